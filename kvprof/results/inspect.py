"""`kvprof inspect --out`'s result (inspect.json): what each turn of a trace could reuse, and how replay would follow
it (`kvprof.traces.reuse`, `kvprof.replay.branches`).

Typed: the top level and each trajectory's part (`InspectedTrajectory`). Kept as JSON: the reuse counts (`total`,
each trajectory's `summary`: turns, input tokens, own and shared prefix, moved, new, what an engine's prefix cache
would serve, divergences by cause), the replay plan's counts (`replay`), the per-turn records, the span-matching
setting and the layer kinds.
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
    """An inspected trace: its path and mode, the prefix cache's block size, the span matching, the model's layer
    kinds (None without --model), the reuse counts of the whole trace, the replay plan's counts and each
    trajectory's part by id."""

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
