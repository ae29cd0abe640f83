"""The multi-agent workflow runner: a ReAct-style schedule of agents and a pluggable tool environment.

Schedule (per task): up to `max_rounds` rounds of `plan` (optional) → `act` → observation from the tool, until `act`
emits `finish[ANSWER]`; then `reflect` (optional) writes the final answer. Every agent reads the whole shared
trajectory so far, laid out by the `WorkflowSpec` templates (see `kvprof.traces.spec`), and generates until a stop
string.

The runner records a `Trajectory` (kvprof.traces.trace) with exact token ids; capture uses it as is, online replay
reruns it under a sharing policy.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import StoppingCriteriaList

from kvprof.errors import KvprofError
from kvprof.model.agents import AgentSet
from kvprof.model.lora import invocation_tokens
from kvprof.traces.chat import ChatFormat, ChatSegments, Message
from kvprof.traces.reuse import last_occurrence
from kvprof.traces.spec import WorkflowSpec
from kvprof.traces.stopping import StopStrings, end_ids
from kvprof.traces.tasks import Task, private_prompt
from kvprof.traces.trace import Segment, Trajectory, Turn


class ToolEnvironment(Protocol):
    """Answers an agent's action with an observation text (None: the tool does not know that action)."""

    def observe(self, task: Task, tool: str, argument: str) -> str | None: ...


class SearchTool:
    """`search[NAME]` returns the task's document about NAME (case-insensitive), or says there is none."""

    def observe(self, task: Task, tool: str, argument: str) -> str | None:
        if tool != "search":
            return None
        wanted = argument.strip().lower()
        for name, text in task.documents.items():
            if name.lower() == wanted:
                return text
        return f"No results for {argument.strip()}."


@dataclass
class Sampling:
    """Generation settings: greedy when `temperature` is 0."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


class TrajectoryBuilder:
    """Appends segments (tokenized on their own) and turns to a growing `Trajectory`."""

    def __init__(self, tokenizer, task: Task):
        self.tokenizer = tokenizer
        self.trajectory = Trajectory(
            id=task.id,
            segments={},
            turns=[],
            question=task.question,
            answer=task.answer,
            documents=dict(task.documents),
            private=dict(task.private),
        )

    def add_text(self, seg_id: str, kind: str, scope: str, text: str) -> str:
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        self.trajectory.segments[seg_id] = Segment(kind=kind, scope=scope, tokens=tokens, text=text)
        return seg_id

    def add_output(self, seg_id: str, agent: str, tokens: list[int]) -> str:
        text = self.tokenizer.decode(tokens)
        self.trajectory.segments[seg_id] = Segment(
            kind="output", scope="shared", tokens=tokens, text=text, producer=agent
        )
        return seg_id


def generate(
    agents: AgentSet,
    agent: str | None,
    input_ids: list[int],
    max_new_tokens: int,
    spec: WorkflowSpec,
    sampling: Sampling,
) -> list[int]:
    """One call with `generate`: new ids through the stop string or end id (`kvprof.traces.stopping.end_ids`).
    `agent` None: adapters off. Refuses an aLoRA call without its invocation ids (peft would run the base alone)."""
    tokenizer = agents.tokenizer
    invocation = invocation_tokens(agents.model, agent) if agent is not None and spec.mode == "lora" else None
    if invocation is not None and last_occurrence(input_ids, invocation) is None:
        raise KvprofError(
            f"a call of agent {agent!r} lacks the invocation ids {invocation} of its Activated LoRA, so peft would "
            "run it on the base model alone; make the workflow render them in each of its calls (cue_template), "
            "or give the agent a plain LoRA adapter."
        )
    ids = torch.tensor([input_ids], device=agents.device)
    kwargs: dict[str, object] = {"do_sample": sampling.temperature > 0}
    ends = end_ids(tokenizer, agents.model.generation_config, spec.chat_template)
    if ends:
        kwargs["eos_token_id"] = ends
    if sampling.temperature > 0:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p)
    if spec.stop:
        kwargs.update(stopping_criteria=StoppingCriteriaList([StopStrings(tokenizer, spec.stop, len(input_ids))]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    try:
        with agents.activate(agent), torch.inference_mode():
            out = agents.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
                **kwargs,
            )
    except torch.OutOfMemoryError:
        raise KvprofError(
            f"agent {agent!r} ran out of memory on a {len(input_ids)}-token input; use fewer "
            "--max-rounds, a smaller --dtype, or a larger device."
        ) from None
    return out[0, len(input_ids) :].tolist()


def parse_action(spec: WorkflowSpec, text: str) -> tuple[str, str] | None:
    match = re.search(spec.action_pattern, text)
    return (match.group(1), match.group(2)) if match else None


def parse_answer(spec: WorkflowSpec, text: str) -> str:
    match = re.search(spec.answer_pattern, text)
    return (match.group(1) if match else text).strip()


TurnCallback = Callable[[Trajectory, Turn], None]
Responder = Callable[[str, list[int], int], list[int]]
"""Produces an agent's output: `(agent, input_ids, max_new_tokens) -> new token ids`."""


