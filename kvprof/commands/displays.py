"""Progress displays of the long runs several commands share: a capture, a replay in this process (resumed from its
checkpoint) and a replay on a Ray cluster."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from kvprof.ui import console, progress

if TYPE_CHECKING:
    from kvprof.capture.workflow import Sampling
    from kvprof.model.agents import AgentSet
    from kvprof.policies import PolicyVariant
    from kvprof.replay.checkpoint import Checkpoint
    from kvprof.replay.engine import ReplayHooks
    from kvprof.replay.lockstep import ReplayProgress
    from kvprof.replay.ray_cluster import RayCluster
    from kvprof.replay.setting import ReplaySettings
    from kvprof.results.capture import CaptureSummary
    from kvprof.traces.tasks import Task
    from kvprof.traces.trace import TraceHeader, Trajectory


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
    settings: ReplaySettings,
) -> dict:
    """`replay_sharded` on `cluster` under `settings` and one progress display (`what`: the variants), saving each
    completed shard to `checkpoint`, resuming from it with `resume`."""
    from kvprof.replay.ray_cluster import ShardHooks, replay_sharded
    from kvprof.replay.shards import plan_shards, shard_groups

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
        online = settings.online
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
        return replay_sharded(cluster, trajectories, variants, settings, done=done, hooks=hooks, groups=groups)


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
