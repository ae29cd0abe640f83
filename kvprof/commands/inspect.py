"""`kvprof inspect`: validate a trace (and optionally its tokenizer against a model) and summarise it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvprof.commands.common import console
from kvprof.model import load_tokenizer, tokenizer_identity
from kvprof.trace import check_tokenizer, iter_trajectories, read_header, shared_segment_ids


def command(
    trace: Annotated[Path, typer.Argument(help="Trace file (JSONL) written by `kvprof capture`.")],
    model: Annotated[
        str | None,
        typer.Option("--model", help="Also check that this model's tokenizer is the one the trace was captured with."),
    ] = None,
) -> None:
    """Validate a trace line by line and print what it holds."""
    header = read_header(trace)
    if model is not None:
        check_tokenizer(header, tokenizer_identity(load_tokenizer(model)), trace, model)
    table = Table(title=f"{trace}: {header.mode} mode, model {header.model.get('path')}, source {header.source}")
    for column in (
        "trajectory",
        "turns",
        "agents",
        "distinct tokens",
        "shared tokens",
        "longest input",
        "answer",
        "prediction",
    ):
        table.add_column(
            column, justify="left" if column in ("trajectory", "agents", "answer", "prediction") else "right"
        )
    count = 0
    for traj in iter_trajectories(trace):
        count += 1
        shared = shared_segment_ids(traj)
        table.add_row(
            traj.id,
            str(len(traj.turns)),
            ",".join(dict.fromkeys(t.agent for t in traj.turns)),
            str(traj.num_tokens),
            str(sum(len(traj.segments[s]) for s in shared)),
            str(max((len(traj.input_tokens(t)) for t in traj.turns), default=0)),
            str(traj.answer),
            str(traj.prediction),
        )
    console.print(table)
    console.print(
        f"valid: {count} trajectories; agents {', '.join(header.agent_names)}; tokenizer "
        f"{header.tokenizer['name']} ({header.tokenizer['vocab_size']} ids)"
        + ("; tokenizer matches --model" if model else "")
    )
