"""Shared fixtures: a tiny world (model, tokenizer, LoRA adapters, tasks) built once per test session."""

from __future__ import annotations

import os

import pytest
import torch

from kvprof.model.tiny import TinyWorld, build_tiny_world

# One intra-op thread per test process (and the subprocesses it starts): the tiny models gain nothing from more,
# and OpenMP threads that spin while another process holds a core made the suite many times slower.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_torch_thread_after_each_test():
    """A test leaves its process at the one thread set above: a call that raised it (a training run did, to two)
    made every later test of this worker contend with the other for the cores, several times slower."""
    yield
    threads = torch.get_num_threads()
    assert threads == 1, f"this test left torch at {threads} threads; scope them (kvprof.profiling.torch_settings)"


# The test files that take longest (first the sm_90 compiles, which a fresh clone runs without pytest's cache), run
# first: pytest-xdist hands whole files to its two workers in collection order, and a long file collected last kept
# one worker busy for a minute and more after the other had finished.
LONGEST_FIRST = (
    "test_kernels_aot.py",
    "test_distributed.py",
    "test_demo_assets.py",
    "test_half_precision.py",
    "test_layer_kinds.py",
    "test_cache_paths.py",
    "test_chat_real_logs.py",
    "test_selective.py",
    "test_kernels_interpreter.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order
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


def capture_tiny_trace(world: TinyWorld, workflow, path):
    """Capture the tiny world's tasks with `workflow` (greedy, CPU) into the trace file `path`."""
    from kvprof.capture.workflow import Sampling, SearchTool, model_responder, run_react
    from kvprof.model.agents import load_agents, tokenizer_identity
    from kvprof.traces.spec import build_spec
    from kvprof.traces.tasks import load_tasks
    from kvprof.traces.trace import Trace, TraceHeader, write_trace

    spec = build_spec(workflow)
    agents = load_agents(spec, str(world.model), device="cpu", dtype="float32")
    trajectories = [
        run_react(spec, agents.tokenizer, task, SearchTool(), model_responder(agents, Sampling()))
        for task in load_tasks(world.tasks)
    ]
    header = TraceHeader(
        model={"path": str(world.model)}, tokenizer=tokenizer_identity(agents.tokenizer), workflow=spec.to_dict()
    )
    return write_trace(path, Trace(header, trajectories))


@pytest.fixture(scope="session")
def lora_trace(tiny_world, tmp_path_factory):
    """A lora-mode trace of the tiny world's three tasks, captured once per session."""
    return capture_tiny_trace(tiny_world, tiny_world.lora_workflow, tmp_path_factory.mktemp("lora") / "trace.jsonl")


@pytest.fixture(scope="session")
def prompt_trace(tiny_world, tmp_path_factory):
    """A prompt-mode trace: shared segments sit after role prompts of different lengths."""
    return capture_tiny_trace(tiny_world, tiny_world.prompt_workflow, tmp_path_factory.mktemp("prompt") / "trace.jsonl")
