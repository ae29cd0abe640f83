"""The replay engine: a trace turn by turn under sharing policies, measured against the dense (NonShared) run.

Teacher-forced (`replay_trace`): the dense run and every policy in lockstep, each dense turn computed once, compared,
released. Online (`replay_online`): the workflow re-run under each policy, errors propagating. Metrics:
`kvprof.replay.metrics`, docs/metrics.md.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from kvprof.capture.workflow import SearchTool, exact_match, require_react_agents, run_react
from kvprof.claims.memory import memory_verdicts
from kvprof.errors import KvprofError
from kvprof.kernels.attention import EXPAND, KERNEL, SHORT, LoraAttention
from kvprof.kernels.expansion import kernel_runs
from kvprof.kernels.transformers_attention import stored_value_calls
from kvprof.model.agents import AgentSet, trace_header
from kvprof.model.layers import LayerKind
from kvprof.model.recurrent import RECURRENT_STATES
from kvprof.model.runtime import Runtime
from kvprof.policies import PolicyVariant, SharingPolicy, TurnRequest, TurnResult
from kvprof.policies.base import tensor_bytes
from kvprof.policies.nonshared import NonShared
from kvprof.profiling import cpu_description, gpu_memory, keep_freed_memory
from kvprof.replay.branches import BranchingTimeline, FollowedTimeline, TurnStart, plan_of, require_one_timeline
from kvprof.replay.metrics import (
    kl_divergence,
    mean_token_cosine,
    relative_frobenius,
    reused_from_others,
    top1_agreement,
)
from kvprof.results.replay import (
    FUSED_EXPANSION,
    STORED_IN_SHORT_FORWARDS,
    CorrectedSpan,
    DenseRun,
    DenseSummary,
    LayerError,
    PolicyRun,
    PolicySummary,
    ReplayResult,
    RunSummary,
    TimedRuns,
    TurnRecord,
    WarmUp,
    measured,
)
from kvprof.threads import LoadMeter, MachineLoad
from kvprof.traces.reuse import DEFAULT_MATCHING, SpanMatching, last_occurrence, message_boundaries
from kvprof.traces.tasks import Task, task_of
from kvprof.traces.trace import Trajectory, Turn, iter_trajectories, read_header

DENSE = "dense"
PAGE_SIZE = 16  # tokens per KV block: vLLM's default block size, as PReCache's serving runs read memory
# stored structures that are not token-indexed caches, by name or name prefix: counted at their exact bytes
UNPAGED = ("anchor pool", RECURRENT_STATES)
TIMINGS = ("turn", "trajectory")
"""`replay_trace`'s timing modes: per-turn medians (kvprof) or PReCache's trajectory timing (code)."""


class PaperMemory(NamedTuple):
    """One turn's memory as the papers report it (`paper_memory`): bytes in KV blocks, full K/V blocks, allocator
    peak with the weights."""

    kv_block_bytes: int
    kv_blocks: float
    allocator_peak_bytes: int


def compare_turn(
    result: TurnResult,
    dense: TurnResult,
    from_others: int,
    trace_outputs: list[int],
    kinds: list[LayerKind] | None = None,
    *,
    trajectory: str,
    turn: int,
    memory: PaperMemory | None = None,
    start: dict | None = None,
    moved_recomputed: int | None = None,
) -> TurnRecord:
    """The record of one policy turn against the dense turn of the same call (teacher-forced on `trace_outputs`),
    turn `turn` of `trajectory`. `from_others`: reused tokens another agent processed first. In a window layer
    (`kinds`) the K/V error counts only the reused tokens the computed ones can attend (`LayerKind.first_attended`).
    `memory`, `start` (the dense run's), `moved_recomputed` (a policy's): recorded as given."""
    kl = kl_divergence(dense.logits, result.logits)
    predicted = result.logits.argmax(-1).tolist()
    return TurnRecord(
        agent=result.agent,
        input_tokens=result.input_kv[0][0].shape[1],
        output_tokens=len(result.output_ids),
        reused=result.reused,
        moved=result.moved,
        extended=result.extended,
        adapter_made=result.adapter_made,
        recomputed=result.recomputed,
        realigned=result.realigned,
        corrected=result.corrected,
        fallback=result.fallback,
        from_others=from_others,
        adapter_free=result.adapter_free,
        prefilled=result.prefilled,
        flops=result.flops,
        ttft_flops=result.ttft_flops,
        ttft_s=result.ttft_s,
        decode_s=result.decode_s,
        decode_steps=result.decode_steps,
        latency_s=result.latency_s,
        memory_bytes=sum(result.memory.values()),
        working_peak_bytes=max(result.stored_before_bytes + result.transient_bytes, sum(result.memory.values())),
        cuda_peak_bytes=result.cuda_peak_bytes,
        kl=float(kl.mean()) if len(kl) else 0.0,
        kl_sum=float(kl.sum()),
        top1_sum=float(top1_agreement(dense.logits, result.logits).sum()),
        first_token_match=bool(dense.logits[0].argmax() == result.logits[0].argmax()) if len(kl) else True,
        trace_agreement_sum=sum(a == b for a, b in zip(predicted, trace_outputs)),
        layers=layer_errors(result, dense, kinds),
        corrected_spans=[span_error(result, dense, start, end, hop) for start, end, hop in result.corrected_spans],
        **(memory._asdict() if memory else {}),
        trajectory=trajectory,
        turn=turn,
        start=start,
        moved_recomputed=moved_recomputed,
    )


def layer_errors(result: TurnResult, dense: TurnResult, kinds: list[LayerKind] | None) -> list[LayerError]:
    """Per layer, the error of `result`'s reused K and V (its prefix-matched and moved spans) against the dense
    turn's; in a window layer (`kinds`) only the reused tokens the computed ones can attend. None reused: empty."""
    layers: list[LayerError] = []
    spans = [(0, result.reused)] * bool(result.reused) + result.moved_spans
    if spans:
        device = result.input_kv[0][0].device
        reused = torch.cat(
            [torch.arange(result.prefix_len + a, result.prefix_len + b, device=device) for a, b in spans]
        )
        first_computed = result.prefix_len + result.reused
        for layer, ((keys, values), (dense_keys, dense_values)) in enumerate(zip(result.input_kv, dense.input_kv)):
            where = reused if kinds is None else reused[reused >= kinds[layer].first_attended(first_computed)]
            keys, values = keys[:, where], values[:, where]
            dense_keys, dense_values = dense_keys[:, where], dense_values[:, where]
            layers.append(
                LayerError(
                    k_error=relative_frobenius(keys, dense_keys),
                    k_cosine=mean_token_cosine(keys, dense_keys),
                    v_error=relative_frobenius(values, dense_values),
                    v_cosine=mean_token_cosine(values, dense_values),
                )
            )
    return layers


