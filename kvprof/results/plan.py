"""`--plan`'s result (plan.json): what a replay, fit-anchors or tune-tau run will hold and how long it will take,
before it runs (`kvprof.planning.plan`).

Bytes by memory kind: `host` (the process's resident memory) and, on a GPU, `device` (the CUDA allocator's peak).
Each prediction is extrapolated to the model's `layers` from two probes on its first layers (`probes`): linear in
the layers, as everything a run holds per layer is; a peak call by call, where the probes measured it.
"""

from __future__ import annotations

import dataclasses

from kvprof.fileio import NUMBER
from kvprof.results.base import OPTIONAL, Record, ResultFile, json_field, records_in_list

FIX = "pass the plan.json a `--plan` run wrote, unchanged (or plan again)"


@dataclasses.dataclass(kw_only=True)
class PlanProbe(Record):
    """One probe: the command on the model's first `layers` layers; its wall `seconds`, peak bytes (`host`: VmHWM,
    `device`: the CUDA allocator's, None on CPU), resident bytes before the command (`process_bytes`), the cut base
    model's `weights_bytes`, (replay) each run's stored caches at their peak (`stored_peak_bytes`), and the peaks
    from each call's start to the next (`call_peak_host_bytes`, `call_peak_device_bytes`; None where not measured:
    off Linux, before they were, on the device without CUDA)."""

    layers: int = json_field(int)
    seconds: float = json_field(NUMBER)
    peak_host_bytes: int = json_field(int)
    peak_device_bytes: int | None = json_field((int, OPTIONAL))
    process_bytes: int = json_field(int)
    weights_bytes: int | None = json_field((int, OPTIONAL))
    stored_peak_bytes: dict[str, int] = json_field(dict)
    call_peak_host_bytes: list[int] | None = json_field(list, absent=True)
    call_peak_device_bytes: list[int | None] | None = json_field(list, absent=True)

    def peaks(self, kind: str) -> tuple[float | None, list[float] | None]:
        """The probe's peak of memory `kind` ("host" or "device") and its peaks call by call (None: not measured;
        a call before CUDA started held none of the device)."""
        if kind == "host":
            return float(self.peak_host_bytes), _floats(self.call_peak_host_bytes)
        peak = None if self.peak_device_bytes is None else float(self.peak_device_bytes)
        return peak, _floats(self.call_peak_device_bytes)


def _floats(values: list[int | None] | list[int] | None) -> list[float] | None:
    return None if values is None else [float(value or 0) for value in values]


@dataclasses.dataclass(kw_only=True)
class PlanResult(ResultFile):
    """The plan of `kvprof COMMAND ARGUMENTS` (`arguments`: the command line without --out and --plan) on a model of
    `layers` decoder layers: predicted `peak_bytes` by memory kind, made of the process (`process_bytes`), the
    weights, each run's stored caches at their peak (`stored_peak_bytes`: the dense run and each policy, all held at
    once in a replay's lockstep) and the rest (`working_bytes`: a turn's caches and activations, the allocators'
    spare), on the kind the stores live in; `expected_seconds`; the memory free when planned (`free_bytes`, None
    where unknown) and whether the peak fits in it; the `--kv-budget` in force."""

    KIND = "plan"
    FIX = FIX

    command: str = json_field(str)
    arguments: list[str] = json_field(list)
    layers: int = json_field(int)
    probes: list[PlanProbe] = json_field(list, read=records_in_list(PlanProbe))
    process_bytes: int = json_field(int)
    weights_bytes: int | None = json_field((int, OPTIONAL))
    stored_peak_bytes: dict[str, int] = json_field(dict)
    working_bytes: int = json_field(int)
    peak_bytes: dict[str, int] = json_field(dict)
    expected_seconds: float = json_field(NUMBER)
    free_bytes: dict[str, int | None] = json_field(dict)
    fits: bool = json_field(bool)
    kv_budget_bytes: int | None = json_field((int, OPTIONAL))
