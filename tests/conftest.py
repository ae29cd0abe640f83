"""Shared fixtures: a tiny world (model, tokenizer, LoRA adapters, tasks) built once per test session."""

from __future__ import annotations

import pytest
import torch

from kvprof.tiny import TinyWorld, build_tiny_world


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> TinyWorld:
    return build_tiny_world(tmp_path_factory.mktemp("tiny_world"))


@pytest.fixture
def run_cli(capsys):
    """Run `kvprof ARGS...` in-process; returns (exit_code, stdout, stderr)."""
    import sys

    from kvprof.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        argv = sys.argv
        sys.argv = ["kvprof", *map(str, args)]
        try:
            main()
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        finally:
            sys.argv = argv
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


@pytest.fixture(scope="session")
def lora_trace(tiny_world, tmp_path_factory):
    """A lora-mode trace of the tiny world's three tasks, captured once per session."""
    from kvprof.model import load_agents
    from kvprof.spec import build_spec
    from kvprof.trace import Trace, TraceHeader, write_trace
    from kvprof.model import tokenizer_identity
    from kvprof.workflow import Sampling, SearchTool, load_tasks, model_responder, run_react

    spec = build_spec(tiny_world.lora_workflow)
    agents = load_agents(spec, str(tiny_world.model), device="cpu", dtype="float32")
    trajectories = [run_react(spec, agents.tokenizer, task, SearchTool(), model_responder(agents, Sampling()))
                    for task in load_tasks(tiny_world.tasks)]
    header = TraceHeader(model={"path": str(tiny_world.model)}, tokenizer=tokenizer_identity(agents.tokenizer),
                         workflow=spec.to_dict())
    path = tmp_path_factory.mktemp("lora_trace") / "trace.jsonl"
    write_trace(path, Trace(header, trajectories))
    return path