def span_error(result: TurnResult, dense: TurnResult, start: int, end: int, hop: int) -> CorrectedSpan:
    """Relative Frobenius error of K and V on timeline tokens [start, end) (corrected at `hop`) against the dense
    turn, mean over layers 1.. (the delta policies leave layer 0 uncorrected)."""
    begin, stop = result.prefix_len + start, result.prefix_len + end
    rows = [
        (
            relative_frobenius(k[:, begin:stop], dk[:, begin:stop]),
            relative_frobenius(v[:, begin:stop], dv[:, begin:stop]),
        )
        for (k, v), (dk, dv) in list(zip(result.input_kv, dense.input_kv))[1:]
    ]
    return CorrectedSpan(
        tokens=end - start,
        k_error=statistics.fmean(row[0] for row in rows) if rows else 0.0,
        v_error=statistics.fmean(row[1] for row in rows) if rows else 0.0,
        hop=hop,
    )


def error_by_hop(turns: list[TurnRecord]) -> dict[str, dict]:
    """Mean K/V error of corrected segments by hop (1: the producer's first reader, ...)."""
    spans: dict[int, list[CorrectedSpan]] = {}
    for turn in turns:
        for span in turn.corrected_spans or []:
            spans.setdefault(span.hop, []).append(span)
    return {
        str(hop): {
            "segments": len(rows),
            "k_error": statistics.fmean(r.k_error for r in rows),
            "v_error": statistics.fmean(r.v_error for r in rows),
        }
        for hop, rows in sorted(spans.items())
    }


def weights_bytes(model) -> int:
    """Bytes of every parameter and buffer of `model` (base + all adapters) as stored: what
    `torch.cuda.max_memory_allocated` counts besides caches. A bitsandbytes 4-bit weight counts its packed bytes
    and its quantization state."""
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        total += tensor.numel() * tensor.element_size()
        state = getattr(tensor, "quant_state", None)
        if state is not None:
            total += sum(t.numel() * t.element_size() for t in state.as_dict().values() if isinstance(t, torch.Tensor))
    return total


def paged_bytes(tensors: dict[str, list], page_size: int) -> int:
    """Bytes of `tensors` (a policy's `live_tensors`) in KV blocks of `page_size` tokens, as vLLM holds them: the
    token axis (−2: K/V (B, H_kv, T, D), LR caches (1, T, r), hidden states (1, T, d_model)) rounded up to whole
    blocks; `UNPAGED` structures at their exact bytes."""
    total = 0
    for name, group in tensors.items():
        for t in group:
            exact = t.numel() * t.element_size()
            tokens = t.shape[-2] if t.dim() >= 2 and not name.startswith(UNPAGED) else 0
            total += exact * math.ceil(tokens / page_size) * page_size // tokens if tokens else exact
    return total


def paper_memory(policy: SharingPolicy, result: TurnResult, weights: int, page_size: int) -> PaperMemory:
    """One turn's memory as the papers report it: `kv_block_bytes` (stored caches in `page_size` blocks,
    `paged_bytes`), `kv_blocks` (those bytes in full K/V blocks: vLLM's count for full-dimension caches, a fraction
    for rank-r ones), `allocator_peak_bytes` (CUDA: weights + the peak above the turn's start + stored bytes, as if
    the policy ran alone; else the analytic weights + working peak)."""
    paged = paged_bytes(policy.stored_tensors(), page_size)
    working = max(result.stored_before_bytes + result.transient_bytes, sum(result.memory.values()))
    peak = result.cuda_peak_bytes if result.cuda_peak_bytes is not None else working
    return PaperMemory(paged, paged / (page_size * policy.runtime.kv_bytes_per_token), weights + peak)


def allocator_peak(turns: list[TurnRecord]) -> tuple[float | None, str | None]:
    """A policy's allocator peak with the weights, and its source: with trajectory timing on CUDA,
    `max_memory_allocated` over each timed run, the policy alone (PReCache's reading); else per turn
    (`paper_memory`)."""
    if not turns or turns[0].allocator_peak_bytes is None:
        return None, None
    alone = [b for t in turns if t.runs for b in t.runs.cuda_allocated_bytes if b is not None]
    if alone:
        return max(alone), "cuda: max_memory_allocated over each timed trajectory run, the policy alone"
    source = (
        "cuda: weights + the allocator's peak above each turn's start + the policy's stored bytes"
        if turns[0].cuda_peak_bytes is not None
        else "analytic (no CUDA): weights + the peak of stored + working bytes"
    )
    return max(measured(t.allocator_peak_bytes) for t in turns), source


