"""Delta correction: reuse another agent's cache of a shared segment plus an estimate of how the reader's context
would have changed it — the machinery KVComm, KVCMAS and GraphFlow share (`kvcomm`, `kvcmas`, `graphflow`).

Prompt mode only: a segment read after PF_j has K/V C_j ≠ C_i. The timeline is cut into segments (`SegmentLog`),
pooled by slot (`AGENT.inK` / `AGENT.outK`, `kvprof.policies.anchors`). Each agent keeps its own full cache (the
saving is prefill compute, not memory). Per segment others added since j's last turn (`decide`): a reference
(`source_of`), a gate decided once by the first reader (`accepts`, `gated`), then either reference +
Σ w·(Δ_j − Δ_source) (layer 0: the reference) or a dense prefill (`fallback=call`, the code's; `segment`, kvprof's),
the segment learnt as an anchor with `pool=grow`. ρ (`delta_reuse`) counts tokens served corrected. The pool outlives
`reset` (fitted by `kvprof fit-anchors`, grown across trajectories in replay order), so these policies are not
trajectory-independent. Moved spans are placeholder segments (`moved_segment`, slots `AGENT.out.moved` /
`AGENT.in.moved`). Walk-through and kvprof's choices for branches and moved spans: docs/policies/delta.md.
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
        """Record `agent`'s turn (input `input_len` tokens, timeline now `total_len`); the segments it added."""
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
        """Forget the timeline from `keep` on; a segment across it is cut and renamed `NAME[:LENGTH]`. The dropped
        segments and old → new name."""
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
    """A pool's model shape: (layers, H_kv, D), or (layers, H_kv, D_k, D_v) when K and V differ (MLA)."""
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
    """Row 0, tokens [begin, end) of per-layer (K, V) (B, H_kv, T, D), stacked (layers, H_kv, L, D), keys rotated
    by `shift`."""
    keys = torch.stack([k[0, :, begin:end] for k, _ in kv])
    values = torch.stack([v[0, :, begin:end] for _, v in kv])
    return (ropes.rotate_stacked(keys, shift) if shift else keys), values


class NeutralContext:
    """What a context-free encoding follows: the agents' longest common prefix, else BOS, else nothing (no attention
    sink on the segment's first token; KVComm's code encodes inside the template). Only the segment's K/V are kept;
    the neutral tokens' cache is computed once per trajectory."""

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
        """Context-free (K, V) of `ids`, each (layers, H_kv, L, D), positions 0..L−1, adapters off; and its FLOPs."""
        runtime = self.runtime
        if self.kv is None:
            cache = runtime.cache_from(runtime.empty_kv(), len(self.ids))
            if self.ids:
                runtime.forward(None, self.ids, cache, 0, last_logits_only=True)
            self.kv = runtime.kv_of(cache)
        offset = len(self.ids)
        out = runtime.forward(None, ids, runtime.cache_from(self.kv, len(ids)), offset, last_logits_only=True)
        return stack(runtime.kv_of(out.cache), offset, offset + len(ids), -offset, runtime.ropes)


def threshold_option(default: str, meaning: str) -> Option:
    """A gate threshold on the normalized entropy of the anchor weights (what `kvprof tune-tau` sweeps)."""
    return Option(default, parse=unit_interval, help=meaning)


def pool_options(capacity: str) -> dict[str, Option]:
    """Every anchor-pool policy's options: pool size per slot, eviction window, a fitted pool to start from."""
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
    """One segment of others read this turn: `source` of the `reference` (None: context-free encoding), the gate's
    `verdict` if `gated`, the `match` the correction mixes, and whether it was `corrected` (else prefilled)."""

    segment: SharedSegment
    source: str | None
    reference: Stacked
    gated: bool
    verdict: bool
    corrected: bool = False
    match: Match | None = None


@dataclass
class DeltaContext(Context):
    """The turn's shared input, `decisions` per segment and `moved_decisions` per moved span, `first` turn, `bases`
    (encodings computed this turn) and `gates` (first-time matches, kept at commit)."""

    shared: list[int] = field(default_factory=list)
    shared_len: int = 0
    decisions: list[Decision] = field(default_factory=list)
    moved_decisions: list[Decision] = field(default_factory=list)
    first: bool = False
    bases: dict[str, Stacked] = field(default_factory=dict)
    gates: dict[str, Match] = field(default_factory=dict)


