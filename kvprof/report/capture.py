"""Tables and dashboard section of a capture result: trajectories, tokens, accuracy, per-agent turn statistics."""

from __future__ import annotations

from kvprof.report.html import Section
from kvprof.report.tables import TableData
from kvprof.results.capture import CaptureResult, CaptureSummary


def agent_table(summary: CaptureSummary, title: str) -> TableData:
    """One row per agent of a capture summary: its turns and mean input and output tokens per turn."""
    table = TableData(title=title, columns=["agent", "turns", "mean input tokens", "mean output tokens"])
    for name, stats in summary.agents.items():
        table.add_row(
            name,
            stats["turns"],
            f"{stats['input_tokens'] / stats['turns']:.1f}",
            f"{stats['output_tokens'] / stats['turns']:.1f}",
        )
    return table


def trace_table(summary: CaptureSummary) -> TableData:
    """The terminal table of a capture: the agent table, titled with the size of the trace."""
    return agent_table(
        summary,
        f"trace: {summary.trajectories} trajectories, {summary.distinct_tokens} "
        f"distinct tokens ({summary.shared_tokens} in segments read by several agents)",
    )


def sections(result: CaptureResult) -> list[Section]:
    summary = result.summary
    accuracy = summary.accuracy
    text = [
        f"{summary.trajectories} trajectories, {summary.turns} agent calls, {summary.distinct_tokens} "
        f"distinct tokens ({summary.shared_tokens} in segments read by several agents); trace "
        f"{result.trace}."
    ]
    if accuracy is not None:
        text.append(f"exact-match accuracy {accuracy:.1%} on {summary.with_answer} tasks.")
    return [
        Section(title="Captured trajectories", text=text, tables=[agent_table(summary, "agent calls")], order="inputs")
    ]