def summarise(turns: list[TurnRecord]) -> RunSummary:
    """Aggregate per-turn records of one policy (token-weighted fidelity, summed cost, per-layer mean error)."""
    outputs = sum(t.output_tokens for t in turns)
    inputs = sum(t.input_tokens for t in turns)
    reusable = [t for t in turns if t.reused or t.moved]
    layer_count = max((len(measured(t.layers)) for t in turns), default=0)
    per_layer = []
    for layer in range(layer_count):
        rows = [measured(t.layers)[layer].to_json() for t in reusable]
        per_layer.append({key: statistics.fmean(r[key] for r in rows) for key in rows[0]})
    timed = trajectory_timed(turns)
    decode_s = sum(row["decode_s"] for row in timed)
    decode_steps = sum(measured(t.decode_steps) for t in turns)
    cuda_peaks = [t.cuda_peak_bytes for t in turns if t.cuda_peak_bytes is not None]
    allocator_bytes, allocator_source = allocator_peak(turns)
    latency_s = sum(row["latency_s"] for row in timed)
    return RunSummary(
        turns=len(turns),
        input_tokens=inputs,
        output_tokens=outputs,
        kl=sum(measured(t.kl_sum) for t in turns) / max(outputs, 1),
        top1=sum(measured(t.top1_sum) for t in turns) / max(outputs, 1),
        first_token_match=statistics.fmean(measured(t.first_token_match) for t in turns) if turns else None,
        trace_agreement=sum(measured(t.trace_agreement_sum) for t in turns) / max(outputs, 1),
        reuse_per_token=sum(measured(t.from_others) for t in turns) / max(inputs, 1),
        reuse_per_call=statistics.fmean(measured(t.from_others) > 0 for t in turns) if turns else None,
        reuse_per_call_excl_source=(
            statistics.fmean(measured(t.from_others) > 0 for t in reusable) if reusable else None
        ),
        adapter_free_per_token=sum(measured(t.adapter_free) for t in turns) / max(inputs, 1),
        recomputed=sum(measured(t.recomputed) for t in turns),
        moved=sum(t.moved or 0 for t in turns),
        moved_recomputed=sum(t.moved_recomputed or 0 for t in turns),
        adapter_made=sum(t.adapter_made or 0 for t in turns),
        delta_reuse=delta_reuse(turns),
        error_by_hop=error_by_hop(turns),
        recompute_ratio=(
            sum(measured(t.recomputed) for t in reusable)
            / sum((measured(t.reused) + (t.extended or 0)) * len(measured(t.layers)) for t in reusable)
            if reusable
            else 0.0
        ),
        prefilled=sum(t.prefilled for t in turns),
        flops=sum(t.flops for t in turns),
        ttft_flops=sum(t.ttft_flops for t in turns),
        timing="trajectory" if turns and turns[0].runs is not None else "turn",
        ttft_s=sum(row["ttft_s"] for row in timed),
        trajectory_ttft_s=trajectory_sums(turns, [row["ttft_s"] for row in timed]),
        decode_s=decode_s,
        tpot_s=decode_s / decode_steps if decode_steps else None,
        decode_tokens_per_s=decode_steps / decode_s if decode_s else None,
        latency_s=latency_s,
        peak_memory_bytes=max((measured(t.memory_bytes) for t in turns), default=0),
        peak_working_bytes=max((measured(t.working_peak_bytes) for t in turns), default=0),
        cuda_peak_bytes=max(cuda_peaks) if cuda_peaks else None,
        allocator_peak_bytes=allocator_bytes,
        allocator_peak_source=allocator_source,
        peak_kv_block_bytes=max((t.kv_block_bytes or 0 for t in turns), default=0),
        peak_kv_blocks=max((t.kv_blocks or 0.0 for t in turns), default=0.0),
        layers=per_layer,
        k_error=statistics.fmean(layer["k_error"] for layer in per_layer) if per_layer else 0.0,
        v_error=statistics.fmean(layer["v_error"] for layer in per_layer) if per_layer else 0.0,
        tokens_per_s=outputs / latency_s if latency_s else None,
    )


def trajectory_timed(turns: list[TurnRecord]) -> list[dict[str, float]]:
    """Each turn's TTFT, decode time and latency: with trajectory timing (`runs`), the mean over the timed runs
    (warm-up excluded); else the turn's own median."""
    return [
        (
            {
                "ttft_s": statistics.fmean(t.runs.ttft_s),
                "decode_s": statistics.fmean(t.runs.decode_s),
                "latency_s": statistics.fmean(t.runs.latency_s),
            }
            if t.runs is not None
            else {"ttft_s": measured(t.ttft_s), "decode_s": measured(t.decode_s), "latency_s": measured(t.latency_s)}
        )
        for t in turns
    ]


def trajectory_sums(turns: list[TurnRecord], values: list[float]) -> dict[str, float]:
    """`values` (one per turn) summed per trajectory id, in replay order."""
    sums: dict[str, float] = {}
    for turn, value in zip(turns, values):
        key = str(turn.trajectory)
        sums[key] = sums.get(key, 0.0) + value
    return sums


