"""One three-agent conversation (for `test_stores`) as the OpenAI chat log kvprof reads, and written from the specs
in each tracing store's export format.

Triage hands the question to the researcher (a handoff tool call), who searches twice in parallel (one search fails
with a tool error), answers with a reasoning part, and the writer gives the final answer; every agent has its own
system instructions and tools. `records` are the chat-log lines (tool-call arguments as objects, as vLLM renders
them); each `write_*` writes the same calls as a store exports them, with each call's input token count where the
format records one (`counts`, or None).
"""

from __future__ import annotations

import copy
import json
import sqlite3
from pathlib import Path

from real_chat import TOOLS

SEARCH = TOOLS[0]
SYSTEM = {
    "triage": "You are triage. Hand each question to the researcher.",
    "researcher": "You research with the search tool, then hand over to the writer.",
    "writer": "You write the final answer as answer[ANSWER].",
}
QUESTION = "Where was Kalomir born, and who is his father?"
TRAJECTORY = "conv-1"


def _handoff(agent: str) -> dict:
    parameters = {"type": "object", "properties": {}}
    function = {
        "name": f"transfer_to_{agent}",
        "description": f"Hand the question to the {agent}.",
        "parameters": parameters,
    }
    return {"type": "function", "function": function}


AGENT_TOOLS = {"triage": [_handoff("researcher")], "researcher": [SEARCH, _handoff("writer")], "writer": [SEARCH]}


def _call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


