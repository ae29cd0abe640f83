"""Tables of a `kvprof simulate` result (the JSON it writes): the step-cost model, its errors on the runs it was
calibrated on, one row per policy and load, and the highest load meeting the TTFT SLO."""

from __future__ import annotations

from kvprof.report.tables import TableData, milliseconds

GIB = 2**30


def _error(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.0f} %"


def cost_lines(result: dict) -> list[str]:
    """The step model (its source, coefficients and fit statistics) and the scaling, as lines of text."""
    model = result["cost_model"]
    lines = [
        "step time t = a + b·prefill + c·decode_seqs + d·kv_read + f·adapter_tokens + g·adapter_step (+ e per "
        f"request on TTFT), {model['source']}: a = {1e3 * model['a']:.3g} ms, b = {1e6 * model['b']:.3g} µs/token, "
        f"c = {1e6 * model['c']:.3g} µs/seq, d = {1e9 * model['d']:.3g} ns/token read, e = {1e3 * model['e']:.3g} "
        f"ms, f = {1e6 * model.get('f', 0.0):.3g} µs/adapter token, "
        f"g = {1e3 * model.get('g', 0.0):.3g} ms/step with adapters"
    ]
    block = result["settings"].get("prefix_block")
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
    scale = result["scale"]
    if scale["shared_tokens"]:
        lines.append(
            f"--shapes: every turn's input-side work scaled linearly by {scale['factor']:.1f}× to "
            f"{scale['shared_tokens']} tokens of final context (scaled linearly: attention's quadratic cost and "
            "the papers' agent counts are not modelled)"
        )
    return lines


def errors_table(result: dict) -> TableData | None:
    """The calibration runs re-simulated: measured against simulated median TTFT and throughput; None without."""
    rows = result.get("calibration_errors") or []
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


def runs_table(result: dict) -> TableData:
    """One row per policy and load: TTFT p50/p90/p99 (ms), e2e p90, throughput, peak KV memory, preemptions,
    OOM (why: `out_of_memory_lines`)."""
    table = TableData(
        title=f"simulated serving ({result['cost_model']['source']})",
        columns=[
            "policy",
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
            "out of memory",
        ],
        caption="simulated, not measured: times in ms; tok/s counts input and output tokens; peak KV: blocks in use "
        "at the peak (kept caches of the trajectories in flight and the running turns').",
    )
    for row in result["runs"]:
        oom = row["out_of_memory"]
        if row["requests"] == 0:
            table.add_row(row["policy"], row["load"]["label"], 0, "-", "-", "-", "-", "-", "-", "-", "-", "OOM")
            continue
        table.add_row(
            row["policy"],
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
            "OOM" if oom else "-",
        )
    return table


def out_of_memory_lines(result: dict) -> list[str]:
    """Why each policy and load that ran out of memory did (one line each)."""
    return [
        f"{row['policy']} @ {row['load']['label']}: out of memory: {row['out_of_memory']}"
        for row in result["runs"]
        if row["out_of_memory"]
    ]


def sustainable_table(result: dict) -> TableData | None:
    """Per policy, the highest swept load whose TTFT p90 met the SLO; None without an SLO."""
    best = result.get("sustainable")
    if best is None:
        return None
    slo = result["settings"]["ttft_slo_s"]
    kinds = list(dict.fromkeys(row["load"]["kind"] for row in result["runs"]))
    table = TableData(
        title=f"highest swept load meeting TTFT p90 ≤ {1000 * slo:.0f} ms (simulated)",
        columns=["policy", *("qps" if kind == "qps" else "concurrency" for kind in kinds)],
        caption="-: no swept load met it (or the policy ran out of memory at every load).",
    )
    for policy, by_kind in best.items():
        table.add_row(policy, *("-" if by_kind.get(kind) is None else f"{by_kind[kind]:g}" for kind in kinds))
    return table


def claim_lines(result: dict) -> list[str]:
    """The published serving figures' verdicts, stated as simulated, with the cost model they used."""
    verdicts = result.get("serving_claims") or []
    if not verdicts:
        return []
    lines = [f"published serving claims, simulated with {verdicts[0]['cost_model']}:"]
    for v in verdicts:
        against = f" vs {v['reference']}" if v["reference"] else ""
        claimed = f"claimed [{v['claimed'][0]:.3g}, {v['claimed'][1]:.3g}], {v['reading']}"
        lines.append(f"  {v['policy']}{against}: {v['verdict']} — {v['why']} ({claimed}) — {v['claim']}")
    return lines
