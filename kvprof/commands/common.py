"""What the commands share: common options (--out, --device, --dtype, --seed, span matching, trace overrides, Ray),
the console, result files, terminal sections, and capture / replay progress displays."""

from __future__ import annotations

import datetime as _dt
import inspect
import platform
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

import kvprof
from kvprof.fileio import RESULT_SCHEMA, RESULT_VERSION, write_json
from kvprof.results.base import ResultFile
from kvprof.ui import console, progress

if TYPE_CHECKING:
    from kvprof.capture.workflow import Sampling
    from kvprof.model.agents import AgentSet
    from kvprof.policies import PolicyVariant
    from kvprof.replay.checkpoint import Checkpoint
    from kvprof.replay.engine import ReplayHooks, ReplayProgress
    from kvprof.replay.sharded import RayCluster
    from kvprof.report import Section
    from kvprof.results.capture import CaptureSummary
    from kvprof.results.replay import ReplayResult
    from kvprof.traces.tasks import Task
    from kvprof.traces.trace import TraceHeader, Trajectory

__all__ = [
    "AgentOverrideOption",
    "DeviceOption",
    "DtypeOption",
    "LimitOption",
    "MinSpanOption",
    "ModelOverrideOption",
    "OutOption",
    "RayAddressOption",
    "RayWorkerCpusOption",
    "RayWorkersOption",
    "RoleOverrideOption",
    "SeedOption",
    "SpanBoundariesOption",
    "TraceArgument",
    "capture_with_progress",
    "command_args",
    "console",
    "demo_prompt_trace",
    "demo_trace",
    "note",
    "print_adapters",
    "print_layers",
    "print_sections",
    "print_skipped",
    "progress",
    "replay_on_ray",
    "replay_progress",
    "resumed_progress",
    "result_envelope",
    "show_replay",
    "write_replay_page",
    "write_result",
]

OutOption = Annotated[Path, typer.Option("--out", help="Directory for results (created if missing).")]
DeviceOption = Annotated[str, typer.Option("--device", help="auto (CUDA if present, else CPU), cpu, cuda or cuda:N.")]
DtypeOption = Annotated[
    str,
    typer.Option("--dtype", help="Model dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16."),
]
SeedOption = Annotated[int, typer.Option("--seed", help="Random seed; a fixed seed gives identical results.")]
MinSpanOption = Annotated[
    int,
    typer.Option(
        "--min-span",
        help="The shortest run of ids, read again at other positions than a turn computed them, counted as a moved "
        "span (at least 8).",
    ),
]
SpanBoundariesOption = Annotated[
    str,
    typer.Option(
        "--span-boundaries",
        help="messages: a moved span begins and ends where a message (a segment of the trace) begins or ends, in the "
        "reading turn or in the turn it comes from, as chunk caches reuse whole messages; ids: any run of equal ids. "
        "Turns generated online (--online) are matched by ids.",
    ),
]

TraceArgument = Annotated[
    Path | None,
    typer.Argument(help="Trace (JSONL) from `kvprof capture` [default: the demo world's sample trace]."),
]
ModelOverrideOption = Annotated[str | None, typer.Option("--model", help="Override the trace's base model.")]
AgentOverrideOption = Annotated[
    list[str] | None,
    typer.Option(
        "--agent",
        help="NAME=ADAPTER_DIR: override an agent's adapter (lora mode, e.g. a shared-A set). Repeat per agent.",
    ),
]
RoleOverrideOption = Annotated[list[str] | None, typer.Option("--role", help="NAME=PROMPT: override a role prompt.")]
LimitOption = Annotated[int | None, typer.Option("--limit", help="Use only the first N trajectories.")]
RayAddressOption = Annotated[
    str | None,
    typer.Option(
        "--ray-address",
        help="With --ray: the cluster's address (HOST:PORT, ray://HOST:PORT, auto: the cluster `ray start` "
        "started on this machine, local: a new instance here) [default: RAY_ADDRESS, else local].",
    ),
]
RayWorkersOption = Annotated[
    int | None,
    typer.Option(
        "--ray-workers", help="With --ray: how many workers [default: one per GPU, else per --ray-worker-cpus]."
    ),
]
RayWorkerCpusOption = Annotated[
    int,
    typer.Option("--ray-worker-cpus", min=1, help="With --ray: CPUs (and threads) each worker holds [default: 1]."),
]


def result_envelope(kind: str, payload: dict, args: dict, workers: list[dict] | None = None) -> dict:
    """The schema-versioned wrapper of every JSON result; `workers`: a distributed run's Ray workers."""
    import torch

    from kvprof.profiling import cpu_description

    envelope = {
        "schema": f"{RESULT_SCHEMA}{kind}",
        "version": RESULT_VERSION,
        "kvprof": kvprof.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cpu": cpu_description(),
            "cpu_threads": torch.get_num_threads(),
        },
        "args": {key: str(value) if isinstance(value, Path) else value for key, value in args.items()},
        **payload,
    }
    if workers is not None:
        envelope["environment"]["workers"] = workers
    return envelope


