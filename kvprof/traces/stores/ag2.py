"""AG2's (AutoGen 0.2's) SQLite runtime log: `autogen.runtime_logging.start(logger_type="sqlite")` writes a table
`chat_completions` with one row per model call: `id`, `session_id`, `source_name` (the agent), `request` (JSON: the
`create` arguments: `messages`, `tools`), `response` (JSON: the ChatCompletion, `choices[0].message`,
`usage.prompt_tokens`), `start_time`. The trajectory is the session, the order `start_time` (then `id`).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.fileio import require_file
from kvprof.traces.chat_log import LoggedCall
from kvprof.traces.stores.common import StoreLog, fail, store_log
from kvprof.traces.stores.messages import chat_tools, openai_message, output_text

FIX = 'pass the database autogen.runtime_logging.start(logger_type="sqlite") wrote'
SETTING = "AG2 logs every call's request in full; log the run with autogen.runtime_logging.start()"
QUERY = "SELECT id, session_id, source_name, request, response FROM chat_completions ORDER BY start_time, id"


def read(path: Path) -> StoreLog:
    """The calls of an AG2 SQLite log."""
    require_file(path, "AG2 log", FIX)
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as connection:
            tables = {name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            rows = connection.execute(QUERY).fetchall() if "chat_completions" in tables else None
    except sqlite3.Error as err:
        raise KvprofError(f"{path} cannot be read as AG2's SQLite log ({err}); {FIX}.") from None
    if rows is None:
        raise KvprofError(f"{path} has no table chat_completions, so it is not AG2's runtime log; {FIX}.")
    calls = [_call(path, *row) for row in rows]
    return store_log(path, "ag2", calls, [], SETTING)


def _call(path: Path, row: int, session: str, agent: str, request_text: str, response_text: str) -> LoggedCall:
    where = f"row {row}"

    def refuse(problem: str, fix: str):
        return fail(path, where, problem, fix)

    request, response = _json(path, where, "request", request_text), _json(path, where, "response", response_text)
    if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
        raise refuse("has a request without a list of messages", FIX)
    response = response if isinstance(response, dict) else {}
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise refuse("has a response that is not a chat completion (no choices)", "leave failed calls out of the log")
    reply = openai_message(choices[0].get("message"), refuse)
    output = output_text([reply.content] if reply.content else [], reply.as_dict().get("tool_calls", []))
    messages = [openai_message(entry, refuse) for entry in request["messages"]]
    tokens = (response.get("usage") or {}).get("prompt_tokens")
    tools = chat_tools(request.get("tools"), refuse)
    return LoggedCall(0, str(agent), messages, output, str(session), None, tools, where, tokens)


def _json(path: Path, where: str, name: str, text: object) -> object:
    try:
        return json.loads(text) if isinstance(text, (str, bytes)) else None
    except json.JSONDecodeError as err:
        raise fail(path, where, f"has a {name} that is not JSON ({err.msg})", FIX) from None
