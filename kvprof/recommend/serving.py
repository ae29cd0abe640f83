"""Each candidate served at a load and a KV-memory budget by `kvprof simulate`'s engine, on its result's step model:
a serve-bench calibration, a device's roofline, or (`--fit-replay`) the replay's own dense timings. The numbers are
those `kvprof simulate RESULT --qps|--concurrency LOAD --memory GIB --duration S --seed N` prints for that result,
with `--memory` the weights plus the budget when one is given."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.serving.traffic import Load
from kvprof.simulate import sweep as sweeps
from kvprof.simulate.run import Simulation, SimulationRequest, prepare


@dataclasses.dataclass(frozen=True)
class StepModel:
    """Where step times come from: a serve-bench file, a device's roofline, or the replays' dense timings."""

    calibration: Path | None = None
    device_model: str | None = None
    fit_replay: bool = False

    def check(self) -> None:
        """Exactly one source, refused in one sentence otherwise."""
        given = [self.calibration is not None, self.device_model is not None, self.fit_replay]
        if sum(given) == 0:
            raise KvprofError(
                "the target's load needs step times to simulate serving; pass --calibration SERVE_BENCH.json (a "
                "kvprof serve-bench run), --device-model a100|h100|h200 (a roofline), or --fit-replay (the replays' "
                "own single-stream timings)."
            )
        if sum(given) > 1:
            raise KvprofError("pass one of --calibration, --device-model and --fit-replay, not several.")

    @property
    def description(self) -> str:
        if self.calibration is not None:
            return f"fitted to {self.calibration}"
        if self.device_model is not None:
            return f"{self.device_model} roofline"
        return "fitted to each replay's dense timings"


@dataclasses.dataclass(frozen=True)
class Serving:
    """One candidate at one load and budget: TTFT and TPOT percentiles (s; None when nothing finished), trajectories
    finished per second (the load's unit, comparable across agent families whose trajectories make different numbers
    of calls), peak KV bytes, and why it ran out of memory (None: it did not)."""

    ttft_p50: float | None
    ttft_p90: float | None
    tpot_p50: float | None
    tpot_p90: float | None
    throughput: float | None
    peak_kv_bytes: float | None
    out_of_memory: str | None


@dataclasses.dataclass
class ServingModel:
    """One replay result's simulation (`kvprof.simulate.run.prepare`) and the device memory without a budget."""

    simulation: Simulation
    memory_bytes: float

    @classmethod
    def of(cls, replay: Path, model: StepModel, memory_gib: float, duration: float, seed: int) -> ServingModel:
        request = SimulationRequest(
            replay=replay,
            calibration=model.calibration,
            device_model=model.device_model,
            qps=[1.0],
            memory_gib=memory_gib,
            duration=duration,
            seed=seed,
        )
        return cls(prepare(request), memory_gib * sweeps.GIB)

    @property
    def errors(self) -> list[dict]:
        """The step model on its calibration's own runs (the replay's dense run with --fit-replay): simulated against
        measured median TTFT and throughput (`kvprof.simulate.sweep.serve_bench_errors`, `replay_errors`)."""
        return self.simulation.errors

    @property
    def weight_bytes(self) -> float:
        return self.simulation.work.weight_bytes()

    def memory_for(self, kv_budget: float | None) -> float:
        """Device memory (bytes) of an engine with `kv_budget` bytes of KV memory (None: the device's)."""
        return self.memory_bytes if kv_budget is None else self.weight_bytes + kv_budget

    def serve(
        self, labels: list[str], load: Load, kv_budget: float | None, tasks: set[str] | None = None
    ) -> dict[str, Serving]:
        """Candidates `labels` at `load` with `kv_budget` bytes of KV memory, on trajectories `tasks` (None: all)."""
        simulation = self.simulation
        work = simulation.work
        if tasks is not None:
            policies = {label: tuple(t for t in work.policies[label] if t.id in tasks) for label in labels}
            work = dataclasses.replace(work, policies=policies)
        settings = dataclasses.replace(simulation.settings, memory_bytes=self.memory_for(kv_budget))
        rows = sweeps.sweep(work, simulation.step_cost, settings, [load], labels)
        return {row["policy"]: _serving(row) for row in rows}


def _serving(row: dict) -> Serving:
    """A simulate row as a candidate's serving numbers."""
    ttft, tpot = row.get("ttft") or {}, row.get("tpot") or {}
    throughput = row.get("throughput") or {}
    return Serving(
        ttft_p50=ttft.get("p50"),
        ttft_p90=ttft.get("p90"),
        tpot_p50=tpot.get("p50"),
        tpot_p90=tpot.get("p90"),
        throughput=throughput.get("trajectories_per_s"),
        peak_kv_bytes=row.get("peak_kv_bytes"),
        out_of_memory=row["out_of_memory"],
    )
