"""Replay in shards, merged into exactly `run_replay`'s single-process result (docs/commands/replay-ray.md): planning,
one shard's replay, checkpoints of finished shards, merging. No Ray here: the Ray backend is
`kvprof.replay.ray_cluster` (driver) and `kvprof.replay.ray_worker` (actors).

- Trajectory shard: one trajectory under every trajectory-independent variant, with its dense run.
- Sequential shard: stateful variants (`PolicyVariant.trajectory_independent` False) over every trajectory in order,
  with a dense run of their own (its records are the result's only when no trajectory shard exists); never split.
  `plan_shards` groups them for the least estimated wall time.

`merge` recomputes every summary with the library's own functions: per-turn records equal a single process's apart
from timings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kvprof.claims.memory import memory_verdicts
from kvprof.errors import KvprofError
from kvprof.model.agents import AgentSet
from kvprof.policies import PolicyVariant
from kvprof.replay.lockstep import ReplayProgress, replay_trace
from kvprof.replay.online import run_online, summarise_online
from kvprof.replay.records import DENSE
from kvprof.replay.setting import KernelCounts, ReplaySettings, run_setting
from kvprof.replay.summary import replay_result, summarise
from kvprof.results.replay import FUSED_EXPANSION, STORED_IN_SHORT_FORWARDS, ReplayResult, RunSummary, TurnRecord
from kvprof.traces.tasks import task_of
from kvprof.traces.trace import Segment, Trajectory, Turn


@dataclass
class Shard:
    """Trajectories replayed together on one worker under `variants`. `key` (checkpoints): `trajectory:ID` or
    `variant:LABEL + LABEL ...`."""

    key: str
    trajectories: list[Trajectory]
    variants: list[PolicyVariant]
    sequential: bool = False

    @property
    def turns(self) -> int:
        return sum(len(traj.turns) for traj in self.trajectories)

    @property
    def cost(self) -> int:
        """Turn replays (the dense run's and each variant's): what the driver hands out largest first."""
        return self.turns * (len(self.variants) + 1)

    def tasks(self, online: bool) -> int:
        """Online re-runs the shard does: each trajectory's task under the dense run and every variant."""
        return len(self.trajectories) * (len(self.variants) + 1) if online else 0


def sequential_shard(trajectories: list[Trajectory], variants: list[PolicyVariant]) -> Shard:
    """The stateful `variants` over every trajectory in order, in one shard."""
    return Shard("variant:" + " + ".join(v.label for v in variants), list(trajectories), variants, sequential=True)


def plan_shards(
    trajectories: list[Trajectory],
    variants: list[PolicyVariant],
    workers: int | None = None,
    groups: list[list[str]] | None = None,
) -> list[Shard]:
    """Trajectory shards, then sequential shards of the stateful variants: `groups` (a checkpoint's plan) if given,
    else the grouping of least `makespan` on `workers` (fewer groups on a tie; one per variant if `workers` is
    unknown)."""
    independent = [v for v in variants if v.trajectory_independent]
    stateful = [v for v in variants if not v.trajectory_independent]
    shards = (
        [Shard(f"trajectory:{traj.id}", [traj], independent) for traj in trajectories]
        if independent or not stateful
        else []
    )
    if groups is not None:
        by_label = {v.label: v for v in stateful}
        return shards + [sequential_shard(trajectories, [by_label[label] for label in group]) for group in groups]
    candidates = [
        shards + [sequential_shard(trajectories, group) for group in _split(stateful, count)]
        for count in range(1, len(stateful) + 1)
    ] or [shards]
    if workers is None:
        return candidates[-1]
    return min(candidates, key=lambda plan: makespan(plan, workers))  # min keeps the first: the fewest groups


def shard_groups(shards: list[Shard]) -> list[list[str]]:
    """Labels of each sequential shard's variants (a checkpoint records them)."""
    return [[variant.label for variant in shard.variants] for shard in shards if shard.sequential]


def _split(items: list[PolicyVariant], count: int) -> list[list[PolicyVariant]]:
    """`items` in order, cut into `count` runs whose lengths differ by at most one."""
    size, extra = divmod(len(items), count)
    cuts = [i * size + min(i, extra) for i in range(count + 1)]
    return [items[start:end] for start, end in zip(cuts, cuts[1:])]


