"""The README and the documentation site: short README, no machine paths, every page in the nav, every example
output present, the CLI reference covering every command (`make docs` builds the site itself)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
# an absolute path of some machine: /work/..., /root/..., /home/..., /tmp/... (not a relative one such as
# world/workflow.toml)
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(work|root|home|tmp)/")
SNIPPET = re.compile(r'--8<-- "docs/examples/([^":]+)(?::[0-9:]*)?"')  # a file, optionally with a line range


def load(path: Path, name: str) -> ModuleType:
    """A module of the repository that is not in a package (a script, the MkDocs hook)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def pages() -> list[Path]:
    """The site's Markdown pages (the hook and the example outputs are sources, not pages)."""
    return sorted(p for p in DOCS.rglob("*.md") if p.relative_to(DOCS).parts[0] not in {"hooks", "examples"})


def nav_pages() -> set[str]:
    """The pages mkdocs.yml's nav names (comments left out)."""
    text = (REPO / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:") :]
    uncommented = "\n".join(line.split("#", 1)[0] for line in nav.splitlines())
    return set(re.findall(r"[\w./-]+\.md", uncommented))


def test_readme_is_short() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_no_machine_paths_in_what_is_shown() -> None:
    shown = [REPO / "README.md", *pages(), *sorted((DOCS / "examples").glob("*.txt"))]
    found = [
        f"{p.relative_to(REPO)}:{n}"
        for p in shown
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if MACHINE_PATH.search(line)
    ]
    assert not found, f"machine-specific paths in {found}"


def test_readme_links_resolve() -> None:
    """The README's relative links name files of the repository (so they work on GitHub)."""
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (REPO / "README.md").read_text())
    missing = [link for link in links if "://" not in link and not (REPO / link).exists()]
    assert not missing


def test_every_page_is_in_the_nav() -> None:
    hook = load(DOCS / "hooks" / "cli_reference.py", "cli_reference_nav")
    on_disk = {p.relative_to(DOCS).as_posix() for p in pages()} | {hook.PAGE}
    nav = nav_pages()
    assert on_disk - nav == set(), "pages missing from the nav"
    assert nav - on_disk == set(), "nav entries without a page"


def test_every_example_output_exists() -> None:
    examples = load(REPO / "scripts" / "docs_examples.py", "docs_examples")
    files = {p.name for p in (DOCS / "examples").glob("*.txt")}
    included = {name for page in pages() for name in SNIPPET.findall(page.read_text())}
    assert included - files == set(), "pages include example outputs that do not exist"
    registered = {f"{name}.txt" for name in examples.EXAMPLES}
    assert registered == files, "every registered example has its output file, and every output file its example"
    for name, example in examples.EXAMPLES.items():
        shown = [line[2:] for line in (DOCS / "examples" / f"{name}.txt").read_text().splitlines() if line[:2] == "$ "]
        assert shown == list(example.commands), f"{name}.txt shows other commands than the example runs"


def test_scrub_makes_paths_relative() -> None:
    examples = load(REPO / "scripts" / "docs_examples.py", "docs_examples")
    assert (
        examples.scrub(f"fidelity: 28 turns of {REPO}/kvprof/demo/x.jsonl")
        == "fidelity: 28 turns of kvprof/demo/x.jsonl"
    )
    assert examples.scrub(f"{Path.home()}/.cache/model") == "~/.cache/model"


def test_cli_reference_covers_every_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command the app registers, including one registered after the hook was written."""
    from kvprof.cli import app

    def added_later(flag: bool = False) -> None:
        """A command registered after the hook was written."""

    monkeypatch.setattr(app, "registered_commands", list(app.registered_commands))
    app.command("added-later")(added_later)
    hook = load(DOCS / "hooks" / "cli_reference.py", "cli_reference")
    group = hook.cli_group()
    names = [name for name, _ in hook.registered(group)]
    assert {"capture", "replay", "tune-tau", "demo", "added-later"} <= set(names)
    page = hook.render(group)
    for name in names:
        assert f"## `kvprof {name}`" in page
    assert "| `--flag` / `--no-flag` | flag |" in page
    assert "A command registered after the hook was written." in page
