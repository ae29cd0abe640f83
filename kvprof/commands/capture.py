"""`kvprof capture`: run the agents on tasks (or import a shape CSV) and write a trace (`kvprof.capture.runner`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvprof.commands.common import console, use_threads, write_result
from kvprof.commands.options import DeviceOption, DtypeOption, OutOption, SeedOption, ThreadsOption
from kvprof.errors import KvprofError
from kvprof.results.capture import CaptureResult, CaptureSummary
from kvprof.traces.chat import template_sha256
from kvprof.traces.spec import build_spec
from kvprof.traces.trace import write_trace

if TYPE_CHECKING:
    from kvprof.traces.tasks import Task
    from kvprof.traces.trace import TraceHeader, Trajectory

HELP = {
    "tasks": 'JSONL tasks, one {"id", "question", "answer"?, "documents"?, "private"?} per line (private: agent name '
    "→ text it alone reads after its role prompt).",
    "role": "NAME=PROMPT or NAME=@FILE: a role-prompt agent (prompt mode). Repeat per agent.",
    "shapes": "Import a shape-only CSV (agent,prefill_len,decode_len) instead of running agents; tokens are "
    "synthesised from --seed.",
    "mode": "Mode recorded for a --shapes import without agents: lora (default) or prompt; with --workflow, --agent or "
    "--role, the workflow's mode, and the trace records the agents' adapters or role prompts.",
    "max_rounds": "Most plan/act rounds per task (default: the workflow's, 4).",
    "max_new_tokens": "Most tokens per agent call (default: the workflow's, 32).",
    "chat_template": "Render each agent call as chat messages through a chat template: auto (the workflow's when it "
    "sets one, else the tokenizer's when it has one, else kvprof's own layout), on (the tokenizer's, required), off "
    "(kvprof's layout), or a Jinja template FILE.",
}


def command(
    model: Annotated[str, typer.Option("--model", help="Base model: a local directory or a hub id.")],
    tasks: Annotated[Path | None, typer.Option("--tasks", help=HELP["tasks"])] = None,
    agent: Annotated[
        list[str] | None, typer.Option("--agent", help="NAME=ADAPTER_DIR: a LoRA agent (lora mode). Repeat per agent.")
    ] = None,
    role: Annotated[list[str] | None, typer.Option("--role", help=HELP["role"])] = None,
    workflow: Annotated[
        Path | None,
        typer.Option("--workflow", help="TOML workflow spec (agents, templates, limits); flags override it."),
    ] = None,
    shapes: Annotated[Path | None, typer.Option("--shapes", help=HELP["shapes"])] = None,
    mode: Annotated[str | None, typer.Option("--mode", help=HELP["mode"])] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="Use only the first N tasks.")] = None,
    max_rounds: Annotated[int | None, typer.Option("--max-rounds", help=HELP["max_rounds"])] = None,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens", help=HELP["max_new_tokens"])] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy; > 0 samples.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass when sampling.")] = 1.0,
    attn: Annotated[str, typer.Option("--attn", help="Attention implementation: sdpa or eager.")] = "sdpa",
    chat_template: Annotated[str, typer.Option("--chat-template", help=HELP["chat_template"])] = "auto",
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue an interrupted capture from OUT/trace.partial.jsonl.")
    ] = False,
    out: OutOption = Path("runs/capture"),
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    threads: ThreadsOption = None,
    seed: SeedOption = 0,
) -> None:
    """Run a multi-agent workflow on tasks and write real trajectories to OUT/trace.jsonl."""
    args = dict(locals())
    use_threads(threads)
    from kvprof.capture.runner import checkpoint_path, prepare_capture
    from kvprof.capture.workflow import Sampling
    from kvprof.report.terminal import capture_with_progress, print_adapters, print_layers, show_capture

    trace_path = out / "trace.jsonl"
    if shapes is not None:
        summary = import_shapes(shapes, trace_path, model, workflow, agent, role, mode, seed)
        write_result(out, "capture", CaptureResult(trace=str(trace_path), summary=summary), args)
        console.print(f"wrote {trace_path}")
        return
    if tasks is None:
        raise KvprofError("capture needs --tasks FILE (JSONL tasks) or --shapes FILE (a shape CSV).")
    setup = prepare_capture(
        model, workflow, tasks, limit, Sampling(temperature, top_p, seed),
        agent_flags=agent, role_flags=role, max_rounds=max_rounds, max_new_tokens=max_new_tokens,
        chat_template=chat_template, device=device, dtype=dtype, attn=attn,
    )  # fmt: skip
    agents = setup.agents
    if agents.spec.chat_template is not None:
        console.print(f"agent calls rendered through a chat template ({template_sha256(agents.spec.chat_template)})")
    print_adapters(agents)
    print_layers(agents)
    resumed = _resumed(checkpoint_path(trace_path), setup.header, setup.tasks) if resume else []
    captured, summary = capture_with_progress(setup, trace_path, resumed)
    write_result(out, "capture", CaptureResult(trace=str(trace_path), summary=summary), args)
    show_capture(summary, trace_path, len(captured))


def import_shapes(
    shapes: Path,
    trace_path: Path,
    model: str,
    workflow: Path | None,
    agent: list[str] | None,
    role: list[str] | None,
    mode: str | None,
    seed: int,
) -> CaptureSummary:
    """--shapes: import a shape CSV as the trace at `trace_path`, print its table; returns its summary."""
    from kvprof.capture.runner import trajectory_summary
    from kvprof.model.agents import load_tokenizer, tokenizer_identity
    from kvprof.report.capture import trace_table
    from kvprof.traces.shapes import import_shape_csv

    agents_spec = build_spec(workflow, agent, role) if workflow or agent or role else None
    if mode not in (None, "lora", "prompt"):
        raise KvprofError(f"--mode {mode!r} is not lora or prompt; pass one of them.")
    if agents_spec is not None and mode is not None and mode != agents_spec.mode:
        raise KvprofError(f"--mode {mode} contradicts the agents, which are in {agents_spec.mode} mode; drop --mode.")
    tokenizer = load_tokenizer(model)
    trace = import_shape_csv(
        shapes, tokenizer, tokenizer_identity(tokenizer), model, seed=seed, mode=mode or "lora", spec=agents_spec
    )
    write_trace(trace_path, trace)
    summary = trajectory_summary(trace.trajectories, 0.0)
    console.print(trace_table(summary).to_rich())
    return summary


def _resumed(checkpoint: Path, header: TraceHeader, tasks: list[Task]) -> list[Trajectory]:
    """The trajectories an interrupted capture left in `checkpoint` (none if there is no checkpoint)."""
    from kvprof.capture.runner import resumed_trajectories

    if not checkpoint.exists():
        console.print(f"no checkpoint {checkpoint}: capturing from the first task")
        return []
    trajectories = resumed_trajectories(checkpoint, header, tasks)
    console.print(f"resuming after {len(trajectories)} captured tasks")
    return trajectories
