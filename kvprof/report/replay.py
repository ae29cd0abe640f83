"""Tables and figures of a replay result (the JSON `kvprof replay` writes), for the terminal and the dashboard."""

from __future__ import annotations

from kvprof.report import decision
from kvprof.report.figures import box_figure, line_figure
from kvprof.report.html import Section
from kvprof.report.styles import DENSE, policy_style
from kvprof.report.tables import TableData, cell
from kvprof.report.uncertainty import LEVEL, RESAMPLES
from kvprof.results.replay import (
    FUSED_EXPANSION,
    STORED_IN_SHORT_FORWARDS,
    PolicySummary,
    ReplayResult,
    RunSummary,
    measured,
    summary_of,
)


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f}"


def _device(result: ReplayResult) -> str:
    """The device a replay ran on; for the CPU its name and matrix extensions (they decide which dtype is fast)."""
    device = result.device or ""
    cpu = result.cpu
    if device != "cpu" or not cpu:
        return device
    return f"cpu ({cpu['name']}; {', '.join(cpu['matrix_flags']) or 'no AVX2'})"


def _low_rank_attention(result: ReplayResult) -> str:
    """Clauses on how the low-rank policies attended where it is not the plain path: views expanded by the fused
    CPU kernel, short forwards over the rank-r values as stored."""
    path = result.lora_attention or ""
    clauses = [f"low-rank views expanded by {FUSED_EXPANSION}"] if FUSED_EXPANSION in path else []
    if STORED_IN_SHORT_FORWARDS in path:
        clauses.append("short forwards attend the rank-r values as stored (Flash-LoRA-Attention)")
    return "".join(f"; {clause}" for clause in clauses)


DENSE_RATIOS = dict.fromkeys(
    (
        "ttft_speedup",
        "tpot_speedup",
        "prefill_speedup_implied",
        "ttft_speedup_implied_flops",
        "harness_efficiency",
        "latency_speedup",
        "memory_ratio",
        "working_memory_ratio",
    ),
    1.0,
)
"""The dense run's ratios to itself that the tables show (the others are '–')."""


def _ratio(summary: RunSummary, name: str) -> float | None:
    """A run's ratio `name` to the dense run (`PolicySummary`); the dense run's own is `DENSE_RATIOS`'."""
    return getattr(summary, name) if isinstance(summary, PolicySummary) else DENSE_RATIOS.get(name)


def _rows(result: ReplayResult) -> list[tuple[str, RunSummary, dict | None]]:
    """(label, summary, online result) for the dense run and each policy."""
    online = result.online or {}
    rows: list[tuple[str, RunSummary, dict | None]] = [
        ("dense (NonShared)", summary_of(DENSE, result.dense), online.get("dense"))
    ]
    rows += [(label, summary_of(label, run), online.get(label)) for label, run in result.policies.items()]
    return rows


def dense_check(result: ReplayResult | dict) -> str:
    """Share of the trace's outputs the dense run reproduces (greedy, teacher-forced); below 100 % on a trace of this
    model means other weights, dtype or library versions."""
    result = ReplayResult.of(result)
    agreement = summary_of(DENSE, result.dense).trace_agreement
    text = f"dense run reproduces {agreement:.1%} of the trace's output tokens"
    source = result.trace_source or "capture"
    if source != "capture":
        return text + f" (source {source!r}: its outputs may come from another model; 100 % says this one wrote them)"
    if agreement < 1.0:
        return (
            "WARNING: "
            + text
            + ", but the trace was captured from this model: it is replayed with other weights, dtype or library "
            "versions than it was captured with, so every figure below is measured against a different oracle"
        )
    return text


def timeline_note(result: ReplayResult | dict) -> str:
    """How many turns left the shared context, why, how many returned to an earlier state, at what cost; on a
    hybrid, the checkpoint rule its calls resumed under; empty when neither applies."""
    result = ReplayResult.of(result)
    rule = result.checkpoint_rule
    hybrid = (
        f"hybrid model: each call resumed its recurrent layers from the last state the {rule['label']} checkpoint "
        "rule kept inside the prefix it shares, the rest recomputed"
        if rule
        else ""
    )
    timeline = summary_of(DENSE, result.dense).timeline
    moved = timeline.get("moved_tokens", 0) if timeline else 0
    if not timeline or not (timeline["left"] or timeline["restored"] or moved):
        return hybrid
    causes = ", ".join(f"{count} {cause}" for cause, count in sorted(timeline["causes"].items()))
    return (
        f"{timeline['left']} of {timeline['turns']} turns left the shared context the turns before them built"
        + (f" ({causes})" if causes else "")
        + f"; {timeline['restored']} returned to an earlier turn's context; every policy reused each turn's longest "
        f"common prefix with earlier turns ({timeline['dropped_tokens']} stored tokens dropped at divergences); "
        f"{moved} input tokens lay in moved spans (ids other turns processed at other positions): the policies "
        "that move spans re-aligned them, the others recomputed them" + (f"\n{hybrid}" if hybrid else "")
    )


