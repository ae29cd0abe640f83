"""Logs of existing multi-agent systems, one agent call per line in the OpenAI chat format, as kvprof traces.

    {"agent": "act", "messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
     {"role": "assistant", "name": "plan", "content": "..."}, {"role": "tool", "content": "..."}],
     "output": "search[ Ada Lovelace]\\n", "trajectory": "task-7"}

`trajectory` (optional) groups calls into trajectories (default: one trajectory, "log"); calls keep their order. An
optional `task` object (`question`, `answer`, `documents`) on any call of a trajectory lets online replay re-run it
with kvprof's ReAct runner. The calls are rendered through the chat template (`kvprof.chat`) into segments: a message
rendered to the same ids in several calls is one segment, shared when several agents read it; a message whose ids
differ between calls keeps each call's exact ids and is reported (`ImportedLog.differences`). The output is its text
tokenized on its own; an earlier output read back as an assistant message is the generation prompt and output
segments that produced it when the tokens agree (otherwise a difference: replay then refuses the turns that read it,
since they no longer extend one shared context). The workflow's agents always come from the log; `--workflow` only
supplies templates and limits for online re-runs.

Mode: with adapters (`--agent NAME=DIR`) lora mode, every agent needs one; otherwise prompt mode, each agent's role
prompt being its system message (the first message, the same in all its calls). A trajectory's prediction is the
last answer a call gave (the workflow's `answer_pattern`: `answer[...]` or `finish[...]` by default).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kvprof.chat import ChatFormat, ChatSegments, Difference, Message
from kvprof.errors import KvprofError
from kvprof.fileio import jsonl_lines
from kvprof.spec import AgentSpec, WorkflowSpec
from kvprof.trace import Segment, Trace, TraceHeader, Trajectory, Turn

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class LoggedCall:
    """One line of a log: where it is (`line`), who acted, what it read and what it wrote."""

    line: int
    agent: str
    messages: list[Message]
    output: str
    trajectory: str
    task: dict | None = None


@dataclass
class ImportedLog:
    """The trace, how its mode was decided (a sentence), and the messages whose tokens differ between calls."""

    trace: Trace
    mode_reason: str
    differences: dict[str, list[Difference]] = field(default_factory=dict)


def _fail(path: Path, line: int, problem: str, fix: str) -> KvprofError:
    return KvprofError(f"{path} line {line}: {problem}; {fix}.")


def read_log(path: str | Path) -> list[LoggedCall]:
    """The calls of a chat log, refusing a malformed line with its number and the fix."""
    path = Path(path)
    if not path.is_file():
        raise KvprofError(f"chat log {path} does not exist; pass a JSONL file with one agent call per line.")
    calls = [_call(path, number, record) for number, record in jsonl_lines(path)]
    if not calls:
        raise KvprofError(f"chat log {path} holds no calls; add one JSON object per agent call.")
    return calls


def _call(path: Path, number: int, record: object) -> LoggedCall:
    example = '{"agent", "messages": [{"role", "content"}, ...], "output"}'
    if not isinstance(record, dict):
        raise _fail(path, number, "is not a JSON object", f"write each call as {example}")
    for name, kind in (("agent", str), ("messages", list), ("output", str)):
        if not isinstance(record.get(name), kind):
            raise _fail(path, number, f"has no {kind.__name__} field {name!r}", f"write each call as {example}")
    messages = []
    for index, entry in enumerate(record["messages"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str) or entry.get("role") not in ROLES:
            raise _fail(
                path,
                number,
                f"message {index} is not {{'role': one of {', '.join(ROLES)}, 'content': text}}",
                "fix that message",
            )
        author = entry.get("name")
        messages.append(Message(entry["role"], entry["content"], None if author is None else str(author)))
    if not messages:
        raise _fail(path, number, "has no messages", "log the messages the agent was called with")
    last = messages[-1]
    if last.role == "assistant" and last.content == record["output"] and last.name in (None, record["agent"]):
        raise _fail(
            path,
            number,
            "has its own output as the last message too, so the agent would read its reply before writing it",
            "log the messages the agent was called with (drop the reply from 'messages')",
        )
    task = record.get("task")
    if task is not None and not (isinstance(task, dict) and isinstance(task.get("question"), str)):
        raise _fail(path, number, "has a 'task' without a string 'question'", "give task as {question, answer?}")
    return LoggedCall(number, record["agent"], messages, record["output"], str(record.get("trajectory", "log")), task)


def _role_prompts(path: Path, calls: list[LoggedCall]) -> dict[str, str]:
    """Prompt mode: each agent's system message, which must open every call of that agent and never change."""
    prompts: dict[str, str] = {}
    for call in calls:
        first = call.messages[0]
        if first.role != "system":
            raise _fail(
                path,
                call.line,
                f"agent {call.agent!r} has no system message first, so prompt mode has no role prompt for it",
                f"log its system message, or pass --agent {call.agent}=ADAPTER_DIR for lora mode",
            )
        if prompts.setdefault(call.agent, first.content) != first.content:
            raise _fail(
                path,
                call.line,
                f"agent {call.agent!r} has a different system message than in its earlier calls",
                "give each agent one role prompt (or split the log by role)",
            )
    return prompts


