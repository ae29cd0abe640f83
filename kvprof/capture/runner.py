"""Capture: run a multi-agent workflow on tasks with real generation and write the trajectories as a trace.

A capture streams its trace to TRACE (e.g. `trace.jsonl`; the file appears, complete, only at the end) and keeps a
checkpoint beside it (`trace.partial.jsonl`, flushed after every task) that an interrupted capture resumes from.
Task i samples with seed `sampling.seed + i`, so a resumed trace is byte-identical to an uninterrupted one.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvprof.capture.workflow import Sampling, SearchTool, exact_match, model_responder, run_react
from kvprof.errors import KvprofError
from kvprof.model.agents import AgentSet, load_agents, tokenizer_identity
from kvprof.results.capture import CaptureSummary
from kvprof.traces.chat import resolve_chat_template
from kvprof.traces.spec import WorkflowSpec, build_spec, check_react_roles
from kvprof.traces.tasks import Task, load_tasks
from kvprof.traces.trace import (
    PartialTrace,
    TraceHeader,
    TraceWriter,
    Trajectory,
    Turn,
    header_record,
    read_partial_trace,
    shared_segment_ids,
)


@dataclass(frozen=True)
class CaptureSetup:
    """What a capture runs (`prepare_capture`): the agents, the tasks, the trace's header and the sampling."""

    agents: AgentSet
    tasks: list[Task]
    header: TraceHeader
    sampling: Sampling


def prepare_capture(
    model: str,
    workflow: Path | None,
    tasks: Path,
    limit: int | None,
    sampling: Sampling,
    *,
    agent_flags: list[str] | None = None,
    role_flags: list[str] | None = None,
    max_rounds: int | None = None,
    max_new_tokens: int | None = None,
    chat_template: str = "auto",
    device: str = "auto",
    dtype: str = "auto",
    attn: str = "sdpa",
) -> CaptureSetup:
    """`kvprof capture`'s step before any generation: the workflow (`capture_spec`), the first `limit` tasks of
    `tasks`, the agents loaded from `model` and rendering through `chat_template` (`use_chat_template`), and the
    header of the trace they will write (`sampled_trace_header`). The run itself: `capture_trajectories`."""
    spec = capture_spec(workflow, agent_flags, role_flags, max_rounds, max_new_tokens)
    task_list = load_tasks(tasks, limit)
    agents = load_agents(spec, model, device=device, dtype=dtype, attn=attn)
    use_chat_template(agents, chat_template, workflow)
    return CaptureSetup(agents, task_list, sampled_trace_header(model, agents, sampling), sampling)


def capture_spec(
    workflow: Path | None = None,
    agent_flags: list[str] | None = None,
    role_flags: list[str] | None = None,
    max_rounds: int | None = None,
    max_new_tokens: int | None = None,
) -> WorkflowSpec:
    """The capture's workflow from a TOML file and flags (`build_spec`), limits replaced; refuses unknown roles."""
    spec = build_spec(workflow, agent_flags, role_flags)
    if max_rounds is not None:
        spec.max_rounds = max_rounds
    if max_new_tokens is not None:
        spec.max_new_tokens = max_new_tokens
    check_react_roles(spec, "" if workflow is None else f"workflow file {workflow}: ")
    return spec


def use_chat_template(agents: AgentSet, chat_template: str, workflow: Path | None) -> None:
    """Set how the agents' calls are rendered (--chat-template: auto keeps the workflow's own template, else
    `kvprof.traces.chat.resolve_chat_template`); refuses a group-chat workflow left without a template."""
    if chat_template != "auto" or agents.spec.chat_template is None:
        agents.spec.chat_template = resolve_chat_template(chat_template, agents.tokenizer)
    if agents.spec.group_chat and agents.spec.chat_template is None:
        raise KvprofError(
            f"workflow {workflow} lays calls out as a group chat (group_chat = true), which needs a chat template; "
            "pass --chat-template FILE or set chat_template in the workflow."
        )


def trace_header(model: str, agents: AgentSet, **fields) -> TraceHeader:
    """The header of a trace captured from `agents` (loaded from `model`); `fields`: other TraceHeader fields."""
    return TraceHeader(
        model={
            "path": model,
            "dtype": str(agents.base_model.dtype).removeprefix("torch."),
            "architecture": agents.config.architectures[0] if agents.config.architectures else "",
        },
        tokenizer=tokenizer_identity(agents.tokenizer),
        workflow=agents.spec.to_dict(),
        **fields,
    )


