"""OTLP spans with the OpenInference semantic conventions (Arize-ai/openinference, spec/semantic_conventions.md), as
Phoenix and its instrumentors (OpenAI, OpenAI Agents SDK, LangChain, CrewAI, ...) write them.

An `LLM` span (`openinference.span.kind`) is one call. Its messages are flattened attributes:
`llm.input_messages.N.message.role`, `.content` (or `.contents.M.message_content.type` / `.text`), `.name`,
`.tool_call_id`, `.tool_calls.K.tool_call.id` / `.function.name` / `.function.arguments`; the output
`llm.output_messages.0.message.*`; the tools `llm.tools.N.tool.json_schema` (JSON text); the input token count
`llm.token_count.prompt`. The agent is the nearest `agent.name`, else `graph.node.name` / `graph.node.id`, else the
nearest `AGENT` span's name ("agent" without one); the trajectory the nearest `session.id`, else the trace id.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvprof.traces.chat import Message
from kvprof.traces.chat_log import LoggedCall
from kvprof.traces.stores.common import MissingContent, StoreLog, fail, store_log
from kvprof.traces.stores.messages import ROLES, Refuse, chat_tool, output_text, tool_call
from kvprof.traces.stores.otlp import Span, ancestors, json_value, read_spans

SETTING = (
    "unset OPENINFERENCE_HIDE_INPUTS, OPENINFERENCE_HIDE_INPUT_MESSAGES and OPENINFERENCE_HIDE_OUTPUT_MESSAGES "
    "(or the instrumentor's TraceConfig) and export again"
)
INDEX = re.compile(r"^\d+$")


def read(path: Path) -> StoreLog:
    """The calls of an OTLP export with OpenInference attributes."""
    spans = read_spans(path)
    by_id = {f"{span.trace_id}/{span.span_id}": span for span in spans}
    calls, missing = [], []
    for span in spans:
        if span.attributes.get("openinference.span.kind") != "LLM":
            continue
        chain = ancestors(span, by_id)
        trajectory = next((str(s.attributes["session.id"]) for s in chain if "session.id" in s.attributes), None)
        trajectory = trajectory or span.trace_id
        tree = unflatten(span.attributes)
        inputs, outputs = tree.get("llm", {}).get("input_messages"), tree.get("llm", {}).get("output_messages")
        if not inputs or not outputs:
            what = "no input messages" if not inputs else "no output messages"
            missing.append(MissingContent(trajectory, span.where, f"{what} (hidden by the instrumentor)"))
            continue

        def refuse(problem: str, fix: str, span: Span = span):
            return fail(path, span.where, problem, fix)

        messages = [_message(entry.get("message"), refuse) for entry in _listed(inputs)]
        reply = _message(_listed(outputs)[0].get("message"), refuse)
        calls_made = [] if reply.tool_calls is None else reply.as_dict()["tool_calls"]
        output = output_text([] if reply.content is None else [reply.content], calls_made)
        schemas = [
            json_value(path, span, "llm.tools.N.tool.json_schema", tool.get("tool", {}).get("json_schema"))
            for tool in _listed(tree.get("llm", {}).get("tools", {}))
        ]
        tools = [chat_tool(schema, refuse) for schema in schemas] or None
        tokens = span.attributes.get("llm.token_count.prompt")
        calls.append(
            LoggedCall(0, _agent(chain), messages, output, trajectory, None, tools, span.where, tokens)
        )  # fmt: skip
    return store_log(path, "openinference", calls, missing, SETTING)


def _agent(chain: list[Span]) -> str:
    for key in ("agent.name", "graph.node.name", "graph.node.id"):
        found = next((s.attributes[key] for s in chain if key in s.attributes), None)
        if found is not None:
            return str(found)
    return next((s.name for s in chain if s.attributes.get("openinference.span.kind") == "AGENT"), "agent")


def unflatten(flat: dict) -> dict:
    """Dotted attribute names as nested dicts (`a.0.b` → {"a": {"0": {"b": ...}}})."""
    tree: dict = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):  # a value and a deeper name share a prefix: keep the value
                break
            node = child
        else:
            node[leaf] = value
    return tree


def _listed(node: object) -> list[dict]:
    """The numbered children of a flattened list (`N` keys), in order."""
    if not isinstance(node, dict):
        return []
    return [node[key] for key in sorted((k for k in node if INDEX.match(k)), key=int) if isinstance(node[key], dict)]


def _message(message: object, refuse: Refuse) -> Message:
    """One flattened OpenInference message as a chat message."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise refuse("has a message without a role of system, user, assistant or tool", "fix the message's role")
    content = message.get("content")
    if content is None and "contents" in message:
        parts = [entry.get("message_content", {}) for entry in _listed(message["contents"])]
        content = "".join(_content_text(part, refuse) for part in parts)
    calls = [
        tool_call(entry.get("id"), entry.get("function", {}).get("name"), entry.get("function", {}).get("arguments"))
        for entry in (item.get("tool_call", {}) for item in _listed(message.get("tool_calls", {})))
    ]
    name = message.get("name")
    return Message.of(
        ROLES[message["role"]],
        None if content is None else str(content),
        None if name is None else str(name),
        calls or None,
        message.get("tool_call_id"),
    )


def _content_text(part: dict, refuse: Refuse) -> str:
    if part.get("type") == "text":
        return str(part.get("text", ""))
    raise refuse(
        f"has message content of type {part.get('type')!r}, which kvprof cannot render (it reads text)",
        "leave such calls out of the export",
    )
