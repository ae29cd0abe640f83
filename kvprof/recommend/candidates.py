"""The candidates of a recommendation: every replayed policy setting of every replay result, grouped by result, and
their accuracy and KL against NonShared over a set of tasks, with intervals as the decision card computes them
(`kvprof.report.decision`, `kvprof.report.uncertainty`).

Results of different traces (agent families: LoRA agents, aLoRA agents, role prompts) are compared only when each is
named (`NAME=RESULT`); their candidates are then called `NAME/label`. A trace is its path and its trajectories.
"""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import numpy as np

from kvprof.errors import KvprofError
from kvprof.report.decision import DENSE_ONLINE, kl_over_tasks, outcomes
from kvprof.report.styles import DENSE
from kvprof.report.uncertainty import Interval, paired_difference
from kvprof.results.replay import ReplayResult
from kvprof.simulate.workload import read_replay_result

NAMED = re.compile(r"^([A-Za-z][A-Za-z0-9_.-]*)=(.+)$")


@dataclasses.dataclass(frozen=True)
class ResultGroup:
    """One replay result: its name (`NAME=` on the command line; "" unnamed), path, result and trajectory ids;
    `with_dense`: NonShared is one of its candidates (of unnamed results of one trace, the first's only)."""

    name: str
    path: Path
    replay: ReplayResult
    trajectories: tuple[str, ...]
    with_dense: bool = True

    @property
    def labels(self) -> list[str]:
        """Its candidates' policy labels: NonShared first (`with_dense`), then the replayed policies in order."""
        policies = [label for label in self.replay.policies if label != DENSE]
        return [DENSE, *policies] if self.with_dense else policies

    def candidate(self, label: str) -> str:
        """The name of its candidate `label` in tables and the result: `NAME/label`, or `label` when unnamed."""
        return f"{self.name}/{label}" if self.name else label

    def identity(self) -> tuple[str, tuple[str, ...]]:
        """What makes two results replays of one trace: the trace's path and its trajectories."""
        return str(self.replay.trace or self.path), tuple(sorted(self.trajectories))


@dataclasses.dataclass(frozen=True)
class Quality:
    """A candidate's fidelity over `tasks` tasks: online accuracy (None without --online), its drop from the dense
    run's (paired over tasks; None without per-task results), KL(dense ‖ policy), replayed TTFT speed-up (single
    stream, dense ÷ policy)."""

    accuracy: Interval | None
    accuracy_drop: Interval | None
    kl: Interval
    ttft_speedup: Interval
    tasks: int


def _argument(argument: str) -> tuple[str, Path]:
    """(name, path) of a RESULT argument: `NAME=PATH` (when PATH is not itself an existing file) or `PATH`."""
    match = NAMED.match(argument)
    if match and not Path(argument).exists():
        return match.group(1), Path(match.group(2))
    return "", Path(argument)


def read_groups(arguments: list[str]) -> list[ResultGroup]:
    """The replay results named by `arguments`, refused in one sentence when results of different traces are mixed
    without a name each, a name repeats, or unnamed results of one trace replay the same policy label twice."""
    groups = []
    for argument in arguments:
        name, path = _argument(argument)
        replay = read_replay_result(path)
        ids = tuple(dict.fromkeys(str(turn.trajectory) for turn in replay.dense.turns))
        groups.append(ResultGroup(name, path, replay, ids))
    named = [group for group in groups if group.name]
    if named and len(named) != len(groups):
        raise KvprofError(
            f"name every result or none ({', '.join(str(g.path) for g in groups if not g.name)} "
            "has no name); pass each as NAME=RESULT."
        )
    names = [group.name for group in named]
    if len(set(names)) != len(names):
        raise KvprofError(f"the name {next(n for n in names if names.count(n) > 1)!r} is given twice; name each once.")
    if not named:
        _check_one_trace(groups)
        groups[1:] = [dataclasses.replace(group, with_dense=False) for group in groups[1:]]
    return groups


