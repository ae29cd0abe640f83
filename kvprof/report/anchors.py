"""Tables, figures and dashboard sections of `kvprof fit-anchors` and `kvprof tune-tau` results (the terminal and
HTML share the tables)."""

from __future__ import annotations

from kvprof.report.html import Section
from kvprof.report.tables import TableData
from kvprof.results.tune_tau import SweepRow, TuneTauResult


def _bytes(count: int | None) -> str:
    return "—" if count is None else f"{count / 2**20:.2f} MiB"


def fit_error_table(report: dict) -> TableData:
    """Per layer: relative Frobenius error of the anchors' deltas (K / V) truncated to each rank; mean effective rank
    of deltas and bases."""
    ranks = report["ranks"]
    table = TableData(
        "anchor deltas, truncated SVD of each layer's (L × H_kv·D) matrix: relative error at rank k (K / V), "
        f"{report['anchors']} anchors",
        ["layer", *[f"k={rank}" for rank in ranks], "eff. rank Δ K/V", "eff. rank base K/V"],
        caption="error: energy of the deltas beyond rank k, ‖Z − Z_k‖/‖Z‖ over every anchor and agent of the layer"
        "; effective rank: exp(entropy of σ/Σσ), mean over matrices.",
    )
    for row in report["layers"]:
        keys, values = row["delta_k"], row["delta_v"]
        table.add_row(
            row["layer"],
            *[f"{keys['error_at_rank'][str(r)]:.2f}/{values['error_at_rank'][str(r)]:.2f}" for r in ranks],
            f"{keys['effective_rank']:.1f} / {values['effective_rank']:.1f}",
            f"{row['base_k']['effective_rank']:.1f} / {row['base_v']['effective_rank']:.1f}",
        )
    return table


def fit_memory_table(report: dict) -> TableData:
    """The pool's bytes full-dimensional and at rank r, measured on the tensors and by the formula."""
    memory = report["memory"]
    table = TableData(
        f"anchor pool memory ({report['anchors']} anchors, V = {report['anchors_per_slot']} per slot, "
        f"{len(report['agents'])} agents)",
        ["storage", "measured", "formula", "formula"],
        caption="formula per stored matrix: layers·H_kv·L·D (full) or layers·min(r, L, H_kv·D)·(L + H_kv·D) (rank r); "
        "per anchor, K and V of its base and of one delta per other agent.",
    )
    table.add_row(
        "full-dimensional (KVComm)",
        _bytes(memory["full_bytes"]),
        _bytes(memory["full_formula_bytes"]),
        "O(V·N·L·D)",
    )
    table.add_row(
        f"rank {report['rank']} factors (KVCMAS)",
        _bytes(memory["low_rank_bytes"]),
        _bytes(memory["low_rank_formula_bytes"]),
        "O(V·N·r·(L+H·D))",
    )
    saving = memory["saving"]
    table.add_row("saving", f"{saving:.2f}×" if saving else "—", "", "")
    return table


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _row_cells(row: SweepRow) -> list[str]:
    accuracy = "—" if row.accuracy is None else f"{100 * row.accuracy:.0f} % ({row.accuracy_drop:+.0f})"
    return [
        f"{row.rho:.2f}",
        f"{row.kl:.2e}",
        f"{row.top1:.3f}",
        f"{row.k_error:.3f} / {row.v_error:.3f}",
        accuracy,
        _ratio(row.ttft_speedup),
        _ratio(row.latency_speedup),
        _ratio(row.memory_ratio),
    ]


COLUMNS = ["ρ", "KL", "top-1", "K / V err", "accuracy (drop, pts)", "TTFT ×", "latency ×", "memory ×"]


def sweep_table(result: TuneTauResult) -> TableData:
    """One row per swept threshold on the tuning trajectories; the recommended one marked."""
    key = result.threshold_option
    best = result.recommended
    table = TableData(
        f"{result.policy}: {key} swept on {len(result.tuning_trajectories)} tuning trajectories "
        f"(target: {result.target})",
        [key, *COLUMNS, ""],
        caption="ρ: of other agents' segment tokens the gate decided on, the share served corrected; KL per output "
        "token against the dense run (teacher-forced); accuracy: exact match when the workflow is re-run under the "
        "policy, drop in points below the dense re-run; speed-ups and memory measured against the dense run in the "
        "same replay. ★ recommended, ✓ meets the target.",
    )
    for row in result.rows:
        mark = "★" if best is not None and row.threshold == best.threshold else ""
        mark += "✓" if row.target_met else ""
        table.add_row(f"{row.threshold:g}", *_row_cells(row), mark)
    return table


