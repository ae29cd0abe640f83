"""Replay sharded over a Ray cluster, merged into exactly `run_replay`'s single-process result
(docs/commands/replay-ray.md).

- Trajectory shard: one trajectory under every trajectory-independent variant, with its dense run.
- Sequential shard: stateful variants (`PolicyVariant.trajectory_independent` False) over every trajectory in order,
  with a dense run of their own (its records are the result's only when no trajectory shard exists); never split.
  `plan_shards` groups them for the least estimated wall time.

One worker per device loads the model once; ids and records travel, caches never do; a lost worker's shard is
retried elsewhere. `merge` recomputes every summary with the library's own functions: per-turn records equal a
single process's apart from timings.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvprof.claims.memory import memory_verdicts
from kvprof.errors import KvprofError
from kvprof.kernels.attention import EXPAND, LoraAttention
from kvprof.kernels.expansion import expansion_path
from kvprof.model.agents import AgentSet, agents_identity, load_agents_for_header
from kvprof.policies import PolicyVariant
from kvprof.replay.engine import (
    DENSE,
    PAGE_SIZE,
    KernelCounts,
    ReplayProgress,
    relative_to_dense,
    replay_result,
    replay_trace,
    run_online,
    run_setting,
    summarise,
    summarise_online,
)
from kvprof.results.replay import FIX, FUSED_EXPANSION, STORED_IN_SHORT_FORWARDS, PolicySummary, TurnRecord
from kvprof.traces.reuse import DEFAULT_MATCHING, SpanMatching
from kvprof.traces.tasks import task_of
from kvprof.traces.trace import Segment, TraceHeader, Trajectory, Turn

INSTALL = "pip install 'kvprof[ray]'"
ATTEMPTS = 3  # workers a shard may be lost on before the replay gives up
POLL_S = 0.2  # how often the driver reads the workers' progress
WAIT_NOTE_S = 60.0  # after this long without a loaded worker, `RayCluster.on_wait` is told once


def require_ray():
    """The `ray` module, or a `KvprofError` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise KvprofError(f"--ray needs Ray, which is not installed here; install it with {INSTALL}.") from None
    return ray


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
    repeats: int,
    online: bool,
    lora_attention: LoraAttention,
    on_turn: Callable[[], None] | None = None,
    on_task: Callable[[], None] | None = None,
    worker: str = "",
    timing: str = "turn",
    page_size: int = PAGE_SIZE,
    span_matching: SpanMatching = DEFAULT_MATCHING,
) -> ShardResult:
    """Replay `shard` here (a worker's job): lockstep, then online re-runs when `online`; other arguments as
    `replay_trace`'s."""
    state = ReplayProgress()
    started = KernelCounts.now()
    replayed = replay_trace(
        agents,
        shard.trajectories,
        shard.variants,
        repeats=repeats,
        on_turn=(lambda traj, index: on_turn()) if on_turn else None,
        progress=state,
        lora_attention=lora_attention,
        timing=timing,
        page_size=page_size,
        span_matching=span_matching,
    )
    entries = {
        label: {key: value for key, value in entry.items() if key not in ("summary", "turns")}
        for label, entry in replayed["policies"].items()
    }
    runs = None
    if online:
        runs = run_online(
            agents,
            [task_of(traj) for traj in shard.trajectories],
            shard.variants,
            on_task=(lambda label, task: on_task()) if on_task else None,
            lora_attention=lora_attention,
            span_matching=span_matching,
        )
    setting = run_setting(agents, repeats, lora_attention, timing, page_size, span_matching, started)
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
    """`run_replay`'s payload from every shard's result: records in trace order, summaries recomputed; setting as
    `_merged_setting`."""
    records, runs, entries = _merged_records(shards, results, variants, online)
    merged = replay_result(records, {variant.label: entries[variant.label] for variant in variants})
    for shard in shards:
        if shard.sequential:  # its speed-ups against the dense run that ran beside it, on the same worker
            own_dense = summarise(results[shard.key].progress.records[DENSE])
            for variant in shard.variants:
                summary = merged["policies"][variant.label]["summary"]
                summary.update(relative_to_dense(PolicySummary.from_json(summary, variant.label, FIX), own_dense))
    if online:
        merged["online"] = summarise_online(runs)
    merged |= _merged_setting([results[shard.key].setting for shard in shards])
    merged["memory_claims"] = memory_verdicts(merged)
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


