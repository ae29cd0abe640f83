"""The trace format: trajectories of multi-agent turns, stored as JSONL with exact token ids.

A trace file is JSON Lines. Line 1 is the header (schema version, model and tokenizer identity, the workflow it was
captured with); every following line is one trajectory::

    {"record": "header", "schema": "kvprof.trace", "version": 1, "model": {...}, "tokenizer": {...},
     "workflow": {...}, "source": "capture"}
    {"record": "trajectory", "id": "t0", "question": "...", "answer": "...", "prediction": "...",
     "segments": {"question": {"kind": "question", "scope": "shared", "tokens": [...], "text": "..."}, ...},
     "turns": [{"agent": "plan", "input": ["system", "question", "cue:plan:0"], "output": "out:plan:0"}, ...]}

Each segment is stored once; a turn lists its input segment ids and its output's. `scope`: `shared` (several
agents may read it) or `private` (one agent's role prompt). Inputs: `tokens == tokenizer.encode(text)`; outputs keep
the generated ids, `decode(tokens) == text`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.fileio import atomic_open, jsonl_lines
from kvprof.traces.spec import AGENT_TYPES, agent_problem, setting_problem

SCHEMA = "kvprof.trace"
VERSION = 1
SEGMENT_KINDS = ("system", "prompt", "question", "cue", "output", "observation", "message", "synthetic")
SCOPES = ("shared", "private")
TRACE_FIX = "pass a trace written by `kvprof capture`"


@dataclass
class Segment:
    """A span of tokens with one id inside a trajectory."""

    kind: str
    scope: str
    tokens: list[int]
    text: str
    producer: str | None = None  # the agent that generated an output segment

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class Turn:
    """One agent call: the ids of the segments it reads, in order, and the id of the segment it writes."""

    agent: str
    input: list[str]
    output: str


@dataclass
class Trajectory:
    """One task run by the agents: its segments (by id) and its turns, in order."""

    id: str
    segments: dict[str, Segment]
    turns: list[Turn]
    question: str = ""
    answer: str | None = None
    prediction: str | None = None
    documents: dict[str, str] = field(default_factory=dict)  # the task's tool documents (for online replay)
    private: dict[str, str] = field(default_factory=dict)  # agent → the task's private text after its role prompt

    def input_tokens(self, turn: Turn) -> list[int]:
        """The token ids the acting agent prefills for `turn`: its input segments concatenated."""
        return [tok for seg_id in turn.input for tok in self.segments[seg_id].tokens]

    def output_tokens(self, turn: Turn) -> list[int]:
        return list(self.segments[turn.output].tokens)

    def private_prefixes(self) -> dict[str, list[int]]:
        """Each agent's private prefix: the private segments its first input starts with (absent in lora mode)."""
        prefixes: dict[str, list[int]] = {}
        for turn in self.turns:
            if turn.agent in prefixes:
                continue
            tokens: list[int] = []
            for seg_id in turn.input:
                if self.segments[seg_id].scope != "private":
                    break
                tokens += self.segments[seg_id].tokens
            if tokens:
                prefixes[turn.agent] = tokens
        return prefixes

    def served_prefixes(self, defaults: dict[str, list[int]]) -> dict[str, list[int]]:
        """Private prefixes as replay serves them: `private_prefixes`, else `defaults`; none for an agent whose calls
        do not all start with it (e.g. Mistral's template moves the system prompt): then it is part of its input."""
        prefixes = {**defaults, **self.private_prefixes()}
        for turn in self.turns:
            ids = prefixes.get(turn.agent)
            if ids and self.input_tokens(turn)[: len(ids)] != ids:
                prefixes[turn.agent] = []
        return prefixes

    def segment_spans(self, turn: Turn) -> list[tuple[str, int, int]]:
        """`(segment_id, start, end)` token offsets of each input segment inside the turn's input."""
        spans, start = [], 0
        for seg_id in turn.input:
            end = start + len(self.segments[seg_id])
            spans.append((seg_id, start, end))
            start = end
        return spans

    @property
    def num_tokens(self) -> int:
        """Distinct tokens in the trajectory (each segment counted once)."""
        return sum(len(seg) for seg in self.segments.values())


