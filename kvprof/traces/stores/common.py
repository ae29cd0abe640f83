"""What every store reader returns (`StoreLog`): the calls it could read, those it left out for want of content
(`MissingContent`, reported per trajectory with the setting that captures it), and its one-sentence refusals."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.fileio import read_text_file
from kvprof.traces.chat_log import LoggedCall


def fail(path: Path, where: str, problem: str, fix: str) -> KvprofError:
    """The refusal of a bad input: file, the span, run, line or row (`where`), the problem and the fix."""
    return KvprofError(f"{path} {where}: {problem}; {fix}.")


@dataclass(frozen=True)
class MissingContent:
    """A call the trace holds without what kvprof needs to render it (`what`: e.g. "no input messages")."""

    trajectory: str
    where: str
    what: str


@dataclass
class StoreLog:
    """A store's calls in import order (numbered from 1), the calls left out, and the setting that records them."""

    format: str
    calls: list[LoggedCall]
    missing: list[MissingContent] = field(default_factory=list)
    setting: str = ""

    def missing_report(self) -> list[str]:
        """One sentence per trajectory with calls left out: how many, which, why, and the setting to turn on."""
        by_trajectory: dict[str, list[MissingContent]] = {}
        for entry in self.missing:
            by_trajectory.setdefault(entry.trajectory, []).append(entry)
        sentences = []
        for trajectory, entries in by_trajectory.items():
            whats = sorted({entry.what for entry in entries})
            places = ", ".join(entry.where for entry in entries[:3]) + (", ..." if len(entries) > 3 else "")
            sentences.append(
                f"trajectory {trajectory!r}: {len(entries)} calls left out ({'; '.join(whats)}: {places}); "
                f"{self.setting}"
            )
        return sentences


def json_documents(path: Path, kind: str, fix: str) -> list[object]:
    """The file's JSON documents: its whole text as one, else one per non-empty line (a line that is not JSON is
    refused naming it); refused as `read_text_file` (`kind`, `fix`) when it cannot be read."""
    text = read_text_file(path, kind, fix)
    try:
        return [json.loads(text)]
    except json.JSONDecodeError:
        pass
    documents = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            documents.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise fail(path, f"line {number}", f"is not JSON ({err.msg} at column {err.colno})", fix) from None
    return documents


def store_log(path: Path, format: str, calls: list[LoggedCall], missing: list[MissingContent], setting: str):
    """The `StoreLog` of a reader's calls (renumbered in import order), refusing an export with no call to import."""
    if not calls and not missing:
        raise KvprofError(f"{path} holds no model calls; export the traces that hold the agents' calls.")
    if not calls:
        raise KvprofError(
            f"{path} holds {len(missing)} model calls but none with its messages ({missing[0].where}: "
            f"{missing[0].what}); {setting}."
        )
    for number, call in enumerate(calls, start=1):
        call.line = number
    return StoreLog(format, calls, missing, setting)
