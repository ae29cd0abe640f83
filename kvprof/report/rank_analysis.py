"""Tables and figures of a rank-analysis result (the JSON `kvprof rank-analysis` writes), for terminal and dashboard."""

from __future__ import annotations

from itertools import accumulate
from pathlib import Path

from kvprof.claims.papers import KVCMAS_DELTA_RANK, LRAGENT_BASE_COSINE, LRAGENT_ORTHOGONAL
from kvprof.claims.rank import KV_NAMES
from kvprof.report.figures import Reference, StyleOf, cycle_style, heatmap_figure, line_figure
from kvprof.report.html import Section, write_html
from kvprof.report.styles import PolicyStyle
from kvprof.report.tables import TableData
from kvprof.results.rank_analysis import RankAnalysisResult

VERDICTS = {True: "holds", False: "does not hold", None: "n/a"}
QUANTITIES = {"cache": "C", "base": "base X·W0", "adapter": "adapter output", "delta": "Δ"}
CONTEXT_FREE_DELTA = "Δ vs context-free"  # label of the prompt-mode delta against the context-free reference


def _rank(means: dict[str, float], name: str) -> str:
    """'effective (energy90/energy99)' of quantity `name`."""
    return f"{means[f'{name}_rank']:.1f} ({means[f'{name}_energy90']:.0f}/{means[f'{name}_energy99']:.0f})"


def layer_tables(result: RankAnalysisResult) -> list[TableData]:
    """Per-layer means over (trajectory, agent pair) spans: ranks, then norms and similarities; lora mode adds X·W0
    and the adapter output, prompt mode the context-free deltas (absent in older results)."""
    lora = result.mode == "lora"
    spans = f"means over {len(result.pairs)} (trajectory, agent pair) spans"
    ranks = TableData(
        title=f"effective rank per layer, {result.mode} mode ({spans})",
        columns=["layer", "C", *(["base X·W0", "adapter"] if lora else []), "Δ_j←i"],
        caption=f"entropy effective rank (energy rank 90 %/99 %); matrices {result.matrix}",
    )
    similarity = TableData(
        title=f"norms and cross-agent similarity per layer ({spans})",
        columns=[
            "layer",
            "‖Δ‖/‖C‖",
            *(["‖adapter‖/‖C‖"] if lora else []),
            "cos C",
            *(["cos base", "cos adapter"] if lora else []),
        ],
        caption="cos = mean token cosine between the two agents' states (source keys re-aligned "
        "to the target's positions)",
    )
    for entry in result.layer_means:
        for kv in KV_NAMES:
            means, label = entry[kv], f"{entry['layer']} {kv}"
            if lora:
                ranks.add_row(
                    label, _rank(means, "cache"), _rank(means, "base"), _rank(means, "adapter"), _rank(means, "delta")
                )
                similarity.add_row(
                    label,
                    f"{means['delta_relative']:.3f}",
                    f"{means['adapter_relative']:.3f}",
                    f"{means['cache_cosine']:.4f}",
                    f"{means['base_cosine']:.4f}",
                    f"{means['adapter_cosine']:+.4f}",
                )
            else:
                ranks.add_row(label, _rank(means, "cache"), _rank(means, "delta"))
                similarity.add_row(label, f"{means['delta_relative']:.3f}", f"{means['cache_cosine']:.4f}")
    context_free = result.context_free
    return [ranks, similarity, *([context_free_table(context_free)] if context_free else [])]


def context_free_table(context_free: dict) -> TableData:
    """Per-layer means of the prompt-mode deltas against the context-free reference (`result.context_free`)."""
    table = TableData(
        title="delta against the context-free reference per layer, prompt mode (means over "
        f"{len(context_free['segments'])} (trajectory, agent, segment) records)",
        columns=["layer", "C_j,seg", "Δ_j", "‖Δ_j‖/‖C_j,seg‖", "cos C, ref"],
        caption="Δ_j = C_j,seg − R(C_ref,seg): an agent's cache of a shared segment minus the segment encoded alone "
        "(no prefix), keys re-aligned to the agent's positions; entropy effective rank (energy rank 90 %/99 %); "
        "every record counts once, short segments as much as long ones (the KVCMAS verdict takes the records "
        "of more than 32 tokens when there are any)",
    )
    for entry in context_free["layer_means"]:
        for kv in KV_NAMES:
            means = entry[kv]
            table.add_row(
                f"{entry['layer']} {kv}",
                _rank(means, "cache"),
                _rank(means, "delta"),
                f"{means['delta_relative']:.3f}",
                f"{means['reference_cosine']:.4f}",
            )
    return table


def verdict_lines(result: RankAnalysisResult) -> list[str]:
    """One line per published claim: paper, claim, verdict, measured value and detail."""
    return [
        f"{c.paper}: {c.statement} — {VERDICTS[c.holds]} (measured {c.measured}; {c.detail})" for c in result.claims
    ]


