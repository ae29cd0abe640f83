"""`kvprof serve-bench`'s result (serve_bench.json): a trace's calls against an OpenAI-compatible server per load and
sharing pattern, with every request's timings.

Kept as JSON: `server` (url, version, started, pid, command, base, adapters); a summary's nested statistics;
per-request records (`RequestRecord`), metric samples, comparison rows.

Deviations from the file as written: fields a file trimmed for simulate lacks (tests/data/simulate/serve_bench.json)
read as None and are left out when written again; nullable `model`, `prefix_hit_ratio` are written as null.
"""

from __future__ import annotations

import dataclasses

from kvprof.results.base import (
    NUMBER,
    OPTIONAL,
    Record,
    ResultFile,
    json_field,
    record_reader,
    records_in_list,
)

FIX = "pass the serve_bench.json a `kvprof serve-bench` run wrote, unchanged (or rerun `kvprof serve-bench`)"


@dataclasses.dataclass(kw_only=True)
class ServeLoad(Record):
    """A run's load: its kind (qps: open loop, concurrency: closed loop), value and label ("2 qps")."""

    kind: str = json_field(str)
    value: float = json_field(NUMBER)
    label: str | None = json_field(str, absent=True)


@dataclasses.dataclass(kw_only=True)
class ServeSummary(Record):
    """One run's summary (`summarize`): pattern (agents: each agent's adapter; base: the base model), load, requests,
    unfinished trajectories, seconds, throughput, prefix-hit ratio, cache use by turn, agreement with the trace,
    statistics overall and per agent, server gauges and prefix-cache counters."""

    pattern: str = json_field(str)
    load: ServeLoad = json_field(dict, read=record_reader(ServeLoad))
    requests: int | None = json_field(int, absent=True)
    unfinished_trajectories: list[str] | None = json_field(list, absent=True)
    duration_s: float | None = json_field(NUMBER, absent=True)
    throughput: dict | None = json_field(dict, absent=True)
    prefix_hit_ratio: float | None = json_field((*NUMBER, OPTIONAL))
    cache_by_turn: dict | None = json_field(dict, absent=True)
    agreement: dict | None = json_field(dict, absent=True)
    overall: dict = json_field(dict)
    agents: dict[str, dict] | None = json_field(dict, absent=True)
    server: dict | None = json_field(dict, absent=True)


@dataclasses.dataclass(kw_only=True)
class ServeRun(Record):
    """One (pattern, load) run: its summary, every request's record and the server's metric samples."""

    summary: ServeSummary = json_field(dict, read=record_reader(ServeSummary))
    requests: list[dict] = json_field(list)
    samples: list[dict] | None = json_field(list, absent=True)


@dataclasses.dataclass(kw_only=True)
class ServeBenchResult(ResultFile):
    """A serve-bench: trace, mode, model, server, trajectories, runs, pattern comparison (agents vs base per load)."""

    KIND = "serve_bench"
    FIX = FIX

    trace: str | None = json_field(str, absent=True)
    mode: str | None = json_field(str, absent=True)
    model: str | None = json_field((str, OPTIONAL))
    server: dict = json_field(dict)
    trajectories: list[str] | None = json_field(list, absent=True)
    runs: list[ServeRun] = json_field(list, read=records_in_list(ServeRun))
    comparison: list[dict] | None = json_field(list, absent=True)
