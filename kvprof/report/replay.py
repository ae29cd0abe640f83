"""Tables and figures of a replay result (the JSON `kvprof replay` writes), for the terminal and the dashboard."""

from __future__ import annotations

from kvprof.report.figures import line_figure
from kvprof.report.html import Section
from kvprof.report.tables import TableData


def _num(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f}"


def _rows(result: dict) -> list[tuple[str, dict, dict, dict | None]]:
    """(label, summary, ratios to dense, online result) for the dense run and each policy."""
    online = result.get("online") or {}
    dense = result["dense"]["summary"]
    unit = {"ttft_speedup": 1.0, "prefill_speedup_implied": 1.0, "latency_speedup": 1.0, "memory_ratio": 1.0}
    rows = [("dense (NonShared)", dense, unit, online.get("dense"))]
    rows += [
        (label, entry["summary"], entry["summary"], online.get(label)) for label, entry in result["policies"].items()
    ]
    return rows


def fidelity_table(result: dict) -> TableData:
    """Policy × cache error and output fidelity (and online accuracy when measured)."""
    online = bool(result.get("online"))
    columns = ["policy", "K err", "V err", "KL", "top-1", "1st tok"] + (["accuracy", "diverged"] if online else [])
    table = TableData(
        title=f"fidelity: {result['dense']['summary']['turns']} turns of {result.get('trace', 'the trace')}, "
        "teacher-forced, against the dense (NonShared) run",
        columns=columns,
        caption="K/V err: relative Frobenius error on the reused span, mean over layers and turns; KL(dense‖policy) "
        "in nats per output token; top-1: argmax agreement; 1st tok: first output token agreement"
        + (
            "; accuracy: exact match when the workflow is re-run under the policy; diverged: turns whose "
            "output differs from the dense re-run"
            if online
            else ""
        )
        + ".",
    )
    for label, summary, _, accuracy in _rows(result):
        cells = [
            label,
            _num(summary["k_error"], ".3g"),
            _num(summary["v_error"], ".3g"),
            _num(summary["kl"], ".3g"),
            _num(summary["top1"], ".3f"),
            _num(summary["first_token_match"], ".2f"),
        ]
        if online:
            cells += [
                _num(accuracy and accuracy["accuracy"], ".1%"),
                _num(accuracy and accuracy["diverged_turns"], ".1%"),
            ]
        table.add_row(*cells)
    return table


def cost_table(result: dict) -> TableData:
    """Policy × reuse, prefill, measured speed-ups and memory."""
    table = TableData(
        title=f"cost: {result.get('device', '')} {result.get('dtype', '')}, TTFT = median of "
        f"{result.get('repeats', 1)} repeats per turn"
        + (" after a warm-up" if result.get("repeats", 1) > 1 else " (no warm-up)"),
        columns=[
            "policy",
            "ρ tok",
            "ρ call",
            "ρ call*",
            "prefilled",
            "TTFT s",
            "TTFT ×",
            "implied ×",
            "latency s",
            "latency ×",
            "memory ×",
            "peak MiB",
        ],
        caption="ρ: share of input tokens (tok) / of calls (call) served from another agent's or an adapter-free "
        "cache, call* excluding source hops; TTFT s / latency s: summed over turns; × = dense ÷ policy (TTFT "
        "and latency measured side by side in this run; implied: tokens prefilled); memory = policy ÷ dense "
        "peak of analytic cache bytes.",
    )
    for label, summary, ratios, _ in _rows(result):
        table.add_row(
            label,
            _num(summary["reuse_per_token"], ".2f"),
            _num(summary["reuse_per_call"], ".2f"),
            _num(summary["reuse_per_call_excl_source"], ".2f"),
            str(summary["prefilled"]),
            _num(summary["ttft_s"], ".3f"),
            _num(ratios["ttft_speedup"], ".2f"),
            _num(ratios["prefill_speedup_implied"], ".2f"),
            _num(summary["latency_s"], ".3f"),
            _num(ratios["latency_speedup"], ".2f"),
            _num(ratios["memory_ratio"], ".2f"),
            _mib(summary["peak_memory_bytes"]),
        )
    return table


def layer_table(result: dict) -> TableData:
    """Per-layer V and K error of each policy (mean over turns with a reused span)."""
    layers = len(result["dense"]["summary"]["layers"]) or max(
        (len(entry["summary"]["layers"]) for entry in result["policies"].values()), default=0
    )
    table = TableData(
        title="per-layer relative error on the reused span (V / K)",
        columns=["policy"] + [f"layer {i}" for i in range(layers)],
    )
    for label, entry in result["policies"].items():
        per_layer = entry["summary"]["layers"]
        table.add_row(
            label,
            *[f"{row['v_error']:.3g} / {row['k_error']:.3g}" for row in per_layer] + ["–"] * (layers - len(per_layer)),
        )
    return table


def notes(result: dict) -> list[str]:
    """One line per policy: its paper, whether it is exact, and the figures its paper publishes (recorded in the
    result from the policy class), then the skipped policies."""
    lines = []
    for label, entry in result["policies"].items():
        exactness = "approximate" if entry["approximate"] else "exact"
        published = "; ".join(figure["claim"] for figure in entry.get("published", []))
        lines.append(f"{label}: {entry['paper']}, {exactness}" + (f"; published: {published}" if published else ""))
    lines += [f"skipped {name}: {reason}" for name, reason in result.get("skipped", {}).items()]
    settings = {figure["setting"] for entry in result["policies"].values() for figure in entry.get("published", [])}
    lines += [f"published figures measured on: {setting}" for setting in sorted(settings)]
    return lines


def sections(result: dict) -> list[Section]:
    """Dashboard sections: tables, per-layer error curves, per-turn TTFT, memory and KL."""
    policies = result["policies"]
    figures = []
    if any(entry["summary"]["layers"] for entry in policies.values()):
        for key, name in (("v_error", "V"), ("k_error", "K")):
            figures.append(
                line_figure(
                    range(len(next(iter(policies.values()))["summary"]["layers"])),
                    {
                        label: [row[key] for row in entry["summary"]["layers"]]
                        for label, entry in policies.items()
                        if entry["summary"]["layers"]
                    },
                    f"{name} relative error per layer",
                    "layer",
                    "‖X_pol − X_dense‖ / ‖X_dense‖",
                )
            )
    turns = range(len(result["dense"]["turns"]))
    runs = {"dense": result["dense"]["turns"]} | {label: entry["turns"] for label, entry in policies.items()}
    figures.append(
        line_figure(
            turns,
            {label: [t["ttft_s"] * 1e3 for t in rows] for label, rows in runs.items()},
            "TTFT per turn (median of repeats)",
            "turn",
            "ms",
        )
    )
    figures.append(
        line_figure(
            turns,
            {label: [t["memory_bytes"] / 2**20 for t in rows] for label, rows in runs.items()},
            "analytic cache memory after each turn",
            "turn",
            "MiB",
        )
    )
    figures.append(
        line_figure(
            turns,
            {label: [t["kl"] for t in entry["turns"]] for label, entry in policies.items()},
            "KL(dense ‖ policy) per turn",
            "turn",
            "nats / output token",
        )
    )
    return [
        Section(
            title="Sharing policies against the dense run",
            text=notes(result),
            tables=[fidelity_table(result), cost_table(result), layer_table(result)],
            figures=figures,
        )
    ]
