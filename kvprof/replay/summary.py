"""A replay's result from its per-turn records: each run's `RunSummary` (`summarise`), each policy's ratios against
the dense run (`relative_to_dense`), the dense run's timeline, and the whole teacher-forced result
(`replay_result`).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict

from kvprof.policies import SharingPolicy
from kvprof.replay.memory import allocator_peak
from kvprof.replay.records import DENSE
from kvprof.results.replay import (
    CorrectedSpan,
    DenseRun,
    DenseSummary,
    PolicyRun,
    PolicySummary,
    RunSummary,
    TurnRecord,
    measured,
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


def replay_result(
    records: dict[str, list[TurnRecord]],
    entries: dict[str, dict],
    memory_exact: dict | None = None,
    own_dense: dict[str, RunSummary] | None = None,
) -> dict:
    """The teacher-forced result from per-turn records (label → records, dense under `DENSE`) and `policy_entry`s:
    summaries recomputed, each policy's against the dense run (or, where `own_dense` names one, against the dense
    run replayed beside it: a sequential shard's); `memory_exact` per policy. Built as `kvprof.results.replay`
    records (an undeclared summary field fails here), returned as JSON."""
    dense_summary = summarise(records[DENSE])
    dense = DenseRun(
        summary=DenseSummary(**asdict(dense_summary), timeline=timeline_summary(records[DENSE])), turns=records[DENSE]
    )
    policies: dict[str, PolicyRun] = {}
    for label, entry in entries.items():
        summary = summarise(records[label])
        policies[label] = PolicyRun(
            **entry,
            summary=PolicySummary(
                **asdict(summary), **relative_to_dense(summary, (own_dense or {}).get(label, dense_summary))
            ),
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
