"""The replay engine: a trace turn by turn under sharing policies, measured against the dense (NonShared) run.

Teacher-forced (`kvprof.replay.lockstep.replay_trace`): the dense run and every policy in lockstep, each dense turn
computed once, compared, released. Online (`kvprof.replay.online.run_online`): the workflow re-run under each
policy, errors propagating. `run_replay` does both and records how the replay ran (`kvprof.replay.setting`);
`replay_file`, `kvprof replay`'s step, returns it as the `ReplayResult` naming its trace. Metrics:
`kvprof.replay.metrics`, docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvprof.capture.workflow import require_react_agents
from kvprof.claims.memory import memory_verdicts
from kvprof.errors import KvprofError
from kvprof.model.agents import AgentSet, trace_header
from kvprof.policies import PolicyVariant
from kvprof.replay.branches import require_one_timeline
from kvprof.replay.lockstep import ReplayProgress, TurnHook, replay_trace
from kvprof.replay.online import run_online, summarise_online
from kvprof.replay.setting import DEFAULT_SETTINGS, KernelCounts, ReplaySettings, run_setting
from kvprof.results.replay import ReplayResult
from kvprof.threads import LoadMeter
from kvprof.traces.tasks import Task, task_of
from kvprof.traces.trace import Trajectory, iter_trajectories, read_header


@dataclass
class ReplayHooks:
    """`run_replay`'s progress callbacks: per teacher-forced turn, online task, trajectory."""

    on_turn: TurnHook | None = None
    on_task: Callable[[str, Task], None] | None = None
    on_trajectory: Callable[[ReplayProgress], object] | None = None


def run_replay(
    agents: AgentSet,
    trajectories: list[Trajectory],
    variants: list[PolicyVariant],
    settings: ReplaySettings = DEFAULT_SETTINGS,
    progress: ReplayProgress | None = None,
    hooks: ReplayHooks | None = None,
) -> dict:
    """`kvprof replay`'s payload under `settings`: the lockstep replay (its stores within `settings.kv_budget` bytes
    where set), the online re-runs when `settings.online`, and the run's setting. `progress`: a checkpoint's,
    resumed."""
    hooks = hooks or ReplayHooks()
    if settings.online:
        require_react_agents(agents.spec.names)
    started = KernelCounts.now()
    meter = LoadMeter()
    result = replay_trace(
        agents,
        trajectories,
        variants,
        settings,
        on_turn=hooks.on_turn,
        progress=progress,
        on_trajectory=hooks.on_trajectory,
    )
    timed_load = meter.reading()
    if settings.online:
        runs = run_online(agents, [task_of(t) for t in trajectories], variants, settings, on_task=hooks.on_task)
        result["online"] = summarise_online(runs)
    result.update(run_setting(agents, settings, started, timed_load))
    result["memory_claims"] = memory_verdicts(ReplayResult.of(result))
    return result


def replay_file(
    trace: Path,
    agents: AgentSet,
    trajectories: list[Trajectory],
    variants: list[PolicyVariant],
    settings: ReplaySettings = DEFAULT_SETTINGS,
    *,
    skipped: dict[str, str] | None = None,
    self_check: dict[str, float] | None = None,
    progress: ReplayProgress | None = None,
    hooks: ReplayHooks | None = None,
) -> ReplayResult:
    """`kvprof replay`'s step: `run_replay` of `trajectories` (read from `trace`) under `variants`, as the
    `ReplayResult` naming the trace, the `skipped` variants and the `self_check` errors (`with_trace`)."""
    replayed = run_replay(agents, trajectories, variants, settings, progress, hooks)
    return with_trace(replayed, trace, skipped or {}, self_check)


def replayed_trajectories(trace: Path, skip: int, limit: int | None, online: bool, strict: bool) -> list[Trajectory]:
    """The trace's trajectories after `skip`, at most `limit`; `online` requires a ReAct workflow's agents, `strict`
    one timeline per trajectory. Read from the trace alone, before a model loads."""
    trajectories = list(iter_trajectories(trace))[skip:][:limit]
    if not trajectories:
        raise KvprofError(f"--skip {skip} leaves none of the trace's trajectories to replay; skip fewer.")
    if online:
        require_react_agents(trace_header(trace).agent_names)
    if strict:
        require_one_timeline(trajectories, trace_header(trace).mode)
    return trajectories


def with_trace(result: dict, trace: Path, skipped: dict[str, str], self_check: dict[str, float] | None) -> ReplayResult:
    """The `ReplayResult` from a replay's JSON, naming the trace and its source, `skipped` variants (label →
    reason) and self-check errors (label → error; None: not checked)."""
    named = result | dict(trace=str(trace), trace_source=read_header(trace).source, skipped=skipped)
    return ReplayResult.from_json(named | {"self_check": self_check}, f"the replay of {trace}", "rerun kvprof replay")
