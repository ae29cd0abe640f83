"""What `kvprof demo` runs beyond the commands' own steps: the policies each replay stage chooses, the lora workflow
with its adapters disabled, the two anchor pools of the prompt-role stage and the recommendation request over the
replays it wrote. The stages that use them: `kvprof.demo.stages`; the stage table: `kvprof.commands.demo`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvprof.capture.runner import trace_header
from kvprof.capture.workflow import exact_match
from kvprof.demo.assets import DemoWorld
from kvprof.demo.evaluate import load_condition, run_tasks
from kvprof.demo.world import DemoTask
from kvprof.model.agents import AgentSet
from kvprof.model.runtime import Runtime
from kvprof.policies import REGISTRY, PolicyVariant, enumerate_variants, runnable_variants
from kvprof.policies.variants import ALL
from kvprof.recommend.candidates import read_groups
from kvprof.recommend.run import RecommendRequest
from kvprof.recommend.serving import StepModel
from kvprof.recommend.target import parse_target
from kvprof.traces.trace import Trace, Trajectory, write_trace

LORA_FAMILIES = ("baseline", "LRAgent", "PReCache", "selective recompute")
ALORA_VARIANTS = (PolicyVariant("alorashared"), PolicyVariant("fullshared"), PolicyVariant("nonshared"))
# The prompt-role stage's pools: name, stored rank (None: full-dimensional, KVComm's), anchors per slot (KVComm's V,
# KVCMAS's V).
POOLS: tuple[tuple[str, int | None, int], ...] = (("full", None, 20), ("rank32", 32, 10))
# The demo's target: what a team might ask of its agents, at a load where, on the demo world's CPU timings, NonShared
# no longer keeps up (the sensitivity table shows where the choice changes).
DEMO_TARGET = "accuracy-drop<=1pt, kl<=0.01, ttft-p90<=150ms, load=16qps, optimise=throughput"
DEMO_SIMULATED_SECONDS = 30.0


def lora_variants(
    agents: AgentSet, families: tuple[str, ...] | None, sweep: bool
) -> tuple[list[PolicyVariant], dict[str, str]]:
    """Every `--policy all` variant (`sweep`) or every policy at its defaults, limited to `families` if given, that
    can replay on `agents`; and the skipped ones (label → reason)."""
    selection = [ALL] if sweep else list(REGISTRY)
    every = [v for v in enumerate_variants(selection) if families is None or v.policy.family in families]
    return runnable_variants(every, Runtime(agents), skip=True)


def prompt_variants(pools: dict[str, Path]) -> list[PolicyVariant]:
    """FullShared and the delta-correction policies over the prompt-role stage's `pools` (`POOLS` by name): KVComm
    and GraphFlow on the full-dimensional pool, KVCMAS chained and not on its rank-32 factors."""
    return [
        PolicyVariant("fullshared"),
        PolicyVariant("graphflow", {"anchors": str(pools["full"])}),
        PolicyVariant("kvcomm", {"anchors": str(pools["full"])}),
        PolicyVariant("kvcmas", {"chain": "chain", "anchors": str(pools["rank32"])}),
        PolicyVariant("kvcmas", {"chain": "star", "anchors": str(pools["rank32"])}),
    ]


def without_adapters(
    world: DemoWorld, tasks: list[DemoTask], device: str, dtype: str, path: Path, advance: Callable[[], None]
) -> list[Trajectory]:
    """The lora workflow on `tasks`, run by the base model with every adapter disabled, written as a trace at `path`;
    `advance` after each task."""
    agents = load_condition(world, "lora_disabled", device, dtype)
    trajectories = run_tasks(agents, "lora_disabled", tasks, advance)
    write_trace(path, Trace(trace_header(str(world.model), agents, extra={"adapters": "disabled"}), trajectories))
    return trajectories


def accuracy(trajectories: list[Trajectory]) -> float:
    """Exact-match accuracy of `trajectories`' predictions."""
    return sum(exact_match(traj.prediction, traj.answer) for traj in trajectories) / len(trajectories)


def recommend_request(replays: dict[str, Path], seed: int) -> RecommendRequest:
    """`kvprof recommend` over the replays (agent family → replay.json) for `DEMO_TARGET`, each replay's timings
    fitted, chosen on half of each replay's trajectories and confirmed on the other half (with two or more)."""
    results = [f"{family}={path}" for family, path in replays.items()]
    split = 0.5 if min(len(group.trajectories) for group in read_groups(results)) >= 2 else None  # else: no halves
    target = parse_target([DEMO_TARGET])
    return RecommendRequest(results, target, StepModel(fit_replay=True), DEMO_SIMULATED_SECONDS, split=split, seed=seed)