def makespan(shards: list[Shard], workers: int) -> int:
    """Estimated wall time of `shards` on `workers` in turn replays, largest first to the first free worker (as
    `RayCluster.replay`)."""
    loads = [0] * max(workers, 1)
    for cost in sorted((shard.cost for shard in shards), reverse=True):
        loads[loads.index(min(loads))] += cost
    return max(loads)


@dataclass
class ShardResult:
    """A worker's answer for a shard: per-turn records (label → records, dense under `DENSE`), `policy_entry`s,
    online re-runs (label → trajectories) when asked, `run_setting`, worker id (`host:pid`)."""

    key: str
    progress: ReplayProgress
    entries: dict[str, dict]
    online: dict[str, list[Trajectory]] | None
    setting: dict
    worker: str

    def to_dict(self) -> dict:
        """JSON-ready, for a checkpoint."""
        return asdict(self) | {"progress": self.progress.to_json()}

    @classmethod
    def from_dict(cls, saved: dict, checkpoint: Path) -> ShardResult:
        """A result `to_dict` wrote into `checkpoint`."""
        online = saved["online"]
        return cls(
            key=saved["key"],
            progress=ReplayProgress.of_checkpoint(saved["progress"], checkpoint),
            entries=saved["entries"],
            online=None if online is None else {k: [_trajectory(t) for t in v] for k, v in online.items()},
            setting=saved["setting"],
            worker=saved["worker"],
        )


def _trajectory(saved: dict) -> Trajectory:
    """A trajectory from `asdict` (a checkpoint's online re-runs)."""
    segments = {key: Segment(**segment) for key, segment in saved["segments"].items()}
    return Trajectory(**(saved | {"segments": segments, "turns": [Turn(**turn) for turn in saved["turns"]]}))


def shard_checkpoint(results: dict[str, ShardResult], groups: list[list[str]]) -> dict:
    """A sharded replay's checkpoint record: completed shards' results and `shard_groups`."""
    return {"shards": {key: result.to_dict() for key, result in results.items()}, "groups": groups}


def saved_shards(progress: dict, checkpoint: Path) -> dict[str, ShardResult]:
    """The shard results of a `shard_checkpoint` record; another shape is refused in one sentence."""
    try:
        return {key: ShardResult.from_dict(result, checkpoint) for key, result in progress["shards"].items()}
    except (KeyError, TypeError, AttributeError):
        raise KvprofError(
            f"checkpoint {checkpoint} is not a sharded replay's checkpoint of this kvprof version; delete it to start "
            "again."
        ) from None


def resumable(
    saved: dict[str, ShardResult],
    groups: list[list[str]] | None,
    trajectories: list[Trajectory],
    variants: list[PolicyVariant],
) -> tuple[dict[str, ShardResult], list[list[str]]]:
    """What a replay resumes from a checkpoint: results that are exactly shards of its plan (another --limit's are
    replayed again) and the checkpoint's `groups` (one per variant if they miss a stateful variant)."""
    stateful = sorted(variant.label for variant in variants if not variant.trajectory_independent)
    if groups is not None and sorted(label for group in groups for label in group) != stateful:
        groups = None
    planned = {shard.key: shard for shard in plan_shards(trajectories, variants, groups=groups)}
    kept = {key: result for key, result in saved.items() if _replayed_whole(result, planned.get(key))}
    return kept, shard_groups(list(planned.values()))


def _replayed_whole(result: ShardResult, shard: Shard | None) -> bool:
    """Whether `result` is `shard` replayed (its trajectories in order, its variants, the dense run)."""
    return (
        shard is not None
        and result.progress.trajectories == [traj.id for traj in shard.trajectories]
        and set(result.progress.records) == {DENSE, *(variant.label for variant in shard.variants)}
    )


def run_shard(
    agents: AgentSet,
    shard: Shard,
    settings: ReplaySettings,
    on_turn: Callable[[], None] | None = None,
    on_task: Callable[[], None] | None = None,
    worker: str = "",
) -> ShardResult:
    """Replay `shard` here under `settings` (a worker's job): lockstep, then online re-runs when `settings.online`;
    `on_turn`, `on_task` called after each turn and online task."""
    state = ReplayProgress()
    started = KernelCounts.now()
    replayed = replay_trace(
        agents,
        shard.trajectories,
        shard.variants,
        settings,
        on_turn=(lambda traj, index: on_turn()) if on_turn else None,
        progress=state,
    )
    entries = {
        label: {key: value for key, value in entry.items() if key not in ("summary", "turns")}
        for label, entry in replayed["policies"].items()
    }
    runs = None
    if settings.online:
        runs = run_online(
            agents,
            [task_of(traj) for traj in shard.trajectories],
            shard.variants,
            settings,
            on_task=(lambda label, task: on_task()) if on_task else None,
        )
    setting = run_setting(agents, settings, started)
    return ShardResult(shard.key, state, entries, runs, setting, worker)


