"""`kvprof replay`: a trace under one sharing policy or all of them, against the dense run."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvprof.cli_help import policy_names, policy_option_list
from kvprof.commands.common import (
    DeviceOption,
    DtypeOption,
    MinSpanOption,
    OutOption,
    SeedOption,
    SpanBoundariesOption,
    console,
    demo_trace,
    note,
    print_layers,
    progress,
    write_result,
)
from kvprof.errors import KvprofError
from kvprof.fileio import check_fields, read_json_file, write_json
from kvprof.traces.reuse import DEFAULT_MATCHING, MIN_SPAN, SpanMatching
from kvprof.traces.trace import Trajectory, iter_trajectories, read_header

if TYPE_CHECKING:
    from kvprof.model.agents import AgentSet
    from kvprof.policies import PolicyVariant
    from kvprof.replay.engine import ReplayProgress
    from kvprof.replay.sharded import RayCluster, ShardResult

    Runnable = Callable[[list[PolicyVariant], bool], tuple[list[PolicyVariant], dict[str, str]]]

SHORTHANDS = {"schedule": ("rebaseshared", "schedule"), "lr_prefill": ("baseshared", "lr_prefill")}


def choose_variants(
    policy: list[str], policy_options: list[str], schedule: str | None, lr_prefill: str | None, runnable: Runnable
) -> tuple[list[PolicyVariant], dict[str, str]]:
    """--policy / --policy-option / the documented shorthands → the variants to replay; with `all`, those this
    setup cannot run are skipped (label → reason). `runnable(variants, skip)`: `runnable_variants` on the loaded
    agents (here, or on a Ray worker)."""
    from kvprof.policies import enumerate_variants, parse_policy_options
    from kvprof.policies.variants import ALL

    flags = list(policy_options)
    for value, (name, key) in zip((schedule, lr_prefill), SHORTHANDS.values()):
        if value:
            flags.append(f"{name}.{key}={value}")
    variants = enumerate_variants(policy, parse_policy_options(flags))
    return runnable(variants, any(name.lower() == ALL for name in policy))


# How a refusal to resume names each setting a replay checkpoint records (`checkpoint_identity`); the values of
# the trace (a digest) and of the agents are not shown.
SETTINGS = {
    "trace": "another trace",
    "model": "--model",
    "agents": "other agents (--agent/--role)",
    "policies": "--policy",
    "repeats": "--repeats",
    "timing": "--timing",
    "page_size": "--page-size",
    "span_matching": "--min-span / --span-boundaries",
    "dtype": "--dtype",
    "device": "--device",
    "lora_attention": "--lora-attention",
    "sharding": "--ray (a sharded replay checkpoints shards)",
    "online": "--online (a sharded replay checkpoints its shards' online re-runs)",
}
UNSHOWN = ("trace", "agents", "sharding")


def checkpoint_identity(
    trace: Path,
    loaded: dict,
    variants: list[PolicyVariant],
    repeats: int,
    use_kernel: bool,
    sharded: bool = False,
    online: bool = False,
    timing: str = "turn",
    page_size: int = 16,
    span_matching: SpanMatching = DEFAULT_MATCHING,
) -> dict:
    """The settings a replay's records depend on, which its checkpoint records: the trace's content, the model
    and agents, dtype and device (`loaded`: `kvprof.model.agents.agents_identity`), the policy variants with their
    options, repeats, timing, page size, span matching and attention path; `sharded` for a replay on Ray, whose
    checkpoint holds shards, with their online re-runs when `online`."""
    identity = {
        "trace": "sha256:" + hashlib.sha256(trace.read_bytes()).hexdigest(),
        "model": loaded["model"],
        "agents": loaded["agents"],
        "policies": {variant.label: variant.options for variant in variants},
        "repeats": repeats,
        "timing": timing,
        "page_size": page_size,
        "span_matching": span_matching.to_json(),
        "dtype": loaded["dtype"],
        "device": loaded["device"],
        "lora_attention": "kernel" if use_kernel else "expand",
    }
    return identity | ({"sharding": "ray", "online": online} if sharded else {})


def read_checkpoint(checkpoint: Path, identity: dict, trajectory_ids: list[str]) -> ReplayProgress:
    """The progress an interrupted replay left in `checkpoint`; refuses one made with other settings than
    `identity` (its records would be mixed with incomparable ones) or of trajectories outside `trajectory_ids`."""
    from kvprof.replay.engine import ReplayProgress

    state = ReplayProgress.of_checkpoint(saved_progress(checkpoint, identity), checkpoint)
    _refuse_foreign(checkpoint, [traj_id for traj_id in state.trajectories if traj_id not in trajectory_ids])
    return state


def read_shard_checkpoint(
    checkpoint: Path, identity: dict, trajectories: list[Trajectory], variants: list[PolicyVariant]
) -> tuple[dict[str, ShardResult], list[list[str]]]:
    """The shards an interrupted replay on Ray completed and its plan's grouping, as far as this replay can resume
    them (`kvprof.replay.sharded.resumable`); `read_checkpoint`'s refusals, and a shard of other trajectories than
    this replay's is refused too."""
    from kvprof.replay.sharded import resumable, saved_shards

    progress = saved_progress(checkpoint, identity)
    saved = saved_shards(progress, checkpoint)
    _refuse_foreign(
        checkpoint,
        sorted(
            {traj_id for result in saved.values() for traj_id in result.progress.trajectories}
            - {traj.id for traj in trajectories}
        ),
    )
    return resumable(saved, progress.get("groups"), trajectories, variants)


