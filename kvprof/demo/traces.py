"""Sample traces of the demo world in both modes.

    python -m kvprof.demo.traces [--world DIR]

- `{prompt,lora}_short`: the first SHORT_TASKS held-out tasks, captured (greedy) as `kvprof capture` does.
- `prompt_tune`: the next TUNE_TASKS, prompt mode: calibration and tuning for `fit-anchors` / `tune-tau`.
- `{prompt,lora}_long`: the first long task with gold outputs (source `demo-oracle`: the model loses the thread in
  paragraphs this long; replay is teacher-forced).

Header paths are relative to the traces' folder (`load_agents_for_trace`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from kvprof.capture.runner import capture_spec, capture_trajectories, sampled_trace_header, trajectory_summary
from kvprof.capture.workflow import Sampling
from kvprof.demo.assets import ASSETS, DemoWorld
from kvprof.demo.data import GoldTask, oracle_trajectory
from kvprof.demo.otlp_log import otlp_export
from kvprof.demo.world import read_tasks
from kvprof.fileio import atomic_open
from kvprof.model.agents import load_agents, load_tokenizer, tokenizer_identity
from kvprof.traces.chat import ChatFormat
from kvprof.traces.chat_log import trajectory_calls
from kvprof.traces.spec import build_spec
from kvprof.traces.tasks import Task, load_tasks
from kvprof.traces.trace import Trace, TraceHeader, Trajectory, read_trace, record_line, write_trace
from kvprof.ui import progress

SHORT_TASKS = 4
TUNE_TASKS = 24


def _relative_header(trace: Path, folder: Path) -> str:
    lines = trace.read_text(encoding="utf-8").splitlines(keepends=True)
    header = json.loads(lines[0])
    header["model"]["path"] = Path(os.path.relpath(header["model"]["path"], folder)).as_posix()
    header["tokenizer"]["name"] = header["model"]["path"]
    for agent in header["workflow"]["agents"]:
        if agent.get("adapter"):
            agent["adapter"] = Path(os.path.relpath(agent["adapter"], folder)).as_posix()
    return record_line(header) + "".join(lines[1:])


def gold_trace(model: Path, workflow: Path, tasks: Sequence[GoldTask], path: Path) -> list[Trajectory]:
    """Write the trace of `tasks` run by `workflow` with gold outputs to `path`; returns its trajectories."""
    spec = build_spec(workflow)
    tokenizer = load_tokenizer(str(model.resolve()))
    trajectories = [oracle_trajectory(spec, tokenizer, task) for task in tasks]
    header = TraceHeader(
        model={"path": str(model.resolve()), "dtype": "float32", "architecture": "LlamaForCausalLM"},
        tokenizer=tokenizer_identity(tokenizer),
        workflow=spec.to_dict(),
        source="demo-oracle",
    )
    write_trace(path, Trace(header, trajectories))
    return trajectories


def captured_trace(model: Path, workflow: Path, tasks: list[Task], path: Path, device: str) -> list[Trajectory]:
    """Capture `tasks` into `path` as `kvprof capture --model MODEL --workflow WORKFLOW` does (greedy, seed 0, fp32)."""
    agents = load_agents(capture_spec(workflow), str(model.resolve()), device=device, dtype="float32")
    sampling = Sampling()
    with progress() as bar:
        job = bar.add_task(f"capturing {workflow.stem}", total=len(tasks))
        return capture_trajectories(
            agents,
            tasks,
            path,
            sampled_trace_header(str(model.resolve()), agents, sampling),
            sampling,
            on_trajectory=lambda traj: bar.advance(job),
        )


def relative_trace(source: Path, target: Path) -> None:
    """Write the trace `source` to `target` with the header's paths relative to `target`'s folder."""
    target.parent.mkdir(parents=True, exist_ok=True)
    text = _relative_header(source, target.parent.resolve())
    with atomic_open(target) as handle:
        handle.write(text)


def build(world: DemoWorld, device: str = "cpu") -> dict[str, dict]:
    """Capture the four sample traces into WORLD/sample_traces; returns `name → {trajectories, tokens}`."""
    stats = {}
    for mode in ("prompt", "lora"):
        for kind, tasks, limit in (("short", world.heldout_tasks, SHORT_TASKS), ("long", world.long_tasks, 1)):
            name = f"{mode}_{kind}"
            with tempfile.TemporaryDirectory() as tmp:
                trace = Path(tmp) / "trace.jsonl"
                if kind == "short":
                    trajectories = captured_trace(
                        world.model, world.workflow(mode), load_tasks(tasks, limit), trace, device
                    )
                else:
                    trajectories = gold_trace(world.model, world.workflow(mode), read_tasks(tasks)[:limit], trace)
                summary = trajectory_summary(trajectories, 0.0)
                relative_trace(trace, world.sample_traces[name])
            stats[name] = {
                "trajectories": summary.trajectories,
                "tokens": summary.distinct_tokens,
                "shared_tokens": summary.shared_tokens,
                "accuracy": summary.accuracy,
            }
    stats["prompt_tune"] = build_tune(world, device)
    write_sample_chat_log(world)
    return stats


def build_tune(world: DemoWorld, device: str = "cpu") -> dict:
    """Capture `prompt_tune` (see module docstring) into WORLD/sample_traces; returns its statistics."""
    tasks = load_tasks(world.heldout_tasks, SHORT_TASKS + TUNE_TASKS)[SHORT_TASKS:]
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        trajectories = captured_trace(world.model, world.prompt_workflow, tasks, trace, device)
        relative_trace(trace, world.sample_traces["prompt_tune"])
    summary = trajectory_summary(trajectories, 0.0)
    return {
        "trajectories": summary.trajectories,
        "tokens": summary.distinct_tokens,
        "shared_tokens": summary.shared_tokens,
        "accuracy": summary.accuracy,
    }


def write_sample_chat_log(world: DemoWorld) -> Path:
    """`prompt_short` written as chat logs (`kvprof.traces.chat_log.trajectory_calls`), what `kvprof import-chat`
    reads: as kvprof lays calls out, as a group chat (`group_chat`), and as an OTLP export (`otlp_export`)."""
    calls = [
        call for traj in read_trace(world.sample_traces["prompt_short"]).trajectories for call in trajectory_calls(traj)
    ]
    world.sample_chat_log.parent.mkdir(parents=True, exist_ok=True)
    for path, lines in ((world.sample_chat_log, calls), (world.sample_group_chat_log, group_chat(calls))):
        with atomic_open(path) as handle:
            handle.write("".join(record_line(call) for call in lines))
    chat = ChatFormat(load_tokenizer(str(world.model)), world.chat_template.read_text(encoding="utf-8"))
    with atomic_open(world.sample_otlp_log) as handle:
        json.dump(otlp_export(calls, chat), handle, ensure_ascii=False)
    return world.sample_chat_log


def group_chat(calls: list[dict]) -> list[dict]:
    """Chat-log calls as AutoGen / AG2 log a group chat: own replies as `assistant`, others' as named `user`."""
    shaped = []
    for call in calls:
        messages = [
            {"role": "user", "name": m["name"], "content": m["content"]}
            if m["role"] == "assistant" and m.get("name") not in (None, call["agent"])
            else m
            for m in call["messages"]
        ]
        shaped.append(call | {"messages": messages})
    return shaped


def main(world_dir: Annotated[Path | None, typer.Option("--world", help="Demo world folder.")] = None) -> None:
    """Re-capture the sample traces of a demo world."""
    print(json.dumps(build(DemoWorld(world_dir or ASSETS)), indent=1))


if __name__ == "__main__":
    typer.run(main)