def delta_reuse(turns: list[TurnRecord]) -> float | None:
    """ρ of a delta policy: the share of gated tokens from others' segments served corrected (None: no gate)."""
    corrected = sum(t.corrected or 0 for t in turns)
    decided = corrected + sum(t.fallback or 0 for t in turns)
    return corrected / decided if decided else None


def relative_to_dense(summary: RunSummary, dense: RunSummary) -> dict:
    """Speed-ups and memory ratios against the dense run measured in the same replay."""

    def ratio(numerator, denominator):
        return numerator / denominator if numerator is not None and denominator else None

    return {
        "ttft_speedup": ratio(dense.ttft_s, summary.ttft_s),
        "tpot_speedup": ratio(dense.tpot_s, summary.tpot_s),
        "latency_speedup": ratio(dense.latency_s, summary.latency_s),
        "prefill_speedup_implied": ratio(dense.prefilled, summary.prefilled),
        "flops_ratio": ratio(summary.flops, dense.flops),
        "ttft_speedup_implied_flops": ratio(dense.ttft_flops, summary.ttft_flops),
        "harness_efficiency": ratio(ratio(dense.ttft_s, summary.ttft_s), ratio(dense.ttft_flops, summary.ttft_flops)),
        "memory_ratio": ratio(summary.peak_memory_bytes, dense.peak_memory_bytes),
        "working_memory_ratio": ratio(summary.peak_working_bytes, dense.peak_working_bytes),
        "allocator_peak_ratio": ratio(summary.allocator_peak_bytes, dense.allocator_peak_bytes),
        "kv_block_ratio": ratio(summary.peak_kv_block_bytes, dense.peak_kv_block_bytes),
    }


def require_invocations(runtime: Runtime, trajectories: Iterable[Trajectory]) -> None:
    """Refuse a trace whose Activated LoRA call lacks its invocation ids (peft would run it on the base model)."""
    for traj in trajectories:
        for index, turn in enumerate(traj.turns):
            tokens = runtime.invocations.get(turn.agent)
            if tokens is not None and last_occurrence(traj.input_tokens(turn), tokens) is None:
                raise KvprofError(
                    f"trajectory {traj.id!r} turn {index} ({turn.agent}): the input lacks the invocation ids "
                    f"{tokens} of {turn.agent}'s Activated LoRA, so its adapter would never act; capture the trace "
                    "with these adapters (their invocation is then in every call), or give the agent another adapter."
                )


def build_policies(runtime: Runtime, variants: Iterable[PolicyVariant]) -> list[SharingPolicy]:
    return [variant.build(runtime) for variant in variants]


def policy_entry(policy: SharingPolicy) -> dict:
    """A policy's identity, options and published figures, as a result records them."""
    return {
        "name": policy.name,
        "family": policy.family,
        "paper": policy.paper,
        "approximate": policy.approximate,
        "modes": list(policy.modes),
        "moves_spans": policy.moves_spans,
        "options": dict(policy.values),
        "published": [asdict(figure) | {"text": str(figure)} for figure in policy.published],
        "notes": policy.notes(),
    }


TurnHook = Callable[[Trajectory, int], None]


@dataclass
class ReplayProgress:
    """Per-turn records of the trajectories replayed so far: a resumable checkpoint."""

    trajectories: list[str] = field(default_factory=list)
    records: dict[str, list[TurnRecord]] = field(default_factory=dict)
    memory_exact: dict[str, bool] = field(default_factory=dict)

    @classmethod
    def of_checkpoint(cls, progress: object, checkpoint: Path) -> ReplayProgress:
        """The progress a checkpoint records (`to_json`), refused in one sentence naming `checkpoint` if it is not
        one."""
        kinds = {"trajectories": list, "records": dict, "memory_exact": dict}
        fix = "delete it to start again"
        if (
            not isinstance(progress, dict)
            or set(progress) != set(kinds)
            or not all(isinstance(progress[key], kind) for key, kind in kinds.items())
            or not all(isinstance(traj_id, str) for traj_id in progress["trajectories"])
            or not all(isinstance(records, list) for records in progress["records"].values())
        ):
            raise KvprofError(f"checkpoint {checkpoint} is not a replay checkpoint of this kvprof version; {fix}.")
        records = {
            label: [
                TurnRecord.from_json(record, f"checkpoint {checkpoint}, {label} turn {index}", fix)
                for index, record in enumerate(turns)
            ]
            for label, turns in progress["records"].items()
        }
        return cls(progress["trajectories"], records, progress["memory_exact"])

    def to_json(self) -> dict:
        """The progress as a checkpoint records it."""
        return {
            "trajectories": list(self.trajectories),
            "records": {label: [record.to_json() for record in records] for label, records in self.records.items()},
            "memory_exact": dict(self.memory_exact),
        }


