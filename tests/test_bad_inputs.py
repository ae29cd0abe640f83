"""Garbage passed as a user file is refused in one sentence: exit 2, one `error:` line naming the file, no traceback,
nothing written, and a bad trace is refused before replay loads a model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvprof.demo.assets import demo_world


@pytest.fixture(scope="module")
def world():
    return demo_world()


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a command loads a model."""
    import kvprof.model.agents

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the trace was validated")

    monkeypatch.setattr(kvprof.model.agents, "load_agents_for_trace", refuse)
    monkeypatch.setattr(kvprof.model.agents, "load_agents", refuse)


def refused(result: tuple[int, str, str], path: Path, message: str) -> None:
    code, out, err = result
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in out + err, (out, err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0], err
    assert message in lines[0], lines[0]


def bad_traces(world, folder: Path) -> dict[str, tuple[Path, str]]:
    """A binary file, a trace with a header and no trajectory, and one whose trajectory has no turns, each with what
    its refusal says."""
    header, first = world.sample_traces["lora_short"].read_text(encoding="utf-8").splitlines()[:2]
    empty = json.loads(first) | {"turns": []}
    files = {
        "binary": (b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x80garbage", "is not UTF-8 text"),
        "header_only": ((header + "\n").encode(), "has no trajectories"),
        "no_turns": ((header + "\n" + json.dumps(empty) + "\n").encode(), f"trajectory {empty['id']!r} has no turns"),
    }
    paths = {}
    for name, (data, message) in files.items():
        path = folder / f"{name}.jsonl"
        path.write_bytes(data)
        paths[name] = (path, message)
    return paths


@pytest.mark.parametrize("case", ["binary", "header_only", "no_turns"])
def test_inspect_refuses_a_bad_trace(world, tmp_path, run_cli, case):
    path, message = bad_traces(world, tmp_path)[case]
    refused(run_cli("inspect", path, "--out", tmp_path / "out"), path, message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["replay", "fit-anchors", "tune-tau"])
@pytest.mark.parametrize("case", ["binary", "header_only", "no_turns"])
def test_a_bad_trace_is_refused_before_the_model_loads(world, tmp_path, run_cli, no_model, command, case):
    path, message = bad_traces(world, tmp_path)[case]
    refused(run_cli(command, path, "--device", "cpu", "--out", tmp_path / "out"), path, message)
    assert not (tmp_path / "out").exists()


def test_inspect_refuses_a_header_that_claims_another_vocabulary(world, tmp_path, run_cli):
    header, *rest = world.sample_traces["lora_short"].read_text(encoding="utf-8").splitlines()
    record = json.loads(header)
    record["tokenizer"]["vocab_size"] += 1000
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join([json.dumps(record), *rest]) + "\n", encoding="utf-8")
    refused(run_cli("inspect", path, "--model", world.model), path, "re-capture the trace")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("search", "that is str, not an object"),
        (7, "that is int, not an object"),
        ({"id": "call-1", "type": "function"}, "without a 'function' object"),
        ({"type": "function", "function": {"arguments": "{}"}}, "whose function has no text 'name'"),
        ({"type": "function", "function": {"name": "search"}}, "whose function has no 'arguments'"),
    ],
)
def test_import_chat_refuses_a_tool_call_that_is_not_one(world, tmp_path, run_cli, call, message):
    lines = world.sample_chat_log.read_text(encoding="utf-8").splitlines()
    record = json.loads(lines[1])
    record["messages"].append({"role": "assistant", "content": None, "tool_calls": [call]})
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join([lines[0], json.dumps(record)]) + "\n", encoding="utf-8")
    result = run_cli("import-chat", path, "--model", world.model, "--out", tmp_path / "out")
    refused(result, path, f"line 2: message {len(record['messages']) - 1} has tool call 0 {message}")
    assert not (tmp_path / "out" / "trace.jsonl").exists()


def test_every_workflow_setting_is_type_checked():
    from kvprof.traces.spec import AGENT_TYPES, SETTING_TYPES, AgentSpec, WorkflowSpec

    assert set(SETTING_TYPES) == set(WorkflowSpec.__dataclass_fields__) - {"agents"}
    assert set(AGENT_TYPES) == set(AgentSpec.__dataclass_fields__) - {"name"}
