"""The teacher-forced lockstep replay (`replay_trace`): the dense run and every policy over each trajectory's turns
side by side, each dense turn computed once, compared, released; its resumable state (`ReplayProgress`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.model.agents import AgentSet
from kvprof.model.architecture import weights_bytes
from kvprof.model.layers import LayerKind
from kvprof.model.runtime import Runtime
from kvprof.policies import PolicyVariant, SharingPolicy, TurnRequest
from kvprof.policies.base import tensor_bytes
from kvprof.policies.nonshared import NonShared
from kvprof.profiling import keep_freed_memory
from kvprof.replay.branches import BranchingTimeline, plan_of
from kvprof.replay.memory import paper_memory
from kvprof.replay.metrics import reused_from_others
from kvprof.replay.parking import StoreParking
from kvprof.replay.records import DENSE, compare_turn, moved_from_others
from kvprof.replay.setting import DEFAULT_SETTINGS, ReplaySettings
from kvprof.replay.summary import policy_entry, replay_result
from kvprof.replay.timing import TIMINGS, interleaved_prefills, run_trajectory, time_trajectory
from kvprof.results.replay import TurnRecord
from kvprof.traces.reuse import last_occurrence, message_boundaries
from kvprof.traces.trace import Trajectory, Turn


def require_invocations(runtime: Runtime, trajectories: Iterable[Trajectory]) -> None:
    """Refuse a trace whose Activated LoRA call lacks its invocation ids (peft would run it on the base model)."""
    for traj in trajectories:
        for index, turn in enumerate(traj.turns):
            tokens = runtime.invocations.get(turn.agent)
            if tokens is not None and last_occurrence(traj.input_tokens(turn), tokens) is None:
                raise KvprofError(
                    f"trajectory {traj.id!r} turn {index} ({turn.agent}): the input lacks the invocation ids "
                    f"{tokens} of {turn.agent}'s Activated LoRA, so its adapter would never act; capture the trace "
                    "with these adapters (their invocation is then in every call), or give the agent another adapter."
                )


def build_policies(runtime: Runtime, variants: Iterable[PolicyVariant]) -> list[SharingPolicy]:
    return [variant.build(runtime) for variant in variants]


TurnHook = Callable[[Trajectory, int], None]


@dataclass
class ReplayProgress:
    """Per-turn records of the trajectories replayed so far: a resumable checkpoint."""

    trajectories: list[str] = field(default_factory=list)
    records: dict[str, list[TurnRecord]] = field(default_factory=dict)
    memory_exact: dict[str, bool] = field(default_factory=dict)

    @classmethod
    def of_checkpoint(cls, progress: object, checkpoint: Path) -> ReplayProgress:
        """The progress a checkpoint records (`to_json`), refused in one sentence naming `checkpoint` if it is not
        one."""
        kinds = {"trajectories": list, "records": dict, "memory_exact": dict}
        fix = "delete it to start again"
        if (
            not isinstance(progress, dict)
            or set(progress) != set(kinds)
            or not all(isinstance(progress[key], kind) for key, kind in kinds.items())
            or not all(isinstance(traj_id, str) for traj_id in progress["trajectories"])
            or not all(isinstance(records, list) for records in progress["records"].values())
        ):
            raise KvprofError(f"checkpoint {checkpoint} is not a replay checkpoint of this kvprof version; {fix}.")
        records = {
            label: [
                TurnRecord.from_json(record, f"checkpoint {checkpoint}, {label} turn {index}", fix)
                for index, record in enumerate(turns)
            ]
            for label, turns in progress["records"].items()
        }
        return cls(progress["trajectories"], records, progress["memory_exact"])

    def to_json(self) -> dict:
        """The progress as a checkpoint records it."""
        return {
            "trajectories": list(self.trajectories),
            "records": {label: [record.to_json() for record in records] for label, records in self.records.items()},
            "memory_exact": dict(self.memory_exact),
        }


@dataclass
class Lockstep:
    """The dense run and every policy over a trajectory's turns side by side; `state` keeps each turn's records.
    `per_turn`: timed prefills per turn; `check_memory`: analytic memory checked against live tensors; `kinds`:
    each layer's kind (its window limits what the K/V error counts)."""

    runtime: Runtime
    dense: NonShared
    policies: list[SharingPolicy]
    state: ReplayProgress
    kinds: list[LayerKind]
    per_turn: int
    weights: int
    page_size: int
    check_memory: bool
    parking: StoreParking | None = None

    def holding(self, run: SharingPolicy) -> contextlib.AbstractContextManager[None]:
        """`run`'s stores resident (under a --kv-budget; the dense run's kept while the policies compare)."""
        return self.parking.holding(run, keep=self.dense) if self.parking else contextlib.nullcontext()

    def replay(self, traj: Trajectory, on_turn: TurnHook | None) -> None:
        """Every turn of `traj` under the dense run and every policy, from empty caches."""
        self.runtime.serve_trajectory(traj)
        for run in [self.dense, *self.policies]:
            with self.holding(run):  # a policy may keep state across trajectories (an anchor pool)
                run.reset()
        timeline = BranchingTimeline(
            plan_of(traj, self.runtime.prefixes, self.runtime.span_matching),
            [self.dense, *self.policies],
            self.holding,
        )
        for index, turn in enumerate(traj.turns):
            self.turn(traj, index, turn, timeline)
            if on_turn:
                on_turn(traj, index)

    def turn(self, traj: Trajectory, index: int, turn: Turn, timeline: BranchingTimeline) -> None:
        """One turn: the dense run's record, then each policy's against it."""
        outputs = traj.output_tokens(turn)
        start = timeline.begin(index)
        request = TurnRequest(
            turn.agent, traj.input_tokens(turn), outputs, moved=start.moved, boundaries=message_boundaries(traj, turn)
        )
        runs = [self.dense, *self.policies]
        # under a --kv-budget each run times its own prefills: round-robin would need every run's stores at once
        timed = [None] * len(runs) if self.parking else interleaved_prefills(runs, request, self.per_turn)
        with self.holding(self.dense):
            dense_result = self.dense.run_turn(request, self.per_turn, timed[0])
        self.state.records[DENSE].append(
            compare_turn(
                dense_result,
                dense_result,
                0,
                outputs,
                self.kinds,
                trajectory=traj.id,
                turn=index,
                memory=paper_memory(self.dense, dense_result, self.weights, self.page_size),
                start=start.to_json(),
            )
        )
        for policy, earlier in zip(self.policies, timed[1:]):
            with self.holding(policy):
                turn_result = policy.run_turn(request, self.per_turn, earlier)
            from_others = turn_result.from_others
            if from_others is None:
                from_others = (
                    reused_from_others(timeline.producers, turn.agent, turn_result.reused)
                    if policy.serves_others
                    else 0
                ) + moved_from_others(traj, start, turn_result, turn.agent)
            self.state.records[policy.label].append(
                compare_turn(
                    turn_result,
                    dense_result,
                    from_others,
                    outputs,
                    self.kinds,
                    trajectory=traj.id,
                    turn=index,
                    memory=paper_memory(policy, turn_result, self.weights, self.page_size),
                    moved_recomputed=start.moved_tokens - turn_result.moved,
                )
            )
            if self.check_memory:
                exact = tensor_bytes(policy.live_tensors()) == policy.analytic_bytes()
                self.state.memory_exact[policy.label] = self.state.memory_exact.get(policy.label, True) and exact
            timeline.finish(index, policy)
        shared_len = len(request.input_ids) - len(self.runtime.prefix(turn.agent))
        timeline.end(index, turn.agent, shared_len + len(outputs))


