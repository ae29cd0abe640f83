"""`kvprof demo`: the kvprof pipeline on the embedded demo world, on CPU, in minutes.

Stages (`QUICK_STAGES`, or `FULL_STAGES` with `--full`) are functions `(DemoContext) -> StageResult` that run the
library functions of the command they stand for, print what it prints and write its files; their docstrings are
printed as the stage's description. Results accumulate in `ctx.results` for the report stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from kvprof.commands.common import (
    command_args,
    console,
    print_adapters,
    print_sections,
    print_skipped,
    progress,
    show_recommendation,
    show_replay,
    write_replay_page,
    write_result,
)
from kvprof.commands.displays import capture_with_progress, replay_progress
from kvprof.commands.options import DeviceOption, DtypeOption, OutOption, SeedOption
from kvprof.errors import KvprofError
from kvprof.results.base import ResultFile
from kvprof.results.capture import CaptureResult
from kvprof.results.replay import ReplayResult, summary_of
from kvprof.traces.trace import Trace, read_trace, write_trace

if TYPE_CHECKING:
    from kvprof.demo.assets import DemoWorld


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
    results: list[Path] = field(default_factory=list)  # the result files written so far
    k_error: dict[str, float] = field(default_factory=dict)  # policy → K error of the q/k/v/o replay
    lora_replays: dict[str, ReplayResult] = field(
        default_factory=dict
    )  # adapter targets → replay of the plain LoRA agents
    replays: dict[str, Path] = field(default_factory=dict)  # agent family → its replay.json, for the recommendation

    def write_result(self, out: Path, kind: str, payload: dict | ResultFile, command: str, **options) -> Path:
        """Write OUT/<kind>.json as `kvprof COMMAND` with `options` would (this demo's device, dtype, seed); keep
        its path for the report."""
        path = write_result(
            out,
            kind,
            payload,
            command_args(command, **options, out=out, device=self.device, dtype=self.dtype, seed=self.seed),
        )
        self.results.append(path)
        return path


@dataclass
class StageResult:
    """One row of the summary table, plus the stage's numbers for demo.json."""

    summary: str
    outputs: list[Path]
    metrics: dict = field(default_factory=dict)


def _capture(ctx: DemoContext, mode: str) -> StageResult:
    from kvprof.capture.runner import capture_spec, sampled_trace_header
    from kvprof.capture.workflow import Sampling
    from kvprof.model.agents import load_agents
    from kvprof.traces.tasks import load_tasks

    out = ctx.out / f"capture_{mode}"
    model, workflow, trace_path = str(ctx.world.model), ctx.world.workflow(mode), out / "trace.jsonl"
    spec = capture_spec(workflow)
    tasks = load_tasks(ctx.world.heldout_tasks, ctx.tasks)
    agents = load_agents(spec, model, device=ctx.device, dtype=ctx.dtype)
    print_adapters(agents)
    sampling = Sampling(seed=ctx.seed)
    trajectories, summary = capture_with_progress(
        agents, tasks, trace_path, sampled_trace_header(model, agents, sampling), sampling
    )
    result_path = ctx.write_result(
        out,
        "capture",
        CaptureResult(trace=str(trace_path), summary=summary),
        "capture",
        model=model,
        tasks=ctx.world.heldout_tasks,
        workflow=workflow,
        limit=ctx.tasks,
    )
    console.print(f"exact-match accuracy: {summary.accuracy:.1%} of {summary.with_answer} tasks")
    console.print(f"wrote {trace_path} ({len(trajectories)} trajectories, {summary.seconds:.1f} s)")
    ctx.traces[mode] = trace_path
    return StageResult(
        f"exact match {summary.accuracy:.1%} on {summary.with_answer} tasks, {summary.distinct_tokens} tokens",
        [trace_path, result_path],
        {
            "accuracy": summary.accuracy,
            "tasks": summary.with_answer,
            "tokens": summary.distinct_tokens,
            "turns": summary.turns,
        },
    )


def capture_prompt(ctx: DemoContext) -> StageResult:
    """`kvprof capture` in prompt mode: agents differ by role prompt."""
    return _capture(ctx, "prompt")


def capture_lora(ctx: DemoContext) -> StageResult:
    """`kvprof capture` in lora mode: agents differ by LoRA adapter under one neutral prompt."""
    return _capture(ctx, "lora")


def lora_without_adapters(ctx: DemoContext) -> StageResult:
    """The lora workflow run by the base model with every adapter disabled: what the adapters are worth."""
    from kvprof.capture.runner import trace_header
    from kvprof.capture.workflow import exact_match
    from kvprof.demo.evaluate import load_condition, run_tasks
    from kvprof.demo.world import read_tasks

    agents = load_condition(ctx.world, "lora_disabled", ctx.device, ctx.dtype)
    tasks = read_tasks(ctx.world.heldout_tasks)[: ctx.tasks]
    path = ctx.out / "lora_no_adapters" / "trace.jsonl"
    with progress() as bar:
        job = bar.add_task("lora, adapters disabled", total=len(tasks))
        trajectories = run_tasks(agents, "lora_disabled", tasks, lambda: bar.advance(job))
    write_trace(path, Trace(trace_header(str(ctx.world.model), agents, extra={"adapters": "disabled"}), trajectories))
    ctx.traces["lora_no_adapters"] = path
    correct = sum(exact_match(traj.prediction, traj.answer) for traj in trajectories)
    tokens = sum(traj.num_tokens for traj in trajectories)
    return StageResult(
        f"exact match {correct / len(tasks):.1%} on {len(tasks)} tasks, {tokens} tokens",
        [path],
        {"accuracy": correct / len(tasks), "tasks": len(tasks), "tokens": tokens},
    )


def capture_lora_shared_a(ctx: DemoContext) -> StageResult:
    """`kvprof capture` in lora mode with the shared-A adapter set (one A per projection, only B differs): the
    agents every policy can replay, BaseLRShared included."""
    return _capture(ctx, "lora_shared_a")


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


def _online_replay(
    ctx: DemoContext,
    out: Path,
    trace: Path,
    agents,
    trajectories,
    variants,
    skipped,
    lora_attention: str,
    **options,
) -> tuple[ReplayResult, dict[str, float], str]:
    """`kvprof replay TRACE --online` of `trajectories` under `variants`, printed and written as the command does
    (`lora_attention`: as --lora-attention; `options`: other arguments; no `policy`: `command_selection`); the record,
    online accuracy per run, as text."""
    from kvprof.policies import command_selection
    from kvprof.replay.engine import run_replay, with_trace
    from kvprof.replay.setting import ReplaySettings, lora_attention_mode

    if "policy" not in options:
        options["policy"], options["policy_option"] = command_selection(variants)
    with replay_progress(f"replaying {len(variants)} policies", trajectories, len(variants), True) as hooks:
        payload = run_replay(
            agents,
            trajectories,
            variants,
            ReplaySettings(
                ctx.repeats, online=True, lora_attention=lora_attention_mode(lora_attention, agents.device.type)
            ),
            hooks=hooks,
        )
    record = with_trace(payload, trace, skipped, None)
    show_replay(record)
    ctx.write_result(out, "replay", record, "replay", trace=trace, online=True, repeats=ctx.repeats, **options)
    write_replay_page(out, record)
    online = {name: row["accuracy"] for name, row in (record.online or {}).items()}
    return record, online, ", ".join(f"{name} {value:.0%}" for name, value in online.items())


def _replay_lora(
    ctx: DemoContext, trace_name: str, out: Path, families: tuple[str, ...] | None = None, sweep: bool = True, **options
) -> tuple[ReplayResult, dict[str, float], str]:
    """`kvprof replay --online` of lora capture `trace_name` under every runnable `--policy all` variant (`sweep`) or
    every policy at its defaults, limited to `families` if given; as `_online_replay`."""
    from kvprof.model.agents import load_agents_for_trace
    from kvprof.model.runtime import Runtime
    from kvprof.policies import REGISTRY, enumerate_variants, runnable_variants
    from kvprof.policies.variants import ALL

    trace = ctx.traces[trace_name]
    agents = load_agents_for_trace(trace, device=ctx.device, dtype=ctx.dtype)
    selection = [ALL] if sweep else list(REGISTRY)
    every = [v for v in enumerate_variants(selection) if families is None or v.policy.family in families]
    variants, skipped = runnable_variants(every, Runtime(agents), skip=True)
    print_skipped(skipped)
    trajectories = read_trace(trace).trajectories[: ctx.replay_tasks]
    return _online_replay(
        ctx, out, trace, agents, trajectories, variants, skipped, "auto",
        limit=ctx.replay_tasks, **options,
    )  # fmt: skip


def _k_errors(record: ReplayResult) -> dict[str, float]:
    return {label: summary_of(label, run).k_error for label, run in record.policies.items()}


def replay_all(ctx: DemoContext) -> StageResult:
    """`kvprof replay --policy all --online` of the shared-A trace: teacher-forced error, fidelity and cost of
    every policy against the dense run, then task accuracy with each policy generating."""
    from kvprof.policies.variants import ALL

    out = ctx.out / "replay"
    record, online, accuracy = _replay_lora(ctx, "lora_shared_a", out, policy=[ALL])
    ctx.replays["lora"] = out / "replay.json"
    ctx.k_error = _k_errors(record)
    ctx.lora_replays["q/k/v/o"] = record
    return StageResult(
        f"{len(record.policies)} policies on {ctx.replay_tasks} tasks; online accuracy: {accuracy}",
        [out / "replay.json", out / "replay.html"],
        {"online_accuracy": online},
    )


LORA_FAMILIES = ("baseline", "LRAgent", "PReCache", "selective recompute")


def replay_lora_defaults(ctx: DemoContext) -> StageResult:
    """`kvprof replay --online` of the shared-A lora trace under the LoRA-family and selective-recompute policies at
    their published defaults: error, fidelity, cost and task accuracy of each against the dense run."""
    out = ctx.out / "replay"
    record, online, accuracy = _replay_lora(ctx, "lora_shared_a", out, LORA_FAMILIES, sweep=False)
    ctx.replays["lora"] = out / "replay.json"
    return StageResult(
        f"{len(record.policies)} policies on {ctx.replay_tasks} tasks; online accuracy: {accuracy}",
        [out / "replay.json", out / "replay.html"],
        {"online_accuracy": online},
    )


def capture_lora_qv(ctx: DemoContext) -> StageResult:
    """`kvprof capture` in lora mode with the papers' adapter setting: q_proj and v_proj only, r = 8, α = 16 (K is
    the base's, V = base + LR), A shared on v_proj (BaseLRShared's requirement)."""
    return _capture(ctx, "lora_shared_a_qv")


def replay_lora_qv(ctx: DemoContext) -> StageResult:
    """`kvprof replay --online` of the q/v trace under the LoRA-aware policies (LRAgent's, PReCache's) and FullShared:
    the regime the papers measured, beside the q/k/v/o replay; K error per policy in both regimes."""
    out = ctx.out / "replay_qv"
    record, online, accuracy = _replay_lora(ctx, "lora_shared_a_qv", out, ("baseline", "LRAgent", "PReCache"))
    ctx.lora_replays["q/v"] = record
    qkvo, k_error = ctx.k_error, _k_errors(record)
    compared = ", ".join(
        f"{label} {value:.2f} (q/k/v/o {qkvo[label]:.2f})" for label, value in k_error.items() if label in qkvo
    )
    return StageResult(
        f"{len(record.policies)} policies on {ctx.replay_tasks} tasks; online accuracy: {accuracy}; K error: "
        f"{compared}",
        [out / "replay.json", out / "replay.html"],
        {"online_accuracy": online, "k_error": k_error},
    )


def capture_alora(ctx: DemoContext) -> StageResult:
    """`kvprof capture` in lora mode with the Activated LoRA twins of plan / act / reflect (q/k/v/o, r=8): each
    adapter acts from the cue on, so what an agent reads before its own cue keeps the base model's K/V."""
    return _capture(ctx, "alora")


def capture_alora_qv(ctx: DemoContext) -> StageResult:
    """`kvprof capture` in lora mode with the Activated LoRA twins of the papers' q/v adapters (r=8, α=16)."""
    return _capture(ctx, "alora_qv")


def alora_sharing(ctx: DemoContext) -> StageResult:
    """`kvprof replay --online` of each aLoRA capture under ALoRAShared (exact sharing: every agent reuses what was
    computed before a call's cue, adapter-made K/V recomputed with the base weights), FullShared and NonShared,
    beside the plain LoRA agents of the same targets under the LoRA-family policies: keep LoRA agents and share
    approximately, or retrain them as aLoRA and share exactly."""
    from kvprof.model.agents import load_agents_for_trace
    from kvprof.policies import PolicyVariant
    from kvprof.report.alora import comparison_rows, comparison_table

    variants = [PolicyVariant("alorashared"), PolicyVariant("fullshared"), PolicyVariant("nonshared")]
    outputs, metrics, summaries = [], {}, []
    for targets, trace_name in (("q/k/v/o", "alora"), ("q/v", "alora_qv")):
        out = ctx.out / f"replay_{trace_name}"
        trace = ctx.traces[trace_name]
        agents = load_agents_for_trace(trace, device=ctx.device, dtype=ctx.dtype)
        trajectories = read_trace(trace).trajectories[: ctx.replay_tasks]
        record, online, _ = _online_replay(
            ctx, out, trace, agents, trajectories, variants, {}, "auto", limit=ctx.replay_tasks
        )
        if trace_name == "alora":
            ctx.replays["alora"] = out / "replay.json"
        rows = comparison_rows(ctx.lora_replays[targets], record)
        title = f"LoRA agents (the shared-A set) or aLoRA agents ({targets}, r=8)"
        console.print(comparison_table(rows, title).to_rich())
        exact = summary_of("alorashared", record.policies["alorashared"])
        dense_prefilled = summary_of("nonshared", record.dense).prefilled
        summaries.append(
            f"{targets}: ALoRAShared KL {exact.kl:.1g}, {exact.prefilled} of "
            f"{dense_prefilled} tokens prefilled, online {online['alorashared']:.0%}"
        )
        metrics[targets] = rows
        outputs += [out / "replay.json", out / "replay.html"]
    return StageResult("; ".join(summaries), outputs, {"comparison": metrics})


def advance(bar, job, *_) -> None:
    bar.advance(job)


def prompt_sharing(ctx: DemoContext) -> StageResult:
    """`kvprof fit-anchors` on the first half of the prompt-mode capture, then `kvprof replay --online` of the other
    half under FullShared and the delta-correction policies (KVComm, GraphFlow: the full-dimensional pool; KVCMAS
    chained and not: its rank-32 factors): what correcting another agent's cache of a shared segment costs and
    saves when agents differ by role prompt."""
    from kvprof.model.agents import load_agents_for_trace
    from kvprof.model.runtime import Runtime
    from kvprof.policies import PolicyVariant
    from kvprof.policies.delta import pool_identity
    from kvprof.report.anchors import fit_memory_table
    from kvprof.tuning.anchor_fit import fit_anchors

    out = ctx.out / "prompt_sharing"
    trace = ctx.traces["prompt"]
    agents = load_agents_for_trace(trace, device=ctx.device, dtype=ctx.dtype)
    trajectories = read_trace(trace).trajectories
    half = max(1, len(trajectories) // 2)
    calibration, replayed = trajectories[:half], trajectories[half:][: ctx.replay_tasks] or trajectories[:half]
    identity = pool_identity(Runtime(agents))
    pools = {}
    with progress() as bar:
        for name, rank in (("full", None), ("rank32", 32)):
            job = bar.add_task(f"fitting anchors ({name})", total=len(calibration))
            capacity = 20 if rank is None else 10  # KVComm's V, KVCMAS's V
            pool, report = fit_anchors(agents, calibration, rank, capacity, on_trajectory=partial(advance, bar, job))
            pools[name] = pool.save(out / f"anchors_{name}.safetensors", identity)
            report.update(pool=str(pools[name]), trace=str(trace), model=agents.model_name, stored_rank=rank)
            fit_path = ctx.write_result(
                out / f"fit_{name}", "fit_anchors", report, "fit-anchors",
                trace=trace, rank="full" if rank is None else str(rank), limit=half,
            )  # fmt: skip
    console.print(fit_memory_table(report).to_rich())
    variants = [
        PolicyVariant("fullshared"),
        PolicyVariant("graphflow", {"anchors": str(pools["full"])}),
        PolicyVariant("kvcomm", {"anchors": str(pools["full"])}),
        PolicyVariant("kvcmas", {"chain": "chain", "anchors": str(pools["rank32"])}),
        PolicyVariant("kvcmas", {"chain": "star", "anchors": str(pools["rank32"])}),
    ]
    record, online, accuracy = _online_replay(
        ctx, out, trace, agents, replayed, variants, {}, "expand", skip=half, limit=len(replayed),
    )  # fmt: skip
    ctx.replays["prompt"] = out / "replay.json"
    kl = {label: summary_of(label, run).kl for label, run in record.policies.items()}
    return StageResult(
        f"{len(replayed)} tasks after fitting on {half}; online accuracy: {accuracy}; anchor pool at rank 32: "
        f"{report['memory']['saving']:.2f}× smaller",
        [out / "replay.json", out / "replay.html", fit_path, pools["rank32"]],
        {"online_accuracy": online, "kl": kl, "anchor_saving": report["memory"]["saving"]},
    )


def codebook_sharing(ctx: DemoContext) -> StageResult:
    """`kvprof replay --online` of the codebook world's short trace (`kvprof.demo.codebook`: each agent's private
    key gives the shared manifest's symbols its own colours, so a shared segment's K/V depend on the prefix before
    it) under FullShared and the delta-correction policies from empty pools: what sharing costs when it is not
    free."""
    from kvprof.demo.codebook_world import EVALUATED as CODEBOOK_EVALUATED
    from kvprof.demo.codebook_world import codebook_world
    from kvprof.model.agents import load_agents_for_trace

    out = ctx.out / "codebook_sharing"
    trace = codebook_world().sample_traces["short"]
    agents = load_agents_for_trace(trace, device=ctx.device, dtype=ctx.dtype)
    trajectories = read_trace(trace).trajectories[: ctx.replay_tasks]
    variants = list(CODEBOOK_EVALUATED)
    record, online, accuracy = _online_replay(
        ctx, out, trace, agents, trajectories, variants, {}, "expand", limit=len(trajectories)
    )
    kl = {label: summary_of(label, run).kl for label, run in record.policies.items()}
    return StageResult(
        f"{len(trajectories)} codebook tasks; online accuracy: {accuracy}",
        [out / "replay.json", out / "replay.html"],
        {"online_accuracy": online, "kl": kl},
    )


# The demo's target: what a team might ask of its agents, at a load where, on the demo world's CPU timings, NonShared
# no longer keeps up (the sensitivity table shows where the choice changes).
DEMO_TARGET = "accuracy-drop<=1pt, kl<=0.01, ttft-p90<=150ms, load=16qps, optimise=throughput"
DEMO_SIMULATED_SECONDS = 30.0


def recommend_families(ctx: DemoContext) -> StageResult:
    """`kvprof recommend` over the replays the demo ran, one agent family each: the policy setting that meets the
    target at its load, chosen on half of each replay's trajectories and confirmed on the other half (with two or
    more), with the runner-up, why each other one misses, and where the choice changes with the load and the KV
    budget."""
    from kvprof.recommend.candidates import read_groups
    from kvprof.recommend.run import RecommendRequest, prepare
    from kvprof.recommend.serving import StepModel
    from kvprof.recommend.target import parse_target
    from kvprof.report.recommend import decision_lines

    out = ctx.out / "recommend"
    results = [f"{family}={path}" for family, path in ctx.replays.items()]
    seconds = DEMO_SIMULATED_SECONDS
    split = 0.5 if min(len(group.trajectories) for group in read_groups(results)) >= 2 else None  # else: no halves
    target = parse_target([DEMO_TARGET])
    request = RecommendRequest(results, target, StepModel(fit_replay=True), seconds, split=split, seed=ctx.seed)
    recommendation = prepare(request)
    with console.status("simulating") as status:
        result = recommendation.run(on_step=lambda step: status.update(f"simulating {step}"))
    show_recommendation(result)
    args = command_args(
        "recommend", results=results, target=[DEMO_TARGET], fit_replay=True, duration=seconds, split=split, out=out,
        seed=ctx.seed,
    )  # fmt: skip
    path = write_result(out, "recommend", result, args)
    ctx.results.append(path)
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
    from kvprof.report.dashboard import dashboard_sections, write_dashboard

    sources = ctx.results
    sections, environment = dashboard_sections(sources)
    print_sections(sections)
    path = write_dashboard(ctx.out / "report.html", sections, sources, environment)
    console.print(f"wrote {path} ({len(sections)} sections from {len(sources)} result files)")
    decisions = {section.title: section.card for section in sections if section.order == "decision" and section.card}
    return StageResult(f"{len(sources)} result files merged", [path], {"decisions": decisions})


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
    Stage("capture lora, shared-A adapters", capture_lora_shared_a, 8.0, "tasks"),
    Stage("capture prompt", capture_prompt, 6.0, "tasks"),
    Stage("replay lora", replay_lora_defaults, 75.0, "replay_tasks"),
    Stage("prompt-role sharing", prompt_sharing, 60.0, "replay_tasks"),
    Stage("recommend", recommend_families, 5.0),
    Stage("report", report_all, 2.0),
]

FULL_STAGES = [
    Stage("capture prompt", capture_prompt, 9.0, "tasks"),
    Stage("capture lora", capture_lora, 7.0, "tasks"),
    Stage("capture lora, shared-A adapters", capture_lora_shared_a, 7.0, "tasks"),
    Stage("lora, adapters disabled", lora_without_adapters, 7.0, "tasks"),
    Stage("rank-analysis", rank_analysis_lora, 2.0),
    Stage("replay", replay_all, 220.0, "replay_tasks"),
    Stage("capture lora q/v, the papers' setting", capture_lora_qv, 9.0, "tasks"),
    Stage("replay lora q/v", replay_lora_qv, 115.0, "replay_tasks"),
    Stage("capture aLoRA twins", capture_alora, 9.0, "tasks"),
    Stage("capture aLoRA q/v twins", capture_alora_qv, 9.0, "tasks"),
    Stage("aLoRA agents or LoRA agents", alora_sharing, 90.0, "replay_tasks"),
    Stage("prompt-role sharing", prompt_sharing, 77.0, "replay_tasks"),
    Stage("codebook: sharing that costs accuracy", codebook_sharing, 9.0, "replay_tasks"),
    Stage("recommend", recommend_families, 5.0),
    Stage("report", report_all, 3.0),
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
