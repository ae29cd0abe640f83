"""`kvprof rank-analysis`'s result (rank_analysis.json): rank and cross-agent similarity of caches on shared context,
and the claims checked on them.

Kept as JSON (keyed by the metric names in `metrics`): `layer_means` and `spectra` (per layer); `pairs` (per
trajectory and agent pair); `context_free` (prompt mode's deltas against the context-free reference; None in lora
mode); `layer_kinds`.

Deviations from the file as written: older files' missing `context_free` / `layer_kinds` read as None and are
written back as `"context_free": null` and without `layer_kinds`.
"""

from __future__ import annotations

import dataclasses

from kvprof.results.base import NUMBER, OPTIONAL, Record, ResultFile, json_field, records_in_list

FIX = "pass the rank_analysis.json a `kvprof rank-analysis` run wrote, unchanged (or rerun `kvprof rank-analysis`)"


@dataclasses.dataclass(kw_only=True)
class RankClaim(Record):
    """A claim checked on the caches: paper, claim, holds (None: undecided on this trace), measured value, detail, and
    the quantity kvprof measured for it (None in older files)."""

    paper: str = json_field(str)
    statement: str = json_field(str)
    holds: bool | None = json_field((bool, OPTIONAL))
    measured: str = json_field(str)
    detail: str = json_field(str)
    quantity: str | None = json_field(str, absent=True)


@dataclasses.dataclass(kw_only=True)
class RankAnalysisResult(ResultFile):
    """A rank analysis: trace, model, layer kinds, seconds, mode, agents, layers, per-head flag, the matrix read (in
    words), metric descriptions, per-layer means and spectra, per-pair values, context-free records, verdicts."""

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
