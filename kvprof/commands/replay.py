"""`kvprof replay`: a trace under one sharing policy or all of them, against the dense run."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvprof.commands.common import (DeviceOption, DtypeOption, OutOption, SeedOption, console, demo_trace,
                                    progress, write_result)
from kvprof.errors import KvprofError
from kvprof.fileio import write_json
from kvprof.model import load_agents_for_trace
from kvprof.policies import REGISTRY, policy_class
from kvprof.profiling import gpu_memory
from kvprof.replay import PolicyChoice, ReplayProgress, replay_trace, run_online, summarise_online
from kvprof.report import write_html
from kvprof.report.replay import cost_table, fidelity_table, sections
from kvprof.runtime import Runtime
from kvprof.trace import iter_trajectories
from kvprof.workflow import task_of


def choose_policies(policy: list[str], schedule: str | None, lr_prefill: str | None,
                    runtime: Runtime) -> tuple[list[PolicyChoice], dict[str, str]]:
    """Policy names and knobs → the variants to replay; with `all`, those this setup cannot run are skipped."""
    names = list(REGISTRY) if "all" in [p.lower() for p in policy] else [policy_class(p).name for p in policy]
    choices, skipped = [], {}
    for name in dict.fromkeys(names):
        cls = REGISTRY[name]
        options: list[dict[str, str]] = [{}]
        if "schedule" in cls.options:
            options = [{"schedule": s} for s in ([schedule] if schedule else
                                                  (cls.options["schedule"] if "all" in policy else ["lp"]))]
        if "lr_prefill" in cls.options and lr_prefill:
            options = [{"lr_prefill": lr_prefill}]
        for option in options:
            try:
                cls(runtime, **option)
            except KvprofError as err:
                if "all" not in policy:
                    raise
                skipped[name] = str(err)
                break
            choices.append(PolicyChoice(name, option))
    if "nonshared" in [c.name for c in choices] and len(choices) > 1:
        choices = [c for c in choices if c.name != "nonshared"] + [c for c in choices if c.name == "nonshared"]
    return choices, skipped


def command(
    trace: Annotated[Optional[Path], typer.Argument(
        help="Trace (JSONL) from `kvprof capture` [default: the demo world's sample trace].")] = None,
    policy: Annotated[list[str], typer.Option(
        "--policy", help=f"Policy to replay, repeatable, or 'all': {', '.join(REGISTRY)}.")] = ["all"],
    schedule: Annotated[Optional[str], typer.Option(
        "--schedule", help="ReBaseShared schedule: lp (lazy prefill) or db (double batching) [default: lp; both "
                           "with --policy all].")] = None,
    lr_prefill: Annotated[Optional[str], typer.Option(
        "--lr-prefill", help="BaseShared LR prefill: full (published) or incremental.")] = None,
    online: Annotated[bool, typer.Option(
        "--online", help="Also re-run the workflow under each policy (agents generate; errors propagate): "
                         "exact-match accuracy and output divergence.")] = False,
    lora_attention: Annotated[str, typer.Option(
        "--lora-attention", help="How low-rank policies attend: kernel (Flash-LoRA-Attention: Triton on CUDA, its "
                                 "torch reference on CPU), expand (V_base + V_lr·B, then sdpa) or auto (kernel on "
                                 "CUDA, expand on CPU).")] = "auto",
    repeats: Annotated[int, typer.Option(
        "--repeats", min=1, help="Timed repeats of each turn's prefill (after one warm-up); TTFT is the median.")] = 3,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Replay only the first N trajectories.")] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue an interrupted replay from OUT/replay.partial.json.")] = False,
    model: Annotated[Optional[str], typer.Option("--model", help="Override the trace's base model.")] = None,
    agent: Annotated[Optional[list[str]], typer.Option(
        "--agent", help="NAME=ADAPTER_DIR: override an agent's adapter (e.g. a shared-A set).")] = None,
    role: Annotated[Optional[list[str]], typer.Option("--role", help="NAME=PROMPT: override a role prompt.")] = None,
    out: OutOption = Path("runs/replay"),
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    seed: SeedOption = 0,
) -> None:
    """Replay a trace under sharing policies with real model execution; per-layer error, fidelity, reuse,
    prefill, TTFT, latency and memory against the dense (NonShared) run."""
    args = dict(locals())
    import torch

    torch.manual_seed(seed)
    if trace is None:
        trace, model = demo_trace(model)
    agents = load_agents_for_trace(trace, model=model, agent_flags=agent, role_flags=role, device=device,
                                   dtype=dtype)
    if lora_attention not in ("auto", "kernel", "expand"):
        raise KvprofError(f"--lora-attention {lora_attention!r} is not auto, kernel or expand; pass one of them.")
    use_kernel = lora_attention == "kernel" or (lora_attention == "auto" and agents.device.type == "cuda")
    choices, skipped = choose_policies(policy, schedule, lr_prefill, Runtime(agents))
    for name, reason in skipped.items():
        console.print(f"[yellow]skipped {name}[/]: {reason}")
    if not choices:
        raise KvprofError("no policy can replay this trace with these agents; see the skipped reasons above.")
    trajectories = list(iter_trajectories(trace))[:limit]
    checkpoint = out / "replay.partial.json"
    state = None
    if resume and checkpoint.exists():
        state = ReplayProgress(**json.loads(checkpoint.read_text()))
        console.print(f"resuming after {len(state.trajectories)} replayed trajectories")
    total_turns = sum(len(t.turns) for t in trajectories)
    with progress() as bar:
        job = bar.add_task(f"replaying {len(choices)} policies", total=total_turns)
        bar.update(job, completed=sum(len(t.turns) for t in trajectories if state and t.id in state.trajectories))
        result = replay_trace(agents, trajectories, choices, repeats=repeats,
                              on_turn=lambda traj, index: bar.advance(job), progress=state,
                              on_trajectory=lambda s: write_json(checkpoint, asdict(s)), lora_attention=use_kernel)
        if online:
            tasks = [task_of(t) for t in trajectories]
            online_job = bar.add_task("online re-runs", total=len(tasks) * (len(choices) + 1))
            runs = run_online(agents, tasks, choices, on_task=lambda label, task: bar.advance(online_job),
                              lora_attention=use_kernel)
            result["online"] = summarise_online(runs)
    result.update(trace=str(trace), mode=agents.spec.mode, skipped=skipped, repeats=repeats,
                  lora_attention="flash-lora-attention" if use_kernel else "expanded values + sdpa",
                  device=str(agents.device), dtype=str(agents.base_model.dtype).removeprefix("torch."))
    result["gpu_memory"] = gpu_memory(agents.device)
    console.print(fidelity_table(result).to_rich())
    console.print(cost_table(result).to_rich())
    path = write_result(out, "replay", result, args)
    html = write_html(out / "replay.html", "kvprof replay", sections(result), subtitle=str(trace))
    checkpoint.unlink(missing_ok=True)
    console.print(f"wrote {path} and {html}")
