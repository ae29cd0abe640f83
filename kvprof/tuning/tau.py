"""Choosing a delta policy's gate threshold (`kvprof tune-tau`; docs/commands/tune-tau.md): sweep it on tuning
trajectories, recommend the value with most reuse meeting a `Target`, verify it on held-out trajectories.

All thresholds are variants of one lockstep `run_replay` (the dense run once; once per sequential shard on Ray),
from the same pool (`anchors`), which grows online. Row: ρ (share of others' segment tokens the gate served
corrected), per-layer K/V error, KL, top-1, speed-ups, memory; with `online`, accuracy and its drop in points.
Targets: accuracy drop, KL (the highest ρ meeting it; ties: lower KL, then stricter threshold), or `target_rho` (the
smallest ρ ≥ R: the paper's matched reuse, ρ ≈ 0.8).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.model.agents import AgentSet
from kvprof.model.runtime import Runtime
from kvprof.policies import PolicyVariant, policy_class
from kvprof.policies.anchors import POOL_FILE, pool_digest
from kvprof.policies.delta import pool_identity
from kvprof.replay.checkpoint import trace_digest
from kvprof.replay.engine import ReplayHooks, run_replay
from kvprof.replay.lockstep import ReplayProgress
from kvprof.replay.records import DENSE
from kvprof.replay.setting import ReplaySettings
from kvprof.results.replay import ReplayResult, summary_of
from kvprof.results.tune_tau import SweepDense, SweepRow, TuneTauResult
from kvprof.traces.reuse import SpanMatching
from kvprof.traces.trace import Trajectory
from kvprof.tuning.anchor_fit import fit_anchors

THRESHOLDS = {"kvcmas": "tau", "kvcomm": "gamma"}  # the gate threshold option of each tunable policy
GRID = ("0", "0.05", "0.1", "0.2", "0.3", "0.4", "0.5", "0.7", "1")


# How a refusal to resume a sweep names each setting `sweep_identity` records.
SWEEP_SETTINGS = {
    "trace": "another trace",
    "pool": "another anchor pool (--anchors)",
    "policy": "--policy",
    "grid": "--grid",
    "options": "--option",
    "tune": "--tune",
    "online": "--online/--no-online",
    "repeats": "--repeats",
    "span_matching": "--min-span / --span-boundaries",
    "model": "--model",
    "dtype": "--dtype",
    "device": "--device",
    "sharding": "with/without --ray (a sweep on Ray checkpoints shards, one in this process trajectories)",
}


def parse_grid(text: str) -> list[str]:
    """--grid: comma-separated thresholds in [0, 1], each once."""
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
    """KEY=VALUE flags → the policy's other options, checked; the threshold (swept) and the pool (--anchors) are not
    among them."""
    cls, key = policy_class(policy), threshold_key(policy)
    options = {}
    for flag in flags:
        name, sep, value = flag.partition("=")
        if not sep or name not in cls.options:
            raise KvprofError(
                f"--option {flag!r} is not KEY=VALUE with a {cls.name} option ({', '.join(cls.options)})."
            )
        cls.options[name].check(cls.name, name, value)
        options[name] = value
    if key in options or "anchors" in options:
        raise KvprofError(f"--option {key}/anchors: the sweep sets {key}, and --anchors names the pool.")
    return options


def split_trajectories(
    agents: AgentSet, trace: Path, trajectories: list[Trajectory], tune_count: int | None
) -> tuple[list[Trajectory], list[Trajectory]]:
    """Tuning trajectories (the first `tune_count`, default half) and the held-out rest of a prompt-mode trace."""
    if agents.spec.mode != "prompt":
        raise KvprofError(f"{trace} is a {agents.spec.mode}-mode trace; tune-tau tunes prompt-mode policies.")
    count = tune_count if tune_count is not None else max(1, len(trajectories) // 2)
    if not 1 <= count <= len(trajectories):
        raise KvprofError(f"--tune {count} must be between 1 and the trace's {len(trajectories)} trajectories.")
    return trajectories[:count], trajectories[count:]


def fit_pool(
    agents: AgentSet,
    tuning: list[Trajectory],
    policy: str,
    options: dict[str, str],
    out: Path,
    span_matching: SpanMatching,
    on_trajectory: Callable[[Trajectory], None] | None = None,
) -> Path:
    """The default starting pool: fitted on the tuning trajectories at the policy's stored rank (KVComm: full) and
    anchors per slot, saved to OUT/anchors.safetensors."""
    cls = policy_class(policy)
    rank = None if cls.name == "kvcomm" else int(options.get("rank", cls.options["rank"].default))
    capacity = int(options.get("anchors_per_slot", cls.options["anchors_per_slot"].default))
    pool, _ = fit_anchors(agents, tuning, rank, capacity, on_trajectory=on_trajectory, span_matching=span_matching)
    return pool.save(out / POOL_FILE, pool_identity(Runtime(agents)))


def sweep_identity(
    trace: Path,
    pool: Path,
    agents: AgentSet,
    policy: str,
    grid: list[str],
    options: dict[str, str],
    tune_count: int,
    settings: ReplaySettings,
    ray_worker: dict | None = None,
) -> dict:
    """The settings a sweep's records (and checkpoint) depend on: trace and pool content, policy, grid, options,
    tuning count, the replay's online, repeats and span matching, model, dtype, device (`ray_worker`: a worker's, on
    Ray)."""
    identity = {
        "trace": trace_digest(trace),
        "pool": pool_digest(pool),
        "policy": policy_class(policy).name,
        "grid": grid,
        "options": {k: v for k, v in options.items() if k != "anchors"},
        "tune": tune_count,
        "online": settings.online,
        "repeats": settings.repeats,
        "span_matching": settings.span_matching.to_json(),
        "model": agents.model_name,
        "dtype": str(agents.base_model.dtype),
        "device": str(agents.device),
    }
    return identity if ray_worker is None else identity | {"sharding": "ray", "device": ray_worker["device"]}


def threshold_key(policy: str) -> str:
    """The threshold option of a tunable policy, or a `KvprofError` naming those that have one."""
    name = policy_class(policy).name
    if name not in THRESHOLDS:
        raise KvprofError(
            f"policy {name} has no acceptance threshold to tune; pass --policy {' or '.join(THRESHOLDS)}."
        )
    return THRESHOLDS[name]


@dataclass(frozen=True)
class Target:
    """What a recommended threshold must meet; exactly one of the three is set."""

    max_accuracy_drop: float | None = None  # points of exact-match accuracy below the dense re-run
    max_kl: float | None = None  # mean KL(dense ‖ policy) per output token, nats
    target_rho: float | None = None  # the smallest ρ at least this

    def __post_init__(self) -> None:
        given = [v for v in (self.max_accuracy_drop, self.max_kl, self.target_rho) if v is not None]
        if len(given) != 1:
            raise KvprofError("give exactly one target: --max-accuracy-drop POINTS, --max-kl NATS or --target-rho R.")

    @classmethod
    def given(cls, max_accuracy_drop: float | None, max_kl: float | None, target_rho: float | None) -> Target:
        """The target the options give; none given: an accuracy drop of at most 1 point."""
        if max_accuracy_drop is None and max_kl is None and target_rho is None:
            max_accuracy_drop = 1.0
        return cls(max_accuracy_drop, max_kl, target_rho)

    @property
    def needs_online(self) -> bool:
        return self.max_accuracy_drop is not None

    def describe(self) -> str:
        if self.max_accuracy_drop is not None:
            return f"accuracy at most {self.max_accuracy_drop:g} points below the dense run"
        if self.max_kl is not None:
            return f"KL(dense ‖ policy) at most {self.max_kl:g} nats per output token"
        return f"reuse ρ at least {self.target_rho:g}"

    def met(self, row: SweepRow) -> bool:
        if self.max_accuracy_drop is not None:
            return row.accuracy_drop is not None and row.accuracy_drop <= self.max_accuracy_drop + 1e-9
        if self.max_kl is not None:
            return row.kl <= self.max_kl
        assert self.target_rho is not None
        return row.rho >= self.target_rho - 1e-9


def row_of(replay: ReplayResult, variant: PolicyVariant, threshold: str) -> SweepRow:
    """One threshold's measurements from a replay result holding `variant` (see module docstring)."""
    summary = summary_of(variant.label, replay.policies[variant.label])
    row = SweepRow(
        threshold=float(threshold),
        label=variant.label,
        rho=summary.delta_reuse or 0.0,
        kl=summary.kl,
        top1=summary.top1,
        k_error=summary.k_error,
        v_error=summary.v_error,
        layers=summary.layers,
        prefilled=summary.prefilled,
        dense_prefilled=summary_of(DENSE, replay.dense).prefilled,
        ttft_speedup=summary.ttft_speedup,
        latency_speedup=summary.latency_speedup,
        memory_ratio=summary.memory_ratio,
        peak_memory_bytes=summary.peak_memory_bytes,
        accuracy=None,
        dense_accuracy=None,
        accuracy_drop=None,
    )
    if replay.online is not None:
        accuracy, dense = replay.online[variant.label]["accuracy"], replay.online[DENSE]["accuracy"]
        row = replace(row, accuracy=accuracy, dense_accuracy=dense, accuracy_drop=100.0 * (dense - accuracy))
    return row