HANDOFF = _call("call00001", "transfer_to_researcher", {})
SEARCHES = [_call("call00002", "search", {"query": "Kalomir"}), _call("call00003", "search", {"query": "Tevren"})]
FOUND = "Observation: Kalomir is a painter with father Tevren and birthplace Norvash."
ERROR = "Error: the search service timed out."
REASONING = "The second search failed, but the first result names both."
ANSWER = "Kalomir was born in Norvash; his father is Tevren."
HISTORY = [  # what the calls after each one read: (messages added after call k)
    [
        {"role": "assistant", "content": None, "tool_calls": [HANDOFF]},
        {"role": "tool", "content": '{"assistant": "researcher"}', "tool_call_id": "call00001"},
    ],
    [
        {"role": "assistant", "content": None, "tool_calls": SEARCHES},
        {"role": "tool", "content": FOUND, "tool_call_id": "call00002"},
        {"role": "tool", "content": ERROR, "tool_call_id": "call00003"},
    ],
    [{"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}],
]
SCRIPT = [  # (agent, how many history blocks it reads, its output message)
    ("triage", 0, {"role": "assistant", "content": None, "tool_calls": [HANDOFF]}),
    ("researcher", 1, {"role": "assistant", "content": None, "tool_calls": SEARCHES}),
    ("researcher", 2, {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}),
    ("writer", 3, {"role": "assistant", "content": "answer[Norvash]"}),
]


def output_of(reply: dict) -> str:
    """The call's output text as kvprof's readers make it (`kvprof.traces.stores.messages.output_text`)."""
    if reply.get("tool_calls"):
        return json.dumps([call["function"] for call in reply["tool_calls"]])
    return reply["content"]


def records(tools: bool = True, reasoning: bool = True) -> list[dict]:
    """The conversation as chat-log lines (`tools`: with each agent's tools; `reasoning`: with reasoning_content)."""
    lines = []
    for agent, read, reply in SCRIPT:
        messages = [{"role": "system", "content": SYSTEM[agent]}, {"role": "user", "content": QUESTION}]
        messages += [message for block in HISTORY[:read] for message in copy.deepcopy(block)]
        if not reasoning:
            for message in messages:
                message.pop("reasoning_content", None)
        line = {"agent": agent, "messages": messages, "output": output_of(reply), "trajectory": TRAJECTORY}
        if tools:
            line["tools"] = AGENT_TOOLS[agent]
        lines.append(line)
    return lines


def replies() -> list[dict]:
    return [reply for _, _, reply in SCRIPT]


def write_jsonl(lines: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


# OTLP ------------------------------------------------------------------------------------------------------------


def any_value(value: object) -> dict:
    """A Python value as an OTLP JSON AnyValue."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, list):
        return {"arrayValue": {"values": [any_value(item) for item in value]}}
    if isinstance(value, dict):
        return {"kvlistValue": {"values": otlp_attributes(value)}}
    return {}


def otlp_attributes(values: dict) -> list[dict]:
    return [{"key": key, "value": any_value(value)} for key, value in values.items() if value is not None]


def span(trace: str, span_id: str, parent: str | None, name: str, start: int, attributes: dict, events=()) -> dict:
    return {
        "traceId": trace,
        "spanId": span_id,
        "parentSpanId": parent or "",
        "name": name,
        "kind": 3,
        "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(start + 500),
        "attributes": otlp_attributes(attributes),
        "events": list(events),
    }


def otlp_request(spans: list[dict], logs: list[dict] = ()) -> dict:
    request: dict = {"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [{"scope": {}, "spans": spans}]}]}
    if logs:
        request["resourceLogs"] = [{"resource": {}, "scopeLogs": [{"scope": {}, "logRecords": list(logs)}]}]
    return request


def genai_parts(message: dict) -> dict:
    """A chat message in the GenAI conventions' parts form (`result` for the tool error, as the spec's example)."""
    parts: list[dict] = []
    if message.get("reasoning_content"):
        parts.append({"type": "reasoning", "content": message["reasoning_content"]})
    if message["role"] == "tool":
        key = "result" if message["content"] == ERROR else "response"
        parts.append({"type": "tool_call_response", "id": message["tool_call_id"], key: message["content"]})
    elif message.get("content"):
        parts.append({"type": "text", "content": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        parts.append(
            {"type": "tool_call", "id": call["id"], "name": function["name"], "arguments": function["arguments"]}
        )
    return {"role": message["role"], "parts": parts}


def flat_tool(tool: dict) -> dict:
    return {"type": "function", **tool["function"]}


def _agent_spans(trace: str, lines: list[dict], call_span, agent_attributes) -> list[dict]:
    """An agent span per run of calls by one agent, each call's span (`call_span(line, k, span_id, parent, start)`)
    under it, two tool spans started together for the parallel searches."""
    spans = [span(trace, "00000000000000aa", None, "workflow", 1000, {})]
    parent, agent, start = None, None, 2000
    for k, line in enumerate(lines):
        if line["agent"] != agent:
            agent, parent = line["agent"], f"{k + 1:016x}"
            spans.append(
                span(trace, parent, "00000000000000aa", f"invoke_agent {agent}", start, agent_attributes(agent))
            )
        start += 1000
        spans.append(call_span(line, k, f"{k + 1:08x}{k + 1:08x}", parent, start))
        if k == 1:
            for n in (1, 2):
                spans.append(span(trace, f"{n:08x}0000ffff", parent, "execute_tool search", start + 600, {}))
    return spans


def write_genai(lines: list[dict], counts: list | None, path: Path, on_event: bool = False, as_json: bool = True):
    """OTLP JSON, the current GenAI conventions: system instructions, input and output messages of typed parts and
    tool definitions on each chat span (or on its operation details event), JSON text or structured."""
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    encode = json.dumps if as_json else (lambda value: value)

    def call_span(line: dict, k: int, span_id: str, parent: str, start: int) -> dict:
        system, *messages = line["messages"]
        content = {
            "gen_ai.system_instructions": encode([{"type": "text", "content": system["content"]}]),
            "gen_ai.input.messages": encode([genai_parts(m) for m in messages]),
            "gen_ai.output.messages": encode([genai_parts(replies()[k]) | {"finish_reason": "stop"}]),
        }
        if line.get("tools"):
            content["gen_ai.tool.definitions"] = encode([flat_tool(t) for t in line["tools"]])
        attributes = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", "gen_ai.request.model": "m"}
        attributes["gen_ai.usage.input_tokens"] = None if counts is None else counts[k]
        events = []
        if on_event:
            details = {"name": "gen_ai.client.inference.operation.details", "timeUnixNano": str(start + 400)}
            events.append(details | {"attributes": otlp_attributes(content)})
        else:
            attributes |= content
        return span(trace, span_id, parent, "chat m", start, attributes, events)

    def agent_attributes(agent: str) -> dict:
        return {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": agent,
            "gen_ai.conversation.id": TRAJECTORY,
        }

    path.write_text(json.dumps(otlp_request(_agent_spans(trace, lines, call_span, agent_attributes))), encoding="utf-8")
    return path


def write_genai_deprecated(lines: list[dict], path: Path, events: bool) -> Path:
    """OTLP JSON, the conventions of v1.36 and earlier: `gen_ai.prompt` / `gen_ai.completion` as JSON text on the
    span, or (`events`) one log record per message (`gen_ai.user.message`, ..., `gen_ai.choice`) of the span."""
    trace = "5bf92f3577b34da6a3ce929d0e0e4736"
    logs: list[dict] = []

    def wire(message: dict) -> dict:  # arguments as the OpenAI API sends them: JSON text
        message = copy.deepcopy(message)
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
        return message

    def call_span(line: dict, k: int, span_id: str, parent: str, start: int) -> dict:
        attributes = {"gen_ai.operation.name": "chat", "gen_ai.system": "openai"}
        if not events:
            attributes["gen_ai.prompt"] = json.dumps([wire(m) for m in line["messages"]])
            attributes["gen_ai.completion"] = json.dumps([wire(replies()[k])])
            return span(trace, span_id, parent, "chat m", start, attributes)
        for n, message in enumerate([*line["messages"], None]):
            if message is None:
                name, body = "gen_ai.choice", {"index": 0, "message": wire(replies()[k])}
            else:
                body = {key: value for key, value in wire(message).items() if key not in ("role", "tool_call_id")}
                body |= {"id": message["tool_call_id"]} if message["role"] == "tool" else {}
                name = f"gen_ai.{message['role']}.message"
            record = {"timeUnixNano": str(start + n), "eventName": name, "spanId": span_id, "traceId": trace}
            logs.append(record | {"body": any_value(body)})
        return span(trace, span_id, parent, "chat m", start, attributes)

    def agent_attributes(agent: str) -> dict:
        return {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": agent,
            "gen_ai.conversation.id": TRAJECTORY,
        }

    spans = _agent_spans(trace, lines, call_span, agent_attributes)
    path.write_text(json.dumps(otlp_request(spans, logs)), encoding="utf-8")
    return path


def openinference_message(prefix: str, message: dict) -> dict:
    """One message as OpenInference's flattened attributes (arguments as JSON text)."""
    flat = {f"{prefix}.message.role": message["role"]}
    if message.get("content") is not None:
        flat[f"{prefix}.message.content"] = message["content"]
    if message.get("tool_call_id"):
        flat[f"{prefix}.message.tool_call_id"] = message["tool_call_id"]
    for j, call in enumerate(message.get("tool_calls") or []):
        at = f"{prefix}.message.tool_calls.{j}.tool_call"
        flat |= {f"{at}.id": call["id"], f"{at}.function.name": call["function"]["name"]}
        flat[f"{at}.function.arguments"] = json.dumps(call["function"]["arguments"])
    return flat


def write_openinference(lines: list[dict], counts: list | None, path: Path) -> Path:
    """OTLP JSON with OpenInference attributes: AGENT spans (`graph.node.id`), LLM spans with flattened input and
    output messages, `llm.tools.N.tool.json_schema`, `llm.token_count.prompt`, and `session.id` on every span."""
    trace = "6bf92f3577b34da6a3ce929d0e0e4736"

    def call_span(line: dict, k: int, span_id: str, parent: str, start: int) -> dict:
        attributes = {"openinference.span.kind": "LLM", "session.id": TRAJECTORY, "llm.model_name": "m"}
        for i, message in enumerate(line["messages"]):
            attributes |= openinference_message(f"llm.input_messages.{i}", message)
        attributes |= openinference_message("llm.output_messages.0", replies()[k])
        for i, tool in enumerate(line.get("tools") or []):
            attributes[f"llm.tools.{i}.tool.json_schema"] = json.dumps(tool)
        attributes["llm.token_count.prompt"] = None if counts is None else counts[k]
        return span(trace, span_id, parent, "ChatCompletion", start, attributes)

    def agent_attributes(agent: str) -> dict:
        return {"openinference.span.kind": "AGENT", "graph.node.id": agent, "session.id": TRAJECTORY}

    path.write_text(json.dumps(otlp_request(_agent_spans(trace, lines, call_span, agent_attributes))), encoding="utf-8")
    return path


# LangSmith -------------------------------------------------------------------------------------------------------


def langchain_message(message: dict) -> dict:
    """A chat message in LangChain's serialized constructor form."""
    kind = {"system": "SystemMessage", "user": "HumanMessage", "assistant": "AIMessage", "tool": "ToolMessage"}
    kwargs: dict = {"content": message.get("content") or ""}
    if message.get("tool_calls"):
        kwargs["tool_calls"] = [
            {"name": c["function"]["name"], "args": c["function"]["arguments"], "id": c["id"], "type": "tool_call"}
            for c in message["tool_calls"]
        ]
    if message.get("tool_call_id"):
        kwargs["tool_call_id"] = message["tool_call_id"]
    if message.get("reasoning_content"):
        kwargs["additional_kwargs"] = {"reasoning_content": message["reasoning_content"]}
    return {
        "lc": 1,
        "type": "constructor",
        "id": ["langchain", "schema", "messages", kind[message["role"]]],
        "kwargs": kwargs,
    }


def write_langsmith(lines: list[dict], counts: list | None, path: Path) -> Path:
    """LangSmith runs as JSON lines: a LangGraph root chain run, a chain run per agent node, an llm run per call with
    LangChain messages, `extra.invocation_params.tools`, `thread_id` and `langgraph_node` in the metadata."""
    root = "00000000-0000-0000-0000-000000000000"
    runs = [
        {
            "id": root,
            "name": "LangGraph",
            "run_type": "chain",
            "parent_run_id": None,
            "trace_id": root,
            "start_time": "2025-01-01T00:00:00",
            "dotted_order": f"20250101T000000000000Z{root}",
            "extra": {"metadata": {"thread_id": TRAJECTORY}},
            "inputs": {},
            "outputs": {},
        }
    ]
    for k, line in enumerate(lines):
        node, llm = f"00000000-0000-0000-0000-0000000000{k}1", f"00000000-0000-0000-0000-0000000000{k}2"
        stamp = f"20250101T00000{k}"
        metadata = {"thread_id": TRAJECTORY, "langgraph_node": line["agent"]}
        runs.append(
            {
                "id": node,
                "name": line["agent"],
                "run_type": "chain",
                "parent_run_id": root,
                "trace_id": root,
                "start_time": f"2025-01-01T00:00:0{k}",
                "dotted_order": f"{runs[0]['dotted_order']}.{stamp}000000Z{node}",
                "extra": {"metadata": metadata},
                "inputs": {},
                "outputs": {},
            }
        )
        reply = langchain_message(replies()[k])
        if counts is not None:
            reply["kwargs"]["usage_metadata"] = {"input_tokens": counts[k], "output_tokens": 5, "total_tokens": 5}
        runs.append(
            {
                "id": llm,
                "name": "ChatOpenAI",
                "run_type": "llm",
                "parent_run_id": node,
                "trace_id": root,
                "start_time": f"2025-01-01T00:00:0{k}.5",
                "dotted_order": f"{runs[-1]['dotted_order']}.{stamp}500000Z{llm}",
                "extra": {"metadata": metadata, "invocation_params": {"model": "m", "tools": line.get("tools")}},
                "inputs": {"messages": [[langchain_message(m) for m in line["messages"]]]},
                "outputs": {"generations": [[{"text": replies()[k].get("content") or "", "message": reply}]]},
            }
        )
    path.write_text("".join(json.dumps(run) + "\n" for run in runs), encoding="utf-8")
    return path


# OpenAI Agents SDK -----------------------------------------------------------------------------------------------


def sdk_span(span_id: str, parent: str | None, start: int, data: dict) -> dict:
    return {
        "object": "trace.span",
        "id": span_id,
        "trace_id": "trace_1",
        "parent_id": parent,
        "started_at": f"2025-01-01T00:00:{start:02d}.000000+00:00",
        "ended_at": None,
        "span_data": data,
        "error": None,
    }


def write_agents_sdk(lines: list[dict], counts: list | None, path: Path, call_data) -> Path:
    """The SDK's export payload: the trace (`group_id` the conversation), an agent span per agent run, each call's
    span (`call_data(line, k)`) under it, function spans for the tools, a handoff span at each handoff."""
    data: list[dict] = [{"object": "trace", "id": "trace_1", "workflow_name": "Agent workflow", "group_id": TRAJECTORY}]
    parent, agent, clock = None, None, 0
    for k, line in enumerate(lines):
        if line["agent"] != agent:
            if agent is not None:
                clock += 1
                data.append(
                    sdk_span(
                        f"span_h{k}", parent, clock, {"type": "handoff", "from_agent": agent, "to_agent": line["agent"]}
                    )
                )
            agent, parent, clock = line["agent"], f"span_a{k}", clock + 1
            data.append(sdk_span(parent, None, clock, {"type": "agent", "name": agent, "handoffs": [], "tools": []}))
        clock += 1
        data.append(sdk_span(f"span_g{k}", parent, clock, call_data(line, k)))
        if k == 1:
            for n, call in enumerate(SEARCHES):
                data.append(
                    sdk_span(
                        f"span_f{n}",
                        parent,
                        clock + 1,
                        {"type": "function", "name": "search", "input": json.dumps(call["function"]["arguments"])},
                    )
                )
    path.write_text(json.dumps({"data": data}), encoding="utf-8")
    return path


def generation_data(counts: list | None):
    """`generation` span data: the chat messages the model was called with (arguments as JSON text), its output."""

    def wire(message: dict) -> dict:
        message = copy.deepcopy(message)
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
        return message

    def data(line: dict, k: int) -> dict:
        usage = None if counts is None else {"input_tokens": counts[k], "output_tokens": 5}
        return {
            "type": "generation",
            "input": [wire(m) for m in line["messages"]],
            "output": [wire(replies()[k])],
            "model": "m",
            "model_config": {},
            "usage": usage,
        }

    return data


def response_items(messages: list[dict]) -> list[dict]:
    """Chat messages as Responses API items."""
    items: list[dict] = []
    for message in messages:
        if message.get("reasoning_content"):
            items.append(
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [{"type": "summary_text", "text": message["reasoning_content"]}],
                }
            )
        if message["role"] == "tool":
            items.append(
                {"type": "function_call_output", "call_id": message["tool_call_id"], "output": message["content"]}
            )
        elif message.get("tool_calls"):
            items += [
                {
                    "type": "function_call",
                    "call_id": c["id"],
                    "name": c["function"]["name"],
                    "arguments": json.dumps(c["function"]["arguments"]),
                }
                for c in message["tool_calls"]
            ]
        else:
            kind = "output_text" if message["role"] == "assistant" else "input_text"
            items.append(
                {"type": "message", "role": message["role"], "content": [{"type": kind, "text": message["content"]}]}
            )
    return items


def response_data(counts: list | None, chained: tuple[int, ...] = (2,)):
    """`response` span data holding the input items and the Response; the calls in `chained` continue the call
    before them with `previous_response_id` (their input only what came after it)."""

    def data(line: dict, k: int) -> dict:
        system, *messages = line["messages"]
        previous = None
        if k in chained:
            before = len(records()[k - 1]["messages"]) - 1  # the earlier call's input, then its output
            messages = messages[before + 1 :]
            previous = f"resp_{k - 1}"
        response = {
            "id": f"resp_{k}",
            "object": "response",
            "instructions": system["content"],
            "previous_response_id": previous,
            "tools": [flat_tool(t) for t in line.get("tools") or []],
            "output": response_items([replies()[k]]),
            "usage": None if counts is None else {"input_tokens": counts[k], "output_tokens": 5},
        }
        return {"type": "response", "response_id": f"resp_{k}", "input": response_items(messages), "response": response}

    return data


# AG2 -------------------------------------------------------------------------------------------------------------

AG2_SCHEMA = """CREATE TABLE chat_completions (id INTEGER PRIMARY KEY, invocation_id TEXT, client_id INTEGER,
wrapper_id INTEGER, session_id TEXT, source_name TEXT, request TEXT, response TEXT, is_cached INTEGER, cost REAL,
start_time DATETIME DEFAULT CURRENT_TIMESTAMP, end_time DATETIME DEFAULT CURRENT_TIMESTAMP)"""


def write_ag2(lines: list[dict], counts: list | None, path: Path) -> Path:
    """AG2's runtime log: a `chat_completions` row per call (request: messages and tools; response: the
    ChatCompletion with its usage), arguments as JSON text as the OpenAI client sends them."""

    def wire(message: dict) -> dict:
        message = copy.deepcopy(message)
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
        return message

    connection = sqlite3.connect(path)
    connection.execute(AG2_SCHEMA)
    for k, line in enumerate(lines):
        request = {"messages": [wire(m) for m in line["messages"]], "model": "m"}
        if line.get("tools"):
            request["tools"] = line["tools"]
        usage = {"prompt_tokens": counts[k] if counts else 0, "completion_tokens": 5}
        response = {
            "id": f"chatcmpl-{k}",
            "choices": [{"index": 0, "message": wire(replies()[k]), "finish_reason": "stop"}],
            "usage": usage if counts else None,
        }
        connection.execute(
            "INSERT INTO chat_completions (invocation_id, session_id, source_name, request, response, start_time) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (
                f"inv-{k}",
                TRAJECTORY,
                line["agent"],
                json.dumps(request),
                json.dumps(response),
                f"2025-01-01 00:00:0{k}",
            ),
        )
    connection.commit()
    connection.close()
    return path
