"""Which format an input is in (`detect`), and its calls read by that format's reader (`read_calls`).

Detected from the content: SQLite's header (AG2's log); OTLP's `resourceSpans` (OpenInference when any span carries
`openinference.span.kind`, else the GenAI conventions); Agents SDK `trace` / `trace.span` objects; LangSmith runs
(`run_type`); anything else is read as kvprof's chat log. `--format` forces one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.fileio import read_text_file, require_file
from kvprof.traces.chat_log import read_log
from kvprof.traces.stores import ag2, agents_sdk, genai, langsmith, openinference
from kvprof.traces.stores.common import StoreLog


def _chat(path: Path) -> StoreLog:
    return StoreLog("chat", read_log(path))


FORMATS: dict[str, tuple[str, Callable[[Path], StoreLog]]] = {
    "chat": ("a chat log (OpenAI messages, one agent call per line)", _chat),
    "otlp": ("OTLP JSON with the OpenTelemetry GenAI conventions", genai.read),
    "openinference": ("OTLP JSON with OpenInference attributes", openinference.read),
    "langsmith": ("a LangSmith run export", langsmith.read),
    "agents-sdk": ("an OpenAI Agents SDK trace export", agents_sdk.read),
    "ag2": ("AG2's SQLite runtime log", ag2.read),
}
SQLITE_HEADER = b"SQLite format 3\x00"
NAMES = ", ".join(FORMATS)
FIX = f"pass --format with one of {NAMES}"


def detect(path: Path) -> str:
    """The format of the file at `path`: a store's when its content has that store's marks, else the chat log (whose
    reader names the first line that is not a call)."""
    require_file(path, "trace export", FIX)
    with open(path, "rb") as handle:
        if handle.read(len(SQLITE_HEADER)) == SQLITE_HEADER:
            return "ag2"
    text = read_text_file(path, "trace export", FIX)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        first = next((line for line in text.splitlines() if line.strip()), "")
        try:
            value = json.loads(first)
        except json.JSONDecodeError:
            return "chat"
    found = _kind(value[0] if isinstance(value, list) and value else value)
    if found == "otlp" and '"openinference.span.kind"' in text:
        return "openinference"
    return found


def _kind(value: object) -> str:
    if not isinstance(value, dict):
        return "chat"
    if {"resourceSpans", "resourceLogs"} & set(value):
        return "otlp"
    entries = value.get("data")
    if value.get("object") in ("trace", "trace.span") or (
        isinstance(entries, list) and entries and isinstance(entries[0], dict) and "object" in entries[0]
    ):
        return "agents-sdk"
    if "run_type" in value or isinstance(value.get("runs"), list):
        return "langsmith"
    return "chat"


def resolve_format(path: Path, choice: str) -> str:
    """`--format`: "auto" (the detected format) or a key of `FORMATS`."""
    if choice == "auto":
        return detect(path)
    if choice not in FORMATS:
        raise KvprofError(f"--format {choice!r} is not a format kvprof reads; pass auto or one of {NAMES}.")
    return choice


def read_calls(path: Path, format: str) -> StoreLog:
    """The calls of `path` read as `format` (a key of `FORMATS`)."""
    return FORMATS[format][1](path)
