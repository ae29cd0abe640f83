"""OTLP spans with the OpenTelemetry GenAI semantic conventions (docs/gen-ai in open-telemetry/semantic-conventions).

An inference span (`gen_ai.operation.name` chat, text_completion or generate_content) is one call. Its content, in
the first form found:

- current: `gen_ai.system_instructions` (parts), `gen_ai.input.messages` and `gen_ai.output.messages` (messages of
  typed `parts`), `gen_ai.tool.definitions`, on the span or on its `gen_ai.client.inference.operation.details`
  event, each a JSON string or structured. Part types: `text` (`content`), `tool_call` (`id`, `name`, `arguments`),
  `tool_call_response` (`id`, `response`, or `result`), `reasoning` (`content`); any other is refused.
- deprecated (v1.36 and earlier): `gen_ai.prompt` / `gen_ai.completion` (JSON text of chat messages) on the span or
  on its `gen_ai.content.prompt` / `gen_ai.content.completion` events; or the events `gen_ai.system.message`,
  `gen_ai.user.message`, `gen_ai.assistant.message`, `gen_ai.tool.message` (`content`, `tool_calls`, `id`) and
  `gen_ai.choice` (`message`), as span events or log records of the span.

The agent is the nearest ancestor `invoke_agent` span's `gen_ai.agent.name` ("agent" without one); the trajectory
the nearest `gen_ai.conversation.id`, else the trace id; the input token count `gen_ai.usage.input_tokens`.
"""

from __future__ import annotations

from pathlib import Path

from kvprof.traces.chat import Message
from kvprof.traces.chat_log import LoggedCall
from kvprof.traces.stores.common import MissingContent, StoreLog, fail, store_log
from kvprof.traces.stores.messages import ROLES, Refuse, chat_tools, openai_message, output_text, text_of, tool_call
from kvprof.traces.stores.otlp import Span, ancestors, json_value, read_spans

INFERENCE = ("chat", "text_completion", "generate_content")
DETAILS_EVENT = "gen_ai.client.inference.operation.details"
MESSAGE_EVENTS = {
    "gen_ai.system.message": "system",
    "gen_ai.user.message": "user",
    "gen_ai.assistant.message": "assistant",
    "gen_ai.tool.message": "tool",
}
SETTING = (
    "turn content capture on in the instrumentor (OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true, or "
    "span_only / event_only where it takes a mode) and export again"
)


def read(path: Path) -> StoreLog:
    """The calls of an OTLP export with the GenAI conventions."""
    spans = read_spans(path)
    by_id = {f"{span.trace_id}/{span.span_id}": span for span in spans}
    calls, missing = [], []
    for span in spans:
        if span.attributes.get("gen_ai.operation.name") not in INFERENCE:
            continue
        chain = ancestors(span, by_id)
        agent = next(
            (str(s.attributes.get("gen_ai.agent.name")) for s in chain[1:] if _is_agent(s)), "agent"
        )  # fmt: skip
        trajectory = next(
            (str(s.attributes["gen_ai.conversation.id"]) for s in chain if "gen_ai.conversation.id" in s.attributes),
            span.trace_id,
        )
        content = _content(path, span)
        if isinstance(content, str):
            missing.append(MissingContent(trajectory, span.where, content))
            continue
        messages, output, tools = content
        tokens = span.attributes.get("gen_ai.usage.input_tokens")
        calls.append(
            LoggedCall(0, agent, messages, output, trajectory, tools=tools, where=span.where, input_tokens=tokens)
        )
    return store_log(path, "otlp", calls, missing, SETTING)


def _is_agent(span: Span) -> bool:
    return span.attributes.get("gen_ai.operation.name") == "invoke_agent" and "gen_ai.agent.name" in span.attributes


def _content(path: Path, span: Span) -> tuple[list[Message], str, list[dict] | None] | str:
    """The span's messages, output and tools, or why it has none."""

    def refuse(problem: str, fix: str):
        return fail(path, span.where, problem, fix)

    fields = dict(span.attributes)
    details = next((event for event in span.events if event.name == DETAILS_EVENT), None)
    if "gen_ai.input.messages" not in fields and details is not None:
        fields |= details.attributes
    if "gen_ai.input.messages" in fields:
        return _current(path, span, fields, refuse)
    for event in span.events:
        if event.name in ("gen_ai.content.prompt", "gen_ai.content.completion"):
            fields |= event.attributes
    if "gen_ai.prompt" in fields:
        return _deprecated_attributes(path, span, fields, refuse)
    if any(event.name in MESSAGE_EVENTS for event in span.events):
        return _deprecated_events(path, span, refuse)
    return "no input messages (content capture off)"


