"""`kvprof demo`: the kvprof pipeline on the embedded demo world, on CPU, in minutes.

The stage table (`QUICK_STAGES`, or `FULL_STAGES` with `--full`) names each stage, its function
(`kvprof.demo.stages`: the library step of the command it stands for, printed and written as that command does) and
its expected time; this module announces each stage (its function's docstring is its description), runs them, and
prints the summary table and the decisions. demo.json records every stage's summary, seconds, numbers and outputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvprof.commands.common import command_args, console, write_result
from kvprof.commands.options import DeviceOption, DtypeOption, OutOption, SeedOption
from kvprof.demo import stages as demo_stages
from kvprof.demo.stages import DemoContext, StageResult
from kvprof.errors import KvprofError
from kvprof.results.base import ResultFile


@dataclass(frozen=True)
class Stage:
    """A demo step: title, function, expected seconds on 2 CPU cores at the full demo's task counts, scaled by `per`
    ("tasks", "replay_tasks", "" for a fixed cost)."""

    name: str
    run: Callable[[DemoContext], StageResult]
    seconds: float
    per: str = ""

    def expected(self, ctx: DemoContext) -> float:
        """Expected seconds at this demo's task counts."""
        if not self.per:
            return self.seconds
        return self.seconds * getattr(ctx, self.per) / DEFAULTS["full"][self.per]


# Task counts per demo: the quick one decides for both families; the full one runs every world and adapter set.
DEFAULTS = {"quick": {"tasks": 12, "replay_tasks": 6}, "full": {"tasks": 20, "replay_tasks": 10}}

QUICK_STAGES = [
    Stage("capture lora, shared-A adapters", demo_stages.capture_lora_shared_a, 8.0, "tasks"),
    Stage("capture prompt", demo_stages.capture_prompt, 6.0, "tasks"),
    Stage("replay lora", demo_stages.replay_lora_defaults, 75.0, "replay_tasks"),
    Stage("prompt-role sharing", demo_stages.prompt_sharing, 60.0, "replay_tasks"),
    Stage("recommend", demo_stages.recommend_families, 5.0),
    Stage("report", demo_stages.report_all, 2.0),
]

FULL_STAGES = [
    Stage("capture prompt", demo_stages.capture_prompt, 9.0, "tasks"),
    Stage("capture lora", demo_stages.capture_lora, 7.0, "tasks"),
    Stage("capture lora, shared-A adapters", demo_stages.capture_lora_shared_a, 7.0, "tasks"),
    Stage("lora, adapters disabled", demo_stages.lora_without_adapters, 7.0, "tasks"),
    Stage("rank-analysis", demo_stages.rank_analysis_lora, 2.0),
    Stage("replay", demo_stages.replay_all, 220.0, "replay_tasks"),
    Stage("capture lora q/v, the papers' setting", demo_stages.capture_lora_qv, 9.0, "tasks"),
    Stage("replay lora q/v", demo_stages.replay_lora_qv, 115.0, "replay_tasks"),
    Stage("capture aLoRA twins", demo_stages.capture_alora, 9.0, "tasks"),
    Stage("capture aLoRA q/v twins", demo_stages.capture_alora_qv, 9.0, "tasks"),
    Stage("aLoRA agents or LoRA agents", demo_stages.alora_sharing, 90.0, "replay_tasks"),
    Stage("prompt-role sharing", demo_stages.prompt_sharing, 77.0, "replay_tasks"),
    Stage("codebook: sharing that costs accuracy", demo_stages.codebook_sharing, 9.0, "replay_tasks"),
    Stage("recommend", demo_stages.recommend_families, 5.0),
    Stage("report", demo_stages.report_all, 3.0),
]


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _announce(index: int, stages: list[Stage], ctx: DemoContext, spent: float, done_expected: float) -> None:
    """Announce a stage, its expected time and what is left, scaled by how this machine has kept to them so far."""
    stage = stages[index]
    pace = spent / done_expected if done_expected > 0 else 1.0
    left = pace * sum(s.expected(ctx) for s in stages[index:])
    console.rule(f"[{index + 1}/{len(stages)}] {stage.name}")
    console.print(
        f"about {_duration(pace * stage.expected(ctx))}; about {_duration(left)} left in all", style="dim", markup=False
    )
    console.print(" ".join((stage.run.__doc__ or "").split()), style="dim", markup=False)