@dataclass
class TraceHeader:
    """Who produced a trace: model, tokenizer identity, and the workflow (mode, agents, templates)."""

    model: dict
    tokenizer: dict
    workflow: dict
    source: str = "capture"
    schema: str = SCHEMA
    version: int = VERSION
    extra: dict = field(default_factory=dict)

    @property
    def agent_names(self) -> list[str]:
        return [agent["name"] for agent in self.workflow.get("agents", [])]

    @property
    def mode(self) -> str:
        return self.workflow.get("mode", "lora")


@dataclass
class Trace:
    header: TraceHeader
    trajectories: list[Trajectory]


# ----------------------------------------------------------------------------------------------------- writing


def record_line(record: dict) -> str:
    """One JSONL line of a trace file (compact, UTF-8 kept), with its newline."""
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"


def header_record(header: TraceHeader) -> dict:
    record = {
        "record": "header",
        "schema": header.schema,
        "version": header.version,
        "model": header.model,
        "tokenizer": header.tokenizer,
        "workflow": header.workflow,
        "source": header.source,
    }
    if header.extra:
        record["extra"] = header.extra
    return record


def trajectory_record(traj: Trajectory) -> dict:
    return (
        {
            "record": "trajectory",
            "id": traj.id,
            "question": traj.question,
            "answer": traj.answer,
            "prediction": traj.prediction,
            "segments": {
                seg_id: {k: v for k, v in asdict(seg).items() if v is not None} for seg_id, seg in traj.segments.items()
            },
            "turns": [asdict(turn) for turn in traj.turns],
        }
        | ({"documents": traj.documents} if traj.documents else {})
        | ({"private": traj.private} if traj.private else {})
    )


class TraceWriter:
    """Streams trajectories to a trace file atomically (complete on `close()`; nothing if the block raises)."""

    def __init__(self, path: str | os.PathLike, header: TraceHeader):
        self.path = Path(path)
        self._ctx = atomic_open(self.path)
        self._handle = self._ctx.__enter__()
        self._write(header_record(header))

    def _write(self, record: dict) -> None:
        self._handle.write(record_line(record))

    def write(self, traj: Trajectory) -> None:
        self._write(trajectory_record(traj))

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._ctx.__exit__(exc_type, exc, tb)


class PartialTrace:
    """A capture's checkpoint: a trace file growing one flushed trajectory at a time, for resuming
    (`read_partial_trace`); never the result. `append=True` continues one."""

    def __init__(self, path: str | os.PathLike, header: TraceHeader, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.path, "a" if append else "w", encoding="utf-8")
        if not append:
            self._append(header_record(header))

    def _append(self, record: dict) -> None:
        self._handle.write(record_line(record))
        self._handle.flush()
        os.fsync(self._handle.fileno())

    def write(self, traj: Trajectory) -> None:
        self._append(trajectory_record(traj))

    def __enter__(self) -> PartialTrace:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._handle.close()


def read_partial_trace(path: str | os.PathLike) -> Trace:
    """Read a `PartialTrace` checkpoint, first cutting from the file a last line that the interruption tore."""
    path = Path(path)
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) < len(data):
        path.write_bytes(complete)
    trajectories = list(_trajectories(path, required=False))
    return Trace(header=read_header(path), trajectories=trajectories)


def write_trace(path: str | os.PathLike, trace: Trace) -> Path:
    with TraceWriter(path, trace.header) as writer:
        for traj in trace.trajectories:
            writer.write(traj)
    return Path(path)


# ----------------------------------------------------------------------------------------------------- reading