@dataclass(frozen=True)
class AgentSource:
    """What every worker loads: the trace header (paths resolved on the driver, the same on every node), the
    command's overrides, device kind (a GPU worker sees only its GPU), dtype, seed."""

    header: TraceHeader
    trace_name: str
    model: str | None = None
    agent_flags: list[str] | None = None
    role_flags: list[str] | None = None
    device: str = "cpu"
    dtype: str = "auto"
    seed: int = 0

    def load(self) -> AgentSet:
        return load_agents_for_header(
            self.header,
            self.trace_name,
            model=self.model,
            agent_flags=self.agent_flags,
            role_flags=self.role_flags,
            device=self.device,
            dtype=self.dtype,
        )


def _absolute(path: str) -> str:
    return str(Path(path).resolve()) if Path(path).exists() else path


def absolute_source(source: AgentSource) -> AgentSource:
    """`source` with existing model and `--agent` paths made absolute (workers have other working directories; the
    files must be at those paths on every node)."""
    agent_flags = None
    if source.agent_flags is not None:
        agent_flags = [
            f"{name}={_absolute(folder)}" if sep else flag
            for flag in source.agent_flags
            for name, sep, folder in [flag.partition("=")]
        ]
    return replace(source, model=_absolute(source.model) if source.model else None, agent_flags=agent_flags)


def absolute_files(variants: list[PolicyVariant]) -> list[PolicyVariant]:
    """`variants` with every file option (pool, profile) made absolute (`absolute_source`)."""
    return [
        replace(
            variant,
            options={
                key: str(Path(value).resolve())
                if value and key in variant.policy.options and not variant.policy.options[key].labelled
                else value
                for key, value in variant.options.items()
            },
        )
        for variant in variants
    ]


class ReplayWorker:
    """Ray actor: loads the agents once, then replays shards. A `KvprofError` while loading is raised by the first
    call (not mistaken for a lost worker)."""

    def __init__(self, source: AgentSource, threads: int = 1):
        import torch

        torch.set_num_threads(threads)  # the CPUs Ray reserved for this worker
        torch.manual_seed(source.seed)
        self.seed = source.seed
        self.agents: AgentSet | None = None
        self.error: KvprofError | None = None
        try:
            self.agents = source.load()
        except KvprofError as err:
            self.error = err

    def _loaded(self) -> AgentSet:
        if self.agents is None:
            raise self.error or KvprofError("the replay worker did not load its agents.")
        return self.agents

    def describe(self) -> dict:
        """This worker: host, process, device, CPU, threads, software, `agents_identity`."""
        import platform

        import torch

        from kvprof.profiling import cpu_description

        agents = self._loaded()
        return {
            "id": f"{socket.gethostname()}:{os.getpid()}",
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "device": str(agents.device),
            "cuda": torch.cuda.get_device_name(agents.device) if agents.device.type == "cuda" else None,
            "cpu": cpu_description(),
            "cpu_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "identity": agents_identity(agents),
            "expansion": expansion_path(agents.device.type),
        }

    def runnable(self, variants: list[PolicyVariant], skip: bool) -> tuple[list[PolicyVariant], dict[str, str]]:
        """`kvprof.policies.runnable_variants` on this worker's agents."""
        from kvprof.model.runtime import Runtime
        from kvprof.policies import runnable_variants

        return runnable_variants(variants, Runtime(self._loaded()), skip)

    def run(
        self,
        shard: Shard,
        attempt: int,
        counter,
        repeats: int,
        online: bool,
        lora_attention: LoraAttention,
        timing: str,
        page_size: int,
        span_matching: SpanMatching,
    ):
        """`run_shard`, reporting each turn and online task to the `ShardCounter` actor `counter`."""
        import torch

        torch.manual_seed(self.seed)
        counter.start.remote(shard.key, attempt)
        return run_shard(
            self._loaded(),
            shard,
            repeats,
            online,
            lora_attention,
            on_turn=lambda: counter.advance.remote(shard.key, attempt, 1, 0),
            on_task=lambda: counter.advance.remote(shard.key, attempt, 0, 1),
            worker=f"{socket.gethostname()}:{os.getpid()}",
            timing=timing,
            page_size=page_size,
            span_matching=span_matching,
        )