def write_result(
    out: Path, kind: str, payload: dict | ResultFile, args: dict, workers: list[dict] | None = None
) -> Path:
    """Write `OUT/<kind>.json` atomically (`result_envelope`) and return its path; a typed result writes its JSON."""
    if isinstance(payload, ResultFile):
        assert payload.KIND == kind, f"a {payload.KIND} result written as {kind}"
        payload = payload.to_json()
    return write_json(out / f"{kind}.json", result_envelope(kind, payload, args, workers))


def command_args(name: str, **given) -> dict:
    """The `args` a `kvprof NAME` result records with options `given`, defaults for the rest (read from the typer
    app, so no command imports another): what a demo stage records."""
    from kvprof.cli import app

    (command,) = [entry.callback for entry in app.registered_commands if entry.name == name]
    assert command is not None, f"kvprof {name} has no callback"
    defaults = {key: parameter.default for key, parameter in inspect.signature(command).parameters.items()}
    unknown = given.keys() - defaults.keys()
    if unknown:
        raise TypeError(f"kvprof {name} has no options {', '.join(sorted(unknown))}")
    return defaults | given


def note(line: str) -> None:
    """A line the user should notice (a wait, a retry), in yellow and without markup."""
    console.print(line, style="yellow", markup=False)


def print_adapters(agents: AgentSet) -> None:
    """One line per agent that runs a LoRA adapter: the adapter's folder, rank, alpha, projections and layers."""
    for name, info in agents.adapters.items():
        console.print(f"agent [bold]{name}[/]: adapter {info.path} ({info.describe()}, {info.layers} layers)")


def print_layers(agents: AgentSet) -> None:
    """The model's layers by kind (attention, window, position encoding: `kvprof.model.layers.describe_layers`)."""
    from kvprof.model.layers import describe_layers

    console.print(f"model {agents.model_name}: {describe_layers(agents.layer_kinds)}", markup=False)


def print_sections(sections: list[Section]) -> None:
    """Dashboard sections on the terminal: title rule, card, text, tables (no figures)."""
    for section in sections:
        console.rule(section.title)
        for line in section.card:
            console.print(line, style="bold", markup=False)
        for line in section.text:
            console.print(line)
        for table in section.tables:
            console.print(table.to_rich())


def demo_trace(model: str | None) -> tuple[Path, str | None]:
    """The demo's short lora-mode trace (and its model unless --model): the default TRACE."""
    from kvprof.demo.assets import demo_world

    world = demo_world()
    return world.sample_traces["lora_short"], model or str(world.model)


def demo_prompt_trace(model: str | None) -> tuple[Path, str | None]:
    """The demo's prompt-mode tuning trace (and its model unless --model): fit-anchors' and tune-tau's default."""
    from kvprof.demo.assets import demo_world

    world = demo_world()
    return world.sample_traces["prompt_tune"], model or str(world.model)


def print_skipped(skipped: dict[str, str]) -> None:
    """One line per refusal reason, naming the variants it skipped."""
    for reason in dict.fromkeys(skipped.values()):
        labels = ", ".join(label for label, why in skipped.items() if why == reason)
        console.print(f"[yellow]skipped {labels}[/]: {reason}")


def capture_with_progress(
    agents: AgentSet,
    tasks: list[Task],
    trace_path: Path,
    header: TraceHeader,
    sampling: Sampling,
    resumed: Sequence[Trajectory] = (),
) -> tuple[list[Trajectory], CaptureSummary]:
    """`capture_trajectories` under a progress bar, timed, trace table printed; the trajectories and summary."""
    from kvprof.capture.runner import capture_trajectories, trajectory_summary
    from kvprof.report.capture import trace_table

    started = time.perf_counter()
    with progress() as bar:
        job = bar.add_task("capturing", total=len(tasks), completed=len(resumed))
        captured = capture_trajectories(
            agents,
            tasks,
            trace_path,
            header,
            sampling,
            resumed,
            on_task=lambda task: bar.update(job, description=f"task {task.id}"),
            on_turn=lambda traj, turn: bar.update(job, description=f"task {traj.id}: {turn.agent}"),
            on_trajectory=lambda traj: bar.advance(job),
        )
    summary = trajectory_summary(captured, time.perf_counter() - started)
    console.print(trace_table(summary).to_rich())
    return captured, summary


def resumed_progress(
    checkpoint: Checkpoint, resume: bool, trajectories: list[Trajectory], what: str
) -> ReplayProgress | None:
    """With `resume`, the progress `checkpoint` holds (none if it does not exist), announced as the replayed `what`."""
    if not resume or not checkpoint.path.exists():
        return None
    state = checkpoint.read_progress([traj.id for traj in trajectories])
    console.print(f"resuming after {len(state.trajectories)} replayed {what}")
    return state


