"""Tables and figures of a `kvprof serve-bench` result: runs, per-agent rows, base against agents, TTFT CDFs,
throughput and TTFT p90 against load."""

from __future__ import annotations

import plotly.graph_objects as go

from kvprof.report.figures import base_layout, cycle_style, line_figure
from kvprof.report.html import Section
from kvprof.report.tables import TableData, milliseconds
from kvprof.results.serve_bench import ServeBenchResult, ServeSummary


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _gauge(summary: ServeSummary, name: str, scale: float = 1.0, unit: str = "") -> str:
    stats = (summary.server or {}).get("gauges", {}).get(name)
    return "-" if stats is None else f"{scale * stats['max']:.{1 if scale != 1 else 0}f}{unit}"


def runs_table(result: ServeBenchResult) -> TableData:
    """One row per run: requests, output agreement, prefix-hit ratio, latencies (ms), throughput, server gauges."""
    table = TableData(
        title="serve-bench: one row per reuse pattern and load",
        columns=[
            "pattern",
            "load",
            "requests",
            "agree",
            "cached",
            "TTFT p50",
            "TTFT p90",
            "TPOT p50",
            "e2e p90",
            "queue p90",
            "req/s",
            "tok/s",
            "max wait",
            "peak KV",
        ],
        caption="agree: outputs equal to the trace's, id for id; cached: prompt tokens the server found in its "
        "prefix cache; TTFT, TPOT (per output token after the first), e2e and queue (server-side wait before "
        "scheduling) in ms; tok/s counts prompt and output tokens; max wait / peak KV: the largest waiting "
        "request count and KV-cache use /metrics showed.",
    )
    for run in result.runs:
        summary = run.summary
        overall, agreement, throughput = summary.overall, summary.agreement or {}, summary.throughput or {}
        table.add_row(
            summary.pattern,
            summary.load.label,
            summary.requests,
            f"{agreement['matching']}/{agreement['requests']}",
            _percent(summary.prefix_hit_ratio),
            milliseconds(overall["ttft"], "p50"),
            milliseconds(overall["ttft"], "p90"),
            milliseconds(overall["tpot"], "p50"),
            milliseconds(overall["e2e"], "p90"),
            milliseconds(overall["server_queue"], "p90"),
            f"{throughput['requests_per_s']:.2f}",
            f"{throughput['tokens_per_s']:.0f}",
            _gauge(summary, "waiting"),
            _gauge(summary, "kv_cache_usage", 100, " %"),
        )
    return table


def agents_table(result: ServeBenchResult) -> TableData:
    """One row per run and agent: requests, prefix-hit ratio, TTFT p50/p90/p99 and e2e p90."""
    table = TableData(
        title="serve-bench per agent",
        columns=["pattern", "load", "agent", "requests", "cached", "TTFT p50", "TTFT p90", "TTFT p99", "e2e p90"],
        caption="times in ms; cached: the agent's prompt tokens served from the prefix cache.",
    )
    for run in result.runs:
        summary = run.summary
        for agent, stats in (summary.agents or {}).items():
            table.add_row(
                summary.pattern,
                summary.load.label,
                agent,
                stats["requests"],
                _percent(stats["prefix_hit_ratio"]),
                milliseconds(stats["ttft"], "p50"),
                milliseconds(stats["ttft"], "p90"),
                milliseconds(stats["ttft"], "p99"),
                milliseconds(stats["e2e"], "p90"),
            )
    return table


