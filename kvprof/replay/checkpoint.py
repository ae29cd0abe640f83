"""The checkpoint of a long replay or τ sweep: identity (the settings records depend on) and progress, written after
each trajectory (in process) or shard (Ray); `--resume` refuses, in one sentence, another file, other settings
(named), trajectories outside this run, or the other kind.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvprof.errors import KvprofError
from kvprof.fileio import read_json_file, write_json
from kvprof.replay.lockstep import ReplayProgress
from kvprof.replay.setting import ReplaySettings
from kvprof.replay.shards import ShardResult, resumable, saved_shards, shard_checkpoint

if TYPE_CHECKING:
    from kvprof.policies import PolicyVariant
    from kvprof.traces.trace import Trajectory

# How a refusal to resume a replay names each setting `replay_identity` records.
REPLAY_SETTINGS = {
    "trace": "another trace",
    "model": "--model",
    "agents": "other agents (--agent/--role)",
    "policies": "--policy",
    "repeats": "--repeats",
    "timing": "--timing",
    "page_size": "--page-size",
    "span_matching": "--min-span / --span-boundaries / --checkpoints / --checkpoint-interval",
    "dtype": "--dtype",
    "device": "--device",
    "lora_attention": "--lora-attention",
    "expansion": "the low-rank views expanded by",  # kvprof's fused CPU kernel needs a C compiler, KVPROF_NATIVE unset
    "sharding": "--ray (a sharded replay checkpoints shards)",
    "online": "--online (a sharded replay checkpoints its shards' online re-runs)",
}
UNSHOWN = ("trace", "agents", "pool", "sharding")  # settings a refusal names without their values


def trace_digest(trace: Path) -> str:
    """The trace's content as an identity records it."""
    return "sha256:" + hashlib.sha256(Path(trace).read_bytes()).hexdigest()


def replay_identity(
    trace: Path,
    loaded: dict,
    variants: list[PolicyVariant],
    settings: ReplaySettings,
    *,
    expansion: str,
    sharded: bool = False,
) -> dict:
    """The settings a replay's records depend on: trace content, model and agents, dtype, device (`loaded`), variants
    with options, `settings`' repeats, timing, page size, span matching and attention path, the views' `expansion`
    path (`kvprof.kernels.expansion.expansion_path`: timings of both paths must not mix); `sharded` (+ `online`) on
    Ray."""
    identity = {
        "trace": trace_digest(trace),
        "model": loaded["model"],
        "agents": loaded["agents"],
        "policies": {variant.label: variant.options for variant in variants},
        "repeats": settings.repeats,
        "timing": settings.timing,
        "page_size": settings.page_size,
        "span_matching": settings.span_matching.to_json(),
        "dtype": loaded["dtype"],
        "device": loaded["device"],
        "lora_attention": settings.lora_attention,
        "expansion": expansion,
    }
    return identity | ({"sharding": "ray", "online": settings.online} if sharded else {})


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint at `path` of a run with `identity`; `settings`: how a refusal names each (default: a replay's)."""

    path: Path
    identity: dict
    settings: dict[str, str] = field(default_factory=REPLAY_SETTINGS.copy)

    def save_progress(self, progress: ReplayProgress) -> None:
        """Write the progress of a replay in this process (after each trajectory), atomically."""
        write_json(self.path, {"identity": self.identity, "progress": progress.to_json()})

    def save_shards(self, results: dict[str, ShardResult], groups: list[list[str]]) -> None:
        """Write the completed shards of a replay on Ray and its plan's grouping, atomically."""
        write_json(self.path, {"identity": self.identity, "progress": shard_checkpoint(results, groups)})

    def read_progress(self, trajectory_ids: list[str]) -> ReplayProgress:
        """An in-process replay's progress, refused when it holds trajectories outside `trajectory_ids`."""
        state = ReplayProgress.of_checkpoint(self._saved_progress(), self.path)
        self._refuse_foreign([traj_id for traj_id in state.trajectories if traj_id not in trajectory_ids])
        return state

    def read_shards(
        self, trajectories: list[Trajectory], variants: list[PolicyVariant]
    ) -> tuple[dict[str, ShardResult], list[list[str]]]:
        """A Ray replay's completed shards and grouping, as far as resumable (`sharded.resumable`); a shard of other
        trajectories is refused."""
        progress = self._saved_progress()
        saved = saved_shards(progress, self.path)
        self._refuse_foreign(
            sorted(
                {traj_id for result in saved.values() for traj_id in result.progress.trajectories}
                - {traj.id for traj in trajectories}
            )
        )
        return resumable(saved, progress.get("groups"), trajectories, variants)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def _saved_progress(self) -> dict:
        """The progress record of the file, refusing one made with other settings than `identity`."""
        saved = read_json_file(self.path, "checkpoint", "delete it to start again")
        if not isinstance(saved, dict) or not isinstance(saved.get("identity"), dict) or "progress" not in saved:
            raise KvprofError(f"{self.path} is not a checkpoint of this kvprof; delete it to start again.")
        keys = list(dict.fromkeys([*self.identity, *saved["identity"]]))
        other_kind = saved["identity"].get("sharding") != self.identity.get("sharding")
        if other_kind:
            keys = ["sharding", "online"]  # the other kind of checkpoint: settings recorded by one kind only aside
        differences = [
            self._difference(key, saved["identity"].get(key), self.identity.get(key), other_kind)
            for key in keys
            if saved["identity"].get(key) != self.identity.get(key)
        ]
        if differences:
            raise KvprofError(
                f"checkpoint {self.path} was made with other settings ({'; '.join(differences)}); resume with the "
                "options it was made with, or delete it to start again."
            )
        return saved["progress"]

    def _difference(self, key: str, saved, current, other_kind: bool = False) -> str:
        """A setting that differs from this run's, for the refusal: its value there and here (a setting a checkpoint
        of the same kind lacks: one an earlier kvprof did not record)."""
        name = self.settings.get(key, key)
        if key in UNSHOWN:
            return name
        if saved is None and not other_kind:
            return f"{name}: not recorded (a checkpoint of an earlier kvprof)"
        return f"{name} {_shown(saved)}, not {_shown(current)}"

    def _refuse_foreign(self, foreign: list[str]) -> None:
        if foreign:
            raise KvprofError(
                f"checkpoint {self.path} holds trajectories {', '.join(foreign[:3])} that this replay does not "
                "include; pass the --limit it was made with, or delete it to start again."
            )


def _shown(value) -> str:
    """A setting's value in a refusal: a list's items, a dict's keys (with plain values)."""
    if isinstance(value, list):
        return ", ".join(map(str, value))
    if isinstance(value, dict):
        return ", ".join(key if isinstance(item, dict) else f"{key}={item}" for key, item in value.items())
    return str(value)