def _refuse_foreign(checkpoint: Path, foreign: list[str]) -> None:
    if foreign:
        raise KvprofError(
            f"checkpoint {checkpoint} holds trajectories {', '.join(foreign[:3])} that this replay does not include; "
            "pass the --limit it was made with, or delete it to start again."
        )


def saved_progress(checkpoint: Path, identity: dict) -> dict:
    """The progress record of the checkpoint `checkpoint`, refusing one made with other settings than `identity`."""
    saved = read_json_file(checkpoint, "checkpoint", "delete it to start the replay again")
    if not isinstance(saved, dict) or not isinstance(saved.get("identity"), dict) or "progress" not in saved:
        raise KvprofError(
            f"{checkpoint} is not a checkpoint of this kvprof's replay; delete it to start the replay again."
        )
    differences = [
        _difference(key, saved["identity"].get(key), identity.get(key))
        for key in dict.fromkeys([*identity, *saved["identity"]])
        if saved["identity"].get(key) != identity.get(key)
    ]
    if differences:
        raise KvprofError(
            f"checkpoint {checkpoint} was made with other settings ({'; '.join(differences)}); resume with the "
            "options it was made with, or delete it to start again."
        )
    return saved["progress"]


def _difference(key: str, saved, current) -> str:
    """A setting of a checkpoint that differs from this run's, for the refusal: its value there and here."""
    if key in UNSHOWN:
        return SETTINGS[key]
    shown = [", ".join(value) if isinstance(value, dict) else str(value) for value in (saved, current)]
    return f"{SETTINGS[key]} {shown[0]}, not {shown[1]}"


def read_tuned(path: Path) -> tuple[str, list[str]]:
    """The policy and its `--policy-option` values in a tuned.json written by `kvprof tune-tau`, refused in one sentence
    naming the file when it is not one or names a policy or options this kvprof does not have."""
    from kvprof.commands.tune_tau import TUNED_KIND
    from kvprof.policies import enumerate_variants, parse_policy_options

    fix = "pass the tuned.json `kvprof tune-tau` wrote"
    saved = check_fields(
        read_json_file(path, "--tuned file", fix), {"kind": str, "policy": str, "policy_options": list}, str(path), fix
    )
    if saved["kind"] != TUNED_KIND or not all(isinstance(flag, str) for flag in saved["policy_options"]):
        raise KvprofError(f"--tuned {path} is not a tuned.json written by kvprof tune-tau; {fix}.")
    try:  # the policy and options it names, as the replay will read them
        enumerate_variants([saved["policy"]], parse_policy_options(saved["policy_options"]))
    except KvprofError as err:
        raise KvprofError(f"--tuned {path}: {err}") from None
    return saved["policy"], list(saved["policy_options"])


def print_skipped(skipped: dict[str, str]) -> None:
    """One line per refusal reason, naming the variants it skipped."""
    for reason in dict.fromkeys(skipped.values()):
        labels = ", ".join(label for label, why in skipped.items() if why == reason)
        console.print(f"[yellow]skipped {labels}[/]: {reason}")