def verification_lines(result: TuneTauResult) -> list[str]:
    """The recommendation and how it fared on the held-out trajectories, as sentences."""
    best = result.recommended
    key = result.threshold_option
    if best is None:
        return [f"no {key} in the sweep meets the target ({result.target}); loosen the target or widen --grid."]
    lines = [f"recommended {key} = {best.threshold:g}: ρ {best.rho:.2f}, KL {best.kl:.2e} on the tuning trajectories."]
    held = result.heldout
    if held is None:
        lines.append("no held-out trajectories to verify it on (--tune covers the whole trace).")
    else:
        verdict = "meets" if held.target_met else "MISSES"
        lines.append(
            f"held-out ({len(result.heldout_trajectories or [])} trajectories): ρ {held.rho:.2f}, KL {held.kl:.2e}"
            + (
                f", accuracy {100 * held.accuracy:.0f} % (drop {held.accuracy_drop:+.0f} pts)"
                if held.accuracy is not None
                else ""
            )
            + f" — {verdict} the target ({result.target})."
        )
    return lines


def pareto_figure(result: TuneTauResult):
    """ρ against KL (log) and, with online re-runs, against the accuracy drop; the front and the recommendation."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = result.rows
    online = any(row.accuracy is not None for row in rows)
    titles = ["KL(dense ‖ policy) vs reuse ρ"] + (["accuracy drop (points) vs reuse ρ"] if online else [])
    figure = make_subplots(rows=1, cols=len(titles), subplot_titles=titles, horizontal_spacing=0.12)
    key = result.threshold_option
    labels = [f"{key}={row.threshold:g}" for row in rows]
    floor = min((row.kl for row in rows if row.kl > 0), default=1e-12) / 10
    front = [row for row in rows if row.threshold in result.pareto]
    figure.add_trace(
        go.Scatter(
            x=[row.rho for row in rows],
            y=[max(row.kl, floor) for row in rows],
            mode="markers+text",
            text=labels,
            textposition="top center",
            name="sweep",
            marker={"size": 9, "color": "#0072B2"},
        ),
        row=1,
        col=1,
    )
    figure.add_trace(
        go.Scatter(
            x=[row.rho for row in front],
            y=[max(row.kl, floor) for row in front],
            mode="lines",
            name="Pareto front",
            line={"color": "#0072B2", "dash": "dot"},
        ),
        row=1,
        col=1,
    )
    best = result.recommended
    if best is not None:
        figure.add_trace(
            go.Scatter(
                x=[best.rho],
                y=[max(best.kl, floor)],
                mode="markers",
                name=f"recommended {key}={best.threshold:g}",
                marker={"size": 16, "symbol": "star", "color": "#D55E00"},
            ),
            row=1,
            col=1,
        )
    figure.update_yaxes(type="log", title_text="KL per output token (nats)", row=1, col=1)
    figure.update_xaxes(title_text="ρ (share of others' segment tokens served corrected)", row=1, col=1)
    if online:
        figure.add_trace(
            go.Scatter(
                x=[row.rho for row in rows],
                y=[row.accuracy_drop for row in rows],
                mode="markers+text",
                text=labels,
                textposition="top center",
                name="accuracy drop",
                marker={"size": 9, "color": "#009E73"},
            ),
            row=1,
            col=2,
        )
        figure.update_yaxes(title_text="accuracy drop (points)", row=1, col=2)
        figure.update_xaxes(title_text="ρ", row=1, col=2)
    count = len(result.tuning_trajectories)
    figure.update_layout(height=460, title=f"{result.policy}: {key} sweep (n = {count} tuning trajectories)")
    return figure


def error_figure(report: dict):
    """Truncation error of the deltas against rank, one curve per layer and side."""
    import plotly.graph_objects as go

    figure = go.Figure()
    ranks = report["ranks"]
    for row in report["layers"]:
        for part, dash in (("delta_k", "solid"), ("delta_v", "dot")):
            figure.add_trace(
                go.Scatter(
                    x=ranks,
                    y=[row[part]["error_at_rank"][str(r)] for r in ranks],
                    mode="lines+markers",
                    name=f"layer {row['layer']} Δ{part[-1].upper()}",
                    line={"dash": dash},
                )
            )
    figure.add_vline(x=report["rank"], line_dash="dash", annotation_text=f"r = {report['rank']}")
    figure.update_xaxes(type="log", title_text="rank k")
    figure.update_yaxes(title_text="‖Δ − Δ_k‖ / ‖Δ‖")
    figure.update_layout(height=420, title=f"anchor deltas: truncation error vs rank ({report['anchors']} anchors)")
    return figure


def fit_sections(report: dict) -> list[Section]:
    """Dashboard sections of a fit-anchors result."""
    return [
        Section(
            "Anchor pools: truncation error and memory",
            text=[f"Fitted on {report['trajectories']} trajectories of {report['trace']}; pool {report['pool']}."],
            tables=[fit_error_table(report), fit_memory_table(report)],
            figures=[error_figure(report)],
        )
    ]


def tune_sections(result: TuneTauResult) -> list[Section]:
    """Dashboard sections of a tune-tau result: the recommendation first."""
    return [
        Section(
            f"{result.policy}: {result.threshold_option} sweep",
            card=verification_lines(result),
            tables=[sweep_table(result)],
            figures=[pareto_figure(result)],
            order="decision",
            wide=1,
        )
    ]
