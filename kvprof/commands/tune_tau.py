"""`kvprof tune-tau`: sweep a delta-correction policy's acceptance threshold on tuning trajectories, recommend one
for a target, verify it on held-out trajectories, and write it where `kvprof replay --tuned` reads it.

The maths lives in `kvprof.tuning.tau` (and the pool fit in `kvprof.tuning.anchor_fit`); this module parses options,
shows progress, checkpoints the sweep (`--resume`: trajectory by trajectory in one process, shard by shard on Ray), and
renders `kvprof.report.anchors`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvprof.cli_help import tune_grid
from kvprof.commands.common import (
    DeviceOption,
    DtypeOption,
    MinSpanOption,
    OutOption,
    SeedOption,
    SpanBoundariesOption,
    console,
    demo_prompt_trace,
    note,
    progress,
    write_result,
)
from kvprof.commands.fit_anchors import POOL_FILE
from kvprof.errors import KvprofError
from kvprof.fileio import read_json_file, write_json
from kvprof.traces.reuse import MIN_SPAN, SpanMatching
from kvprof.traces.trace import Trajectory, read_trace

if TYPE_CHECKING:
    from kvprof.tuning.tau import Replayer

TUNED_KIND = "kvprof.tuned-policy"


def parse_grid(text: str) -> list[str]:
    values = [piece.strip() for piece in text.split(",") if piece.strip()]
    try:
        if not values or any(not 0.0 <= float(v) <= 1.0 for v in values):
            raise ValueError
    except ValueError:
        raise KvprofError(
            f"--grid {text!r} is not a list of thresholds in [0, 1]; pass e.g. --grid 0,0.2,0.5,1."
        ) from None
    return list(dict.fromkeys(values))


def parse_options(policy: str, flags: list[str]) -> dict[str, str]:
    """KEY=VALUE flags → the policy's other options, checked against its declared ones."""
    from kvprof.policies import policy_class

    cls = policy_class(policy)
    options = {}
    for flag in flags:
        key, sep, value = flag.partition("=")
        if not sep or key not in cls.options:
            raise KvprofError(
                f"--option {flag!r} is not KEY=VALUE with a {cls.name} option ({', '.join(cls.options)})."
            )
        cls.options[key].check(cls.name, key, value)
        options[key] = value
    return options