def model_responder(agents: AgentSet, sampling: Sampling) -> Responder:
    """Answer each turn with the agents' own model (transformers' `generate`)."""
    torch.manual_seed(sampling.seed)
    return lambda agent, input_ids, max_new: generate(agents, agent, input_ids, max_new, agents.spec, sampling)


def run_react(
    spec: WorkflowSpec,
    tokenizer,
    task: Task,
    tool: ToolEnvironment,
    respond: Responder,
    on_turn: TurnCallback | None = None,
) -> Trajectory:
    """Run one task through the ReAct schedule; its trajectory. `respond`: the model (capture), a policy (online
    replay) or gold outputs (training data); inputs laid out by `TextLayout` or `ChatLayout` alike."""
    layout: Layout = (
        ChatLayout(spec, tokenizer, task, respond) if spec.chat_template else TextLayout(spec, tokenizer, task, respond)
    )
    traj = layout.trajectory

    def call(agent: str) -> str:
        turn = layout.call(agent)
        if on_turn:
            on_turn(traj, turn)
        return traj.segments[turn.output].text

    names = set(spec.names)
    answer = None
    for _ in range(spec.max_rounds):
        if "plan" in names:
            call("plan")
        action = parse_action(spec, call("act"))
        if action is None:
            observation = "Invalid action."
        elif action[0] == "finish":
            answer = action[1].strip()
            break
        else:
            observed = tool.observe(task, *action)
            observation = observed if observed is not None else f"Unknown action {action[0]}."
        layout.observe(spec.observation_template.format(observation=observation))
    if "reflect" in names:
        answer = parse_answer(spec, call("reflect"))
    traj.prediction = answer
    return traj


def require_react_agents(names: list[str]) -> None:
    """Refuse agents `run_react` cannot schedule (it needs `act`; `plan` / `reflect` optional)."""
    if "act" not in names or any(name not in ("plan", "act", "reflect") for name in names):
        raise KvprofError(
            f"--online re-runs kvprof's ReAct schedule (agents act, and plan / reflect when present), but this "
            f"trace's agents are {', '.join(names)}; replay it teacher-forced (drop --online)."
        )


class Layout(Protocol):
    """How a trajectory's agent calls are laid out as tokens."""

    trajectory: Trajectory

    def call(self, agent: str) -> Turn:
        """Lay out `agent`'s input, get its output from the responder, record the turn."""
        ...

    def observe(self, text: str) -> None:
        """Append a tool observation every later call reads."""
        ...