class ShardCounter:
    """Ray actor holding each shard's progress for the driver; a retried shard restarts from zero under its new
    attempt, a lost attempt's reports are ignored."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}

    def start(self, key: str, attempt: int) -> None:
        self.counts[key] = [attempt, 0, 0]

    def advance(self, key: str, attempt: int, turns: int, tasks: int) -> None:
        count = self.counts.get(key)
        if count is not None and count[0] == attempt:
            count[1] += turns
            count[2] += tasks

    def snapshot(self) -> dict[str, list[int]]:
        return self.counts


@dataclass
class ShardHooks:
    """`replay_sharded`'s callbacks: `on_progress(turns, tasks)` (totals, resumed included), `on_shard(results)`
    (all results so far: a checkpoint), `on_event(line)` (a lost worker, a retry)."""

    on_progress: Callable[[int, int], object] | None = None
    on_shard: Callable[[dict[str, ShardResult]], object] | None = None
    on_event: Callable[[str], object] | None = None


@dataclass
class _Running:
    worker: str
    shard: Shard
    attempt: int


@dataclass
class RayCluster:
    """Replay workers on Ray. `__enter__` connects to `address`, RAY_ADDRESS, or a new local instance (a leftover
    `ray start` only with "auto"), and starts up to `workers` (default: one per GPU, else per `worker_cpus` CPUs,
    each running that many threads); `__exit__` (Ctrl-C too) kills them and stops a Ray it started. Reusable."""

    source: AgentSource
    address: str | None = None
    workers: int | None = None
    worker_cpus: int = 1
    on_wait: Callable[[str], object] | None = None
    handles: dict[str, Any] = field(default_factory=dict)
    described: dict[str, dict] = field(default_factory=dict)
    lost: list[dict] = field(default_factory=list)
    _starting: dict[Any, Any] = field(default_factory=dict)
    _started_ray: bool = False
    _counter: Any = None
    _actor: Any = None
    _options: dict = field(default_factory=dict)
    _capacity: int = 0

    def __enter__(self) -> RayCluster:
        try:
            return self._connect()
        except BaseException:
            self.__exit__()
            raise

    def _connect(self) -> RayCluster:
        ray = require_ray()
        if not ray.is_initialized():
            import logging

            address = self.address or os.environ.get("RAY_ADDRESS") or "local"
            try:
                ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
            except ConnectionError as err:
                raise KvprofError(
                    f"could not connect to a Ray cluster at {address!r} "
                    f"({err}); start one with `ray start --head`, pass its address (--ray-address or RAY_ADDRESS) "
                    "and, for a cluster with token authentication (Ray's default), set RAY_AUTH_MODE=token here."
                ) from None
            self._started_ray = True
        nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
        gpus, cpus = (int(sum(node.get(kind, 0) for node in nodes)) for kind in ("GPU", "CPU"))
        asked = self.source.device
        if asked.startswith("cuda") and not gpus:
            raise KvprofError(
                "--device asks for CUDA but the Ray cluster has no GPUs; pass --device cpu or connect to a "
                "cluster with GPUs (--ray-address)."
            )
        if asked == "auto" or asked.startswith("cuda"):  # a GPU worker sees its own GPU alone, as cuda:0
            self.source = replace(self.source, device="cuda" if gpus else "cpu")
        self._capacity = sum(  # per node: a worker's CPUs (and GPU) must be on one node
            min(int(node.get("GPU", 0)), int(node.get("CPU", 0)) // self.worker_cpus)
            if self.source.device == "cuda"
            else int(node.get("CPU", 0)) // self.worker_cpus
            for node in nodes
        )
        self._options = {"num_cpus": self.worker_cpus, "num_gpus": 1 if self.source.device == "cuda" else 0}
        if not self._capacity:
            raise KvprofError(
                f"--ray-worker-cpus {self.worker_cpus} is more than any node of the Ray cluster has "
                f"({max((int(node.get('CPU', 0)) for node in nodes), default=0)} CPUs at most); pass a smaller number."
            )
        if self.workers is not None and not 1 <= self.workers <= self._capacity:
            room = f"{gpus} GPUs" if self.source.device == "cuda" else f"{cpus} CPUs"
            room += "" if self.worker_cpus == 1 else f" at {self.worker_cpus} CPUs per worker"
            raise KvprofError(
                f"--ray-workers {self.workers} is not between 1 and the {self._capacity} "
                f"worker{'s' if self._capacity > 1 else ''} the cluster's {room} hold; pass a number in that range."
            )
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._counter = ray.remote(num_cpus=0)(ShardCounter).options(scheduling_strategy=here).remote()
        return self

    def __exit__(self, *exc) -> None:
        ray = require_ray()
        for handle in [*self.handles.values(), *self._starting.values(), self._counter]:
            if handle is not None:
                ray.kill(handle, no_restart=True)
        self.handles.clear()
        self._starting.clear()
        if self._started_ray:
            ray.shutdown()

    @property
    def size(self) -> int:
        """How many workers this cluster runs at most."""
        return self.workers or self._capacity

    def _start(self) -> None:
        ray = require_ray()
        self._actor = self._actor or ray.remote(ReplayWorker).options(**self._options)
        handle = self._actor.remote(self.source, self.worker_cpus)
        self._starting[handle.describe.remote()] = handle

    def first(self) -> dict:
        """Start one worker and wait until it has loaded the agents; its description (`ReplayWorker.describe`)."""
        if not self.described and not self._starting:
            self._start()
        waiting: float | None = time.monotonic()
        while not self.described:  # a worker that dies while loading is replaced (`_await_started`)
            self._await_started(timeout=WAIT_NOTE_S)
            if not self.described and waiting is not None and time.monotonic() - waiting >= WAIT_NOTE_S:
                waiting = None
                if self.on_wait:
                    room = "GPU" if self.source.device == "cuda" else f"{self.worker_cpus} CPU"
                    self.on_wait(
                        f"no Ray worker has loaded the model after {WAIT_NOTE_S:.0f} s; a worker needs one {room} "
                        "free on one node: if `ray status` shows none, other jobs hold them (kvprof keeps waiting)"
                    )
        return next(iter(self.described.values()))

    def runnable(self, variants: list[PolicyVariant], skip: bool) -> tuple[list[PolicyVariant], dict[str, str]]:
        """`kvprof.policies.runnable_variants` on a worker (the driver loads no model)."""
        self.first()
        ray = require_ray()
        return _get(ray, next(iter(self.handles.values())).runnable.remote(variants, skip))

    def _await_started(self, timeout: float | None) -> None:
        """Move loaded workers to `handles`, waiting up to `timeout` s (None: until one, 0: not at all)."""
        ray = require_ray()
        if not self._starting:
            return
        ready, _ = ray.wait(list(self._starting), num_returns=1, timeout=timeout)
        for ref in ready:
            handle = self._starting.pop(ref)
            try:
                info = _get(ray, ref)
            except _lost_errors(ray) as err:
                self.lost.append({"worker": "starting worker", "shard": None, "error": _first_line(err)})
                if len(self.lost) > ATTEMPTS * max(self.size, 1):
                    raise KvprofError(
                        f"replay workers keep dying while loading the model ({_first_line(err)}); see the Ray logs "
                        "(/tmp/ray/session_latest/logs) on the worker nodes."
                    ) from None
                self._start()
                continue
            if self.described:
                refuse_unlike_worker(next(iter(self.described.values())), info)
            self.handles[info["id"]] = handle
            self.described[info["id"]] = info

    def ready(self) -> dict[str, dict]:
        """Start every worker and wait until each has loaded (to time replay apart from start-up); descriptions by
        id."""
        self.first()
        while len(self.handles) + len(self._starting) < self.size:
            self._start()
        while self._starting:
            self._await_started(timeout=None)
        return dict(self.described)

    def workers_described(self) -> list[dict]:
        """Started workers' descriptions without their agents (a result's environment)."""
        return [{key: value for key, value in info.items() if key != "identity"} for info in self.described.values()]

    def replay(
        self,
        shards: list[Shard],
        results: dict[str, ShardResult],
        repeats: int,
        online: bool,
        lora_attention: LoraAttention,
        hooks: ShardHooks,
        timing: str = "turn",
        page_size: int = PAGE_SIZE,
        span_matching: SpanMatching = DEFAULT_MATCHING,
    ) -> dict[str, ShardResult]:
        """Replay shards without a result in `results`, largest first; every shard's result."""
        ray = require_ray()
        results = dict(results)
        pending = deque(sorted((shard for shard in shards if shard.key not in results), key=lambda s: -s.cost))
        attempts = {shard.key: 0 for shard in pending}
        running: dict[object, _Running] = {}
        self.first()
        while len(self.handles) + len(self._starting) < min(self.size, len(pending)):
            self._start()
        done_turns = sum(shard.turns for shard in shards if shard.key in results)
        done_tasks = sum(shard.tasks(online) for shard in shards if shard.key in results)
        if hooks.on_progress:
            hooks.on_progress(done_turns, done_tasks)
        while pending or running:
            self._await_started(timeout=None if not running and not self.handles else 0)
            busy = {run.worker for run in running.values()}
            for worker in [w for w in self.handles if w not in busy]:
                if not pending:
                    break
                shard = pending.popleft()
                attempts[shard.key] += 1
                ref = self.handles[worker].run.remote(
                    shard,
                    attempts[shard.key],
                    self._counter,
                    repeats,
                    online,
                    lora_attention,
                    timing,
                    page_size,
                    span_matching,
                )
                running[ref] = _Running(worker, shard, attempts[shard.key])
            ready, _ = ray.wait(list(running), num_returns=1, timeout=POLL_S) if running else ([], [])
            for ref in ready:
                run = running.pop(ref)
                try:
                    result = _get(ray, ref)
                except _lost_errors(ray) as err:
                    self._lose(run, err, hooks)
                    if attempts[run.shard.key] >= ATTEMPTS:
                        raise KvprofError(
                            f"shard {run.shard.key} was lost on {ATTEMPTS} workers (last: {_first_line(err)}); see "
                            "the Ray logs (/tmp/ray/session_latest/logs) on the worker nodes."
                        ) from None
                    pending.appendleft(run.shard)
                    continue
                results[run.shard.key] = result
                done_turns += run.shard.turns
                done_tasks += run.shard.tasks(online)
                if hooks.on_shard:
                    hooks.on_shard(results)
            if hooks.on_progress:
                counts = _get(ray, self._counter.snapshot.remote())
                current = [
                    counts[r.shard.key] for r in running.values() if counts.get(r.shard.key, [0])[0] == r.attempt
                ]
                hooks.on_progress(done_turns + sum(c[1] for c in current), done_tasks + sum(c[2] for c in current))
        return results

    def _lose(self, run: _Running, err: Exception, hooks: ShardHooks) -> None:
        """Forget a lost worker, start a replacement, record and announce the loss."""
        info = self.described.get(run.worker, {})
        self.handles.pop(run.worker, None)
        error = _first_line(err)
        self.lost.append({"worker": run.worker, "host": info.get("host"), "shard": run.shard.key, "error": error})
        self._start()
        if hooks.on_event:
            hooks.on_event(f"worker {run.worker} was lost ({_first_line(err)}); retrying shard {run.shard.key}")