def recommend(rows: Sequence[SweepRow], target: Target) -> SweepRow | None:
    """The recommended row (see module docstring), or None when no threshold meets the target."""
    meeting = [row for row in rows if target.met(row)]
    if not meeting:
        return None
    if target.target_rho is not None:
        return min(meeting, key=lambda row: (row.rho, row.kl, row.threshold))
    return max(meeting, key=lambda row: (row.rho, -row.kl, -row.threshold))


def pareto(rows: Sequence[SweepRow]) -> list[SweepRow]:
    """Rows no other row beats on both reuse (higher ρ) and KL (lower), by ρ."""

    def beats(other: SweepRow, row: SweepRow) -> bool:
        better = other.rho >= row.rho and other.kl <= row.kl
        return better and (other.rho, other.kl) != (row.rho, row.kl)

    front = [row for row in rows if not any(beats(other, row) for other in rows)]
    return sorted(front, key=lambda row: row.rho)


def variants_of(policy: str, options: dict[str, str], grid: Sequence[str]) -> list[PolicyVariant]:
    """One variant of `policy` per threshold in `grid`, with its other `options`."""
    name, key = policy_class(policy).name, threshold_key(policy)
    return [PolicyVariant(name, {**options, key: threshold}) for threshold in grid]


Replayer = Callable[[Sequence[Trajectory], list[PolicyVariant], bool], dict]
"""Replays trajectories under variants and returns what `kvprof.replay.engine.run_replay` returns; the flag is True for
the sweep (which a replayer may checkpoint and resume) and False for the held-out verification."""


