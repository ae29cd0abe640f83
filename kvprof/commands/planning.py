"""The plan before a model-running command (replay, fit-anchors, tune-tau): `--plan` measures it on the model's
first layers (`kvprof.planning.plan`), writes OUT/plan.json and stops; a run whose OUT holds the plan of the same
command line shows it first and refuses to start where it would not fit in the memory free now."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, NamedTuple

import typer

from kvprof.commands.common import console, write_result
from kvprof.errors import KvprofError

PlanOption = Annotated[
    bool,
    typer.Option(
        "--plan",
        help="Print what the run will hold (weights, each run's stored caches at their peak, a turn's working set) "
        "and how long it will take — measured on the model's first layers (about 3/L of the run), extrapolated to "
        "all L — write OUT/plan.json and exit; refused where the peak exceeds the free memory. A later run into "
        "the same OUT shows the plan first and checks it against the memory free then.",
    ),
]
KvBudgetOption = Annotated[
    str | None,
    typer.Option(
        "--kv-budget",
        help="Hold the runs' stored caches within this size (e.g. 8GiB): the caches of runs not running move to a "
        "file (CPU) or to host memory (GPU) and come back when read; same numbers, the moves timed apart from TTFT.",
    ),
]
LEFT_OUT = ("out", "plan", "resume")  # options a plan's probes and its matching run do not share
PLAN_FILE = "plan.json"


def _option_value(value: object) -> str:
    return str(value.value) if isinstance(value, enum.Enum) else str(value)


def arguments_of(name: str, args: dict) -> list[str]:
    """The command line of `kvprof NAME` with parameter values `args` (a command's `locals()`), without --out,
    --plan and --resume: options left at their defaults left out, in the command's order."""
    from typer.main import get_command

    from kvprof.cli import app

    command = get_command(app).commands[name]  # type: ignore[attr-defined]
    line: list[str] = []
    for parameter in command.params:
        value = args.get(parameter.name)
        if parameter.name in LEFT_OUT or value is None or value == parameter.default:
            continue
        if parameter.param_type_name == "argument":
            line.append(_option_value(value))
        elif getattr(parameter, "is_flag", False) and isinstance(value, bool):
            line.append(parameter.opts[0] if value else parameter.secondary_opts[0])
        else:
            values = value if isinstance(value, (list, tuple)) else [value]
            line += [part for item in values for part in (parameter.opts[0], _option_value(item))]
    return line


class Planned(NamedTuple):
    """What `plan_first` decided: whether the command stops (it planned), and --kv-budget in bytes."""

    stop: bool
    kv_budget: int | None


def plan_first(name: str, args: dict, trace: Path, model: str | None) -> Planned:
    """`kvprof NAME`'s plan on `trace` and its model (`model`, else the trace's), from the command's `args`: with
    --plan, plan it (its --kv-budget scaled to each probe's layers), write OUT/plan.json, show it, refuse if it does
    not fit, and stop. Else show OUT/plan.json if it plans this command line, and refuse if its peak exceeds the
    memory free now. --plan and --kv-budget measure and hold one process's memory: refused with --ray."""
    import torch

    from kvprof.model.agents import load_model_config, trace_header
    from kvprof.model.first_layers import text_config
    from kvprof.planning.memory import parse_size
    from kvprof.planning.plan import make_plan, require_budget_floor, require_fit, with_free_memory
    from kvprof.report.plan import plan_lines
    from kvprof.results.plan import PlanResult

    kv_budget = parse_size(args["kv_budget"], "--kv-budget") if args.get("kv_budget") is not None else None
    if args.get("ray"):
        if args.get("plan") or kv_budget is not None:
            raise KvprofError("--plan and --kv-budget measure and hold one process's memory; run them without --ray.")
        return Planned(False, None)
    out, device, what = Path(args["out"]), str(args["device"]), f"kvprof {name}"
    planned = out / PLAN_FILE
    if not args.get("plan") and not planned.exists():  # nothing to plan or show: the model config is not read
        return Planned(False, kv_budget)
    config = load_model_config(model or trace_header(trace).model.get("path") or "")
    total = int(text_config(config).num_hidden_layers)

    def arguments(layers: int) -> list[str]:
        scaled = {} if kv_budget is None else {"kv_budget": str(kv_budget * layers // total)}
        return arguments_of(name, args | scaled)

    if args.get("plan"):
        plan = make_plan(
            name,
            arguments,
            config,
            device,
            kv_budget,
            on_probe=lambda layers: console.print(f"planning: {what} on the model's first {layers} layers"),
            threads=torch.get_num_threads(),  # as this command chose them (`use_threads`)
        )
        for line in plan_lines(plan):
            console.print(line, markup=False)
        console.print(f"wrote {write_result(out, 'plan', plan, args)}")
        require_budget_floor(plan)
        require_fit(plan, what)
        return Planned(True, kv_budget)
    plan = PlanResult.read(planned)
    if plan.command == name and plan.arguments == arguments(total):
        plan = with_free_memory(plan, device)
        for line in plan_lines(plan):
            console.print(line, markup=False)
        require_budget_floor(plan)
        require_fit(plan, what)
    return Planned(False, kv_budget)
