"""OpenAI Agents SDK trace exports (openai-agents-python, src/agents/tracing): the objects its exporter sends,
`{"data": [...]}` in a file, a list, or one object (or payload) per line.

`{"object": "trace", "id", "workflow_name", "group_id", "metadata"}` and `{"object": "trace.span", "id", "trace_id",
"parent_id", "started_at", "ended_at", "span_data", "error"}`. A call is a `generation` span (`input`: the chat
messages it was called with, or Responses items; `output`; `usage.input_tokens`) or a `response` span that holds
`input` (Responses items) and `response` (the Response object: `instructions`, `tools`, `output`,
`previous_response_id`, `usage.input_tokens`). The SDK's own exporter writes a response span's `response_id` alone,
and leaves generation inputs out unless sensitive data is included; such calls are left out and reported. A
`previous_response_id` chain is rebuilt from the earlier responses the export holds (their inputs and outputs before
the call's own input); a call continuing a response the export lacks is left out and reported.

The agent is the nearest ancestor `agent` span's `name`, else the `to_agent` of the trace's latest `handoff` span
("agent" without either); the trajectory is the trace's `group_id`, else the trace id.
"""

from __future__ import annotations

from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.traces.chat import Message
from kvprof.traces.chat_log import LoggedCall
from kvprof.traces.stores.common import MissingContent, StoreLog, fail, json_documents, store_log
from kvprof.traces.stores.messages import chat_tools
from kvprof.traces.stores.responses import items_messages, items_output
from kvprof.traces.stores.tree import Node, ancestors, ordered

FIX = 'pass the SDK\'s trace export: {"data": [trace and trace.span objects]}, or one object per line'
SETTING = (
    "run with RunConfig(trace_include_sensitive_data=True) (OPENAI_AGENTS_TRACE_INCLUDE_SENSITIVE_DATA=true), and for "
    "the Responses API export each response span's input and response objects, then export again"
)


def objects(path: Path) -> list[dict]:
    """The export's trace and span objects (from `{"data": [...]}` payloads, lists, or one per line)."""
    values = json_documents(path, "Agents SDK export", FIX)
    found = []
    for value in values:
        entries = value.get("data", [value]) if isinstance(value, dict) else value
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict) and entry.get("object") in ("trace", "trace.span"):
                found.append(entry)
    return found


def read(path: Path) -> StoreLog:
    """The calls of an Agents SDK trace export."""
    found = objects(path)
    traces = {str(t.get("id")): t for t in found if t["object"] == "trace"}
    raw = [s for s in found if s["object"] == "trace.span"]
    if not raw:
        raise KvprofError(f"Agents SDK export {path} holds no spans; {FIX}.")
    nodes = [
        Node(str(s.get("id")), s.get("parent_id") or None, str(s.get("started_at") or ""), f"span {s.get('id')}", s)
        for s in raw
    ]
    spans = ordered(path, nodes, "span")
    by_key = {node.key: node for node in spans}
    held = {
        str(data["response"].get("id")): data
        for data in (node.record.get("span_data") or {} for node in spans)
        if data.get("type") == "response" and isinstance(data.get("response"), dict) and data.get("input") is not None
    }
    calls, missing, handed_to = [], [], {}
    for node in spans:
        span = node.record
        data = span.get("span_data") or {}
        trace_id = str(span.get("trace_id"))
        if data.get("type") == "handoff" and data.get("to_agent"):
            handed_to[trace_id] = str(data["to_agent"])
        if data.get("type") not in ("generation", "response"):
            continue
        trajectory = str(traces.get(trace_id, {}).get("group_id") or trace_id)
        agent = next(
            (str(n.record["span_data"].get("name")) for n in ancestors(node, by_key)[1:] if _is_agent(n)),
            handed_to.get(trace_id, "agent"),
        )
        content = _content(path, node, data, held)
        if isinstance(content, str):
            missing.append(MissingContent(trajectory, node.where, content))
            continue
        messages, output, tools, tokens = content
        calls.append(LoggedCall(0, agent, messages, output, trajectory, None, tools, node.where, tokens))
    return store_log(path, "agents-sdk", calls, missing, SETTING)


def _is_agent(node: Node) -> bool:
    return ((node.record.get("span_data") or {}).get("type")) == "agent"


def _content(path: Path, node: Node, data: dict, held: dict[str, dict]):
    """A call's messages, output, tools and input token count, or why the export does not hold them."""

    def refuse(problem: str, fix: str):
        return fail(path, node.where, problem, fix)

    if data["type"] == "generation":
        if data.get("input") is None or data.get("output") is None:
            return "no input or output (sensitive data not included)"
        tokens = (data.get("usage") or {}).get("input_tokens")
        return items_messages(data["input"], refuse), items_output(data["output"], refuse), None, tokens
    response = data.get("response")
    if not isinstance(response, dict) or data.get("input") is None:
        return "a response id without its input items"
    context: list[Message] = []
    previous, seen = response.get("previous_response_id"), {response.get("id")}
    while previous:
        if previous in seen:
            raise refuse(f"continues response {previous}, whose previous_response_id chain loops", FIX)
        seen.add(previous)
        earlier = held.get(str(previous))
        if earlier is None:
            return f"continues response {previous}, which the export does not hold"
        context = [
            *items_messages(earlier["input"], refuse),
            *items_messages(earlier["response"].get("output") or [], refuse),
            *context,
        ]
        previous = earlier["response"].get("previous_response_id")
    instructions = response.get("instructions")
    messages = ([Message("system", instructions)] if isinstance(instructions, str) and instructions else []) + [
        *context,
        *items_messages(data["input"], refuse),
    ]
    tokens = (response.get("usage") or {}).get("input_tokens")
    output = items_output(response.get("output") or [], refuse)
    return messages, output, chat_tools(response.get("tools"), refuse), tokens
