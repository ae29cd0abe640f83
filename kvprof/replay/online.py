"""Online re-runs: the workflow re-run on each trajectory's task under the dense run and each policy, errors
propagating to later agents (`run_online`), and their accuracy and divergence (`summarise_online`).
"""

from __future__ import annotations

from collections.abc import Callable

from kvprof.capture.workflow import SearchTool, exact_match, run_react
from kvprof.model.agents import AgentSet
from kvprof.model.runtime import Runtime
from kvprof.policies import PolicyVariant, SharingPolicy, TurnRequest
from kvprof.policies.nonshared import NonShared
from kvprof.replay.branches import FollowedTimeline
from kvprof.replay.lockstep import build_policies
from kvprof.replay.records import DENSE
from kvprof.replay.setting import DEFAULT_SETTINGS, ReplaySettings
from kvprof.traces.tasks import Task
from kvprof.traces.trace import Trajectory


def policy_responder(policy: SharingPolicy):
    """A responder serving each call of one task with `policy`, greedily; a call leaving the context keeps the
    common prefix (`FollowedTimeline`)."""
    timeline = FollowedTimeline(policy, policy.runtime.span_matching)

    def respond(agent: str, input_ids: list[int], max_new: int) -> list[int]:
        shared = input_ids[len(policy.runtime.prefix(agent)) :]
        moved = timeline.begin(shared)
        request = TurnRequest(
            agent=agent,
            input_ids=input_ids,
            max_new_tokens=max_new,
            moved=moved,
            boundaries=frozenset({len(input_ids)}),
        )
        outputs = policy.run_turn(request).output_ids
        timeline.end(shared + outputs)
        return outputs

    return respond


def run_online(
    agents: AgentSet,
    tasks: list[Task],
    variants: list[PolicyVariant],
    settings: ReplaySettings = DEFAULT_SETTINGS,
    on_task: Callable[[str, Task], None] | None = None,
) -> dict[str, list[Trajectory]]:
    """Re-run the workflow on `tasks` under the dense run ("dense") and each policy, attending and matching spans as
    `settings` say; returns trajectories."""
    runtime = Runtime(agents, settings.lora_attention, span_matching=settings.span_matching)
    runs: dict[str, SharingPolicy] = {DENSE: NonShared(runtime)}
    runs.update({policy.label: policy for policy in build_policies(runtime, variants)})
    tool = SearchTool()
    trajectories: dict[str, list[Trajectory]] = {label: [] for label in runs}
    for label, policy in runs.items():
        for task in tasks:
            runtime.serve_task(task)
            policy.reset()
            trajectories[label].append(run_react(agents.spec, agents.tokenizer, task, tool, policy_responder(policy)))
            if on_task:
                on_task(label, task)
    return trajectories


def summarise_online(runs: dict[str, list[Trajectory]]) -> dict[str, dict]:
    """Exact-match accuracy per run, whether each task (by trajectory id) was answered exactly, and the share of
    turns whose output differs from the dense run's."""
    result = {}
    for label, trajectories in runs.items():
        diverged = total = correct = 0
        exact = {}
        for dense_traj, traj in zip(runs[DENSE], trajectories):
            exact[traj.id] = exact_match(traj.prediction, traj.answer)
            correct += exact[traj.id]
            dense_outputs = [dense_traj.output_tokens(turn) for turn in dense_traj.turns]
            outputs = [traj.output_tokens(turn) for turn in traj.turns]
            for index in range(max(len(dense_outputs), len(outputs))):
                total += 1
                diverged += not (
                    index < len(dense_outputs) and index < len(outputs) and dense_outputs[index] == outputs[index]
                )
        result[label] = {
            "accuracy": correct / len(trajectories) if trajectories else None,
            "correct": correct,
            "tasks": len(trajectories),
            "diverged_turns": diverged / max(total, 1),
            "exact": exact,
        }
    return result
