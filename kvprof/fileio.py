"""Atomic file writes (a temporary file beside the target, renamed over it: readers never see a half-written file,
an interrupted command leaves the old one), and readers that refuse a missing, directory, empty, non-UTF-8 or
non-JSON file in one sentence naming it and the fix; `read_result` and `check_fields` also check results' shapes.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from kvprof.errors import KvprofError

RESULT_SCHEMA = "kvprof.result."
RESULT_VERSION = 1

JsonType = type | tuple[type, ...]
NUMBER = (int, float)
TYPE_NAMES = {
    dict: "an object",
    list: "a list",
    str: "text",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    type(None): "null",
}


def require_file(path: Path, kind: str, fix: str) -> None:
    """Refuse a missing or directory `path`; `kind` names the file ("trace file"), `fix` what to pass instead."""
    if path.is_dir():
        raise KvprofError(f"{kind} {path} is a directory, not a file; {fix}.")
    if not path.exists():
        raise KvprofError(f"{kind} {path} does not exist; {fix}.")


def _read_bytes(path: str | os.PathLike, kind: str, fix: str) -> bytes:
    """The bytes of the file at `path`, refused (`require_file`) when missing, a directory, unreadable or empty."""
    path = Path(path)
    require_file(path, kind, fix)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise KvprofError(f"{kind} {path} cannot be read ({err.strerror}); {fix}.") from None
    if not data.strip():
        raise KvprofError(f"{kind} {path} is empty; {fix}.")
    return data


def read_text_file(path: str | os.PathLike, kind: str, fix: str) -> str:
    """The text of the UTF-8 file at `path`, refused if missing, a directory, unreadable, empty or not UTF-8."""
    data = _read_bytes(path, kind, fix)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise KvprofError(f"{kind} {path} is not UTF-8 text (line {line} holds other bytes); {fix}.") from None


class _NonFinite(ValueError):
    """A NaN or Infinity met while parsing a file that must hold finite numbers (its text: `args[0]`)."""


def _refuse_constant(name: str) -> float:
    """`json.loads`' `parse_constant` where NaN and ±Infinity (Python's extension of JSON) are not numbers."""
    raise _NonFinite(name)


def read_json_file(path: str | os.PathLike, kind: str, fix: str, finite: bool = False) -> object:
    """The JSON value in the file at `path`; refused as `read_text_file`, and when it is not JSON (`finite`: nor
    when it holds NaN or Infinity, which JSON does not have and Python's parser accepts)."""
    text = read_text_file(path, kind, fix)
    try:
        return json.loads(text, parse_constant=_refuse_constant) if finite else json.loads(text)
    except json.JSONDecodeError as err:
        raise KvprofError(
            f"{kind} {path} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); {fix}."
        ) from None
    except _NonFinite as err:
        raise KvprofError(f"{kind} {path} holds {err.args[0]} where a number is required; {fix}.") from None


def read_result(path: str | os.PathLike, fix: str, kind: str | None = None) -> tuple[str, dict]:
    """(kind, payload) of a kvprof result file: a JSON object of finite numbers whose schema is
    `kvprof.result.<kind>` (`kind` if given) of a format version this kvprof reads (a file without one is refused:
    which format it holds cannot be told)."""
    what = "result" if kind is None else f"{kind.replace('_', '-')} result"
    payload = read_json_file(path, f"{what} file", fix, finite=True)
    schema = payload.get("schema") if isinstance(payload, dict) else None
    if not isinstance(payload, dict) or not isinstance(schema, str) or not schema.startswith(RESULT_SCHEMA):
        raise KvprofError(f"{path} is not a kvprof {what} (no '{RESULT_SCHEMA}{kind or '*'}' schema); {fix}.")
    found = schema.removeprefix(RESULT_SCHEMA)
    if kind is not None and found != kind:
        raise KvprofError(f"{path} is not a kvprof {what} but a {found.replace('_', '-')} result; {fix}.")
    if "version" not in payload:
        raise KvprofError(
            f"{path} is a kvprof {what} without a format 'version', so which format it holds cannot be told; {fix}."
        )
    version = payload["version"]
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= RESULT_VERSION:
        raise KvprofError(
            f"{path} is a result of format version {version!r}, which this kvprof does not read "
            f"(it reads {RESULT_VERSION}); {fix}."
        )
    return found, payload


def is_json(value: object, kind: JsonType) -> bool:
    """Whether a JSON value has type `kind` (a bool is not a number)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        return False
    return isinstance(value, kinds)


def type_name(kind: JsonType) -> str:
    """How a refusal names a JSON type ("a number", "text or null")."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds:
        kinds = tuple(k for k in kinds if k is not int)
    return " or ".join(TYPE_NAMES.get(k, k.__name__) for k in kinds)


def check_fields(record: object, fields: dict[str, JsonType], where: str, fix: str) -> dict:
    """Check `record` is a JSON object with each of `fields` of its type (a tuple with None: optional); else a
    `KvprofError` '{where}: ...; {fix}.'."""
    if not isinstance(record, dict):
        raise KvprofError(f"{where} is not a JSON object; {fix}.")
    for name, kind in fields.items():
        optional = isinstance(kind, tuple) and type(None) in kind
        if name not in record:
            if optional:
                continue
            raise KvprofError(f"{where} has no field '{name}'; {fix}.")
        if not is_json(record[name], kind):
            raise KvprofError(
                f"{where}, field '{name}' should be {type_name(kind)}, not {type(record[name]).__name__}; {fix}."
            )
    return record


def jsonl_lines(path: str | os.PathLike, kind: str, fix: str) -> Iterator[tuple[int, object]]:
    """(line number, value) per non-blank JSONL line, refused as `require_file`; a non-UTF-8 or non-JSON line is
    refused naming file, line and the parser's complaint."""
    path = Path(path)
    require_file(path, kind, fix)
    try:
        handle = open(path, "rb")
    except OSError as err:
        raise KvprofError(f"{kind} {path} cannot be read ({err.strerror}); {fix}.") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise KvprofError(
                    f"{kind} {path} line {number} is not UTF-8 text (byte {err.start + 1}); {fix}."
                ) from None
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                raise KvprofError(
                    f"{path} line {number} is not valid JSON ({err.msg} at column {err.colno}); fix that line."
                ) from None


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Open a temporary file next to `path`; on a clean exit it replaces `path`, on an exception it is removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, 0o666 & ~_umask())
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


def write_json(path: str | os.PathLike, payload: dict) -> Path:
    """Write `payload` as indented JSON, atomically."""
    with atomic_open(path) as handle:
        json.dump(payload, handle, indent=2, sort_keys=False)
        handle.write("\n")
    return Path(path)


def _umask() -> int:
    """The process umask (reading it means setting it; it is set straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