def replay_trace(
    agents: AgentSet,
    trajectories: Iterable[Trajectory],
    variants: list[PolicyVariant],
    settings: ReplaySettings = DEFAULT_SETTINGS,
    on_turn: TurnHook | None = None,
    check_memory: bool = False,
    progress: ReplayProgress | None = None,
    on_trajectory: Callable[[ReplayProgress], object] | None = None,
) -> dict:
    """Teacher-forced lockstep replay under `settings` (its `online` is `run_replay`'s). Returns
    {"dense": ..., "policies": {label: ...}} (and "kv_budget": what holding the stores within `settings.kv_budget`
    bytes moved, `kvprof.replay.parking`, where one is set).

    - `timing` "turn" (kvprof): TTFT the median of `repeats` prefills timed round-robin across the dense run and the
      policies after a warm-up round (`interleaved_prefills`); "trajectory"
      (PReCache's `bench/single_stream.py`): after the lockstep pass, each run replays each trajectory alone
      (`time_trajectory`) and summaries take the mean over its runs.
    - Memory as the papers report it per turn: `paper_memory`.
    - Turns that leave the shared context: `kvprof.replay.branches`; the dense records say where and why.
    - `progress`: trajectories already replayed are skipped; stateful variants replay them again unrecorded
      (`rebuild_state`).
    - `check_memory`: each policy's analytic bytes checked against its live tensors after every turn.
    """
    trajectories = list(trajectories)
    repeats, timing = settings.repeats, settings.timing
    runtime = Runtime(agents, settings.lora_attention, span_matching=settings.span_matching)
    require_invocations(runtime, trajectories)
    if runtime.device.type == "cpu":
        keep_freed_memory()
    dense = NonShared(runtime)
    policies = build_policies(runtime, variants)
    state = progress or ReplayProgress()
    for label in [DENSE] + [policy.label for policy in policies]:
        state.records.setdefault(label, [])
    if timing not in TIMINGS:
        raise ValueError(f"timing {timing!r} is not one of {TIMINGS}")
    per_turn = repeats if timing == "turn" else 1
    weights = weights_bytes(agents.model)
    timers = (
        {DENSE: NonShared(runtime), **{p.label: v.build(runtime) for p, v in zip(policies, variants)}}
        if timing == "trajectory"
        else {}
    )
    stateful = [policy for policy, variant in zip(policies, variants) if not variant.trajectory_independent]
    done = [traj for traj in trajectories if traj.id in state.trajectories]
    rebuild_state(runtime, stateful, done)
    stateful_timers = [timers[v.label] for v in variants if not v.trajectory_independent and v.label in timers]
    rebuild_state(runtime, stateful_timers, done, passes=repeats + 1)
    parking = StoreParking(settings.kv_budget) if settings.kv_budget is not None else None
    kinds, page_size = agents.layer_kinds, settings.page_size
    lockstep = Lockstep(runtime, dense, policies, state, kinds, per_turn, weights, page_size, check_memory, parking)
    for traj in trajectories:
        if traj.id in state.trajectories:
            continue
        lockstep.replay(traj, on_turn)
        if timers:
            for run in [dense, *policies]:
                run.reset()  # the lockstep runs' stored caches are released: each timed run holds only its own
            for label, timer in timers.items():
                records = state.records[label][-len(traj.turns) :]
                for record, (warm_up, runs) in zip(records, time_trajectory(timer, traj, repeats), strict=True):
                    record.warm_up, record.runs = warm_up, runs
        state.trajectories.append(traj.id)
        if on_trajectory:
            on_trajectory(state)
    result = replay_result(
        state.records,
        {policy.label: policy_entry(policy) for policy in policies},
        state.memory_exact if check_memory else None,
    )
    if parking:
        parking.close()
        result["kv_budget"] = parking.report.to_json()
    return result


def rebuild_state(
    runtime: Runtime, policies: list[SharingPolicy], trajectories: list[Trajectory], passes: int = 1
) -> None:
    """Replay `trajectories` under stateful `policies` unrecorded, each `passes` times, so a resumed replay reaches
    the state an uninterrupted one would."""
    for traj in trajectories if policies else []:
        runtime.serve_trajectory(traj)
        for _ in range(passes):
            for policy in policies:
                policy.reset()
            run_trajectory(runtime, policies, traj)
