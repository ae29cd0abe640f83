"""`kvprof import-chat`: a chat log of an existing multi-agent system as a kvprof trace."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvprof.commands.common import console, write_result
from kvprof.commands.options import OutOption
from kvprof.errors import KvprofError
from kvprof.traces.chat import PLAIN_TEMPLATE, resolve_chat_template, template_sha256
from kvprof.traces.chat_log import import_log
from kvprof.traces.spec import build_spec, parse_assignment
from kvprof.traces.trace import write_trace

MAX_DIFFERENCES_SHOWN = 10


def command(
    log: Annotated[Path, typer.Argument(help="JSONL chat log: one agent call per line (see the README).")],
    model: Annotated[
        str, typer.Option("--model", help="The base model the agents run (its tokenizer renders the log).")
    ],
    agent: Annotated[
        list[str] | None,
        typer.Option("--agent", help="NAME=ADAPTER_DIR: the agent's LoRA adapter (lora mode). Repeat per agent."),
    ] = None,
    chat_template: Annotated[
        str,
        typer.Option(
            "--chat-template",
            help="auto (the tokenizer's template, else message contents back to back), on (the tokenizer's, "
            "required), off (contents back to back) or a Jinja template FILE.",
        ),
    ] = "auto",
    workflow: Annotated[
        Path | None,
        typer.Option("--workflow", help="TOML workflow whose templates and limits online replay re-runs with."),
    ] = None,
    out: OutOption = Path("runs/import"),
) -> None:
    """Import a chat log (OpenAI message format, one agent call per line) as OUT/trace.jsonl."""
    args = dict(locals())
    from kvprof.capture.runner import trajectory_summary
    from kvprof.model.agents import load_tokenizer, tokenizer_identity
    from kvprof.report.capture import trace_table

    tokenizer = load_tokenizer(model)
    template = resolve_chat_template(chat_template, tokenizer) or PLAIN_TEMPLATE
    adapters = dict(parse_assignment("--agent", value) for value in agent or [])
    spec = build_spec(workflow, require_adapters=False) if workflow is not None else None
    imported = import_log(log, tokenizer, template, tokenizer_identity(tokenizer), model, adapters or None, spec)
    console.print(imported.mode_reason)
    rendering = "message contents back to back" if template == PLAIN_TEMPLATE else "a chat template"
    console.print(f"rendered with {rendering} ({template_sha256(template)})")
    differences = [(tid, d) for tid, found in imported.differences.items() for d in found]
    differences.sort(key=lambda item: (item[1].line is None, item[1].line or 0))  # in log order
    if differences:
        console.print(
            f"{len(differences)} differences (messages rendered to other ids than before, replies read back "
            "otherwise than generated):"
        )
    for trajectory, difference in differences[:MAX_DIFFERENCES_SHOWN]:
        console.print(f"trajectory {trajectory!r}: {difference.describe()}", markup=False)  # texts hold [INST] etc.
    if len(differences) > MAX_DIFFERENCES_SHOWN:
        console.print(f"... and {len(differences) - MAX_DIFFERENCES_SHOWN} more (all in OUT/import-chat.json)")
    if not imported.trace.trajectories:
        raise KvprofError(f"chat log {log} produced no trajectories; add agent calls.")
    trace_path = write_trace(out / "trace.jsonl", imported.trace)
    summary = trajectory_summary(imported.trace.trajectories, 0.0)
    console.print(trace_table(summary).to_rich())
    payload = {
        "trace": str(trace_path),
        "mode": imported.trace.header.mode,
        "mode_reason": imported.mode_reason,
        "template": template_sha256(template),
        "differences": [
            {"trajectory": tid, "line": d.line, "read_back": d.producer is not None, "message": d.describe()}
            for tid, d in differences
        ],
        "summary": summary.to_json(),
    }
    write_result(out, "import-chat", payload, args)
    if summary.accuracy is not None:
        console.print(
            f"exact-match accuracy of the logged answers: {summary.accuracy:.1%} of {summary.with_answer} tasks"
        )
    console.print(f"wrote {trace_path}")
