"""Delta correction: reuse another agent's cache of a shared segment after adding an estimate of how the reader's
context would have changed it — the machinery KVComm, KVCMAS and GraphFlow share (one module per method: `kvcomm`,
`kvcmas`, `graphflow`), as the authors' public code runs it. Prompt mode only: agents differ by their private prefix
PF_a, and a shared segment (the question, an observation, another agent's output) read after PF_j has K/V C_j ≠ C_i.

Segments and slots. The shared timeline is cut into segments as it grows: each turn adds the tokens of its input
nobody had read yet (`part` "in": the question, an observation, the workflow's cue) and its output ("out"). A
segment's slot is its place in the workflow, `AGENT.inK` / `AGENT.outK` (the K-th input or output of that agent's
turns), the placeholder its anchors are pooled under (`kvprof.policies.anchors`), so segments in the same place of
different trajectories share a pool.

A turn of agent j. Each agent keeps its own cache (its prefix and every token it has read, as NonShared does: the
active caches are full-dimensional; the saving is prefill compute, not their memory). For each segment others added
since j's last turn (`decide`):

- the reference: the cache j corrects from, `source_of` — an output's producer's in-context cache (KVComm and
  KVCMAS alike), an input's context-free encoding (KVComm, GraphFlow: one reference prefill per segment,
  `NeutralContext`) or its previous / first reader's cache (KVCMAS chain / star); keys rotated into the segment's
  frame;
- the gate (`accepts`), decided once per segment by its first reader (`verdicts`): the reference against its slot's
  anchors (`kvprof.policies.anchors.AnchorPool.match`); `gated` says which segments have one (KVCMAS: outputs only);
- accepted: j gets reference + Σ w·(Δ_j − Δ_source) with per-token weights, keys rotated to j's positions, layer 0
  left as the reference (its K/V depend only on the token and its position, so the re-aligned reference is exact
  there); refused: j prefills densely — its whole call (`fallback=call`, the code's) or only the refused segments
  (`fallback=segment`, kvprof's) — and with `pool=grow` its dense cache joins the segment's anchor (created on the
  first refusal, its base `owner_of`: the reference of the time). KVCMAS also keeps every dense computation of an
  input while its slot has fewer than V anchors (`admits`). Densely read segments after the last corrected one are
  simply part of j's chunk, so a gate that accepts nothing replays exactly what NonShared computes.

Every matching, correction, reference prefill and dense fallback runs in `assemble`, inside the timed prefill; the
gate's verdicts, activations and pool growth are kept in `commit`. The acceptance rate ρ (`Context.corrected` /
`fallback`: tokens of others' segments served corrected / prefilled densely) is the replay's `delta_reuse`. The pool
outlives `reset` (it is fitted once (`kvprof fit-anchors`, option `anchors`) and grows online across trajectories,
in replay order), so these policies are not trajectory-independent. A branching trace (`truncate`) cuts the segment
log, the caches and the verdicts; the pool keeps what it learnt (kvprof's: the public code replays one growing
timeline).

Moved spans (ids another turn processed at other positions, `kvprof.policies.moved`): read as placeholder segments
— KVCOMM's placeholders, a shared segment after each agent's different prefix — in the reading turn's coordinates
(`moved_segment`), produced by the agent of the turn they come from, pooled per message kind (`AGENT.out.moved`,
`AGENT.in.moved`). The reference is the K/V that turn held, or for an input the context-free encoding (KVComm,
GraphFlow); the gate and the correction are the segments' own; new tokens between moved spans are prefilled densely
over the cache so far (`read_moved`); a refused span is prefilled densely and, with `pool=grow`, learnt into its
anchor. kvprof's, where the public code has no counterpart: a moved input is corrected from the turn that first read
it (KVCMAS's chain of readers is not followed across positions), and the agent's own earlier reading of the same span
elsewhere is not reused.

Approximate: the correction is an estimate from other segments' deltas.
"""

from __future__ import annotations

from abc import abstractmethod
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from kvprof.errors import KvprofError
from kvprof.model.agents import tokenizer_identity
from kvprof.model.buffers import KVBuffer
from kvprof.model.rope import LayerRopes
from kvprof.model.runtime import Runtime
from kvprof.policies.anchors import AnchorPool, Match, mixed_delta
from kvprof.policies.base import SharingPolicy
from kvprof.policies.options import Option, positive_int, unit_interval
from kvprof.policies.turns import Chunk, Context
from kvprof.traces.reuse import MovedSpan