def refuse_unlike_worker(first: dict, other: dict) -> None:
    """Refuse a worker whose agents (model, adapters, roles, dtype, device kind) differ from the first's, or that
    expands low-rank views another way (`expansion_path`: the shards' timings would mix)."""
    kind = dict(other["identity"], device=other["identity"]["device"].split(":")[0])
    if kind != dict(first["identity"], device=first["identity"]["device"].split(":")[0]):
        raise KvprofError(
            f"Ray worker {other['id']} loaded other agents than worker {first['id']} (model, adapters, role prompts, "
            "dtype or device kind differ); give every node the same model and adapter files at the same paths."
        )
    if other["expansion"] != first["expansion"]:
        raise KvprofError(
            f"Ray worker {other['id']} expands low-rank views with {other['expansion']} and worker {first['id']} with "
            f"{first['expansion']}, so their shards' timings would mix; give every node a C compiler (or set "
            "KVPROF_NATIVE=0 on all of them)."
        )


def _lost_errors(ray) -> tuple[type[Exception], ...]:
    """Errors of a call whose worker died (or Ray's memory monitor killed it), not one the call raised."""
    return (
        ray.exceptions.RayActorError,
        ray.exceptions.WorkerCrashedError,
        ray.exceptions.NodeDiedError,
        ray.exceptions.OutOfMemoryError,
    )