@dataclass
class Lockstep:
    """The dense run and every policy over a trajectory's turns side by side; `state` keeps each turn's records.
    `per_turn`: timed prefills per turn; `check_memory`: analytic memory checked against live tensors; `kinds`:
    each layer's kind (its window limits what the K/V error counts)."""

    runtime: Runtime
    dense: NonShared
    policies: list[SharingPolicy]
    state: ReplayProgress
    kinds: list[LayerKind]
    per_turn: int
    weights: int
    page_size: int
    check_memory: bool

    def replay(self, traj: Trajectory, on_turn: TurnHook | None) -> None:
        """Every turn of `traj` under the dense run and every policy, from empty caches."""
        self.runtime.serve_trajectory(traj)
        for run in [self.dense, *self.policies]:
            run.reset()
        timeline = BranchingTimeline(
            plan_of(traj, self.runtime.prefixes, self.runtime.span_matching), [self.dense, *self.policies]
        )
        for index, turn in enumerate(traj.turns):
            self.turn(traj, index, turn, timeline)
            if on_turn:
                on_turn(traj, index)

    def turn(self, traj: Trajectory, index: int, turn: Turn, timeline: BranchingTimeline) -> None:
        """One turn: the dense run's record, then each policy's against it."""
        outputs = traj.output_tokens(turn)
        start = timeline.begin(index)
        request = TurnRequest(
            turn.agent, traj.input_tokens(turn), outputs, moved=start.moved, boundaries=message_boundaries(traj, turn)
        )
        timed = interleaved_prefills([self.dense, *self.policies], request, self.per_turn)
        dense_result = self.dense.run_turn(request, self.per_turn, timed[0])
        self.state.records[DENSE].append(
            compare_turn(
                dense_result,
                dense_result,
                0,
                outputs,
                self.kinds,
                trajectory=traj.id,
                turn=index,
                memory=paper_memory(self.dense, dense_result, self.weights, self.page_size),
                start=start.to_json(),
            )
        )
        for policy, earlier in zip(self.policies, timed[1:]):
            turn_result = policy.run_turn(request, self.per_turn, earlier)
            from_others = turn_result.from_others
            if from_others is None:
                from_others = (
                    reused_from_others(timeline.producers, turn.agent, turn_result.reused)
                    if policy.serves_others
                    else 0
                ) + moved_from_others(traj, start, turn_result, turn.agent)
            self.state.records[policy.label].append(
                compare_turn(
                    turn_result,
                    dense_result,
                    from_others,
                    outputs,
                    self.kinds,
                    trajectory=traj.id,
                    turn=index,
                    memory=paper_memory(policy, turn_result, self.weights, self.page_size),
                    moved_recomputed=start.moved_tokens - turn_result.moved,
                )
            )
            if self.check_memory:
                exact = tensor_bytes(policy.live_tensors()) == policy.analytic_bytes()
                self.state.memory_exact[policy.label] = self.state.memory_exact.get(policy.label, True) and exact
        shared_len = len(request.input_ids) - len(self.runtime.prefix(turn.agent))
        timeline.end(index, turn.agent, shared_len + len(outputs))


def interleaved_prefills(runs: list[SharingPolicy], request: TurnRequest, repeats: int) -> list[list[float] | None]:
    """With `repeats` > 1, each run's first `repeats` − 1 timed prefills of `request`, timed round-robin across
    `runs` after one untimed round; each run's `run_turn` times the last, in the same order. So a drift of the
    machine's speed during the turn reaches every run alike. Else None per run (each times its own)."""
    if repeats <= 1:
        return [None] * len(runs)
    timings: list[list[float]] = [[] for _ in runs]
    for round_index in range(repeats):
        for run, seconds in zip(runs, timings):
            measured = run.time_prefill(request)
            if round_index:
                seconds.append(measured)
    return list(timings)


def replay_trace(
    agents: AgentSet,
    trajectories: Iterable[Trajectory],
    variants: list[PolicyVariant],
    repeats: int = 1,
    on_turn: TurnHook | None = None,
    check_memory: bool = False,
    progress: ReplayProgress | None = None,
    on_trajectory: Callable[[ReplayProgress], object] | None = None,
    lora_attention: LoraAttention = EXPAND,
    timing: str = "turn",
    page_size: int = PAGE_SIZE,
    span_matching: SpanMatching = DEFAULT_MATCHING,
) -> dict:
    """Teacher-forced lockstep replay. Returns {"dense": ..., "policies": {label: ...}}.

    - `timing` "turn" (kvprof): TTFT the median of `repeats` prefills timed round-robin across the dense run and the
      policies after a warm-up round (`interleaved_prefills`); "trajectory"
      (PReCache's `bench/single_stream.py`): after the lockstep pass, each run replays each trajectory alone
      (`time_trajectory`) and summaries take the mean over its runs.
    - Memory as the papers report it per turn: `paper_memory`.
    - Turns that leave the shared context: `kvprof.replay.branches`; the dense records say where and why.
    - `progress`: trajectories already replayed are skipped; stateful variants replay them again unrecorded
      (`rebuild_state`).
    - `lora_attention`: how low-rank policies attend their rank-r values (`Runtime`); `span_matching`:
      `SpanMatching`.
    """
    trajectories = list(trajectories)
    runtime = Runtime(agents, lora_attention, span_matching=span_matching)
    require_invocations(runtime, trajectories)
    if runtime.device.type == "cpu":
        keep_freed_memory()
    dense = NonShared(runtime)
    policies = build_policies(runtime, variants)
    state = progress or ReplayProgress()
    for label in [DENSE] + [policy.label for policy in policies]:
        state.records.setdefault(label, [])
    if timing not in TIMINGS:
        raise ValueError(f"timing {timing!r} is not one of {TIMINGS}")
    per_turn = repeats if timing == "turn" else 1
    weights = weights_bytes(agents.model)
    timers = (
        {DENSE: NonShared(runtime), **{p.label: v.build(runtime) for p, v in zip(policies, variants)}}
        if timing == "trajectory"
        else {}
    )
    stateful = [policy for policy, variant in zip(policies, variants) if not variant.trajectory_independent]
    done = [traj for traj in trajectories if traj.id in state.trajectories]
    rebuild_state(runtime, stateful, done)
    stateful_timers = [timers[v.label] for v in variants if not v.trajectory_independent and v.label in timers]
    rebuild_state(runtime, stateful_timers, done, passes=repeats + 1)
    lockstep = Lockstep(runtime, dense, policies, state, agents.layer_kinds, per_turn, weights, page_size, check_memory)
    for traj in trajectories:
        if traj.id in state.trajectories:
            continue
        lockstep.replay(traj, on_turn)
        if timers:
            for run in [dense, *policies]:
                run.reset()  # the lockstep runs' stored caches are released: each timed run holds only its own
            for label, timer in timers.items():
                records = state.records[label][-len(traj.turns) :]
                for record, (warm_up, runs) in zip(records, time_trajectory(timer, traj, repeats), strict=True):
                    record.warm_up, record.runs = warm_up, runs
        state.trajectories.append(traj.id)
        if on_trajectory:
            on_trajectory(state)
    return replay_result(
        state.records,
        {policy.label: policy_entry(policy) for policy in policies},
        state.memory_exact if check_memory else None,
    )