Stacked = tuple[torch.Tensor, torch.Tensor]  # keys and values (layers, H_kv, L, D), keys in the segment's frame


@dataclass(frozen=True)
class SharedSegment:
    """Timeline tokens [start, end) added by one turn of `producer`; `slot` its workflow placeholder, `name` unique
    within the replay."""

    start: int
    end: int
    producer: str
    slot: str
    name: str
    part: str  # "in": an input nobody had read (question, tool result, cue); "out": the producer's output

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def is_output(self) -> bool:
        return self.part == "out"


class SegmentLog:
    """The segments of one trajectory's shared timeline, in order (see module docstring)."""

    def __init__(self, trajectory: str):
        self.trajectory = trajectory
        self.segments: list[SharedSegment] = []
        self.length = 0
        self.turns: Counter[str] = Counter()

    def observe(self, agent: str, input_len: int, total_len: int) -> list[SharedSegment]:
        """Record a turn of `agent` whose shared input was `input_len` tokens and whose outputs end the timeline
        at `total_len`; returns the segments it added."""
        turn = self.turns[agent]
        self.turns[agent] += 1
        added = []
        for part, end in (("in", input_len), ("out", total_len)):
            if end > self.length:
                name = f"{self.trajectory}#{len(self.segments)}"
                segment = SharedSegment(self.length, end, agent, f"{agent}.{part}{turn}", name, part)
                self.segments.append(segment)
                added.append(segment)
                self.length = end
        return added

    def truncate(self, keep: int) -> tuple[list[SharedSegment], dict[str, str]]:
        """Forget the timeline from index `keep` on: segments starting there or later are dropped, one running
        across it ends there (same slot; a name of its own, `NAME[:LENGTH]`: an anchor learnt of the whole segment is
        not this one's). Returns the dropped segments and the cut one's old name → new name."""
        dropped = [segment for segment in self.segments if segment.start >= keep]
        renamed: dict[str, str] = {}
        kept = []
        for segment in self.segments:
            if segment.start >= keep:
                continue
            if segment.end > keep:
                name = f"{segment.name}[:{keep - segment.start}]"
                renamed[segment.name] = name
                segment = replace(segment, end=keep, name=name)
            kept.append(segment)
        self.segments = kept
        self.length = min(self.length, keep)
        return dropped, renamed


FITTED = "fitted:"  # what the names of a loaded pool's anchors start with (the replay's own start "replay:")


def pool_shape(runtime: Runtime) -> tuple[int, ...]:
    """A pool's tensors' model shape: (layers, H_kv, D), or (layers, H_kv, D_k, D_v) when K and V differ (an MLA
    model's RoPE keys and latents)."""
    dims = (runtime.key_dim,) if runtime.key_dim == runtime.value_dim else (runtime.key_dim, runtime.value_dim)
    return (runtime.num_layers, runtime.kv_heads, *dims)


def pool_identity(runtime: Runtime) -> dict:
    """What a pool must have been fitted on to be used: the model's name and shapes, and the tokenizer."""
    agents = runtime.agents
    return {
        "model": agents.model_name,
        "shape": "x".join(map(str, pool_shape(runtime))),
        "tokenizer": tokenizer_identity(agents.tokenizer)["fingerprint"],
        "dtype": str(runtime.dtype).removeprefix("torch."),
    }


def stack(kv: list[tuple[torch.Tensor, torch.Tensor]], begin: int, end: int, shift: int, ropes: LayerRopes) -> Stacked:
    """Batch row 0 of tokens [begin, end) of per-layer (K, V) (B, H_kv, T, D), stacked (layers, H_kv, L, D), each
    layer's keys rotated by `shift` positions with its RoPE."""
    keys = torch.stack([k[0, :, begin:end] for k, _ in kv])
    values = torch.stack([v[0, :, begin:end] for _, v in kv])
    return (ropes.rotate_stacked(keys, shift) if shift else keys), values


