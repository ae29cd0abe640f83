"""`kvprof simulate`'s result (simulate.json): every policy of a replay on a modelled engine at each load.

Kept as JSON (read by the report alone): `cost_model` (`StepCost.as_dict`), calibration errors, `scale`
(shared_tokens, factors, linear), model constants, runs, sustainable loads, serving-claim verdicts.

Deviations from the file as written: older files' missing `calibration_errors`, `sustainable`, `serving_claims` read
as None; `sustainable` is written as null.
"""

from __future__ import annotations

import dataclasses

from kvprof.results.base import NUMBER, OPTIONAL, Record, ResultFile, json_field, record_reader

FIX = "pass the simulate.json a `kvprof simulate` run wrote, unchanged (or rerun `kvprof simulate`)"
MAYBE_NUMBER = (*NUMBER, OPTIONAL)


@dataclasses.dataclass(kw_only=True)
class SimulateSettings(Record):
    """The modelled engine: memory (bytes), token budget, max sequences, KV block, prefix-cache block, kept state
    (evict or hold), seconds of arrivals per load, TTFT SLO (s; None: none)."""

    memory_bytes: float = json_field(NUMBER)
    token_budget: int = json_field(int)
    max_num_seqs: int = json_field(int)
    block_size: int = json_field(int)
    prefix_block: int | None = json_field((int, OPTIONAL))
    kept: str = json_field(str)
    duration_s: float = json_field(NUMBER)
    ttft_slo_s: float | None = json_field(MAYBE_NUMBER)


@dataclasses.dataclass(kw_only=True)
class SimulateResult(ResultFile):
    """A simulation: replay and calibration files, step-cost model, calibration errors, scaling, model constants,
    settings, runs, sustainable loads (None without an SLO), serving-claim verdicts."""

    KIND = "simulate"
    FIX = FIX

    replay: str = json_field(str)
    calibration: str | None = json_field((str, OPTIONAL))
    cost_model: dict = json_field(dict)
    calibration_errors: list[dict] | None = json_field(list, absent=True)
    scale: dict = json_field(dict)
    model: dict = json_field(dict)
    settings: SimulateSettings = json_field(dict, read=record_reader(SimulateSettings))
    runs: list[dict] = json_field(list)
    sustainable: dict | None = json_field((dict, OPTIONAL))
    serving_claims: list[dict] | None = json_field(list, absent=True)