def _get(ray, ref):
    """`ray.get`, re-raising a `KvprofError` a worker raised as itself (one sentence, no traceback)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, KvprofError):
            raise err.cause from None
        raise


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def replay_sharded(
    cluster: RayCluster,
    trajectories: list[Trajectory],
    variants: list[PolicyVariant],
    repeats: int = 1,
    online: bool = False,
    lora_attention: LoraAttention = EXPAND,
    done: dict[str, ShardResult] | None = None,
    hooks: ShardHooks | None = None,
    groups: list[list[str]] | None = None,
    timing: str = "turn",
    page_size: int = PAGE_SIZE,
    span_matching: SpanMatching = DEFAULT_MATCHING,
) -> dict:
    """`run_replay`'s result for the same arguments, replayed in shards on `cluster` and merged; `done`: results
    already replayed (a checkpoint's); `groups`: sequential groups (`plan_shards`).

    Adds a `distributed` block: each shard's worker, sequential groups, retried shards, every worker's description.
    """
    shards = plan_shards(trajectories, variants, cluster.size, groups)
    results = cluster.replay(
        shards,
        {key: result for key, result in (done or {}).items() if key in {s.key for s in shards}},
        repeats,
        online,
        lora_attention,
        hooks or ShardHooks(),
        timing,
        page_size,
        span_matching,
    )
    merged = merge(shards, results, variants, online)
    used = dict.fromkeys(results[shard.key].worker for shard in shards)
    merged["distributed"] = {
        "shards": {shard.key: results[shard.key].worker for shard in shards},
        "sequential": shard_groups(shards),
        "retried": list(cluster.lost),
        "workers": [
            {key: value for key, value in cluster.described[worker].items() if key != "identity"}
            if worker in cluster.described
            else {
                "id": worker,
                "host": worker.rpartition(":")[0],
                "device": next(results[key].setting["device"] for key in results if results[key].worker == worker),
                "note": "replayed shards of the resumed checkpoint",
            }
            for worker in used
        ],
    }
    return merged