def moved_from_others(traj: Trajectory, start: TurnStart, result: TurnResult, agent: str) -> int:
    """Moved tokens `result` served from another agent's turn's K/V."""
    served = set(result.moved_spans)
    return sum(
        len(span) for span in start.moved if (span.begin, span.end) in served and traj.turns[span.source].agent != agent
    )


def rebuild_state(
    runtime: Runtime, policies: list[SharingPolicy], trajectories: list[Trajectory], passes: int = 1
) -> None:
    """Replay `trajectories` under stateful `policies` unrecorded, each `passes` times, so a resumed replay reaches
    the state an uninterrupted one would."""
    for traj in trajectories if policies else []:
        runtime.serve_trajectory(traj)
        for _ in range(passes):
            for policy in policies:
                policy.reset()
            run_trajectory(runtime, policies, traj)


def run_trajectory(runtime: Runtime, policies: list[SharingPolicy], traj: Trajectory) -> list[list[TurnResult]]:
    """Every turn of a served `traj` under `policies` in lockstep, once each, following its timeline; per turn,
    each policy's result."""
    timeline = BranchingTimeline(plan_of(traj, runtime.prefixes, runtime.span_matching), policies)
    results = []
    for index, turn in enumerate(traj.turns):
        start = timeline.begin(index)
        request = TurnRequest(
            turn.agent,
            traj.input_tokens(turn),
            traj.output_tokens(turn),
            moved=start.moved,
            boundaries=message_boundaries(traj, turn),
        )
        results.append([policy.run_turn(request) for policy in policies])
        shared_len = len(request.input_ids) - len(runtime.prefix(turn.agent))
        timeline.end(index, turn.agent, shared_len + len(request.output_ids or []))
    return results


def time_trajectory(policy: SharingPolicy, traj: Trajectory, repeats: int) -> list[tuple[WarmUp, TimedRuns]]:
    """Trajectory timing (PReCache's `bench/single_stream.py`): `policy` alone replays `traj` once untimed, then
    `repeats` times, each from an empty store. Per turn: `runs` (TTFT — the synced prefill call: a double-batched
    policy's two rows inside, a lazy prefill's adapter-free pass outside —, decode time, latency, CUDA allocator
    peak with the weights) and `warm_up`."""
    runs = []
    for _ in range(repeats + 1):
        policy.reset()
        runs.append([turn[0] for turn in run_trajectory(policy.runtime, [policy], traj)])
    policy.reset()
    warm_up, timed = runs[0], runs[1:]
    return [
        (
            WarmUp(ttft_s=warm_up[index].ttft_s, latency_s=warm_up[index].latency_s),
            TimedRuns(
                ttft_s=[run[index].ttft_s for run in timed],
                decode_s=[run[index].decode_s for run in timed],
                latency_s=[run[index].latency_s for run in timed],
                cuda_allocated_bytes=[run[index].cuda_allocated_bytes for run in timed],
            ),
        )
        for index in range(len(traj.turns))
    ]


def replay_result(
    records: dict[str, list[TurnRecord]], entries: dict[str, dict], memory_exact: dict | None = None
) -> dict:
    """The teacher-forced result from per-turn records (label → records, dense under `DENSE`) and `policy_entry`s:
    summaries recomputed, each policy's against the dense run; `memory_exact` per policy. Built as
    `kvprof.results.replay` records (an undeclared summary field fails here), returned as JSON."""
    dense_summary = summarise(records[DENSE])
    dense = DenseRun(
        summary=DenseSummary(**asdict(dense_summary), timeline=timeline_summary(records[DENSE])), turns=records[DENSE]
    )
    policies: dict[str, PolicyRun] = {}
    for label, entry in entries.items():
        summary = summarise(records[label])
        policies[label] = PolicyRun(
            **entry,
            summary=PolicySummary(**asdict(summary), **relative_to_dense(summary, dense_summary)),
            turns=records[label],
            memory_accounting_exact=None if memory_exact is None else memory_exact[label],
        )
    return {"dense": dense.to_json(), "policies": {label: run.to_json() for label, run in policies.items()}}


def timeline_summary(dense_turns: list[TurnRecord]) -> dict:
    """Turns that left the shared context (by cause), turns that returned to an earlier state, tokens dropped."""
    starts = [turn.start for turn in dense_turns if turn.start is not None]
    causes = Counter(start["divergence"]["cause"] for start in starts if start["divergence"])
    return {
        "turns": len(starts),
        "left": sum(causes.values()),
        "causes": dict(causes),
        "restored": sum(start["restored_from"] is not None for start in starts),
        "dropped_tokens": sum(start["dropped"] for start in starts),
        "moved_tokens": sum(end - begin for start in starts for begin, end, *_ in start.get("moved", [])),
    }


