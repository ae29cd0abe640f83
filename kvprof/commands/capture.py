"""`kvprof capture`: run the agents on tasks (or import a shape CSV) and write a trace.

The capture itself lives in `kvprof.capture.runner`; this module parses options, shows progress and writes the result.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvprof.commands.common import (
    DeviceOption,
    DtypeOption,
    OutOption,
    SeedOption,
    console,
    print_adapters,
    print_layers,
    progress,
    write_result,
)
from kvprof.errors import KvprofError
from kvprof.traces.chat import resolve_chat_template, template_sha256
from kvprof.traces.spec import build_spec
from kvprof.traces.trace import TraceHeader, Trajectory, write_trace

if TYPE_CHECKING:
    from kvprof.capture.workflow import Sampling
    from kvprof.model.agents import AgentSet
    from kvprof.traces.tasks import Task


def command(
    model: Annotated[str, typer.Option("--model", help="Base model: a local directory or a hub id.")],
    tasks: Annotated[
        Path | None,
        typer.Option(
            "--tasks",
            help='JSONL tasks, one {"id", "question", "answer"?, "documents"?, "private"?} per line '
            "(private: agent name → text it alone reads after its role prompt).",
        ),
    ] = None,
    agent: Annotated[
        list[str] | None, typer.Option("--agent", help="NAME=ADAPTER_DIR: a LoRA agent (lora mode). Repeat per agent.")
    ] = None,
    role: Annotated[
        list[str] | None,
        typer.Option("--role", help="NAME=PROMPT or NAME=@FILE: a role-prompt agent (prompt mode). Repeat per agent."),
    ] = None,
    workflow: Annotated[
        Path | None,
        typer.Option("--workflow", help="TOML workflow spec (agents, templates, limits); flags override it."),
    ] = None,
    shapes: Annotated[
        Path | None,
        typer.Option(
            "--shapes",
            help="Import a shape-only CSV (agent,prefill_len,decode_len) instead of running agents; "
            "tokens are synthesised from --seed.",
        ),
    ] = None,
    mode: Annotated[
        str | None,
        typer.Option(
            "--mode",
            help="Mode recorded for a --shapes import without agents: lora (default) or prompt; with --workflow, "
            "--agent or --role, the workflow's mode, and the trace records the agents' adapters or role prompts.",
        ),
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="Use only the first N tasks.")] = None,
    max_rounds: Annotated[
        int | None, typer.Option("--max-rounds", help="Most plan/act rounds per task (default: the workflow's, 4).")
    ] = None,
    max_new_tokens: Annotated[
        int | None, typer.Option("--max-new-tokens", help="Most tokens per agent call (default: the workflow's, 32).")
    ] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy; > 0 samples.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass when sampling.")] = 1.0,
    attn: Annotated[str, typer.Option("--attn", help="Attention implementation: sdpa or eager.")] = "sdpa",
    chat_template: Annotated[
        str,
        typer.Option(
            "--chat-template",
            help="Render each agent call as chat messages through a chat template: auto (the workflow's when it sets "
            "one, else the tokenizer's when it has one, else kvprof's own layout), on (the tokenizer's, required), "
            "off (kvprof's layout), or a Jinja template FILE.",
        ),
    ] = "auto",
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue an interrupted capture from OUT/trace.partial.jsonl.")
    ] = False,
    out: OutOption = Path("runs/capture"),
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    seed: SeedOption = 0,
) -> None:
    """Run a multi-agent workflow on tasks and write real trajectories to OUT/trace.jsonl."""
    args = dict(locals())
    from kvprof.capture.runner import capture_spec, checkpoint_path, sampled_trace_header, trajectory_summary
    from kvprof.capture.workflow import Sampling
    from kvprof.model.agents import load_agents, load_tokenizer, tokenizer_identity
    from kvprof.report.capture import trace_table
    from kvprof.traces.shapes import import_shape_csv
    from kvprof.traces.tasks import load_tasks

    trace_path = out / "trace.jsonl"
    if shapes is not None:
        agents_spec = build_spec(workflow, agent, role) if workflow or agent or role else None
        if mode not in (None, "lora", "prompt"):
            raise KvprofError(f"--mode {mode!r} is not lora or prompt; pass one of them.")
        if agents_spec is not None and mode is not None and mode != agents_spec.mode:
            raise KvprofError(
                f"--mode {mode} contradicts the agents, which are in {agents_spec.mode} mode; drop --mode."
            )
        tokenizer = load_tokenizer(model)
        trace = import_shape_csv(
            shapes, tokenizer, tokenizer_identity(tokenizer), model, seed=seed, mode=mode or "lora", spec=agents_spec
        )
        write_trace(trace_path, trace)
        summary = trajectory_summary(trace.trajectories, 0.0)
        console.print(trace_table(summary).to_rich())
        write_result(out, "capture", {"trace": str(trace_path), "summary": summary}, args)
        console.print(f"wrote {trace_path}")
        return
    if tasks is None:
        raise KvprofError("capture needs --tasks FILE (JSONL tasks) or --shapes FILE (a shape CSV).")
    spec = capture_spec(workflow, agent, role, max_rounds, max_new_tokens)
    task_list = load_tasks(tasks, limit)
    agents = load_agents(spec, model, device=device, dtype=dtype, attn=attn)
    if chat_template != "auto" or agents.spec.chat_template is None:  # auto keeps the workflow's own template
        agents.spec.chat_template = resolve_chat_template(chat_template, agents.tokenizer)
    if agents.spec.group_chat and agents.spec.chat_template is None:
        raise KvprofError(
            f"workflow {workflow} lays calls out as a group chat (group_chat = true), which needs a chat template; "
            "pass --chat-template FILE or set chat_template in the workflow."
        )
    if agents.spec.chat_template is not None:
        console.print(f"agent calls rendered through a chat template ({template_sha256(agents.spec.chat_template)})")
    print_adapters(agents)
    print_layers(agents)
    sampling = Sampling(temperature, top_p, seed)
    header = sampled_trace_header(model, agents, sampling)
    resumed = _resumed(checkpoint_path(trace_path), header, task_list) if resume else []
    captured, summary = capture_with_progress(agents, task_list, trace_path, header, sampling, resumed)
    write_result(out, "capture", {"trace": str(trace_path), "summary": summary}, args)
    if summary["accuracy"] is not None:
        console.print(f"exact-match accuracy: {summary['accuracy']:.1%} of {summary['with_answer']} tasks")
    console.print(f"wrote {trace_path} ({len(captured)} trajectories, {summary['seconds']:.1f} s)")


def capture_with_progress(
    agents: AgentSet,
    tasks: list[Task],
    trace_path: Path,
    header: TraceHeader,
    sampling: Sampling,
    resumed: Sequence[Trajectory] = (),
) -> tuple[list[Trajectory], dict]:
    """`capture_trajectories` under a progress bar, timed; prints the trace table. Returns the trajectories and
    their `trajectory_summary`."""
    from kvprof.capture.runner import capture_trajectories, trajectory_summary
    from kvprof.report.capture import trace_table

    started = time.perf_counter()
    with progress() as bar:
        job = bar.add_task("capturing", total=len(tasks), completed=len(resumed))
        captured = capture_trajectories(
            agents,
            tasks,
            trace_path,
            header,
            sampling,
            resumed,
            on_task=lambda task: bar.update(job, description=f"task {task.id}"),
            on_turn=lambda traj, turn: bar.update(job, description=f"task {traj.id}: {turn.agent}"),
            on_trajectory=lambda traj: bar.advance(job),
        )
    summary = trajectory_summary(captured, time.perf_counter() - started)
    console.print(trace_table(summary).to_rich())
    return captured, summary


def _resumed(checkpoint: Path, header: TraceHeader, tasks: list[Task]) -> list[Trajectory]:
    """The trajectories an interrupted capture left in `checkpoint` (none if there is no checkpoint)."""
    from kvprof.capture.runner import resumed_trajectories

    if not checkpoint.exists():
        console.print(f"no checkpoint {checkpoint}: capturing from the first task")
        return []
    trajectories = resumed_trajectories(checkpoint, header, tasks)
    console.print(f"resuming after {len(trajectories)} captured tasks")
    return trajectories
