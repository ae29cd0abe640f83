"""`kvprof report`'s core: results (any command's JSON) → dashboard sections, via one function `dict →
list[Section]` registered per kind (`schema` `kvprof.result.<kind>`); results of one kind are titled by file path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvprof.errors import KvprofError
from kvprof.fileio import JsonType, check_fields, read_result
from kvprof.report import anchors, bench, capture, plan, rank_analysis, recommend, replay, serve_bench, simulate
from kvprof.report.html import Section, ordered, write_html
from kvprof.report.tables import TableData
from kvprof.results.base import ResultFile
from kvprof.results.capture import CaptureResult
from kvprof.results.plan import PlanResult
from kvprof.results.rank_analysis import RankAnalysisResult
from kvprof.results.recommend import RecommendResult
from kvprof.results.replay import ReplayResult
from kvprof.results.serve_bench import ServeBenchResult
from kvprof.results.simulate import SimulateResult
from kvprof.results.tune_tau import TuneTauResult

SectionBuilder = Callable[[Any], list[Section]]
"""A result kind's sections from its JSON, or from its typed result (`TYPED`)."""

BUILDERS: dict[str, SectionBuilder] = {
    "bench": bench.sections,
    "capture": capture.sections,
    "replay": replay.sections,
    "rank_analysis": rank_analysis.sections,
    "fit_anchors": anchors.fit_sections,
    "tune_tau": anchors.tune_sections,
    "serve_bench": serve_bench.sections,
    "simulate": simulate.sections,
    "recommend": recommend.sections,
    "plan": plan.sections,
}


RESULT_FIX = "pass JSON files written by kvprof commands (e.g. runs/replay/replay.json)"
OPTIONAL = type(None)
SHOWN_FIELDS: dict[str, dict[str, JsonType]] = {
    "bench": {"results": list, "implementations": dict},
    "capture": {"summary": dict},
    "replay": {"dense": dict, "policies": dict},
    "rank_analysis": {"mode": str, "agents": list, "layer_means": list, "pairs": list, "spectra": list, "claims": list},
    "fit_anchors": {
        "trajectories": int,
        "trace": str,
        "pool": str,
        "anchors": int,
        "agents": list,
        "rank": (int, OPTIONAL),
        "ranks": list,
        "layers": list,
        "memory": dict,
    },
    "tune_tau": {
        "policy": str,
        "threshold_option": str,
        "options": dict,
        "rows": list,
        "pareto": list,
        "recommended": (dict, OPTIONAL),
        "heldout": (dict, OPTIONAL),
        "tuning_trajectories": list,
    },
    "serve_bench": {"server": dict, "runs": list},
    "simulate": {"runs": list, "settings": dict, "scale": dict, "cost_model": dict},
    "recommend": {"candidates": list, "decision": dict, "sensitivity": list},
    "plan": {"command": str, "layers": int, "probes": list, "peak_bytes": dict, "stored_peak_bytes": dict},
}
"""The fields each result kind's sections read first; `result_sections` checks them before drawing."""
TYPED: dict[str, type[ResultFile]] = {
    "capture": CaptureResult,
    "plan": PlanResult,
    "rank_analysis": RankAnalysisResult,
    "recommend": RecommendResult,
    "replay": ReplayResult,
    "serve_bench": ServeBenchResult,
    "simulate": SimulateResult,
    "tune_tau": TuneTauResult,
}
"""The result kinds whose sections draw from a typed result (`kvprof.results`), read from the JSON first."""
DATA_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError)
"""What drawing sections from a result's JSON raises on a field deeper than `SHOWN_FIELDS` that is missing or has
another type or value than kvprof writes."""


