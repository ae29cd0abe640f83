"""What kvprof shows on the terminal while a command runs and after: the progress of a capture and of a replay in
this process, and each result's lines and tables (a capture's, a replay's and its page, a recommendation's, a
dashboard's sections, the agents' adapters and layers, skipped policies). The commands and the demo's stages print
through these, so a command's output changes in one place.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from kvprof.ui import console, progress

if TYPE_CHECKING:
    from kvprof.capture.runner import CaptureSetup
    from kvprof.model.agents import AgentSet
    from kvprof.replay.checkpoint import Checkpoint
    from kvprof.replay.engine import ReplayHooks
    from kvprof.replay.lockstep import ReplayProgress
    from kvprof.report import Section
    from kvprof.results.capture import CaptureSummary
    from kvprof.results.recommend import RecommendResult
    from kvprof.results.replay import ReplayResult
    from kvprof.traces.trace import Trajectory


def capture_with_progress(
    setup: CaptureSetup, trace_path: Path, resumed: Sequence[Trajectory] = ()
) -> tuple[list[Trajectory], CaptureSummary]:
    """`capture_trajectories` of a prepared capture (`prepare_capture`) into `trace_path` after the `resumed`
    trajectories, under a progress bar, timed, trace table printed; the trajectories and summary."""
    from kvprof.capture.runner import capture_trajectories, trajectory_summary
    from kvprof.report.capture import trace_table

    started = time.perf_counter()
    with progress() as bar:
        job = bar.add_task("capturing", total=len(setup.tasks), completed=len(resumed))
        captured = capture_trajectories(
            setup.agents,
            setup.tasks,
            trace_path,
            setup.header,
            setup.sampling,
            resumed,
            on_task=lambda task: bar.update(job, description=f"task {task.id}"),
            on_turn=lambda traj, turn: bar.update(job, description=f"task {traj.id}: {turn.agent}"),
            on_trajectory=lambda traj: bar.advance(job),
        )
    summary = trajectory_summary(captured, time.perf_counter() - started)
    console.print(trace_table(summary).to_rich())
    return captured, summary


def show_capture(summary: CaptureSummary, trace_path: Path, trajectories: int) -> None:
    """A capture's last lines: its exact-match accuracy (where its tasks have answers) and the trace it wrote."""
    if summary.accuracy is not None:
        console.print(f"exact-match accuracy: {summary.accuracy:.1%} of {summary.with_answer} tasks")
    console.print(f"wrote {trace_path} ({trajectories} trajectories, {summary.seconds:.1f} s)")


@contextmanager
def replay_progress(
    label: str,
    trajectories: list[Trajectory],
    variants: int,
    online: bool,
    state: ReplayProgress | None = None,
    checkpoint: Checkpoint | None = None,
) -> Iterator[ReplayHooks]:
    """Progress bars of an in-process replay (turns; online re-runs with `online`), counting `state`'s as done;
    yields the hooks, which also save each trajectory to `checkpoint`."""
    from kvprof.replay.engine import ReplayHooks

    with progress() as bar:
        job = bar.add_task(label, total=sum(len(t.turns) for t in trajectories))
        bar.update(job, completed=sum(len(t.turns) for t in trajectories if state and t.id in state.trajectories))
        online_job = bar.add_task("online re-runs", total=len(trajectories) * (variants + 1)) if online else None
        yield ReplayHooks(
            on_turn=lambda traj, index: bar.advance(job),
            # online_job is None only without online re-runs, when on_task is never called.
            on_task=(lambda label, task: bar.advance(online_job)) if online_job is not None else None,
            on_trajectory=checkpoint.save_progress if checkpoint is not None else None,
        )


def show_replay(result: ReplayResult) -> None:
    """A replay's terminal output: a warning if the dense run does not reproduce a captured trace, then the tables."""
    from kvprof.report.replay import (
        contention_text,
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
    contention = contention_text(result.timing or {})
    if contention and contention.startswith("CONTENDED"):
        console.print(f"WARNING: {contention}.", style="bold red", markup=False)
    timeline = timeline_note(result)
    if timeline:
        console.print(timeline)
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


def write_replay_page(out: Path, result: ReplayResult) -> Path:
    """OUT/replay.html: a replay's dashboard page."""
    from kvprof.report import write_html
    from kvprof.report.replay import sections

    return write_html(out / "replay.html", "kvprof replay", sections(result), subtitle=result.trace or "")


def show_recommendation(result: RecommendResult) -> None:
    """A recommendation's tables (candidates, held-out confirmation, sensitivity), then its decision in bold."""
    from kvprof.report.recommend import candidates_table, decision_lines, heldout_table, sensitivity_table

    console.print(candidates_table(result).to_rich())
    heldout = heldout_table(result)
    if heldout is not None:
        console.print(heldout.to_rich())
    console.print(sensitivity_table(result).to_rich())
    for line in decision_lines(result):
        console.print(line, style="bold", markup=False)


def print_sections(sections: list[Section]) -> None:
    """Dashboard sections on the terminal: title rule, card, text, tables (no figures)."""
    for section in sections:
        console.rule(section.title)
        for line in section.card:
            console.print(line, style="bold", markup=False)
        for line in section.text:
            console.print(line)
        for table in section.tables:
            console.print(table.to_rich())


def show_report(path: Path, sections: list[Section], sources: list[Path]) -> None:
    """A dashboard's sections on the terminal (`print_sections`), then the page written at `path` from `sources`."""
    print_sections(sections)
    console.print(f"wrote {path} ({len(sections)} sections from {len(sources)} result files)")


def print_adapters(agents: AgentSet) -> None:
    """One line per agent that runs a LoRA adapter: the adapter's folder, rank, alpha, projections and layers."""
    for name, info in agents.adapters.items():
        console.print(f"agent [bold]{name}[/]: adapter {info.path} ({info.describe()}, {info.layers} layers)")


def print_layers(agents: AgentSet) -> None:
    """The model's layers by kind (attention, window, position encoding: `kvprof.model.layers.describe_layers`)."""
    from kvprof.model.layers import describe_layers

    console.print(f"model {agents.model_name}: {describe_layers(agents.layer_kinds)}", markup=False)


def print_skipped(skipped: dict[str, str]) -> None:
    """One line per refusal reason, naming the variants it skipped."""
    for reason in dict.fromkeys(skipped.values()):
        labels = ", ".join(label for label, why in skipped.items() if why == reason)
        console.print(f"[yellow]skipped {labels}[/]: {reason}")
