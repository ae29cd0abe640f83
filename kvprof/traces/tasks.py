"""Tasks: the questions a workflow runs (with their tool documents and each agent's private text), read from and
written to tasks files, and each agent's private prefix for one."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.fileio import jsonl_lines
from kvprof.traces.spec import WorkflowSpec
from kvprof.traces.trace import Trajectory


@dataclass
class Task:
    """One question; `documents` (entity → text) feed the default search tool; `private` (agent → text) is what
    each agent alone reads for this task after its role prompt (prompt mode: its own notes, retrieved memory or
    profile), so its private prefix differs from task to task."""

    id: str
    question: str
    answer: str | None = None
    documents: dict[str, str] = field(default_factory=dict)
    private: dict[str, str] = field(default_factory=dict)


def task_of(traj: Trajectory) -> Task:
    """The task a captured trajectory ran (question, answer, tool documents, private texts), for online replay."""
    return Task(
        id=traj.id,
        question=traj.question,
        answer=traj.answer,
        documents=dict(traj.documents),
        private=dict(traj.private),
    )


def private_prompt(spec: WorkflowSpec, task: Task, agent: str) -> str:
    """The text of `agent`'s private prefix for `task` (prompt mode): its role prompt, then the task's private text
    for it."""
    return (spec.agent(agent).prompt or "") + task.private.get(agent, "")


def load_tasks(path: str | Path, limit: int | None = None) -> list[Task]:
    """Read `{"id", "question", "answer"?, "documents"?}` per line; refuse malformed lines with their number."""
    path = Path(path)
    fix = 'pass a JSONL file with one {"id", "question", "answer"} object per line'
    tasks: list[Task] = []
    lines: dict[str, int] = {}
    for number, record in jsonl_lines(path, "tasks file", fix):
        task = task_from_record(record, f"{path} line {number}", f"task{number}")
        if task.id in lines:
            raise KvprofError(
                f"{path} line {number} repeats the id {task.id!r} of line {lines[task.id]}; give each task its own id."
            )
        lines[task.id] = number
        tasks.append(task)
        if limit is not None and len(tasks) >= limit:
            break
    if not tasks:
        raise KvprofError(f"tasks file {path} holds no tasks; add one JSON object per line.")
    return tasks


def task_from_record(record: object, where: str, default_id: str) -> Task:
    """The task a tasks file's JSON object describes (`{"id", "question", "answer"?, "documents"?, "private"?}`),
    refused with one sentence naming `where` (e.g. FILE line N) when malformed; `default_id` when it has no id."""
    if not isinstance(record, dict) or not isinstance(record.get("question"), str):
        raise KvprofError(f'{where} has no string field \'question\'; each line needs {{"id", "question"}}.')
    documents = record.get("documents", {})
    if not isinstance(documents, dict) or not all(isinstance(v, str) for v in documents.values()):
        raise KvprofError(f"{where}, field 'documents' should map names to texts; fix that line.")
    private = record.get("private", {})
    if not isinstance(private, dict) or not all(isinstance(v, str) for v in private.values()):
        raise KvprofError(f"{where}, field 'private' should map agent names to texts; fix that line.")
    answer = record.get("answer")
    return Task(
        id=str(record.get("id", default_id)),
        question=record["question"],
        answer=None if answer is None else str(answer),
        documents=documents,
        private=private,
    )


def task_record(task: Task) -> dict:
    """`task` as a tasks file's JSON object (`task_from_record` reads it back); `private` only when it has one."""
    record = {"id": task.id, "question": task.question, "answer": task.answer, "documents": task.documents}
    return record | ({"private": task.private} if task.private else {})