class NeutralContext:
    """What a context-free encoding is computed after: the tokens every agent's prefix starts with (their longest
    common prefix — a shared system header, the "You are the" of role prompts), else the tokenizer's BOS token when
    it has one, else nothing. An encoding of a segment with no context at all makes its first token the sequence's
    first (an attention sink), which no agent ever reads; the public KVComm code likewise encodes placeholders inside
    the template and drops the template's tokens. Only the segment's K/V are kept; the neutral tokens' cache is
    computed once per trajectory."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        prefixes = [runtime.prefix(agent.name) for agent in runtime.agents.spec.agents]
        common: list[int] = []
        for column in zip(*prefixes):
            if len(set(column)) > 1:
                break
            common.append(column[0])
        bos = runtime.agents.tokenizer.bos_token_id
        self.ids = common or ([bos] if bos is not None else [])
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def cost(self) -> tuple[int, float]:
        """Tokens and FLOPs of computing the neutral tokens' cache (0 once it is computed)."""
        if self.kv is not None or not self.ids:
            return 0, 0.0
        return len(self.ids), self.runtime.flops(len(self.ids), 0)

    def encode(self, ids: list[int]) -> Stacked:
        """The context-free encoding of `ids`: (K, V), each (layers, H_kv, L, D), keys in the segment's frame
        (positions 0..L−1), adapters off; FLOPs: `self.runtime.flops(len(ids), len(self.ids))`."""
        runtime = self.runtime
        if self.kv is None:
            cache = runtime.cache_from(runtime.empty_kv())
            if self.ids:
                runtime.forward(None, self.ids, cache, 0, last_logits_only=True)
            self.kv = runtime.kv_of(cache)
        offset = len(self.ids)
        out = runtime.forward(None, ids, runtime.cache_from(self.kv), offset, last_logits_only=True)
        return stack(runtime.kv_of(out.cache), offset, offset + len(ids), -offset, runtime.ropes)


def threshold_option(default: str, meaning: str) -> Option:
    """A gate threshold on the normalized entropy of the anchor weights (what `kvprof tune-tau` sweeps)."""
    return Option(default, parse=unit_interval, help=meaning)


def pool_options(capacity: str) -> dict[str, Option]:
    """The options every anchor-pool policy has: the pool size per slot, the eviction window, and a fitted pool to
    start from."""
    return {
        "anchors_per_slot": Option(capacity, parse=positive_int, help="anchors kept per slot (V)"),
        "window": Option("5", parse=positive_int, help="the eviction window"),
        "pool": Option(
            "grow",
            ("grow", "frozen"),
            help="grow: refused segments become anchors (published); frozen: the pool stays as it started",
        ),
        "anchors": Option(
            "", labelled=False, help="an anchor pool written by kvprof fit-anchors to start from; empty: start empty"
        ),
    }


def fallback_option() -> Option:
    """What a gate's refusal makes the reader prefill densely."""
    return Option(
        "call",
        ("call", "segment"),
        help="call: a refused segment makes every reader prefill its whole call densely (code); segment: only the "
        "refused segments (kvprof)",
    )


@dataclass
class Decision:
    """What happened to one segment of others the agent read this turn. source: whose cache the reference is (None:
    the context-free encoding); reference: that cache in the segment's frame; gated: whether a gate decided for the
    segment (`verdict`: the gate accepted it, decided once per segment); match: the anchors the correction mixes
    (None: `corrected_kv` weighs them when the segment is corrected); corrected: the agent got the segment
    corrected (else it prefilled it densely)."""

    segment: SharedSegment
    source: str | None
    reference: Stacked
    gated: bool
    verdict: bool
    corrected: bool = False
    match: Match | None = None


@dataclass
class DeltaContext(Context):
    """shared / shared_len: the turn's shared input and its length; decisions: per segment of others read this turn;
    moved_decisions: per moved span read this turn, in order (`moved_segment`: the segment in this turn's
    coordinates); first: the agent's first turn (its buffers are new); bases: context-free encodings computed this
    turn, by segment name; gates: the matches of segments gated for the first time this turn (their verdicts and
    activations are kept at commit)."""

    shared: list[int] = field(default_factory=list)
    shared_len: int = 0
    decisions: list[Decision] = field(default_factory=list)
    moved_decisions: list[Decision] = field(default_factory=list)
    first: bool = False
    bases: dict[str, Stacked] = field(default_factory=dict)
    gates: dict[str, Match] = field(default_factory=dict)


