"""The Ray actors of a sharded replay: `ReplayWorker` (loads the agents once, replays shards with
`kvprof.replay.shards.run_shard`) and `ShardCounter` (each shard's progress for the driver). The driver side:
`kvprof.replay.ray_cluster`.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

from kvprof.errors import KvprofError
from kvprof.kernels.expansion import expansion_path
from kvprof.model.agents import AgentSet, agents_identity
from kvprof.policies import PolicyVariant
from kvprof.replay.setting import ReplaySettings
from kvprof.replay.shards import Shard, run_shard

if TYPE_CHECKING:
    from kvprof.replay.ray_cluster import AgentSource


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
        settings: ReplaySettings,
    ):
        """`run_shard` under `settings`, reporting each turn and online task to the `ShardCounter` actor `counter`."""
        import torch

        torch.manual_seed(self.seed)
        counter.start.remote(shard.key, attempt)
        return run_shard(
            self._loaded(),
            shard,
            settings,
            on_turn=lambda: counter.advance.remote(shard.key, attempt, 1, 0),
            on_task=lambda: counter.advance.remote(shard.key, attempt, 0, 1),
            worker=f"{socket.gethostname()}:{os.getpid()}",
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