def _current(path: Path, span: Span, fields: dict, refuse: Refuse):
    messages: list[Message] = []
    instructions = json_value(path, span, "gen_ai.system_instructions", fields.get("gen_ai.system_instructions"))
    if instructions:
        messages.append(_parts_messages("system", instructions, refuse)[0])
    entries = json_value(path, span, "gen_ai.input.messages", fields["gen_ai.input.messages"])
    if not isinstance(entries, list):
        raise refuse("has gen_ai.input.messages that is not a list of messages", "export the messages as a list")
    for entry in entries:
        if not isinstance(entry, dict) or entry.get("role") not in ROLES:
            raise refuse("has an input message without a role of system, user, assistant or tool", "fix its role")
        messages += _parts_messages(ROLES[entry["role"]], entry.get("parts"), refuse, entry.get("name"))
    outputs = json_value(path, span, "gen_ai.output.messages", fields.get("gen_ai.output.messages"))
    if not outputs:
        return "no output messages (content capture off)"
    if not isinstance(outputs, list) or not isinstance(outputs[0], dict):
        raise refuse("has gen_ai.output.messages that is not a list of messages", "export the messages as a list")
    reply = _parts_messages("assistant", outputs[0].get("parts"), refuse)[0]
    calls = [] if reply.tool_calls is None else reply.as_dict()["tool_calls"]
    texts = [] if reply.content is None else [reply.content]
    tools = json_value(path, span, "gen_ai.tool.definitions", fields.get("gen_ai.tool.definitions"))
    return messages, output_text(texts, calls), chat_tools(tools, refuse)


def _parts_messages(role: str, parts: object, refuse: Refuse, name: object = None) -> list[Message]:
    """A GenAI message's parts as chat messages: the message (text, tool calls, reasoning), and one `tool` message
    per tool call response."""
    if not isinstance(parts, list):
        raise refuse("has a message without a list of parts", "export messages as {role, parts}")
    texts, calls, thoughts, results = [], [], [], []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            texts.append(str(part.get("content", "")))
        elif kind == "tool_call":
            calls.append(tool_call(part.get("id"), part.get("name"), part.get("arguments")))
        elif kind == "tool_call_response":
            response = part["response"] if "response" in part else part.get("result")
            results.append(Message.of("tool", text_of(response), tool_call_id=part.get("id")))
        elif kind == "reasoning":
            thoughts.append(str(part.get("content", "")))
        else:
            raise refuse(
                f"has a message part of type {kind!r}, which kvprof cannot render (it reads text, tool_call, "
                "tool_call_response and reasoning)",
                "leave such calls out of the export",
            )
    if results and not (texts or calls or thoughts):
        return results
    content = "".join(texts) if texts or not calls else None
    author = None if name is None else str(name)
    message = Message.of(role, content, author, calls or None, None, "".join(thoughts) if thoughts else None)
    return [message, *results]


def _deprecated_attributes(path: Path, span: Span, fields: dict, refuse: Refuse):
    prompt = json_value(path, span, "gen_ai.prompt", fields["gen_ai.prompt"])
    if not isinstance(prompt, list):
        raise refuse("has gen_ai.prompt that is not a list of chat messages", "export the prompt's messages")
    messages = [openai_message(entry, refuse) for entry in prompt]
    completion = json_value(path, span, "gen_ai.completion", fields.get("gen_ai.completion"))
    if not completion:
        return "no completion (content capture off)"
    first = completion[0] if isinstance(completion, list) else completion
    reply = openai_message(first.get("message", first) if isinstance(first, dict) else first, refuse)
    calls = [] if reply.tool_calls is None else reply.as_dict()["tool_calls"]
    return messages, output_text([] if reply.content is None else [reply.content], calls), None


def _deprecated_events(path: Path, span: Span, refuse: Refuse):
    messages, reply = [], None
    for event in span.events:
        fields = dict(event.attributes)
        for key in ("tool_calls", "message"):
            if key in fields:
                fields[key] = json_value(path, span, f"{event.name} {key}", fields[key])
        if event.name in MESSAGE_EVENTS:
            role = MESSAGE_EVENTS[event.name]
            entry = {"role": role, "content": fields.get("content"), "tool_calls": fields.get("tool_calls")}
            if role == "tool":
                entry["tool_call_id"] = fields.get("id")
            messages.append(openai_message(entry, refuse))
        elif event.name == "gen_ai.choice" and reply is None:
            reply = openai_message({"role": "assistant", **(fields.get("message") or {})}, refuse)
    if reply is None:
        return "no gen_ai.choice event (content capture off)"
    calls = [] if reply.tool_calls is None else reply.as_dict()["tool_calls"]
    return messages, output_text([] if reply.content is None else [reply.content], calls), None