def command(
    trace: Annotated[
        Path | None,
        typer.Argument(help="Trace (JSONL) from `kvprof capture` [default: the demo world's sample trace]."),
    ] = None,
    policy: Annotated[
        list[str],
        typer.Option(
            "--policy",
            help=f"Policy to replay, repeatable, or 'all' (every policy, each option over its declared "
            f"sweep): {', '.join(policy_names())}.",
        ),
    ] = ["all"],
    policy_option: Annotated[
        list[str] | None,
        typer.Option(
            "--policy-option",
            help="POLICY.KEY=VALUE: set a policy's option, repeatable (several values of one key "
            "are each replayed). Options: " + policy_option_list() + ".",
        ),
    ] = None,
    schedule: Annotated[
        str | None,
        typer.Option(
            "--schedule",
            help="Shorthand for --policy-option rebaseshared.schedule=VALUE: lp (lazy prefill) or db "
            "(double batching); default lp, both with --policy all.",
        ),
    ] = None,
    lr_prefill: Annotated[
        str | None,
        typer.Option(
            "--lr-prefill",
            help="Shorthand for --policy-option baseshared.lr_prefill=VALUE: code (LRAgent's code: the tokens "
            "since the agent's last turn, attending to the shared base), full (paper text: the whole context "
            "again) or incremental (kvprof); default code, all three with --policy all.",
        ),
    ] = None,
    tuned: Annotated[
        Path | None,
        typer.Option(
            "--tuned",
            help="tuned.json from `kvprof tune-tau`: replay that policy with its tuned options (alone, unless "
            "--policy names others too).",
        ),
    ] = None,
    online: Annotated[
        bool,
        typer.Option(
            "--online",
            help="Also re-run the workflow under each policy (agents generate; errors propagate): "
            "exact-match accuracy and output divergence.",
        ),
    ] = False,
    lora_attention: Annotated[
        str,
        typer.Option(
            "--lora-attention",
            help="How low-rank policies attend: kernel (Flash-LoRA-Attention: Triton on CUDA, its "
            "torch reference on CPU), expand (V_base + V_lr·B, then sdpa) or auto (kernel on "
            "CUDA, expand on CPU).",
        ),
    ] = "auto",
    repeats: Annotated[
        int,
        typer.Option(
            "--repeats",
            min=1,
            help="Timed repeats of each turn's prefill (after one warm-up); TTFT is the median. Above 1, the first "
            "decode step also runs once untimed before the timed ones. With --timing trajectory: timed runs of each "
            "trajectory after its warm-up run.",
        ),
    ] = 3,
    timing: Annotated[
        str,
        typer.Option(
            "--timing",
            help="turn (kvprof): TTFT, TPOT and latency per turn, the median of --repeats after a warm-up of the "
            "same turn on hot caches; trajectory (code: PReCache's bench/single_stream.py): each policy replays "
            "each trajectory alone, once untimed, then --repeats timed runs; TTFT = the sum of the trajectory's "
            "synced prefill calls, mean over the runs.",
        ),
    ] = "turn",
    page_size: Annotated[
        int,
        typer.Option(
            "--page-size",
            min=1,
            help="Tokens per KV block (vLLM's block size) for the memory the papers report: the policy's stored "
            "caches in whole blocks, peak over the replay.",
        ),
    ] = 16,
    min_span: MinSpanOption = MIN_SPAN,
    span_boundaries: SpanBoundariesOption = "messages",
    limit: Annotated[int | None, typer.Option("--limit", help="Replay only the first N trajectories.")] = None,
    skip: Annotated[
        int, typer.Option("--skip", min=0, help="Skip the first N trajectories (e.g. those a pool was fitted on).")
    ] = 0,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="Refuse a trace any of whose turns leaves the shared context the turns before it built, instead of "
            "reusing the longest common prefix and recomputing the rest.",
        ),
    ] = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue an interrupted replay from OUT/replay.partial.json.")
    ] = False,
    model: Annotated[str | None, typer.Option("--model", help="Override the trace's base model.")] = None,
    agent: Annotated[
        list[str] | None,
        typer.Option("--agent", help="NAME=ADAPTER_DIR: override an agent's adapter (e.g. a shared-A set)."),
    ] = None,
    role: Annotated[list[str] | None, typer.Option("--role", help="NAME=PROMPT: override a role prompt.")] = None,
    ray: Annotated[
        bool,
        typer.Option(
            "--ray",
            help="Replay in shards on a Ray cluster (pip install 'kvprof[ray]'): one worker per GPU (without GPUs, "
            "per --ray-worker-cpus CPUs) loads the model once and replays whole trajectories (a variant that keeps "
            "state across trajectories: all of them, in order); the result is merged into the one a single "
            "process writes.",
        ),
    ] = False,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray-address",
            help="With --ray: the cluster's address (HOST:PORT, ray://HOST:PORT, auto: the cluster `ray start` "
            "started on this machine, local: a new instance here) [default: RAY_ADDRESS, else local].",
        ),
    ] = None,
    ray_workers: Annotated[
        int | None,
        typer.Option(
            "--ray-workers", help="With --ray: how many workers [default: one per GPU, else per --ray-worker-cpus]."
        ),
    ] = None,
    ray_worker_cpus: Annotated[
        int,
        typer.Option("--ray-worker-cpus", min=1, help="With --ray: CPUs (and threads) each worker holds [default: 1]."),
    ] = 1,
    out: OutOption = Path("runs/replay"),
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    seed: SeedOption = 0,
) -> None:
    """Replay a trace under sharing policies with real model execution; per-layer error, fidelity, reuse,
    prefill, TTFT, latency and memory against the dense (NonShared) run."""
    args = dict(locals())
    import torch

    from kvprof.model.agents import agents_identity, load_agents_for_trace, trace_header
    from kvprof.model.runtime import Runtime
    from kvprof.policies import runnable_variants
    from kvprof.policies.variants import ALL
    from kvprof.replay.sharded import AgentSource, RayCluster, absolute_files, absolute_source

    torch.manual_seed(seed)
    matching = SpanMatching(min_span, span_boundaries)
    if trace is None:
        trace, model = demo_trace(model)
    trajectories = select_trajectories(trace, skip, limit)  # the whole trace validated before any model loads
    if online:
        from kvprof.capture.workflow import require_react_agents

        require_react_agents(trace_header(trace).agent_names)
    if strict:
        from kvprof.replay.branches import require_one_timeline

        require_one_timeline(trajectories, trace_header(trace).mode)
    from kvprof.replay.engine import TIMINGS

    if timing not in TIMINGS:
        raise KvprofError(f"--timing {timing!r} is not {' or '.join(TIMINGS)}; pass one of them.")
    if lora_attention not in ("auto", "kernel", "expand"):
        raise KvprofError(f"--lora-attention {lora_attention!r} is not auto, kernel or expand; pass one of them.")
    flags = list(policy_option or [])
    if tuned is not None:
        name, tuned_flags = read_tuned(tuned)
        flags += tuned_flags
        policy = [name] if policy == [ALL] else [*policy, name]
    if ray:
        source = absolute_source(AgentSource(trace_header(trace), str(trace), model, agent, role, device, dtype, seed))
        with RayCluster(source, ray_address, ray_workers, ray_worker_cpus, on_wait=note) as cluster:
            loaded = cluster.first()["identity"]
            use_kernel = lora_attention == "kernel" or (lora_attention == "auto" and loaded["device"] != "cpu")
            variants, skipped = choose_variants(
                policy, flags, schedule, lr_prefill, lambda chosen, skip: cluster.runnable(absolute_files(chosen), skip)
            )
            print_skipped(skipped)
            if not variants:
                raise KvprofError("no policy can replay this trace with these agents; see the skipped reasons above.")
            identity = checkpoint_identity(
                trace, loaded, variants, repeats, use_kernel, True, online, timing, page_size, matching
            )
            result = replay_on_ray(
                cluster,
                trace,
                trajectories,
                variants,
                skipped,
                repeats,
                online,
                use_kernel,
                out,
                identity,
                resume,
                timing,
                page_size,
                matching,
            )
        result["self_check"] = None  # the driver loads no model: a sharded replay does not check itself
        finish(out, result, args, workers=result["distributed"].pop("workers"))
        return
    agents = load_agents_for_trace(trace, model=model, agent_flags=agent, role_flags=role, device=device, dtype=dtype)
    print_layers(agents)
    use_kernel = lora_attention == "kernel" or (lora_attention == "auto" and agents.device.type == "cuda")
    runtime = Runtime(agents)
    variants, skipped = choose_variants(
        policy, flags, schedule, lr_prefill, lambda chosen, skip: runnable_variants(chosen, runtime, skip)
    )
    variants, skipped, checked = self_checked(agents, trajectories[0], variants, skipped)
    print_skipped(skipped)
    if not variants:
        raise KvprofError("no policy can replay this trace with these agents; see the skipped reasons above.")
    checkpoint = out / "replay.partial.json"
    identity = checkpoint_identity(
        trace,
        agents_identity(agents),
        variants,
        repeats,
        use_kernel,
        timing=timing,
        page_size=page_size,
        span_matching=matching,
    )
    state = None
    if resume and checkpoint.exists():
        state = read_checkpoint(checkpoint, identity, [t.id for t in trajectories])
        console.print(f"resuming after {len(state.trajectories)} replayed trajectories")
    result = replay_with_progress(
        trace,
        agents,
        trajectories,
        variants,
        skipped,
        repeats=repeats,
        online=online,
        lora_attention=use_kernel,
        state=state,
        on_trajectory=lambda s: write_json(checkpoint, {"identity": identity, "progress": asdict(s)}),
        timing=timing,
        page_size=page_size,
        span_matching=matching,
    )
    result["self_check"] = checked
    finish(out, result, args)


