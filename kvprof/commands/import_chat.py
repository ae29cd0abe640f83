"""`kvprof import-chat`: a chat log, or an export of a tracing store, of an existing multi-agent system as a kvprof
trace."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvprof.commands.common import console, write_result
from kvprof.commands.options import OutOption
from kvprof.errors import KvprofError
from kvprof.traces.chat import PLAIN_TEMPLATE, resolve_chat_template, template_sha256
from kvprof.traces.chat_log import ImportedLog, import_calls
from kvprof.traces.spec import build_spec, parse_assignment
from kvprof.traces.stores.common import StoreLog
from kvprof.traces.stores.detect import FORMATS, read_calls, resolve_format
from kvprof.traces.trace import write_trace

MAX_DIFFERENCES_SHOWN = 10


def command(
    log: Annotated[
        Path,
        typer.Argument(
            help="The calls: a JSONL chat log (one agent call per line), OTLP JSON (GenAI or OpenInference "
            "conventions), a LangSmith run export, an OpenAI Agents SDK trace export or AG2's SQLite log."
        ),
    ],
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
    format: Annotated[
        str,
        typer.Option("--format", help=f"auto (detected from the file) or one of {', '.join(FORMATS)}."),
    ] = "auto",
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="Refuse a log where a call's recorded input token count differs from kvprof's rendering of it.",
        ),
    ] = False,
    out: OutOption = Path("runs/import"),
) -> None:
    """Import a chat log or a tracing store's export of agent calls as OUT/trace.jsonl."""
    args = dict(locals())
    from kvprof.capture.runner import trajectory_summary
    from kvprof.model.agents import load_tokenizer, tokenizer_identity
    from kvprof.report.capture import trace_table

    chosen = resolve_format(log, format)
    console.print(f"read as {FORMATS[chosen][0]} ({'detected' if format == 'auto' else '--format'} {chosen})")
    store = read_calls(log, chosen)
    for sentence in store.missing_report():
        console.print(sentence, markup=False)
    tokenizer = load_tokenizer(model)
    template = resolve_chat_template(chat_template, tokenizer) or PLAIN_TEMPLATE
    adapters = dict(parse_assignment("--agent", value) for value in agent or [])
    spec = build_spec(workflow, require_adapters=False) if workflow is not None else None
    source = "chat-log" if chosen == "chat" else chosen
    identity = tokenizer_identity(tokenizer)
    imported = import_calls(log, store.calls, tokenizer, template, identity, model, adapters or None, spec, source)
    console.print(imported.mode_reason)
    rendering = "message contents back to back" if template == PLAIN_TEMPLATE else "a chat template"
    console.print(f"rendered with {rendering} ({template_sha256(template)})")
    differences = _show_differences(imported)
    _check_token_counts(log, imported, len(store.calls), strict)
    if not imported.trace.trajectories:
        raise KvprofError(f"chat log {log} produced no trajectories; add agent calls.")
    trace_path = write_trace(out / "trace.jsonl", imported.trace)
    summary = trajectory_summary(imported.trace.trajectories, 0.0)
    console.print(trace_table(summary).to_rich())
    payload = _payload(chosen, store, imported, differences, template) | {
        "trace": str(trace_path),
        "summary": summary.to_json(),
    }
    write_result(out, "import-chat", payload, args)
    if summary.accuracy is not None:
        console.print(
            f"exact-match accuracy of the logged answers: {summary.accuracy:.1%} of {summary.with_answer} tasks"
        )
    console.print(f"wrote {trace_path}")


def _payload(chosen: str, store: StoreLog, imported: ImportedLog, differences: list, template: str) -> dict:
    """What the result file records of the import: format, mode, template, differences, the template check, the
    calls left out, and where each numbered call of a store's export is."""
    return {
        "format": chosen,
        "mode": imported.trace.header.mode,
        "mode_reason": imported.mode_reason,
        "template": template_sha256(template),
        "differences": [
            {"trajectory": tid, "line": d.line, "read_back": d.producer is not None, "message": d.describe()}
            for tid, d in differences
        ],
        "token_count_mismatches": [m.describe() for m in imported.mismatches],
        "left_out": [{"trajectory": m.trajectory, "where": m.where, "why": m.what} for m in store.missing],
        "calls": [{"line": call.line, "where": call.where} for call in store.calls] if chosen != "chat" else [],
    }


def _show_differences(imported: ImportedLog) -> list:
    """Print the first differences (in log order) and return them all as (trajectory, difference)."""
    differences = [(tid, d) for tid, found in imported.differences.items() for d in found]
    differences.sort(key=lambda item: (item[1].line is None, item[1].line or 0))
    if differences:
        console.print(
            f"{len(differences)} differences (messages rendered to other ids than before, replies read back "
            "otherwise than generated):"
        )
    for trajectory, difference in differences[:MAX_DIFFERENCES_SHOWN]:
        console.print(f"trajectory {trajectory!r}: {difference.describe()}", markup=False)  # texts hold [INST] etc.
    if len(differences) > MAX_DIFFERENCES_SHOWN:
        console.print(f"... and {len(differences) - MAX_DIFFERENCES_SHOWN} more (all in OUT/import-chat.json)")
    return differences


def _check_token_counts(log: Path, imported: ImportedLog, calls: int, strict: bool) -> None:
    """Print each call whose recorded input token count differs from its rendering; refuse them with `strict`."""
    found = imported.mismatches
    if not found:
        return
    if strict:
        raise KvprofError(
            f"{len(found)} of {calls} calls of {log} render to another number of ids than the trace records (first, "
            f"{found[0].describe()}); render with the server's template and tools, or drop --strict."
        )
    console.print(f"template check: {len(found)} of {calls} calls render to another number of ids than recorded:")
    for entry in found[:MAX_DIFFERENCES_SHOWN]:
        console.print(entry.describe(), markup=False)
    if len(found) > MAX_DIFFERENCES_SHOWN:
        console.print(f"... and {len(found) - MAX_DIFFERENCES_SHOWN} more (all in OUT/import-chat.json)")
