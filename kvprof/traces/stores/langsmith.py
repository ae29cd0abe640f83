"""LangSmith run exports (the Run schema of the LangSmith API: `langsmith.schemas.Run`), as a JSON list, `{"runs":
[...]}`, or one run per line.

A run with `run_type` "llm" is one call. Runs form a tree by `parent_run_id`, each run's children ordered by
`dotted_order` (else `start_time`). Its messages are `inputs.messages` (a list, or LangChain's batch: a list of
lists, the first taken), each in LangChain's serialized constructor form (`{"lc": 1, "type": "constructor", "id":
[..., "HumanMessage"], "kwargs": {"content", "tool_calls", "tool_call_id", "name"}}`) or `{"type": "human",
"data": {...}}`, or as OpenAI's or Anthropic's API takes them (with Anthropic's `inputs.system`). The output is
`outputs.generations[0][0].message` (or `.text`), an OpenAI `choices[0].message`, or Anthropic's `content`; the tools
`extra.invocation_params.tools` or `inputs.tools`; the input token count the output's `llm_output.token_usage` /
`usage` (`prompt_tokens` or `input_tokens`), or the AI message's `usage_metadata.input_tokens`. The agent is the
metadata's `lc_agent_name`, else `langgraph_node`, else the nearest chain run's name; the trajectory the metadata's
`thread_id` (or `session_id`, `conversation_id`), else the `trace_id`.
"""

from __future__ import annotations

from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.traces.chat import Message
from kvprof.traces.chat_log import LoggedCall
from kvprof.traces.stores.common import MissingContent, StoreLog, fail, json_documents, store_log
from kvprof.traces.stores.messages import (
    ROLES,
    Refuse,
    blocks_messages,
    chat_tools,
    openai_message,
    output_text,
    text_of,
    tool_call,
)
from kvprof.traces.stores.tree import Node, ancestors, ordered

FIX = 'pass LangSmith runs: a JSON list of runs, {"runs": [...]}, or one run per line'
SETTING = "unset LANGSMITH_HIDE_INPUTS and LANGSMITH_HIDE_OUTPUTS (or the client's hide_inputs) and export again"
LANGCHAIN_ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool", "chat": "user"}
THREAD_KEYS = ("thread_id", "session_id", "conversation_id")


def runs(path: Path) -> list[dict]:
    """The export's runs."""
    values = json_documents(path, "LangSmith export", FIX)
    if len(values) == 1:
        whole = values[0]
        values = whole.get("runs", values) if isinstance(whole, dict) else whole if isinstance(whole, list) else values
    return [run for run in values if isinstance(run, dict) and "run_type" in run]


def read(path: Path) -> StoreLog:
    """The calls of a LangSmith run export."""
    found = runs(path)
    if not found:
        raise KvprofError(f"LangSmith export {path} holds no runs; {FIX}.")
    nodes = [
        Node(str(r.get("id")), r.get("parent_run_id") and str(r["parent_run_id"]), _order(r), f"run {r.get('id')}", r)
        for r in found
    ]
    order = ordered(path, nodes, "run")
    by_key = {node.key: node for node in order}
    calls, missing = [], []
    for node in order:
        run: dict = node.record
        if run.get("run_type") != "llm":
            continue
        metadata = (run.get("extra") or {}).get("metadata") or {}
        thread = next((metadata[key] for key in THREAD_KEYS if metadata.get(key)), None)
        trajectory = str(thread or run.get("trace_id") or ancestors(node, by_key)[-1].key)
        chains = [n.record.get("name") for n in ancestors(node, by_key)[1:] if n.record.get("run_type") == "chain"]
        agent = str(metadata.get("lc_agent_name") or metadata.get("langgraph_node") or next(iter(chains), "agent"))
        content = _content(path, node, run)
        if isinstance(content, str):
            missing.append(MissingContent(trajectory, node.where, content))
            continue
        messages, output, tokens = content
        params = (run.get("extra") or {}).get("invocation_params") or {}

        def refuse(problem: str, fix: str, where: str = node.where):
            return fail(path, where, problem, fix)

        tools = chat_tools(params.get("tools") or (run.get("inputs") or {}).get("tools"), refuse)
        calls.append(LoggedCall(0, agent, messages, output, trajectory, None, tools, node.where, tokens))
    return store_log(path, "langsmith", calls, missing, SETTING)


def _order(run: dict) -> str:
    dotted = run.get("dotted_order")
    return str(dotted).rsplit(".", 1)[-1] if dotted else str(run.get("start_time") or "")


