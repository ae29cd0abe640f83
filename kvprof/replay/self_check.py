"""kvprof checks its policies on the user's model before a replay reports anything (docs/models.md).

A policy with an exact setting (`SharingPolicy.exact_setting`) replays the first turns of the first trajectory in it:
"recompute all" (selective policies at ratio 1) or "one agent" (the low-rank cache split, one adapter acting). A
worst K/V error above the dtype's tolerance refuses the policy for this model with that error (an unseen window or
key norm was 5–47 % off).
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

import torch

from kvprof.policies import PolicyVariant
from kvprof.results.replay import ReplayResult, summary_of
from kvprof.traces.reuse import DEFAULT_MATCHING, SpanMatching

if TYPE_CHECKING:
    from kvprof.model.agents import AgentSet
    from kvprof.traces.trace import Trajectory

TURNS = 4  # first turns of the first trajectory replayed in each exact setting
FLOAT32_TOLERANCE, HALF_TOLERANCE = 1e-4, 3e-2  # worst relative K/V error an exact setting may leave
NO_MOVES = SpanMatching(min_span=1 << 30)  # a span that long never matches: the exact setting moves none
_CHECKED: dict[str, dict[str, float]] = {}  # identity of (agents, trajectory, variants) → worst error per label


def exact_variant(variant: PolicyVariant) -> PolicyVariant | None:
    """`variant` in its policy's exact setting (`ratio` at 1 for "recompute all"), None for a policy without one."""
    setting = variant.policy.exact_setting
    if setting is None:
        return None
    options = dict(variant.options)
    if setting == "recompute all":
        options["ratio"] = "1"
    return PolicyVariant(variant.name, options)


def one_agent(trajectory: Trajectory, agent: str) -> Trajectory:
    """`trajectory` with every turn acted by `agent`."""
    return dataclasses.replace(trajectory, turns=[dataclasses.replace(t, agent=agent) for t in trajectory.turns])


def check_on_model(agents: AgentSet, trajectory: Trajectory, variants: list[PolicyVariant]) -> dict[str, float]:
    """Worst relative K/V error of each of `variants` in its exact setting on the first `TURNS` turns of
    `trajectory` (variants without one left out); cached per agents, trajectory and variants."""
    from kvprof.model.agents import agents_identity
    from kvprof.replay.lockstep import replay_trace
    from kvprof.replay.setting import ReplaySettings

    exact = {variant.label: checked for variant in variants if (checked := exact_variant(variant)) is not None}
    short = dataclasses.replace(trajectory, turns=trajectory.turns[:TURNS])
    key = json.dumps([agents_identity(agents), trajectory.id, sorted(exact)], sort_keys=True, default=str)
    if key in _CHECKED:
        return _CHECKED[key]
    errors: dict[str, float] = {}
    settings = {
        "recompute all": (short, DEFAULT_MATCHING),
        "one agent": (one_agent(short, short.turns[0].agent), NO_MOVES),
    }
    for setting, (replayed, matching) in settings.items():
        chosen = {label: v for label, v in exact.items() if v.policy.exact_setting == setting}
        unique = list({v.label: v for v in chosen.values()}.values())
        if not unique:
            continue
        replayed_records = replay_trace(agents, [replayed], unique, ReplaySettings(span_matching=matching))
        runs = ReplayResult.of(replayed_records).policies
        for label, checked in chosen.items():
            summary = summary_of(checked.label, runs[checked.label])
            errors[label] = max(summary.k_error, summary.v_error)
    _CHECKED[key] = errors
    return errors


def refusals(agents: AgentSet, errors: dict[str, float]) -> dict[str, str]:
    """{label: one sentence} for the variants whose exact-setting error exceeds the model dtype's tolerance."""
    tolerance = FLOAT32_TOLERANCE if agents.base_model.dtype == torch.float32 else HALF_TOLERANCE
    return {
        label: (
            f"on this model, {label} in its exact setting (selective recompute at ratio 1, or a low-rank split of "
            f"one agent's own cache) leaves a relative K/V error of {error:.2g} (at most {tolerance:g} expected), "
            "so its results here would be wrong; this architecture has a layer kvprof does not yet model, so pick "
            "another policy."
        )
        for label, error in errors.items()
        if error > tolerance
    }


def checked_variants(
    agents: AgentSet, trajectory: Trajectory, variants: list[PolicyVariant], skipped: dict[str, str]
) -> tuple[list[PolicyVariant], dict[str, str], dict[str, float]]:
    """The variants passing `check_on_model`, `skipped` plus `refusals`, and each checked variant's error."""
    if not any(variant.policy.exact_setting for variant in variants):
        return variants, skipped, {}
    errors = check_on_model(agents, trajectory, variants)
    refused = refusals(agents, errors)
    return [v for v in variants if v.label not in refused], skipped | refused, errors
