"""What every typed result shares: JSON records declared as dataclasses (`Record`, `json_field`) and the result
file's envelope (`ResultFile`).

- `from_json` checks every declared field and refuses, in one sentence naming where, a record kvprof did not write;
  `to_json` writes fields in declared order (the commands' order).
- `ResultFile.read` refuses another kind, a newer format, a file without a format version, and NaN or Infinity
  (`kvprof.fileio.read_result`); an in-memory result has `envelope` None.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from kvprof.fileio import NUMBER, RESULT_SCHEMA, JsonType, check_fields, read_result

R = TypeVar("R", bound="Record")
F = TypeVar("F", bound="ResultFile")
Reader = Callable[[Any, str, str], Any]
OPTIONAL = type(None)


def json_field(kind: JsonType, *, read: Reader | None = None, absent: bool = False) -> Any:
    """A `Record` field: `kind`, the JSON type (a tuple with None: nullable or missing → None); `read`, JSON → typed
    (value, where, fix); `absent`: older files may lack it (None, left out by `to_json` while None)."""
    metadata = {"kind": kind, "read": read, "absent": absent}
    if absent or (isinstance(kind, tuple) and OPTIONAL in kind):
        return dataclasses.field(default=None, metadata=metadata)
    return dataclasses.field(metadata=metadata)


def _json_fields(record: Record | type[Record]) -> list[dataclasses.Field]:
    """The fields of a record declared with `json_field` (a result's `envelope` is not one)."""
    return [f for f in dataclasses.fields(record) if "kind" in f.metadata]


def _optional(kind: JsonType) -> JsonType:
    """`kind` or null, as one flat tuple (a refusal names each type)."""
    return (*kind, OPTIONAL) if isinstance(kind, tuple) else (kind, OPTIONAL)


def _dump(value: Any) -> Any:
    """A field's JSON value: records written with `to_json`, inside lists and objects too."""
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, dict):
        return {key: _dump(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_dump(item) for item in value]
    return value


@dataclasses.dataclass(kw_only=True)
class Record:
    """A JSON object with declared fields (see the module docstring)."""

    @classmethod
    def from_json(cls: type[R], record: object, where: str, fix: str) -> R:
        """`record` (read at `where`), refused with `fix` when a declared field is missing or mistyped."""
        fields = _json_fields(cls)
        kinds = {f.name: _optional(f.metadata["kind"]) if f.metadata["absent"] else f.metadata["kind"] for f in fields}
        checked = check_fields(record, kinds, where, fix)
        values = {}
        for f in fields:
            if f.name not in checked:
                continue
            read = f.metadata["read"]
            value = checked[f.name]
            values[f.name] = read(value, f"{where}, {f.name}", fix) if read and value is not None else value
        return cls(**values)

    def to_json(self) -> dict:
        """The record as kvprof writes it."""
        return {
            f.name: _dump(getattr(self, f.name))
            for f in _json_fields(self)
            if not (f.metadata["absent"] and getattr(self, f.name) is None)
        }


def record_reader(cls: type[Record]) -> Reader:
    """A `json_field` reader of one nested `cls` record."""
    return lambda value, where, fix: cls.from_json(value, where, fix)


def records_by_label(cls: type[Record]) -> Reader:
    """A `json_field` reader of an object of `cls` records by label (a policy's, a run's)."""
    return lambda value, where, fix: {
        label: cls.from_json(item, f"{where} {label!r}", fix) for label, item in value.items()
    }


def records_in_list(cls: type[Record]) -> Reader:
    """A `json_field` reader of a list of `cls` records."""
    return lambda value, where, fix: [cls.from_json(item, f"{where} {index}", fix) for index, item in enumerate(value)]


@dataclasses.dataclass(kw_only=True)
class Environment(Record):
    """What a result was measured on: python, torch, CUDA device, CPU, torch threads (`threads_chosen`: how, for a
    command that runs models), the machine's `load` while the command ran (`kvprof.threads.MachineLoad`: other
    processes' cores); `workers`: a distributed run's Ray workers; `peak_host_bytes`: the command's process at its
    peak resident memory so far (VmHWM; what a `--plan` predicts), absent in files written before it."""

    python: str = json_field(str)
    torch: str = json_field(str)
    cuda: str | None = json_field((str, OPTIONAL))
    cpu: dict | None = json_field((dict, OPTIONAL))
    cpu_threads: int = json_field(int)
    threads_chosen: str | None = json_field(str, absent=True)
    load: dict | None = json_field(dict, absent=True)
    workers: list[dict] | None = json_field(list, absent=True)
    peak_host_bytes: int | None = json_field(int, absent=True)


@dataclasses.dataclass(kw_only=True)
class Envelope(Record):
    """A result file's wrapper: `schema` `kvprof.result.<kind>`, format `version`, writing `kvprof` version, ISO
    `created`, `args` (paths as text); all but schema and version may be missing in hand-trimmed files
    (tests/data/simulate)."""

    schema: str = json_field(str)
    version: int = json_field(int)
    kvprof: str | None = json_field(str, absent=True)
    created: str | None = json_field(str, absent=True)
    environment: Environment | None = json_field(dict, read=record_reader(Environment), absent=True)
    args: dict | None = json_field(dict, absent=True)

    @property
    def kind(self) -> str:
        """The result's kind: `replay`, `tune_tau`, ..."""
        return self.schema.removeprefix(RESULT_SCHEMA)


ENVELOPE_FIELDS = tuple(f.name for f in dataclasses.fields(Envelope))


@dataclasses.dataclass(kw_only=True)
class ResultFile(Record):
    """A command's result: the payload's declared fields and the file's `envelope` (None in memory). Subclasses set
    `KIND` (schema suffix) and `FIX` (what a refusal tells the user)."""

    KIND: ClassVar[str]
    FIX: ClassVar[str]
    envelope: Envelope | None = None

    @classmethod
    def of(cls: type[F], result: F | dict) -> F:
        """`result` itself, or read from its JSON (the library's replays return JSON)."""
        return result if isinstance(result, cls) else cls.from_json(result, f"the {cls.KIND} result")

    @classmethod
    def read(cls: type[F], path: str | os.PathLike) -> F:
        """The result at `path`, refused naming it if not this kind, newer, or lacking a field kvprof reads."""
        _, payload = read_result(path, cls.FIX, cls.KIND)
        return cls.from_json(payload, str(path), cls.FIX)

    @classmethod
    def from_json(cls: type[F], record: object, where: str, fix: str | None = None) -> F:
        """The result in `record`: a result file's JSON (with its envelope) or a command's payload (without)."""
        fix = fix or cls.FIX
        checked = check_fields(record, {}, where, fix)
        payload = {key: value for key, value in checked.items() if key not in ENVELOPE_FIELDS}
        result = super().from_json(payload, where, fix)
        if "schema" in checked:
            envelope = {key: checked[key] for key in ENVELOPE_FIELDS if key in checked}
            result.envelope = Envelope.from_json(envelope, where, fix)
        return result

    def to_json(self) -> dict:
        """The result file's JSON: the envelope's fields, then the payload's (the payload alone without one)."""
        return (self.envelope.to_json() if self.envelope else {}) | super().to_json()


__all__ = [
    "NUMBER",
    "OPTIONAL",
    "Envelope",
    "Environment",
    "Record",
    "ResultFile",
    "json_field",
    "record_reader",
    "records_by_label",
    "records_in_list",
]