def _layer_grid(result: RankAnalysisResult, metric: str, kv: str) -> tuple[list[str], list[list[float | None]]]:
    """Agent pairs × layers: `metric`'s mean over each unordered pair's trajectories (None: not measured); labels,
    grid."""
    layers = [entry["layer"] for entry in result.layer_means]
    sums: dict[tuple[str, str], dict[int, list[float]]] = {}
    order = {agent: i for i, agent in enumerate(result.agents)}
    for pair in result.pairs:
        key = tuple(sorted((pair["source"], pair["target"]), key=lambda agent: order.get(agent, len(order))))
        for entry in pair["layers"]:
            sums.setdefault(key, {}).setdefault(entry["layer"], []).append(entry[kv][metric])  # type: ignore[arg-type]
    rows = sorted(sums, key=lambda key: [order.get(agent, len(order)) for agent in key])
    grid = [
        [sum(sums[key][layer]) / len(sums[key][layer]) if layer in sums[key] else None for layer in layers]
        for key in rows
    ]
    return [" – ".join(key) for key in rows], grid


QUANTITY_STYLES = {  # colour and dash per quantity; K and V differ in marker
    "C": ("#0072B2", "solid"),
    "base X·W0": ("#009E73", "dash"),
    "adapter output": ("#E69F00", "dot"),
    "Δ": ("#D55E00", "dashdot"),
    CONTEXT_FREE_DELTA: ("#CC79A7", "longdash"),
    "‖Δ‖/‖C‖": ("#D55E00", "solid"),
    "‖adapter‖/‖C‖": ("#E69F00", "dash"),
    "caches": ("#0072B2", "solid"),
    "base caches": ("#009E73", "dash"),
    "adapter outputs": ("#E69F00", "dot"),
}


def quantity_style(name: str) -> PolicyStyle:
    """`<quantity> <K|V>` → the quantity's colour and dash, a circle for K and a square for V."""
    quantity, _, kv = name.rpartition(" ")
    color, dash = QUANTITY_STYLES.get(quantity, ("#888888", "solid"))
    return PolicyStyle(color, "circle" if kv == "K" else "square-open", dash)


def spectrum_style(layers: list[int]) -> StyleOf:
    """`layer <i> <quantity>` → one colour per layer, one dash per quantity."""
    colours = cycle_style([str(layer) for layer in layers])
    dashes = {QUANTITIES["cache"]: "solid", QUANTITIES["delta"]: "dash", CONTEXT_FREE_DELTA: "dot"}

    def style(name: str) -> PolicyStyle:
        _, layer, quantity = name.split(" ", 2)
        return PolicyStyle(colours(layer).color, "circle", dashes.get(quantity, "dashdot"))

    return style


COSINE_LABELS = {"cache_cosine": "caches", "base_cosine": "base caches", "adapter_cosine": "adapter outputs"}


def figures(result: RankAnalysisResult) -> tuple[list, list, list]:
    """Per-layer curves with the claims' thresholds, cumulative spectra, agent-pair × layer cosine heatmaps."""
    spectra = [_spectrum_figure(result, kv) for kv in KV_NAMES]
    return _layer_curves(result), spectra, _cosine_heatmaps(result)


def _layer_curves(result: RankAnalysisResult) -> list:
    """Effective rank, relative norms and cross-agent cosine per layer, with the papers' thresholds."""
    layers = [entry["layer"] for entry in result.layer_means]
    present = result.layer_means[0]["K"]
    context_free = result.context_free

    def per_layer(metrics: dict[str, str]) -> dict[str, list[float]]:
        """`label K|V` → its metric per layer, for the metrics this result has."""
        return {
            f"{label} {kv}": [entry[kv][metric] for entry in result.layer_means]
            for metric, label in metrics.items()
            for kv in KV_NAMES
            if metric in present
        }

    reference_ranks = (
        {
            f"{CONTEXT_FREE_DELTA} {kv}": [entry[kv]["delta_rank"] for entry in context_free["layer_means"]]
            for kv in KV_NAMES
        }
        if context_free
        else {}
    )
    cosine_references = [Reference(LRAGENT_BASE_COSINE, f"LRAgent: base caches > {LRAGENT_BASE_COSINE}")]
    if "adapter_cosine" in present:
        cosine_references += [
            Reference(LRAGENT_ORTHOGONAL, f"LRAgent: |adapter cos| < {LRAGENT_ORTHOGONAL}"),
            Reference(-LRAGENT_ORTHOGONAL, ""),
        ]
    ranks = per_layer({f"{name}_rank": label for name, label in QUANTITIES.items()}) | reference_ranks
    norms = per_layer({"delta_relative": "‖Δ‖/‖C‖", "adapter_relative": "‖adapter‖/‖C‖"})
    rank_reference = [Reference(KVCMAS_DELTA_RANK, f"KVCMAS: Δ rank < {KVCMAS_DELTA_RANK:g}")]
    return [
        line_figure(
            layers,
            ranks,
            "entropy effective rank per layer",
            "layer",
            "effective rank",
            style=quantity_style,
            references=rank_reference,
        ),
        line_figure(layers, norms, "relative norms per layer", "layer", "ratio", style=quantity_style),
        line_figure(
            layers,
            per_layer(COSINE_LABELS),
            "mean token cosine between two agents, per layer",
            "layer",
            "cosine",
            style=quantity_style,
            references=cosine_references,
        ),
    ]


