"""How replay follows a trajectory whose turns do not extend one shared context.

The policies store caches of one shared timeline per trajectory (`kvprof.policies.base`): an agent's input is its
private prefix followed by the timeline's first tokens. Real traces are not one growing timeline: a turn is its
exact ids as the server rendered them, and its shared input (after the acting agent's private prefix) may leave the
timeline the policies hold — the previous turn's input and outputs — at some position: a reply re-rendered by the
template (Llama's `| trim`, a stop string cut), another role header (a group chat shows others' replies as `user`
messages), a boundary tokenized as one merged id. Replay then does what a serving engine's prefix cache does:

- the policies keep the tokens of their timeline the input starts with (`SharingPolicy.truncate`) and everything
  after the divergence is new tokens for the turn, computed by the acting agent;
- when an earlier turn's sequence (its input and outputs) shares more with the input than the current timeline does
  — agents alternating in a group chat, each reading its own replies under `assistant` and the others' under
  `user` — the policies first return to the state they had after that turn (`SharingPolicy.snapshot` /
  `restore`), so a turn reuses its longest common prefix with any earlier turn, as a prefix tree over all turns
  keeps it (vLLM's automatic prefix caching, SGLang's radix cache).

After the kept prefix a turn is a sequence of spans: **moved spans** — runs of at least `min_span` ids equal to ids
an earlier turn processed at other positions (`kvprof.traces.reuse.SpanIndex`: the question, a tool result, another
agent's reply read after this agent's own role prompt and header), by default trimmed to message boundaries
(`kvprof.traces.reuse.SpanMatching`) — and **new tokens** between them. A policy that
moves caches (`SharingPolicy.moves_spans`) serves each moved span from the K/V the source turn held (kept by the
replay for the turns that will read it: `SpanStore`), re-aligned to the reader's positions, and computes the new
tokens span by span over the cache so far; any other policy computes moved spans as new tokens. The input's last id
is always computed (its logits start the output).

`plan_trajectory` derives each turn's start and spans from the ids alone, before any model runs; `BranchingTimeline`
applies it to the policies turn by turn and keeps a snapshot only of the turns a later turn returns to.
Memory: a policy's analytic bytes count the branch it is on; the snapshots of branches a later turn returns to are
the replay's, as a radix cache would keep those blocks besides; the K/V kept for moved spans are the policy's
("moved spans" in its memory).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
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

    restore: the earlier turn whose state they return to first (None: the state the previous turn left); keep:
    tokens of that state's timeline the turn's shared input starts with, which they keep; dropped: tokens of that
    timeline after `keep`, which they forget; divergence: where the input leaves the timeline it continues, and why
    (None when it extends it); moved: the moved spans after `keep` (shared-input coordinates; `source_begin` in the
    source turn's shared sequence), none of them covering the input's last id; tokens: the shared input's length."""

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
    """Each turn's start, from its shared input ids and output ids (one list per turn, in order): the longest common
    prefix with any earlier turn's sequence, restoring that turn's state when the previous turn's sequence shares
    less, then the moved spans after it as `matching` finds them (`boundaries`: per turn, where the messages of its
    shared sequence begin and end; None: runs of ids) (see the module docstring)."""
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
    """Per source turn, the range of its shared sequence later turns read as moved spans (the hull of them): what
    a policy that moves spans keeps of that turn."""
    ranges: dict[int, tuple[int, int]] = {}
    for start in starts:
        for span in start.moved:
            low, high = ranges.get(span.source, (span.source_begin, span.source_begin + len(span)))
            ranges[span.source] = (min(low, span.source_begin), max(high, span.source_begin + len(span)))
    return ranges


