"""Tables and figures of a `kvprof simulate` result: step model, calibration errors, policy × load, SLO loads."""

from __future__ import annotations

from kvprof.report.tables import TableData, milliseconds
from kvprof.results.simulate import SimulateResult

GIB = 2**30


def _error(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.0f} %"


def cost_lines(result: SimulateResult) -> list[str]:
    """The step model (its source, coefficients and fit statistics) and the scaling, as lines of text."""
    model = result.cost_model
    lines = [
        "step time t = a + b·prefill + c·decode_seqs + d·kv_read + f·adapter_tokens + g·adapter_step (+ e per "
        f"request on TTFT), {model['source']}: a = {1e3 * model['a']:.3g} ms, b = {1e6 * model['b']:.3g} µs/token, "
        f"c = {1e6 * model['c']:.3g} µs/seq, d = {1e9 * model['d']:.3g} ns/token read, e = {1e3 * model['e']:.3g} "
        f"ms, f = {1e6 * model.get('f', 0.0):.3g} µs/adapter token, "
        f"g = {1e3 * model.get('g', 0.0):.3g} ms/step with adapters"
    ]
    block = result.settings.prefix_block
    if block:
        lines.append(
            f"prefix cache: reused tokens rounded down to whole blocks of {block} tokens, the rest prefilled again "
            "(as an engine's paged prefix cache reuses)"
        )
    fit = model.get("fit") or {}
    if fit:
        r2 = ", ".join(
            f"R² {kind} {fit[f'r2_{kind}']:.3f} ({fit[f'{kind}_observations']} obs.)"
            for kind in ("ttft", "decode")
            if fit.get(f"r2_{kind}") is not None
        )
        lines.append(f"fit: {r2}" + "".join(f"; {note}" for note in fit.get("notes", [])))
    scale = result.scale
    if scale["shared_tokens"]:
        scaled = ", ".join(f"{scale['factors'][str(n)]:.1f}× to {n}" for n in scale["shared_tokens"])
        lines.append(
            f"--shapes: every turn's input-side work scaled linearly ({scaled} tokens of final context; scaled "
            "linearly: attention's quadratic cost and "
            "the papers' agent counts are not modelled)"
        )
    return lines


def errors_table(result: SimulateResult) -> TableData | None:
    """The calibration runs re-simulated: measured against simulated median TTFT and throughput; None without."""
    rows = result.calibration_errors or []
    if not rows:
        return None
    table = TableData(
        title="the step model on the calibration file's runs (simulated against measured)",
        columns=["run", "use", "TTFT p50 ms", "simulated", "error", "req/s", "simulated ", "error "],
        caption="error = simulated ÷ measured − 1; use: fit (the step model was fitted to this run) or check (a "
        "run it was not fitted to: a validation).",
    )
    for row in rows:
        table.add_row(
            row["run"],
            "fit" if row.get("fitted", True) else "check",
            f"{1000 * row['ttft_p50']:.1f}",
            "-" if row["ttft_p50_simulated"] is None else f"{1000 * row['ttft_p50_simulated']:.1f}",
            _error(row["ttft_error"]),
            f"{row['requests_per_s']:.2f}",
            "-" if row["requests_per_s_simulated"] is None else f"{row['requests_per_s_simulated']:.2f}",
            _error(row["throughput_error"]),
        )
    return table


def runs_table(result: SimulateResult) -> TableData:
    """Per policy and load: TTFT p50/p90/p99 (ms), e2e p90, throughput, peak KV, preemptions, OOM."""
    scaled = bool(result.scale["shared_tokens"])
    table = TableData(
        title=f"simulated serving ({result.cost_model['source']})",
        columns=[
            "policy",
            *(["context"] if scaled else []),
            "load",
            "requests",
            "TTFT p50",
            "TTFT p90",
            "TTFT p99",
            "e2e p90",
            "req/s",
            "tok/s",
            "peak KV MiB",
            "preempt",
            "evict",
            "out of memory",
        ],
        caption="simulated, not measured: times in ms; tok/s counts input and output tokens; peak KV: blocks in use "
        "at the peak (kept caches of the trajectories in flight and the running turns'); evict: trajectories whose "
        "kept state was evicted (their next turn recomputed).",
    )
    for row in result.runs:
        oom = row["out_of_memory"]
        context = [str(row.get("shared_tokens"))] if scaled else []
        if row["requests"] == 0:
            table.add_row(row["policy"], *context, row["load"]["label"], 0, *["-"] * 9, "OOM")
            continue
        table.add_row(
            row["policy"],
            *context,
            row["load"]["label"],
            row["requests"],
            milliseconds(row["ttft"], "p50"),
            milliseconds(row["ttft"], "p90"),
            milliseconds(row["ttft"], "p99"),
            milliseconds(row["e2e"], "p90"),
            f"{row['throughput']['requests_per_s']:.2f}",
            f"{row['throughput']['tokens_per_s']:.0f}",
            f"{row['peak_kv_bytes'] / 2**20:.1f}",
            row["preemptions"],
            row.get("evictions", 0),
            "OOM" if oom else "-",
        )
    return table


