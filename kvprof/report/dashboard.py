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
from kvprof.report import anchors, bench, capture, rank_analysis, replay, serve_bench, simulate
from kvprof.report.html import Section, ordered, write_html
from kvprof.report.tables import TableData

SectionBuilder = Callable[[dict], list[Section]]

BUILDERS: dict[str, SectionBuilder] = {
    "bench": bench.sections,
    "capture": capture.sections,
    "replay": replay.sections,
    "rank_analysis": rank_analysis.sections,
    "fit_anchors": anchors.fit_sections,
    "tune_tau": anchors.tune_sections,
    "serve_bench": serve_bench.sections,
    "simulate": simulate.sections,
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


def _device(result: dict) -> str:
    device = str(result.get("device") or result.get("args", {}).get("device") or "–")
    cuda = result.get("environment", {}).get("cuda")
    return f"{device} ({cuda})" if cuda and device.startswith("cuda") else device


def environment_table(results: Sequence[tuple[Path, dict]]) -> TableData:
    """The environment panel: per result file, what it was measured on and when (from the result's envelope;
    '–' where a result does not record it)."""
    table = TableData(
        title="environment", columns=["result", "model", "device", "dtype", "software", "kvprof", "created"]
    )
    for path, result in results:
        args, environment = result.get("args", {}), result.get("environment", {})
        cpu = environment.get("cpu") or {}
        software = f"torch {environment.get('torch', '?')}, {environment.get('cpu_threads', '?')} CPU threads"
        table.add_row(
            str(path),
            str(result.get("model") or args.get("model") or "–"),
            _device(result),
            str(result.get("dtype") or args.get("dtype") or "–"),
            software + (f", {cpu['name']}" if cpu.get("name") else ""),
            str(result.get("kvprof", "–")),
            str(result.get("created", "–")),
        )
    return table


def dashboard_sections(paths: list[Path]) -> tuple[list[Section], TableData]:
    """The sections of every result file in `paths`, decision first (`ordered`), and the environment panel of those
    files."""
    loaded = [(path, *load_result(path)) for path in paths]
    sections = ordered([section for path, kind, result in loaded for section in result_sections(kind, result, path)])
    return sections, environment_table([(path, result) for path, _, result in loaded])


def write_dashboard(
    path: Path, sections: list[Section], sources: Sequence[Path], environment: TableData | None = None
) -> Path:
    """The dashboard page of `sections`, from the result files `sources`, at `path`."""
    return write_html(path, "kvprof report", sections, subtitle=", ".join(map(str, sources)), environment=environment)