class DeltaCorrection(SharingPolicy[DeltaContext]):
    """Base class of the delta-correction policies (see module docstring). A subclass sets `rank` (anchor factor
    rank, None: full-dimensional), `source_of` (whose cache a reader corrects from), `gated` (which segments a gate
    decides for) and implements `accepts`, the gate."""

    family = "delta"
    approximate = True
    modes = ("prompt",)
    trajectory_independent = False
    timeline_state = ("log", "own", "seen", "latest", "readers", "corrected", "bases", "neutral", "verdicts")
    moves_spans = True
    stacks_layers = True
    temperature = 1.0  # softmax temperature over anchor distances (the public code hard-codes 1)
    per_token = True  # per-token K and V correction weights (the public code); False: the gate's weights
    admits_dense_inputs = False  # an input computed densely joins its slot while it has < V anchors (KVCMAS)

    def __init__(self, runtime: Runtime, **options: str):
        self.pool: AnchorPool | None = None
        self.trajectory = 0
        super().__init__(runtime, **options)

    @classmethod
    def independent_of_trajectories(cls, options: dict[str, str]) -> bool:
        """A frozen pool (option `pool=frozen`) learns nothing from one trajectory for the next."""
        return options.get("pool") == "frozen"

    @property
    def rank(self) -> int | None:
        return None

    @property
    def grow(self) -> bool:
        """Whether refused segments become anchors (option `pool`; growing is the published behaviour)."""
        return self.settings["pool"] == "grow"

    @property
    def whole_call(self) -> bool:
        """Whether a refused segment makes its reader prefill its whole call densely (option `fallback`, the public
        code's), rather than only the refused segments (kvprof's)."""
        return self.settings.get("fallback") == "call"

    def source_of(self, reader: str, segment: SharedSegment) -> str | None:
        """Whose cache `reader` corrects `segment` from: its producer's for an output, the context-free encoding
        (None) for an input (KVComm's references; KVCMAS overrides the inputs')."""
        return segment.producer if segment.is_output else None

    def owner_of(self, segment: SharedSegment) -> str | None:
        """The base of a new anchor of `segment`: the cache its readers were corrected from at the time (the
        producer's for an output, the context-free encoding for an input)."""
        return segment.producer if segment.is_output else None

    def gated(self, segment: SharedSegment) -> bool:
        """Whether a gate decides for `segment` (otherwise it is always corrected)."""
        return True

    @abstractmethod
    def accepts(self, match: Match) -> bool:
        """The gate: whether `match` is trusted enough to correct instead of prefilling densely."""

    def notes(self) -> list[str]:
        path = self.settings.get("anchors")
        started = f"anchor pool started from {path}" if path else "anchor pool started empty"
        return [f"{started}; it grows across trajectories in replay order" if self.grow else started]

    def reset(self) -> None:
        if self.pool is None:
            self.pool = self.initial_pool()
        self.trajectory += 1
        self.log = SegmentLog(f"replay:{self.trajectory}")
        self.own: dict[str, list[KVBuffer]] = {}  # agent -> per layer (1, H_kv, ≥ L_agent, D) buffers
        self.seen: dict[str, int] = {}  # agent -> shared-timeline tokens in its cache
        self.latest: dict[str, str] = {}  # segment name -> the agent holding its latest materialised cache
        self.readers: Counter[str] = Counter()  # segment name -> agents besides its producer that read it
        self.corrected: dict[str, list[tuple[int, int]]] = {}  # agent -> timeline spans of its cache got by correction
        self.bases: dict[str, Stacked] = {}  # segment name -> context-free encoding (kept for later readers)
        self.verdicts: dict[str, bool] = {}  # segment name -> its gate's verdict (decided once per segment)
        self.neutral = NeutralContext(self.runtime)

    def truncate(self, keep: int) -> None:
        """Cut the segment log at `keep` (kvprof's: the public code replays one growing timeline), each agent's cache,
        the context-free encodings and the gate's verdicts with it; the anchor pool keeps what it learnt."""
        dropped, renamed = self.log.truncate(keep)
        for segment in dropped:
            for table in (self.latest, self.readers, self.bases, self.verdicts):
                table.pop(segment.name, None)
        for old, new in renamed.items():  # the cut segment: its gate decides again, its encoding is cut too
            self.verdicts.pop(old, None)
            if old in self.latest:
                self.latest[new] = self.latest.pop(old)
            if old in self.readers:
                self.readers[new] = self.readers.pop(old)
            base = self.bases.pop(old, None)
            if base is not None:
                length = next(s.length for s in self.log.segments if s.name == new)
                keys, values = base
                self.bases[new] = (keys[..., :length, :].clone(), values[..., :length, :].clone())
        self.seen = {agent: min(seen, keep) for agent, seen in self.seen.items()}
        self.corrected = {
            agent: [(start, min(end, keep)) for start, end in spans if start < keep]
            for agent, spans in self.corrected.items()
        }

    def initial_pool(self) -> AnchorPool:
        path = self.settings.get("anchors")
        if path:
            pool = AnchorPool.load(str(path), pool_identity(self.runtime), self.runtime.device)
            if pool.rank != self.rank:
                raise KvprofError(
                    f"anchor pool {path} stores {'rank-' + str(pool.rank) if pool.rank else 'full-dimensional'} "
                    f"anchors but {self.label} uses {'rank-' + str(self.rank) if self.rank else 'full-dimensional'} "
                    "ones; fit a pool with the matching --rank."
                )
            pool.capacity, pool.window = int(self.values["anchors_per_slot"]), int(self.values["window"])
            for anchor in (a for anchors in pool.slots.values() for a in anchors):  # not a segment this replay names
                anchor.name = f"{FITTED}{anchor.name}"
            return pool
        return AnchorPool(int(self.values["anchors_per_slot"]), int(self.values["window"]), self.rank)

    # ------------------------------------------------------------------------------------------ the turn

    def base_of(self, segment: SharedSegment, shared: list[int], context: DeltaContext) -> Stacked:
        """The segment's context-free encoding (`NeutralContext.encode`), computed once per segment: a reference
        prefill, charged to the turn's prefill that needs it first."""
        base, flops = self.encoding(segment, shared, context)
        context.extra_flops += flops
        return base

    def encoding(self, segment: SharedSegment, shared: list[int], context: DeltaContext) -> tuple[Stacked, float]:
        """`base_of` without charging its FLOPs: (encoding, FLOPs of computing it now, 0 if known). Counts the
        tokens in the turn's `extra_prefill`."""
        known = self.bases.get(segment.name) or context.bases.get(segment.name)
        if known is not None:
            return known, 0.0
        neutral_tokens, flops = self.neutral.cost()
        base = self.neutral.encode(shared[segment.start : segment.end])
        context.bases[segment.name] = base
        context.extra_prefill += segment.length + neutral_tokens
        return base, flops + self.runtime.flops(segment.length, len(self.neutral.ids))

    def stored_segment(self, agent: str, segment: SharedSegment) -> Stacked:
        """`agent`'s stored cache of `segment`, in the segment's frame."""
        begin = len(self.runtime.prefix(agent)) + segment.start
        kv = [buffer.view(begin - segment.start + self.seen[agent]) for buffer in self.own[agent]]
        return stack(kv, begin, begin + segment.length, -begin, self.runtime.ropes)

    def cache_of(self, owner: str | None, segment: SharedSegment, shared: list[int], context: DeltaContext) -> Stacked:
        """`owner`'s cache of `segment` in its frame; None: its context-free encoding (charged to this turn when
        computed now)."""
        return self.base_of(segment, shared, context) if owner is None else self.stored_segment(owner, segment)

    def decide(self, agent: str, segment: SharedSegment, shared: list[int], context: DeltaContext) -> Decision:
        """The reference `agent` corrects `segment` from (`source_of`) and the gate's verdict (`judge`)."""
        source = self.source_of(agent, segment)
        return self.judge(agent, segment, source, self.cache_of(source, segment, shared, context), context)

    def judge(
        self, agent: str, segment: SharedSegment, source: str | None, reference: Stacked, context: DeltaContext
    ) -> Decision:
        """The gate's verdict on `segment` read by `agent` from `reference` (`source`'s cache; None: the context-free
        encoding), decided by the first reader, once per segment (the candidate is the same reference for every
        reader); `correction_match` adds the anchors the correction mixes, for the segments that are corrected."""
        assert self.pool is not None
        gated = self.gated(segment)
        verdict = True
        if gated:
            known = self.verdicts.get(segment.name)
            if known is None:
                gate = self.pool.match(
                    segment.slot, reference, source, (), self.temperature, exclude=segment.name, per_token=False
                )
                context.extra_flops += 3.0 * reference[1].numel() * len(gate.anchors)
                known = self.accepts(gate)
                context.gates[segment.name] = gate
            verdict = known
        return Decision(segment, source, reference, gated, verdict)

    def correction_match(self, agent: str, decision: Decision, context: DeltaContext) -> Match:
        """The anchors holding `agent`'s cache of the segment, weighed (per token) against its reference."""
        assert self.pool is not None
        segment, reference = decision.segment, decision.reference
        match = self.pool.match(
            segment.slot, reference, decision.source, (agent,), self.temperature, segment.name, self.per_token
        )
        context.extra_flops += 2 * 3.0 * reference[1].numel() * len(match.anchors)
        return match

    def corrected_kv(self, agent: str, decision: Decision, context: DeltaContext) -> Stacked:
        """The accepted segment's K/V for `agent`, in its frame: reference + mixed deltas on layers 1.. (the
        reference alone when no anchor holds `agent`'s cache of a segment this long: the public code reuses it
        uncorrected)."""
        match = decision.match or self.correction_match(agent, decision, context)
        keys, values = decision.reference
        out_keys, out_values = keys.clone(), values.clone()
        if not match.anchors:
            return out_keys, out_values
        for layer in range(1, self.runtime.num_layers):
            mixed_delta(match, agent, layer, False, keys[layer], out_keys[layer])
            mixed_delta(match, agent, layer, True, values[layer], out_values[layer])
        terms = sum((agent != a.owner) + (match.source != a.owner) for a in match.anchors)
        context.extra_flops += 2.0 * 2 * terms * keys[1:].numel() * (self.rank or keys.shape[-1])
        return out_keys, out_values

    def assemble(self, agent: str, shared: list[int]) -> DeltaContext:
        runtime = self.runtime
        prefix_len = len(runtime.prefix(agent))
        context = DeltaContext(kv=[], reused=0, shared=shared, shared_len=len(shared), first=agent not in self.own)
        if context.first:
            prefix_kv, flops = self.prefix_context(agent)
            context.extra_prefill, context.extra_flops = prefix_len, flops
            buffers = [KVBuffer.of(keys, values, len(shared)) for keys, values in prefix_kv]
            seen = 0
        else:
            buffers, seen = self.own[agent], self.seen[agent]
        known = min(self.log.length, len(shared) - 1)
        pending = [s for s in self.log.segments if s.start >= seen and s.end <= known]
        context.decisions = [self.decide(agent, segment, shared, context) for segment in pending]
        context.moved_decisions = [
            self.decide_moved(agent, span, shared, context) for span in self.moved_now if span.begin >= known
        ]
        refused = any(not d.verdict for d in [*context.decisions, *context.moved_decisions])
        for decision in [*context.decisions, *context.moved_decisions]:
            decision.corrected = decision.verdict and not (refused and self.whole_call)
        corrected = [d for d in context.decisions if d.corrected]
        reused = corrected[-1].segment.end if corrected else seen
        dense: list[SharedSegment] = []  # a run of densely read segments before a corrected one: one forward
        for decision in context.decisions:
            segment = decision.segment
            if not decision.corrected:
                context.fallback += segment.length
                if segment.end <= reused:
                    dense.append(segment)
                continue
            self.prefill_densely(agent, dense, buffers, context)
            dense = []
            self.write_corrected(agent, decision, buffers, context, self.readers[segment.name] + 1)
        context.reused = reused
        self.read_moved(agent, buffers, context)
        context.kv = [buffer.view(prefix_len + context.covered) for buffer in buffers]
        context.buffers = buffers
        earlier = sum(max(0, min(end, reused) - start) for start, end in self.corrected.get(agent, []))
        context.from_others = earlier + context.corrected
        return context

    # ------------------------------------------------------------------------------------------ moved spans

    def moved_segment(self, span: MovedSpan) -> SharedSegment:
        """A moved span as a placeholder segment in the reading turn's coordinates: produced by the agent of the
        turn it comes from, an output when it lies in that turn's outputs (else an input), pooled in the slot
        `AGENT.out.moved` / `AGENT.in.moved` (one per message kind), named by its source."""
        kept = self.span_store.source(span)
        part = "out" if span.source_begin >= kept.inputs else "in"
        name = f"{self.log.trajectory}@{span.source}+{span.source_begin}:{len(span)}"
        return SharedSegment(span.begin, span.end, kept.agent, f"{kept.agent}.{part}.moved", name, part)

    def moved_source(self, segment: SharedSegment) -> str | None:
        """Whose cache a moved span is corrected from: the turn it comes from for an output (its producer's), the
        context-free encoding (None) for an input (KVComm's and GraphFlow's references; KVCMAS overrides)."""
        return segment.producer if segment.is_output else None

    def decide_moved(self, agent: str, span: MovedSpan, shared: list[int], context: DeltaContext) -> Decision:
        """The reference and the gate's verdict for a moved span (`moved_segment`): the reference is the K/V the
        turn it comes from held (`kvprof.policies.moved.SpanStore`), keys rotated into the segment's frame, or its
        context-free encoding."""
        segment = self.moved_segment(span)
        source = self.moved_source(segment)
        if source is None:
            reference = self.base_of(segment, shared, context)
        else:
            kv, position = self.span_store.span(span)
            reference = stack(kv, 0, len(span), -position, self.runtime.ropes)
        return self.judge(agent, segment, source, reference, context)

    def read_moved(self, agent: str, buffers: list[KVBuffer], context: DeltaContext) -> None:
        """Extend `agent`'s context past `context.reused` over the moved spans it gets corrected: the tokens before
        each (new tokens, refused moved spans) prefilled densely over the cache so far, then the span's corrected
        K/V written at its positions. Refused spans after the last corrected one are part of the chunk."""
        runtime = self.runtime
        prefix_len = len(runtime.prefix(agent))
        position = context.reused
        for decision in context.moved_decisions:
            segment = decision.segment
            if not decision.corrected:
                context.fallback += segment.length
                continue
            if segment.start > position:
                at = prefix_len + position
                piece = context.shared[position : segment.start]
                runtime.forward(agent, piece, runtime.buffer_cache(buffers, at), at, last_logits_only=True)
                context.extra_prefill += len(piece)
                context.extra_flops += runtime.flops(len(piece), at)
            self.write_corrected(agent, decision, buffers, context, 1)
            context.moved += segment.length
            context.moved_spans.append((segment.start, segment.end))
            position = segment.end
        context.extended = position - context.reused

    def learn_moved(self, agent: str, decision: Decision) -> None:
        """Keep `agent`'s dense K/V of a refused moved span in its slot's anchor of it, creating that anchor (its
        base: the reference the gate refused; the delta of the agent whose turn it comes from) first."""
        assert self.pool is not None
        segment = decision.segment
        self.pool.trim(segment.slot)
        anchor = self.pool.anchor(segment.slot, segment.name)
        if anchor is None:
            anchor = self.pool.insert(segment.slot, segment.name, decision.source, *decision.reference)
        self.pool.add_delta(anchor, agent, *self.stored_segment(agent, segment))

    def write_corrected(
        self, agent: str, decision: Decision, buffers: list[KVBuffer], context: DeltaContext, hop: int
    ) -> None:
        """Write the accepted segment's corrected K/V (`corrected_kv`, keys rotated to its positions after
        `agent`'s prefix) into `buffers` and count it (`hop`: see `Context.corrected_spans`)."""
        segment = decision.segment
        at = len(self.runtime.prefix(agent)) + segment.start
        keys, values = self.corrected_kv(agent, decision, context)
        keys = self.runtime.ropes.rotate_stacked(keys, at)
        for layer, buffer in enumerate(buffers):
            buffer.write(at, keys[layer][None], values[layer][None])
        context.corrected += segment.length
        context.corrected_spans.append((segment.start, segment.end, hop))

    def prefill_densely(
        self, agent: str, segments: list[SharedSegment], buffers: list[KVBuffer], context: DeltaContext
    ) -> None:
        """The dense fallback for consecutive refused segments: one forward of their tokens with `agent`'s adapter
        over its context so far, written in place into `buffers` after it."""
        if not segments:
            return
        runtime = self.runtime
        start, end = segments[0].start, segments[-1].end
        at = len(runtime.prefix(agent)) + start
        runtime.forward(agent, context.shared[start:end], runtime.buffer_cache(buffers, at), at, last_logits_only=True)
        context.extra_prefill += end - start
        context.extra_flops += runtime.flops(end - start, at)
        context.recomputed += (end - start) * runtime.num_layers

    def commit(self, chunk: Chunk[DeltaContext]) -> float:
        agent, context = chunk.agent, chunk.context
        self.own[agent] = chunk.buffers
        self.seen[agent] = chunk.start + len(chunk.ids)
        self.corrected.setdefault(agent, []).extend((start, end) for start, end, _ in context.corrected_spans)
        self.bases.update(context.bases)
        assert self.pool is not None
        self.record_verdicts(context)
        for decision in context.decisions:
            self.latest[decision.segment.name] = agent
            self.readers[decision.segment.name] += 1
        added = self.log.observe(agent, context.shared_len, self.seen[agent])
        for segment in added:
            self.latest[segment.name] = agent
        return self.learn_turn(agent, context, added)

    def record_verdicts(self, context: DeltaContext) -> None:
        """Keep each gated segment's verdict; an accepted gate activates the anchors it matched."""
        assert self.pool is not None
        for decision in [*context.decisions, *context.moved_decisions]:
            gate = context.gates.get(decision.segment.name)
            if gate is not None:
                self.verdicts[decision.segment.name] = decision.verdict
                if decision.verdict:
                    self.pool.activate(gate)

    def learn_turn(self, agent: str, context: DeltaContext, added: list[SharedSegment]) -> float:
        """What the pool learns from a committed turn: its rejected or uncorrected inputs and the segments it
        produced, as the pool admits them, and its rejected moved spans. Returns the FLOPs spent."""
        flops = 0.0
        for decision in context.decisions:
            segment = decision.segment
            if decision.gated and not decision.verdict and self.grow:
                flops += self.learn(agent, segment, context)
            elif not decision.corrected and self.admits(segment):
                flops += self.learn(agent, segment, context)
        for segment in added:
            if self.admits(segment):
                flops += self.learn(agent, segment, context)
        for decision in context.moved_decisions:
            if decision.gated and not decision.verdict and self.grow:
                self.learn_moved(agent, decision)
        return flops

    def admits(self, segment: SharedSegment) -> bool:
        """Whether a dense computation of an ungated input joins its slot (KVCMAS: its anchor exists, or the slot has
        fewer than V anchors; no eviction)."""
        assert self.pool is not None
        if not (self.admits_dense_inputs and self.grow) or segment.is_output:
            return False
        anchors = self.pool.slots.get(segment.slot, [])
        return self.pool.anchor(segment.slot, segment.name) is not None or len(anchors) < self.pool.capacity

    def learn(self, agent: str, segment: SharedSegment, context: DeltaContext) -> float:
        """Keep `agent`'s dense K/V of `segment` in its slot's anchor of it, creating that anchor (its base:
        `owner_of`; the producer's delta) on the segment's first admission, after the slot's size check. Returns the
        FLOPs: a reference prefill when the base is a context-free encoding not computed yet."""
        assert self.pool is not None
        flops = 0.0
        self.pool.trim(segment.slot)  # the public code's size check runs on every dense reader's call
        anchor = self.pool.anchor(segment.slot, segment.name)
        if anchor is None:
            owner = self.owner_of(segment)
            if owner is None:
                base, flops = self.encoding(segment, context.shared, context)
                self.bases[segment.name] = base
            else:
                base = self.stored_segment(owner, segment)
            anchor = self.pool.insert(segment.slot, segment.name, owner, *base)
            self.pool.add_delta(anchor, segment.producer, *self.stored_segment(segment.producer, segment))
        self.pool.add_delta(anchor, agent, *self.stored_segment(agent, segment))  # commit stored the turn's cache
        return flops

    # ------------------------------------------------------------------------------------------ memory

    def live_tensors(self) -> dict[str, list[torch.Tensor]]:
        tensors = {
            f"cache:{agent}": self.runtime.held(buffers, len(self.runtime.prefix(agent)) + self.seen[agent])
            for agent, buffers in self.own.items()
        }
        if self.bases:
            tensors["context-free encodings"] = [t for pair in self.bases.values() for t in pair]
        assert self.pool is not None
        tensors["anchor pool"] = self.pool.tensors()
        return tensors

    def analytic_bytes(self) -> dict[str, int]:
        runtime = self.runtime
        sizes = {
            f"cache:{agent}": runtime.kv_bytes(len(runtime.prefix(agent)) + self.seen[agent]) for agent in self.own
        }
        if self.bases:
            sizes["context-free encodings"] = runtime.kv_bytes_per_token * sum(
                pair[0].shape[-2] for pair in self.bases.values()
            )
        assert self.pool is not None
        sizes["anchor pool"] = self.pool.analytic_bytes(
            runtime.num_layers, runtime.kv_heads, (runtime.key_dim, runtime.value_dim), runtime.dtype.itemsize
        )
        return sizes
