"""The package's layers: only the command line (kvprof/cli.py, kvprof/commands/) imports the commands."""

from __future__ import annotations

import ast
from pathlib import Path

import kvprof

PACKAGE = Path(kvprof.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def test_only_the_command_line_imports_commands():
    command_line = {PACKAGE / "cli.py", *(PACKAGE / "commands").rglob("*.py")}
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(m for m in _imported_modules(path) if m.startswith("kvprof.commands"))
        for path in PACKAGE.rglob("*.py")
        if path not in command_line
    }
    assert not {path: modules for path, modules in offenders.items() if modules}
