"""`kvprof rank-analysis`: effective rank and cross-agent similarity of caches, adapter outputs and deltas, per layer.

The maths lives in `kvprof.analysis`; this module parses options, shows progress and renders tables, verdicts, the
JSON result and the HTML report.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer

from kvprof.analysis import KV, RankAnalysis, analyze_trace, select_agents
from kvprof.cache import decoder_layers, resolve_layers
from kvprof.commands.common import (DeviceOption, DtypeOption, OutOption, SeedOption, console, progress,
                                    write_result)
from kvprof.errors import KvprofError
from kvprof.model import load_agents_for_trace
from kvprof.report import Section, TableData, heatmap_figure, line_figure, write_html
from kvprof.trace import read_trace

VERDICTS = {True: "holds", False: "does not hold", None: "n/a"}


def command(
    trace: Annotated[Optional[Path], typer.Argument(
        help="Trace file from `kvprof capture` (default: the demo world's sample trace).")] = None,
    model: Annotated[Optional[str], typer.Option(
        "--model", help="Base model directory (default: the one recorded in the trace).")] = None,
    agent: Annotated[Optional[list[str]], typer.Option(
        "--agent", help="NAME=ADAPTER_DIR: override an agent's adapter (lora mode). Repeat per agent.")] = None,
    agents: Annotated[Optional[str], typer.Option(
        "--agents", help="Comma-separated agents to compare (default: all in the trace), e.g. plan,act.")] = None,
    layers: Annotated[Optional[str], typer.Option(
        "--layers", help="Layers to analyse: 0,2 or 0-3 or a mix (default: all).")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(
        "--max-tokens", help="Use at most the first N tokens each agent holds (default: 2048).")] = 2048,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Use only the first N trajectories.")] = None,
    per_head: Annotated[bool, typer.Option(
        "--per-head", help="One (tokens, D) matrix per KV head, averaged over heads, instead of one flattened "
                           "(tokens, H_kv·D) matrix per layer.")] = False,
    out: OutOption = Path("runs/rank-analysis"),
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    seed: SeedOption = 0,
) -> None:
    """Effective rank and cross-agent cosine similarity of base caches, adapter outputs and deltas, per layer."""
    args = dict(locals())
    if max_tokens is not None and max_tokens < 1:
        raise KvprofError(f"--max-tokens {max_tokens} must be at least 1.")
    if limit is not None and limit < 1:
        raise KvprofError(f"--limit {limit} must be at least 1.")
    torch.manual_seed(seed)
    if trace is None:
        trace, model = _demo_trace(model)
        args.update(trace=trace, model=model)
    loaded = read_trace(trace)
    if limit is not None:
        loaded.trajectories = loaded.trajectories[:limit]
    names = select_agents(loaded, [name.strip() for name in agents.split(",") if name.strip()] if agents else None)
    agent_set = load_agents_for_trace(trace, model=model, agent_flags=agent, device=device, dtype=dtype)
    chosen = resolve_layers(parse_layers(layers), len(decoder_layers(agent_set)))
    started = time.perf_counter()
    with progress() as bar:
        job = bar.add_task("capturing and comparing caches", total=len(loaded.trajectories))
        result = analyze_trace(agent_set, loaded, names, chosen, max_tokens=max_tokens, per_head=per_head,
                               on_trajectory=lambda traj: bar.advance(job))
    elapsed = time.perf_counter() - started
    tables = layer_tables(result)
    for table in tables:
        console.print(table.to_rich())
    for claim in result.claims():
        verdict = {True: "[green]holds[/]", False: "[red]does not hold[/]", None: "[yellow]n/a[/]"}[claim.holds]
        console.print(f"{claim.paper}: {claim.statement} — {verdict} (measured {claim.measured}; {claim.detail})")
    payload = {"trace": str(trace), "model": agent_set.model_name, "seconds": round(elapsed, 3), **result.to_dict()}
    json_path = write_result(out, "rank_analysis", payload, args)
    html_path = write_html(out / "rank_analysis.html", "kvprof rank-analysis", report_sections(result, tables),
                           subtitle=f"{trace} · model {agent_set.model_name} · {result.mode} mode · "
                                    f"{len(result.pairs)} (trajectory, pair) spans · matrices {result.matrix}")
    console.print(f"wrote {json_path} and {html_path} ({elapsed:.1f} s)")


def parse_layers(text: str | None) -> list[int] | None:
    """'0,2' → [0, 2]; '0-3' → [0, 1, 2, 3]; mixes allowed; None → None (all layers)."""
    if text is None:
        return None
    chosen: list[int] = []
    for piece in text.split(","):
        piece = piece.strip()
        if not piece:
            continue
        low, sep, high = piece.partition("-")
        try:
            if sep:
                start, stop = int(low), int(high)
                if stop < start:
                    raise ValueError
                chosen.extend(range(start, stop + 1))
            else:
                chosen.append(int(piece))
        except ValueError:
            raise KvprofError(f"--layers {text!r} is not a list of layer indices or ranges; "
                              "use e.g. --layers 0,2 or --layers 0-3.") from None
    return chosen


def _demo_trace(model: str | None) -> tuple[Path, str | None]:
    """The demo world's sample trace (and its model, unless --model is given) when no TRACE is passed."""
    try:
        from kvprof.demo.assets import demo_world
    except ImportError:
        raise KvprofError("no TRACE given and the demo world is not installed; pass a trace file written by "
                          "`kvprof capture`.") from None
    world = demo_world()
    sample = getattr(world, "sample_trace", None)
    if sample is None:
        raise KvprofError("no TRACE given and the installed demo world has no sample trace; pass a trace file "
                          "written by `kvprof capture`.")
    return Path(sample), model or (str(world.model) if getattr(world, "model", None) else None)