class TextLayout:
    """kvprof's own layout (`kvprof.traces.spec`): each piece its own segment, tokenized on its own; a cue before each
    output; in prompt mode the acting agent's role prompt first."""

    def __init__(self, spec: WorkflowSpec, tokenizer, task: Task, respond: Responder):
        self.spec, self.respond = spec, respond
        self.builder = TrajectoryBuilder(tokenizer, task)
        self.trajectory = self.builder.trajectory
        self.history: list[str] = []
        if spec.mode == "lora" and spec.system_prompt:
            self.history.append(self.builder.add_text("system", "system", "shared", spec.system_prompt))
        question = spec.question_template.format(question=task.question)
        self.history.append(self.builder.add_text("question", "question", "shared", question))
        self.prefixes: dict[str, str] = {}
        if spec.mode == "prompt":
            for a in spec.agents:
                # A prompt-mode spec gives every agent a role prompt (`kvprof.traces.spec` refuses one that does not).
                assert a.prompt is not None, f"prompt-mode agent {a.name!r} has no role prompt"
                prompt = private_prompt(spec, task, a.name)
                self.prefixes[a.name] = self.builder.add_text(f"prompt:{a.name}", "prompt", "private", prompt)
        self.counts: dict[str, int] = {}
        self.observations = 0

    def call(self, agent: str) -> Turn:
        index = self.counts.get(agent, 0)
        self.counts[agent] = index + 1
        cue_text = self.spec.cue_template.format(agent=agent)
        cue = self.builder.add_text(f"cue:{agent}:{index}", "cue", "shared", cue_text)
        inputs = ([self.prefixes[agent]] if agent in self.prefixes else []) + self.history + [cue]
        turn = Turn(agent=agent, input=inputs, output=f"out:{agent}:{index}")
        max_new = self.spec.agent(agent).max_new_tokens or self.spec.max_new_tokens
        tokens = self.respond(agent, self.trajectory.input_tokens(turn), max_new)
        self.builder.add_output(turn.output, agent, tokens)
        self.trajectory.turns.append(turn)
        self.history.extend([cue, turn.output])
        return turn

    def observe(self, text: str) -> None:
        self.history.append(self.builder.add_text(f"obs:{self.observations}", "observation", "shared", text))
        self.observations += 1


class ChatLayout:
    """Chat messages through the spec's template (`kvprof.traces.chat`): system (role prompt; lora mode: the shared
    system prompt), user (question), assistant by agent (`group_chat`: user with a name, as AutoGen / AG2), tool."""

    def __init__(self, spec: WorkflowSpec, tokenizer, task: Task, respond: Responder):
        assert spec.chat_template is not None  # chosen by run_react
        self.spec, self.respond, self.task = spec, respond, task
        self.format = ChatFormat(tokenizer, spec.chat_template)
        self.trajectory = TrajectoryBuilder(tokenizer, task).trajectory
        self.segments = ChatSegments(self.format, self.trajectory.segments)
        self.history: list[Message] = []
        if spec.mode == "lora" and spec.system_prompt:
            self.history.append(Message("system", spec.system_prompt))
        self.history.append(Message("user", spec.question_template.format(question=task.question)))

    def call(self, agent: str) -> Turn:
        private = {0} if self.spec.mode == "prompt" else set()
        role = [Message("system", private_prompt(self.spec, self.task, agent))] if private else []
        messages = role + [self.read_by(agent, message) for message in self.history]
        inputs, prompt_segment = self.segments.call(len(self.trajectory.turns), messages, private)
        max_new = self.spec.agent(agent).max_new_tokens or self.spec.max_new_tokens
        turn = Turn(agent=agent, input=inputs, output="")
        tokens = self.respond(agent, self.trajectory.input_tokens(turn), max_new)
        text = self.format.tokenizer.decode(tokens, skip_special_tokens=True)  # the reply, without end-of-turn
        turn.output, message = self.segments.output(agent, tokens, text, prompt_segment)
        self.trajectory.turns.append(turn)
        self.history.append(message)
        return turn

    def read_by(self, agent: str, message: Message) -> Message:
        """`message` as `agent` reads it: in a group chat another agent's output is a user message with its name."""
        if self.spec.group_chat and message.role == "assistant" and message.name not in (None, agent):
            return Message("user", message.content, message.name)
        return message

    def observe(self, text: str) -> None:
        self.history.append(Message("tool", text))


def exact_match(prediction: str | None, answer: str | None) -> bool:
    return prediction is not None and answer is not None and prediction.strip().lower() == answer.strip().lower()