@contextmanager
def replay_progress(
    label: str,
    trajectories: list[Trajectory],
    variants: int,
    online: bool,
    state: ReplayProgress | None = None,
    checkpoint: Checkpoint | None = None,
) -> Iterator[ReplayHooks]:
    """Progress bars of an in-process replay (turns; online re-runs with `online`), counting `state`'s as done;
    yields the hooks, which also save each trajectory to `checkpoint`."""
    from kvprof.replay.engine import ReplayHooks

    with progress() as bar:
        job = bar.add_task(label, total=sum(len(t.turns) for t in trajectories))
        bar.update(job, completed=sum(len(t.turns) for t in trajectories if state and t.id in state.trajectories))
        online_job = bar.add_task("online re-runs", total=len(trajectories) * (variants + 1)) if online else None
        yield ReplayHooks(
            on_turn=lambda traj, index: bar.advance(job),
            # online_job is None only without online re-runs, when on_task is never called.
            on_task=(lambda label, task: bar.advance(online_job)) if online_job is not None else None,
            on_trajectory=checkpoint.save_progress if checkpoint is not None else None,
        )


def replay_on_ray(
    cluster: RayCluster,
    trajectories: list[Trajectory],
    variants: list[PolicyVariant],
    what: str,
    checkpoint: Checkpoint | None,
    resume: bool,
    online: bool = False,
    **settings,
) -> dict:
    """`replay_sharded` on `cluster` under one progress display (`what`: the variants; `settings`: other arguments),
    saving each completed shard to `checkpoint`, resuming from it with `resume`."""
    from kvprof.replay.sharded import ShardHooks, plan_shards, replay_sharded, shard_groups

    done, groups = None, None
    if checkpoint is not None and resume and checkpoint.path.exists():
        done, groups = checkpoint.read_shards(trajectories, variants)
    shards = plan_shards(trajectories, variants, cluster.size, groups)
    groups = shard_groups(shards)
    if done is not None:
        console.print(f"resuming after {len(done)} of {len(shards)} replayed shards")
    _print_groups(groups)
    with progress() as bar:
        label = f"replaying {what} in {len(shards)} shards on up to {cluster.size} Ray workers"
        job = bar.add_task(label, total=sum(shard.turns for shard in shards))
        online_job = bar.add_task("online re-runs", total=sum(s.tasks(online) for s in shards)) if online else None

        def show_progress(turns: int, tasks: int) -> None:
            bar.update(job, completed=turns)
            if online_job is not None:
                bar.update(online_job, completed=tasks)

        hooks = ShardHooks(
            on_progress=show_progress,
            on_shard=(lambda results: checkpoint.save_shards(results, groups)) if checkpoint is not None else None,
            on_event=lambda line: bar.console.print(f"[yellow]{line}[/]"),
        )
        return replay_sharded(
            cluster, trajectories, variants, online=online, done=done, hooks=hooks, groups=groups, **settings
        )


def _print_groups(groups: list[list[str]]) -> None:
    """One line per sequential shard: its variants keep state across trajectories."""
    for group in groups:
        console.print(
            f"{', '.join(group)} {'keeps' if len(group) == 1 else 'keep'} state across trajectories: "
            + (
                "it replays its trajectories in order in one shard, on one worker"
                if len(group) == 1
                else "they replay their trajectories in order, side by side in one shard, on one worker"
            )
        )


def show_replay(result: ReplayResult) -> None:
    """A replay's terminal output: a warning if the dense run does not reproduce a captured trace, then the tables."""
    from kvprof.report.replay import (
        cost_table,
        delta_table,
        dense_check,
        fidelity_table,
        memory_claims_table,
        policy_notes,
        reuse_table,
        timeline_note,
    )

    check = dense_check(result)
    if check.startswith("WARNING"):
        console.print(f"[bold red]{check}[/]")
    timeline = timeline_note(result)
    if timeline:
        console.print(timeline)
    console.print(fidelity_table(result).to_rich())
    console.print(reuse_table(result).to_rich())
    delta = delta_table(result)
    if delta is not None:
        console.print(delta.to_rich())
    console.print(cost_table(result).to_rich())
    claims = memory_claims_table(result)
    if claims is not None:
        console.print(claims.to_rich())
    for line in policy_notes(result):
        console.print(line)


def write_replay_page(out: Path, result: ReplayResult) -> Path:
    """OUT/replay.html: a replay's dashboard page."""
    from kvprof.report import write_html
    from kvprof.report.replay import sections

    return write_html(out / "replay.html", "kvprof replay", sections(result), subtitle=result.trace or "")