def _check_one_trace(groups: list[ResultGroup]) -> None:
    """Unnamed results must replay one trace and no policy label twice."""
    first = groups[0]
    for group in groups[1:]:
        if group.identity() != first.identity():
            raise KvprofError(
                f"{first.path} and {group.path} are replays of different traces ({first.identity()[0]}, "
                f"{group.identity()[0]}, or other trajectories); to compare them as agent families, name each: "
                f"kvprof recommend a={first.path} b={group.path} ..."
            )
    seen: dict[str, Path] = {}
    for group in groups:
        for label in group.replay.policies:
            if label != DENSE and label in seen:
                raise KvprofError(
                    f"policy {label!r} is replayed in both {seen[label]} and {group.path}; pass one of them, or name "
                    "each (NAME=RESULT)."
                )
            seen[label] = group.path


def split_trajectories(groups: list[ResultGroup], fraction: float, seed: int) -> dict[Path, tuple[set, set]]:
    """Per result: (trajectories to choose on, held-out trajectories), `fraction` of each trace chosen on, drawn
    with `seed` (the same draw for replays of one trace); refused when either part would be empty."""
    if not 0 < fraction < 1:
        raise KvprofError(f"--split {fraction:g} is not a fraction between 0 and 1; pass e.g. --split 0.5.")
    parts = {}
    for group in groups:
        ids = sorted(group.trajectories)
        random.Random(f"{seed}:{group.identity()[0]}").shuffle(ids)
        chosen = round(fraction * len(ids))
        if chosen < 1 or chosen >= len(ids):
            raise KvprofError(
                f"--split {fraction:g} of the {len(ids)} trajectories of {group.path} leaves one part empty; pass a "
                "result with more trajectories, another fraction, or no --split."
            )
        parts[group.path] = set(ids[:chosen]), set(ids[chosen:])
    return parts


def _within(replay: ReplayResult, tasks: set[str]) -> ReplayResult:
    """`replay` restricted to the trajectories `tasks`: turns, and online counts from the per-task results."""
    keep = [turn for turn in replay.dense.turns if str(turn.trajectory) in tasks]
    policies = {
        label: dataclasses.replace(run, turns=[t for t in run.turns if str(t.trajectory) in tasks])
        for label, run in replay.policies.items()
    }
    online = None
    if replay.online and all("exact" in entry for entry in replay.online.values()):
        online = {
            label: {"correct": sum(bool(entry["exact"][t]) for t in tasks), "tasks": len(tasks)}
            for label, entry in replay.online.items()
        }
    return dataclasses.replace(
        replay, dense=dataclasses.replace(replay.dense, turns=keep), policies=policies, online=online
    )


def _drop(replay: ReplayResult, label: str, tasks: list[str]) -> Interval | None:
    """The dense run's exact match − `label`'s over `tasks`, paired; None without per-task results. NonShared is
    its re-run when replayed as a policy, else the dense run itself (a drop of 0)."""
    online = replay.online or {}
    dense = online.get(DENSE_ONLINE)
    mine = online.get(label, dense if label == DENSE else None)
    if not mine or not dense or "exact" not in mine or "exact" not in dense:
        return None
    return paired_difference(np.array([[bool(dense["exact"][t]), bool(mine["exact"][t])] for t in tasks], dtype=float))


def quality(group: ResultGroup, tasks: set[str] | None = None) -> dict[str, Quality]:
    """Every candidate of `group` by label, over `tasks` (None: all of its trajectories)."""
    everything = tasks is None or set(group.trajectories) <= tasks
    chosen = list(group.trajectories) if tasks is None else [t for t in group.trajectories if t in tasks]
    replay = group.replay if everything else _within(group.replay, set(chosen))
    runs = {DENSE: replay.dense.turns} | {label: run.turns for label, run in replay.policies.items()}
    result = {}
    for outcome in outcomes(replay):
        result[outcome.label] = Quality(
            accuracy=outcome.accuracy,
            accuracy_drop=_drop(group.replay, outcome.label, chosen),
            kl=kl_over_tasks(runs[outcome.label]) if outcome.label in replay.policies else _zero(len(chosen)),
            ttft_speedup=outcome.ttft,
            tasks=len(chosen),
        )
    return result


def _zero(tasks: int) -> Interval:
    """The dense run against itself: KL 0 exactly."""
    return Interval(0.0, 0.0, 0.0, tasks)
