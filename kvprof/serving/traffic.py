"""A trace as serving traffic: one completion per turn (exact input ids, exactly the recorded output length, EOS
ignored, greedy), trajectories arriving on a schedule. Patterns: `agents` (each agent's adapter: vLLM keys blocks
by adapter, NonShared's pattern) and `base` (the base model: FullShared's pattern, base-model outputs);
docs/commands/serve-bench.md.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvprof.errors import KvprofError
from kvprof.traces.trace import Trajectory

PATTERNS = ("agents", "base")


@dataclass(frozen=True)
class ServedModels:
    """The names the server serves the trace's models under: the base model and, in lora mode, agent → adapter."""

    base: str
    adapters: dict[str, str]

    def for_turn(self, agent: str, pattern: str) -> str:
        """The model a turn of `agent` names under `pattern`."""
        return self.adapters[agent] if pattern == "agents" and self.adapters else self.base


@dataclass(frozen=True)
class TurnRequest:
    """One turn: `prompt` input ids, `expected` output ids, `agent_turn` the agent's earlier turns (0: first),
    `index` its place in the trajectory."""

    trajectory: str
    index: int
    agent: str
    agent_turn: int
    model: str
    prompt: list[int]
    expected: list[int]


@dataclass(frozen=True)
class TrajectoryTraffic:
    """A trajectory's requests, sent in order: the next one when the previous one has answered, as agents do."""

    id: str
    turns: list[TurnRequest]


@dataclass(frozen=True)
class Load:
    """Arrivals: `qps` (Poisson, open loop) or `concurrency` (closed loop, the next when one finishes)."""

    kind: str
    value: float

    @property
    def label(self) -> str:
        return f"{self.value:g} qps" if self.kind == "qps" else f"{self.value:g} conc"


def loads(qps: list[float], concurrency: list[int]) -> list[Load]:
    """The loads a run sweeps, in the order given (Poisson rates first, then closed-loop concurrencies)."""
    for rate in qps:
        if rate <= 0:
            raise KvprofError(f"--qps {rate:g} is not a positive rate; pass trajectories per second, e.g. --qps 0.5.")
    for count in concurrency:
        if count < 1:
            raise KvprofError(f"--concurrency {count} is not a positive count; pass e.g. --concurrency 4.")
    return [Load("qps", rate) for rate in qps] + [Load("concurrency", count) for count in concurrency]


def trajectory_traffic(trajectories: list[Trajectory], pattern: str, models: ServedModels) -> list[TrajectoryTraffic]:
    """Every trajectory's turns as requests under `pattern` (one of `PATTERNS`)."""
    traffic = []
    for traj in trajectories:
        seen: dict[str, int] = {}
        turns = []
        for index, turn in enumerate(traj.turns):
            turns.append(
                TurnRequest(
                    trajectory=traj.id,
                    index=index,
                    agent=turn.agent,
                    agent_turn=seen.get(turn.agent, 0),
                    model=models.for_turn(turn.agent, pattern),
                    prompt=traj.input_tokens(turn),
                    expected=traj.output_tokens(turn),
                )
            )
            seen[turn.agent] = seen.get(turn.agent, 0) + 1
        traffic.append(TrajectoryTraffic(traj.id, turns))
    return traffic


def poisson_arrivals(count: int, qps: float, seed: int) -> list[float]:
    """Arrival times of `count` trajectories at rate `qps`: 0, then exponential gaps (mean 1/qps) from `seed`."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for index in range(count):
        if index:
            now += rng.expovariate(qps)
        times.append(now)
    return times