def self_checked(
    agents: AgentSet, trajectory: Trajectory, variants: list[PolicyVariant], skipped: dict[str, str]
) -> tuple[list[PolicyVariant], dict[str, str], dict[str, float]]:
    """`kvprof.replay.self_check` on the user's model: the variants that pass, the skipped ones with those it refuses
    added, and each checked variant's error in its exact setting."""
    from kvprof.replay.self_check import check_on_model, refusals

    if not any(variant.policy.exact_setting for variant in variants):
        return variants, skipped, {}
    with console.status("checking the policies on this model (their exact settings, first turns)"):
        errors = check_on_model(agents, trajectory, variants)
    refused = refusals(agents, errors)
    return [v for v in variants if v.label not in refused], skipped | refused, errors


def select_trajectories(trace: Path, skip: int, limit: int | None) -> list[Trajectory]:
    """The trace's trajectories after the first `skip`, at most `limit` of them (refusing none)."""
    trajectories = list(iter_trajectories(trace))[skip:][:limit]
    if not trajectories:
        raise KvprofError(f"--skip {skip} leaves none of the trace's trajectories to replay; skip fewer.")
    return trajectories


def finish(out: Path, result: dict, args: dict, workers: list[dict] | None = None) -> None:
    """Show the result, write OUT/replay.json (with the Ray `workers` in its environment) and OUT/replay.html,
    and remove the checkpoint."""
    show(result)
    path = write_result(out, "replay", result, args, workers=workers)
    html = write_page(out, result)
    (out / "replay.partial.json").unlink(missing_ok=True)
    console.print(f"wrote {path} and {html}")


