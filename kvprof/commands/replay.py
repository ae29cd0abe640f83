"""`kvprof replay`: a trace under one sharing policy or all of them, against the dense run."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvprof.cli_help import policy_names, policy_option_list
from kvprof.commands import common, displays, options, planning
from kvprof.errors import KvprofError
from kvprof.traces.reuse import MIN_SPAN

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvprof.policies import PolicyVariant
    from kvprof.policies.variants import Runnable
    from kvprof.replay.ray_cluster import AgentSource, RayCluster
    from kvprof.replay.setting import ReplaySettings
    from kvprof.results.replay import ReplayResult
    from kvprof.traces.trace import Trajectory

CHECKPOINT = "replay.partial.json"
SELF_CHECK = "checking the policies on this model (their exact settings, first turns)"
HELP = {
    "policy": f"Policy to replay, repeatable, or 'all' (every policy, each option over its declared sweep): "
    f"{', '.join(policy_names())}.",
    "policy_option": "POLICY.KEY=VALUE: set a policy's option, repeatable (several values of one key are each "
    "replayed). Options: " + policy_option_list() + ".",
    "schedule": "Shorthand for --policy-option rebaseshared.schedule=VALUE: lp (lazy prefill) or db (double "
    "batching); default lp, both with --policy all.",
    "lr_prefill": "Shorthand for --policy-option baseshared.lr_prefill=VALUE: code (LRAgent's code: the tokens since "
    "the agent's last turn, attending to the shared base), full (paper text: the whole context again) or incremental "
    "(kvprof); default code, all three with --policy all.",
    "tuned": "tuned.json from `kvprof tune-tau`: replay that policy with its tuned options (alone, unless --policy "
    "names others too).",
    "online": "Also re-run the workflow under each policy (agents generate; errors propagate): exact-match accuracy "
    "and output divergence.",
    "lora_attention": "How low-rank policies attend: kernel (Flash-LoRA-Attention: Triton on CUDA, its torch "
    "reference on CPU), expand (V_base + V_lr·B, then sdpa) or auto (kernel on CUDA; on CPU, the kernel in forwards "
    "of few tokens over at least 4096 cached ones, where it moves fewer bytes, expand in the others).",
    "repeats": "Timed repeats of each turn's prefill (after one warm-up); TTFT is the median. Above 1, the "
    "prefills of a turn are timed round-robin across the dense run and the policies, and the first decode step "
    "also runs once untimed before the timed ones. With --timing trajectory: timed runs of each trajectory after "
    "its warm-up run.",
    "timing": "turn (kvprof): TTFT, TPOT and latency per turn, the median of --repeats after a warm-up round, a "
    "turn's prefills timed round-robin across the runs; trajectory (code: PReCache's bench/single_stream.py): each "
    "policy replays each trajectory alone, once untimed, then --repeats timed runs; TTFT = the sum of the "
    "trajectory's synced prefill calls, mean over the runs.",
    "page_size": "Tokens per KV block (vLLM's block size) for the memory the papers report: the policy's stored "
    "caches in whole blocks, peak over the replay.",
    "skip": "Skip the first N trajectories (e.g. those a pool was fitted on).",
    "strict": "Refuse a trace any of whose turns leaves the shared context the turns before it built, instead of "
    "reusing the longest common prefix and recomputing the rest.",
    "resume": f"Continue an interrupted replay from OUT/{CHECKPOINT}.",
    "ray": "Replay in shards on a Ray cluster (pip install 'kvprof[ray]'): one worker per GPU (without GPUs, per "
    "--ray-worker-cpus CPUs) loads the model once and replays whole trajectories (a variant that keeps state across "
    "trajectories: all of them, in order); the result is merged into the one a single process writes.",
}


def command(
    trace: options.TraceArgument = None,
    policy: Annotated[list[str], typer.Option("--policy", help=HELP["policy"])] = ["all"],
    policy_option: Annotated[list[str] | None, typer.Option("--policy-option", help=HELP["policy_option"])] = None,
    schedule: Annotated[str | None, typer.Option("--schedule", help=HELP["schedule"])] = None,
    lr_prefill: Annotated[str | None, typer.Option("--lr-prefill", help=HELP["lr_prefill"])] = None,
    tuned: Annotated[Path | None, typer.Option("--tuned", help=HELP["tuned"])] = None,
    online: Annotated[bool, typer.Option("--online", help=HELP["online"])] = False,
    lora_attention: Annotated[str, typer.Option("--lora-attention", help=HELP["lora_attention"])] = "auto",
    repeats: Annotated[int, typer.Option("--repeats", min=1, help=HELP["repeats"])] = 3,
    timing: Annotated[str, typer.Option("--timing", help=HELP["timing"])] = "turn",
    page_size: Annotated[int, typer.Option("--page-size", min=1, help=HELP["page_size"])] = 16,
    min_span: options.MinSpanOption = MIN_SPAN,
    span_boundaries: options.SpanBoundariesOption = "messages",
    checkpoints: options.CheckpointsOption = "vllm",
    checkpoint_interval: options.CheckpointIntervalOption = None,
    retention_interval: options.CheckpointRetentionOption = "0",
    kernel_block: options.KernelBlockOption = "gpu",
    limit: options.LimitOption = None,
    skip: Annotated[int, typer.Option("--skip", min=0, help=HELP["skip"])] = 0,
    strict: Annotated[bool, typer.Option("--strict", help=HELP["strict"])] = False,
    resume: Annotated[bool, typer.Option("--resume", help=HELP["resume"])] = False,
    model: options.ModelOverrideOption = None,
    agent: options.AgentOverrideOption = None,
    role: options.RoleOverrideOption = None,
    ray: Annotated[bool, typer.Option("--ray", help=HELP["ray"])] = False,
    ray_address: options.RayAddressOption = None,
    ray_workers: options.RayWorkersOption = None,
    ray_worker_cpus: options.RayWorkerCpusOption = 1,
    out: options.OutOption = Path("runs/replay"),
    device: options.DeviceOption = "auto",
    dtype: options.DtypeOption = "auto",
    threads: options.ThreadsOption = None,
    seed: options.SeedOption = 0,
    plan: planning.PlanOption = False,
    kv_budget: planning.KvBudgetOption = None,
) -> None:
    """Replay a trace under sharing policies with real model execution; per-layer error, fidelity, reuse,
    prefill, TTFT, latency and memory against the dense (NonShared) run."""
    args = dict(locals())
    common.use_threads(threads)
    import torch

    from kvprof.model.agents import trace_header
    from kvprof.policies.variants import choose_variants
    from kvprof.replay.engine import replayed_trajectories
    from kvprof.replay.ray_cluster import AgentSource, RayCluster, absolute_source
    from kvprof.replay.setting import ReplaySettings, check_setting
    from kvprof.report.terminal import show_replay, write_replay_page
    from kvprof.tuning.tuned import with_tuned

    torch.manual_seed(seed)
    if trace is None:
        trace, model = common.demo_trace(model)
    trajectories = replayed_trajectories(trace, skip, limit, online, strict)  # validated before any model loads
    check_setting(timing, lora_attention)
    if (planned := planning.plan_first("replay", args, trace, model)).stop:
        return
    policy, flags = with_tuned(policy, list(policy_option or []), tuned)
    choose = partial(choose_variants, policy, flags, schedule, lr_prefill)
    span_matching = options.span_matching(
        min_span, span_boundaries, checkpoints, checkpoint_interval, retention_interval, kernel_block
    )
    settings = ReplaySettings(
        repeats, online, timing=timing, page_size=page_size, span_matching=span_matching, kv_budget=planned.kv_budget
    )
    replay = Replay(trace, trajectories, choose, lora_attention, out / CHECKPOINT, resume, settings)
    source = AgentSource(trace_header(trace), str(trace), model, agent, role, device, dtype, seed)
    if ray:
        result = replay.on_ray(
            RayCluster(absolute_source(source), ray_address, ray_workers, ray_worker_cpus, on_wait=common.note)
        )
        workers = (result.distributed or {}).pop("workers", None)
    else:
        result, workers = replay.in_process(source), None
    show_replay(result)
    path = common.write_result(out, "replay", result, args, workers=workers)
    html = write_replay_page(out, result)
    (out / CHECKPOINT).unlink(missing_ok=True)
    common.console.print(f"wrote {path} and {html}")


@dataclass(frozen=True)
class Replay:
    """A replay here or on Ray: trace, trajectories, `choose` (variants among a setup's), --lora-attention (resolved
    on the loaded agents' device), checkpoint, --resume, the other `settings` (--kv-budget: in process only)."""

    trace: Path
    trajectories: list[Trajectory]
    choose: Callable[[Runnable], tuple[list[PolicyVariant], dict[str, str]]]
    lora_attention: str
    checkpoint_path: Path
    resume: bool
    settings: ReplaySettings

    def in_process(self, source: AgentSource) -> ReplayResult:
        """In this process: variants self-checked on the agents first, checkpointed per trajectory."""
        from kvprof.kernels.expansion import expansion_path
        from kvprof.model.agents import agents_identity
        from kvprof.model.runtime import Runtime
        from kvprof.policies import runnable_variants
        from kvprof.replay.checkpoint import Checkpoint, replay_identity
        from kvprof.replay.engine import replay_file
        from kvprof.replay.self_check import checked_variants
        from kvprof.replay.setting import lora_attention_mode
        from kvprof.report.terminal import print_layers, replay_progress

        agents = source.load()
        print_layers(agents)
        mode, runtime = lora_attention_mode(self.lora_attention, agents.device.type), Runtime(agents)
        settings = replace(self.settings, lora_attention=mode)
        variants, skipped = self.choose(lambda chosen, skip: runnable_variants(chosen, runtime, skip))
        with common.console.status(SELF_CHECK) if any(v.policy.exact_setting for v in variants) else nullcontext():
            variants, skipped, checked = checked_variants(agents, self.trajectories[0], variants, skipped)
        require_variants(variants, skipped)
        identity = replay_identity(
            self.trace, agents_identity(agents), variants, settings, expansion=expansion_path(agents.device.type)
        )
        checkpoint = Checkpoint(self.checkpoint_path, identity)
        state = displays.resumed_progress(checkpoint, self.resume, self.trajectories, "trajectories")
        label = f"replaying {len(variants)} policies"
        with replay_progress(label, self.trajectories, len(variants), settings.online, state, checkpoint) as hooks:
            return replay_file(
                self.trace, agents, self.trajectories, variants, settings,
                skipped=skipped, self_check=checked, progress=state, hooks=hooks,
            )  # fmt: skip

    def on_ray(self, cluster: RayCluster) -> ReplayResult:
        """In shards on `cluster`, checkpointed per shard; variants chosen on a worker's agents, not self-checked
        (the driver loads no model)."""
        from kvprof.replay.checkpoint import Checkpoint, replay_identity
        from kvprof.replay.engine import with_trace
        from kvprof.replay.ray_cluster import absolute_files
        from kvprof.replay.setting import lora_attention_mode

        with cluster:
            first = cluster.first()
            loaded = first["identity"]
            mode = lora_attention_mode(self.lora_attention, loaded["device"])
            settings = replace(self.settings, lora_attention=mode, kv_budget=None)  # workers hold their stores whole
            variants, skipped = self.choose(lambda chosen, skip: cluster.runnable(absolute_files(chosen), skip))
            require_variants(variants, skipped)
            identity = replay_identity(
                self.trace, loaded, variants, settings, expansion=first["expansion"], sharded=True
            )
            checkpoint = Checkpoint(self.checkpoint_path, identity)
            what = f"{len(variants)} policies"
            result = displays.replay_on_ray(
                cluster, self.trajectories, variants, what, checkpoint, self.resume, settings
            )
        return with_trace(result, self.trace, skipped, None)


def require_variants(variants: list[PolicyVariant], skipped: dict[str, str]) -> None:
    """Print the skipped variants; refuse a replay left with none."""
    from kvprof.report.terminal import print_skipped

    print_skipped(skipped)
    if not variants:
        raise KvprofError("no policy can replay this trace with these agents; see the skipped reasons above.")