def policy_responder(policy: SharingPolicy):
    """A responder serving each call of one task with `policy`, greedily; a call leaving the context keeps the
    common prefix (`FollowedTimeline`)."""
    timeline = FollowedTimeline(policy, policy.runtime.span_matching)

    def respond(agent: str, input_ids: list[int], max_new: int) -> list[int]:
        shared = input_ids[len(policy.runtime.prefix(agent)) :]
        moved = timeline.begin(shared)
        request = TurnRequest(
            agent=agent,
            input_ids=input_ids,
            max_new_tokens=max_new,
            moved=moved,
            boundaries=frozenset({len(input_ids)}),
        )
        outputs = policy.run_turn(request).output_ids
        timeline.end(shared + outputs)
        return outputs

    return respond


def run_online(
    agents: AgentSet,
    tasks: list[Task],
    variants: list[PolicyVariant],
    on_task: Callable[[str, Task], None] | None = None,
    lora_attention: LoraAttention = EXPAND,
    span_matching: SpanMatching = DEFAULT_MATCHING,
) -> dict[str, list[Trajectory]]:
    """Re-run the workflow on `tasks` under the dense run ("dense") and each policy; returns trajectories."""
    runtime = Runtime(agents, lora_attention, span_matching=span_matching)
    runs: dict[str, SharingPolicy] = {DENSE: NonShared(runtime)}
    runs.update({policy.label: policy for policy in build_policies(runtime, variants)})
    tool = SearchTool()
    trajectories: dict[str, list[Trajectory]] = {label: [] for label in runs}
    for label, policy in runs.items():
        for task in tasks:
            runtime.serve_task(task)
            policy.reset()
            trajectories[label].append(run_react(agents.spec, agents.tokenizer, task, tool, policy_responder(policy)))
            if on_task:
                on_task(label, task)
    return trajectories


def summarise_online(runs: dict[str, list[Trajectory]]) -> dict[str, dict]:
    """Exact-match accuracy per run, whether each task (by trajectory id) was answered exactly, and the share of
    turns whose output differs from the dense run's."""
    result = {}
    for label, trajectories in runs.items():
        diverged = total = correct = 0
        exact = {}
        for dense_traj, traj in zip(runs[DENSE], trajectories):
            exact[traj.id] = exact_match(traj.prediction, traj.answer)
            correct += exact[traj.id]
            dense_outputs = [dense_traj.output_tokens(turn) for turn in dense_traj.turns]
            outputs = [traj.output_tokens(turn) for turn in traj.turns]
            for index in range(max(len(dense_outputs), len(outputs))):
                total += 1
                diverged += not (
                    index < len(dense_outputs) and index < len(outputs) and dense_outputs[index] == outputs[index]
                )
        result[label] = {
            "accuracy": correct / len(trajectories) if trajectories else None,
            "correct": correct,
            "tasks": len(trajectories),
            "diverged_turns": diverged / max(total, 1),
            "exact": exact,
        }
    return result


@dataclass
class ReplayHooks:
    """`run_replay`'s progress callbacks: per teacher-forced turn, online task, trajectory."""

    on_turn: TurnHook | None = None
    on_task: Callable[[str, Task], None] | None = None
    on_trajectory: Callable[[ReplayProgress], object] | None = None


def run_replay(
    agents: AgentSet,
    trajectories: list[Trajectory],
    variants: list[PolicyVariant],
    repeats: int = 1,
    online: bool = False,
    lora_attention: LoraAttention = EXPAND,
    progress: ReplayProgress | None = None,
    hooks: ReplayHooks | None = None,
    timing: str = "turn",
    page_size: int = PAGE_SIZE,
    span_matching: SpanMatching = DEFAULT_MATCHING,
) -> dict:
    """`kvprof replay`'s payload: the lockstep replay, the online re-runs when `online`, and the run's setting."""
    hooks = hooks or ReplayHooks()
    if online:
        require_react_agents(agents.spec.names)
    started = KernelCounts.now()
    meter = LoadMeter()
    result = replay_trace(
        agents,
        trajectories,
        variants,
        repeats=repeats,
        on_turn=hooks.on_turn,
        progress=progress,
        on_trajectory=hooks.on_trajectory,
        lora_attention=lora_attention,
        timing=timing,
        page_size=page_size,
        span_matching=span_matching,
    )
    timed_load = meter.reading()
    if online:
        runs = run_online(
            agents,
            [task_of(t) for t in trajectories],
            variants,
            on_task=hooks.on_task,
            lora_attention=lora_attention,
            span_matching=span_matching,
        )
        result["online"] = summarise_online(runs)
    result.update(run_setting(agents, repeats, lora_attention, timing, page_size, span_matching, started, timed_load))
    result["memory_claims"] = memory_verdicts(result)
    return result


def checkpoint_setting(agents: AgentSet, span_matching: SpanMatching) -> dict | None:
    """The checkpoint rule a hybrid's replay ran under, as resolved on the model (vLLM's B derived from its sizes):
    `CheckpointRule`'s fields and its `label`; None without recurrent layers."""
    rule = Runtime(agents, span_matching=span_matching).checkpoint_rule if agents.recurrent else None
    return None if rule is None else asdict(rule) | {"label": rule.label}