def replay_on_ray(
    cluster: RayCluster,
    trace: Path,
    trajectories: list[Trajectory],
    variants: list[PolicyVariant],
    skipped: dict[str, str],
    repeats: int,
    online: bool,
    lora_attention: bool,
    out: Path,
    identity: dict,
    resume: bool,
    timing: str = "turn",
    page_size: int = 16,
    span_matching: SpanMatching = DEFAULT_MATCHING,
) -> dict:
    """`replay_sharded` on `cluster` under one progress display aggregated over its workers, checkpointing every
    completed shard to OUT/replay.partial.json and, with `resume`, continuing from the shards it holds."""
    from kvprof.replay.sharded import ShardHooks, plan_shards, replay_sharded, shard_checkpoint, shard_groups

    checkpoint = out / "replay.partial.json"
    done, groups = None, None
    if resume and checkpoint.exists():
        done, groups = read_shard_checkpoint(checkpoint, identity, trajectories, variants)
    shards = plan_shards(trajectories, variants, cluster.size, groups)
    groups = shard_groups(shards)
    if done is not None:
        console.print(f"resuming after {len(done)} of {len(shards)} replayed shards")
    for group in groups:
        console.print(
            f"{', '.join(group)} {'keeps' if len(group) == 1 else 'keep'} state across trajectories: "
            + (
                "it replays its trajectories in order in one shard, on one worker"
                if len(group) == 1
                else "they replay their trajectories in order, side by side in one shard, on one worker"
            )
        )

    def save(results: dict[str, ShardResult]) -> None:
        write_json(checkpoint, {"identity": identity, "progress": shard_checkpoint(results, groups)})

    with progress() as bar:
        job = bar.add_task(
            f"replaying {len(variants)} policies in {len(shards)} shards on up to {cluster.size} Ray workers",
            total=sum(shard.turns for shard in shards),
        )
        online_job = bar.add_task("online re-runs", total=sum(s.tasks(online) for s in shards)) if online else None

        def show_progress(turns: int, tasks: int) -> None:
            bar.update(job, completed=turns)
            if online_job is not None:
                bar.update(online_job, completed=tasks)

        hooks = ShardHooks(
            on_progress=show_progress, on_shard=save, on_event=lambda line: bar.console.print(f"[yellow]{line}[/]")
        )
        result = replay_sharded(
            cluster,
            trajectories,
            variants,
            repeats,
            online,
            lora_attention,
            done,
            hooks,
            groups,
            timing,
            page_size,
            span_matching,
        )
    result.update(trace=str(trace), trace_source=read_header(trace).source, skipped=skipped)
    return result


