"""`kvprof demo`: the kvprof pipeline on the embedded demo world, on CPU, in minutes.

The demo is a list of stages; each is one function `(DemoContext) -> StageResult` appended to `STAGES`. A stage
reads what earlier stages left in the context (e.g. `ctx.traces["lora"]`) and writes its files under `ctx.out`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich.table import Table

from kvprof.commands import capture, rank_analysis, replay, report
from kvprof.commands.common import (DeviceOption, DtypeOption, OutOption, SeedOption, console, progress,
                                    write_result)
from kvprof.commands.capture import trace_header
from kvprof.demo.assets import DemoWorld, demo_world
from kvprof.demo.evaluate import load_condition, run_tasks
from kvprof.demo.world import read_tasks
from kvprof.errors import KvprofError
from kvprof.trace import Trace, write_trace
from kvprof.workflow import exact_match


@dataclass
class DemoContext:
    """What every stage gets: the world, the options, and what earlier stages produced."""

    world: DemoWorld
    out: Path
    tasks: int
    device: str
    dtype: str
    seed: int
    replay_tasks: int
    repeats: int
    traces: dict[str, Path] = field(default_factory=dict)
    results: list[Path] = field(default_factory=list)


@dataclass
class StageResult:
    """One row of the summary table, plus the stage's numbers for demo.json."""

    summary: str
    outputs: list[Path]
    metrics: dict = field(default_factory=dict)


def _capture(ctx: DemoContext, mode: str) -> StageResult:
    out = ctx.out / f"capture_{mode}"
    capture.command(model=str(ctx.world.model), tasks=ctx.world.heldout_tasks, workflow=ctx.world.workflow(mode),
                    limit=ctx.tasks, out=out, device=ctx.device, dtype=ctx.dtype, seed=ctx.seed)
    ctx.traces[mode] = out / "trace.jsonl"
    ctx.results.append(out / "capture.json")
    summary = json.loads((out / "capture.json").read_text(encoding="utf-8"))["summary"]
    return StageResult(f"exact match {summary['accuracy']:.1%} on {summary['with_answer']} tasks, "
                       f"{summary['distinct_tokens']} tokens", [ctx.traces[mode], out / "capture.json"],
                       {"accuracy": summary["accuracy"], "tasks": summary["with_answer"],
                        "tokens": summary["distinct_tokens"], "turns": summary["turns"]})


def capture_prompt(ctx: DemoContext) -> StageResult:
    """`kvprof capture` in prompt mode: agents differ by role prompt."""
    return _capture(ctx, "prompt")


def capture_lora(ctx: DemoContext) -> StageResult:
    """`kvprof capture` in lora mode: agents differ by LoRA adapter under one neutral prompt."""
    return _capture(ctx, "lora")


def lora_without_adapters(ctx: DemoContext) -> StageResult:
    """The lora workflow run by the base model with every adapter disabled: what the adapters are worth."""
    agents = load_condition(ctx.world, "lora_disabled", ctx.device, ctx.dtype)
    tasks = read_tasks(ctx.world.heldout_tasks)[:ctx.tasks]
    path = ctx.out / "lora_no_adapters" / "trace.jsonl"
    with progress() as bar:
        job = bar.add_task("lora, adapters disabled", total=len(tasks))
        trajectories = run_tasks(agents, "lora_disabled", tasks, lambda: bar.advance(job))
    write_trace(path, Trace(trace_header(str(ctx.world.model), agents, extra={"adapters": "disabled"}),
                            trajectories))
    ctx.traces["lora_no_adapters"] = path
    correct = sum(exact_match(traj.prediction, traj.answer) for traj in trajectories)
    tokens = sum(traj.num_tokens for traj in trajectories)
    return StageResult(f"exact match {correct / len(tasks):.1%} on {len(tasks)} tasks, {tokens} tokens", [path],
                       {"accuracy": correct / len(tasks), "tasks": len(tasks), "tokens": tokens})


def capture_lora_shared_a(ctx: DemoContext) -> StageResult:
    """`kvprof capture` in lora mode with the shared-A adapter set (one A per projection, only B differs): the
    agents every policy can replay, BaseLRShared included."""
    return _capture(ctx, "lora_shared_a")


