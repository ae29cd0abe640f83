"""`kvprof tune-tau`'s result (tune_tau.json): a delta policy's gate threshold swept, the recommendation and its
held-out check. Kept as JSON: `SweepRow.layers` and the dense run's online result.

Deviations from the file as written: fields older files lack (`target`, held-out trajectories, dense run, trace,
model, pool) read as None and are left out when written again, as are the trace, model and pool of `tune`'s payload
(the command adds them).
"""

from __future__ import annotations

import dataclasses

from kvprof.results.base import NUMBER, OPTIONAL, Record, ResultFile, json_field, record_reader, records_in_list
from kvprof.results.replay import DenseSummary

FIX = "pass the tune_tau.json a `kvprof tune-tau` run wrote, unchanged (or rerun `kvprof tune-tau`)"
MAYBE_NUMBER = (*NUMBER, OPTIONAL)


@dataclasses.dataclass(kw_only=True)
class SweepRow(Record):
    """One threshold (`row_of`): threshold, label, ρ (the gate's reuse), KL, top-1, K / V error (per layer too),
    prefilled tokens (and dense's), TTFT and latency speed-ups, memory ratio, peak stored bytes, online accuracy (and
    dense's, the drop in points; None offline), `target_met` (None until `tune` checks)."""

    threshold: float = json_field(NUMBER)
    label: str = json_field(str)
    rho: float = json_field(NUMBER)
    kl: float = json_field(NUMBER)
    top1: float = json_field(NUMBER)
    k_error: float = json_field(NUMBER)
    v_error: float = json_field(NUMBER)
    layers: list[dict] = json_field(list)
    prefilled: float = json_field(NUMBER)
    dense_prefilled: float = json_field(NUMBER)
    ttft_speedup: float | None = json_field(MAYBE_NUMBER)
    latency_speedup: float | None = json_field(MAYBE_NUMBER)
    memory_ratio: float | None = json_field(MAYBE_NUMBER)
    peak_memory_bytes: float = json_field(NUMBER)
    accuracy: float | None = json_field(MAYBE_NUMBER)
    dense_accuracy: float | None = json_field(MAYBE_NUMBER)
    accuracy_drop: float | None = json_field(MAYBE_NUMBER)
    target_met: bool | None = json_field((bool, OPTIONAL))


@dataclasses.dataclass(kw_only=True)
class SweepDense(Record):
    """The sweep's dense run: its summary and its online result (None without online re-runs)."""

    summary: DenseSummary = json_field(dict, read=record_reader(DenseSummary))
    online: dict | None = json_field((dict, OPTIONAL))


@dataclasses.dataclass(kw_only=True)
class TuneTauResult(ResultFile):
    """A threshold sweep: policy, threshold option, other options, target in words, rows, Pareto front (ρ vs KL),
    recommendation and held-out check (None: none met / nothing held out), trajectory ids, dense run, trace, model,
    pool."""

    KIND = "tune_tau"
    FIX = FIX

    policy: str = json_field(str)
    threshold_option: str = json_field(str)
    options: dict[str, str] = json_field(dict)
    target: str | None = json_field(str, absent=True)
    rows: list[SweepRow] = json_field(list, read=records_in_list(SweepRow))
    pareto: list[float] = json_field(list)
    recommended: SweepRow | None = json_field((dict, OPTIONAL), read=record_reader(SweepRow))
    heldout: SweepRow | None = json_field((dict, OPTIONAL), read=record_reader(SweepRow))
    tuning_trajectories: list[str] = json_field(list)
    heldout_trajectories: list[str] | None = json_field(list, absent=True)
    dense: SweepDense | None = json_field(dict, read=record_reader(SweepDense), absent=True)
    trace: str | None = json_field(str, absent=True)
    model: str | None = json_field(str, absent=True)
    pool: str | None = json_field(str, absent=True)
