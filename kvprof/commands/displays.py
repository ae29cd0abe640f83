"""Progress displays of the long runs several commands share beyond `kvprof.report.terminal`'s: a replay in this
process resumed from its checkpoint, and a replay on a Ray cluster."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvprof.ui import console, progress

if TYPE_CHECKING:
    from kvprof.policies import PolicyVariant
    from kvprof.replay.checkpoint import Checkpoint
    from kvprof.replay.lockstep import ReplayProgress
    from kvprof.replay.ray_cluster import RayCluster
    from kvprof.replay.setting import ReplaySettings
    from kvprof.traces.trace import Trajectory


def resumed_progress(
    checkpoint: Checkpoint, resume: bool, trajectories: list[Trajectory], what: str
) -> ReplayProgress | None:
    """With `resume`, the progress `checkpoint` holds (none if it does not exist), announced as the replayed `what`."""
    if not resume or not checkpoint.path.exists():
        return None
    state = checkpoint.read_progress([traj.id for traj in trajectories])
    console.print(f"resuming after {len(state.trajectories)} replayed {what}")
    return state


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
