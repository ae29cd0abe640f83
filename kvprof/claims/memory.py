"""Verdicts on the published memory figures the replayed policies carry (`Published.memory`, a `MemoryClaim`).

A claim is the policy's peak memory as the paper reads it (`MemoryClaim.measure`) over a reference run's in the same
replay. Per policy and reference: "holds" (ratio in the interval), "does not hold", or "not comparable" (reference not
replayed or with other options; shorter longest context or fewer agents than the claim's; measure not recorded),
with the ratio and why. Reads a `ReplayResult`, so saved results too.
"""

from __future__ import annotations

from typing import NamedTuple

from kvprof.results.replay import ReplayResult, RunSummary

MEASURES = {
    "allocator": ("allocator_peak_bytes", "allocator peak with the weights"),
    "kv_blocks": ("peak_kv_block_bytes", "stored caches in KV blocks"),
}
VERDICTS = {True: "holds", False: "does not hold", None: "not comparable"}
DENSE_NAME = "nonshared"  # the dense run is NonShared: a claim against NonShared reads the replay's dense run


class Run(NamedTuple):
    """What a claim reads of a run: its policy's name, options and summary (None where the result lacks it)."""

    name: str | None
    options: dict
    summary: RunSummary | None


def memory_verdicts(result: ReplayResult) -> list[dict]:
    """One verdict per (policy, memory claim, reference run) in a replay's `result`: policy, claim, reference
    ("dense" for NonShared), measure, ratio (None if a reading is missing), claimed, reading, holds, verdict
    (`VERDICTS`), why."""
    dense_turns = result.dense.turns
    context = max((t.input_tokens + t.output_tokens for t in dense_turns), default=0)
    agents = len({t.agent for t in dense_turns})
    runs = {"dense": Run(DENSE_NAME, {}, result.dense.summary)}
    runs |= {label: Run(run.name, run.options or {}, run.summary) for label, run in result.policies.items()}
    verdicts = []
    for label, entry in result.policies.items():
        for figure in entry.published or []:
            claim = figure.get("memory")
            if not claim:
                continue
            references = [ref for ref, run in runs.items() if run.name in claim["references"]]
            if not references:
                verdicts.append(
                    verdict_entry(
                        label, figure, claim, None, None, f"no {' / '.join(claim['references'])} run replayed"
                    )
                )
            for reference in references:
                verdicts.append(_judge(label, figure, claim, reference, runs[label], runs[reference], context, agents))
    return verdicts


def _judge(
    label: str, figure: dict, claim: dict, reference: str, entry: Run, run: Run, context: int, agents: int
) -> dict:
    """`label`'s `claim` against reference `run`, on a trace of longest context `context` and `agents` agents."""
    key, what = MEASURES[claim["measure"]]
    mine, theirs = (None if r.summary is None else getattr(r.summary, key) for r in (entry, run))
    ratio = mine / theirs if mine is not None and theirs else None
    if ratio is None:
        return verdict_entry(label, figure, claim, reference, None, f"the replay recorded no {what}")
    options = dict(claim.get("reference_options", []))
    other = {k: run.options.get(k) for k, v in options.items() if _value(run.options.get(k)) != _value(v)}
    if other:
        ran = ", ".join(f"{k} {v}" for k, v in other.items())
        wanted = ", ".join(f"{k} {v}" for k, v in options.items())
        why = f"{reference} ran with {ran}, the claim's setting with {wanted}"
        return verdict_entry(label, figure, claim, reference, ratio, why)
    if context < claim.get("context_tokens", 0):
        return verdict_entry(
            label,
            figure,
            claim,
            reference,
            ratio,
            f"the trace's longest context is {context} tokens, the claim's setting {claim['context_tokens']}",
        )
    if claim.get("agents") and agents != claim["agents"]:
        why = f"the trace has {agents} agents, the claim's setting {claim['agents']}"
        return verdict_entry(label, figure, claim, reference, ratio, why)
    holds = claim["low"] <= ratio <= claim["high"]
    why = f"{what}: {label} ÷ {reference} = {ratio:.3f}, {'inside' if holds else 'outside'} the claimed interval"
    return verdict_entry(label, figure, claim, reference, ratio, why, holds)


def _value(value) -> object:
    """An option value compared as a number where it reads as one ("0.3" equals 0.3)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def verdict_entry(
    label: str,
    figure: dict,
    claim: dict,
    reference: str | None,
    ratio: float | None,
    why: str,
    holds: bool | None = None,
) -> dict:
    """The fields every claim verdict has (`memory_verdicts`), for `label`'s `claim` (as a dict) of `figure`."""
    return {
        "policy": label,
        "claim": figure["claim"],
        "paper": figure["paper"],
        "reference": reference,
        "measure": claim["measure"],
        "ratio": ratio,
        "claimed": [claim["low"], claim["high"]],
        "reading": claim["reading"],
        "holds": holds,
        "verdict": VERDICTS[holds],
        "why": why,
    }
