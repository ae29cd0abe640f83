"""One `kvprof simulate` run: its settings checked, the step-cost model chosen, every policy swept over the loads
and context lengths, and the result (`kvprof.results.simulate.SimulateResult`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.results.replay import ReplayResult
from kvprof.results.serve_bench import ServeBenchResult
from kvprof.results.simulate import SimulateResult, SimulateSettings
from kvprof.serving.traffic import Load, loads
from kvprof.simulate import DEFAULT_QPS
from kvprof.simulate import cost as costs
from kvprof.simulate import sweep as sweeps
from kvprof.simulate.workload import ReplayWork, read_replay_result, replay_work, scale_to_shapes

DEVICE_MODELS = ("a100", "h100", "h200")
KEPT = ("evict", "hold")
DEFAULT_SHARED_TOKENS = 32768  # the papers' 32K context, what --shapes scales to by default
BLOCK_SIZE = 16  # tokens per KV block of the modelled engine


@dataclasses.dataclass
class SimulationRequest:
    """What to simulate: replay (+ serve-bench calibration, optionally at one load) or a device roofline, policies
    (None: all), loads (default `DEFAULT_QPS`), engine (memory GiB, token budget, max seqs, prefix block — None: the
    calibration's, else 16 —, kept-state handling), seconds of arrivals, TTFT SLO (s), context lengths (None: as
    replayed)."""

    replay: Path
    calibration: Path | None = None
    fit_load: float | None = None
    device_model: str | None = None
    policies: list[str] | None = None
    qps: list[float] = dataclasses.field(default_factory=list)
    concurrency: list[int] = dataclasses.field(default_factory=list)
    memory_gib: float = 80.0
    ttft_slo: float | None = None
    duration: float = 600.0
    token_budget: int = 8192
    max_num_seqs: int = 256
    prefix_block: int | None = None
    kept: str = "evict"
    shared_tokens: list[int] | None = None
    seed: int = 0

    def check(self) -> None:
        """Refuse options that do not go together, in one sentence each."""
        if self.calibration is not None and self.device_model is not None:
            raise KvprofError("pass either --calibration or --device-model, not both.")
        if self.fit_load is not None and self.calibration is None:
            raise KvprofError(
                "--fit-load selects runs of a --calibration file; pass --calibration SERVE_BENCH.json too."
            )
        if self.device_model is not None and self.device_model not in DEVICE_MODELS:
            raise KvprofError(
                f"--device-model {self.device_model!r} is not one of {', '.join(DEVICE_MODELS)}; pass one of them."
            )
        if self.kept not in KEPT:
            raise KvprofError(f"--kept {self.kept!r} is not one of {', '.join(KEPT)}; pass evict or hold.")


@dataclasses.dataclass
class Simulation:
    """A checked request with its inputs read: work, step-cost model, engine settings, sweep axes, calibration
    errors."""

    request: SimulationRequest
    replay: ReplayResult
    work: ReplayWork
    step_cost: costs.StepCost
    settings: sweeps.Settings
    loads: list[Load]
    labels: list[str]
    lengths: list[int | None]
    errors: list[dict]

    @property
    def description(self) -> str:
        return f"simulating {len(self.labels)} policies at {len(self.loads)} loads × {len(self.lengths)} lengths"

    def run(self) -> SimulateResult:
        """Every policy at every load and context length, with the sustainable loads and the serving claims."""
        rows, factors = [], {}
        for length in self.lengths:
            scaled = self.work if length is None else scale_to_shapes(self.work, length)
            factors[str(length)] = scaled.scale
            for row in sweeps.sweep(scaled, self.step_cost, self.settings, self.loads, self.labels):
                rows.append(row | {"shared_tokens": length})
        request, settings, slo = self.request, self.settings, self.request.ttft_slo
        result = SimulateResult(
            replay=str(request.replay),
            calibration=str(request.calibration) if request.calibration is not None else None,
            cost_model=self.step_cost.as_dict(),
            calibration_errors=self.errors,
            scale={"shared_tokens": request.shared_tokens, "factors": factors, "linear": True},
            model={
                "params": self.work.params,
                "weight_bytes": self.work.weight_bytes(),
                "kv_bytes_per_token": self.work.kv_bytes_per_token,
            },
            settings=SimulateSettings(
                memory_bytes=settings.memory_bytes,
                token_budget=request.token_budget,
                max_num_seqs=request.max_num_seqs,
                block_size=BLOCK_SIZE,
                prefix_block=settings.prefix_block,
                kept=request.kept,
                duration_s=request.duration,
                ttft_slo_s=slo,
            ),
            runs=rows,
            sustainable=sweeps.sustainable_loads(rows, slo) if slo is not None else None,
        )
        result.serving_claims = serving_claims(result, self.replay)
        return result


def prepare(request: SimulationRequest) -> Simulation:
    """Check `request`, read its replay (and calibration), and choose the step-cost model."""
    request.check()
    sweep_loads = loads(request.qps, request.concurrency) or loads(list(DEFAULT_QPS), [])
    replay = read_replay_result(request.replay)
    work = replay_work(replay, request.replay)
    labels = request.policies or list(work.policies)
    unknown = [label for label in labels if label not in work.policies]
    if unknown:
        raise KvprofError(
            f"policy {unknown[0]!r} is not in {request.replay}; pass one of {', '.join(work.policies)} "
            "(or no --policy)."
        )
    calibration = costs.read_serve_bench(request.calibration) if request.calibration is not None else None
    step_cost = _step_cost(request, replay, work, calibration)
    prefix_block = request.prefix_block or (sweeps.cached_block(calibration) if calibration else None) or 16
    settings = sweeps.Settings(
        prefix_block=prefix_block,
        evict_kept=request.kept == "evict",
        memory_bytes=request.memory_gib * sweeps.GIB,
        duration=request.duration,
        ttft_slo=request.ttft_slo,
        token_budget=request.token_budget,
        max_num_seqs=request.max_num_seqs,
        seed=request.seed,
    )
    errors = []
    if calibration is not None:
        errors = sweeps.serve_bench_errors(calibration, work, step_cost, settings, request.fit_load)
    elif request.device_model is None:
        errors = sweeps.replay_errors(replay, work, step_cost, settings)
    lengths: list[int | None] = list(request.shared_tokens) if request.shared_tokens else [None]
    return Simulation(request, replay, work, step_cost, settings, sweep_loads, labels, lengths, errors)


def _step_cost(
    request: SimulationRequest, replay: ReplayResult, work: ReplayWork, calibration: ServeBenchResult | None
) -> costs.StepCost:
    """A device's roofline, the fit to a serve-bench calibration, or else the fit to the replay's dense timings."""
    if request.device_model is not None:
        return costs.roofline_cost(request.device_model, work)
    if calibration is not None:
        return costs.serve_bench_cost(calibration, str(request.calibration), request.fit_load)
    return costs.fit(costs.replay_observations(replay), f"fit to the dense timings of {request.replay}")


def serving_claims(result: SimulateResult, replay: ReplayResult) -> list[dict]:
    """Serving-claim verdicts (`kvprof.claims.serving`), claims read from the policy registry (older replays too)."""
    from kvprof.claims.serving import serving_verdicts
    from kvprof.policies import REGISTRY  # imports torch: only when a simulation has run

    runs = {label: {"name": run.name or label, "options": run.options or {}} for label, run in replay.policies.items()}
    published = {name: [dataclasses.asdict(figure) for figure in cls.published] for name, cls in REGISTRY.items()}
    return serving_verdicts(result.to_json(), runs, published)