HELP = {
    "full": "Every world and adapter set (captures without adapters, with the papers' q/v adapters and with Activated "
    "LoRA twins, the rank analysis, every variant of every policy, aLoRA agents against LoRA agents, the codebook "
    "world): about 10 minutes on 2 CPU cores.",
    "tasks": "Held-out demo tasks per capture (default 12; 20 with --full).",
    "replay_tasks": "Tasks replayed under every policy (default 6; 10 with --full).",
    "repeats": "Timed repeats of each replayed prefill (after a warm-up); TTFT is the median.",
    "world": "A demo world folder written by `python -m kvprof.demo.train` (default: the shipped one).",
}


def command(
    full: Annotated[bool, typer.Option("--full", help=HELP["full"])] = False,
    tasks: Annotated[int | None, typer.Option("--tasks", help=HELP["tasks"])] = None,
    replay_tasks: Annotated[int | None, typer.Option("--replay-tasks", help=HELP["replay_tasks"])] = None,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help=HELP["repeats"])] = 2,
    world: Annotated[Path | None, typer.Option("--world", help=HELP["world"])] = None,
    out: OutOption = Path("runs/demo"),
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "auto",
    seed: SeedOption = 0,
) -> None:
    """Run kvprof on the embedded demo world (trained model, role prompts, LoRA adapters): the sharing decision for
    both agent families in about three minutes on 2 CPU cores, or every stage with --full."""
    args = dict(locals())
    from kvprof.demo.assets import demo_world

    defaults = DEFAULTS["full" if full else "quick"]
    tasks = defaults["tasks"] if tasks is None else tasks
    replay_tasks = defaults["replay_tasks"] if replay_tasks is None else replay_tasks
    if tasks < 1 or replay_tasks < 1:
        raise KvprofError(f"--tasks {tasks} / --replay-tasks {replay_tasks}: pass 1 or more tasks to each.")
    ctx = DemoContext(
        world=demo_world(world),
        out=out,
        tasks=tasks,
        device=device,
        dtype=dtype,
        seed=seed,
        replay_tasks=min(replay_tasks, tasks),
        repeats=repeats,
        writer=_write_as_command,
    )
    stages = FULL_STAGES if full else QUICK_STAGES
    expected = sum(stage.expected(ctx) for stage in stages)
    console.print(f"demo world: {ctx.world.root}")
    console.print(
        f"kvprof demo{' --full' if full else ''}: {len(stages)} stages, about {_duration(expected)} on 2 CPU cores"
        + ("" if full else " (every stage: kvprof demo --full)"),
        markup=False,
    )
    started = time.perf_counter()
    results = _run_stages(stages, ctx)
    total = time.perf_counter() - started
    _print_summary(f"kvprof demo{' --full' if full else ''} ({total:.0f} s)", results)
    path = write_result(
        out,
        "demo",
        {"world": str(ctx.world.root), "full": full, "stages": results, "seconds": round(total, 1)},
        args | {"tasks": tasks, "replay_tasks": replay_tasks},
    )
    console.print(f"wrote {path}")


def _write_as_command(out: Path, kind: str, payload: dict | ResultFile, command: str, options: dict) -> Path:
    """OUT/<kind>.json as `kvprof COMMAND` with `options` writes it (`DemoContext.writer`)."""
    return write_result(out, kind, payload, command_args(command, **options))


def _run_stages(stages: list[Stage], ctx: DemoContext) -> dict[str, dict]:
    """Run the stages in order; per stage what demo.json records (summary, seconds, numbers, outputs)."""
    results: dict[str, dict] = {}
    started = time.perf_counter()
    done_expected = 0.0
    for index, stage in enumerate(stages):
        _announce(index, stages, ctx, time.perf_counter() - started, done_expected)
        stage_started = time.perf_counter()
        result = stage.run(ctx)
        seconds = time.perf_counter() - stage_started
        done_expected += stage.expected(ctx)
        results[stage.name] = {
            "summary": result.summary,
            "seconds": round(seconds, 1),
            **result.metrics,
            "outputs": [str(p) for p in result.outputs],
        }
    return results


def _print_summary(title: str, results: dict[str, dict]) -> None:
    """The stage table, then the report's decision cards (the answer last, where the terminal stops)."""
    table = Table(title=title)
    for column in ("stage", "result", "seconds", "outputs"):
        table.add_column(column, justify="right" if column == "seconds" else "left")
    for name, result in results.items():
        table.add_row(name, result["summary"], f"{result['seconds']:.1f}", "\n".join(result["outputs"]))
    console.print(table)
    for heading, card in results["report"]["decisions"].items():
        console.rule(heading)
        for line in card:
            console.print(line, style="bold", markup=False)
    console.rule("Recommendation for the demo's target, across agent families")
    for line in results["recommend"]["recommendation"]:
        console.print(line, style="bold", markup=False)
