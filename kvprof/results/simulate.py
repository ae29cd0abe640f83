"""`kvprof simulate`'s result (simulate.json): every policy of a replay served on a modelled engine at each load
(`kvprof.simulate`).

Typed: the top level and the engine's settings (`SimulateSettings`). Kept as JSON (rows the sweep and the claims
build, read by the report alone):

- the step-cost model (`cost_model`: `kvprof.simulate.cost.StepCost.as_dict`, coefficients, source and fit);
- the calibration's errors, the scaling (`scale`: shared_tokens, factors, linear), the model's constants;
- the simulated runs (per policy, load and shared-context length: requests, TTFT / e2e distributions, throughput,
  memory, out-of-memory), the sustainable loads and the serving claims' verdicts (`kvprof.claims.serving`).

Deviations from the file as written:

- older files' missing `calibration_errors`, `sustainable` and `serving_claims` read as None; `sustainable` is
  written as null.
"""

from __future__ import annotations

import dataclasses

from kvprof.results.base import NUMBER, OPTIONAL, Record, ResultFile, json_field, record_reader

FIX = "pass the simulate.json a `kvprof simulate` run wrote, unchanged (or rerun `kvprof simulate`)"
MAYBE_NUMBER = (*NUMBER, OPTIONAL)


@dataclasses.dataclass(kw_only=True)
class SimulateSettings(Record):
    """The modelled engine: memory in bytes, the token budget and the most sequences per step, the KV block size,
    the prefix cache's block, what a trajectory's caches do between its turns (evict or hold), the simulated seconds
    of arrivals per load, and the TTFT SLO in seconds (None: none)."""

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
    """A simulation: the replay and calibration files it read, the step-cost model, the calibration's errors, the
    scaling, the model's constants (params, weight_bytes, kv_bytes_per_token), the settings, the runs, the
    sustainable loads (None without an SLO) and the serving claims' verdicts."""

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
