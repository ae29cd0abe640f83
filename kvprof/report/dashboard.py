"""`kvprof report`'s core: results (any command's JSON, from files or in memory) → dashboard sections, by result kind.

Each command that writes a result registers one function `dict → list[Section]` under its kind (the `schema`
field is `kvprof.result.<kind>`). Several results of one kind are shown one after another, each titled by the path
of its file.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.report import bench, capture, rank_analysis, replay
from kvprof.report.html import Section, write_html

SectionBuilder = Callable[[dict], list[Section]]

BUILDERS: dict[str, SectionBuilder] = {
    "bench": bench.sections,
    "capture": capture.sections,
    "replay": replay.sections,
    "rank_analysis": rank_analysis.sections,
}


def load_result(path: Path) -> tuple[str, dict]:
    """Read a result file and return (kind, payload); refuses files that are not kvprof results."""
    if not path.is_file():
        raise KvprofError(
            f"result file {path} does not exist; pass JSON files written by kvprof commands "
            "(e.g. runs/replay/replay.json)."
        )
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise KvprofError(
            f"result file {path} is not valid JSON ({err.msg} at line {err.lineno}); "
            "pass a file written by a kvprof command."
        ) from None
    schema = payload.get("schema", "") if isinstance(payload, dict) else ""
    if not schema.startswith("kvprof.result."):
        raise KvprofError(
            f"{path} is not a kvprof result (no 'kvprof.result.*' schema); pass JSON files written by kvprof commands."
        )
    return schema.removeprefix("kvprof.result."), payload


def result_sections(kind: str, result: dict, path: Path) -> list[Section]:
    """The sections of one result of `kind` (a result file's JSON, or the payload written to it), each titled with
    the `path` of its file."""
    builder = BUILDERS.get(kind)
    if builder is None:
        raise KvprofError(
            f"{path} is a {kind!r} result, which `kvprof report` cannot show yet (it shows "
            f"{', '.join(sorted(BUILDERS))}); leave it out."
        )
    sections = builder(result)
    for section in sections:
        section.title = f"{section.title} — {path}"
    return sections


def dashboard_sections(paths: list[Path]) -> list[Section]:
    """The sections of every result file in `paths`, in order."""
    return [section for path in paths for section in result_sections(*load_result(path), path)]


def write_dashboard(path: Path, sections: list[Section], sources: Sequence[Path]) -> Path:
    """The dashboard page of `sections`, from the result files `sources`, at `path`."""
    return write_html(path, "kvprof report", sections, subtitle=", ".join(map(str, sources)))