def _rank(means: dict[str, float], name: str) -> str:
    """'effective (energy90/energy99)' of quantity `name`."""
    return f"{means[f'{name}_rank']:.1f} ({means[f'{name}_energy90']:.0f}/{means[f'{name}_energy99']:.0f})"


def layer_tables(result: RankAnalysis) -> list[TableData]:
    """Per-layer summary tables (means over trajectories and agent pairs): ranks, then norms and similarities.

    lora mode adds the base part X·W0 and the adapter output; prompt mode has neither.
    """
    lora = result.mode == "lora"
    spans = f"means over {len(result.pairs)} (trajectory, agent pair) spans"
    ranks = TableData(title=f"effective rank per layer, {result.mode} mode ({spans})",
                      columns=["layer", "C", *(["base X·W0", "adapter"] if lora else []), "Δ_j←i"],
                      caption=f"entropy effective rank (energy rank 90 %/99 %); matrices {result.matrix}")
    similarity = TableData(title=f"norms and cross-agent similarity per layer ({spans})",
                           columns=["layer", "‖Δ‖/‖C‖", *(["‖adapter‖/‖C‖"] if lora else []), "cos C",
                                    *(["cos base", "cos adapter"] if lora else [])],
                           caption="cos = mean token cosine between the two agents' states (source keys re-aligned "
                                   "to the target's positions)")
    for layer, by_kv in result.layer_means().items():
        for kv in KV:
            means = by_kv[kv]
            label = f"{layer} {kv}"
            if lora:
                ranks.add_row(label, _rank(means, "cache"), _rank(means, "base"), _rank(means, "adapter"),
                              _rank(means, "delta"))
                similarity.add_row(label, f"{means['delta_relative']:.3f}", f"{means['adapter_relative']:.3f}",
                                   f"{means['cache_cosine']:.4f}", f"{means['base_cosine']:.4f}",
                                   f"{means['adapter_cosine']:+.4f}")
            else:
                ranks.add_row(label, _rank(means, "cache"), _rank(means, "delta"))
                similarity.add_row(label, f"{means['delta_relative']:.3f}", f"{means['cache_cosine']:.4f}")
    return [ranks, similarity]


def report_sections(result: RankAnalysis, tables: list[TableData]) -> list[Section]:
    """HTML sections: verdicts and table, per-layer rank curves, spectra, and agent-pair similarity heatmaps."""
    verdicts = TableData(title="published claims", columns=["paper", "claim", "verdict", "measured", "detail"])
    for claim in result.claims():
        verdicts.add_row(claim.paper, claim.statement, VERDICTS[claim.holds], claim.measured, claim.detail)
    means = result.layer_means()
    layers = result.layers
    quantities = [("cache", "C"), ("base", "base X·W0"), ("adapter", "adapter output"), ("delta", "Δ")]
    rank_figures = [line_figure(layers, {f"{label} {kv}": [means[layer][kv][f"{name}_rank"] for layer in layers]
                                         for name, label in quantities for kv in KV
                                         if f"{name}_rank" in means[layers[0]][kv]},
                                "entropy effective rank per layer", "layer", "effective rank")]
    rank_figures.append(line_figure(
        layers, {f"{label} {kv}": [means[layer][kv][metric] for layer in layers]
                 for metric, label in (("delta_relative", "‖Δ‖/‖C‖"),
                                       ("adapter_relative", "‖adapter‖/‖C‖"))
                 for kv in KV if metric in means[layers[0]][kv]},
        "relative norms per layer", "layer", "ratio"))
    spectra = result.layer_spectra()
    spectrum_figures = []
    for kv in KV:
        series = {}
        for layer in layers:
            for name in ("cache", "delta"):
                cumulative = torch.tensor(spectra[layer][kv][name]).cumsum(0).tolist()
                series[f"layer {layer} {'C' if name == 'cache' else 'Δ'}"] = cumulative
        longest = max(len(values) for values in series.values())
        spectrum_figures.append(line_figure(list(range(1, longest + 1)), series,
                                            f"{kv}: cumulative energy of the singular spectrum (mean)",
                                            "number of singular directions k", "Σ_{i≤k} σ_i² / Σσ²"))
    heatmaps = []
    metrics = ["base_cosine", "adapter_cosine"] if result.mode == "lora" else ["cache_cosine"]
    labels = {"base_cosine": "base caches", "adapter_cosine": "adapter outputs", "cache_cosine": "caches"}
    for metric in metrics:
        for kv in KV:
            pairs = result.pair_means(metric, kv)
            grid = [[1.0 if a == b else pairs.get((a, b), pairs.get((b, a))) for b in result.agents]
                    for a in result.agents]
            heatmaps.append(heatmap_figure(grid, result.agents, result.agents,
                                           f"{kv}: mean token cosine of {labels[metric]} (mean over layers)",
                                           zmin=-1.0, zmax=1.0, colorscale="RdBu"))
    return [
        Section("Summary", text=[f"Agents {', '.join(result.agents)}; layers {', '.join(map(str, layers))}; "
                                 f"matrices {result.matrix}."], tables=[verdicts, *tables]),
        Section("Rank per layer", figures=rank_figures),
        Section("Singular spectra", text=["Mean over (trajectory, pair) spans; a curve that reaches 1 early means "
                                          "low rank."], figures=spectrum_figures),
        Section("Similarity across agent pairs", figures=heatmaps),
    ]
