"""How replay follows a trajectory whose turns do not extend one shared context (docs/commands/replay.md, "Traces
that are not one growing context" and "Moved spans").

As a prefix cache does (vLLM, SGLang's radix cache): each turn keeps its longest common prefix with any earlier turn
(`truncate`, after `snapshot` / `restore` of that turn's state); after it, moved spans (`kvprof.traces.reuse`) and
new tokens; the input's last id is always computed. `plan_trajectory` plans from ids alone; `BranchingTimeline`
applies the plan turn by turn. Memory: snapshots of branches a later turn returns to are the replay's; moved-span
K/V are the policy's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvprof.errors import KvprofError
from kvprof.traces.reuse import (
    DEFAULT_MATCHING,
    Divergence,
    MovedSpan,
    PrefixTree,
    SpanIndex,
    SpanMatching,
    common_prefix,
    divergence_cause,
    message_boundaries,
)
from kvprof.traces.trace import Trajectory

if TYPE_CHECKING:  # the policies import torch; planning a trace (kvprof inspect) must not
    from kvprof.policies.base import SharingPolicy


@dataclass(frozen=True)
class TurnStart:
    """Where the policies start one turn from.

    restore: the earlier turn whose state they return to (None: the previous turn's); keep / dropped: tokens of that
    timeline kept / forgotten; divergence: where and why the input leaves it (None: it extends it); moved: moved spans
    after `keep` (shared-input coordinates; `source_begin` in the source's sequence), never the last id; tokens: the
    shared input's length."""

    restore: int | None
    keep: int
    dropped: int
    divergence: Divergence | None
    moved: tuple[MovedSpan, ...] = ()
    tokens: int = 0

    @property
    def reusable_prefix(self) -> int:
        """Kept tokens a policy can serve: all but the input's last id, which it computes."""
        return min(self.keep, max(self.tokens - 1, 0))

    @property
    def moved_tokens(self) -> int:
        return sum(len(span) for span in self.moved)

    def to_json(self) -> dict:
        divergence = self.divergence
        return {
            "restored_from": self.restore,
            "kept": self.keep,
            "dropped": self.dropped,
            "divergence": None if divergence is None else {"position": divergence.position, "cause": divergence.cause},
            "moved": [[span.begin, span.end, span.source, span.source_begin] for span in self.moved],
        }


def plan_trajectory(
    inputs: Sequence[list[int]],
    outputs: Sequence[list[int]],
    matching: SpanMatching = DEFAULT_MATCHING,
    boundaries: Sequence[frozenset[int]] | None = None,
) -> list[TurnStart]:
    """Each turn's start from its shared input and output ids: the longest common prefix with any earlier turn's
    sequence (restoring that turn when it shares more than the previous one), then moved spans per `matching`
    (`boundaries`: per turn, its messages' bounds; None: runs of ids)."""
    tree, span_index = PrefixTree(), SpanIndex()
    starts: list[TurnStart] = []
    previous: list[int] = []
    for index, (ids, out) in enumerate(zip(inputs, outputs)):
        best = tree.match(ids)
        restore = None
        timeline = previous
        keep = common_prefix(ids, 0, previous, 0, min(len(ids), len(previous)))
        if best.turn is not None and best.length > keep:
            restore, timeline, keep = best.turn, best.sequence, best.length
        divergence = None
        if keep < min(len(ids), len(timeline)):
            source = restore if restore is not None else index - 1
            cause = divergence_cause(ids, timeline, keep, len(inputs[source]))
            divergence = Divergence(keep, source, cause)
        moved = span_index.matched(
            ids, keep, len(ids) - 1, matching, None if boundaries is None else boundaries[: index + 1]
        )
        starts.append(TurnStart(restore, keep, len(timeline) - keep, divergence, tuple(moved), len(ids)))
        previous = ids + out
        span_index.add(previous, tree.insert(index, previous), index)
    return starts


def source_ranges(starts: Sequence[TurnStart]) -> dict[int, tuple[int, int]]:
    """Per source turn, the hull of its sequence later turns read as moved spans: what a span-moving policy keeps."""
    ranges: dict[int, tuple[int, int]] = {}
    for start in starts:
        for span in start.moved:
            low, high = ranges.get(span.source, (span.source_begin, span.source_begin + len(span)))
            ranges[span.source] = (min(low, span.source_begin), max(high, span.source_begin + len(span)))
    return ranges


def plan_of(
    traj: Trajectory, prefixes: Mapping[str, list[int]], matching: SpanMatching = DEFAULT_MATCHING
) -> list[TurnStart]:
    """`plan_trajectory` of `traj`: shared input = input after the agent's private prefix (`prefixes`), spans
    aligned to its segments per `matching`."""
    skips = [len(prefixes.get(turn.agent, [])) for turn in traj.turns]
    inputs = [traj.input_tokens(turn)[skip:] for turn, skip in zip(traj.turns, skips)]
    boundaries = [message_boundaries(traj, turn, skip) for turn, skip in zip(traj.turns, skips)]
    return plan_trajectory(inputs, [traj.output_tokens(turn) for turn in traj.turns], matching, boundaries)


def require_one_timeline(trajectories: Iterable[Trajectory], mode: str) -> None:
    """`kvprof replay --strict`: refuse a trace whose turn leaves the shared context, from the trace alone (prompt
    mode: private prefixes as `Trajectory.served_prefixes`; lora mode: none)."""
    for traj in trajectories:
        prefixes = traj.served_prefixes({}) if mode == "prompt" else {}
        for index, start in enumerate(plan_of(traj, prefixes)):
            if start.divergence is None and start.restore is None:
                continue
            at = start.divergence.position if start.divergence else start.keep
            cause = f" ({start.divergence.cause})" if start.divergence else ""
            raise KvprofError(
                f"trajectory {traj.id!r} turn {index} ({traj.turns[index].agent}): its input leaves the shared "
                f"context of the turns before it at shared position {at}{cause}, and --strict replays only traces "
                "whose turns extend one shared context; drop --strict to reuse the longest common prefix and "
                "recompute the rest."
            )


@dataclass
class ReplayPlanSummary:
    """`plan_of` summed over trajectories: shared input tokens (after private prefixes), `kept` (reusable prefix),
    `moved`, `new` (what a span-moving policy prefills, each private prefix once per trajectory, as FullShared),
    turns leaving the context (by cause) and returning to an earlier turn."""

    turns: int = 0
    shared_tokens: int = 0
    kept: int = 0
    moved: int = 0
    new: int = 0
    restored: int = 0
    causes: dict[str, int] = field(default_factory=dict)

    def add(self, traj: Trajectory, mode: str, matching: SpanMatching = DEFAULT_MATCHING) -> None:
        prefixes = traj.served_prefixes({}) if mode == "prompt" else {}
        self.new += sum(len(prefixes.get(agent, [])) for agent in dict.fromkeys(turn.agent for turn in traj.turns))
        for start in plan_of(traj, prefixes, matching):
            self.turns += 1
            self.shared_tokens += start.tokens
            self.kept += start.reusable_prefix
            self.moved += start.moved_tokens
            self.new += start.tokens - start.reusable_prefix - start.moved_tokens
            self.restored += start.restore is not None
            if start.divergence is not None:
                self.causes[start.divergence.cause] = self.causes.get(start.divergence.cause, 0) + 1

    def share(self, tokens: int) -> str:
        return f"{tokens / max(self.shared_tokens, 1):.1%}"

    def describe(self) -> str:
        left = sum(self.causes.values())
        causes = ", ".join(f"{count} {cause}" for cause, count in sorted(self.causes.items()))
        return (
            f"replay: {left} of {self.turns} turns leave the shared context the turns before them built"
            + (f" ({causes})" if causes else "")
            + f", {self.restored} return to an earlier turn's; of the input tokens after private prefixes, "
            f"{self.share(self.kept)} are each turn's longest common prefix with earlier turns (every sharing policy "
            f"reuses it), {self.share(self.moved)} lie in moved spans (re-aligned by the policies that move spans, "
            f"recomputed by the others); a policy that moves spans prefills {self.new} tokens, private prefixes "
            "included"
        )


class BranchingTimeline:
    """Applies `plan_trajectory` to `policies` (`begin` / `end` per turn): restores, truncations, the K/V kept for
    moved spans (`source_ranges`); `producers`: who held each timeline token first (for ρ). `holding(policy)`: a
    context each step on a policy's stores runs in (where stores are parked: `kvprof.replay.parking`)."""

    def __init__(
        self,
        starts: list[TurnStart],
        policies: Sequence[SharingPolicy],
        holding: Callable[[SharingPolicy], AbstractContextManager[None]] = lambda policy: nullcontext(),
    ):
        self.starts = starts
        self.policies = list(policies)
        self.holding = holding
        self.sources = source_ranges(starts)
        for policy in self.policies:
            policy.forget_spans()
        self.producers: list[str] = []
        self.pending = Counter(start.restore for start in starts if start.restore is not None)
        self.snapshots: dict[int, tuple[list[dict[str, object]], list[str]]] = {}
        self.finished: set[int] = set()  # ids of the policies `finish`ed for the turn being served

    def begin(self, index: int) -> TurnStart:
        """Bring every policy to turn `index`'s start: restore, then truncate."""
        start = self.starts[index]
        if start.restore is not None:
            states, producers = self.snapshots[start.restore]
            for policy, state in zip(self.policies, states):
                with self.holding(policy):
                    policy.restore(state)
            self.producers = list(producers)
            self.pending[start.restore] -= 1
            if not self.pending[start.restore]:
                del self.snapshots[start.restore]
        if start.dropped:
            for policy in self.policies:
                with self.holding(policy):
                    policy.truncate(start.keep)
            del self.producers[start.keep :]
        return start

    def end(self, index: int, agent: str, sequence_len: int) -> None:
        """After turn `index` (`sequence_len` tokens): record who added them; snapshot if a later turn returns."""
        self.producers += [agent] * (sequence_len - len(self.producers))
        for policy in self.policies:
            if id(policy) not in self.finished:
                self.finish(index, policy)
        self.finished.clear()
        if self.pending[index]:
            self.snapshots[index] = ([self._snapshot(policy) for policy in self.policies], list(self.producers))

    def finish(self, index: int, policy: SharingPolicy) -> None:
        """`policy` has served turn `index`: keep what later turns move of it, then let its turn's cache go (each
        run's as soon as it is done, not all runs' at once; `end` finishes the runs not finished yet)."""
        if index in self.sources:
            with self.holding(policy):
                policy.keep_span_source(index, *self.sources[index])
        policy.release_last_turn()
        self.finished.add(id(policy))

    def _snapshot(self, policy: SharingPolicy) -> dict[str, object]:
        with self.holding(policy):
            return policy.snapshot()


class FollowedTimeline:
    """Online counterpart (no turn planned ahead): before each turn the policy forgets what the input does not share
    with the previous turn's timeline (nothing restored); `begin` returns the moved spans (runs of ids ≥
    `matching.min_span`: generated turns have no messages). A span-moving policy keeps each turn's sequence from its
    first run of ids nothing before held."""

    def __init__(self, policy: SharingPolicy, matching: SpanMatching = DEFAULT_MATCHING):
        self.policy = policy
        self.matching = matching
        self.ids: list[int] = []
        self.index = SpanIndex()
        self.turns = 0
        policy.forget_spans()

    def begin(self, shared: list[int]) -> tuple[MovedSpan, ...]:
        keep = common_prefix(shared, 0, self.ids, 0, min(len(shared), len(self.ids)))
        if keep < len(self.ids):
            self.policy.truncate(keep)
        return tuple(self.index.matched(shared, keep, len(shared) - 1, self.matching))

    def end(self, sequence: list[int]) -> None:
        self.ids = sequence
        new = self.index.add(sequence, 0, self.turns)
        if new < len(sequence):
            self.policy.keep_span_source(self.turns, new, len(sequence))
        self.policy.release_last_turn()
        self.turns += 1
