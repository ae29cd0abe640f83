"""`kvprof capture`'s result (capture.json): the trace written and its summary. Kept as JSON:
`CaptureSummary.agents` (agent → turns, input_tokens, output_tokens).
"""

from __future__ import annotations

import dataclasses

from kvprof.results.base import NUMBER, OPTIONAL, Record, ResultFile, json_field, record_reader

FIX = "pass the capture.json a `kvprof capture` run wrote, unchanged (or rerun `kvprof capture`)"


@dataclasses.dataclass(kw_only=True)
class CaptureSummary(Record):
    """A captured trace's numbers (`trajectory_summary`): trajectories, calls, distinct tokens and those in segments
    several agents read, answered tasks and exact-match accuracy (None: none), seconds, per-agent counts."""

    trajectories: int = json_field(int)
    turns: int = json_field(int)
    distinct_tokens: int = json_field(int)
    shared_tokens: int = json_field(int)
    with_answer: int = json_field(int)
    accuracy: float | None = json_field((*NUMBER, OPTIONAL))
    seconds: float = json_field(NUMBER)
    agents: dict[str, dict] = json_field(dict)


@dataclasses.dataclass(kw_only=True)
class CaptureResult(ResultFile):
    """A capture: the trace file written and its summary."""

    KIND = "capture"
    FIX = FIX

    trace: str = json_field(str)
    summary: CaptureSummary = json_field(dict, read=record_reader(CaptureSummary))
