"""The command line answers `--help` and usage errors without importing the heavy libraries (they take seconds),
and the help texts it reads from `kvprof/cli_help.json` are what the policy registry generates."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvprof import cli_help
from kvprof.cli import app

HEAVY = ("torch", "transformers", "peft", "triton", "ray", "plotly", "numpy", "scipy", "safetensors")
COMMANDS = [command.name for command in app.registered_commands]

# Runs the CLI in a fresh interpreter on the given arguments and prints the heavy modules it imported.
PROBE = """
import json, sys
from kvprof.cli import main
heavy = set(json.loads(sys.argv[2]))
sys.argv = ["kvprof", *json.loads(sys.argv[1])]
try:
    main()
except SystemExit:
    pass
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules} & heavy)), file=sys.stderr)
"""


def heavy_imports(*args: str) -> list[str]:
    """The heavy top-level packages `kvprof ARGS` imported, from a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(list(args)), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return json.loads(done.stderr.strip().splitlines()[-1])


def test_every_command_is_probed():
    assert len(COMMANDS) >= 10 and "replay" in COMMANDS and "tune-tau" in COMMANDS


@pytest.mark.parametrize(
    "args",
    [("--help",), ("--version",), (), ("no-such-command",), ("replay", "--no-such-option")]
    + [(command, "--help") for command in COMMANDS],
    ids=lambda args: " ".join(args) or "no arguments",
)
def test_help_and_usage_errors_import_no_heavy_library(args):
    assert heavy_imports(*args) == []


def test_the_probe_sees_what_a_running_command_imports():
    # a command that gets past option parsing imports what it needs: the probe would see it
    assert "torch" in heavy_imports("bench", "--seq-lens", "x")


def test_help_file_is_what_the_registry_generates():
    assert cli_help.help_data() == cli_help.generate(), "run `python -m kvprof.cli_help` to regenerate it"
