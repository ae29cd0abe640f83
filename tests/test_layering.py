"""The package's layers: each package imports only packages below it (or itself), the command line alone imports
the commands, and the reports render any result file without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvprof

PACKAGE = Path(kvprof.__file__).parent

# Bottom to top; a package may import its own layer and the layers below it. docs/layout.md draws the same order.
LAYERS = (
    ("errors", "fileio", "ui", "profiling", "threads"),  # plumbing
    ("claims", "results"),  # the papers' figures and verdicts; the commands' result files: data, no torch
    ("kernels",),  # attention and correction kernels, torch references
    ("traces",),  # trace format, tasks, chat templates and logs, shapes, reuse structure: no model
    ("model",),  # loading, the runtime, LoRA split, RoPE, layer kinds, buffers
    ("capture",),  # the workflow runner and capture of trajectories
    ("policies",),  # the sharing policies, their turn loop and anchor pools
    ("replay",),  # the replay engine, branches, metrics, the self-check, sharded replay
    ("rank", "tuning", "planning"),  # rank analysis; anchor fitting and threshold sweeps; a run's plan
    ("serving", "simulate"),  # serve-bench against a server; the serving model
    ("report",),  # tables, figures, dashboards
    ("recommend",),  # one decision for a target over replays, served by the simulator
    ("demo",),  # the demo worlds
    ("commands", "cli", "cli_help", "__main__"),  # the command line
)
LEVEL = {name: level for level, names in enumerate(LAYERS) for name in names}


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def _package_of(path: Path) -> str:
    return path.relative_to(PACKAGE).with_suffix("").parts[0]


def _sources() -> list[Path]:
    return [path for path in PACKAGE.rglob("*.py") if "assets" not in path.parts and path.name != "__init__.py"]


def test_every_package_has_a_layer():
    assert sorted({_package_of(path) for path in _sources()} - set(LEVEL)) == []


def test_no_package_imports_upward():
    upward = {}
    for path in _sources():
        own = LEVEL[_package_of(path)]
        above = sorted(
            module
            for module in _imported_modules(path)
            if module.startswith("kvprof.") and LEVEL.get(module.split(".")[1], -1) > own
        )
        if above:
            upward[str(path.relative_to(PACKAGE))] = above
    assert upward == {}


def test_only_the_command_line_imports_commands():
    command_line = {PACKAGE / "cli.py", *(PACKAGE / "commands").rglob("*.py")}
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(m for m in _imported_modules(path) if m.startswith("kvprof.commands"))
        for path in PACKAGE.rglob("*.py")
        if path not in command_line
    }
    assert not {path: modules for path, modules in offenders.items() if modules}


def test_no_command_imports_another():
    """A command module imports the library and the modules commands share (common, options, displays, planning),
    never another command: what two commands share otherwise lives in the library."""
    shared = {"__init__", "common", "options", "displays", "planning"}
    commands = {path.stem for path in (PACKAGE / "commands").glob("*.py")} - shared
    offenders = {
        path.name: sorted(
            module
            for module in _imported_modules(path)
            if module.startswith("kvprof.commands.") and module.split(".")[2] in commands
        )
        for path in (PACKAGE / "commands").glob("*.py")
    }
    assert {name: modules for name, modules in offenders.items() if modules} == {}


def test_reports_results_and_claims_import_without_torch():
    """`kvprof report` renders any result file on a machine without torch: every report, result and claims module
    imports with torch blocked."""
    code = (
        "import sys, pkgutil, importlib; sys.modules['torch'] = None\n"
        "for name in ('kvprof.report', 'kvprof.results', 'kvprof.claims'):\n"
        "    package = importlib.import_module(name)\n"
        "    [importlib.import_module(m.name) for m in pkgutil.walk_packages(package.__path__, name + '.')]"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_report_command_renders_results_without_torch(run_cli, tmp_path):
    """`kvprof report` on a replay and a simulate result, in a process where importing torch fails."""
    replay = Path(__file__).parent / "data" / "simulate" / "replay.json"
    code, _, err = run_cli("simulate", str(replay), "--qps", "1", "--duration", "5", "--out", str(tmp_path))
    assert code == 0, err
    files = [str(Path(__file__).parent / "data" / "results" / "replay.json"), str(tmp_path / "simulate.json")]
    code = (
        "import sys; sys.modules['torch'] = None; from kvprof.cli import main; "
        f"sys.argv = ['kvprof', 'report', *{files!r}, '--out', {str(tmp_path / 'report.html')!r}]; main()"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "report.html").stat().st_size > 0


MODEL = PACKAGE / "model"
# Function-level imports of kvprof.model modules inside kvprof/model that stay, each for a reason other than an import
# cycle: ("module", "function", "imported module") -> why. None today.
LAZY_MODEL_IMPORTS: dict[tuple[str, str, str], str] = {}


def _model_imports(path: Path) -> tuple[set[str], set[tuple[str, str]]]:
    """A kvprof/model module's imports of other kvprof.model modules: those run when it is imported (module level,
    class bodies and `if TYPE_CHECKING:` included), and (function, module) for those inside a function."""
    module_level: set[str] = set()
    in_functions: set[tuple[str, str]] = set()

    def targets(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            names = []
        return {
            name.split(".")[2]
            for name in names
            if name.startswith("kvprof.model.") and (MODEL / f"{name.split('.')[2]}.py").exists()
        }

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, function or getattr(child, "name", "<lambda>"))
                continue
            found = targets(child)
            if function is None:
                module_level.update(found)
            else:
                in_functions.update((function, module) for module in found)
            visit(child, function)

    visit(ast.parse(path.read_text(encoding="utf-8")), None)
    module_level.discard(path.stem)
    return module_level, in_functions


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """A cycle of `graph` (node -> the nodes it imports) as [a, b, ..., a], or [] when it is a DAG."""
    state: dict[str, str] = {}  # node -> "open" (on the current path) or "done"
    path: list[str] = []

    def walk(node: str) -> list[str]:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (found := walk(target)):
                return found
        path.pop()
        state[node] = "done"
        return []

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return []


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_model_modules_import_each_other_without_a_cycle():
    """kvprof/model's modules import each other at module level as a DAG (architecture at the bottom, runtime and
    agents near the top), and none imports another inside a function to dodge a cycle (`LAZY_MODEL_IMPORTS`)."""
    graph, lazy = {}, {}
    for path in sorted(MODEL.glob("*.py")):
        graph[path.stem], in_functions = _model_imports(path)
        lazy.update({(path.stem, function, module): None for function, module in in_functions})
    assert _cycle(graph) == []
    assert sorted(set(lazy) - set(LAZY_MODEL_IMPORTS)) == []
    assert graph["architecture"] == set()


def test_no_function_over_80_lines_outside_kernels():
    """Functions a newcomer reads in one screen (signature and docstring included); the Triton kernels, whose
    bodies are one tiled loop each, are exempt. ruff holds their complexity (pyproject.toml)."""
    long = {}
    for path in _sources():
        if _package_of(path) == "kernels":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long[f"{path.relative_to(PACKAGE)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert long == {}


def test_no_replay_module_over_500_lines():
    """The replay engine's modules are each one stage a reader holds in mind (records, memory, summary, timing,
    the lockstep loop, online re-runs, the run's setting, shards and their Ray backend)."""
    long = {
        path.name: lines
        for path in (PACKAGE / "replay").glob("*.py")
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > 500
    }
    assert long == {}
