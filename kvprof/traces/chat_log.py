"""Logs of existing multi-agent systems, one agent call per line in the OpenAI chat format, as kvprof traces.

    {"agent": "act", "messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
     {"role": "assistant", "name": "plan", "content": "..."}, {"role": "tool", "content": "..."}],
     "output": "search[ Ada Lovelace]\\n", "trajectory": "task-7"}

Messages as frameworks write them (`content` or null, `name`, `tool_calls`, `tool_call_id`; per-call `tools`) go to
the template as logged, so input ids are exactly `apply_chat_template(messages, tools=tools,
add_generation_prompt=True)`. `trajectory` groups calls (default "log"); an optional `task` (`question`, `answer`,
`documents`) enables online re-runs. Segments, differences and the mode (lora with `--agent NAME=DIR`, else prompt;
private prefixes) are as docs/commands/import-chat.md describes. The output is its text tokenized alone; agents come
from the log (`--workflow` only supplies templates and limits); a trajectory's prediction is its last answer
(`answer_pattern`: `answer[...]` or `finish[...]` by default).

`import_calls` takes `LoggedCall`s from any reader (`kvprof.traces.stores` converts tracing-store exports into them);
where a call records its input token count, the count is checked against the rendering
(`kvprof.traces.token_counts`).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.fileio import jsonl_lines
from kvprof.traces.chat import ChatFormat, ChatSegments, Difference, Message
from kvprof.traces.reuse import last_occurrence
from kvprof.traces.spec import AgentSpec, WorkflowSpec, adapter_invocation
from kvprof.traces.token_counts import TokenCountMismatch, mismatch
from kvprof.traces.trace import Segment, Trace, TraceHeader, Trajectory, Turn

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class LoggedCall:
    """One agent call: its number in the log (`line`; a store's calls are numbered in import order), who acted, what
    it read and what it wrote; `where` names it in messages ("line 3", "span 00f067aa0ba902b7"); `input_tokens`: the
    input token count the log recorded for it, if any."""

    line: int
    agent: str
    messages: list[Message]
    output: str
    trajectory: str
    task: dict | None = None
    tools: list[dict] | None = None
    where: str = ""
    input_tokens: int | None = None

    def __post_init__(self) -> None:
        self.where = self.where or f"line {self.line}"


@dataclass
class ImportedLog:
    """The trace, its mode decision (a sentence), per trajectory its `kvprof.traces.chat.Difference`s, and the calls
    whose recorded input token count differs from the rendering (the template check)."""

    trace: Trace
    mode_reason: str
    differences: dict[str, list[Difference]] = field(default_factory=dict)
    mismatches: list[TokenCountMismatch] = field(default_factory=list)


def _fail(path: Path, line: int | str, problem: str, fix: str) -> KvprofError:
    where = line if isinstance(line, str) else f"line {line}"
    return KvprofError(f"{path} {where}: {problem}; {fix}.")


def read_log(path: str | Path) -> list[LoggedCall]:
    """The calls of a chat log, refusing a malformed line with its number and the fix."""
    path = Path(path)
    fix = "pass a JSONL file with one agent call per line"
    calls = [_call(path, number, record) for number, record in jsonl_lines(path, "chat log", fix)]
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
    messages = [_message(path, number, index, entry) for index, entry in enumerate(record["messages"])]
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
    documents = (task or {}).get("documents") or {}
    if not (isinstance(documents, dict) and all(isinstance(text, str) for text in documents.values())):
        raise _fail(path, number, "has task documents that are not texts by name", "give documents as {name: text}")
    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
        raise _fail(path, number, "has 'tools' that is not a list of objects", "give tools as function schemas")
    trajectory = str(record.get("trajectory", "log"))
    return LoggedCall(number, record["agent"], messages, record["output"], trajectory, task, tools)


def _message(path: Path, number: int, index: int, entry: object) -> Message:
    """One logged message: role and content (text or null), and the OpenAI fields templates read."""
    if not isinstance(entry, dict) or entry.get("role") not in ROLES:
        shape = f"message {index} is not {{'role': one of {', '.join(ROLES)}, 'content': text}}"
        raise _fail(path, number, shape, "fix that message")
    content, calls, call_id, author = (entry.get(key) for key in ("content", "tool_calls", "tool_call_id", "name"))
    reasoning = entry.get("reasoning_content")
    problem = None
    if reasoning is not None and not isinstance(reasoning, str):
        problem = "has a 'reasoning_content' that is not text"
    elif content is not None and not isinstance(content, str):
        problem = "has a content that is neither text nor null (content parts are not supported)"
    elif calls is not None and not isinstance(calls, list):
        problem = "has 'tool_calls' that is not a list"
    elif call_id is not None and not isinstance(call_id, str):
        problem = "has a 'tool_call_id' that is not text"
    if problem:
        raise _fail(path, number, f"message {index} {problem}", "log it as the OpenAI chat format has it")
    for k, call in enumerate(calls or []):
        problem = _tool_call_problem(call)
        if problem:
            fix = 'log each tool call as {"type": "function", "function": {"name": ..., "arguments": ...}}'
            raise _fail(path, number, f"message {index} has tool call {k} {problem}", fix)
    return Message.of(entry["role"], content, None if author is None else str(author), calls, call_id, reasoning)


def _tool_call_problem(call: object) -> str | None:
    """Why a `tool_calls` entry is not `{"type": "function", "function": {"name", "arguments"}}`, or None."""
    if not isinstance(call, dict):
        return f"that is {type(call).__name__}, not an object"
    function = call.get("function")
    if not isinstance(function, dict):
        return "without a 'function' object"
    if not isinstance(function.get("name"), str):
        return "whose function has no text 'name'"
    if not isinstance(function.get("arguments"), (str, dict)):
        return "whose function has no 'arguments' (JSON text or an object)"
    return None


def _role_prompts(path: Path, calls: list[LoggedCall]) -> dict[str, str]:
    """Prompt mode: each agent's role prompt, its most common system message (the first on a tie); every call must
    start with a system message."""
    seen: dict[str, Counter[str]] = {}
    for call in calls:
        first = call.messages[0]
        if first.role != "system":
            raise _fail(
                path,
                call.where,
                f"agent {call.agent!r} has no system message first, so prompt mode has no role prompt for it",
                f"log its system message, or pass --agent {call.agent}=ADAPTER_DIR for lora mode",
            )
        seen.setdefault(call.agent, Counter())[first.text] += 1
    return {agent: counts.most_common(1)[0][0] for agent, counts in seen.items()}


def _system(call: LoggedCall) -> str | None:
    first = call.messages[0]
    return first.text if first.role == "system" else None


@dataclass
class _LogAgents:
    """The agents a log's calls name and how they differ: `mode` and the sentence saying why; lora mode: each agent's
    Activated LoRA invocation (if any) and the trajectories whose agents have different system messages; prompt mode:
    each agent's role prompt."""

    mode: str
    agents: list[AgentSpec]
    reason: str
    invocations: dict[str, list[int] | None] = field(default_factory=dict)
    private_in: set[str] = field(default_factory=set)
    prompts: dict[str, str] = field(default_factory=dict)


def _lora_agents(path: Path, calls: list[LoggedCall], names: list[str], adapters: dict[str, str]) -> _LogAgents:
    unknown = [call for call in calls if call.agent not in adapters]
    if unknown:
        raise _fail(
            path,
            unknown[0].where,
            f"agent {unknown[0].agent!r} has no adapter",
            f"pass --agent {unknown[0].agent}=ADAPTER_DIR (lora mode needs one per agent)",
        )
    reason = f"lora mode: adapters given for {', '.join(names)}"
    by_trajectory: dict[str, set[str | None]] = {}
    for call in calls:
        by_trajectory.setdefault(call.trajectory, set()).add(_system(call))
    private_in = {tid for tid, systems in by_trajectory.items() if len(systems - {None}) > 1}
    if private_in:
        reason += (
            f" (their system messages differ in {len(private_in)} of {len(by_trajectory)} trajectories: there "
            "each agent's system message is private, its private prefix)"
        )
    return _LogAgents(
        "lora",
        [AgentSpec(name, adapter=adapters[name]) for name in names],
        reason,
        invocations={name: adapter_invocation(adapters[name]) for name in names},
        private_in=private_in,
    )


def _prompt_agents(path: Path, calls: list[LoggedCall], names: list[str]) -> _LogAgents:
    prompts = _role_prompts(path, calls)
    reason = (
        f"prompt mode: no adapters given; {len(names)} agents with {len(set(prompts.values()))} distinct role "
        "prompts, each agent's role prompt being its most common system message (the first on a tie)"
    )
    other = [call for call in calls if _system(call) != prompts[call.agent]]
    if other:
        reason += (
            f"; {len(other)} calls have another system message (per-task memory, first at "
            f"{other[0].where}): each stays that trajectory's private prefix for its agent"
        )
    return _LogAgents("prompt", [AgentSpec(name, prompt=prompts[name]) for name in names], reason, prompts=prompts)


def _add_call(
    path: Path,
    call: LoggedCall,
    traj: Trajectory,
    segments: ChatSegments,
    log: _LogAgents,
    answer_pattern: str,
    tokenizer,
) -> None:
    """Append `call` to `traj` as a turn: its task, its private text (prompt mode), its segments and output."""
    if call.task is not None:
        traj.question = call.task["question"]
        traj.answer = None if call.task.get("answer") is None else str(call.task["answer"])
        traj.documents = dict(call.task.get("documents") or {})
    elif not traj.question:
        traj.question = next((m.text for m in call.messages if m.role == "user"), "")
    system = _system(call)
    prompt_mode = log.mode == "prompt"
    private = {0} if prompt_mode or (system is not None and call.trajectory in log.private_in) else set()
    role = log.prompts.get(call.agent, "")
    if prompt_mode and system is not None and system != role and system.startswith(role):
        traj.private.setdefault(call.agent, system[len(role) :])  # the task's private text after the role prompt
    try:
        inputs, prompt_segment = segments.call(
            len(traj.turns), call.messages, private, call.tools, line=call.line, agent=call.agent
        )
    except KvprofError as err:  # the template refuses this call's messages
        raise KvprofError(f"{path} {call.where}: {err}") from None
    invocation = log.invocations.get(call.agent)
    ids = [token for segment in inputs for token in traj.segments[segment].tokens]
    if invocation is not None and last_occurrence(ids, invocation) is None:
        raise _fail(
            path,
            call.where,
            f"agent {call.agent!r}'s call lacks the invocation ids {invocation} of its Activated LoRA, so peft "
            "would run it on the base model alone",
            "log the calls as the agent was invoked, or give it its adapter's invocation",
        )
    output_ids = tokenizer.encode(call.output, add_special_tokens=False)
    output, _ = segments.output(call.agent, output_ids, call.output, prompt_segment)
    traj.turns.append(Turn(agent=call.agent, input=inputs, output=output))
    answer = re.search(answer_pattern, call.output)
    if answer:  # the trajectory's prediction: the last answer (or finish) a call gave
        traj.prediction = answer.group(1).strip()


def import_log(
    path: str | Path,
    tokenizer,
    template: str,
    identity: dict,
    model_name: str,
    adapters: dict[str, str] | None = None,
    workflow: WorkflowSpec | None = None,
) -> ImportedLog:
    """The trace of a chat log rendered with `template`; `identity`: `tokenizer_identity`; `workflow`: for re-runs."""
    path = Path(path)
    return import_calls(path, read_log(path), tokenizer, template, identity, model_name, adapters, workflow)


def import_calls(
    path: Path,
    calls: list[LoggedCall],
    tokenizer,
    template: str,
    identity: dict,
    model_name: str,
    adapters: dict[str, str] | None = None,
    workflow: WorkflowSpec | None = None,
    source: str = "chat-log",
) -> ImportedLog:
    """The trace of `calls` read from `path` (as `import_log`); `source`: the header's name for the input's format."""
    names = list(dict.fromkeys(call.agent for call in calls))
    log = _lora_agents(path, calls, names, adapters) if adapters else _prompt_agents(path, calls, names)
    base = workflow or WorkflowSpec(mode=log.mode, agents=[])
    group_chat = any(m.role == "user" and m.name in names for call in calls for m in call.messages)
    spec = WorkflowSpec(
        **{
            **base.to_dict(),
            "mode": log.mode,
            "agents": log.agents,
            "chat_template": template,
            "group_chat": group_chat,
        }
    )
    chat = ChatFormat(tokenizer, template)
    trajectories: dict[str, Trajectory] = {}
    builders: dict[str, ChatSegments] = {}
    mismatches = []
    uses_tools = any(message.tool_calls or message.role == "tool" for call in calls for message in call.messages)
    for call in calls:
        traj = trajectories.get(call.trajectory)
        if traj is None:
            traj = trajectories[call.trajectory] = Trajectory(id=call.trajectory, segments={}, turns=[], question="")
            builders[call.trajectory] = ChatSegments(chat, traj.segments)
        _add_call(path, call, traj, builders[call.trajectory], log, spec.answer_pattern, tokenizer)
        rendered = len(traj.input_tokens(traj.turns[-1]))
        found = mismatch(
            call.where, call.trajectory, call.agent, rendered, call.input_tokens, bool(call.tools), uses_tools
        )
        if found is not None:
            mismatches.append(found)
    header = TraceHeader(
        model={"path": model_name}, tokenizer=identity, workflow=spec.to_dict(), source=f"{source}:{path.name}"
    )
    differences = {tid: builders[tid].differences for tid in trajectories if builders[tid].differences}
    return ImportedLog(Trace(header, list(trajectories.values())), log.reason, differences, mismatches)


def trajectory_calls(traj: Trajectory) -> list[dict]:
    """A chat-rendered trajectory back as log lines: the inverse of `import_log`."""
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
