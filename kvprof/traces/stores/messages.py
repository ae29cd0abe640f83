"""The one shape every store's messages become: OpenAI chat messages (`kvprof.traces.chat.Message`) as a server
passes them to the chat template.

- Tool calls are `{"id", "type": "function", "function": {"name", "arguments"}}` with `arguments` an object (parsed
  from JSON text where the store keeps text), as vLLM renders them.
- Tool results are `tool` messages with `tool_call_id`; a result that is not text is its JSON.
- Reasoning is the assistant message's `reasoning_content`; a reply that only calls tools has content null (not
  empty text).
- Tool definitions are `{"type": "function", "function": {"name", "description", "parameters"}}`, from the flat
  form of the Responses API and the GenAI conventions, and from Anthropic's `input_schema` form.
- A call's output is its text; a reply that only calls tools is the JSON list of its calls' `function` objects
  (`output_text`); reasoning stays out of it.

Content blocks (Anthropic's, and LangChain's that follow them) are read by `blocks_messages`.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from kvprof.errors import KvprofError
from kvprof.traces.chat import Message

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
Refuse = Callable[[str, str], KvprofError]
"""`refuse(problem, fix)`: the reader's refusal naming its file and the span, run or row."""


def arguments(value: object) -> object:
    """Tool-call arguments as an object where they are a JSON object (or its text), else as given."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def tool_call(call_id: object, name: object, args: object) -> dict:
    """One OpenAI tool call."""
    call: dict = {} if call_id is None else {"id": str(call_id)}
    return call | {"type": "function", "function": {"name": str(name), "arguments": arguments(args)}}


def text_of(value: object) -> str:
    """A tool result or text field as text: itself when text, else its JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def output_text(texts: list[str], calls: list[dict]) -> str:
    """A call's output: its text, and the JSON list of its tool calls' `function` objects when it called tools."""
    parts = ["".join(texts)] if texts else []
    if calls:
        parts.append(json.dumps([call["function"] for call in calls], ensure_ascii=False))
    return "\n".join(part for part in parts if part)


def chat_tool(definition: object, refuse: Refuse) -> dict:
    """A tool definition in the chat form templates read."""
    if not isinstance(definition, dict):
        raise refuse("has a tool definition that is not an object", "export the tools as function schemas")
    if isinstance(definition.get("function"), dict):
        return definition
    if "input_schema" in definition:  # Anthropic's
        function = {"name": definition.get("name"), "description": definition.get("description")}
        return {"type": "function", "function": function | {"parameters": definition["input_schema"]}}
    if isinstance(definition.get("name"), str):  # the Responses API's and the GenAI conventions' flat form
        return {"type": "function", "function": {k: v for k, v in definition.items() if k != "type"}}
    raise refuse("has a tool definition without a name", "export the tools as function schemas")


def chat_tools(definitions: object, refuse: Refuse) -> list[dict] | None:
    """A call's tool definitions in chat form, or None when it has none."""
    if definitions in (None, []):
        return None
    if not isinstance(definitions, list):
        raise refuse("has tool definitions that are not a list", "export the tools as a list of function schemas")
    return [chat_tool(definition, refuse) for definition in definitions]


def openai_message(entry: object, refuse: Refuse) -> Message:
    """An OpenAI chat message (content text, text parts or null; `tool_calls`; `tool_call_id`; `name`)."""
    if not isinstance(entry, dict) or entry.get("role") not in ROLES:
        raise refuse(f"has a message that is not {{'role': one of {', '.join(ROLES)}, ...}}", "export chat messages")
    content = entry.get("content")
    if isinstance(content, list):
        content = "".join(_text_part(part, refuse) for part in content)
    elif content is not None and not isinstance(content, str):
        raise refuse("has a message whose content is neither text, text parts nor null", "export chat messages")
    calls = [_openai_tool_call(call, refuse) for call in entry.get("tool_calls") or []]
    if calls and not content:  # a reply that only calls tools: content null, as servers return it
        content = None
    reasoning = entry.get("reasoning_content")
    name = entry.get("name")
    return Message.of(
        ROLES[entry["role"]],
        content,
        None if name is None else str(name),
        calls or None,
        entry.get("tool_call_id"),
        reasoning if isinstance(reasoning, str) else None,
    )


def _text_part(part: object, refuse: Refuse) -> str:
    if isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
        return str(part.get("text", ""))
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise refuse(f"has a content part of type {kind!r}, which kvprof cannot render", "export text content")


def _openai_tool_call(call: object, refuse: Refuse) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise refuse("has a tool call without a function name", 'export tool calls as {"function": {"name", ...}}')
    return tool_call(call.get("id"), function["name"], function.get("arguments"))


def blocks_messages(role: str, blocks: object, refuse: Refuse, reasoning: str | None = None) -> list[Message]:
    """A message whose content is text or content blocks (text, tool_use, tool_result, thinking, reasoning): the
    message, after one `tool` message per tool result."""
    if isinstance(blocks, str) or blocks is None:
        return [Message.of(role, blocks, reasoning_content=reasoning)]
    if not isinstance(blocks, list):
        raise refuse("has a message whose content is neither text nor content blocks", "export the messages")
    texts, calls, results, thoughts = [], [], [], [] if reasoning is None else [reasoning]
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind == "text" and isinstance(block, dict):
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use" and isinstance(block, dict):
            calls.append(tool_call(block.get("id"), block.get("name"), block.get("input")))
        elif kind == "tool_result" and isinstance(block, dict):
            content = block.get("content")
            text = "".join(_text_part(part, refuse) for part in content) if isinstance(content, list) else content
            results.append(Message.of("tool", text_of(text), tool_call_id=block.get("tool_use_id")))
        elif kind in ("thinking", "reasoning") and isinstance(block, dict):
            thoughts.append(str(block.get("thinking", block.get("reasoning", ""))))
        else:
            raise refuse(f"has a content block of type {kind!r}, which kvprof cannot render", "drop it")
    if not (texts or calls or thoughts):
        return results
    content = "".join(texts) if texts or not calls else None
    message = Message.of(role, content, None, calls or None, None, "".join(thoughts) if thoughts else None)
    return [*results, message]