def fidelity_table(result: ReplayResult | dict) -> TableData:
    """Policy × cache error and output fidelity (and online accuracy when measured)."""
    result = ReplayResult.of(result)
    online = bool(result.online)
    columns = ["policy", "K err", "V err", "KL", "top-1", "1st tok"] + (["accuracy", "diverged"] if online else [])
    check = dense_check(result)
    table = TableData(
        title=f"fidelity: {summary_of(DENSE, result.dense).turns} turns of {result.trace or 'the trace'}, "
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
        + "."
        + (f" {check[0].upper()}{check[1:]}." if check else ""),
    )
    for label, summary, accuracy in _rows(result):
        cells = [
            label,
            cell(summary.k_error, ".3g"),
            cell(summary.v_error, ".3g"),
            cell(summary.kl, ".3g"),
            cell(summary.top1, ".3f"),
            cell(summary.first_token_match, ".2f"),
        ]
        if online:
            cells += [
                cell(accuracy and accuracy["accuracy"], ".1%"),
                cell(accuracy and accuracy["diverged_turns"], ".1%"),
            ]
        table.add_row(*cells)
    return table


def reuse_table(result: ReplayResult | dict) -> TableData:
    """Policy × reuse ratios and tokens prefilled."""
    result = ReplayResult.of(result)
    table = TableData(
        title="reuse: tokens served from stored caches instead of prefilled",
        columns=[
            "policy",
            "ρ tok",
            "ρ call",
            "ρ call*",
            "adapter-free tok",
            "recomputed",
            "prefilled",
            "implied ×",
            "FLOP ×",
        ],
        caption="ρ: share of input tokens (tok) / of calls (call) reused from caches of tokens another agent "
        "processed first — one definition for every policy — call* excluding source hops; adapter-free tok: share "
        "of input tokens served from an adapter-free cache; recomputed: share of the reused span's (token, layer) "
        "K/V entries recomputed for the acting agent (selective recompute; the KV reuse ratio is 1 − it); "
        "prefilled: tokens through the backbone (chunks, LR prefills, prefixes; a recompute counts its (token, "
        "layer) entries ÷ layers); implied × = dense ÷ policy tokens prefilled; FLOP × = dense ÷ policy analytic "
        "FLOPs of the TTFT phase (every batch row counted): the TTFT speed-up the work allows.",
    )
    timeline = summary_of(DENSE, result.dense).timeline or {}
    moved = bool(timeline.get("moved_tokens"))
    if moved:
        table.columns[5:5] = ["moved re-aligned", "moved recomputed"]
        table.caption += (
            " moved re-aligned / recomputed: input tokens in moved spans (ids other turns processed at other "
            "positions) served from their K/V re-aligned (and corrected, by the delta policies) / recomputed (a "
            "policy that does not move spans, or a delta gate's refusal)."
        )
    for label, summary, _ in _rows(result):
        split = [str(summary.moved or 0), str(summary.moved_recomputed or 0)] if moved else []
        table.add_row(
            label,
            cell(summary.reuse_per_token, ".2f"),
            cell(summary.reuse_per_call, ".2f"),
            cell(summary.reuse_per_call_excl_source, ".2f"),
            cell(summary.adapter_free_per_token, ".2f"),
            *split,
            cell(summary.recompute_ratio, ".2f"),
            str(summary.prefilled),
            cell(_ratio(summary, "prefill_speedup_implied"), ".2f"),
            cell(_ratio(summary, "ttft_speedup_implied_flops"), ".2f"),
        )
    return table


