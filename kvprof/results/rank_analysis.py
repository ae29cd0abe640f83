"""`kvprof rank-analysis`'s result (rank_analysis.json): rank and cross-agent similarity of the caches agents build on
shared context, and the published claims checked on them (`kvprof.rank.analysis`).

Typed: the top level and the claims' verdicts (`RankClaim`). Kept as JSON (per-layer and per-pair numbers, keyed by
the metric names the result lists in `metrics`):

- `layer_means` and `spectra` (per layer: "K" and "V" metric → value, or quantity → energy spectrum);
- `pairs` (per trajectory and agent pair: tokens, bound, segments, per-layer metrics);
- `context_free` (prompt mode: the same per-layer records of the deltas against the context-free reference; None in
  lora mode), `layer_kinds` (`kvprof.model.layers.LayerKind.to_json`).

Deviations from the file as written:

- files older than the context-free records or the layer kinds read them as None; they are written back with
  `"context_free": null` and without `layer_kinds`.
"""

from __future__ import annotations

import dataclasses

from kvprof.results.base import NUMBER, OPTIONAL, Record, ResultFile, json_field, records_in_list

FIX = "pass the rank_analysis.json a `kvprof rank-analysis` run wrote, unchanged (or rerun `kvprof rank-analysis`)"


@dataclasses.dataclass(kw_only=True)
class RankClaim(Record):
    """A published claim checked on the measured caches: the paper, the claim, whether it holds (None: not decided
    on this trace), what was measured
    and how (detail), and which quantity kvprof measured for it (None in older files)."""

    paper: str = json_field(str)
    statement: str = json_field(str)
    holds: bool | None = json_field((bool, OPTIONAL))
    measured: str = json_field(str)
    detail: str = json_field(str)
    quantity: str | None = json_field(str, absent=True)


@dataclasses.dataclass(kw_only=True)
class RankAnalysisResult(ResultFile):
    """A rank analysis: the trace, model and its layer kinds, the seconds it took, the mode, the agents and layers
    analysed, whether per KV head, the matrix each cache was read as (in words), the metrics' descriptions by name,
    the per-layer means and spectra, the per-pair values, the context-free records and the claims' verdicts."""

    KIND = "rank_analysis"
    FIX = FIX

    trace: str = json_field(str)
    model: str = json_field(str)
    layer_kinds: list[dict] | None = json_field(list, absent=True)
    seconds: float = json_field(NUMBER)
    mode: str = json_field(str)
    agents: list[str] = json_field(list)
    layers: list[int] = json_field(list)
    per_head: bool = json_field(bool)
    matrix: str = json_field(str)
    metrics: dict[str, str] = json_field(dict)
    layer_means: list[dict] = json_field(list)
    spectra: list[dict] = json_field(list)
    pairs: list[dict] = json_field(list)
    context_free: dict | None = json_field((dict, OPTIONAL))
    claims: list[RankClaim] = json_field(list, read=records_in_list(RankClaim))