def plan_of(
    traj: Trajectory, prefixes: Mapping[str, list[int]], matching: SpanMatching = DEFAULT_MATCHING
) -> list[TurnStart]:
    """`plan_trajectory` of `traj`, each turn's shared input being its input after the acting agent's private prefix
    (`prefixes`: agent → ids; none for an agent not in it), moved spans aligned to its messages (its segments) as
    `matching` says."""
    skips = [len(prefixes.get(turn.agent, [])) for turn in traj.turns]
    inputs = [traj.input_tokens(turn)[skip:] for turn, skip in zip(traj.turns, skips)]
    boundaries = [message_boundaries(traj, turn, skip) for turn, skip in zip(traj.turns, skips)]
    return plan_trajectory(inputs, [traj.output_tokens(turn) for turn in traj.turns], matching, boundaries)


def require_one_timeline(trajectories: Iterable[Trajectory], mode: str) -> None:
    """`kvprof replay --strict`: refuse the trace if a turn of any trajectory leaves the shared context the turns
    before it built (checked from the trace alone, before a model loads: in prompt mode each agent's private prefix
    is the private segments its calls start with, `Trajectory.served_prefixes`, as replay serves them unless --role
    overrides a role prompt; lora-mode agents have none)."""
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
    """What replay will do with a trace's turns (`plan_of`), summed over trajectories (`add`): shared input tokens
    (after private prefixes); of them those kept from stored caches (`kept`: the reusable prefix, the input's last id
    always computed) and those in moved spans (`moved`); the tokens a policy that moves spans prefills (`new`: the
    rest, and each agent's private prefix once per trajectory — what FullShared prefills); turns that leave the
    context (by cause) and turns that return to an earlier turn's."""

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
    """Applies a trajectory's `plan_trajectory` to `policies` turn by turn (`begin` before a turn, `end` after it):
    restores and truncations, and the K/V each policy that moves spans keeps of a turn later turns read from
    (`source_ranges`). Keeps who held each token of the current timeline first (`producers`, for the replay's reuse
    count)."""

    def __init__(self, starts: list[TurnStart], policies: Sequence[SharingPolicy]):
        self.starts = starts
        self.policies = list(policies)
        self.sources = source_ranges(starts)
        for policy in self.policies:
            policy.forget_spans()
        self.producers: list[str] = []
        self.pending = Counter(start.restore for start in starts if start.restore is not None)
        self.snapshots: dict[int, tuple[list[dict[str, object]], list[str]]] = {}

    def begin(self, index: int) -> TurnStart:
        """Bring every policy to turn `index`'s start: restore the turn it returns to, then forget what its input
        does not share."""
        start = self.starts[index]
        if start.restore is not None:
            states, producers = self.snapshots[start.restore]
            for policy, state in zip(self.policies, states):
                policy.restore(state)
            self.producers = list(producers)
            self.pending[start.restore] -= 1
            if not self.pending[start.restore]:
                del self.snapshots[start.restore]
        if start.dropped:
            for policy in self.policies:
                policy.truncate(start.keep)
            del self.producers[start.keep :]
        return start

    def end(self, index: int, agent: str, sequence_len: int) -> None:
        """After turn `index` of `agent` (its shared input and outputs: `sequence_len` tokens): record the tokens it
        added and snapshot the policies if a later turn returns here."""
        self.producers += [agent] * (sequence_len - len(self.producers))
        if index in self.sources:
            for policy in self.policies:
                policy.keep_span_source(index, *self.sources[index])
        if self.pending[index]:
            self.snapshots[index] = ([policy.snapshot() for policy in self.policies], list(self.producers))


class FollowedTimeline:
    """The online counterpart (turns generated as they come, so no turn can be planned ahead): before each turn the
    policy forgets what the input does not share with the timeline the previous turn left (no earlier state is
    restored), and `begin` returns the input's moved spans after that, found among the earlier turns' sequences (as
    runs of ids of `matching.min_span` or more: a generated turn reaches replay as ids, without its messages); a
    policy that moves spans keeps of each turn what a later turn could read as a moved span (no later turn is known
    yet): its sequence from its first run of ids nothing before it held."""

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
        self.turns += 1
