"""The demo's chat log as an instrumented client exports it: OTLP JSON with the OpenTelemetry GenAI conventions
(`world/sample_logs/prompt_short_otlp.json`, what `kvprof import-chat` reads as format otlp).

Per trajectory one trace (`gen_ai.conversation.id` the trajectory), per call an `invoke_agent` span
(`gen_ai.agent.name`) and under it a `chat` span: the system message as `gen_ai.system_instructions`, the other
messages as `gen_ai.input.messages`, the output as `gen_ai.output.messages` (JSON text, parts of type text), and
`gen_ai.usage.input_tokens` as the server would count the call: the ids of its rendering with the world's template.
"""

from __future__ import annotations

import hashlib
import json

from kvprof.traces.chat import ChatFormat, Message

STEP_NS = 1_000_000  # a millisecond between spans


def _text(value: object) -> dict:
    return {"stringValue": value} if isinstance(value, str) else {"intValue": str(value)}


def _attributes(values: dict) -> list[dict]:
    return [{"key": key, "value": _text(value)} for key, value in values.items()]


def _parts(message: dict) -> dict:
    entry = {"role": message["role"], "parts": [{"type": "text", "content": message["content"]}]}
    return entry | ({"name": message["name"]} if message.get("name") else {})


def otlp_export(calls: list[dict], chat: ChatFormat) -> dict:
    """Chat-log `calls` (kvprof's format) as one OTLP `ExportTraceServiceRequest`; `chat` renders each call to count
    its input tokens."""
    spans = []
    for number, call in enumerate(calls, start=1):
        trace = hashlib.sha256(call["trajectory"].encode()).hexdigest()[:32]
        start = number * 2 * STEP_NS
        system, *messages = call["messages"]
        agent_span, chat_span = f"{2 * number:016x}", f"{2 * number + 1:016x}"
        agent = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": call["agent"]}
        spans.append(_span(trace, agent_span, "", f"invoke_agent {call['agent']}", start, agent))
        ids = chat.ids([Message.of(**m) for m in call["messages"]], generation_prompt=True)
        output = [_parts({"role": "assistant", "content": call["output"]}) | {"finish_reason": "stop"}]
        attributes = {
            "gen_ai.operation.name": "chat",
            "gen_ai.conversation.id": call["trajectory"],
            "gen_ai.system_instructions": json.dumps([{"type": "text", "content": system["content"]}]),
            "gen_ai.input.messages": json.dumps([_parts(message) for message in messages]),
            "gen_ai.output.messages": json.dumps(output),
            "gen_ai.usage.input_tokens": len(ids),
        }
        spans.append(_span(trace, chat_span, agent_span, "chat demo", start + STEP_NS // 2, attributes))
    scope = {"scope": {"name": "kvprof.demo"}, "spans": spans}
    resource = {"attributes": _attributes({"service.name": "kvprof-demo"})}
    return {"resourceSpans": [{"resource": resource, "scopeSpans": [scope]}]}


def _span(trace: str, span_id: str, parent: str, name: str, start: int, attributes: dict) -> dict:
    return {
        "traceId": trace,
        "spanId": span_id,
        "parentSpanId": parent,
        "name": name,
        "kind": 3,
        "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(start + STEP_NS // 4),
        "attributes": _attributes(attributes),
    }