def _spectrum_figure(result: RankAnalysisResult, kv: str):
    """`kv`'s cumulative energy spectra, per layer, of the caches and the deltas (context-free deltas too)."""
    series = {
        f"layer {entry['layer']} {QUANTITIES[name]}": list(accumulate(entry[kv][name]))
        for entry in result.spectra
        for name in ("cache", "delta")
    }
    if result.context_free:
        series |= {
            f"layer {entry['layer']} {CONTEXT_FREE_DELTA}": list(accumulate(entry[kv]["delta"]))
            for entry in result.context_free["spectra"]
        }
    longest = max(len(values) for values in series.values())
    zero = [name for name, values in series.items() if not any(values)]  # an exactly zero Δ has no spectrum
    return line_figure(
        list(range(1, longest + 1)),
        {name: values for name, values in series.items() if name not in zero},
        f"{kv}: energy captured by the top k singular directions (mean over spans)"
        + (f"<br><sup>zero, not drawn: {', '.join(zero)}</sup>" if zero else ""),
        "singular directions k (log)",
        "fraction of Σσ²",
        style=spectrum_style([entry["layer"] for entry in result.spectra]),
        markers=False,
        references=[
            Reference(0.9, "90 %"),
            Reference(0.99, "99 %"),
            Reference(KVCMAS_DELTA_RANK, f"k = {KVCMAS_DELTA_RANK:g}", axis="x"),
        ],
        log_x=True,
    )


def _cosine_heatmaps(result: RankAnalysisResult) -> list:
    """Agent pair × layer heatmaps of the cosines the mode has (base and adapter in lora mode, caches in prompt)."""
    layers = [entry["layer"] for entry in result.layer_means]
    heatmaps = []
    for metric in ["base_cosine", "adapter_cosine"] if result.mode == "lora" else ["cache_cosine"]:
        for kv in KV_NAMES:
            rows, grid = _layer_grid(result, metric, kv)
            heatmaps.append(
                heatmap_figure(
                    grid,
                    [f"layer {layer}" for layer in layers],
                    rows,
                    f"{kv}: mean token cosine of {COSINE_LABELS[metric]}, agent pair × layer",
                    colorbar_title="cosine",
                )
            )
    return heatmaps


def sections(result: RankAnalysisResult) -> list[Section]:
    """Dashboard sections: verdicts and tables, per-layer curves, spectra, heatmaps."""
    verdicts = TableData(
        title="published claims", columns=["paper", "claim", "verdict", "measured", "detail", "quantity measured"]
    )
    for claim in result.claims:
        verdicts.add_row(
            claim.paper,
            claim.statement,
            VERDICTS[claim.holds],
            claim.measured,
            claim.detail,
            claim.quantity or "",
        )
    layers = [entry["layer"] for entry in result.layer_means]
    curves, spectra, heatmaps = figures(result)
    return [
        Section(
            "Cache rank and cross-agent similarity",
            text=[
                f"Agents {', '.join(result.agents)}; layers {', '.join(map(str, layers))}; "
                f"{result.mode} mode; matrices {result.matrix}."
            ],
            tables=[verdicts, *layer_tables(result)],
        ),
        Section(
            "Rank, norms and cosines per layer",
            text=["Dotted lines: the published claims' thresholds (a claim holds when every layer is on its side)."],
            figures=curves,
        ),
        Section(
            "Singular spectra",
            text=["Mean over (trajectory, pair) spans; a curve that reaches 1 early means low rank."],
            figures=spectra,
        ),
        Section(
            "Similarity across agent pairs",
            text=["Only measured cells are coloured; the colour range is the measured range."],
            figures=heatmaps,
        ),
    ]


def write_report(path: Path, result: RankAnalysisResult) -> Path:
    """The HTML page of a rank-analysis result, under a line naming trace, model, mode, spans and matrices."""
    return write_html(
        path,
        "kvprof rank-analysis",
        sections(result),
        subtitle=f"{result.trace} · model {result.model} · {result.mode} mode · "
        f"{len(result.pairs)} (trajectory, pair) spans · matrices {result.matrix}",
    )
