"""`kvprof report`'s core: result files (any command's JSON) → dashboard sections, by result kind.

Each command that writes a result registers one function `dict → list[Section]` under its kind (the `schema`
field is `kvprof.result.<kind>`). Several files of one kind are shown one after another, each titled by its path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from kvprof.errors import KvprofError
from kvprof.report import bench, capture, rank_analysis, replay
from kvprof.report.html import Section

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
        raise KvprofError(f"result file {path} does not exist; pass JSON files written by kvprof commands "
                          "(e.g. runs/replay/replay.json).")
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise KvprofError(f"result file {path} is not valid JSON ({err.msg} at line {err.lineno}); "
                          "pass a file written by a kvprof command.") from None
    schema = payload.get("schema", "") if isinstance(payload, dict) else ""
    if not schema.startswith("kvprof.result."):
        raise KvprofError(f"{path} is not a kvprof result (no 'kvprof.result.*' schema); pass JSON files written "
                          "by kvprof commands.")
    return schema.removeprefix("kvprof.result."), payload


def dashboard_sections(paths: list[Path]) -> list[Section]:
    sections: list[Section] = []
    for path in paths:
        kind, payload = load_result(path)
        builder = BUILDERS.get(kind)
        if builder is None:
            raise KvprofError(f"{path} is a {kind!r} result, which `kvprof report` cannot show yet (it shows "
                              f"{', '.join(sorted(BUILDERS))}); leave it out.")
        for section in builder(payload):
            section.title = f"{section.title} — {path}"
            sections.append(section)
    return sections