def in_process(
    agents: AgentSet,
    settings: ReplaySettings,
    progress: ReplayProgress | None = None,
    hooks: ReplayHooks | None = None,
) -> Replayer:
    """An in-process `Replayer` under `settings`, resuming from `progress`, reporting to `hooks`."""

    def replay(trajectories: Sequence[Trajectory], variants: list[PolicyVariant], sweep: bool) -> dict:
        return run_replay(
            agents,
            list(trajectories),
            variants,
            settings,
            progress=progress if sweep else None,
            hooks=hooks if sweep else None,
        )

    return replay


def tune(
    replay: Replayer,
    tuning: Sequence[Trajectory],
    heldout: Sequence[Trajectory],
    policy: str,
    options: dict[str, str],
    grid: Sequence[str],
    target: Target,
    online: bool,
) -> TuneTauResult:
    """Sweep `grid` on `tuning`, recommend, verify on `heldout`; every threshold a variant of one lockstep `replay`
    (`in_process` or Ray). `options`: other options (the pool); `online` must match `replay`'s."""
    if target.needs_online and not online:
        raise KvprofError("an accuracy target needs the online re-runs; drop --no-online or pass --max-kl.")
    variants = variants_of(policy, options, grid)
    swept = ReplayResult.of(replay(tuning, variants, True))
    rows = [row_of(swept, variant, threshold) for variant, threshold in zip(variants, grid)]
    rows = [replace(row, target_met=target.met(row)) for row in rows]
    best = recommend(rows, target)
    verification = None
    if best is not None and heldout:
        (variant,) = variants_of(policy, options, [f"{best.threshold:g}"])
        checked = row_of(ReplayResult.of(replay(heldout, [variant], False)), variant, f"{best.threshold:g}")
        verification = replace(checked, target_met=target.met(checked))
    return TuneTauResult(
        policy=policy_class(policy).name,
        threshold_option=threshold_key(policy),
        options=options,
        target=target.describe(),
        rows=rows,
        pareto=[row.threshold for row in pareto(rows)],
        recommended=best,
        heldout=verification,
        tuning_trajectories=[t.id for t in tuning],
        heldout_trajectories=[t.id for t in heldout],
        dense=SweepDense(summary=summary_of(DENSE, swept.dense), online=(swept.online or {}).get(DENSE)),
    )


def replay_flags(result: TuneTauResult) -> list[str]:
    """The recommendation as `kvprof replay --policy-option` values."""
    best = result.recommended
    if best is None:
        return []
    options = {**result.options, result.threshold_option: f"{best.threshold:g}"}
    return [f"{result.policy}.{key}={value}" for key, value in options.items()]
