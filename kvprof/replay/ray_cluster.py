"""The Ray backend of a sharded replay (`kvprof.replay.shards`, docs/commands/replay-ray.md), driver side:
`RayCluster` starts one `kvprof.replay.ray_worker.ReplayWorker` per device, each loading the model once from an
`AgentSource`; ids and records travel, caches never do; a lost worker's shard is retried elsewhere.
`replay_sharded` plans, replays and merges.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvprof.errors import KvprofError
from kvprof.model.agents import AgentSet, load_agents_for_header
from kvprof.policies import PolicyVariant
from kvprof.replay.ray_worker import ReplayWorker, ShardCounter
from kvprof.replay.setting import DEFAULT_SETTINGS, ReplaySettings
from kvprof.replay.shards import Shard, ShardResult, merge, plan_shards, shard_groups
from kvprof.traces.trace import TraceHeader, Trajectory

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
        settings: ReplaySettings,
        hooks: ShardHooks,
    ) -> dict[str, ShardResult]:
        """Replay shards without a result in `results` under `settings`, largest first; every shard's result."""
        ray = require_ray()
        online = settings.online
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
                    settings,
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
    settings: ReplaySettings = DEFAULT_SETTINGS,
    done: dict[str, ShardResult] | None = None,
    hooks: ShardHooks | None = None,
    groups: list[list[str]] | None = None,
) -> dict:
    """`run_replay`'s result for the same arguments, replayed in shards on `cluster` and merged; `done`: results
    already replayed (a checkpoint's); `groups`: sequential groups (`plan_shards`).

    Adds a `distributed` block: each shard's worker, sequential groups, retried shards, every worker's description.
    """
    shards = plan_shards(trajectories, variants, cluster.size, groups)
    results = cluster.replay(
        shards,
        {key: result for key, result in (done or {}).items() if key in {s.key for s in shards}},
        settings,
        hooks or ShardHooks(),
    )
    merged = merge(shards, results, variants, settings.online)
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