def delta_table(result: ReplayResult | dict) -> TableData | None:
    """Delta policies' gate ρ and corrected segments' K/V error by hop; None when no policy has a gate."""
    rows = [
        (label, summary)
        for label, summary, _ in _rows(ReplayResult.of(result))
        if isinstance(summary, PolicySummary) and summary.delta_reuse is not None
    ]
    if not rows:
        return None
    hops = sorted({int(hop) for _, summary in rows for hop in summary.error_by_hop})
    table = TableData(
        title="delta correction: the gate's reuse and the corrected segments' error by hop",
        columns=["policy", "ρ (gate)", *[f"hop {hop} K / V err (n)" for hop in hops]],
        caption="ρ (gate): of the tokens of other agents' segments the gate decided on, the share served corrected "
        "(the rest prefilled densely); hop k: the k-th agent besides the producer to read a segment — its K/V "
        "error on that segment (relative Frobenius, mean over layers 1.., layer 0 being uncorrected), mean over "
        "corrected segments (n); a chained correction starts from the previous hop's corrected cache.",
    )
    for label, summary in rows:
        cells = []
        for hop in hops:
            entry = summary.error_by_hop.get(str(hop))
            cells.append(
                "—" if entry is None else f"{entry['k_error']:.4f} / {entry['v_error']:.4f} ({entry['segments']})"
            )
        table.add_row(label, cell(summary.delta_reuse, ".2f"), *cells)
    return table


def cost_table(result: ReplayResult | dict) -> TableData:
    """Policy × measured time (TTFT, TPOT, latency) and memory, side by side with the dense run."""
    result = ReplayResult.of(result)
    cuda = any(summary.cuda_peak_bytes is not None for _, summary, _ in _rows(result))
    timing = result.timing or {"mode": "turn", "origin": "kvprof", "runs": result.repeats or 1}
    columns = ["policy", "TTFT s", "TTFT ×", "eff.", "TPOT ms", "TPOT ×", "latency s", "latency ×", "stored MiB"]
    columns += ["working MiB", "working ×"] + (["CUDA MiB"] if cuda else []) + ["alloc. MiB", "blocks MiB", "blocks ×"]
    table = TableData(
        title=f"cost: {_device(result)} {result.dtype or ''}, {timing_text(timing)}{_low_rank_attention(result)}",
        columns=columns,
        caption="TTFT s / latency s: summed over turns"
        + (" (each turn's mean over the timed runs of its trajectory)" if timing["mode"] == "trajectory" else "")
        + "; eff.: measured TTFT × ÷ FLOP × (the share of the speed-up the work allows that the replay realises; "
        "below 1, work the FLOPs leave out — a short turn's reads of a long cache, element-wise passes — or the "
        "harness's own cost); TPOT: decode time per output token (one forward per token over the cache); × = dense "
        "÷ policy, measured side by side in this run (working ×: policy ÷ dense); stored: peak analytic bytes of what "
        "the policy keeps between turns; working: peak during a turn, adding its transients (the turn's cache, "
        "captured hidden states, an LR prefill's working set)"
        + ("; CUDA: allocator peak of the policy's own turns plus its stored bytes" if cuda else "")
        + "; as the papers report memory: alloc., the allocator's peak with the weights ("
        + (summary_of(DENSE, result.dense).allocator_peak_source or "not recorded")
        + f"); blocks, the stored caches in KV blocks of {result.page_size or 16} tokens as vLLM holds them "
        "(peak; × = policy ÷ dense).",
    )
    for label, summary, _ in _rows(result):
        cells = [
            label,
            cell(summary.ttft_s, ".3f"),
            cell(_ratio(summary, "ttft_speedup"), ".2f"),
            cell(_ratio(summary, "harness_efficiency"), ".2f"),
            cell(summary.tpot_s and summary.tpot_s * 1e3, ".2f"),
            cell(_ratio(summary, "tpot_speedup"), ".2f"),
            cell(summary.latency_s, ".3f"),
            cell(_ratio(summary, "latency_speedup"), ".2f"),
            _mib(summary.peak_memory_bytes),
            _mib(summary.peak_working_bytes),
            cell(_ratio(summary, "working_memory_ratio"), ".2f"),
        ]
        if cuda:
            cells.append(cell(summary.cuda_peak_bytes and summary.cuda_peak_bytes / 2**20, ".2f"))
        cells += [
            cell(summary.allocator_peak_bytes and summary.allocator_peak_bytes / 2**20, ".2f"),
            cell(summary.peak_kv_block_bytes and summary.peak_kv_block_bytes / 2**20, ".2f"),
            cell(_ratio(summary, "kv_block_ratio"), ".2f"),
        ]
        table.add_row(*cells)
    return table