def command(
    trace: Annotated[
        Path | None,
        typer.Argument(help="Prompt-mode trace: tuning then held-out trajectories [default: the demo's tuning trace]."),
    ] = None,
    policy: Annotated[str, typer.Option("--policy", help="Policy to tune: kvcmas (τ) or kvcomm (γ).")] = "kvcmas",
    grid: Annotated[str, typer.Option("--grid", help="Thresholds to sweep, comma-separated.")] = ",".join(tune_grid()),
    option: Annotated[
        list[str] | None,
        typer.Option("--option", help="KEY=VALUE: another option of the policy (e.g. chain=star), repeatable."),
    ] = None,
    anchors: Annotated[
        Path | None,
        typer.Option(
            "--anchors",
            help="Anchor pool from `kvprof fit-anchors` to start every row from [default: fit one on the tuning "
            "trajectories, saved to OUT/anchors.safetensors].",
        ),
    ] = None,
    tune_count: Annotated[
        int | None,
        typer.Option("--tune", help="Tuning trajectories: the first N [default: half]; the rest are held out."),
    ] = None,
    max_accuracy_drop: Annotated[
        float | None,
        typer.Option("--max-accuracy-drop", help="Target: accuracy at most P points below dense [default: 1]."),
    ] = None,
    max_kl: Annotated[float | None, typer.Option("--max-kl", help="Target: KL at most X nats per token.")] = None,
    target_rho: Annotated[
        float | None,
        typer.Option("--target-rho", help="Target: matched reuse, the smallest ρ at least R (papers compare at 0.8)."),
    ] = None,
    online: Annotated[
        bool, typer.Option("--online/--no-online", help="Re-run the workflow per threshold (accuracy).")
    ] = True,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed repeats of each prefill.")] = 1,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue an interrupted sweep from OUT/tune_tau.partial.json.")
    ] = False,
    model: Annotated[str | None, typer.Option("--model", help="Override the trace's base model.")] = None,
    role: Annotated[list[str] | None, typer.Option("--role", help="NAME=PROMPT: override a role prompt.")] = None,
    ray: Annotated[
        bool,
        typer.Option(
            "--ray",
            help="Replay the sweep in shards on a Ray cluster (as kvprof replay --ray; each threshold is a "
            "stateful variant: the values run in as many sequential shards as the workers make fastest). The pool is "
            "fitted here.",
        ),
    ] = False,
    ray_address: Annotated[
        str | None, typer.Option("--ray-address", help="With --ray: the cluster's address [default: RAY_ADDRESS].")
    ] = None,
    ray_workers: Annotated[int | None, typer.Option("--ray-workers", help="With --ray: how many workers.")] = None,
    ray_worker_cpus: Annotated[
        int, typer.Option("--ray-worker-cpus", min=1, help="With --ray: CPUs (and threads) each worker holds.")
    ] = 1,
    min_span: MinSpanOption = MIN_SPAN,
    span_boundaries: SpanBoundariesOption = "messages",
    out: OutOption = Path("runs/tune-tau"),
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    seed: SeedOption = 0,
) -> None:
    """Sweep the acceptance threshold (τ of KVCMAS, γ of KVComm): reuse ρ, per-layer error, KL, accuracy, TTFT,
    latency and memory per value; recommend the value with the most reuse that meets the target, verify it on the
    held-out trajectories, and write it to OUT/tuned.json for `kvprof replay --tuned`."""
    args = dict(locals())
    import torch

    from kvprof.model.agents import load_agents_for_trace
    from kvprof.model.runtime import Runtime
    from kvprof.policies import policy_class
    from kvprof.policies.anchors import pool_digest
    from kvprof.policies.delta import pool_identity
    from kvprof.replay.engine import ReplayHooks, ReplayProgress
    from kvprof.tuning.anchor_fit import fit_anchors
    from kvprof.tuning.tau import Target, in_process, threshold_key, tune

    torch.manual_seed(seed)
    matching = SpanMatching(min_span, span_boundaries)
    key = threshold_key(policy)
    if max_accuracy_drop is None and max_kl is None and target_rho is None:
        max_accuracy_drop = 1.0
    target = Target(max_accuracy_drop, max_kl, target_rho)
    thresholds = parse_grid(grid)
    options = parse_options(policy, option or [])
    if key in options or "anchors" in options:
        raise KvprofError(f"--option {key}/anchors: the sweep sets {key}, and --anchors names the pool.")
    if trace is None:
        trace, model = demo_prompt_trace(model)
        args.update(trace=trace, model=model)
    trajectories = read_trace(trace).trajectories  # the whole trace validated before the model loads
    with ExitStack() as stack:
        cluster = None
        if ray:
            from kvprof.model.agents import trace_header
            from kvprof.replay.sharded import AgentSource, RayCluster, require_ray

            require_ray()
            source = AgentSource(trace_header(trace), str(trace), model, None, role, device, dtype, seed)
            cluster = stack.enter_context(RayCluster(source, ray_address, ray_workers, ray_worker_cpus, on_wait=note))
            # The pool is fitted here, on the CPU, in the workers' dtype (they refuse a pool of another dtype).
            worker = cluster.first()["identity"]
            device, dtype = "cpu", worker["dtype"]
        agents = load_agents_for_trace(trace, model=model, role_flags=role, device=device, dtype=dtype)
        if agents.spec.mode != "prompt":
            raise KvprofError(f"{trace} is a {agents.spec.mode}-mode trace; tune-tau tunes prompt-mode policies.")
        count = tune_count if tune_count is not None else max(1, len(trajectories) // 2)
        if not 1 <= count <= len(trajectories):
            raise KvprofError(f"--tune {count} must be between 1 and the trace's {len(trajectories)} trajectories.")
        tuning, heldout = trajectories[:count], trajectories[count:]
        cls = policy_class(policy)
        if anchors is None:
            rank = None if cls.name == "kvcomm" else int(options.get("rank", cls.options["rank"].default))
            capacity = int(options.get("anchors_per_slot", cls.options["anchors_per_slot"].default))
            with progress() as bar:
                job = bar.add_task("fitting anchors on the tuning trajectories", total=len(tuning))
                pool, _ = fit_anchors(
                    agents, tuning, rank, capacity, on_trajectory=lambda traj: bar.advance(job), span_matching=matching
                )
            anchors = pool.save(out / POOL_FILE, pool_identity(Runtime(agents)))
        # Ray workers open the pool themselves: at the same absolute path on every node.
        options["anchors"] = str(Path(anchors).resolve()) if cluster is not None else str(anchors)
        checkpoint = out / "tune_tau.partial.json"
        identity = {
            "trace": "sha256:" + hashlib.sha256(Path(trace).read_bytes()).hexdigest(),
            "pool": pool_digest(anchors),
            "policy": cls.name,
            "grid": thresholds,
            "options": {k: v for k, v in options.items() if k != "anchors"},
            "tune": count,
            "online": online,
            "repeats": repeats,
            "span_matching": matching.to_json(),
            "model": agents.model_name,
            "dtype": str(agents.base_model.dtype),
            "device": str(agents.device),
        }
        workers = None
        if cluster is not None:
            identity |= {"sharding": "ray", "device": worker["device"]}
            saved = read_sweep_checkpoint(checkpoint, identity) if resume and checkpoint.exists() else None
            replay = on_ray(cluster, repeats, online, checkpoint, identity, saved, matching)
            result = tune(replay, tuning, heldout, cls.name, options, thresholds, target, online)
            workers = [{k: v for k, v in info.items() if k != "identity"} for info in cluster.described.values()]
        else:
            state = None
            if resume and checkpoint.exists():
                state = ReplayProgress.of_checkpoint(read_sweep_checkpoint(checkpoint, identity), checkpoint)
                console.print(f"resuming after {len(state.trajectories)} replayed tuning trajectories")
            with progress() as bar:
                turns = bar.add_task(
                    f"replaying {len(thresholds)} values of {key} in lockstep", total=sum(len(t.turns) for t in tuning)
                )
                bar.update(turns, completed=sum(len(t.turns) for t in tuning if state and t.id in state.trajectories))
                tasks = bar.add_task("online re-runs", total=len(tuning) * (len(thresholds) + 1)) if online else None
                hooks = ReplayHooks(
                    on_turn=lambda traj, index: bar.advance(turns),
                    on_task=(lambda label, task: bar.advance(tasks)) if tasks is not None else None,
                    on_trajectory=lambda s: write_json(checkpoint, {"identity": identity, "progress": asdict(s)}),
                )
                replay = in_process(agents, repeats, online, state, hooks, matching)
                result = tune(replay, tuning, heldout, cls.name, options, thresholds, target, online)
    finish(out, result, args, trace, anchors, agents.model_name, checkpoint, workers)


def read_sweep_checkpoint(checkpoint: Path, identity: dict) -> dict:
    """The progress record an interrupted sweep left in `checkpoint`, refusing one made with other settings (a
    sweep on Ray checkpoints shards, one in this process trajectories: each refuses the other's)."""
    saved = read_json_file(checkpoint, "checkpoint", "delete it to start again")
    if not isinstance(saved, dict) or saved.get("identity") != identity:
        raise KvprofError(
            f"checkpoint {checkpoint} was made with other settings (or with/without --ray); resume with the options "
            "it was made with, or delete it to start again."
        )
    progress = saved.get("progress")
    shape = ("shards", "groups") if identity.get("sharding") else ("trajectories", "records")
    if not isinstance(progress, dict) or any(key not in progress for key in shape):
        raise KvprofError(f"checkpoint {checkpoint} is not a tune-tau checkpoint; delete it to start again.")
    return progress


def on_ray(
    cluster,
    repeats: int,
    online: bool,
    checkpoint: Path,
    identity: dict,
    saved: dict | None,
    span_matching: SpanMatching,
) -> Replayer:
    """A `kvprof.tuning.tau.Replayer` that replays in shards on `cluster` (`kvprof.replay.sharded.replay_sharded`: every
    threshold is a stateful variant, so the values are grouped into sequential shards, as many as the cluster's
    workers make fastest), under a progress bar. The sweep checkpoints every completed shard to `checkpoint` and
    continues from `saved` (a checkpoint's progress: its shards and their grouping); the held-out check is not
    checkpointed."""
    from kvprof.policies import PolicyVariant
    from kvprof.replay.sharded import (
        ShardHooks,
        ShardResult,
        plan_shards,
        replay_sharded,
        resumable,
        saved_shards,
        shard_checkpoint,
        shard_groups,
    )

    def replay(trajectories: Sequence[Trajectory], variants: list[PolicyVariant], sweep: bool) -> dict:
        done, groups = None, None
        if sweep and saved is not None:
            done, groups = resumable(saved_shards(saved, checkpoint), saved["groups"], list(trajectories), variants)
        shards = plan_shards(list(trajectories), variants, cluster.size, groups)
        groups = shard_groups(shards)
        if done is not None:
            console.print(f"resuming after {len(done)} of {len(shards)} replayed shards")

        def save(results: dict[str, ShardResult]) -> None:
            write_json(checkpoint, {"identity": identity, "progress": shard_checkpoint(results, groups)})

        label = f"replaying {len(variants)} variants in {len(shards)} shards on {cluster.size} Ray workers"
        with progress() as bar:
            job = bar.add_task(label, total=sum(shard.turns for shard in shards))
            tasks = (
                bar.add_task("online re-runs", total=sum(shard.tasks(online) for shard in shards)) if online else None
            )

            def show_progress(turns: int, done_tasks: int) -> None:
                bar.update(job, completed=turns)
                if tasks is not None:
                    bar.update(tasks, completed=done_tasks)

            hooks = ShardHooks(
                on_progress=show_progress,
                on_shard=save if sweep else None,
                on_event=lambda line: bar.console.print(f"[yellow]{line}[/]"),
            )
            result = replay_sharded(
                cluster,
                list(trajectories),
                variants,
                repeats,
                online,
                False,
                done,
                hooks,
                groups,
                span_matching=span_matching,
            )
        result.pop("distributed")
        return result

    return replay


def finish(
    out: Path, result: dict, args: dict, trace, anchors, model: str, checkpoint: Path, workers: list[dict] | None = None
) -> None:
    """Show the sweep and its recommendation, write tune_tau.json (with the Ray `workers` in its environment) /
    .html and tuned.json, drop the checkpoint."""
    from kvprof.report import write_html
    from kvprof.report.anchors import sweep_table, tune_sections, verification_lines
    from kvprof.tuning.tau import replay_flags

    result.update(trace=str(trace), model=model, pool=str(anchors))
    console.print(sweep_table(result).to_rich())
    for line in verification_lines(result):
        console.print(line, markup=False)
    path = write_result(out, "tune_tau", result, args, workers=workers)
    html = write_html(out / "tune_tau.html", "kvprof tune-tau", tune_sections(result), subtitle=str(trace))
    outputs = [str(path), str(html)]
    if result["recommended"] is not None:
        tuned = write_json(
            out / "tuned.json",
            {
                "kind": TUNED_KIND,
                "policy": result["policy"],
                "policy_options": replay_flags(result),
                "target": result["target"],
                "heldout_target_met": None if result["heldout"] is None else result["heldout"]["target_met"],
            },
        )
        outputs.append(str(tuned))
    checkpoint.unlink(missing_ok=True)
    console.print(f"wrote {', '.join(outputs)}")
