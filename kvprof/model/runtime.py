"""Model execution for replay: one forward of a chunk over a given cache, greedy decoding, cache construction.

A `Runtime` wraps an `AgentSet` and knows the shapes every policy needs: layers, KV heads `H_kv`, head size `D`,
the rotary frequencies, the per-layer LoRA splits (`kvprof.model.lora`), and each agent's private prefix (its role
prompt in prompt mode; empty in lora mode). Caches handed to the model are `BufferCache`s
(`kvprof.model.buffers`: transformers `DynamicCache`s that append in place) over per-layer `(K, V)` of shape
(B, H_kv, L, D); keys post-RoPE, as transformers stores them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvprof.errors import KvprofError
from kvprof.kernels.transformers_attention import register_lora_attention
from kvprof.model.agents import AgentSet
from kvprof.model.buffers import BufferCache, BufferLayer, KVBuffer, Rewrite
from kvprof.model.lora import (
    HiddenTap,
    LayerSplit,
    ProjectionNorm,
    attention_of,
    decoder_layers,
    invocation_tokens,
    key_norms,
    layer_splits,
)
from kvprof.model.recurrent import LayerState, StateBuffer, StateLayer
from kvprof.traces.chat import ChatFormat, Message
from kvprof.traces.reuse import DEFAULT_MATCHING, SpanMatching, last_occurrence
from kvprof.traces.stopping import StopStrings, end_ids
from kvprof.traces.tasks import Task, private_prompt
from kvprof.traces.trace import Trajectory

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class ChunkForward:
    """What one forward over a chunk of n tokens returns.

    logits: (B, n, vocab) fp32; hidden: per layer the attention inputs X, (B, n, d_model), when captured;
    cache: the DynamicCache after the forward (context + chunk); residual: per layer the residual stream entering
    the decoder layer, (B, n, d_model), when captured; base: per layer the cached projections' base outputs
    {"key"|"value": (B, n, H_kv·D)} (keys before any key norm and RoPE) and down: per layer {"key"|"value":
    {agent: (B_a, n, r)}}, the down-projections X·Aᵀ of the adapters that ran, when captured
    (`kvprof.model.lora.HiddenTap`).
    """

    logits: torch.Tensor
    hidden: list[torch.Tensor] | None
    cache: DynamicCache
    residual: list[torch.Tensor] | None = None
    base: list[dict[str, torch.Tensor]] | None = None
    down: list[dict[str, dict[str, torch.Tensor]]] | None = None


def _captured(state: torch.Tensor | None) -> torch.Tensor:
    assert state is not None
    return state.detach()


class Runtime:
    """See module docstring. The runtime's forwards attend through kvprof's registered attention implementation
    ("kvprof_lora", switched on for each forward and back after it): sdpa, with chunks after a cache attended
    without an explicit mask (`kvprof.kernels.chunk_attention`). With `lora_attention` the low-rank policies hand it
    V_base and V_lr instead of expanded values (Flash-LoRA-Attention: the Triton kernel on CUDA, its torch
    reference elsewhere).

    `fast_paths=False` is the plain path the tests hold the fast one to: every turn copies its context into a
    fresh cache (no in-place appends to stored buffers) and, without `lora_attention`, the model attends with its
    own implementation (sdpa with transformers' explicit masks).

    `span_matching`: how the trajectories served find their moved spans (`kvprof.traces.reuse.SpanMatching`)."""

    def __init__(
        self,
        agents: AgentSet,
        lora_attention: bool = False,
        fast_paths: bool = True,
        span_matching: SpanMatching = DEFAULT_MATCHING,
    ):
        self.agents = agents
        self.lora_attention = lora_attention
        self.fast_paths = fast_paths
        self.span_matching = span_matching
        # agent -> its Activated LoRA's invocation ids (lora mode); the call being served: agent, invocation start
        self.invocations = {
            name: tokens
            for name in agents.spec.names
            if agents.spec.mode == "lora" and (tokens := invocation_tokens(agents.model, name)) is not None
        }
        self.call: tuple[str, int | None] | None = None
        self.attention = register_lora_attention()
        self.model = agents.model
        config = agents.config
        self.num_layers = config.num_hidden_layers
        self.latent = agents.latent
        self.recurrent = (
            agents.recurrent
        )  # a hybrid's recurrent layers: a state each, no K/V (`kvprof.model.recurrent`)
        # Per layer K (B, H_kv, L, D_k) and V (B, H_kv, L, D_v): D_k = D_v = D, or an MLA layer's k_rot and latent
        self.cache_shapes = agents.cache_shapes
        attending = [shape for index, shape in enumerate(self.cache_shapes) if index not in self.recurrent]
        self.uniform_cache = len(set(attending)) == 1  # False: Gemma 4's local and global layers
        self.kv_heads, self.key_dim, self.value_dim = attending[0]  # the first attention layer's (all's if uniform)
        self.head_dim = self.key_dim  # of the queries (an MLA model's: see `layer_pair_flops`)
        self.query_heads = config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.ropes = agents.ropes
        self._rope_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(Rope) → its cos, sin
        self.tap = HiddenTap(agents.base_model)
        self.dtype = agents.base_model.dtype
        self.device = agents.device
        self.role_prefixes: dict[str, list[int]] = {}
        if agents.spec.mode == "prompt":
            self.role_prefixes = {a.name: self._role_prompt_ids(a.prompt or "") for a in agents.spec.agents}
        self.prefixes = dict(self.role_prefixes)
        self._stop = StopStrings(agents.tokenizer, agents.spec.stop) if agents.spec.stop else None
        self._end = set(end_ids(agents.tokenizer, agents.model.generation_config, agents.spec.chat_template))
        self.linear_params = sum(
            p.numel()
            for name, p in agents.base_model.named_parameters()
            if p.dim() == 2 and "embed" not in name and "lora_" not in name
        )

    @functools.cached_property
    def splits(self) -> list[LayerSplit]:
        """Per layer the base and adapter weights of k_proj and v_proj (`kvprof.model.lora.layer_splits`; lora mode,
        else empty), read when a policy first needs them: a model whose cache does not split is refused then."""
        return layer_splits(self.agents) if self.agents.spec.mode == "lora" else []

    @functools.cached_property
    def key_norms(self) -> list[ProjectionNorm] | None:
        """Per layer the model's key norm before RoPE (`kvprof.model.lora.key_norms`), None for a model without one."""
        return key_norms(self.agents.base_model)

    def require_split(self) -> None:
        """Read `splits` and `key_norms` now (they are kept), refusing in one sentence a model whose cache does not
        split into base and adapter parts: what every low-rank policy's `check` asks first."""
        _ = self.splits, self.key_norms

    def rope_tables(self, length: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of layer `layer`'s RoPE at positions 0..length−1, each (length, R) fp32
        (`kvprof.model.rope.Rope`), attention scaling included: computed once per RoPE for the longest context asked
        for and sliced after (policies that rotate a whole context every turn would otherwise recompute the same
        angles)."""
        rope = self.ropes[layer]
        tables = self._rope_tables.get(id(rope))
        if tables is None or tables[0].shape[0] < length:
            size = max(length, 2 * tables[0].shape[0] if tables is not None else length)
            tables = self._rope_tables[id(rope)] = rope.tables(torch.arange(size, device=self.device))
        cos, sin = tables
        return cos[:length], sin[:length]

    def held_length(self, layer: int, length: int) -> int:
        """Of a sequence's first `length` tokens, how many layer `layer` must keep for the next token, as an engine
        keeps them: all of them in a full-attention layer, the last W in a sliding-window layer, those of the current
        W-token chunk in a chunked one (`kvprof.model.layers.LayerKind`)."""
        kind = self.agents.layer_kinds[layer]
        if kind.window is None:
            return length
        return min(length, kind.window) if kind.attention == "sliding" else length % kind.window

    def held(self, buffers: list[KVBuffer], length: int) -> list[torch.Tensor]:
        """The K/V tensors of a sequence's cache over its first `length` tokens, as an engine holds them: per layer
        the K and V of its `held_length` last tokens (a hybrid's recurrent layers: none; their states apart)."""
        tensors = []
        for index, buffer in enumerate(buffers):
            if isinstance(buffer, StateBuffer):
                continue
            keep = self.held_length(index, length)
            tensors += [t.narrow(2, length - keep, keep) for t in buffer.view(length)]
        return tensors

    def layer_token_bytes(self, layer: int) -> int:
        """Bytes one token's K and V take in layer `layer`: H_kv·(D_k + D_v)·itemsize (0 in a recurrent layer)."""
        heads, key_dim, value_dim = self.cache_shapes[layer]
        return heads * (key_dim + value_dim) * self.dtype.itemsize

    def kv_bytes(self, tokens: int) -> int:
        """Bytes a sequence's cache of `tokens` tokens takes as an engine holds it (`held`): per layer its
        `held_length` tokens' K and V (recurrent states apart: `state_bytes`)."""
        return sum(self.layer_token_bytes(layer) * self.held_length(layer, tokens) for layer in range(self.num_layers))

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token's K and V take in the cache, over the layers: Σ H_kv·(D_k + D_v)·itemsize (an MLA model's
        latent and RoPE key, as engines hold them; a hybrid's recurrent layers hold none)."""
        return sum(self.layer_token_bytes(layer) for layer in range(self.num_layers))

    @functools.cached_property
    def state_bytes(self) -> int:
        """Bytes a hybrid model's recurrent layers hold for one sequence, whatever its length (0 without such
        layers): their states after one token, measured on the model."""
        if not self.recurrent:
            return 0
        cache = self.cache_from(self.empty_kv())
        with torch.inference_mode(), self.agents.activate(None):
            self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device), cache=cache, use_cache=True)
        return sum(
            t.numel() * t.element_size() for b in self.state_buffers(self.buffers_of(cache)) for t in b.tensors()
        )

    @staticmethod
    def state_buffers(buffers: list[KVBuffer]) -> list[StateBuffer]:
        """The recurrent layers' `StateBuffer`s among a cache's buffers."""
        return [buffer for buffer in buffers if isinstance(buffer, StateBuffer)]

    def states_cover(self, buffers: list[KVBuffer], length: int) -> bool:
        """Whether a cache's recurrent layers hold their state after exactly `length` tokens, so a context of that
        length can be continued (always, for a model without recurrent layers)."""
        return all(buffer.length == length for buffer in self.state_buffers(buffers))

    @property
    def hidden_bytes_per_token(self) -> int:
        """Bytes of one token's captured attention inputs X over all layers: layers·d_model·itemsize."""
        return self.num_layers * self.hidden_size * self.dtype.itemsize

    def _role_prompt_ids(self, prompt: str) -> list[int]:
        """A role prompt's tokens as every call starts with them: on their own, or as the chat template renders the
        system message (`kvprof.traces.chat`)."""
        template = self.agents.spec.chat_template
        if template is None:
            return self.agents.tokenizer.encode(prompt, add_special_tokens=False)
        (system,), _ = ChatFormat(self.agents.tokenizer, template).spans([Message("system", prompt)])
        return system

    def prefix(self, agent: str) -> list[int]:
        """The agent's private prefix tokens in the trajectory being served (its role prompt in prompt mode, and the
        task's private text for it when the task has one)."""
        return self.prefixes.get(agent, [])

    def serve_trajectory(self, traj: Trajectory) -> None:
        """Serve `traj`'s own private prefixes (`Trajectory.private_prefixes`), so a task whose agents read private
        text (notes, memory) after their role prompts replays with exactly the prefixes it was captured with
        (`Trajectory.served_prefixes`). Call before the policies' `reset`."""
        self.prefixes = traj.served_prefixes(self.role_prefixes) if self.role_prefixes else {}

    def serve_task(self, task: Task) -> None:
        """Serve `task`'s private prefixes for an online re-run: each role prompt followed by the task's private
        text for that agent, tokenized as the workflow lays it out."""
        spec = self.agents.spec
        self.prefixes = {
            name: self._role_prompt_ids(private_prompt(spec, task, name)) if task.private.get(name) else ids
            for name, ids in self.role_prefixes.items()
        }

    @contextlib.contextmanager
    def serving_call(self, agent: str, input_ids: list[int]) -> Iterator[None]:
        """Within the block, forwards of `agent` belong to its call on `input_ids`: an Activated LoRA acts from the
        last occurrence of its invocation ids in that input on, in every forward of the call (a decode step's one
        token included), as peft's `generate` applies it; without the invocation it never acts."""
        if agent not in self.invocations:
            yield
            return
        self.call = (agent, last_occurrence(input_ids, self.invocations[agent]))
        try:
            yield
        finally:
            self.call = None

    def adapter_acts_from(self, agent: str) -> int | None:
        """Within `serving_call`: the position in `agent`'s call input (private prefix included) from which its
        Activated LoRA acts — its K/V from there on are the adapter's, the ones before are the base model's; None for
        an adapter that acts on every token (plain LoRA) or not at all (an aLoRA call without its invocation)."""
        if self.call is None or self.call[0] != agent:
            return None
        return self.call[1]

    def alora_offsets(self, rows: list[str | None], start: int, count: int) -> list[int | None] | None:
        """peft's `alora_offsets` for a forward of `count` tokens at positions start.. with one adapter per row
        (None: disabled): for the served call's agent, how many of the forward's last tokens its adapter acts on;
        None when the forward is not the served call's (peft then looks for the invocation in its own ids)."""
        if self.call is None or self.call[0] not in rows:
            return None
        agent, invocation = self.call
        acting = 0 if invocation is None else max(0, start + count - invocation)
        return [acting if row == agent else None for row in rows]

    # ------------------------------------------------------------------------------------------ caches

    def cache_from(
        self,
        layers: list[KV],
        spare: int = 0,
        rewrite: Rewrite | None = None,
        states: list[KVBuffer] | None = None,
    ) -> BufferCache:
        """A cache holding copies of `layers[i] = (K, V)`, each (B, H_kv, L, D), in fresh buffers with room for
        `spare` more tokens; the model's appends write in place (`kvprof.model.buffers`; then `rewrite` may overwrite
        them), the inputs stay untouched. A hybrid's recurrent layers start from their `StateBuffer` in `states`
        (the buffers `layers` were read from), or from no state for an empty context."""
        length = int(layers[0][0].shape[2])
        buffers: list[KVBuffer] = []
        for index, (keys, values) in enumerate(layers):
            if index not in self.recurrent:
                buffers.append(KVBuffer.of(keys, values, spare))
            elif states is not None:
                buffers.append(states[index])
            else:
                buffers.append(StateBuffer(None, 0, keys))
        return self.buffer_cache(buffers, length, rewrite)

    def cache_over(
        self, kv: list[KV], buffers: list[KVBuffer] | None, spare: int = 0, rewrite: Rewrite | None = None
    ) -> BufferCache:
        """A cache whose context is `kv` (per layer (K, V), (B, H_kv, L, D)): when `buffers` holds them (kv are
        their first L tokens), in place — not copied, the model's appends write after them; otherwise a copy
        (`cache_from`) with room for `spare` more tokens. `rewrite`: see `kvprof.model.buffers.Rewrite`."""
        if buffers is None or not self.fast_paths:
            return self.cache_from(kv, spare, rewrite, buffers)
        return self.buffer_cache(buffers, int(kv[0][0].shape[2]), rewrite)

    def buffer_cache(self, buffers: list[KVBuffer], length: int, rewrite: Rewrite | None = None) -> BufferCache:
        """A cache over `buffers` whose first `length` tokens are the context, appended in place; MLA layers in
        kvprof's order (`kvprof.model.latent`)."""
        return BufferCache(buffers, length, rewrite, self.latent)

    @staticmethod
    def buffers_of(cache: BufferCache) -> list[KVBuffer]:
        """The buffers a cache's layers write to; for a hybrid's recurrent layer, a `StateBuffer` of its state now."""
        length = Runtime.cache_length(cache)
        return [
            layer.buffer
            if isinstance(layer, BufferLayer)
            else StateBuffer(LayerState.of(layer), length, layer.buffer.empty)
            for layer in cache.layers
        ]

    @staticmethod
    def cache_length(cache: DynamicCache) -> int:
        """Tokens a cache holds, as its attention layers count them (transformers ≥ 5.25 asks a hybrid's first layer,
        whose count starts where the cache was made, not where its restored state was)."""
        for layer in cache.layers:
            if isinstance(layer, BufferLayer):
                return layer.length
        return int(cache.get_seq_length())

    def empty_kv(self, batch: int = 1) -> list[KV]:
        """Per layer an empty K (B, H_kv, 0, D_k) and V (B, H_kv, 0, D_v), each layer's own shape."""
        return [
            tuple(
                torch.zeros(batch, heads, 0, dim, dtype=self.dtype, device=self.device) for dim in (key_dim, value_dim)
            )
            for heads, key_dim, value_dim in self.cache_shapes
        ]

    @staticmethod
    def kv_of(cache: DynamicCache) -> list[KV]:
        """Per layer (K, V) of a cache (a hybrid's recurrent layers: zero-width, `kvprof.model.recurrent`)."""
        length = Runtime.cache_length(cache)
        return [
            layer.buffer.view(length) if isinstance(layer, StateLayer) else (layer.keys, layer.values)
            for layer in cache.layers
        ]

    # ------------------------------------------------------------------------------------------ forwards

    def forward(
        self,
        agent: str | None,
        ids: list[int] | torch.Tensor,
        cache: DynamicCache,
        start: int,
        capture: bool = False,
        adapter_names: list[str] | None = None,
        last_logits_only: bool = False,
    ) -> ChunkForward:
        """Run `ids` (n tokens, or a (B, n) tensor) at positions start..start+n−1 over `cache`.

        `agent` selects the adapter (None: adapters disabled); `adapter_names` instead gives one adapter per batch
        row (peft's mixed batch, "__base__" for none). `last_logits_only` computes logits for the last position only
        (a prefill needs no more), so `logits` is then (B, 1, vocab).
        """
        tokens = ids if isinstance(ids, torch.Tensor) else torch.tensor([ids], device=self.device)
        positions = torch.arange(start, start + tokens.shape[1], device=self.device).expand(tokens.shape[0], -1)
        kwargs: dict[str, object] = {"logits_to_keep": 1} if last_logits_only else {}
        if adapter_names is not None:
            kwargs["adapter_names"] = adapter_names
        rows: list[str | None] = list(adapter_names) if adapter_names is not None else [agent] * tokens.shape[0]
        offsets = self.alora_offsets(rows, start, tokens.shape[1])
        if offsets is not None:
            kwargs["alora_offsets"] = offsets
        try:
            with contextlib.ExitStack() as scope:
                scope.enter_context(torch.inference_mode())
                scope.enter_context(self.kvprof_attention())
                if capture:
                    scope.enter_context(self.tap.capture())
                if adapter_names is None:
                    scope.enter_context(self.agents.activate(agent))
                out = self.model(input_ids=tokens, position_ids=positions, cache=cache, use_cache=True, **kwargs)
        except torch.OutOfMemoryError:
            raise KvprofError(
                f"out of memory replaying a {tokens.shape[1]}-token chunk at position {start}; "
                "replay fewer trajectories, use --dtype bfloat16, or a larger device."
            ) from None
        if not capture:
            return ChunkForward(logits=out.logits.float(), hidden=None, cache=out.cache)
        # The forward above ran every decoder layer inside tap.capture(), whose hooks set each entry.
        tap = self.tap
        return ChunkForward(
            logits=out.logits.float(),
            hidden=[_captured(h) for h in tap.hidden],
            cache=out.cache,
            residual=[_captured(h) for h in tap.residual],
            base=tap.base,
            down=tap.down,
        )

    @contextlib.contextmanager
    def kvprof_attention(self) -> Iterator[None]:
        """The model attends through kvprof's implementation inside the block, through its own outside. Without
        Flash-LoRA-Attention only a model that attends with sdpa switches (kvprof's implementation is sdpa plus the
        unmasked chunk path); one loaded with another implementation (eager, e.g. for logit soft-capping) keeps it,
        and so does the plain path. Nested inside a block that already switched (a turn switches once for all its
        forwards), it changes nothing."""
        model = self.agents.base_model
        previous = model.config._attn_implementation
        if previous == self.attention or not self.lora_attention and (not self.fast_paths or previous != "sdpa"):
            yield
            return
        model.set_attn_implementation(self.attention)
        try:
            yield
        finally:
            model.set_attn_implementation(previous)

    def stops(self, new_tokens: list[int], max_new: int) -> bool:
        """Capture's stopping rules, for greedy generation: an end id (`kvprof.traces.stopping.end_ids`: EOS, the chat
        template's end of turn), a stop string in the text of `new_tokens` (`kvprof.traces.stopping`), or the token
        budget."""
        if len(new_tokens) >= max_new or new_tokens[-1] in self._end:
            return True
        return self._stop is not None and self._stop.found(new_tokens)

    def flops(self, tokens: int, context: int) -> float:
        """Analytic forward FLOPs of `tokens` new tokens after `context` cached ones: 2·params per token in the
        linear layers plus, per attention layer, its `layer_pair_flops` per (query, key) pair it attends
        (`attended`)."""
        attention = sum(
            self.layer_pair_flops[layer] * self.attended(layer, context, tokens) for layer in range(self.num_layers)
        )
        return 2.0 * self.linear_params * tokens + attention

    @functools.cached_property
    def layer_pair_flops(self) -> list[float]:
        """Per layer the FLOPs of one (query, key) pair over the query heads: 2·H_q·(D_qk + D_v) (QKᵀ and PV; an MLA
        layer's query head is its RoPE and non-RoPE parts, its value head its own size; 0 in a recurrent layer)."""
        flops = []
        for index, layer in enumerate(decoder_layers(self.agents.base_model)):
            if index in self.recurrent:
                flops.append(0.0)
                continue
            attention = attention_of(layer, index)
            size = self.cache_shapes[index][1]
            query = getattr(attention, "qk_head_dim", None) or size
            value = getattr(attention, "v_head_dim", None) or size
            flops.append(2.0 * self.query_heads * (query + value))
        return flops

    def attended(self, layer: int, start: int, count: int) -> int:
        """(query, key) pairs layer `layer` computes for `count` tokens at positions start..: each attends every key
        up to itself, its sliding window's last W, or its chunk's so far; none in a recurrent layer."""
        kind = self.agents.layer_kinds[layer]
        if kind.attention == "recurrent":
            return 0
        first, last = start + 1, start + count  # keys seen by the first and the last token without a window
        if kind.window is None:
            return (first + last) * count // 2
        window = kind.window
        if kind.attention == "chunked":

            def upto(end: int) -> int:  # pairs of the tokens at positions 0..end−1
                return (end // window) * window * (window + 1) // 2 + (end % window) * (end % window + 1) // 2

            return upto(start + count) - upto(start)
        capped = max(0, last - max(first, window + 1) + 1)  # tokens that see a full window
        below = min(last, window) - first + 1 if first <= window else 0
        return capped * window + max(below, 0) * (first + min(last, window)) // 2

    def attended_at(self, layer: int, positions: torch.Tensor) -> int:
        """`attended` for tokens at cache positions `positions` (m,), not necessarily contiguous."""
        kind = self.agents.layer_kinds[layer]
        if kind.attention == "recurrent":
            return 0
        seen = positions + 1
        if kind.window is not None:
            seen = positions % kind.window + 1 if kind.attention == "chunked" else seen.clamp(max=kind.window)
        return int(seen.sum())