def memory_claims_table(result: ReplayResult | dict) -> TableData | None:
    """Verdicts on the replayed policies' published memory claims (`kvprof.claims.memory`); None without any."""
    claims = ReplayResult.of(result).memory_claims
    if not claims:
        return None
    table = TableData(
        title="published memory claims",
        columns=["policy", "claim", "vs", "ratio", "claimed", "verdict", "why"],
        caption="ratio: the policy's peak over the reference run's, as the paper measures it (measure); claimed: "
        "the interval the claim's words give (reading, labelled paper text or kvprof).",
    )
    for claim in claims:
        low, high = claim["claimed"]
        table.add_row(
            claim["policy"],
            claim["claim"],
            claim["reference"] or "–",
            cell(claim["ratio"], ".3f"),
            f"{low:.3f}–{high:.3f} ({claim['reading']})",
            claim["verdict"],
            claim["why"],
        )
    return table


def timing_text(timing: dict) -> str:
    """The timing mode (`timing_setting`) in words, labelled with whose practice it follows, and the machine's load
    while timing where it was metered (`contention_text`)."""
    runs = timing["runs"]
    kept = "; the CPU allocator kept freed memory" if timing.get("heap_kept") else ""
    load = contention_text(timing)
    load = f"; {load}" if load else ""
    if timing["mode"] == "trajectory":
        return (
            f"trajectory timing ({timing['origin']}: PReCache's bench/single_stream.py): each run alone, one untimed "
            f"warm-up run of each trajectory, then the mean of {runs} timed runs; TTFT = the sum of its synced "
            f"prefill calls{kept}{load}"
        )
    warm_up = " after a warm-up" if runs > 1 else " (no warm-up)"
    interleaved = ", timed round-robin across the runs" if timing.get("interleaved") else ""
    return (
        f"turn timing ({timing['origin']}): TTFT = median of {runs} repeats per turn{warm_up}{interleaved}{kept}{load}"
    )


def contention_text(timing: dict) -> str | None:
    """The machine's load while a replay timed (`kvprof.threads.MachineLoad` in its timing): other processes'
    cores beside its threads, and when they contended, that its times are slowed; None where not metered."""
    load = timing.get("load")
    if not isinstance(load, dict) or load.get("other_cores") is None:
        return None
    other = f"other processes used {load['other_cores']:.1f} of {load['cores']} cores beside its {load['threads']} "
    other += f"torch thread{'s' if load['threads'] != 1 else ''} while it timed"
    if load.get("contended"):
        return f"CONTENDED: {other}, so these times are slowed by contention, not clean; rerun on a quiet machine"
    return other


def layer_table(result: ReplayResult) -> TableData:
    """Per-layer V and K error of each policy (mean over turns with a reused span)."""
    dense = summary_of(DENSE, result.dense).layers
    per_policy = {label: summary_of(label, run).layers for label, run in result.policies.items()}
    layers = len(dense) or max((len(per_layer) for per_layer in per_policy.values()), default=0)
    table = TableData(
        title="per-layer relative error on the reused span (V / K)",
        columns=["policy"] + [f"layer {i}" for i in range(layers)],
    )
    for label, per_layer in per_policy.items():
        table.add_row(
            label,
            *[f"{row['v_error']:.3g} / {row['k_error']:.3g}" for row in per_layer] + ["–"] * (layers - len(per_layer)),
        )
    return table


def policy_notes(result: ReplayResult | dict) -> list[str]:
    """A line per policy note (`SharingPolicy.notes`) and per policy that recomputed moved spans."""
    lines = []
    for label, run in ReplayResult.of(result).policies.items():
        lines += [f"{label}: {note}" for note in run.notes or []]
        recomputed = summary_of(label, run).moved_recomputed
        if recomputed and run.moves_spans is False:
            lines.append(
                f"{label}: does not move spans: it recomputed the {recomputed} tokens of moved spans (ids other "
                "turns processed at other positions) as new tokens"
            )
    return lines