def load_result(path: Path) -> tuple[str, dict]:
    """(kind, payload) of a result file; refuses non-kvprof files and malformed envelopes (`args`, `environment`)."""
    kind, result = read_result(path, RESULT_FIX)
    check_fields(result, {"args": (dict, OPTIONAL), "environment": (dict, OPTIONAL)}, str(path), RESULT_FIX)
    check_fields(result.get("environment") or {}, {"cpu": (dict, OPTIONAL)}, f"{path}, environment", RESULT_FIX)
    return kind, result


def result_sections(kind: str, result: dict, path: Path) -> list[Section]:
    """The sections of one result of `kind` (file JSON or payload) titled with `path`; malformed fields are refused
    naming the file."""
    builder = BUILDERS.get(kind)
    if builder is None:
        raise KvprofError(
            f"{path} is a {kind!r} result, which `kvprof report` cannot show yet (it shows "
            f"{', '.join(sorted(BUILDERS))}); leave it out."
        )
    fix = f"pass the {kind}.json a kvprof {kind.replace('_', '-')} run wrote, unchanged"
    check_fields(result, SHOWN_FIELDS[kind], str(path), fix)
    shown: object = result
    if kind == "replay":
        shown = read_replay(result, path, fix)
    elif kind in TYPED:
        shown = TYPED[kind].from_json(result, str(path), fix)
    try:
        sections = builder(shown)
    except DATA_ERRORS as err:
        raise KvprofError(
            f"{path} is a {kind} result with a field kvprof cannot read ({type(err).__name__}: {err}); {fix}."
        ) from None
    for section in sections:
        section.title = f"{section.title} — {path}"
    return sections


def read_replay(result: dict, path: Path, fix: str) -> ReplayResult:
    """A replay result's JSON as a `ReplayResult`, refused naming `path` when a run lacks its summary."""
    replay = ReplayResult.from_json(result, str(path), fix)
    runs = {"dense run": replay.dense} | {f"policy {label!r}": run for label, run in replay.policies.items()}
    for name, run in runs.items():
        if run.summary is None:
            raise KvprofError(f"{path}, {name} has no field 'summary'; {fix}.")
    return replay


def _device(result: dict) -> str:
    device = str(result.get("device") or result.get("args", {}).get("device") or "–")
    cuda = result.get("environment", {}).get("cuda")
    return f"{device} ({cuda})" if cuda and device.startswith("cuda") else device


def environment_table(results: Sequence[tuple[Path, dict]]) -> TableData:
    """The environment panel: per result file, what and when it was measured on, with the threads it ran and the
    machine's load from other processes while its command ran ('–' where not recorded)."""
    table = TableData(
        title="environment", columns=["result", "model", "device", "dtype", "software", "kvprof", "created"]
    )
    for path, result in results:
        args, environment = result.get("args", {}), result.get("environment", {})
        cpu = environment.get("cpu") or {}
        software = f"torch {environment.get('torch', '?')}, {environment.get('cpu_threads', '?')} CPU threads"
        load = environment.get("load") or {}
        if load.get("other_cores") is not None:
            software += f", other processes' load {load['other_cores']:.1f} of {load['cores']} cores"
            software += " (contended)" if load.get("contended") else ""
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
    """Every result file's sections, decision first (`ordered`), and their environment panel."""
    loaded = [(path, *load_result(path)) for path in paths]
    sections = ordered([section for path, kind, result in loaded for section in result_sections(kind, result, path)])
    return sections, environment_table([(path, result) for path, _, result in loaded])


def write_dashboard(
    path: Path, sections: list[Section], sources: Sequence[Path], environment: TableData | None = None
) -> Path:
    """The dashboard page of `sections`, from the result files `sources`, at `path`."""
    return write_html(path, "kvprof report", sections, subtitle=", ".join(map(str, sources)), environment=environment)


def build_dashboard(paths: list[Path], out: Path) -> tuple[Path, list[Section]]:
    """`kvprof report`'s step: the dashboard of the result files `paths` written at `out`; its path and sections."""
    sections, environment = dashboard_sections(paths)
    return write_dashboard(out, sections, paths, environment), sections
