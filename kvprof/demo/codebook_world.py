"""The codebook world as shipped (`kvprof.demo.codebook`): its files, sample traces and evaluation.

    python -m kvprof.demo.codebook_world [--world DIR]    # after python -m kvprof.demo.train_codebook --out DIR

The world's folder (default: the packaged `assets/codebook`) holds::

    model/                                  two-layer model + tokenizer (written by train_codebook)
    workflow_prompt.toml                    the clerk (act) and the auditor (reflect), prompt mode
    workflow_group_chat.toml                the same as a group chat through a chat template (the other agent's
                                            outputs read as user messages, as AutoGen / AG2 lay them out)
    tasks/{heldout,long}.jsonl              held-out tasks (never trained on) and the long split (4 ships × 6 docks)
    tasks/standing.jsonl                    held-out-like tasks whose keys are the same in every task
    training.json                           what training measured, check by check
    sample_traces/heldout.jsonl             the first HELDOUT_TASKS held-out tasks, captured (the agents generate)
    sample_traces/short.jsonl               its first SHORT_TASKS trajectories (what `kvprof demo` replays)
    sample_traces/long.jsonl                the long tasks, captured
    sample_traces/standing.jsonl            the first HELDOUT_TASKS standing-key tasks, captured
    sample_traces/group_chat.jsonl          the first HELDOUT_TASKS held-out tasks captured as a group chat
    evaluation.json                         capture accuracy and the `kvprof replay --online` numbers below

`evaluate` replays a sample trace teacher-forced and online under NonShared (the dense run) and other policies, as
`kvprof replay TRACE --online --policy ...` does, and keeps each policy's summary (accuracy, diverged turns, K/V
error, KL, top-1, ρ, moved spans served): the numbers the docs quote. `heldout` and `group_chat` (the same tasks in
both renderings) run every prompt-mode policy at its defaults (`PROMPT_POLICIES`), `standing` FullShared and the
delta-correction policies (`EVALUATED`); anchor pools start empty and grow, as published.
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
from kvprof.replay.engine import DENSE, ReplayHooks, run_replay
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
    """The shipped codebook world (or one written by `python -m kvprof.demo.train_codebook --out ROOT`); refuses a
    folder without the trained model."""
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
    """Capture the sample traces (see module docstring); returns `name → statistics` (accuracy: NonShared exact
    match, the agents generating greedily)."""
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
    """Replay the sample trace `name` teacher-forced and online under NonShared and `policies`; returns
    `label → {KEPT numbers}` with the dense run under "nonshared"."""
    trace = world.sample_traces[name]
    agents = load_agents_for_trace(trace, device=device, dtype="float32")
    trajectories = read_trace(trace).trajectories
    with progress() as bar:
        job = bar.add_task(f"replaying {name}", total=len(trajectories) * (len(policies) + 1))
        result = run_replay(
            agents,
            trajectories,
            list(policies),
            online=True,
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
