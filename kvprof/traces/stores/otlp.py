"""The OTLP JSON container (OpenTelemetry protocol, JSON encoding) both OTLP readers share.

A file is one `ExportTraceServiceRequest` object, or one such object per line as the Collector's file exporter
writes them: `resourceSpans[].scopeSpans[].spans[]`, each span with `traceId`, `spanId`, `parentSpanId` (empty for a
root), `name`, `startTimeUnixNano`, `attributes` (`[{"key", "value": AnyValue}]`) and `events` (`name`,
`timeUnixNano`, `attributes`). Objects with `resourceLogs[].scopeLogs[].logRecords[]` may sit beside them: log-based
events (`eventName` or the `event.name` attribute, `body`, and the `spanId` of their span). AnyValue is one of
`stringValue`, `boolValue`, `intValue` (decimal text), `doubleValue`, `arrayValue.values`, `kvlistValue.values`,
`bytesValue`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.traces.stores.common import fail, json_documents
from kvprof.traces.stores.tree import Node, ordered

FIX = "pass an OTLP JSON export (resourceSpans), one request per line or one in the file"


@dataclass
class Event:
    """A span event, or a log record of the span (its body's fields merged into `attributes`)."""

    name: str
    time: int
    attributes: dict


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start: int
    attributes: dict
    events: list[Event] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"span {self.span_id}"


def any_value(value: object) -> object:
    """The Python value of an OTLP AnyValue."""
    if not isinstance(value, dict) or not value:
        return None
    kind, inner = next(iter(value.items()))
    if kind == "intValue":
        return int(inner)
    if kind == "arrayValue":
        return [any_value(item) for item in (inner or {}).get("values", [])]
    if kind == "kvlistValue":
        return attributes((inner or {}).get("values", []))
    return inner


def attributes(entries: object) -> dict:
    """OTLP `[{"key", "value"}]` as a dict."""
    if not isinstance(entries, list):
        return {}
    return {entry["key"]: any_value(entry.get("value")) for entry in entries if isinstance(entry, dict)}


def requests(path: Path) -> list:
    """The export's request objects (the whole file, or one per line; each checked by its reader)."""
    documents = json_documents(path, "OTLP export", FIX)
    return documents[0] if len(documents) == 1 and isinstance(documents[0], list) else documents


def read_spans(path: Path) -> list[Span]:
    """The export's spans, depth first by start time within each trace (`kvprof.traces.stores.tree`), with the log
    events of each span appended to its events."""
    spans: list[Span] = []
    logs: dict[str, list[Event]] = {}
    for number, request in enumerate(requests(path), start=1):
        if not isinstance(request, dict) or not ({"resourceSpans", "resourceLogs"} & set(request)):
            raise fail(path, f"request {number}", "is not an OTLP object with resourceSpans", FIX)
        for resource in request.get("resourceSpans") or []:
            for scope in resource.get("scopeSpans") or []:
                spans += [_span(path, raw) for raw in scope.get("spans") or []]
        for resource in request.get("resourceLogs") or []:
            for scope in resource.get("scopeLogs") or []:
                for record in scope.get("logRecords") or []:
                    _add_log(record, logs)
    if not spans:
        raise KvprofError(f"OTLP export {path} holds no spans; export the traces of the agents' runs.")
    for span in spans:
        span.events += sorted(logs.get(span.span_id, []), key=lambda event: event.time)
    nodes = [
        Node(f"{s.trace_id}/{s.span_id}", s.parent_id and f"{s.trace_id}/{s.parent_id}", s.start, s.where, s)
        for s in spans
    ]
    return [node.record for node in ordered(path, nodes, "span")]


def _span(path: Path, raw: object) -> Span:
    if not isinstance(raw, dict) or not raw.get("spanId") or not raw.get("traceId"):
        raise fail(path, f"span {raw.get('name') if isinstance(raw, dict) else raw!r}", "has no traceId/spanId", FIX)
    events = [
        Event(str(e.get("name", "")), int(e.get("timeUnixNano") or 0), attributes(e.get("attributes")))
        for e in raw.get("events") or []
        if isinstance(e, dict)
    ]
    return Span(
        str(raw["traceId"]),
        str(raw["spanId"]),
        raw.get("parentSpanId") or None,
        str(raw.get("name", "")),
        int(raw.get("startTimeUnixNano") or 0),
        attributes(raw.get("attributes")),
        events,
    )


def _add_log(record: object, logs: dict[str, list[Event]]) -> None:
    if not isinstance(record, dict) or not record.get("spanId"):
        return
    fields = attributes(record.get("attributes"))
    name = record.get("eventName") or fields.get("event.name") or ""
    body = any_value(record.get("body"))
    if isinstance(body, dict):
        fields |= body
    time = int(record.get("timeUnixNano") or record.get("observedTimeUnixNano") or 0)
    logs.setdefault(str(record["spanId"]), []).append(Event(str(name), time, fields))


def ancestors(span: Span, by_id: dict[str, Span]) -> list[Span]:
    """The span and its ancestors up to the root (the tree was checked by `read_spans`)."""
    chain = [span]
    while chain[-1].parent_id is not None:
        chain.append(by_id[f"{span.trace_id}/{chain[-1].parent_id}"])
    return chain


def json_value(path: Path, span: Span, name: str, value: object) -> object:
    """An attribute that holds JSON, as the GenAI and OpenInference conventions allow: JSON text or structured."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise fail(
            path, span.where, f"has {name} that is not JSON ({err.msg} at column {err.colno})", "export it as JSON"
        ) from None