def comparison_table(result: ServeBenchResult) -> TableData | None:
    """Base against agents at each load run under both patterns; None when no load was."""
    rows = result.comparison or []
    if not rows:
        return None
    table = TableData(
        title="what sharing caches across agents could win on this engine (base pattern against agents)",
        columns=["load", "cached agents", "cached base", "TTFT p90 agents", "TTFT p90 base", "TTFT p90 ×", "tok/s ×"],
        caption="TTFT p90 × = agents' / base's; tok/s × = base's throughput / agents'. The base pattern's outputs "
        "are the base model's, not the agents': it bounds what a sharing policy can win, not what it keeps.",
    )
    for row in rows:
        table.add_row(
            row["load"],
            _percent(row["prefix_hit_ratio_agents"]),
            _percent(row["prefix_hit_ratio_base"]),
            "-" if row["ttft_p90_agents"] is None else f"{1000 * row['ttft_p90_agents']:.0f} ms",
            "-" if row["ttft_p90_base"] is None else f"{1000 * row['ttft_p90_base']:.0f} ms",
            "-" if row["ttft_p90_ratio"] is None else f"{row['ttft_p90_ratio']:.2f}×",
            "-" if row["throughput_ratio"] is None else f"{row['throughput_ratio']:.2f}×",
        )
    return table


def ttft_cdf_figure(result: ServeBenchResult) -> go.Figure:
    """The empirical CDF of TTFT, one line per (pattern, load)."""
    labels = [f"{run.summary.pattern} @ {run.summary.load.label}" for run in result.runs]
    style = cycle_style(labels)
    figure = go.Figure()
    for label, run in zip(labels, result.runs):
        ttfts = sorted(1000 * request["ttft"] for request in run.requests)
        look = style(label)
        figure.add_trace(
            go.Scatter(
                x=ttfts,
                y=[(i + 1) / len(ttfts) for i in range(len(ttfts))],
                mode="lines",
                line=dict(shape="hv", **look.line()),
                name=label,
                legendgroup=label,
            )
        )
    base_layout(figure, "TTFT CDF per load")
    figure.update_layout(xaxis_title="TTFT (ms)", yaxis_title="fraction of requests")
    return figure


def load_figures(result: ServeBenchResult) -> list[go.Figure]:
    """Throughput and TTFT p90 against load, one line per pattern (loads in the order they ran)."""
    summaries = [run.summary for run in result.runs]
    load_labels = list(dict.fromkeys(s.load.label for s in summaries))
    patterns = list(dict.fromkeys(s.pattern for s in summaries))

    def series(value) -> dict[str, list[float | None]]:
        table = {(s.pattern, s.load.label): s for s in summaries}
        return {
            name: [value(table[(name, label)]) if (name, label) in table else None for label in load_labels]
            for name in patterns
        }

    throughput = series(lambda s: (s.throughput or {})["tokens_per_s"])
    ttft_p90 = series(lambda s: 1000 * s.overall["ttft"]["p90"] if s.overall["ttft"] else None)
    return [
        line_figure(load_labels, throughput, "throughput against load", "load", "tokens/s (prompt + output)"),
        line_figure(load_labels, ttft_p90, "TTFT p90 against load", "load", "TTFT p90 (ms)"),
    ]


def sections(result: ServeBenchResult) -> list[Section]:
    """The serve-bench dashboard section."""
    server = result.server
    text = [
        f"trace {result.trace} ({result.mode} mode, {len(result.trajectories or [])} trajectories) on "
        f"{'a vLLM server kvprof started' if server['started'] else 'the server'} at {server['url']} (version "
        f"{server.get('version') or 'unknown'}); base model "
        f"{server['base']}" + (f", adapters {', '.join(server['adapters'])}" if server["adapters"] else "") + ".",
        "agents: each turn on its agent's adapter (vLLM's prefix cache keys blocks by adapter: an agent reuses only "
        "its own earlier prefixes). base: every turn on the base model (prefixes shared across agents, FullShared's "
        "compute and memory pattern). Their difference bounds what a sharing policy can win on this engine.",
    ]
    tables = [runs_table(result), agents_table(result)]
    comparison = comparison_table(result)
    if comparison is not None:
        tables.append(comparison)
    return [
        Section(
            "serve-bench: the trace's agents on a serving engine under load",
            text=text,
            tables=tables,
            figures=[ttft_cdf_figure(result), *load_figures(result)],
            order="details",
            wide=1,
        )
    ]