def _content(path: Path, node: Node, run: dict):
    """A run's messages, output and input token count, or why the export does not hold them."""

    def refuse(problem: str, fix: str):
        return fail(path, node.where, problem, fix)

    inputs, outputs = run.get("inputs") or {}, run.get("outputs") or {}
    entries = inputs.get("messages")
    if isinstance(entries, list) and entries and isinstance(entries[0], list):
        entries = entries[0]
    if not entries:
        return "no input messages (inputs hidden)"
    if not isinstance(entries, list):
        raise refuse("has inputs.messages that is not a list of messages", FIX)
    messages = []
    system = inputs.get("system")
    if system:
        messages += blocks_messages("system", system, refuse)
    for entry in entries:
        messages += message_of(entry, refuse)
    reply, tokens = _reply(outputs, refuse)
    if reply is None:
        return "no output message (outputs hidden)"
    texts = [reply.content] if reply.content else []
    return messages, output_text(texts, reply.as_dict().get("tool_calls", [])), tokens


def message_of(entry: object, refuse: Refuse) -> list[Message]:
    """One exported message as chat messages (a user message of tool results becomes `tool` messages)."""
    if not isinstance(entry, dict):
        raise refuse("has a message that is not an object", FIX)
    if entry.get("lc") == 1 and isinstance(entry.get("id"), list):
        kind = str(entry["id"][-1]).removesuffix("Chunk").removesuffix("Message").lower()
        return _langchain(kind, entry.get("kwargs") or {}, refuse)
    if "data" in entry and entry.get("type") in LANGCHAIN_ROLES:
        return _langchain(str(entry["type"]), entry["data"] or {}, refuse)
    if isinstance(entry.get("content"), list) and entry.get("role") in ROLES:  # Anthropic's content blocks
        return blocks_messages(ROLES[entry["role"]], entry["content"], refuse)
    return [openai_message(entry, refuse)]


def _langchain(kind: str, fields: dict, refuse: Refuse) -> list[Message]:
    """A LangChain message's fields (`content` text or blocks, `tool_calls` with `args`, `tool_call_id`, `name`,
    `additional_kwargs.reasoning_content`) as chat messages."""
    role = LANGCHAIN_ROLES.get(kind)
    if role is None:
        raise refuse(f"has a LangChain message of type {kind!r}, which kvprof cannot render", "export chat messages")
    content = fields.get("content")
    if role == "tool":
        return [Message.of("tool", text_of(content), tool_call_id=fields.get("tool_call_id"))]
    if isinstance(content, list):  # tool_use blocks repeat the message's tool_calls
        content = [b for b in content if not (isinstance(b, dict) and b.get("type") == "tool_use")] or None
    reasoning = (fields.get("additional_kwargs") or {}).get("reasoning_content")
    *results, message = blocks_messages(role, content, refuse, reasoning) or [Message(role, None)]
    calls = [
        tool_call(call.get("id"), call.get("name"), call.get("args"))
        for call in fields.get("tool_calls") or []
        if isinstance(call, dict)
    ]
    name = fields.get("name")
    entry = message.as_dict() | ({"name": str(name)} if name else {}) | ({"tool_calls": calls} if calls else {})
    return [*results, openai_message(entry, refuse)]


def _reply(outputs: dict, refuse: Refuse) -> tuple[Message | None, int | None]:
    """The output message and the input token count of a run's outputs."""
    usage = outputs.get("usage") or ((outputs.get("llm_output") or {}).get("token_usage")) or {}
    tokens = usage.get("prompt_tokens", usage.get("input_tokens"))
    generations = outputs.get("generations")
    if isinstance(generations, list) and generations:
        first = generations[0][0] if isinstance(generations[0], list) else generations[0]
        if isinstance(first.get("message"), dict):
            message = first["message"]
            fields = message.get("kwargs") or message.get("data") or {}
            tokens = tokens if tokens is not None else (fields.get("usage_metadata") or {}).get("input_tokens")
            return message_of(message, refuse)[-1], tokens
        return Message("assistant", str(first.get("text", ""))), tokens
    if isinstance(outputs.get("choices"), list) and outputs["choices"]:
        return openai_message(outputs["choices"][0].get("message"), refuse), tokens
    if isinstance(outputs.get("content"), list):
        return blocks_messages("assistant", outputs["content"], refuse)[-1], tokens
    return None, tokens
