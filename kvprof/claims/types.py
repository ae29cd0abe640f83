"""The papers' figures as data: `Published` (a figure, for side-by-side reading), and the ratios replay and
simulate give verdicts on (`MemoryClaim`, `ServingClaim`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryClaim:
    """A published memory figure as a ratio a replay measures (`kvprof.claims.memory` gives it a verdict): the
    claiming policy's peak `measure` over each reference run's, claimed within [low, high].

    measure: "allocator" (the allocator's peak with the weights over a trajectory, as PReCache reads
    `torch.cuda.max_memory_allocated`; the summary's `allocator_peak_bytes`) or "kv_blocks" (the stored caches in
    KV blocks of --page-size tokens, as vLLM holds them; `peak_kv_block_bytes`). references: the policy names the
    ratio is taken against ("nonshared": the dense run). context_tokens: the longest context of the claim's setting
    (a trace whose longest turn is shorter is not comparable: with the weights counted, short contexts push every
    ratio towards 1); agents: the setting's number of agents (0: any); reference_options: option values the
    references ran with in the setting (key, value). reading: how [low, high] reads the claim's words, labelled
    with whose reading it is ("paper text" where the paper gives the bound, "kvprof" where it gives a word such
    as "≈").
    """

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
    """A published serving figure as a ratio `kvprof simulate` gives a verdict, stated as simulated
    (`kvprof.claims.serving`): the claiming policy's `measure` over each reference run's at the claim's setting,
    claimed within [low, high].

    measure: "ttft_p50" (median TTFT), "request_throughput" (per-request throughput, read as the reference's median
    end-to-end latency over the policy's: both serve the same outputs) or "out_of_memory" (1 when the policy runs out
    of memory, 0 when not; no reference). references: the policy names the ratio is taken against ("nonshared": the
    dense run), with `reference_options` (key, value) they ran with in the setting; policy_options: the claiming
    policy's option values the claim is about (a variant). shared_tokens: the setting's shared context (the
    simulation must have been scaled to it with --shapes, within 10 %); qps: the setting's load (None: the lowest
    simulated load, read as the paper's "unsaturated"); kv_bytes_per_token: for a memory-bound claim, the setting's
    model's (a simulated model more than 2× off is not comparable; 0: any). reading: how [low, high] reads the
    claim's words, labelled with whose reading it is.
    """

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
    """A figure the method's paper reports, for side-by-side reading with kvprof's measurement.

    paper: short citation; where: section / table / figure; setting: models, data, hardware; claim: the figure;
    memory: for a memory figure, the ratio it claims (`MemoryClaim`), which each replay gives a verdict;
    serving: for a serving figure, the ratio it claims (`ServingClaim`), which each simulation gives a verdict.
    """

    paper: str
    where: str
    setting: str
    claim: str
    memory: MemoryClaim | None = None
    serving: ServingClaim | None = None

    def __str__(self) -> str:
        return f"{self.paper}, {self.where} ({self.setting}): {self.claim}"
