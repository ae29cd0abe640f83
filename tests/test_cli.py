"""The command line itself: usage errors are one line and exit 2; help and version exit 0."""

from __future__ import annotations

import pytest

import kvprof


@pytest.mark.parametrize(
    "args, message",
    [
        (("no-such-command",), "No such command 'no-such-command'. See 'kvprof --help'."),
        (("fit-anchor",), "No such command 'fit-anchor'. Did you mean 'fit-anchors'? See 'kvprof --help'."),
        (("replay", "--nope"), "No such option: --nope"),
        (("capture",), "Missing option '--model'."),
        (("replay", "--repeats", "0"), "Invalid value for '--repeats'"),
    ],
)
def test_usage_errors_are_one_line(run_cli, args, message):
    code, out, err = run_cli(*args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in out + err
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


@pytest.mark.parametrize("args", [("--help",), ("replay", "--help"), ("capture", "--help"), ("import-chat", "--help")])
def test_help_exits_0(run_cli, args):
    code, out, err = run_cli(*args)
    assert code == 0 and "Usage: kvprof" in out and not err.strip()


def test_version_exits_0(run_cli):
    assert run_cli("--version") == (0, f"kvprof {kvprof.__version__}\n", "")


def test_no_command_shows_the_help(run_cli):
    code, out, err = run_cli()
    assert code == 2 and "Usage: kvprof" in out and "Traceback" not in out + err