def sampled_trace_header(model: str, agents: AgentSet, sampling: Sampling) -> TraceHeader:
    """The header of a trace `agents` generate with `sampling`, which it records (a resume checks it)."""
    return trace_header(model, agents, extra={"sampling": asdict(sampling)})


def checkpoint_path(trace_path: Path) -> Path:
    """The checkpoint of a capture into `trace_path`: `trace.jsonl` → `trace.partial.jsonl` beside it."""
    return trace_path.with_suffix(".partial" + trace_path.suffix)


def resumed_trajectories(checkpoint: Path, header: TraceHeader, tasks: Sequence[Task]) -> list[Trajectory]:
    """The trajectories in `checkpoint`; refuses one with another `header` or other leading `tasks`."""
    partial = read_partial_trace(checkpoint)
    if header_record(partial.header) != json.loads(json.dumps(header_record(header))):
        raise KvprofError(
            f"checkpoint {checkpoint} was captured with another model, tokenizer, workflow or sampling; "
            f"rerun with the options it was captured with, or delete it to start again."
        )
    ids = [traj.id for traj in partial.trajectories]
    if ids != [task.id for task in tasks[: len(ids)]]:
        raise KvprofError(
            f"checkpoint {checkpoint} holds tasks {', '.join(ids[:3])}… that are not the first tasks "
            f"of --tasks; pass the --tasks and --limit it was captured with, or delete it."
        )
    return partial.trajectories


def capture_trajectories(
    agents: AgentSet,
    tasks: Sequence[Task],
    trace_path: Path,
    header: TraceHeader,
    sampling: Sampling,
    resumed: Sequence[Trajectory] = (),
    on_task: Callable[[Task], None] | None = None,
    on_turn: Callable[[Trajectory, Turn], None] | None = None,
    on_trajectory: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """Run the ReAct workflow on `tasks` after the `resumed` ones, write all to `trace_path` (checkpointing each,
    checkpoint removed at the end); trajectories in task order. Callbacks: `on_task`, `on_turn`, `on_trajectory`."""
    captured = list(resumed)
    checkpoint = checkpoint_path(trace_path)
    tool = SearchTool()
    with PartialTrace(checkpoint, header, append=bool(captured)) as partial, TraceWriter(trace_path, header) as writer:
        for traj in captured:
            writer.write(traj)
        for index, task in enumerate(tasks[len(captured) :], start=len(captured)):
            if on_task:
                on_task(task)
            respond = model_responder(agents, replace(sampling, seed=sampling.seed + index))
            traj = run_react(agents.spec, agents.tokenizer, task, tool, respond, on_turn=on_turn)
            writer.write(traj)
            partial.write(traj)
            captured.append(traj)
            if on_trajectory:
                on_trajectory(traj)
    checkpoint.unlink()
    return captured


def trajectory_summary(trajectories: list[Trajectory], elapsed: float) -> CaptureSummary:
    """Trajectories, calls, tokens (distinct, shared), exact-match accuracy, `elapsed` s, per-agent turns."""
    with_answer = [t for t in trajectories if t.answer is not None]
    correct = sum(exact_match(t.prediction, t.answer) for t in with_answer)
    per_agent: dict[str, dict] = defaultdict(lambda: {"turns": 0, "input_tokens": 0, "output_tokens": 0})
    shared_tokens = total_tokens = 0
    for traj in trajectories:
        shared = shared_segment_ids(traj)
        shared_tokens += sum(len(traj.segments[s]) for s in shared)
        total_tokens += traj.num_tokens
        for turn in traj.turns:
            stats = per_agent[turn.agent]
            stats["turns"] += 1
            stats["input_tokens"] += len(traj.input_tokens(turn))
            stats["output_tokens"] += len(traj.segments[turn.output])
    return CaptureSummary(
        trajectories=len(trajectories),
        turns=sum(s["turns"] for s in per_agent.values()),
        distinct_tokens=total_tokens,
        shared_tokens=shared_tokens,
        with_answer=len(with_answer),
        accuracy=correct / len(with_answer) if with_answer else None,
        seconds=round(elapsed, 3),
        agents=dict(per_agent),
    )