def _merged_records(
    shards: list[Shard], results: dict[str, ShardResult], variants: list[PolicyVariant], online: bool
) -> tuple[dict[str, list[TurnRecord]], dict[str, list[Trajectory]], dict[str, dict]]:
    """Per label, every shard's records and online re-runs in trace order, and each policy's entry (a sequential
    shard's dense run only when no trajectory shard ran one)."""
    trajectory_shards = [shard for shard in shards if not shard.sequential]
    records: dict[str, list[TurnRecord]] = {DENSE: [], **{variant.label: [] for variant in variants}}
    runs: dict[str, list[Trajectory]] = {label: [] for label in records}
    entries: dict[str, dict] = {}
    for shard in trajectory_shards:
        result = results[shard.key]
        for label in [DENSE, *(variant.label for variant in shard.variants)]:
            records[label] += result.progress.records[label]
            if online and result.online is not None:
                runs[label] += result.online[label]
        entries |= result.entries
    for shard in (shard for shard in shards if shard.sequential):
        result = results[shard.key]
        labels = [v.label for v in shard.variants]
        if not trajectory_shards and not records[DENSE]:
            labels.append(DENSE)
        for label in labels:
            records[label] = list(result.progress.records[label])
            if online and result.online is not None:
                runs[label] = list(result.online[label])
        for variant in shard.variants:
            entries[variant.label] = _sequential_entry(result.entries[variant.label], shard, variant.label)
    return records, runs, entries


def merge(shards: list[Shard], results: dict[str, ShardResult], variants: list[PolicyVariant], online: bool) -> dict:
    """`run_replay`'s payload from every shard's result: records in trace order, summaries recomputed (a sequential
    shard's policies' speed-ups against the dense run that ran beside them, on the same worker); setting as
    `_merged_setting`."""
    records, runs, entries = _merged_records(shards, results, variants, online)
    own_dense: dict[str, RunSummary] = {}
    for shard in (shard for shard in shards if shard.sequential):
        dense = summarise(results[shard.key].progress.records[DENSE])
        own_dense |= dict.fromkeys((variant.label for variant in shard.variants), dense)
    merged = replay_result(records, {variant.label: entries[variant.label] for variant in variants}, None, own_dense)
    if online:
        merged["online"] = summarise_online(runs)
    merged |= _merged_setting([results[shard.key].setting for shard in shards])
    merged["memory_claims"] = memory_verdicts(ReplayResult.of(merged))
    return merged


def _sequential_entry(entry: dict, shard: Shard, label: str) -> dict:
    """A sequential shard's policy entry, noting how it was replayed and beside which variants."""
    others = [variant.label for variant in shard.variants if variant.label != label]
    note = (
        f"keeps state across trajectories, so its {len(shard.trajectories)} trajectories were replayed in order in "
        "one shard, on one worker (not spread over workers), beside a dense run of its own that its speed-ups are "
        "measured against" + (f" (with {', '.join(others)})" if others else "")
    )
    return entry | {"notes": [*entry["notes"], note]}


def _merged_setting(settings: list[dict]) -> dict:
    """The first shard's setting, every worker's device named, the attention path naming the most of what ran in
    any shard (the fused expansion, short forwards over stored values) and, on CUDA, the highest allocator peak."""
    setting = dict(settings[0])
    setting["lora_attention"] = max(
        (s["lora_attention"] for s in settings),
        key=lambda path: (FUSED_EXPANSION in path) + (STORED_IN_SHORT_FORWARDS in path),
    )
    setting["device"] = ", ".join(dict.fromkeys(s["device"] for s in settings))
    readings = [s["gpu_memory"] for s in settings if s["gpu_memory"]]
    setting["gpu_memory"] = max(readings, key=lambda r: r["allocator_peak_bytes"]) if readings else None
    return setting
