"""The papers' figures as data: `Published` (a figure, for side-by-side reading), and the ratios replay and
simulate give verdicts on (`MemoryClaim`, `ServingClaim`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryClaim:
    """A published memory figure: the policy's peak `measure` over each reference run's, claimed in [low, high]
    (verdicts: `kvprof.claims.memory`).

    measure: "allocator" (peak with the weights over a trajectory, as PReCache reads `max_memory_allocated`;
    `allocator_peak_bytes`) or "kv_blocks" (stored caches in --page-size blocks, as vLLM; `peak_kv_block_bytes`).
    references: policy names ("nonshared": dense), run with `reference_options`; context_tokens: the setting's
    longest context (shorter traces are not comparable: the weights push ratios towards 1); agents: the setting's
    count (0: any); reading: how [low, high] reads the words, "paper text" (a bound) or "kvprof" (a word like "≈")."""

    measure: str
    references: tuple[str, ...]
    low: float
    high: float
    reading: str
    context_tokens: int = 0
    agents: int = 0
    reference_options: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ServingClaim:
    """A published serving figure: the policy's `measure` over each reference's at the claim's setting, claimed in
    [low, high]; verdicts from `kvprof simulate`, stated as simulated (`kvprof.claims.serving`).

    measure: "ttft_p50", "request_throughput" (reference's median end-to-end latency over the policy's: same
    outputs) or "out_of_memory" (1 / 0, no reference). references with `reference_options`; policy_options: the
    claimed variant; shared_tokens: the setting's shared context (simulation scaled to it by --shapes within 10 %);
    qps: its load (None: the lowest simulated, the paper's "unsaturated"); kv_bytes_per_token: for a memory-bound
    claim (a model more than 2× off is not comparable; 0: any); reading: how [low, high] reads the words, and whose."""

    measure: str
    low: float
    high: float
    reading: str
    references: tuple[str, ...] = ()
    shared_tokens: int = 0
    qps: float | None = None
    reference_options: tuple[tuple[str, str], ...] = ()
    policy_options: tuple[tuple[str, str], ...] = ()
    kv_bytes_per_token: int = 0


@dataclass(frozen=True)
class Published:
    """A figure the paper reports (`paper`, `where`, `setting`, `claim`), printed beside kvprof's measurement;
    `memory` / `serving`: the ratio it claims, which each replay / simulation gives a verdict."""

    paper: str
    where: str
    setting: str
    claim: str
    memory: MemoryClaim | None = None
    serving: ServingClaim | None = None

    def __str__(self) -> str:
        return f"{self.paper}, {self.where} ({self.setting}): {self.claim}"
