"""One turn's record: a policy turn measured against the dense turn of the same call (`compare_turn`), its per-layer
K/V errors, its corrected spans' errors and the moved tokens it served from others. The record's fields:
`kvprof.results.replay.TurnRecord`; the metrics: `kvprof.replay.metrics`, docs/metrics.md.
"""

from __future__ import annotations

import statistics

import torch

from kvprof.model.layers import LayerKind
from kvprof.policies import TurnResult
from kvprof.replay.branches import TurnStart
from kvprof.replay.memory import PaperMemory
from kvprof.replay.metrics import kl_divergence, mean_token_cosine, relative_frobenius, top1_agreement
from kvprof.results.replay import CorrectedSpan, LayerError, TurnRecord
from kvprof.traces.trace import Trajectory

DENSE = "dense"


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
        working_peak_bytes=result.working_peak_bytes,
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


def moved_from_others(traj: Trajectory, start: TurnStart, result: TurnResult, agent: str) -> int:
    """Moved tokens `result` served from another agent's turn's K/V."""
    served = set(result.moved_spans)
    return sum(
        len(span) for span in start.moved if (span.begin, span.end) in served and traj.turns[span.source].agent != agent
    )