class _Where:
    """Formats 'FILE line N, field F' for validation messages."""

    def __init__(self, path: Path, line: int):
        self.path, self.line = path, line

    def fail(self, field_name: str, problem: str, fix: str = "re-capture the trace or fix that line") -> KvprofError:
        return KvprofError(f"{self.path} line {self.line}, field '{field_name}': {problem}; {fix}.")


def _require(where: _Where, record: dict, name: str, kind: type | tuple[type, ...]):
    if name not in record:
        raise where.fail(name, "is missing")
    value = record[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise where.fail(name, f"should be {expected}, got {type(value).__name__}")
    return value


def _parse_tokenizer(where: _Where, record: dict) -> dict:
    tokenizer = _require(where, record, "tokenizer", dict)
    for key in ("name", "vocab_size", "fingerprint"):
        if key not in tokenizer:
            raise where.fail(f"tokenizer.{key}", "is missing")
    vocab = tokenizer["vocab_size"]
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise where.fail("tokenizer.vocab_size", f"is {vocab!r}, not a positive integer")
    return tokenizer


def _parse_workflow(where: _Where, record: dict) -> dict:
    workflow = _require(where, record, "workflow", dict)
    agents = workflow.get("agents")
    if not isinstance(agents, list) or not agents or not all(isinstance(a, dict) and "name" in a for a in agents):
        raise where.fail("workflow.agents", "must be a non-empty list of {name, ...} objects")
    for index, agent in enumerate(agents):
        problem = agent_problem(agent, {"name": str, **AGENT_TYPES})
        if problem:
            raise where.fail(f"workflow.agents[{index}]", problem)
    names = [agent["name"] for agent in agents]
    if len(set(names)) < len(names):
        raise where.fail("workflow.agents", f"declares an agent twice ({', '.join(names)})")
    if workflow.get("mode") not in ("lora", "prompt"):
        raise where.fail("workflow.mode", f"is {workflow.get('mode')!r}, not 'lora' or 'prompt'")
    for key, value in workflow.items():
        problem = None if key == "agents" else setting_problem(key, value)
        if problem:
            raise where.fail(f"workflow.{key}", problem)
    return workflow


def _parse_segment(where: _Where, name: str, raw: object, vocab: int) -> Segment:
    if not isinstance(raw, dict):
        raise where.fail(name, "should be an object")
    kind, scope = raw.get("kind"), raw.get("scope")
    if kind not in SEGMENT_KINDS:
        raise where.fail(f"{name}.kind", f"is {kind!r}, not one of {', '.join(SEGMENT_KINDS)}")
    if scope not in SCOPES:
        raise where.fail(f"{name}.scope", f"is {scope!r}, not 'shared' or 'private'")
    tokens = raw.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise where.fail(f"{name}.tokens", "should be a list of integer token ids")
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise where.fail(f"{name}.tokens", f"holds id {bad}, outside the tokenizer's vocabulary of {vocab}")
    text, producer = raw.get("text", ""), raw.get("producer")
    if not isinstance(text, str):
        raise where.fail(f"{name}.text", "should be a string")
    if producer is not None and not isinstance(producer, str):
        raise where.fail(f"{name}.producer", "should be an agent's name")
    return Segment(kind=kind, scope=scope, tokens=tokens, text=text, producer=producer)


def _parse_turn(
    where: _Where, name: str, raw: object, segments: dict[str, Segment], agents: set[str], produced: set[str]
) -> Turn:
    """One turn of a trajectory; `produced`: the outputs earlier turns produced (this turn's added)."""
    if not isinstance(raw, dict):
        raise where.fail(name, "should be an object")
    agent = raw.get("agent")
    if not isinstance(agent, str) or agent not in agents:
        raise where.fail(
            f"{name}.agent",
            f"names agent {agent!r}, which the header does not declare (declared: {', '.join(sorted(agents))})",
        )
    inputs = raw.get("input")
    if not isinstance(inputs, list) or not inputs or not all(isinstance(seg_id, str) for seg_id in inputs):
        raise where.fail(f"{name}.input", "should be a non-empty list of segment ids")
    for seg_id in inputs:
        if seg_id not in segments:
            raise where.fail(f"{name}.input", f"refers to segment {seg_id!r}, which the trajectory does not define")
        if segments[seg_id].kind == "output" and seg_id not in produced:
            raise where.fail(f"{name}.input", f"reads output {seg_id!r} before any turn produced it")
    output = raw.get("output")
    if not isinstance(output, str) or output not in segments or segments[output].kind != "output":
        raise where.fail(f"{name}.output", f"{output!r} is not an output segment of this trajectory")
    produced.add(output)
    return Turn(agent=agent, input=list(inputs), output=output)


def _parse_texts(where: _Where, record: dict) -> tuple[dict, dict, str]:
    """A trajectory's documents, private texts and question."""
    documents = record.get("documents", {})
    if not isinstance(documents, dict) or not all(isinstance(v, str) for v in documents.values()):
        raise where.fail("documents", "should map names to texts")
    private = record.get("private", {})
    if not isinstance(private, dict) or not all(isinstance(v, str) for v in private.values()):
        raise where.fail("private", "should map agent names to texts")
    question = record.get("question", "")
    if not isinstance(question, str):
        raise where.fail("question", "should be a string")
    for key in ("answer", "prediction"):
        if record.get(key) is not None and not isinstance(record[key], str):
            raise where.fail(key, "should be a string or null")
    return documents, private, question


def _parse_header(where: _Where, record: dict) -> TraceHeader:
    if record.get("record") != "header":
        raise where.fail(
            "record",
            "the first line must be the trace header",
            "pass a file written by `kvprof capture` (or its CSV import)",
        )
    if record.get("schema") != SCHEMA:
        raise where.fail("schema", f"is {record.get('schema')!r}, not {SCHEMA!r}", "pass a kvprof trace file")
    version = _require(where, record, "version", int)
    if version > VERSION:
        raise where.fail("version", f"is {version}, newer than this kvprof reads ({VERSION})", "upgrade kvprof")
    model = _require(where, record, "model", dict)
    if not isinstance(model.get("path", ""), str):
        raise where.fail("model.path", "should be the model's path (text)")
    tokenizer = _parse_tokenizer(where, record)
    workflow = _parse_workflow(where, record)
    source = record.get("source", "capture")
    if not isinstance(source, str):
        raise where.fail("source", "should be text")
    extra = record.get("extra", {})
    if not isinstance(extra, dict):
        raise where.fail("extra", "should be an object")
    return TraceHeader(
        model=model,
        tokenizer=tokenizer,
        workflow=workflow,
        source=source,
        version=version,
        extra=extra,
    )


def _parse_trajectory(where: _Where, record: dict, header: TraceHeader) -> Trajectory:
    if record.get("record") != "trajectory":
        raise where.fail("record", f"is {record.get('record')!r}, expected 'trajectory'")
    traj_id = str(_require(where, record, "id", (str, int)))
    vocab = header.tokenizer["vocab_size"]
    segments = {
        seg_id: _parse_segment(where, f"segments.{seg_id}", raw, vocab)
        for seg_id, raw in _require(where, record, "segments", dict).items()
    }
    agents = set(header.agent_names)
    produced: set[str] = set()
    raw_turns = _require(where, record, "turns", list)
    if not raw_turns:
        raise where.fail("turns", f"trajectory {traj_id!r} has no turns", "drop that line or re-capture the trace")
    turns = [_parse_turn(where, f"turns[{i}]", raw, segments, agents, produced) for i, raw in enumerate(raw_turns)]
    documents, private, question = _parse_texts(where, record)
    return Trajectory(
        id=traj_id,
        segments=segments,
        turns=turns,
        question=question,
        answer=record.get("answer"),
        prediction=record.get("prediction"),
        documents=documents,
        private=private,
    )


def _records(path: Path) -> Iterator[tuple[_Where, dict]]:
    if path.is_dir():
        raise KvprofError(f"{path} is a directory; pass the trace file inside it (e.g. {path / 'trace.jsonl'}).")
    for number, record in jsonl_lines(path, "trace file", TRACE_FIX):
        where = _Where(path, number)
        if not isinstance(record, dict):
            raise where.fail("-", "is not a JSON object")
        yield where, record


def read_header(path: str | os.PathLike) -> TraceHeader:
    for where, record in _records(Path(path)):
        return _parse_header(where, record)
    raise KvprofError(f"trace file {path} is empty; {TRACE_FIX}.")


def _trajectories(path: Path, required: bool) -> Iterator[Trajectory]:
    """The trajectories of a trace, validated line by line; a trace without any is refused when `required`."""
    header = None
    seen: set[str] = set()
    for where, record in _records(path):
        if header is None:
            header = _parse_header(where, record)
            continue
        traj = _parse_trajectory(where, record, header)
        if traj.id in seen:
            raise where.fail("id", f"repeats trajectory id {traj.id!r}")
        seen.add(traj.id)
        yield traj
    if header is None:
        raise KvprofError(f"trace file {path} is empty; {TRACE_FIX}.")
    if required and not seen:
        raise KvprofError(
            f"trace file {path} has no trajectories, only its header; {TRACE_FIX} that holds at least one."
        )


def iter_trajectories(path: str | os.PathLike) -> Iterator[Trajectory]:
    """Stream the trajectories of a trace, validating each line as it is read; a trace without any is refused."""
    return _trajectories(Path(path), required=True)


def read_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a whole trace; raises `KvprofError` naming file, line and field on the first problem."""
    trajectories = list(iter_trajectories(path))
    return Trace(header=read_header(path), trajectories=trajectories)


def _beside(folder: Path, path: str) -> str:
    """`path` resolved against `folder` if it is relative and exists there, else unchanged."""
    candidate = folder / path
    return str(candidate.resolve()) if not Path(path).is_absolute() and candidate.exists() else path


def trace_header(trace_path) -> TraceHeader:
    """The trace's header, relative model and adapter paths resolved against its folder where they exist there."""
    header = read_header(trace_path)
    folder = Path(trace_path).parent
    if header.model.get("path"):
        header.model["path"] = _beside(folder, header.model["path"])
    for agent_fields in header.workflow.get("agents", []):
        if agent_fields.get("adapter"):
            agent_fields["adapter"] = _beside(folder, agent_fields["adapter"])
    return header


def check_tokenizer(header: TraceHeader, identity: dict, trace_path: str | os.PathLike, model_name: str) -> None:
    """Refuse a tokenizer other than the trace's, or whose vocabulary differs from the header's."""
    if header.tokenizer.get("fingerprint") != identity["fingerprint"]:
        raise KvprofError(
            f"trace {trace_path} was captured with tokenizer {header.tokenizer.get('name')!r} "
            f"(vocabulary {header.tokenizer.get('vocab_size')}), but model {model_name!r} uses a different tokenizer "
            f"(vocabulary {identity['vocab_size']}); pass --model with the model the trace was captured with "
            f"({header.model.get('path')!r})."
        )
    if header.tokenizer["vocab_size"] != identity["vocab_size"]:
        raise KvprofError(
            f"trace {trace_path} says its tokenizer has {header.tokenizer['vocab_size']} ids, but that tokenizer "
            f"(model {model_name!r}) has {identity['vocab_size']}; re-capture the trace or restore its header's "
            "tokenizer.vocab_size."
        )


def shared_segment_ids(traj: Trajectory) -> set[str]:
    """Ids of segments that appear in the inputs of more than one agent."""
    readers: dict[str, set[str]] = {}
    for turn in traj.turns:
        for seg_id in turn.input:
            readers.setdefault(seg_id, set()).add(turn.agent)
    return {seg_id for seg_id, agents in readers.items() if len(agents) > 1}