def notes(result: ReplayResult) -> list[str]:
    """Per policy: paper, exactness, published figures (from the policy class); then the skipped policies."""
    check = dense_check(result)
    lines = [check] if check else []
    for label, run in result.policies.items():
        exactness = "approximate" if run.approximate else "exact"
        published = "; ".join(figure["claim"] for figure in run.published or [])
        lines.append(f"{label}: {run.paper}, {exactness}" + (f"; published: {published}" if published else ""))
    lines += policy_notes(result)
    lines += [f"skipped {name}: {reason}" for name, reason in (result.skipped or {}).items()]
    settings = {figure["setting"] for run in result.policies.values() for figure in run.published or []}
    lines += [f"published figures measured on: {setting}" for setting in sorted(settings)]
    return lines


def _uncertainty_note(items: list[decision.Outcome]) -> str:
    reference = items[0]
    noise = (
        f" The dense run replayed a second time as the nonshared policy measures TTFT {reference.ttft.text(unit='×')}"
        ": speed-ups closer to 1 than that are timing noise."
        if reference.ttft.low < reference.ttft.high
        else ""
    )
    return (
        f"Error bars: {LEVEL:.0%} bootstrap intervals over the n = {reference.ttft.n} tasks ({RESAMPLES} resamples; "
        "approximate, and narrow with few tasks); memory: the range of per-task ratios (analytic bytes, no noise)."
        + noise
    )


def decision_section(result: ReplayResult) -> Section:
    """The decision: the recommendation for a stated target, the Pareto scatter, the cost bars, per-turn TTFT."""
    items = decision.outcomes(result)
    chosen = decision.decide(items)
    return Section(
        title="Decision: which policy, at what cost, for what gain",
        card=chosen.lines,
        text=[_uncertainty_note(items)],
        figures=[
            decision.pareto_figure(items, chosen),
            decision.bars_figure(items),
            decision.ttft_box_figure(result),
        ],
        order="decision",
        wide=3,
    )


def _positive(values: list[float]) -> list[float | None]:
    return [value if value > 0 else None for value in values]


def diagnostic_figures(result: ReplayResult) -> list:
    """Per-layer error, KL per turn (log boxes), cache memory per turn; `nonshared` left out where it repeats dense."""
    policies = {label: run for label, run in result.policies.items() if label != DENSE}
    figures = []
    per_layer = {label: summary_of(label, run).layers for label, run in policies.items()}
    layered = {label: rows for label, rows in per_layer.items() if rows}
    if layered:
        layers = range(max(len(rows) for rows in layered.values()))
        for key, name in (("v_error", "V"), ("k_error", "K")):
            figures.append(
                line_figure(
                    layers,
                    {label: _positive([row[key] for row in rows]) for label, rows in layered.items()},
                    f"{name} relative error per layer on the reused span (log; exact = 0 not drawn)",
                    "layer",
                    "‖X_pol − X_dense‖ / ‖X_dense‖",
                    log_y=True,
                    style=policy_style,
                )
            )
    kl = {label: ([label] * len(run.turns), [measured(t.kl) for t in run.turns]) for label, run in policies.items()}
    exact = sum(value <= 0 for _, values in kl.values() for value in values)
    figures.append(
        box_figure(
            kl,
            "KL(dense ‖ policy) per turn (log" + (f"; {exact} turns with KL = 0 not drawn)" if exact else ")"),
            "nats / output token",
            log_y=True,
            style=policy_style,
        )
    )
    figures[-1].update_layout(showlegend=False)
    runs = {DENSE: result.dense.turns} | {label: run.turns for label, run in policies.items()}
    figures.append(
        line_figure(
            range(len(result.dense.turns)),
            {label: [measured(t.memory_bytes) / 2**20 for t in rows] for label, rows in runs.items()},
            "analytic cache memory after each turn (all trajectories in order)",
            "turn",
            "MiB",
            style=policy_style,
            markers=False,
        )
    )
    return figures


def sections(result: ReplayResult | dict) -> list[Section]:
    """Dashboard sections: the decision first, then the tables and the diagnostic figures."""
    result = ReplayResult.of(result)
    return [
        decision_section(result),
        Section(
            title="Sharing policies against the dense run: tables and diagnostics",
            text=notes(result),
            tables=[
                table
                for table in (
                    fidelity_table(result),
                    reuse_table(result),
                    delta_table(result),
                    cost_table(result),
                    layer_table(result),
                )
                if table is not None
            ],
            figures=diagnostic_figures(result),
            order="details",
        ),
    ]