def check_setting(timing: str, lora_attention: str) -> None:
    """Refuse a --timing outside `TIMINGS`, a --lora-attention other than auto, kernel, expand."""
    if timing not in TIMINGS:
        raise KvprofError(f"--timing {timing!r} is not {' or '.join(TIMINGS)}; pass one of them.")
    if lora_attention not in ("auto", "kernel", "expand"):
        raise KvprofError(f"--lora-attention {lora_attention!r} is not auto, kernel or expand; pass one of them.")


def lora_attention_mode(option: str, device: str) -> LoraAttention:
    """`--lora-attention` on `device`: kernel and expand as named; auto the kernel on a GPU and, on CPU, the values
    as stored in the forwards where that pays, expanded in the others (`Runtime.values_as_stored`)."""
    if option == "auto":
        return KERNEL if device != "cpu" else SHORT
    return KERNEL if option == "kernel" else EXPAND


def replayed_trajectories(trace: Path, skip: int, limit: int | None, online: bool, strict: bool) -> list[Trajectory]:
    """The trace's trajectories after `skip`, at most `limit`; `online` requires a ReAct workflow's agents, `strict`
    one timeline per trajectory. Read from the trace alone, before a model loads."""
    trajectories = list(iter_trajectories(trace))[skip:][:limit]
    if not trajectories:
        raise KvprofError(f"--skip {skip} leaves none of the trace's trajectories to replay; skip fewer.")
    if online:
        require_react_agents(trace_header(trace).agent_names)
    if strict:
        require_one_timeline(trajectories, trace_header(trace).mode)
    return trajectories


def with_trace(result: dict, trace: Path, skipped: dict[str, str], self_check: dict[str, float] | None) -> ReplayResult:
    """The `ReplayResult` from a replay's JSON, naming the trace and its source, `skipped` variants (label →
    reason) and self-check errors (label → error; None: not checked)."""
    named = result | dict(trace=str(trace), trace_source=read_header(trace).source, skipped=skipped)
    return ReplayResult.from_json(named | {"self_check": self_check}, f"the replay of {trace}", "rerun kvprof replay")


def timing_setting(timing: str, repeats: int, heap_kept: bool = False, load: MachineLoad | None = None) -> dict:
    """How TTFT, TPOT and latency were timed: mode, whose practice (`Option.origins` labels), timed and warm-up
    runs, whether a turn's prefills were timed round-robin across the runs (`interleaved_prefills`), whether the CPU
    allocator kept freed memory (`keep_freed_memory`), and the machine's `load` while they were (other processes'
    cores, whether they contended: `kvprof.threads.MachineLoad`; absent where not metered)."""
    trajectory = timing == "trajectory"
    return {
        "mode": timing,
        "origin": "code" if trajectory else "kvprof",
        "runs": repeats,
        "warm_up_runs": 1 if trajectory or repeats > 1 else 0,
        "interleaved": not trajectory and repeats > 1,
        "heap_kept": heap_kept,
    } | ({} if load is None else {"load": load.to_json()})


@dataclass(frozen=True)
class KernelCounts:
    """How often this process ran the fused CPU expansion (`kvprof.kernels.expansion.kernel_runs`) and attended
    rank-r values as stored (`stored_value_calls`): taken when a replay starts, compared when it ends."""

    expansions: int
    stored_values: int

    @classmethod
    def now(cls) -> KernelCounts:
        return cls(kernel_runs(), stored_value_calls())


def attention_path(lora_attention: LoraAttention, fused_expansion: bool, stored_values: bool = False) -> str:
    """How the low-rank policies attended: Flash-LoRA-Attention, or expanded views (by kvprof's fused CPU kernel
    when `fused_expansion`: it ran in the replay, `kvprof.kernels.expansion`) and SDPA, and with "short" where
    `stored_values` (some forwards attended the rank-r values as stored), a clause saying so."""
    if lora_attention == KERNEL:
        return "flash-lora-attention"
    expanded = f"expanded values ({FUSED_EXPANSION}) + sdpa" if fused_expansion else "expanded values + sdpa"
    return f"{expanded}; {STORED_IN_SHORT_FORWARDS}" if lora_attention == SHORT and stored_values else expanded


def run_setting(
    agents: AgentSet,
    repeats: int,
    lora_attention: LoraAttention,
    timing: str = "turn",
    page_size: int = PAGE_SIZE,
    span_matching: SpanMatching = DEFAULT_MATCHING,
    started: KernelCounts | None = None,
    load: MachineLoad | None = None,
) -> dict:
    """How a replay ran: model, mode, repeats, timing (`load`: the machine's while it timed), page size, span
    matching (on a hybrid, the checkpoint rule it resolves to: `checkpoint_setting`), weights' bytes, layer kinds,
    attention path (`attention_path`: what ran since the `started` counts), device, CPU, dtype, GPU memory (the
    allocator's peak so far)."""
    return dict(
        checkpoint_rule=checkpoint_setting(agents, span_matching),
        model=agents.model_name,
        mode=agents.spec.mode,
        repeats=repeats,
        timing=timing_setting(timing, repeats, agents.device.type == "cpu" and keep_freed_memory(), load),
        page_size=page_size,
        span_matching=span_matching.to_json(),
        weights_bytes=weights_bytes(agents.model),
        layers=[kind.to_json() for kind in agents.layer_kinds],
        lora_attention=attention_path(
            lora_attention,
            started is not None and kernel_runs() > started.expansions,
            started is not None and stored_value_calls() > started.stored_values,
        ),
        device=str(agents.device),
        cpu=cpu_description(),
        dtype=str(agents.base_model.dtype).removeprefix("torch."),
        gpu_memory=gpu_memory(agents.device),
    )
