"""`kvprof tune-tau`: sweep a delta policy's acceptance threshold on tuning trajectories, recommend one for a target,
verify it on held-out ones, write it for `kvprof replay --tuned`. Maths: `kvprof.tuning.tau`; checkpoint:
`kvprof.replay.checkpoint`; tuned file: `kvprof.tuning.tuned`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvprof.cli_help import tune_grid
from kvprof.commands import common, displays, options, planning
from kvprof.traces.reuse import MIN_SPAN, SpanMatching
from kvprof.traces.trace import Trajectory, read_trace

if TYPE_CHECKING:
    from kvprof.model.agents import AgentSet
    from kvprof.policies import PolicyVariant
    from kvprof.replay.checkpoint import Checkpoint
    from kvprof.replay.ray_cluster import RayCluster
    from kvprof.replay.setting import ReplaySettings
    from kvprof.results.tune_tau import TuneTauResult
    from kvprof.tuning.tau import Replayer

CHECKPOINT = "tune_tau.partial.json"
HELP = {
    "trace": "Prompt-mode trace: tuning then held-out trajectories [default: the demo's tuning trace].",
    "anchors": "Anchor pool from `kvprof fit-anchors` to start every row from [default: fit one on the tuning "
    "trajectories, saved to OUT/anchors.safetensors].",
    "tune": "Tuning trajectories: the first N [default: half]; the rest are held out.",
    "option": "KEY=VALUE: another option of the policy (e.g. chain=star), repeatable.",
    "max_accuracy_drop": "Target: accuracy at most P points below dense [default: 1].",
    "target_rho": "Target: matched reuse, the smallest ρ at least R (papers compare at 0.8).",
    "online": "Re-run the workflow per threshold (accuracy).",
    "ray": "Replay the sweep in shards on a Ray cluster (as kvprof replay --ray; each threshold is a stateful variant: "
    "the values run in as many sequential shards as the workers make fastest). The pool is fitted here.",
}


def command(
    trace: Annotated[Path | None, typer.Argument(help=HELP["trace"])] = None,
    policy: Annotated[str, typer.Option("--policy", help="Policy to tune: kvcmas (τ) or kvcomm (γ).")] = "kvcmas",
    grid: Annotated[str, typer.Option("--grid", help="Thresholds to sweep, comma-separated.")] = ",".join(tune_grid()),
    option: Annotated[list[str] | None, typer.Option("--option", help=HELP["option"])] = None,
    anchors: Annotated[Path | None, typer.Option("--anchors", help=HELP["anchors"])] = None,
    tune_count: Annotated[int | None, typer.Option("--tune", help=HELP["tune"])] = None,
    max_accuracy_drop: Annotated[
        float | None, typer.Option("--max-accuracy-drop", help=HELP["max_accuracy_drop"])
    ] = None,
    max_kl: Annotated[float | None, typer.Option("--max-kl", help="Target: KL at most X nats per token.")] = None,
    target_rho: Annotated[float | None, typer.Option("--target-rho", help=HELP["target_rho"])] = None,
    online: Annotated[bool, typer.Option("--online/--no-online", help=HELP["online"])] = True,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed repeats of each prefill.")] = 1,
    resume: Annotated[
        bool, typer.Option("--resume", help=f"Continue an interrupted sweep from OUT/{CHECKPOINT}.")
    ] = False,
    model: options.ModelOverrideOption = None,
    role: options.RoleOverrideOption = None,
    ray: Annotated[bool, typer.Option("--ray", help=HELP["ray"])] = False,
    ray_address: options.RayAddressOption = None,
    ray_workers: options.RayWorkersOption = None,
    ray_worker_cpus: options.RayWorkerCpusOption = 1,
    min_span: options.MinSpanOption = MIN_SPAN,
    span_boundaries: options.SpanBoundariesOption = "messages",
    out: options.OutOption = Path("runs/tune-tau"),
    device: options.DeviceOption = "auto",
    dtype: options.DtypeOption = "auto",
    threads: options.ThreadsOption = None,
    seed: options.SeedOption = 0,
    plan: planning.PlanOption = False,
) -> None:
    """Sweep the acceptance threshold (τ of KVCMAS, γ of KVComm): reuse ρ, per-layer error, KL, accuracy, TTFT,
    latency and memory per value; recommend the value with the most reuse that meets the target, verify it on the
    held-out trajectories, and write it to OUT/tuned.json for `kvprof replay --tuned`."""
    args = dict(locals())
    common.use_threads(threads)
    import torch

    from kvprof.model.agents import load_agents_for_trace, trace_header
    from kvprof.policies import policy_class
    from kvprof.replay.checkpoint import Checkpoint
    from kvprof.replay.ray_cluster import AgentSource, RayCluster
    from kvprof.replay.setting import ReplaySettings
    from kvprof.tuning import tau

    torch.manual_seed(seed)
    settings = ReplaySettings(repeats=repeats, online=online, span_matching=SpanMatching(min_span, span_boundaries))
    key, target = tau.threshold_key(policy), tau.Target.given(max_accuracy_drop, max_kl, target_rho)
    thresholds, options = tau.parse_grid(grid), tau.parse_options(policy, option or [])
    trace, model, trajectories = tuning_trace(args, trace, model)
    if planning.plan_first("tune-tau", args, trace, model).stop:
        return
    with ExitStack() as stack:
        cluster, worker = None, None
        if ray:
            source = AgentSource(trace_header(trace), str(trace), model, None, role, device, dtype, seed)
            cluster = RayCluster(source, ray_address, ray_workers, ray_worker_cpus, on_wait=common.note)
            worker = stack.enter_context(cluster).first()["identity"]
            device, dtype = "cpu", worker["dtype"]  # the pool is fitted here, in the dtype the workers accept
        agents = load_agents_for_trace(trace, model=model, role_flags=role, device=device, dtype=dtype)
        tuning, heldout = tau.split_trajectories(agents, trace, trajectories, tune_count)
        if anchors is None:
            anchors = fit_default_pool(agents, tuning, policy, options, out, settings.span_matching)
        # Ray workers open the pool themselves: at the same absolute path on every node.
        options["anchors"] = str(Path(anchors).resolve()) if cluster is not None else str(anchors)
        identity = tau.sweep_identity(
            trace, anchors, agents, policy, thresholds, options, len(tuning), settings, worker
        )
        checkpoint = Checkpoint(out / CHECKPOINT, identity, tau.SWEEP_SETTINGS)
        replayer: AbstractContextManager[Replayer] = (
            nullcontext(replayer_on_ray(cluster, checkpoint, resume, settings))
            if cluster is not None
            else replayer_here(agents, tuning, key, thresholds, checkpoint, resume, settings)
        )
        with replayer as replay:
            result = tau.tune(replay, tuning, heldout, policy_class(policy).name, options, thresholds, target, online)
    workers = None if cluster is None else cluster.workers_described()
    finish(out, result, args, trace, anchors, agents.model_name, checkpoint, workers)


def fit_default_pool(
    agents: AgentSet, tuning: list[Trajectory], policy: str, options: dict[str, str], out: Path, matching: SpanMatching
) -> Path:
    """`tau.fit_pool` on the tuning trajectories under a progress bar: the pool every row starts from."""
    from kvprof.tuning import tau

    with common.progress() as bar:
        job = bar.add_task("fitting anchors on the tuning trajectories", total=len(tuning))
        return tau.fit_pool(agents, tuning, policy, options, out, matching, lambda traj: bar.advance(job))


def tuning_trace(args: dict, trace: Path | None, model: str | None) -> tuple[Path, str | None, list[Trajectory]]:
    """The trace (the demo world's tuning trace by default, recorded in `args`), its model override and its
    trajectories, the whole trace validated before the model loads."""
    if trace is None:
        trace, model = common.demo_prompt_trace(model)
        args.update(trace=trace, model=model)
    return trace, model, read_trace(trace).trajectories


@contextmanager
def replayer_here(
    agents: AgentSet,
    tuning: list[Trajectory],
    key: str,
    thresholds: list[str],
    checkpoint: Checkpoint,
    resume: bool,
    settings: ReplaySettings,
) -> Iterator[Replayer]:
    """An in-process `Replayer` under `settings` and progress bars of option `key`'s `thresholds`, checkpointed per
    tuning trajectory, resuming from `checkpoint` with `resume`."""
    from kvprof.report.terminal import replay_progress
    from kvprof.tuning.tau import in_process

    state = displays.resumed_progress(checkpoint, resume, tuning, "tuning trajectories")
    label = f"replaying {len(thresholds)} values of {key} in lockstep"
    with replay_progress(label, tuning, len(thresholds), settings.online, state, checkpoint) as hooks:
        yield in_process(agents, settings, state, hooks)


def replayer_on_ray(cluster: RayCluster, checkpoint: Checkpoint, resume: bool, settings: ReplaySettings) -> Replayer:
    """A `Replayer` in shards on `cluster` under `settings`: each threshold is a stateful variant, grouped into
    sequential shards as the cluster's size makes fastest; checkpointed per shard (held-out check not), resuming with
    `resume`."""

    def replay(trajectories: Sequence[Trajectory], variants: list[PolicyVariant], sweep: bool) -> dict:
        what, saved = f"{len(variants)} variants", checkpoint if sweep else None
        result = displays.replay_on_ray(cluster, list(trajectories), variants, what, saved, resume and sweep, settings)
        result.pop("distributed")
        return result

    return replay


def finish(
    out: Path,
    result: TuneTauResult,
    args: dict,
    trace: Path,
    anchors: Path | str,
    model: str,
    checkpoint: Checkpoint,
    workers: list[dict] | None,
) -> None:
    """Show the sweep and recommendation, write tune_tau.json (Ray `workers` in its environment), .html and
    tuned.json; drop the checkpoint."""
    from kvprof.report import write_html
    from kvprof.report.anchors import sweep_table, tune_sections, verification_lines
    from kvprof.tuning.tuned import write_tuned

    result.trace, result.model, result.pool = str(trace), model, str(anchors)
    common.console.print(sweep_table(result).to_rich())
    for line in verification_lines(result):
        common.console.print(line, markup=False)
    path = common.write_result(out, "tune_tau", result, args, workers=workers)
    html = write_html(out / "tune_tau.html", "kvprof tune-tau", tune_sections(result), subtitle=str(trace))
    tuned = write_tuned(out, result)
    checkpoint.remove()
    common.console.print(f"wrote {', '.join(str(p) for p in (path, html, tuned) if p is not None)}")
