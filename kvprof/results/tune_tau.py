"""`kvprof tune-tau`'s result (tune_tau.json): a delta-correction policy's gate threshold swept, the recommended
value and its check on held-out trajectories (`kvprof.tuning.tau`).

Typed: the top level, each sweep row (`SweepRow`, also the recommendation and the held-out check) and the dense
run's part (`SweepDense`, its summary a `kvprof.results.replay.DenseSummary`). Kept as JSON: a row's per-layer errors
(`SweepRow.layers`) and the dense run's online result (accuracy, correct, tasks, diverged_turns).

Deviations from the file as written:

- fields older files lack (`target`, the held-out trajectories, the dense run, the trace, model and pool) read as
  None and are left out when written again; so are the trace, model and pool of the payload `tune` returns
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
    """One threshold's measurements (`kvprof.tuning.tau.row_of`): the threshold and its variant's label, ρ (the
    gate's reuse), KL, top-1, K / V error and per layer, tokens prefilled (and the dense run's), TTFT and latency
    speed-ups and memory ratio to the dense run, peak stored bytes, online accuracy (and the dense run's, and the
    drop in points; None without online re-runs), whether it meets the target (None until `tune` checks it)."""

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
    """A threshold sweep: the policy (registry name), its threshold option and other options, the target in words,
    the rows, the thresholds on the Pareto front (ρ against KL), the recommended row and its held-out check (None:
    none met the target / nothing held out), the tuning and held-out trajectories' ids, the dense run, and the
    trace, model and anchor pool the command swept with."""

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
