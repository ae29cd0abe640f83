"""`kvprof replay`'s result (replay.json): the dense run and each policy's run, their summaries, how the replay ran.

Typed: the per-turn records (`TurnRecord`, with their per-layer errors, corrected spans and timed runs). Kept as
JSON: per-layer means, errors by hop, per-trajectory TTFT; a policy's `published` figures; `online` (label →
accuracy, correct, tasks, diverged_turns, exact: trajectory id → answered exactly, absent from older files); timing
and span-matching settings, layer kinds, CPU, GPU
memory, memory verdicts, self-check errors, `distributed`.

Deviations from the file as written:

- a run's summary may be missing (simulate's fixture tests/data/simulate/replay.json); the report refuses it;
- fields older files lack read as None and are left out when written again; nullable ones (`gpu_memory`,
  `self_check`) are written as null.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar, overload

from kvprof.errors import KvprofError
from kvprof.results.base import (
    NUMBER,
    OPTIONAL,
    Record,
    ResultFile,
    json_field,
    record_reader,
    records_by_label,
    records_in_list,
)

# In `ReplayResult.lora_attention` when the low-rank views were expanded by `kvprof.kernels.expansion`'s C kernel,
# and a replay checkpoint's expansion path (`kvprof.kernels.expansion.expansion_path`).
FUSED_EXPANSION = "kvprof's fused CPU kernel"
# In `ReplayResult.lora_attention` when forwards where it pays attended the rank-r values as stored (`--lora-attention
# auto` on CPU: `kvprof.kernels.attention.values_as_stored_pay`).
STORED_IN_SHORT_FORWARDS = "short forwards: rank-r values as stored (flash-lora-attention, torch)"
FIX = "pass the replay.json a `kvprof replay` run wrote, unchanged (or rerun `kvprof replay`)"
MAYBE_NUMBER = (*NUMBER, OPTIONAL)
T = TypeVar("T")


@dataclasses.dataclass(kw_only=True)
class LayerError(Record):
    """One layer's error of a turn's reused K and V against the dense turn: relative Frobenius error and mean
    per-token cosine (`kvprof.replay.metrics`)."""

    k_error: float = json_field(NUMBER)
    k_cosine: float = json_field(NUMBER)
    v_error: float = json_field(NUMBER)
    v_cosine: float = json_field(NUMBER)


@dataclasses.dataclass(kw_only=True)
class CorrectedSpan(Record):
    """A corrected segment's K and V error against the dense turn (mean over layers 1..), its length in tokens and
    its `hop` (1: the producer's first reader, ...)."""

    tokens: int = json_field(int)
    k_error: float = json_field(NUMBER)
    v_error: float = json_field(NUMBER)
    hop: int = json_field(int)


@dataclasses.dataclass(kw_only=True)
class WarmUp(Record):
    """A turn's untimed warm-up run under trajectory timing: TTFT and latency (seconds)."""

    ttft_s: float = json_field(NUMBER)
    latency_s: float = json_field(NUMBER)


@dataclasses.dataclass(kw_only=True)
class TimedRuns(Record):
    """A turn's timed runs under trajectory timing, one value per run: TTFT, decode time, latency (seconds) and the
    CUDA allocator's peak with the weights (bytes; None off CUDA)."""

    ttft_s: list[float] = json_field(list)
    decode_s: list[float] = json_field(list)
    latency_s: list[float] = json_field(list)
    cuda_allocated_bytes: list[int | None] = json_field(list)


@dataclasses.dataclass(kw_only=True)
class TurnRecord(Record):
    """One turn of one run (the dense run or a policy's) against the dense turn, in the order a replay writes it:

    - what the turn is and reused (`kvprof.policies.turns.ReuseCounts`; `from_others`: reused tokens another agent
      processed first), its cost (FLOPs, seconds) and memory (bytes) — `kvprof.replay.records.compare_turn`;
    - its fidelity: mean and summed KL, top-1 and trace agreement over output tokens, per-layer K/V errors of the
      reused tokens, corrected spans;
    - memory as the papers report it (`kvprof.replay.records.paper_memory`), where it sits (trajectory, turn);
    - the dense run's `start` (`kvprof.replay.branches.TurnStart.to_json`), a policy's `moved_recomputed`;
    - under trajectory timing, `warm_up` and `runs`.

    Only agent, tokens, prefilled, FLOPs and where are required: simulate reads hand-trimmed records
    (tests/data/simulate); other fields read as None there and are left out when written again, but
    `cuda_peak_bytes`, None off CUDA, is written as null.
    """

    agent: str = json_field(str)
    input_tokens: int = json_field(int)
    output_tokens: int = json_field(int)
    reused: int | None = json_field(int, absent=True)
    moved: int | None = json_field(int, absent=True)
    extended: int | None = json_field(int, absent=True)
    adapter_made: int | None = json_field(int, absent=True)
    recomputed: int | None = json_field(int, absent=True)
    realigned: int | None = json_field(int, absent=True)
    corrected: int | None = json_field(int, absent=True)
    fallback: int | None = json_field(int, absent=True)
    from_others: int | None = json_field(int, absent=True)
    adapter_free: int | None = json_field(int, absent=True)
    prefilled: float = json_field(NUMBER)
    flops: float = json_field(NUMBER)
    ttft_flops: float = json_field(NUMBER)
    ttft_s: float | None = json_field(NUMBER, absent=True)
    decode_s: float | None = json_field(NUMBER, absent=True)
    decode_steps: int | None = json_field(int, absent=True)
    latency_s: float | None = json_field(NUMBER, absent=True)
    memory_bytes: float | None = json_field(NUMBER, absent=True)
    working_peak_bytes: float | None = json_field(NUMBER, absent=True)
    cuda_peak_bytes: float | None = json_field(MAYBE_NUMBER)
    kl: float | None = json_field(NUMBER, absent=True)
    kl_sum: float | None = json_field(NUMBER, absent=True)
    top1_sum: float | None = json_field(NUMBER, absent=True)
    first_token_match: bool | None = json_field(bool, absent=True)
    trace_agreement_sum: int | None = json_field(int, absent=True)
    layers: list[LayerError] | None = json_field(list, read=records_in_list(LayerError), absent=True)
    corrected_spans: list[CorrectedSpan] | None = json_field(list, read=records_in_list(CorrectedSpan), absent=True)
    kv_block_bytes: float | None = json_field(NUMBER, absent=True)
    kv_blocks: float | None = json_field(NUMBER, absent=True)
    allocator_peak_bytes: float | None = json_field(NUMBER, absent=True)
    trajectory: str = json_field(str)
    turn: int = json_field(int)
    start: dict | None = json_field(dict, absent=True)
    moved_recomputed: int | None = json_field(int, absent=True)
    warm_up: WarmUp | None = json_field(dict, read=record_reader(WarmUp), absent=True)
    runs: TimedRuns | None = json_field(dict, read=record_reader(TimedRuns), absent=True)

    @property
    def steps(self) -> int:
        """Decode steps: `decode_steps`, or the output tokens where a trimmed record lacks it (or holds 0)."""
        return int(self.decode_steps or self.output_tokens)


@dataclasses.dataclass(kw_only=True)
class RunSummary(Record):
    """One run's aggregate over its turns (`summarise`; metrics: docs/metrics.md): tokens, fidelity, reuse,
    recomputation, cost (seconds), memory peaks (bytes), per-layer K and V errors."""

    turns: int = json_field(int)
    input_tokens: int = json_field(int)
    output_tokens: int = json_field(int)
    kl: float = json_field(NUMBER)
    top1: float = json_field(NUMBER)
    first_token_match: float | None = json_field(MAYBE_NUMBER)
    trace_agreement: float = json_field(NUMBER)
    reuse_per_token: float = json_field(NUMBER)
    reuse_per_call: float | None = json_field(MAYBE_NUMBER)
    reuse_per_call_excl_source: float | None = json_field(MAYBE_NUMBER)
    adapter_free_per_token: float = json_field(NUMBER)
    recomputed: int = json_field(NUMBER)
    moved: int | None = json_field(NUMBER, absent=True)
    moved_recomputed: int | None = json_field(NUMBER, absent=True)
    adapter_made: int | None = json_field(NUMBER, absent=True)
    delta_reuse: float | None = json_field(MAYBE_NUMBER)
    error_by_hop: dict = json_field(dict)
    recompute_ratio: float = json_field(NUMBER)
    prefilled: float = json_field(NUMBER)
    flops: float = json_field(NUMBER)
    ttft_flops: float = json_field(NUMBER)
    timing: str = json_field(str)
    ttft_s: float = json_field(NUMBER)
    trajectory_ttft_s: dict = json_field(dict)
    decode_s: float = json_field(NUMBER)
    tpot_s: float | None = json_field(MAYBE_NUMBER)
    decode_tokens_per_s: float | None = json_field(MAYBE_NUMBER)
    latency_s: float = json_field(NUMBER)
    peak_memory_bytes: float = json_field(NUMBER)
    peak_working_bytes: float = json_field(NUMBER)
    cuda_peak_bytes: float | None = json_field(MAYBE_NUMBER)
    allocator_peak_bytes: float | None = json_field(MAYBE_NUMBER)
    allocator_peak_source: str | None = json_field((str, OPTIONAL))
    peak_kv_block_bytes: float = json_field(NUMBER)
    peak_kv_blocks: float = json_field(NUMBER)
    layers: list[dict] = json_field(list)
    k_error: float = json_field(NUMBER)
    v_error: float = json_field(NUMBER)
    tokens_per_s: float | None = json_field(MAYBE_NUMBER)


@dataclasses.dataclass(kw_only=True)
class DenseSummary(RunSummary):
    """The dense run's summary; `timeline`: `timeline_summary` (turns, left, causes, restored, dropped_tokens,
    moved_tokens)."""

    timeline: dict | None = json_field(dict, absent=True)


@dataclasses.dataclass(kw_only=True)
class PolicySummary(RunSummary):
    """A policy's summary with `relative_to_dense` ratios (None where the dense measure is zero or missing)."""

    ttft_speedup: float | None = json_field(MAYBE_NUMBER)
    tpot_speedup: float | None = json_field(MAYBE_NUMBER)
    latency_speedup: float | None = json_field(MAYBE_NUMBER)
    prefill_speedup_implied: float | None = json_field(MAYBE_NUMBER)
    flops_ratio: float | None = json_field(MAYBE_NUMBER)
    ttft_speedup_implied_flops: float | None = json_field(MAYBE_NUMBER)
    harness_efficiency: float | None = json_field(MAYBE_NUMBER)
    memory_ratio: float | None = json_field(MAYBE_NUMBER)
    working_memory_ratio: float | None = json_field(MAYBE_NUMBER)
    allocator_peak_ratio: float | None = json_field(MAYBE_NUMBER)
    kv_block_ratio: float | None = json_field(MAYBE_NUMBER)


@dataclasses.dataclass(kw_only=True)
class DenseRun(Record):
    """The dense (NonShared) run every policy is measured against: its summary and per-turn records."""

    summary: DenseSummary | None = json_field(dict, read=record_reader(DenseSummary), absent=True)
    turns: list[TurnRecord] = json_field(list, read=records_in_list(TurnRecord))


@dataclasses.dataclass(kw_only=True)
class PolicyRun(Record):
    """One policy variant's run (`policy_entry` + numbers): identity, options, published figures, notes, summary,
    turns; `memory_accounting_exact`: analytic memory matched live tensors."""

    name: str | None = json_field(str, absent=True)
    family: str | None = json_field(str, absent=True)
    paper: str | None = json_field(str, absent=True)
    approximate: bool | None = json_field(bool, absent=True)
    modes: list[str] | None = json_field(list, absent=True)
    moves_spans: bool | None = json_field(bool, absent=True)
    options: dict | None = json_field(dict, absent=True)
    published: list[dict] | None = json_field(list, absent=True)
    notes: list[str] | None = json_field(list, absent=True)
    summary: PolicySummary | None = json_field(dict, read=record_reader(PolicySummary), absent=True)
    turns: list[TurnRecord] = json_field(list, read=records_in_list(TurnRecord))
    memory_accounting_exact: bool | None = json_field(bool, absent=True)


@dataclasses.dataclass(kw_only=True)
class ReplayResult(ResultFile):
    """A replay: dense run, policy runs by label, online runs, setting (`run_setting`), memory verdicts, trace and
    source, skipped policies (label → reason), self-check errors (label → error), `distributed`; `kv_budget`: what
    holding the stores within --kv-budget moved (`kvprof.replay.parking.ParkingReport`), absent without one."""

    KIND = "replay"
    FIX = FIX

    dense: DenseRun = json_field(dict, read=record_reader(DenseRun))
    policies: dict[str, PolicyRun] = json_field(dict, read=records_by_label(PolicyRun))
    online: dict[str, dict] | None = json_field(dict, absent=True)
    model: str | None = json_field(str, absent=True)
    mode: str | None = json_field(str, absent=True)
    repeats: int | None = json_field(int, absent=True)
    timing: dict | None = json_field(dict, absent=True)
    page_size: int | None = json_field(int, absent=True)
    span_matching: dict | None = json_field(dict, absent=True)
    checkpoint_rule: dict | None = json_field((dict, OPTIONAL), absent=True)
    weights_bytes: int | None = json_field(int, absent=True)
    layers: list[dict] | None = json_field(list, absent=True)
    lora_attention: str | None = json_field(str, absent=True)
    device: str | None = json_field(str, absent=True)
    cpu: dict | None = json_field(dict, absent=True)
    dtype: str | None = json_field(str, absent=True)
    gpu_memory: dict | None = json_field((dict, OPTIONAL))
    kv_budget: dict | None = json_field(dict, absent=True)
    memory_claims: list[dict] | None = json_field(list, absent=True)
    distributed: dict | None = json_field(dict, absent=True)
    trace: str | None = json_field(str, absent=True)
    trace_source: str | None = json_field(str, absent=True)
    skipped: dict[str, str] | None = json_field(dict, absent=True)
    self_check: dict[str, float] | None = json_field((dict, OPTIONAL))


@overload
def summary_of(label: str, run: DenseRun) -> DenseSummary: ...


@overload
def summary_of(label: str, run: PolicyRun) -> PolicySummary: ...


def summary_of(label: str, run: DenseRun | PolicyRun) -> RunSummary:
    """The summary of the run `label`, refused when the result lacks it (simulate's fixtures keep turns alone)."""
    if run.summary is None:
        raise KvprofError(f"the replay result has no summary of the {label} run; {FIX}.")
    return run.summary


def measured(value: T | None) -> T:
    """A `TurnRecord` field every record a replay writes holds, refused where a trimmed record lacks it."""
    if value is None:
        raise KvprofError(f"a turn record lacks a measure this reads; {FIX}.")
    return value
