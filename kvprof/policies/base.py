"""The `SharingPolicy` interface every KV-sharing method implements, and the turn loop they share.

Agent a's input at a turn is `prefix_a + S[0:n]`: its private prefix (role prompt in prompt mode, empty in lora
mode), then the first n tokens of the shared timeline S. `assemble` hands the agent a `Context` (its prefix and the
first `reused` tokens of S); the agent computes the rest (the chunk) and its output over it; `commit` keeps what the
policy stores. Before a turn that leaves the stored timeline the engine calls `restore` / `truncate`
(`kvprof.replay.branches`), so a policy only sees inputs extending what it stores, possibly followed by moved spans
(`TurnRequest.moved`, `extend_context`). Phases (`run_turn`): `prefill` (TTFT: `assemble`, the chunk's forward,
`on_prefill`), `decode` (TPOT: one forward per token, `on_decode_step`), `commit` (end-to-end only). Concepts,
phases and how to add a policy: docs/design.md#sharing-policies.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import ClassVar, Generic

import torch

from kvprof.claims.types import Published
from kvprof.errors import KvprofError
from kvprof.kernels.transformers_attention import use_lora_attention
from kvprof.model.buffers import KVBuffer, Workspace
from kvprof.model.runtime import KV, ChunkForward, Runtime
from kvprof.policies.moved import PieceForward, SpanKV, SpanStore, extend_over_moved
from kvprof.policies.options import Option, variant_label
from kvprof.policies.state_checkpoints import keeps_call_end
from kvprof.policies.turns import (
    Chunk,
    Context,
    ContextT,
    Decoded,
    Prefill,
    TurnRequest,
    TurnResult,
    attended_kv,
    lora_context,
    reuse_counts,
)
from kvprof.profiling import CALL_PEAKS, CudaPeak, TouchedHeap, clock
from kvprof.traces.reuse import MovedSpan


class SharingPolicy(ABC, Generic[ContextT]):
    """Base class of every sharing policy (see module docstring)."""

    name: ClassVar[str]
    family: ClassVar[str]
    paper: ClassVar[str]
    approximate: ClassVar[bool]
    modes: ClassVar[tuple[str, ...]] = ("lora",)
    options: ClassVar[dict[str, Option]] = {}
    published: ClassVar[tuple[Published, ...]] = ()
    serves_others: ClassVar[bool] = True  # False: an agent only ever attends to caches it computed itself
    # False: the policy keeps state across trajectories (an online anchor pool that `reset` keeps), so a replay must
    # run its trajectories in order in one process; sharding them would change its results. Per variant:
    # `independent_of_trajectories`.
    trajectory_independent: ClassVar[bool] = True
    # The attributes holding the current trajectory's stored state (what `reset` creates, not what it keeps): what
    # `snapshot` copies and `restore` puts back when a later turn returns to an earlier branch of the trajectory.
    timeline_state: ClassVar[tuple[str, ...]] = ()
    # True: the policy serves a turn's moved spans from the K/V earlier turns held, re-aligned (its `assemble` calls
    # `extend_over_moved`); False: it computes them as new tokens (`kvprof.policies.moved`).
    moves_spans: ClassVar[bool] = False
    # The setting in which the policy must reproduce the dense run, which `kvprof.replay.self_check` replays on the
    # user's model first: "recompute all" (its `ratio` option at 1), "one agent" (every turn acted by one agent, no span
    # moved), or None (no such setting).
    exact_setting: ClassVar[str | None] = None
    # True: the policy stacks every layer's K/V into one tensor (anchor pools, low-rank stores, per-head queries of
    # one head size), so it needs every attention layer's cache of one shape (not Gemma 4's local and global layers)
    stacks_layers: ClassVar[bool] = False
    # True: the policy replays hybrid models, resuming recurrent states only where the checkpoint rule kept them
    # (`kvprof.policies.state_checkpoints`); False: refused for them (`check_recurrent`)
    runs_on_hybrids: ClassVar[bool] = False

    def __init__(self, runtime: Runtime, **options: str):
        self.runtime = runtime
        self.moved_now: tuple[MovedSpan, ...] = ()  # the moved spans of the turn being served
        self.request_now = TurnRequest("", [])  # the call being served
        self.workspace = Workspace()  # a call's views and copies (released when the call ends)
        self.touched_heap = TouchedHeap()  # the CPU heap kept ready for the timed prefills (as large as they fault)
        self.forget_spans()
        unknown = set(options) - set(self.options)
        if unknown:
            raise KvprofError(
                f"policy {self.name} has no option {', '.join(sorted(unknown))}; its options are "
                f"{', '.join(self.options) or 'none'}."
            )
        self.values = {key: options.get(key, option.default) for key, option in self.options.items()}
        self.settings = {key: option.check(self.name, key, self.values[key]) for key, option in self.options.items()}
        self.check(runtime)
        self.reset()

    @property
    def label(self) -> str:
        return variant_label(self.name, self.options, self.values)

    @property
    def needs_hidden(self) -> bool:
        """Whether the turn's forwards capture their attention inputs X (`ChunkForward.hidden`) for the hooks."""
        return False

    def notes(self) -> list[str]:
        """What a reader of the results must know about how it ran (e.g. a profile's origin); printed with the
        tables. None by default."""
        return []

    def check(self, runtime: Runtime) -> None:
        """Refuse a setting this policy cannot replay (mode, adapters)."""
        mode = runtime.agents.spec.mode
        if mode not in self.modes:
            raise KvprofError(
                f"policy {self.name} replays {' or '.join(self.modes)}-mode traces (agents that differ "
                f"by {'adapter' if 'lora' in self.modes else 'prompt'}), not {mode} mode; pick another "
                "policy or trace."
            )
        self.check_recurrent(runtime)
        if self.stacks_layers and not runtime.uniform_cache:
            shapes = sorted({shape for i, shape in enumerate(runtime.cache_shapes) if i not in runtime.recurrent})
            raise KvprofError(
                f"policy {self.name} keeps every layer's cache in one shape, and model "
                f"{runtime.agents.base_model.config.name_or_path!r} has attention layers of different shapes "
                f"({' and '.join(f'{h} KV heads of {k}' for h, k, _ in shapes)} channels); pick another policy."
            )

    def check_recurrent(self, runtime: Runtime) -> None:
        """Refuse a hybrid model (`kvprof.model.recurrent`) for a policy that does not run on one."""
        if runtime.recurrent and not self.runs_on_hybrids:
            index, mixer = next(iter(runtime.recurrent.items()))
            raise KvprofError(
                f"policy {self.name} moves, corrects or recomputes per-token K/V, and layer {index} of model "
                f"{runtime.agents.base_model.config.name_or_path!r} is a recurrent layer ({mixer}), whose state after "
                "a prefix summarises that exact sequence and has no per-token entries; on hybrid models replay "
                "nonshared, fullshared or alorashared."
            )

    @classmethod
    def independent_of_trajectories(cls, options: dict[str, str]) -> bool:
        """Whether this variant replays each trajectory alone (shardable): `trajectory_independent` unless an option
        changes it."""
        return cls.trajectory_independent

    @abstractmethod
    def reset(self) -> None:
        """Forget the trajectory's state (state kept across trajectories survives)."""

    @abstractmethod
    def assemble(self, agent: str, shared: list[int]) -> ContextT:
        """Build the context for `agent` whose input is prefix + `shared`; must not change stored state."""

    @abstractmethod
    def commit(self, chunk: Chunk[ContextT]) -> float:
        """Keep what the policy stores of the turn; returns the analytic FLOPs that took (0 if none)."""

    @abstractmethod
    def live_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor the policy keeps between turns, by structure name."""

    @abstractmethod
    def analytic_bytes(self) -> dict[str, int]:
        """Bytes of each structure computed from token counts and shapes (must equal `live_tensors`' bytes)."""

    @abstractmethod
    def truncate(self, keep: int) -> None:
        """Forget every stored token at timeline index ≥ `keep` (the next input leaves the timeline there); storage
        may stay allocated."""

    def snapshot(self) -> dict[str, object]:
        """A copy of the trajectory's stored state (`timeline_state`; tensors cloned), for `restore`."""
        with torch.inference_mode():
            return copy.deepcopy(
                {name: getattr(self, name) for name in self.timeline_state}, {id(self.runtime): self.runtime}
            )

    def restore(self, state: dict[str, object]) -> None:
        """Return to a `snapshot` (copied again: the snapshot stays valid for another return)."""
        with torch.inference_mode():
            for name, value in copy.deepcopy(state, {id(self.runtime): self.runtime}).items():
                setattr(self, name, value)

    def forget_spans(self) -> None:
        """A new trajectory: drop the K/V kept for moved spans."""
        self.span_store = SpanStore()  # K/V kept of earlier turns for moved spans (`keep_span_source`)
        # the last turn's agent, prefix length, shared input length and cache (until the timeline finishes the turn)
        self.last_turn: tuple[str, int, int, list[KV]] | None = None

    def keep_span_source(self, turn: int, lo: int, hi: int) -> None:
        """Keep tokens [lo, hi) of turn `turn`'s shared sequence for later moved spans (no-op unless `moves_spans`)."""
        if self.moves_spans and self.last_turn is not None:
            agent, prefix_len, inputs, kv = self.last_turn
            self.span_store.keep(turn, prefix_len, kv, lo, hi, agent, inputs)

    def release_last_turn(self) -> None:
        """Let go of the last turn's cache: a timeline calls this once it has kept what later turns move of it."""
        self.last_turn = None

    def extend_context(
        self,
        agent: str,
        shared: list[int],
        context: Context,
        placeholders: bool = False,
        on_piece: Callable[[int, ChunkForward], None] | None = None,
        span_kv: SpanKV | None = None,
        forward: PieceForward | None = None,
    ) -> None:
        """Extend `context` over the moved spans past its reused tokens (`kvprof.policies.moved.extend_over_moved`):
        moved K/V re-aligned, new tokens between them computed by `agent` (or zeros with `placeholders`)."""
        spans = [span for span in self.moved_now if span.begin >= context.reused]
        if not spans:
            return
        cache = self.runtime.cache_over(context.kv, context.buffers, self.with_output(len(shared) - context.reused))
        done = extend_over_moved(
            self.runtime,
            agent,
            shared,
            cache,
            context.reused,
            spans,
            self.span_store,
            placeholders,
            on_piece,
            span_kv,
            forward,
        )
        context.buffers = self.runtime.buffers_of(cache)
        length = cache.get_seq_length()
        context.kv = [buffer.view(length) for buffer in context.buffers]
        context.extended, context.moved = done.covered, done.moved
        context.moved_spans, context.placeholders = done.spans, done.placeholders
        context.extra_prefill += done.computed
        context.extra_flops += done.flops

    def stored_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor the policy keeps between turns: `live_tensors` and the K/V kept for moved spans."""
        kept = self.span_store.tensors()
        return self.live_tensors() | ({"moved spans": kept} if kept else {})

    def span_store_bytes(self) -> dict[str, int]:
        """The K/V kept for moved spans, as a structure of the policy's memory (none when empty)."""
        tokens = self.span_store.tokens()
        low_rank = sum(t.numel() * t.element_size() for t in self.span_store.low_rank_tensors())
        return {"moved spans": self.runtime.kv_bytes_per_token * tokens + low_rank} if tokens else {}

    def prefix_context(self, agent: str) -> tuple[list[KV], float]:
        """The agent's private prefix computed alone at positions 0.. (exact: nothing precedes it), and its FLOPs."""
        prefix = self.runtime.prefix(agent)
        if not prefix:
            return self.runtime.empty_kv(), 0.0
        cache = self.runtime.cache_from(self.runtime.empty_kv(), len(prefix))
        out = self.runtime.forward(agent, prefix, cache, 0, last_logits_only=True)
        return self.runtime.kv_of(out.cache), self.runtime.flops(len(prefix), 0)

    def prefix_buffers(self, agent: str, spare: int = 0) -> tuple[list[KVBuffer], float]:
        """`prefix_context` as the buffers that hold it, with room for `spare` tokens after it (a hybrid's recurrent
        layers: their state after it)."""
        prefix = self.runtime.prefix(agent)
        cache = self.runtime.cache_from(self.runtime.empty_kv(), len(prefix) + spare)
        if prefix:
            self.runtime.forward(agent, prefix, cache, 0, last_logits_only=True)
        return self.runtime.buffers_of(cache), self.runtime.flops(len(prefix), 0)

    def adapter_rows(self, agent: str) -> list[str] | None:
        """Per-row adapters for a batched forward (None: one row with `agent`'s adapter)."""
        return None

    def on_prefill(self, agent: str, context: ContextT, forward: ChunkForward, start: int) -> float:
        """Serving's work on the chunk during prefill (TTFT), kept in `context`; its analytic FLOPs.

        `forward.hidden`: per layer (B, n, d_model) when `needs_hidden`; `start`: the chunk's first timeline index."""
        return 0.0

    def on_decode_step(self, agent: str, context: ContextT, forward: ChunkForward, start: int) -> float:
        """`on_prefill` for one decode step (the token at timeline index `start`)."""
        return 0.0

    # ---------------------------------------------------------------------------------------------- the turn

    def run_turn(self, request: TurnRequest, repeats: int = 1, timed: list[float] | None = None) -> TurnResult:
        """Serve one agent call: `prefill` (TTFT, median of `repeats` after a warm-up), `decode`, `commit`.

        `timed`: this turn's prefills timed beforehand (`time_prefill`, interleaved with other runs, warmed up); the
        call then times its own prefill once and the TTFT is the median of all. Teacher-forced on
        `request.output_ids` (greedy when None); in inference mode, with kvprof's attention
        (`Runtime.kvprof_attention`)."""
        with self._serving(request):
            return self._run_turn(request, repeats, timed)

    def time_prefill(self, request: TurnRequest) -> float:
        """One timed prefill of `request` as `run_turn` serves it, nothing decoded or stored: seconds."""
        with self._serving(request):
            shared = self._turn_input(request)
            self.make_room(request.agent, shared)
            return self.prefill(request.agent, shared).seconds

    def make_room(self, agent: str, shared: list[int]) -> None:
        """Before `agent`'s call over `shared` (its input after its private prefix), untimed: grow the stores its
        forwards and `commit` extend in place to exactly what they will hold once that input and the call's output
        are in (`with_output(len(shared))` tokens of the shared timeline; `KVBuffer.make_room`), so no store grows (a
        copy of all it holds) inside a timed phase and none keeps spare room between turns — as a paged engine
        allocates a call's blocks (a greedy call that stops early leaves its unused `max_new_tokens` room). Default:
        nothing."""

    @staticmethod
    def _output_length(request: TurnRequest) -> int:
        """Tokens the call will decode at most: its teacher-forced output, or `max_new_tokens`."""
        return len(request.output_ids) if request.output_ids is not None else request.max_new_tokens

    def with_output(self, tokens: int) -> int:
        """`tokens` and the slots the current call's output will take: the room a buffer made during the call needs
        so that neither the chunk nor decoding grows it inside a timed phase."""
        return tokens + self._output_length(self.request_now)

    @contextlib.contextmanager
    def _serving(self, request: TurnRequest) -> Iterator[None]:
        """Inside: inference mode, kvprof's attention (`Runtime.kvprof_attention`), `request`'s serving call; after
        it, the call's workspace released. Its start marks the peaks a plan's probe records (`CallPeaks`)."""
        CALL_PEAKS.mark()
        with torch.inference_mode(), self.runtime.kvprof_attention():
            with self.runtime.serving_call(request.agent, request.input_ids):
                try:
                    yield
                finally:
                    self.workspace.release()

    def _turn_input(self, request: TurnRequest) -> list[int]:
        """The request's input after the agent's prefix; the turn's moved spans made current."""
        shared = self._shared_input(request)
        self.moved_now = request.moved if self.moves_spans else ()
        self.request_now = request
        return shared

    def _run_turn(self, request: TurnRequest, repeats: int, timed: list[float] | None) -> TurnResult:
        runtime = self.runtime
        shared = self._turn_input(request)
        self.make_room(request.agent, shared)
        stored_before = sum(self.analytic_bytes().values()) + sum(self.span_store_bytes().values())
        meter = CudaPeak(runtime.device, stored_before)
        first = self.prefill(request.agent, shared, repeats if timed is None else 1)
        if timed is not None:
            first.seconds = statistics.median([*timed, first.seconds])
        decoded = self.decode(request, first, warm_up=repeats > 1)
        commit_started = clock(runtime.device)
        context = first.context
        sequence_kv = runtime.kv_of(decoded.last.cache)
        prefix_len = len(request.input_ids) - len(shared)
        self.last_turn = (request.agent, prefix_len, len(shared), sequence_kv) if self.moves_spans else None
        commit_flops = self.commit(
            Chunk(
                agent=request.agent,
                start=context.covered,
                ids=shared[context.covered :] + decoded.output_ids,
                kv=sequence_kv,
                context=context,
                buffers=runtime.buffers_of(decoded.last.cache),
            )
        )
        commit_s = clock(runtime.device) - commit_started
        chunk_len = len(shared) - context.covered
        rows = len(self.adapter_rows(request.agent) or [None])
        ttft_flops = rows * runtime.flops(chunk_len, first.start) + context.extra_flops + first.flops
        decode_flops = rows * runtime.flops(len(decoded.output_ids), len(request.input_ids)) + decoded.flops
        turn_cache = rows * runtime.kv_bytes(len(request.input_ids) + len(decoded.output_ids))
        hidden = runtime.hidden_bytes_per_token * rows * chunk_len if self.needs_hidden else 0
        return TurnResult(
            agent=request.agent,
            output_ids=decoded.output_ids,
            logits=decoded.logits,
            input_kv=first.input_kv,
            prefix_len=first.start - context.covered,
            reused=context.reused,
            adapter_free=context.adapter_free,
            prefilled=chunk_len + context.extra_prefill,
            flops=ttft_flops + decode_flops + commit_flops,
            ttft_flops=ttft_flops,
            ttft_s=first.seconds,
            decode_s=decoded.seconds,
            decode_steps=decoded.steps,
            latency_s=first.seconds + decoded.seconds + commit_s,
            memory=self.analytic_bytes() | self.span_store_bytes(),
            stored_before_bytes=stored_before,
            transient_bytes=turn_cache + hidden + context.working_bytes,
            cuda_peak_bytes=meter.peak(),
            cuda_allocated_bytes=meter.allocated(),
            **reuse_counts(context),
        )

    def _shared_input(self, request: TurnRequest) -> list[int]:
        """The request's input after the agent's private prefix (refusing inputs that do not start with it)."""
        prefix = self.runtime.prefix(request.agent)
        if request.input_ids[: len(prefix)] != prefix:
            raise KvprofError(
                f"agent {request.agent!r}'s input does not start with its role prompt; the trace was "
                "not captured with this workflow — pass the matching --workflow."
            )
        shared = request.input_ids[len(prefix) :]
        if not shared:
            raise KvprofError(
                f"agent {request.agent!r} has an empty input after its role prompt; the trace is malformed."
            )
        return shared

    @torch.inference_mode()
    def prefill(self, agent: str, shared: list[int], repeats: int = 1) -> Prefill[ContextT]:
        """Assemble the context and run the chunk (after `Context.refreshed` tokens) over it; timed."""
        timings, context, forward, start, flops = [], None, None, 0, 0.0
        for _ in range(repeats + 1 if repeats > 1 else 1):
            with self.touched_heap.section():
                started = clock(self.runtime.device)
                context = self.assemble(agent, shared)
                if context.covered >= len(shared):
                    raise RuntimeError(f"{self.name} left no token of the input to compute")
                begin = context.covered - context.refreshed
                start = len(self.runtime.prefix(agent)) + context.covered
                ids = shared[begin:]
                room = self.with_output(len(ids))
                cache = self.runtime.cache_over(context.kv, context.buffers, room, context.rewrite)
                forward = self._prefill_forward(agent, ids, cache, start - context.refreshed, context)
                flops = self.on_prefill(agent, context, forward, begin)
                timings.append(clock(self.runtime.device) - started)
        assert context is not None and forward is not None
        return Prefill(
            context=context,
            forward=forward,
            input_kv=attended_kv(self.runtime.kv_of(forward.cache), context, start - context.covered),
            start=start,
            seconds=statistics.median(timings[1:] if repeats > 1 else timings),
            flops=flops,
        )

    @torch.inference_mode()
    def decode(self, request: TurnRequest, first: Prefill[ContextT], warm_up: bool = False) -> Decoded:
        """One forward per output token over the growing cache: teacher-forced on `request.output_ids`, or greedy
        with transformers' stopping rules; the last forward writes the last token's K/V. `warm_up`: the first step
        runs once untimed first (Triton compilation, first allocations out of TPOT)."""
        runtime, agent, context = self.runtime, request.agent, first.context
        forced = request.output_ids
        outputs: list[int] = []
        rows = [first.forward.logits[0, -1]]
        last, flops = first.forward, 0.0
        shared_len = len(request.input_ids) - (first.start - context.covered)
        if warm_up and (forced is None or forced):
            token = forced[0] if forced is not None else int(rows[0].argmax())
            states = runtime.states_of(last.cache)
            self._forward(agent, [token], last.cache, len(request.input_ids), context)
            runtime.undo_step(last.cache, states)
        started = clock(runtime.device)
        while forced is None or len(outputs) < len(forced):
            outputs.append(forced[len(outputs)] if forced is not None else int(rows[-1].argmax()))
            position = len(request.input_ids) + len(outputs) - 1
            last = self._forward(agent, outputs[-1:], last.cache, position, context)
            if position + 1 in context.state_marks or self._ends_greedy_call(request, context, first, outputs, last):
                context.kept_states[position + 1] = runtime.states_of(last.cache)
            flops += self.on_decode_step(agent, context, last, shared_len + len(outputs) - 1)
            done = len(outputs) == len(forced) if forced is not None else runtime.stops(outputs, request.max_new_tokens)
            if done:
                break
            rows.append(last.logits[0, -1])
        seconds = clock(runtime.device) - started
        logits = torch.stack(rows[: len(outputs)]) if outputs else first.forward.logits[0, :0]
        return Decoded(output_ids=outputs, logits=logits, last=last, seconds=seconds, steps=len(outputs), flops=flops)

    def _prefill_forward(self, agent: str, ids: list[int], cache, start: int, context: Context) -> ChunkForward:
        """The chunk's forward at positions start..; on a hybrid, split where the turn keeps its recurrent states
        (`Context.state_marks`), each kept in `context.kept_states` (as an engine aligns its prefill chunks to them)."""
        end = start + len(ids)
        for mark in sorted(mark for mark in context.state_marks if start < mark < end):
            done = mark - start
            self._forward(agent, ids[:done], cache, start, context, prefill=True)
            context.kept_states[mark] = self.runtime.states_of(cache)
            ids, start = ids[done:], mark
        forward = self._forward(agent, ids, cache, start, context, prefill=True)
        if end in context.state_marks:
            context.kept_states[end] = self.runtime.states_of(forward.cache)
        return forward

    def _ends_greedy_call(
        self, request: TurnRequest, context: Context, first: Prefill, outputs: list[int], last: ChunkForward
    ) -> bool:
        """Whether a greedy call's next id (the argmax of `last`) is its last, where the checkpoint rule keeps the
        states of a call's end: an engine never computes the last id, so the end is here (a teacher-forced call's
        marks already hold it)."""
        rule = self.runtime.checkpoint_rule
        if rule is None or request.output_ids is not None or not context.state_marks:
            return False
        upcoming = [*outputs, int(last.logits[0, -1].argmax())]
        if self.runtime.stops(outputs, request.max_new_tokens) or not self.runtime.stops(
            upcoming, request.max_new_tokens
        ):
            return False
        resumed = first.start - context.covered + context.reused
        return keeps_call_end(rule, request, resumed, len(request.input_ids) + len(upcoming))

    def _forward(
        self, agent: str, ids: list[int], cache, start: int, context: Context, prefill: bool = False
    ) -> ChunkForward:
        rows = self.adapter_rows(agent)
        tokens = torch.tensor([ids] * (len(rows) if rows else 1), device=self.runtime.device)
        attention: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if context.lora_values is not None:
            attention = use_lora_attention(lora_context(context, tokens.shape[0], cache.get_seq_length() + len(ids)))
        with attention:
            return self.runtime.forward(
                agent, tokens, cache, start, capture=self.needs_hidden, adapter_names=rows, last_logits_only=prefill
            )


def tensor_bytes(tensors: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Actual bytes of each structure's tensors."""
    return {name: sum(t.numel() * t.element_size() for t in group) for name, group in tensors.items()}