def out_of_memory_lines(result: SimulateResult) -> list[str]:
    """Why each policy and load that ran out of memory did (one line each)."""
    return [
        f"{row['policy']} @ {row['load']['label']}{_context(row)}: out of memory: {row['out_of_memory']}"
        for row in result.runs
        if row["out_of_memory"]
    ]


def _context(row: dict) -> str:
    return f", {row['shared_tokens']} tokens" if row.get("shared_tokens") else ""


def sustainable_table(result: SimulateResult) -> TableData | None:
    """Per policy, the highest swept load whose TTFT p90 met the SLO; None without an SLO."""
    best, slo = result.sustainable, result.settings.ttft_slo_s
    if best is None or slo is None:
        return None
    kinds = list(dict.fromkeys(row["load"]["kind"] for row in result.runs))
    table = TableData(
        title=f"highest swept load meeting TTFT p90 ≤ {1000 * slo:.0f} ms (simulated)",
        columns=["policy", *("qps" if kind == "qps" else "concurrency" for kind in kinds)],
        caption="-: no swept load met it (or the policy ran out of memory at every load).",
    )
    for policy, by_kind in best.items():
        table.add_row(policy, *("-" if by_kind.get(kind) is None else f"{by_kind[kind]:g}" for kind in kinds))
    return table


def claim_lines(result: SimulateResult) -> list[str]:
    """The published serving figures' verdicts, stated as simulated, with the cost model they used."""
    verdicts = result.serving_claims or []
    if not verdicts:
        return []
    lines = [f"published serving claims, simulated with {verdicts[0]['cost_model']}:"]
    for v in verdicts:
        against = f" vs {v['reference']}" if v["reference"] else ""
        claimed = f"claimed [{v['claimed'][0]:.3g}, {v['claimed'][1]:.3g}], {v['reading']}"
        lines.append(f"  {v['policy']}{against}: {v['verdict']} — {v['why']} ({claimed}) — {v['claim']}")
    return lines


def claims_table(result: SimulateResult) -> TableData | None:
    """The published serving figures' verdicts as a table (the dashboard's); None without any."""
    verdicts = result.serving_claims or []
    if not verdicts:
        return None
    table = TableData(
        title="published serving claims (simulated)",
        columns=["policy", "reference", "claim", "ratio", "claimed", "verdict", "why"],
        caption=f"simulated with {verdicts[0]['cost_model']}; the interval's reading is in the JSON.",
    )
    for v in verdicts:
        table.add_row(
            v["policy"],
            v["reference"] or "-",
            v["claim"],
            "-" if v["ratio"] is None else f"{v['ratio']:.3g}",
            f"[{v['claimed'][0]:.3g}, {v['claimed'][1]:.3g}]",
            v["verdict"],
            v["why"],
        )
    return table


def figures(result: SimulateResult) -> list:
    """TTFT p90 against load per policy (longest context); with several --shared-tokens, peak KV against context
    (lowest load)."""
    from kvprof.report.figures import line_figure

    runs = [row for row in result.runs if row["requests"]]
    lengths = sorted({row.get("shared_tokens") or 0 for row in result.runs})
    longest = [row for row in runs if (row.get("shared_tokens") or 0) == lengths[-1]]
    loads = sorted({row["load"]["value"] for row in longest})
    policies = list(dict.fromkeys(row["policy"] for row in result.runs))

    def at(rows: list[dict], policy: str, key) -> dict | None:
        return next((row for row in rows if row["policy"] == policy and key(row)), None)

    ttft = {
        policy: [
            1000 * row["ttft"]["p90"] if (row := at(longest, policy, lambda r, v=value: r["load"]["value"] == v))
            else None
            for value in loads
        ]
        for policy in policies
    }  # fmt: skip
    kind = longest[0]["load"]["kind"] if longest else "qps"
    shown = [line_figure(loads, ttft, "TTFT p90 against load (simulated)", kind, "TTFT p90 (ms)", log_y=True)]
    if len(lengths) > 1:
        lowest = min(row["load"]["value"] for row in result.runs)
        memory = {
            policy: [
                row["peak_kv_bytes"] / GIB
                if (row := at(runs, policy, lambda r, n=n: (r.get("shared_tokens") or 0) == n
                              and r["load"]["value"] == lowest))
                else None
                for n in lengths
            ]
            for policy in policies
        }  # fmt: skip
        shown.append(
            line_figure(
                lengths, memory, f"peak KV memory against shared context at {lowest:g} {kind} (simulated)",
                "shared context (tokens)", "peak KV memory (GiB)",
            )
        )  # fmt: skip
    return shown


def sections(result: SimulateResult) -> list:
    """The simulate dashboard section, from the JSON result."""
    from kvprof.report.html import Section

    tables = [table for table in (errors_table(result), runs_table(result), sustainable_table(result),
                                  claims_table(result)) if table is not None]  # fmt: skip
    return [
        Section(
            "simulate: every policy served by a modelled engine (simulated, not measured)",
            text=[*cost_lines(result), *out_of_memory_lines(result)],
            tables=tables,
            figures=figures(result),
            order="details",
            wide=1,
        )
    ]