def replay_with_progress(
    trace: Path,
    agents: AgentSet,
    trajectories: list[Trajectory],
    variants: list[PolicyVariant],
    skipped: dict[str, str],
    repeats: int,
    online: bool,
    lora_attention: bool,
    state: ReplayProgress | None = None,
    on_trajectory: Callable[[ReplayProgress], object] | None = None,
    timing: str = "turn",
    page_size: int = 16,
    span_matching: SpanMatching = DEFAULT_MATCHING,
) -> dict:
    """`run_replay` under progress bars (teacher-forced turns; online re-runs with `online`), resuming from `state`,
    timed as `timing` says, KV blocks of `page_size` tokens, moved spans as `span_matching` finds them
    (`kvprof.replay.engine.replay_trace`); the result names its trace, the trace's source and the variants `skipped`."""
    from kvprof.replay.engine import ReplayHooks, run_replay

    with progress() as bar:
        job = bar.add_task(f"replaying {len(variants)} policies", total=sum(len(t.turns) for t in trajectories))
        bar.update(job, completed=sum(len(t.turns) for t in trajectories if state and t.id in state.trajectories))
        online_job = bar.add_task("online re-runs", total=len(trajectories) * (len(variants) + 1)) if online else None
        hooks = ReplayHooks(
            on_turn=lambda traj, index: bar.advance(job),
            # online_job is None only without --online, when no online task runs (and on_task is never called).
            on_task=(lambda label, task: bar.advance(online_job)) if online_job is not None else None,
            on_trajectory=on_trajectory,
        )
        result = run_replay(
            agents,
            trajectories,
            variants,
            repeats=repeats,
            online=online,
            lora_attention=lora_attention,
            progress=state,
            hooks=hooks,
            timing=timing,
            page_size=page_size,
            span_matching=span_matching,
        )
    result.update(trace=str(trace), trace_source=read_header(trace).source, skipped=skipped)
    return result


def show(result: dict) -> None:
    """The replay's terminal output: a warning when the dense run does not reproduce a captured trace, then the
    fidelity, reuse and cost tables."""
    from kvprof.report.replay import (
        cost_table,
        delta_table,
        dense_check,
        fidelity_table,
        memory_claims_table,
        policy_notes,
        reuse_table,
        timeline_note,
    )

    check = dense_check(result)
    if check.startswith("WARNING"):
        console.print(f"[bold red]{check}[/]")
    note = timeline_note(result)
    if note:
        console.print(note)
    console.print(fidelity_table(result).to_rich())
    console.print(reuse_table(result).to_rich())
    delta = delta_table(result)
    if delta is not None:
        console.print(delta.to_rich())
    console.print(cost_table(result).to_rich())
    claims = memory_claims_table(result)
    if claims is not None:
        console.print(claims.to_rich())
    for line in policy_notes(result):
        console.print(line)


def write_page(out: Path, result: dict) -> Path:
    """OUT/replay.html: the replay's dashboard page."""
    from kvprof.report import write_html
    from kvprof.report.replay import sections

    return write_html(out / "replay.html", "kvprof replay", sections(result), subtitle=result["trace"])
