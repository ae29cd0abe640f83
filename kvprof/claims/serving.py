"""Verdicts on the published serving figures (`Published.serving`, a `ServingClaim`) from a simulation, stated as
simulated.

A claim is the policy's measure (median TTFT, per-request throughput) over a reference's at the claim's load, on
trajectories scaled to its shared context. Per simulated policy (the claim's variant) and reference: "holds", "does
not hold", or "not comparable" (reference not simulated or with other options, not scaled to the claim's context,
load not simulated, or either run out of memory), with the ratio and why; an out-of-memory claim holds when the
policy runs out of memory there. Pure Python over the payload and `Published` dicts.
"""

from __future__ import annotations

from kvprof.claims.memory import verdict_entry

VERDICTS = {True: "holds (simulated)", False: "does not hold (simulated)", None: "not comparable"}
SHARED_TOLERANCE = 0.1  # the simulation's shared context within 10 % of the claim's


def serving_verdicts(result: dict, policies: dict[str, dict], published: dict[str, list[dict]]) -> list[dict]:
    """One verdict per (policy, serving claim, reference) in `kvprof simulate`'s `result` (`policies`: label →
    {"name", "options"}; `published`: name → `Published` dicts), with `memory_verdicts`' fields plus load."""
    rows: dict[str, list[dict]] = {}
    for row in result["runs"]:
        rows.setdefault(row["policy"], []).append(row)
    verdicts = []
    for label in rows:
        run = policies.get(label, {"name": label, "options": {}})
        for figure in published.get(run["name"], []):
            claim = figure.get("serving")
            if not claim or not _matches(run["options"], claim["policy_options"]):
                continue
            verdicts += _judge(label, figure, claim, rows, policies, result)
    return verdicts


def _judge(label: str, figure: dict, claim: dict, rows: dict, policies: dict, result: dict) -> list[dict]:
    """The verdicts of one claim of policy `label` against each of its simulated references."""
    verdict = _verdict_for(label, figure, claim, result)
    mine = _row_at(rows[label], claim)
    if isinstance(mine, str):
        return [verdict(None, None, None, mine)]
    if claim["measure"] == "out_of_memory":
        wanted, simulated = claim.get("kv_bytes_per_token") or 0, result["model"]["kv_bytes_per_token"]
        if wanted and not 0.5 <= simulated / wanted <= 2:
            why = (
                f"the simulated model keeps {simulated:.0f} bytes of K/V per token, the setting's {wanted}: its memory "
                "does not run out where theirs does"
            )
            return [verdict(None, None, None, why)]
        if not mine["out_of_memory"] and (result.get("settings") or {}).get("kept") == "evict":
            why = (
                "the engine evicted kept state instead of running out (--kept evict); rerun with --kept hold for "
                "state an engine cannot drop, such as anchor pools"
            )
            return [verdict(None, None, None, why)]
        oom = bool(mine["out_of_memory"])
        return [verdict(None, float(oom), oom, mine["out_of_memory"] or "the simulation ran without running out")]
    references = [
        ref
        for ref in rows
        if ref != label
        and policies.get(ref, {"name": ref})["name"] in claim["references"]
        and _matches(policies.get(ref, {"options": {}})["options"], claim["reference_options"])
    ]
    if not references:
        return [verdict(None, None, None, f"no {' / '.join(claim['references'])} run simulated with its setting")]
    out = []
    for ref in references:
        theirs = _row_at(rows[ref], claim)
        if isinstance(theirs, str) or mine["out_of_memory"] or theirs["out_of_memory"]:
            out.append(verdict(ref, None, None, theirs if isinstance(theirs, str) else "a run ran out of memory"))
            continue
        ratio = _ratio(claim["measure"], mine, theirs)
        holds = claim["low"] <= ratio <= claim["high"]
        out.append(verdict(ref, ratio, holds, f"ratio {ratio:.3g} at {mine['load']['label']}"))
    return out


def _verdict_for(label: str, figure: dict, claim: dict, result: dict):
    """A verdict as a memory claim's (`verdict_entry`), its claim text with the paper and section, stated as
    simulated, with the cost model."""

    def verdict(reference: str | None, ratio: float | None, holds: bool | None, why: str) -> dict:
        return verdict_entry(label, figure, claim, reference, ratio, why, holds) | {
            "claim": f"{figure['paper']}, {figure['where']}: {figure['claim']}",
            "verdict": VERDICTS[holds],
            "cost_model": result["cost_model"]["source"],
        }

    return verdict


def _row_at(rows: list[dict], claim: dict) -> dict | str:
    """The simulated row at the claim's context and load (lowest qps if none named), or why none."""
    wanted = claim["shared_tokens"]
    if wanted:
        rows = [
            row
            for row in rows
            if row.get("shared_tokens") and abs(row["shared_tokens"] / wanted - 1) <= SHARED_TOLERANCE
        ]
        if not rows:
            return f"the simulation was not scaled to {wanted} shared tokens (--shapes --shared-tokens {wanted})"
    open_loop = sorted((row for row in rows if row["load"]["kind"] == "qps"), key=lambda row: row["load"]["value"])
    if not open_loop:
        return "no open-loop (--qps) load simulated"
    if claim["qps"] is None:
        return open_loop[0]
    for row in open_loop:
        if abs(row["load"]["value"] - claim["qps"]) < 1e-9:
            return row
    return f"{claim['qps']:g} qps not simulated (add --qps {claim['qps']:g})"


def _ratio(measure: str, mine: dict, theirs: dict) -> float:
    if measure == "ttft_p50":
        return mine["ttft"]["p50"] / theirs["ttft"]["p50"]
    return theirs["e2e"]["p50"] / mine["e2e"]["p50"]  # request_throughput: the same outputs, in less time


def _matches(options: dict, wanted) -> bool:
    return all(str(options.get(key)) == str(value) for key, value in wanted)