class DeltaCorrection(SharingPolicy[DeltaContext]):
    """Base of the delta-correction policies: a subclass sets `rank` (None: full-dimensional), `source_of`, `gated`
    and implements `accepts`."""

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
        """Whether a refusal makes the reader prefill its whole call (`fallback=call`, the code's)."""
        return self.settings.get("fallback") == "call"

    def source_of(self, reader: str, segment: SharedSegment) -> str | None:
        """Whose cache `reader` corrects `segment` from: the producer's (output) or None, the encoding (input)."""
        return segment.producer if segment.is_output else None

    def owner_of(self, segment: SharedSegment) -> str | None:
        """A new anchor's base: the cache `segment`'s readers were corrected from at the time."""
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
        """Cut the segment log, caches, encodings and verdicts at `keep` (kvprof's); the pool keeps what it learnt."""
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
        """The segment's context-free encoding, computed once, charged to the first turn needing it."""
        base, flops = self.encoding(segment, shared, context)
        context.extra_flops += flops
        return base

    def encoding(self, segment: SharedSegment, shared: list[int], context: DeltaContext) -> tuple[Stacked, float]:
        """`base_of` without charging its FLOPs: (encoding, FLOPs now or 0); tokens counted in `extra_prefill`."""
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
        """`owner`'s cache of `segment` in its frame (None: its context-free encoding)."""
        return self.base_of(segment, shared, context) if owner is None else self.stored_segment(owner, segment)

    def decide(self, agent: str, segment: SharedSegment, shared: list[int], context: DeltaContext) -> Decision:
        """The reference `agent` corrects `segment` from (`source_of`) and the gate's verdict (`judge`)."""
        source = self.source_of(agent, segment)
        return self.judge(agent, segment, source, self.cache_of(source, segment, shared, context), context)

    def judge(
        self, agent: str, segment: SharedSegment, source: str | None, reference: Stacked, context: DeltaContext
    ) -> Decision:
        """The gate's verdict on `segment` from `reference`, decided once by the first reader; corrected segments get
        their `correction_match`."""
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
        """Reference + mixed deltas on layers 1.. in the segment's frame (no covering anchor: the reference, as the
        code)."""
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
            buffers = [KVBuffer.of(keys, values, self.with_output(len(shared))) for keys, values in prefix_kv]
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
        """A moved span as a segment in this turn's coordinates, produced by its source turn's agent, slot
        `AGENT.out.moved` / `AGENT.in.moved`."""
        kept = self.span_store.source(span)
        part = "out" if span.source_begin >= kept.inputs else "in"
        name = f"{self.log.trajectory}@{span.source}+{span.source_begin}:{len(span)}"
        return SharedSegment(span.begin, span.end, kept.agent, f"{kept.agent}.{part}.moved", name, part)

    def moved_source(self, segment: SharedSegment) -> str | None:
        """A moved span's reference: its source turn's cache (output) or None, the encoding (input)."""
        return segment.producer if segment.is_output else None

    def decide_moved(self, agent: str, span: MovedSpan, shared: list[int], context: DeltaContext) -> Decision:
        """`decide` for a moved span, its reference from `kvprof.policies.moved.SpanStore` or the encoding."""
        segment = self.moved_segment(span)
        source = self.moved_source(segment)
        if source is None:
            reference = self.base_of(segment, shared, context)
        else:
            kv, position = self.span_store.span(span)
            reference = stack(kv, 0, len(span), -position, self.runtime.ropes)
        return self.judge(agent, segment, source, reference, context)

    def read_moved(self, agent: str, buffers: list[KVBuffer], context: DeltaContext) -> None:
        """Extend the context over corrected moved spans: tokens before each prefilled densely, then its corrected
        K/V; refused spans after the last corrected one join the chunk."""
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
        """Learn `agent`'s dense K/V of a refused moved span into its anchor (created with the refused reference)."""
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
        """Write `corrected_kv`, keys rotated to its positions, into `buffers`; count it at `hop`."""
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
        """Dense fallback: one forward over consecutive refused segments, written in place into `buffers`."""
        if not segments:
            return
        runtime = self.runtime
        start, end = segments[0].start, segments[-1].end
        at = len(runtime.prefix(agent)) + start
        runtime.forward(agent, context.shared[start:end], runtime.buffer_cache(buffers, at), at, last_logits_only=True)
        context.extra_prefill += end - start
        context.extra_flops += runtime.flops(end - start, at)
        context.recomputed += (end - start) * runtime.num_layers

    def make_room(self, agent: str, shared: list[int]) -> None:
        for buffer in self.own.get(agent, []):
            buffer.make_room(len(self.runtime.prefix(agent)) + self.with_output(len(shared)))

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
        """Whether a dense ungated input joins its slot (KVCMAS: anchor exists or < V anchors; no eviction)."""
        assert self.pool is not None
        if not (self.admits_dense_inputs and self.grow) or segment.is_output:
            return False
        anchors = self.pool.slots.get(segment.slot, [])
        return self.pool.anchor(segment.slot, segment.name) is not None or len(anchors) < self.pool.capacity

    def learn(self, agent: str, segment: SharedSegment, context: DeltaContext) -> float:
        """Learn `agent`'s dense K/V of `segment` into its anchor (created on first admission, base `owner_of`);
        FLOPs of a reference prefill if needed."""
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