def rank_analysis_lora(ctx: DemoContext) -> StageResult:
    """`kvprof rank-analysis` of the lora trace: effective rank and cross-agent similarity, per layer, with a
    verdict per published claim."""
    out = ctx.out / "rank_analysis"
    rank_analysis.command(trace=ctx.traces["lora"], limit=min(ctx.tasks, 4), out=out, device=ctx.device,
                          dtype=ctx.dtype, seed=ctx.seed)
    record = json.loads((out / "rank_analysis.json").read_text(encoding="utf-8"))
    ctx.results.append(out / "rank_analysis.json")
    holds = sum(claim["holds"] is True for claim in record["claims"])
    return StageResult(f"{holds} of {len(record['claims'])} published claims hold on this world",
                       [out / "rank_analysis.json", out / "rank_analysis.html"],
                       {"claims": {claim["statement"]: claim["holds"] for claim in record["claims"]}})


def replay_all(ctx: DemoContext) -> StageResult:
    """`kvprof replay --policy all --online` of the shared-A trace: teacher-forced error, fidelity and cost of
    every policy against the dense run, then task accuracy with each policy generating."""
    out = ctx.out / "replay"
    replay.command(trace=ctx.traces["lora_shared_a"], policy=["all"], online=True, repeats=ctx.repeats,
                   limit=ctx.replay_tasks, out=out, device=ctx.device, dtype=ctx.dtype, seed=ctx.seed)
    record = json.loads((out / "replay.json").read_text(encoding="utf-8"))
    ctx.results.append(out / "replay.json")
    online = {name: row["accuracy"] for name, row in record["online"].items()}
    accuracy = ", ".join(f"{name} {value:.0%}" for name, value in online.items())
    return StageResult(f"{len(record['policies'])} policies on {ctx.replay_tasks} tasks; online accuracy: "
                       f"{accuracy}", [out / "replay.json", out / "replay.html"], {"online_accuracy": online})


def report_all(ctx: DemoContext) -> StageResult:
    """`kvprof report` over every result file the demo wrote: one HTML dashboard."""
    path = ctx.out / "report.html"
    report.command(results=ctx.results, out=path)
    return StageResult(f"{len(ctx.results)} result files merged", [path])


STAGES: list[tuple[str, Callable[[DemoContext], StageResult]]] = [
    ("capture prompt", capture_prompt),
    ("capture lora", capture_lora),
    ("capture lora, shared-A adapters", capture_lora_shared_a),
    ("lora, adapters disabled", lora_without_adapters),
    ("rank-analysis", rank_analysis_lora),
    ("replay", replay_all),
    ("report", report_all),
]


def command(
    tasks: Annotated[int, typer.Option("--tasks", help="Held-out demo tasks per capture.")] = 20,
    replay_tasks: Annotated[int, typer.Option("--replay-tasks", help="Tasks replayed under every policy.")] = 10,
    repeats: Annotated[int, typer.Option(
        "--repeats", min=1, help="Timed repeats of each replayed prefill (after a warm-up); TTFT is the median.")] = 2,
    world: Annotated[Optional[Path], typer.Option(
        "--world", help="A demo world folder written by `python -m kvprof.demo.train` (default: the shipped one).")
    ] = None,
    out: OutOption = Path("runs/demo"),
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "auto",
    seed: SeedOption = 0,
) -> None:
    """Run kvprof on the embedded demo world (trained model, role prompts, LoRA adapters) and summarise."""
    args = dict(locals())
    if tasks < 1 or replay_tasks < 1:
        raise KvprofError(f"--tasks {tasks} / --replay-tasks {replay_tasks}: pass 1 or more tasks to each.")
    ctx = DemoContext(world=demo_world(world), out=out, tasks=tasks, device=device, dtype=dtype, seed=seed,
                      replay_tasks=min(replay_tasks, tasks), repeats=repeats)
    console.print(f"demo world: {ctx.world.root}")
    results: dict[str, dict] = {}
    rows = []
    started = time.perf_counter()
    for name, stage in STAGES:
        console.rule(name)
        stage_started = time.perf_counter()
        result = stage(ctx)
        seconds = time.perf_counter() - stage_started
        results[name] = {"summary": result.summary, "seconds": round(seconds, 1), **result.metrics,
                         "outputs": [str(p) for p in result.outputs]}
        rows.append((name, result.summary, seconds, result.outputs))
    total = time.perf_counter() - started
    table = Table(title=f"kvprof demo ({total:.0f} s)")
    for column in ("stage", "result", "seconds", "outputs"):
        table.add_column(column, justify="right" if column == "seconds" else "left")
    for name, summary, seconds, outputs in rows:
        table.add_row(name, summary, f"{seconds:.1f}", "\n".join(str(p) for p in outputs))
    console.print(table)
    path = write_result(out, "demo", {"world": str(ctx.world.root), "stages": results, "seconds": round(total, 1)},
                        args)
    console.print(f"wrote {path}")