def import_log(
    path: str | Path,
    tokenizer,
    template: str,
    identity: dict,
    model_name: str,
    adapters: dict[str, str] | None = None,
    workflow: WorkflowSpec | None = None,
) -> ImportedLog:
    """The trace of a chat log (see module docstring) rendered with `template`; `identity`: the tokenizer's
    (`kvprof.model.tokenizer_identity`); `workflow`: templates and limits for online re-runs (default kvprof's)."""
    path = Path(path)
    calls = read_log(path)
    names = list(dict.fromkeys(call.agent for call in calls))
    if adapters:
        unknown = [call for call in calls if call.agent not in adapters]
        if unknown:
            raise _fail(
                path,
                unknown[0].line,
                f"agent {unknown[0].agent!r} has no adapter",
                f"pass --agent {unknown[0].agent}=ADAPTER_DIR (lora mode needs one per agent)",
            )
        mode = "lora"
        agents = [AgentSpec(name, adapter=adapters[name]) for name in names]
        reason = f"lora mode: adapters given for {', '.join(names)}"
        system = {call.messages[0].content for call in calls if call.messages[0].role == "system"}
        if len(system) > 1:
            reason += " (their system messages differ: each stays in its own calls' segments)"
    else:
        prompts = _role_prompts(path, calls)
        mode = "prompt"
        agents = [AgentSpec(name, prompt=prompts[name]) for name in names]
        distinct = len(set(prompts.values()))
        reason = f"prompt mode: no adapters given; {len(names)} agents with {distinct} distinct system messages"
    base = workflow or WorkflowSpec(mode=mode, agents=[])
    spec = WorkflowSpec(**{**base.to_dict(), "mode": mode, "agents": agents, "chat_template": template})
    chat = ChatFormat(tokenizer, template)
    trajectories: dict[str, Trajectory] = {}
    builders: dict[str, ChatSegments] = {}
    for call in calls:
        traj = trajectories.get(call.trajectory)
        if traj is None:
            traj = trajectories[call.trajectory] = Trajectory(id=call.trajectory, segments={}, turns=[], question="")
            builders[call.trajectory] = ChatSegments(chat, traj.segments)
        if call.task is not None:
            traj.question = call.task["question"]
            traj.answer = None if call.task.get("answer") is None else str(call.task["answer"])
            traj.documents = dict(call.task.get("documents") or {})
        elif not traj.question:
            traj.question = next((m.content for m in call.messages if m.role == "user"), "")
        segments = builders[call.trajectory]
        private = {0} if mode == "prompt" else set()
        inputs, prompt_segment = segments.call(len(traj.turns), call.messages, private)
        output_ids = tokenizer.encode(call.output, add_special_tokens=False)
        output, _ = segments.output(call.agent, output_ids, call.output, prompt_segment)
        traj.turns.append(Turn(agent=call.agent, input=inputs, output=output))
        answer = re.search(spec.answer_pattern, call.output)
        if answer:  # the trajectory's prediction: the last answer (or finish) a call gave
            traj.prediction = answer.group(1).strip()
    header = TraceHeader(
        model={"path": model_name}, tokenizer=identity, workflow=spec.to_dict(), source=f"chat-log:{path.name}"
    )
    differences = {tid: builders[tid].differences for tid in trajectories if builders[tid].differences}
    return ImportedLog(Trace(header, list(trajectories.values())), reason, differences)


def trajectory_calls(traj: Trajectory) -> list[dict]:
    """A trajectory of a chat-rendered trace back as log lines (messages read from its segments), e.g. to write a
    sample log; the inverse of `import_log` for traces captured through a chat template."""
    lines: list[dict] = []
    for turn in traj.turns:
        messages = []
        for seg_id in turn.input:
            segment = traj.segments[seg_id]
            message = _segment_message(segment)
            if message is not None:
                messages.append(message)
        output = traj.segments[turn.output]
        line: dict[str, object] = {
            "agent": turn.agent,
            "messages": [m.as_dict() for m in messages],
            "output": output.text,
            "trajectory": traj.id,
        }
        if not lines:
            line["task"] = {"question": traj.question, "answer": traj.answer, "documents": traj.documents}
        lines.append(line)
    return lines


def _segment_message(segment: Segment) -> Message | None:
    role = {"prompt": "system", "system": "system", "question": "user", "observation": "tool"}.get(segment.kind)
    if role is not None:
        return Message(role, segment.text)
    if segment.kind in ("output", "message"):
        return Message("assistant", segment.text, segment.producer)
    return None  # generation prompts and template tails
