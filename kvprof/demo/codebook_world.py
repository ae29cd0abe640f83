"""The codebook world as shipped (`kvprof.demo.codebook`): its files, sample traces and evaluation.

    python -m kvprof.demo.codebook_world [--world DIR]    # after python -m kvprof.demo.train_codebook --out DIR

The folder's files and what `evaluate` replays: docs/demo-worlds.md ("The codebook world"). Each policy's kept
summary (accuracy, diverged turns, K/V error, KL, top-1, ρ, moved spans served) is what the docs quote.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from kvprof.capture.runner import trajectory_summary
from kvprof.demo.assets import ASSETS, WorldFolder
from kvprof.demo.traces import captured_trace, relative_trace
from kvprof.fileio import write_json
from kvprof.model.agents import load_agents_for_trace
from kvprof.policies import PolicyVariant
from kvprof.replay.engine import ReplayHooks, run_replay
from kvprof.replay.records import DENSE
from kvprof.replay.setting import ReplaySettings
from kvprof.results.replay import ReplayResult, summary_of
from kvprof.traces.tasks import load_tasks
from kvprof.traces.trace import Trace, read_trace, write_trace
from kvprof.ui import progress

CODEBOOK = ASSETS / "codebook"
HELDOUT_TASKS = 100
SHORT_TASKS = 10
EVALUATED = (
    PolicyVariant("fullshared"),
    PolicyVariant("kvcomm"),
    PolicyVariant("kvcmas", {"chain": "chain"}),
    PolicyVariant("kvcmas", {"chain": "star"}),
)
"""The policies `evaluate` replays on the standing-key tasks besides the dense run."""
PROMPT_POLICIES = (
    *EVALUATED,
    PolicyVariant("cacheblend"),
    PolicyVariant("relaycaching"),
    PolicyVariant("droidspeak"),
    PolicyVariant("graphflow"),
)
"""Every prompt-mode policy at its defaults (KVCMAS chained and not): what `evaluate` replays on both renderings of
the held-out tasks."""
KEPT = (
    "accuracy",
    "diverged_turns",
    "k_error",
    "v_error",
    "kl",
    "top1",
    "delta_reuse",
    "reuse_per_token",
    "moved",
    "moved_recomputed",
    "prefilled",
)


@dataclass(frozen=True)
class CodebookWorld(WorldFolder):
    """Paths of the codebook world (see module docstring)."""

    @property
    def workflow(self) -> Path:
        return self.root / "workflow_prompt.toml"

    @property
    def group_chat_workflow(self) -> Path:
        return self.root / "workflow_group_chat.toml"

    @property
    def standing_tasks(self) -> Path:
        return self.root / "tasks" / "standing.jsonl"

    @property
    def sample_traces(self) -> dict[str, Path]:
        names = ("short", "heldout", "long", "standing", "group_chat")
        return {name: self.root / "sample_traces" / f"{name}.jsonl" for name in names}

    @property
    def training_record(self) -> Path:
        return self.root / "training.json"


def codebook_world(root: str | Path | None = None) -> CodebookWorld:
    """The shipped codebook world (or `train_codebook --out ROOT`'s); refuses a folder without the trained model."""
    world = CodebookWorld(Path(root) if root is not None else CODEBOOK)
    world.require(
        "codebook world",
        [world.model / "config.json", world.workflow, world.heldout_tasks],
        "rebuild it with `python -m kvprof.demo.train_codebook --out DIR`",
    )
    return world


def _stats(trajectories) -> dict:
    summary = trajectory_summary(trajectories, 0.0)
    return {key: getattr(summary, key) for key in ("trajectories", "distinct_tokens", "shared_tokens", "accuracy")}


def build_traces(world: CodebookWorld, device: str = "cpu") -> dict[str, dict]:
    """Capture the sample traces; `name → statistics` (accuracy: NonShared, greedy)."""
    stats = {}
    with tempfile.TemporaryDirectory() as tmp:
        captures = (
            ("heldout", world.heldout_tasks, HELDOUT_TASKS, world.workflow),
            ("long", world.long_tasks, None, world.workflow),
            ("standing", world.standing_tasks, HELDOUT_TASKS, world.workflow),
            ("group_chat", world.heldout_tasks, HELDOUT_TASKS, world.group_chat_workflow),
        )
        for name, tasks, limit, workflow in captures:
            trace = Path(tmp) / f"{name}.jsonl"
            trajectories = captured_trace(world.model, workflow, load_tasks(tasks, limit), trace, device)
            relative_trace(trace, world.sample_traces[name])
            stats[name] = _stats(trajectories)
        short = read_trace(world.sample_traces["heldout"])
        write_trace(world.sample_traces["short"], Trace(short.header, short.trajectories[:SHORT_TASKS]))
        stats["short"] = _stats(short.trajectories[:SHORT_TASKS])
    return stats


def evaluate(
    world: CodebookWorld, name: str = "heldout", device: str = "cpu", policies: tuple[PolicyVariant, ...] = EVALUATED
) -> dict:
    """Replay trace `name` teacher-forced and online under NonShared and `policies`; `label → {KEPT numbers}`
    (dense under "nonshared")."""
    trace = world.sample_traces[name]
    agents = load_agents_for_trace(trace, device=device, dtype="float32")
    trajectories = read_trace(trace).trajectories
    with progress() as bar:
        job = bar.add_task(f"replaying {name}", total=len(trajectories) * (len(policies) + 1))
        result = run_replay(
            agents,
            trajectories,
            list(policies),
            ReplaySettings(online=True),
            hooks=ReplayHooks(on_task=lambda label, task: bar.advance(job)),
        )
    replay = ReplayResult.of(result)
    online = replay.online or {}
    rows = {"nonshared": summary_of(DENSE, replay.dense).to_json() | online[DENSE]}
    for label, run in replay.policies.items():
        rows[label] = summary_of(label, run).to_json() | online[label]
    return {label: {key: row.get(key) for key in KEPT} for label, row in rows.items()}


def build(world: CodebookWorld, device: str = "cpu") -> dict:
    """Sample traces, then the evaluation; writes WORLD/evaluation.json and returns it."""
    started = time.perf_counter()
    record: dict[str, object] = {
        "traces": build_traces(world, device),
        "replay_online": evaluate(world, "heldout", device, PROMPT_POLICIES),
        "replay_online_group_chat": evaluate(world, "group_chat", device, PROMPT_POLICIES),
        "replay_online_standing": evaluate(world, "standing", device),
    }
    record["seconds"] = round(time.perf_counter() - started, 1)
    write_json(world.evaluation_record, record)
    return record


def main(world_dir: Annotated[Path | None, typer.Option("--world", help="Codebook world folder.")] = None) -> None:
    """Capture the codebook world's sample traces and evaluate it."""
    print(json.dumps(build(codebook_world(world_dir)), indent=1))


if __name__ == "__main__":
    typer.run(main)
