"""The stages of `kvprof demo`: each is a function `(DemoContext) -> StageResult` that calls the library step of the
command it stands for (`prepare_capture`, `replay_file`, `fit_and_save`, `build_dashboard`, ...), prints what that
command prints (`kvprof.report.terminal`) and writes its files as the command would (`DemoContext.writer`). Its
docstring is the stage's description. The demo's own choices (policies, pools, target): `kvprof.demo.pipeline`. Both
are imported inside the stages, so that `kvprof --help` imports neither torch nor plotly. The stage table and the
command: `kvprof.commands.demo`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from rich.progress import Progress, TaskID

from kvprof.results.base import ResultFile
from kvprof.results.capture import CaptureResult
from kvprof.results.replay import ReplayResult, summary_of
from kvprof.traces.trace import read_trace
from kvprof.ui import console, progress

if TYPE_CHECKING:
    from kvprof.demo.assets import DemoWorld
    from kvprof.model.agents import AgentSet
    from kvprof.policies import PolicyVariant
    from kvprof.traces.trace import Trajectory

Writer = Callable[[Path, str, "dict | ResultFile", str, dict], Path]
"""Writes OUT/<kind>.json (arguments: OUT, kind, payload, command, options) as `kvprof COMMAND` with those options
would, and returns its path: the command line's `write_result` (the envelope records the command's arguments)."""


@dataclass
class DemoContext:
    """What every stage gets: the world, the options, how result files are written (`writer`), and what earlier stages
    produced: traces by capture, the result files written so far, the q/k/v/o replay's K error per policy, the plain
    LoRA agents' replays by adapter targets, and each agent family's replay.json for the recommendation."""

    world: DemoWorld
    out: Path
    tasks: int
    device: str
    dtype: str
    seed: int
    replay_tasks: int
    repeats: int
    writer: Writer
    traces: dict[str, Path] = field(default_factory=dict)
    results: list[Path] = field(default_factory=list)
    k_error: dict[str, float] = field(default_factory=dict)
    lora_replays: dict[str, ReplayResult] = field(default_factory=dict)
    replays: dict[str, Path] = field(default_factory=dict)

    def write_result(self, out: Path, kind: str, payload: dict | ResultFile, command: str, **options) -> Path:
        """Write OUT/<kind>.json as `kvprof COMMAND` with `options` would (this demo's device, dtype, seed); keep
        its path for the report."""
        return self.write_as(
            out, kind, payload, command, options | dict(device=self.device, dtype=self.dtype, seed=self.seed)
        )

    def write_as(self, out: Path, kind: str, payload: dict | ResultFile, command: str, options: dict) -> Path:
        """Write OUT/<kind>.json as `kvprof COMMAND` with `options` would; keep its path for the report."""
        self.results.append(self.writer(out, kind, payload, command, options | {"out": out}))
        return self.results[-1]


@dataclass
class StageResult:
    """One row of the summary table, plus the stage's numbers for demo.json."""

    summary: str
    outputs: list[Path]
    metrics: dict = field(default_factory=dict)


def _capture(ctx: DemoContext, mode: str) -> StageResult:
    """`kvprof capture` of the world's held-out tasks with workflow `mode`."""
    from kvprof.capture.runner import prepare_capture
    from kvprof.capture.workflow import Sampling
    from kvprof.report.terminal import capture_with_progress, print_adapters, show_capture

    out, model, workflow = ctx.out / f"capture_{mode}", str(ctx.world.model), ctx.world.workflow(mode)
    trace_path = out / "trace.jsonl"
    setup = prepare_capture(
        model, workflow, ctx.world.heldout_tasks, ctx.tasks, Sampling(seed=ctx.seed), device=ctx.device, dtype=ctx.dtype
    )
    print_adapters(setup.agents)
    trajectories, summary = capture_with_progress(setup, trace_path)
    result = CaptureResult(trace=str(trace_path), summary=summary)
    options = dict(model=model, tasks=ctx.world.heldout_tasks, workflow=workflow, limit=ctx.tasks)
    result_path = ctx.write_result(out, "capture", result, "capture", **options)
    show_capture(summary, trace_path, len(trajectories))
    ctx.traces[mode] = trace_path
    return StageResult(
        f"exact match {summary.accuracy:.1%} on {summary.with_answer} tasks, {summary.distinct_tokens} tokens",
        [trace_path, result_path],
        dict(accuracy=summary.accuracy, tasks=summary.with_answer, tokens=summary.distinct_tokens, turns=summary.turns),
    )


def capture_prompt(ctx: DemoContext) -> StageResult:
    """`kvprof capture` in prompt mode: agents differ by role prompt."""
    return _capture(ctx, "prompt")


def capture_lora(ctx: DemoContext) -> StageResult:
    """`kvprof capture` in lora mode: agents differ by LoRA adapter under one neutral prompt."""
    return _capture(ctx, "lora")


def capture_lora_shared_a(ctx: DemoContext) -> StageResult:
    """`kvprof capture` in lora mode with the shared-A adapter set (one A per projection, only B differs): the
    agents every policy can replay, BaseLRShared included."""
    return _capture(ctx, "lora_shared_a")


def capture_lora_qv(ctx: DemoContext) -> StageResult:
    """`kvprof capture` in lora mode with the papers' adapter setting: q_proj and v_proj only, r = 8, α = 16 (K is
    the base's, V = base + LR), A shared on v_proj (BaseLRShared's requirement)."""
    return _capture(ctx, "lora_shared_a_qv")


def capture_alora(ctx: DemoContext) -> StageResult:
    """`kvprof capture` in lora mode with the Activated LoRA twins of plan / act / reflect (q/k/v/o, r=8): each
    adapter acts from the cue on, so what an agent reads before its own cue keeps the base model's K/V."""
    return _capture(ctx, "alora")


def capture_alora_qv(ctx: DemoContext) -> StageResult:
    """`kvprof capture` in lora mode with the Activated LoRA twins of the papers' q/v adapters (r=8, α=16)."""
    return _capture(ctx, "alora_qv")


def lora_without_adapters(ctx: DemoContext) -> StageResult:
    """The lora workflow run by the base model with every adapter disabled: what the adapters are worth."""
    from kvprof.demo import pipeline
    from kvprof.demo.world import read_tasks

    tasks, path = read_tasks(ctx.world.heldout_tasks)[: ctx.tasks], ctx.out / "lora_no_adapters" / "trace.jsonl"
    with progress() as bar:
        job = bar.add_task("lora, adapters disabled", total=len(tasks))
        trajectories = pipeline.without_adapters(
            ctx.world, tasks, ctx.device, ctx.dtype, path, lambda: bar.advance(job)
        )
    ctx.traces["lora_no_adapters"] = path
    accuracy, tokens = pipeline.accuracy(trajectories), sum(traj.num_tokens for traj in trajectories)
    summary = f"exact match {accuracy:.1%} on {len(tasks)} tasks, {tokens} tokens"
    return StageResult(summary, [path], {"accuracy": accuracy, "tasks": len(tasks), "tokens": tokens})


def rank_analysis_lora(ctx: DemoContext) -> StageResult:
    """`kvprof rank-analysis` of the lora trace: effective rank and cross-agent similarity, per layer, with a
    verdict per published claim."""
    import torch

    from kvprof.claims.rank import EXTENSION
    from kvprof.rank.trace_analysis import prepare_rank_analysis, run_rank_analysis
    from kvprof.report.rank_analysis import layer_tables, verdict_lines, write_report

    out, trace, limit = ctx.out / "rank_analysis", ctx.traces["lora"], min(ctx.tasks, 4)
    torch.manual_seed(ctx.seed)
    setup = prepare_rank_analysis(trace, limit=limit, device=ctx.device, dtype=ctx.dtype)
    with progress() as bar:
        job = bar.add_task("capturing and comparing caches", total=len(setup.trace.trajectories))
        record = run_rank_analysis(setup, on_trajectory=lambda traj: bar.advance(job))
    for table in layer_tables(record):
        console.print(table.to_rich())
    for line in verdict_lines(record):
        console.print(line, markup=False)
    json_path = ctx.write_result(out, "rank_analysis", record, "rank-analysis", trace=trace, limit=limit)
    html_path = write_report(out / "rank_analysis.html", record)
    console.print(f"wrote {json_path} and {html_path} ({record.seconds:.1f} s)")
    paper = [claim for claim in record.claims if EXTENSION not in (claim.quantity or "")]
    extensions = [claim for claim in record.claims if claim not in paper]
    summary = f"{sum(c.holds is True for c in paper)} of {len(paper)} published claims hold on this world"
    if extensions:
        summary += f"; {sum(c.holds is True for c in extensions)} of {len(extensions)} on kvprof's extension"
    claims = {claim.statement: claim.holds for claim in record.claims}
    return StageResult(summary, [json_path, html_path], {"claims": claims})


def online_replay(
    ctx: DemoContext,
    out: Path,
    trace: Path,
    agents: AgentSet,
    trajectories: list[Trajectory],
    variants: list[PolicyVariant],
    skipped: dict[str, str],
    lora_attention: str,
    **options,
) -> tuple[ReplayResult, dict[str, float], str]:
    """`kvprof replay TRACE --online` of `trajectories` under `variants` (`replay_file`), printed and written as the
    command does (`lora_attention`: as --lora-attention; `options`: other arguments; no `policy`:
    `command_selection`); the record, online accuracy per run, as text."""
    from kvprof.policies import command_selection
    from kvprof.replay.engine import replay_file
    from kvprof.replay.setting import ReplaySettings, lora_attention_mode
    from kvprof.report.terminal import replay_progress, show_replay, write_replay_page

    if "policy" not in options:
        options["policy"], options["policy_option"] = command_selection(variants)
    mode = lora_attention_mode(lora_attention, agents.device.type)
    with replay_progress(f"replaying {len(variants)} policies", trajectories, len(variants), True) as hooks:
        settings = ReplaySettings(ctx.repeats, online=True, lora_attention=mode)
        record = replay_file(trace, agents, trajectories, variants, settings, skipped=skipped, hooks=hooks)
    show_replay(record)
    ctx.write_result(out, "replay", record, "replay", trace=trace, online=True, repeats=ctx.repeats, **options)
    write_replay_page(out, record)
    online = {name: row["accuracy"] for name, row in (record.online or {}).items()}
    return record, online, ", ".join(f"{name} {value:.0%}" for name, value in online.items())


def replay_lora(
    ctx: DemoContext, trace_name: str, out: Path, families: tuple[str, ...] | None = None, sweep: bool = True, **options
) -> StageResult:
    """`kvprof replay --online` of lora capture `trace_name` under every runnable `--policy all` variant (`sweep`) or
    every policy at its defaults, limited to `families` if given (`pipeline.lora_variants`); as `online_replay`,
    its record kept by the capture's adapter targets."""
    from kvprof.demo import pipeline
    from kvprof.model.agents import load_agents_for_trace
    from kvprof.report.terminal import print_skipped

    trace = ctx.traces[trace_name]
    agents = load_agents_for_trace(trace, device=ctx.device, dtype=ctx.dtype)
    variants, skipped = pipeline.lora_variants(agents, families, sweep)
    print_skipped(skipped)
    trajectories = read_trace(trace).trajectories[: ctx.replay_tasks]
    record, online, accuracy = online_replay(
        ctx, out, trace, agents, trajectories, variants, skipped, "auto", limit=ctx.replay_tasks, **options
    )
    ctx.lora_replays["q/v" if trace_name.endswith("_qv") else "q/k/v/o"] = record
    summary = f"{len(record.policies)} policies on {ctx.replay_tasks} tasks; online accuracy: {accuracy}"
    return StageResult(summary, [out / "replay.json", out / "replay.html"], {"online_accuracy": online})


def replay_all(ctx: DemoContext) -> StageResult:
    """`kvprof replay --policy all --online` of the shared-A trace: teacher-forced error, fidelity and cost of
    every policy against the dense run, then task accuracy with each policy generating."""
    from kvprof.policies.variants import ALL

    result = replay_lora(ctx, "lora_shared_a", ctx.out / "replay", policy=[ALL])
    ctx.replays["lora"], ctx.k_error = ctx.out / "replay" / "replay.json", _k_errors(ctx.lora_replays["q/k/v/o"])
    return result


def replay_lora_defaults(ctx: DemoContext) -> StageResult:
    """`kvprof replay --online` of the shared-A lora trace under the LoRA-family and selective-recompute policies at
    their published defaults: error, fidelity, cost and task accuracy of each against the dense run."""
    from kvprof.demo import pipeline

    result = replay_lora(ctx, "lora_shared_a", ctx.out / "replay", pipeline.LORA_FAMILIES, sweep=False)
    ctx.replays["lora"] = ctx.out / "replay" / "replay.json"
    return result


def replay_lora_qv(ctx: DemoContext) -> StageResult:
    """`kvprof replay --online` of the q/v trace under the LoRA-aware policies (LRAgent's, PReCache's) and FullShared:
    the regime the papers measured, beside the q/k/v/o replay; K error per policy in both regimes."""
    result = replay_lora(ctx, "lora_shared_a_qv", ctx.out / "replay_qv", ("baseline", "LRAgent", "PReCache"))
    qkvo, k_error = ctx.k_error, _k_errors(ctx.lora_replays["q/v"])
    compared = ", ".join(
        f"{label} {value:.2f} (q/k/v/o {qkvo[label]:.2f})" for label, value in k_error.items() if label in qkvo
    )
    result.summary += f"; K error: {compared}"
    result.metrics["k_error"] = k_error
    return result


def _k_errors(record: ReplayResult) -> dict[str, float]:
    return {label: summary_of(label, run).k_error for label, run in record.policies.items()}


def alora_sharing(ctx: DemoContext) -> StageResult:
    """`kvprof replay --online` of each aLoRA capture under ALoRAShared (exact sharing: every agent reuses what was
    computed before a call's cue, adapter-made K/V recomputed with the base weights), FullShared and NonShared,
    beside the plain LoRA agents of the same targets under the LoRA-family policies: keep LoRA agents and share
    approximately, or retrain them as aLoRA and share exactly."""
    from kvprof.demo import pipeline
    from kvprof.model.agents import load_agents_for_trace
    from kvprof.report.alora import comparison_rows, comparison_table

    outputs, metrics, summaries = [], {}, []
    for targets, trace_name in (("q/k/v/o", "alora"), ("q/v", "alora_qv")):
        out, trace = ctx.out / f"replay_{trace_name}", ctx.traces[trace_name]
        agents = load_agents_for_trace(trace, device=ctx.device, dtype=ctx.dtype)
        trajectories = read_trace(trace).trajectories[: ctx.replay_tasks]
        variants = list(pipeline.ALORA_VARIANTS)
        record, online, _ = online_replay(
            ctx, out, trace, agents, trajectories, variants, {}, "auto", limit=ctx.replay_tasks
        )
        if trace_name == "alora":
            ctx.replays["alora"] = out / "replay.json"
        rows = comparison_rows(ctx.lora_replays[targets], record)
        console.print(
            comparison_table(rows, f"LoRA agents (the shared-A set) or aLoRA agents ({targets}, r=8)").to_rich()
        )
        exact = summary_of("alorashared", record.policies["alorashared"])
        summaries.append(
            f"{targets}: ALoRAShared KL {exact.kl:.1g}, {exact.prefilled} of "
            f"{summary_of('nonshared', record.dense).prefilled} tokens prefilled, online {online['alorashared']:.0%}"
        )
        metrics[targets] = rows
        outputs += [out / "replay.json", out / "replay.html"]
    return StageResult("; ".join(summaries), outputs, {"comparison": metrics})


def prompt_sharing(ctx: DemoContext) -> StageResult:
    """`kvprof fit-anchors` on the first half of the prompt-mode capture, then `kvprof replay --online` of the other
    half under FullShared and the delta-correction policies (KVComm, GraphFlow: the full-dimensional pool; KVCMAS
    chained and not: its rank-32 factors): what correcting another agent's cache of a shared segment costs and
    saves when agents differ by role prompt."""
    from kvprof.demo import pipeline
    from kvprof.model.agents import load_agents_for_trace
    from kvprof.report.anchors import fit_memory_table
    from kvprof.tuning.anchor_fit import fit_and_save

    out, trace = ctx.out / "prompt_sharing", ctx.traces["prompt"]
    agents = load_agents_for_trace(trace, device=ctx.device, dtype=ctx.dtype)
    trajectories = read_trace(trace).trajectories
    half = max(1, len(trajectories) // 2)
    calibration, replayed = trajectories[:half], trajectories[half:][: ctx.replay_tasks] or trajectories[:half]
    pools = {}
    with progress() as bar:
        for name, rank, capacity in pipeline.POOLS:
            job = bar.add_task(f"fitting anchors ({name})", total=len(calibration))
            pools[name], report = fit_and_save(
                agents, trace, calibration, rank, capacity, out / f"anchors_{name}.safetensors",
                on_trajectory=partial(_advance, bar, job),
            )  # fmt: skip
            fit_path = ctx.write_result(
                out / f"fit_{name}", "fit_anchors", report, "fit-anchors",
                trace=trace, rank="full" if rank is None else str(rank), limit=half,
            )  # fmt: skip
    console.print(fit_memory_table(report).to_rich())
    variants = pipeline.prompt_variants(pools)
    record, online, accuracy = online_replay(
        ctx, out, trace, agents, replayed, variants, {}, "expand", skip=half, limit=len(replayed)
    )
    ctx.replays["prompt"] = out / "replay.json"
    kl = {label: summary_of(label, run).kl for label, run in record.policies.items()}
    return StageResult(
        f"{len(replayed)} tasks after fitting on {half}; online accuracy: {accuracy}; anchor pool at rank 32: "
        f"{report['memory']['saving']:.2f}× smaller",
        [out / "replay.json", out / "replay.html", fit_path, pools["rank32"]],
        {"online_accuracy": online, "kl": kl, "anchor_saving": report["memory"]["saving"]},
    )


def _advance(bar: Progress, job: TaskID, *_) -> None:
    bar.advance(job)


def codebook_sharing(ctx: DemoContext) -> StageResult:
    """`kvprof replay --online` of the codebook world's short trace (`kvprof.demo.codebook`: each agent's private
    key gives the shared manifest's symbols its own colours, so a shared segment's K/V depend on the prefix before
    it) under FullShared and the delta-correction policies from empty pools: what sharing costs when it is not
    free."""
    from kvprof.demo.codebook_world import EVALUATED, codebook_world
    from kvprof.model.agents import load_agents_for_trace

    out, trace = ctx.out / "codebook_sharing", codebook_world().sample_traces["short"]
    agents = load_agents_for_trace(trace, device=ctx.device, dtype=ctx.dtype)
    trajectories = read_trace(trace).trajectories[: ctx.replay_tasks]
    record, online, accuracy = online_replay(
        ctx, out, trace, agents, trajectories, list(EVALUATED), {}, "expand", limit=len(trajectories)
    )
    kl = {label: summary_of(label, run).kl for label, run in record.policies.items()}
    summary = f"{len(trajectories)} codebook tasks; online accuracy: {accuracy}"
    return StageResult(summary, [out / "replay.json", out / "replay.html"], {"online_accuracy": online, "kl": kl})


def recommend_families(ctx: DemoContext) -> StageResult:
    """`kvprof recommend` over the replays the demo ran, one agent family each: the policy setting that meets the
    target at its load, chosen on half of each replay's trajectories and confirmed on the other half (with two or
    more), with the runner-up, why each other one misses, and where the choice changes with the load and the KV
    budget."""
    from kvprof.demo import pipeline
    from kvprof.recommend.run import prepare
    from kvprof.report.recommend import decision_lines
    from kvprof.report.terminal import show_recommendation

    out, request = ctx.out / "recommend", pipeline.recommend_request(ctx.replays, ctx.seed)
    with console.status("simulating") as status:
        result = prepare(request).run(on_step=lambda step: status.update(f"simulating {step}"))
    show_recommendation(result)
    options = dict(
        results=request.results, target=[pipeline.DEMO_TARGET], fit_replay=True, duration=request.duration,
        split=request.split, seed=ctx.seed,
    )  # fmt: skip
    path = ctx.write_as(out, "recommend", result, "recommend", options)
    decision = result.decision
    heldout = result.heldout.verdict if result.heldout else "no held-out check"
    summary = (
        f"{decision.chosen} at {result.load.value:g} {result.load.kind} (runner-up {decision.runner_up}); held out: "
        f"{heldout}"
        if decision.chosen
        else f"nothing meets the target (closest: {decision.closest})"
    )
    return StageResult(summary, [path], {"recommendation": decision_lines(result)})


def report_all(ctx: DemoContext) -> StageResult:
    """`kvprof report` over every result the demo wrote: one HTML dashboard."""
    from kvprof.report.dashboard import build_dashboard
    from kvprof.report.terminal import show_report

    path, sections = build_dashboard(ctx.results, ctx.out / "report.html")
    show_report(path, sections, ctx.results)
    decisions = {section.title: section.card for section in sections if section.order == "decision" and section.card}
    return StageResult(f"{len(ctx.results)} result files merged", [path], {"decisions": decisions})
