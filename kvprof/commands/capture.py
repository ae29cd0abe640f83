"""`kvprof capture`: run the agents on tasks (or import a shape CSV) and write a trace."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from kvprof.commands.common import (DeviceOption, DtypeOption, OutOption, SeedOption, console, progress,
                                    write_result)
from kvprof.errors import KvprofError
from kvprof.model import AgentSet, load_agents, load_tokenizer, tokenizer_identity
from kvprof.shapes import import_shape_csv
from kvprof.spec import build_spec, check_react_roles
from kvprof.trace import (PartialTrace, TraceHeader, TraceWriter, Trajectory, header_record, read_partial_trace,
                          shared_segment_ids, write_trace)
from kvprof.workflow import Sampling, SearchTool, exact_match, load_tasks, model_responder, run_react


def command(
    model: Annotated[str, typer.Option("--model", help="Base model: a local directory or a hub id.")],
    tasks: Annotated[Optional[Path], typer.Option(
        "--tasks", help='JSONL tasks, one {"id", "question", "answer"?, "documents"?} per line.')] = None,
    agent: Annotated[Optional[list[str]], typer.Option(
        "--agent", help="NAME=ADAPTER_DIR: a LoRA agent (lora mode). Repeat per agent.")] = None,
    role: Annotated[Optional[list[str]], typer.Option(
        "--role", help="NAME=PROMPT or NAME=@FILE: a role-prompt agent (prompt mode). Repeat per agent.")] = None,
    workflow: Annotated[Optional[Path], typer.Option(
        "--workflow", help="TOML workflow spec (agents, templates, limits); flags override it.")] = None,
    shapes: Annotated[Optional[Path], typer.Option(
        "--shapes", help="Import a shape-only CSV (agent,prefill_len,decode_len) instead of running agents; "
                         "tokens are synthesised from --seed.")] = None,
    mode: Annotated[str, typer.Option("--mode", help="Mode recorded for a --shapes import: lora or prompt.")] = "lora",
    limit: Annotated[Optional[int], typer.Option("--limit", help="Use only the first N tasks.")] = None,
    max_rounds: Annotated[Optional[int], typer.Option(
        "--max-rounds", help="Most plan/act rounds per task (default: the workflow's, 4).")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(
        "--max-new-tokens", help="Most tokens per agent call (default: the workflow's, 32).")] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy; > 0 samples.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass when sampling.")] = 1.0,
    attn: Annotated[str, typer.Option("--attn", help="Attention implementation: sdpa or eager.")] = "sdpa",
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue an interrupted capture from OUT/trace.partial.jsonl.")] = False,
    out: OutOption = Path("runs/capture"),
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    seed: SeedOption = 0,
) -> None:
    """Run a multi-agent workflow on tasks and write real trajectories to OUT/trace.jsonl."""
    args = dict(locals())
    trace_path = out / "trace.jsonl"
    if shapes is not None:
        if mode not in ("lora", "prompt"):
            raise KvprofError(f"--mode {mode!r} is not lora or prompt; pass one of them.")
        tokenizer = load_tokenizer(model)
        trace = import_shape_csv(shapes, tokenizer, tokenizer_identity(tokenizer), model, seed=seed, mode=mode)
        write_trace(trace_path, trace)
        _render(trace.trajectories)
        write_result(out, "capture", {"trace": str(trace_path),
                                      "summary": trajectory_summary(trace.trajectories, 0.0)}, args)
        console.print(f"wrote {trace_path}")
        return
    if tasks is None:
        raise KvprofError("capture needs --tasks FILE (JSONL tasks) or --shapes FILE (a shape CSV).")
    spec = build_spec(workflow, agent, role)
    if max_rounds is not None:
        spec.max_rounds = max_rounds
    if max_new_tokens is not None:
        spec.max_new_tokens = max_new_tokens
    check_react_roles(spec)
    task_list = load_tasks(tasks, limit)
    agents = load_agents(spec, model, device=device, dtype=dtype, attn=attn)
    for name, info in agents.adapters.items():
        console.print(f"agent [bold]{name}[/]: adapter {info.path} ({info.describe()}, {info.layers} layers)")
    header = trace_header(model, agents, extra={"sampling": {"temperature": temperature, "top_p": top_p,
                                                             "seed": seed}})
    checkpoint = out / "trace.partial.jsonl"
    captured = _resumed(checkpoint, header, task_list) if resume else []
    tool = SearchTool()
    started = time.perf_counter()
    with PartialTrace(checkpoint, header, append=bool(captured)) as partial, \
            TraceWriter(trace_path, header) as writer, progress() as bar:
        job = bar.add_task("capturing", total=len(task_list), completed=len(captured))
        for traj in captured:
            writer.write(traj)
        for index, task in enumerate(task_list[len(captured):], start=len(captured)):
            bar.update(job, description=f"task {task.id}")
            respond = model_responder(agents, Sampling(temperature, top_p, seed + index))
            traj = run_react(spec, agents.tokenizer, task, tool, respond,
                             on_turn=lambda t, turn: bar.update(job, description=f"task {t.id}: {turn.agent}"))
            writer.write(traj)
            partial.write(traj)
            captured.append(traj)
            bar.advance(job)
    checkpoint.unlink()
    elapsed = time.perf_counter() - started
    _render(captured)
    summary = trajectory_summary(captured, elapsed)
    write_result(out, "capture", {"trace": str(trace_path), "summary": summary}, args)
    if summary["accuracy"] is not None:
        console.print(f"exact-match accuracy: {summary['accuracy']:.1%} of {summary['with_answer']} tasks")
    console.print(f"wrote {trace_path} ({len(captured)} trajectories, {elapsed:.1f} s)")


def _resumed(checkpoint: Path, header: TraceHeader, tasks: list) -> list[Trajectory]:
    """The trajectories an interrupted capture with the same header left in `checkpoint` (none if it is absent);
    refuses a checkpoint of another model, workflow, sampling or task list."""
    if not checkpoint.exists():
        console.print(f"no checkpoint {checkpoint}: capturing from the first task")
        return []
    partial = read_partial_trace(checkpoint)
    if header_record(partial.header) != json.loads(json.dumps(header_record(header))):
        raise KvprofError(f"checkpoint {checkpoint} was captured with another model, tokenizer, workflow or sampling; "
                          f"rerun with the options it was captured with, or delete it to start again.")
    ids = [traj.id for traj in partial.trajectories]
    if ids != [task.id for task in tasks[:len(ids)]]:
        raise KvprofError(f"checkpoint {checkpoint} holds tasks {', '.join(ids[:3])}… that are not the first tasks "
                          f"of --tasks; pass the --tasks and --limit it was captured with, or delete it.")
    console.print(f"resuming after {len(ids)} captured tasks")
    return partial.trajectories


def trace_header(model: str, agents: AgentSet, **fields) -> TraceHeader:
    """The header of a trace captured from `agents` (loaded from `model`); `fields`: other TraceHeader fields."""
    return TraceHeader(model={"path": model, "dtype": str(agents.base_model.dtype).removeprefix("torch."),
                              "architecture": agents.config.architectures[0] if agents.config.architectures else ""},
                       tokenizer=tokenizer_identity(agents.tokenizer), workflow=agents.spec.to_dict(), **fields)


def trajectory_summary(trajectories: list[Trajectory], elapsed: float) -> dict:
    with_answer = [t for t in trajectories if t.answer is not None]
    correct = sum(exact_match(t.prediction, t.answer) for t in with_answer)
    per_agent: dict[str, dict] = defaultdict(lambda: {"turns": 0, "input_tokens": 0, "output_tokens": 0})
    shared_tokens = total_tokens = 0
    for traj in trajectories:
        shared = shared_segment_ids(traj)
        shared_tokens += sum(len(traj.segments[s]) for s in shared)
        total_tokens += traj.num_tokens
        for turn in traj.turns:
            stats = per_agent[turn.agent]
            stats["turns"] += 1
            stats["input_tokens"] += len(traj.input_tokens(turn))
            stats["output_tokens"] += len(traj.segments[turn.output])
    return {"trajectories": len(trajectories), "turns": sum(s["turns"] for s in per_agent.values()),
            "distinct_tokens": total_tokens, "shared_tokens": shared_tokens, "with_answer": len(with_answer),
            "accuracy": correct / len(with_answer) if with_answer else None, "seconds": round(elapsed, 3),
            "agents": dict(per_agent)}


def _render(trajectories: list[Trajectory]) -> None:
    summary = trajectory_summary(trajectories, 0.0)
    table = Table(title=f"trace: {summary['trajectories']} trajectories, {summary['distinct_tokens']} distinct tokens "
                        f"({summary['shared_tokens']} in segments read by several agents)")
    for column in ("agent", "turns", "mean input tokens", "mean output tokens"):
        table.add_column(column, justify="right" if column != "agent" else "left")
    for name, stats in summary["agents"].items():
        table.add_row(name, str(stats["turns"]), f"{stats['input_tokens'] / stats['turns']:.1f}",
                      f"{stats['output_tokens'] / stats['turns']:.1f}")
    console.print(table)

