"""`kvprof inspect --out`'s result (inspect.json): what each turn could reuse and how replay would follow it.

Kept as JSON: reuse counts (`total`, each trajectory's `summary`), the replay plan's counts (`replay`), per-turn
records, the span-matching setting and layer kinds.
"""

from __future__ import annotations

import dataclasses

from kvprof.results.base import OPTIONAL, Record, ResultFile, json_field, records_by_label

FIX = "pass the inspect.json a `kvprof inspect --out` run wrote, unchanged (or rerun `kvprof inspect`)"


@dataclasses.dataclass(kw_only=True)
class InspectedTrajectory(Record):
    """One trajectory's reuse counts (summed over its turns) and per-turn records."""

    summary: dict = json_field(dict)
    turns: list[dict] = json_field(list)


@dataclasses.dataclass(kw_only=True)
class InspectResult(ResultFile):
    """An inspected trace: path, mode, prefix-cache block, span matching, layer kinds (None without --model), whole
    trace's reuse counts, replay plan counts, trajectories by id."""

    KIND = "inspect"
    FIX = FIX

    trace: str = json_field(str)
    mode: str = json_field(str)
    block_size: int = json_field(int)
    span_matching: dict = json_field(dict)
    layers: list[dict] | None = json_field((list, OPTIONAL))
    total: dict = json_field(dict)
    replay: dict = json_field(dict)
    trajectories: dict[str, InspectedTrajectory] = json_field(dict, read=records_by_label(InspectedTrajectory))
