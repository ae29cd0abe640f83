"""OpenAI Responses API items as chat messages (the API reference's input items, and a response's `output`).

`message` items (`role`, `content` text or `input_text` / `output_text` parts; a chat message is read as one too),
`function_call` (`call_id`, `name`, `arguments`: an assistant message's tool call; calls in a row are one message,
as parallel calls), `function_call_output` (`call_id`, `output`: a `tool` message), `reasoning` (`summary` and
`content` texts: the next assistant message's `reasoning_content`). Any other item is refused.
"""

from __future__ import annotations

from dataclasses import replace

from kvprof.traces.chat import Message
from kvprof.traces.stores.messages import Refuse, openai_message, output_text, text_of, tool_call


def items_messages(items: object, refuse: Refuse) -> list[Message]:
    """A list of Responses items (or an input text) as chat messages."""
    if isinstance(items, str):
        return [Message("user", items)]
    if not isinstance(items, list):
        raise refuse("has an input that is neither text nor a list of items", "export the input items")
    messages: list[Message] = []
    thoughts: list[str] = []
    joinable = False  # the last message is an assistant message the next function call joins
    for item in items:
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            message = openai_message(item, refuse)
            if message.role == "assistant" and thoughts:
                message = replace(message, reasoning_content="".join(thoughts))
                thoughts = []
            messages.append(message)
            joinable = message.role == "assistant"
        elif kind == "function_call" and isinstance(item, dict):
            call = tool_call(item.get("call_id"), item.get("name"), item.get("arguments"))
            last = messages[-1] if joinable else None
            calls = [*(last.as_dict().get("tool_calls", []) if last else []), call]
            reasoning = "".join(thoughts) if thoughts else (last.reasoning_content if last else None)
            message = Message.of("assistant", last.content if last else None, None, calls, None, reasoning)
            if last:
                messages[-1] = message
            else:
                messages.append(message)
            thoughts, joinable = [], True
        elif kind == "function_call_output" and isinstance(item, dict):
            messages.append(Message.of("tool", text_of(item.get("output")), tool_call_id=item.get("call_id")))
            joinable = False
        elif kind == "reasoning" and isinstance(item, dict):
            for key in ("summary", "content"):
                thoughts += [str(part.get("text", "")) for part in item.get(key) or [] if isinstance(part, dict)]
        else:
            raise refuse(f"has an item of type {kind!r}, which kvprof cannot render", "leave such calls out")
    return messages


def items_output(items: object, refuse: Refuse) -> str:
    """A response's output items as the call's output text (`kvprof.traces.stores.messages.output_text`)."""
    texts, calls = [], []
    for message in items_messages(items, refuse):
        if message.content:
            texts.append(message.content)
        calls += message.as_dict().get("tool_calls", [])
    return output_text(texts, calls)
