"""Model execution for replay: one forward of a chunk over a given cache, greedy decoding, cache construction.

A `Runtime` wraps an `AgentSet` and knows the shapes policies need (layers, H_kv, D, rotary tables, LoRA splits,
each agent's private prefix). Caches are `BufferCache`s (`kvprof.model.buffers`) over per-layer (K, V)
(B, H_kv, L, D), keys post-RoPE.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from kvprof.errors import KvprofError
from kvprof.kernels.attention import EXPAND, KERNEL, SHORT, LoraAttention, values_as_stored_pay
from kvprof.kernels.transformers_attention import register_lora_attention
from kvprof.model.agents import AgentSet
from kvprof.model.architecture import decoder_layers
from kvprof.model.buffers import BufferCache, BufferLayer, KVBuffer, Rewrite
from kvprof.model.lora import HiddenTap, LayerSplit, ProjectionNorm, invocation_tokens, key_norms, layer_splits
from kvprof.model.recurrent import LayerState, StateBuffer, StateLayer
from kvprof.traces.chat import ChatFormat, Message
from kvprof.traces.checkpoints import (
    PREFILL_CHUNK,
    SGLANG_TRACK_INTERVAL,
    CheckpointRule,
    checkpoint_rule,
    vllm_hybrid_block_size,
)
from kvprof.traces.reuse import DEFAULT_MATCHING, SpanMatching, last_occurrence
from kvprof.traces.stopping import StopStrings, end_ids
from kvprof.traces.tasks import Task, private_prompt
from kvprof.traces.trace import Trajectory

KV = tuple[torch.Tensor, torch.Tensor]


# SDPA's backends with no per-shape set-up. cuDNN's builds an execution plan for each new sequence length: on an H200
# (torch 2.11, cuDNN 9.19) a decode step over 4k keys took 35 ms the first time a length was seen and 0.07 ms after,
# against 0.05 ms for FlashAttention's kernel, which needs no plan. A replay's decode meets a new length every step,
# and whichever run met a length first would pay its plan.
PER_SHAPE_FREE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def per_shape_free_sdpa(device: torch.device) -> contextlib.AbstractContextManager:
    """On CUDA, SDPA without cuDNN's backend (`PER_SHAPE_FREE_BACKENDS`), so timings measure attention, not plan
    building; elsewhere nothing (the CPU kernels have no per-shape set-up)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(PER_SHAPE_FREE_BACKENDS)


@dataclass
class ChunkForward:
    """One forward over n tokens: logits (B, n, vocab) fp32, the cache after it, and when captured
    (`kvprof.model.lora.HiddenTap`) per layer: hidden X and residual (B, n, d_model), base {"key"|"value":
    (B, n, H_kv·D)} (before key norm and RoPE), down {"key"|"value": {agent: (B_a, n, r)}}."""

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
    """Forwards attend through kvprof's "kvprof_lora" attention (sdpa, unmasked chunks after a cache). How low-rank
    policies attend their rank-r values, `lora_attention`: "kernel" passes V_base and V_lr to every forward
    (Flash-LoRA-Attention), "expand" expanded views, "short" V_base and V_lr where that pays (`values_as_stored`).

    `fast_paths=False`: the plain path the tests hold the fast one to (fresh copied caches, the model's own
    attention); `span_matching`: how moved spans are found (`kvprof.traces.reuse.SpanMatching`)."""

    def __init__(
        self,
        agents: AgentSet,
        lora_attention: LoraAttention = EXPAND,
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
        """Per layer k_proj / v_proj base and adapter weights (`kvprof.model.lora.layer_splits`), read lazily."""
        return layer_splits(self.agents) if self.agents.spec.mode == "lora" else []

    @functools.cached_property
    def key_norms(self) -> list[ProjectionNorm] | None:
        """Per layer the model's key norm before RoPE (`kvprof.model.lora.key_norms`), None for a model without one."""
        return key_norms(self.agents.base_model)

    def require_split(self) -> None:
        """Read `splits` and `key_norms` now, refusing a model whose cache does not split (low-rank `check`s)."""
        _ = self.splits, self.key_norms

    def rope_tables(self, length: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of layer `layer`'s RoPE at 0..length−1, each (length, R) fp32, scaled; tabulated once, sliced."""
        rope = self.ropes[layer]
        tables = self._rope_tables.get(id(rope))
        if tables is None or tables[0].shape[0] < length:
            size = max(length, 2 * tables[0].shape[0] if tables is not None else length)
            tables = self._rope_tables[id(rope)] = rope.tables(torch.arange(size, device=self.device))
        cos, sin = tables
        return cos[:length], sin[:length]

    def held_length(self, layer: int, length: int) -> int:
        """Of `length` tokens, how many layer `layer` keeps for the next (`LayerKind.held`): all, the last W
        (sliding), or the current chunk's (chunked)."""
        return self.agents.layer_kinds[layer].held(length)

    def held(self, buffers: list[KVBuffer], length: int) -> list[torch.Tensor]:
        """Per layer K, V of its `held_length` last tokens of `length`, as an engine holds them."""
        tensors = []
        for index, buffer in enumerate(buffers):
            if isinstance(buffer, StateBuffer):
                continue
            keep = self.held_length(index, length)
            tensors += [t.narrow(2, length - keep, keep) for t in buffer.view(length)]
        return tensors

    def layer_token_bytes(self, layer: int) -> int:
        """Bytes one token's K and V take in layer `layer` (`LayerKind.token_bytes`): H_kv·(D_k + D_v)·itemsize (0
        in a recurrent layer)."""
        return self.agents.layer_kinds[layer].token_bytes(self.cache_shapes[layer], self.dtype.itemsize)

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of a `tokens`-long cache as an engine holds it (`held`; recurrent states apart)."""
        return sum(self.layer_token_bytes(layer) * self.held_length(layer, tokens) for layer in range(self.num_layers))

    @property
    def kv_bytes_per_token(self) -> int:
        """Σ over layers of `layer_token_bytes` (MLA: latent and RoPE key)."""
        return sum(self.layer_token_bytes(layer) for layer in range(self.num_layers))

    @functools.cached_property
    def state_bytes(self) -> int:
        """Bytes of a hybrid's recurrent states per sequence, any length (measured; 0 without)."""
        if not self.recurrent:
            return 0
        cache = self.cache_from(self.empty_kv())
        with torch.inference_mode(), self.agents.activate(None):
            self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device), cache=cache, use_cache=True)
        return sum(t.numel() * t.element_size() for b in self.states_of(cache).values() for t in b.tensors())

    @functools.cached_property
    def checkpoint_rule(self) -> CheckpointRule | None:
        """Where a hybrid's recurrent states are kept (`span_matching.checkpoints`, `kvprof.traces.checkpoints`),
        prefill steps of at most `PREFILL_CHUNK` ids as `kvprof inspect` serves them; vLLM's block size derived from
        one recurrent layer's state and one attention layer's K/V per token (aligned to `span_matching.kernel_block`)
        unless given, its retention `span_matching.checkpoint_retention`. None without recurrent layers."""
        if not self.recurrent:
            return None
        matching = self.span_matching
        name, interval = matching.checkpoints, matching.checkpoint_interval
        if name == "vllm" and interval is None:
            interval = vllm_hybrid_block_size(*self.hybrid_page_sizes, matching.kernel_block)
        return checkpoint_rule(
            name,
            interval,
            interval or SGLANG_TRACK_INTERVAL,
            budget=PREFILL_CHUNK,
            retention=matching.checkpoint_retention,
        )

    @property
    def hybrid_page_sizes(self) -> tuple[int, int]:
        """What vLLM's hybrid block size comes from (`vllm_hybrid_block_size`): one recurrent layer's state (a
        sequence's states over the recurrent layers, measured) and one attention layer's K/V per token, in bytes."""
        attention = next(index for index in range(self.num_layers) if index not in self.recurrent)
        return self.state_bytes // len(self.recurrent), self.layer_token_bytes(attention)

    @staticmethod
    def states_of(cache: BufferCache) -> dict[int, StateBuffer]:
        """Copies of a cache's recurrent layers' states now, by layer index (`buffers_of`'s; used by
        `kvprof.policies.state_checkpoints`)."""
        return Runtime.state_buffers(Runtime.buffers_of(cache))

    @staticmethod
    def undo_step(cache: DynamicCache, states: dict[int, StateBuffer]) -> None:
        """Forget a cache's last token: attention layers cropped, recurrent layers back to `states` (`states_of`
        before the step: a state cannot crop)."""
        for index, layer in enumerate(cache.layers):
            if index in states:
                cache.layers[index] = StateLayer(states[index], states[index].length)
            else:
                layer.crop(-1)

    @staticmethod
    def state_buffers(buffers: list[KVBuffer]) -> dict[int, StateBuffer]:
        """The recurrent layers' `StateBuffer`s among a cache's buffers, by layer index."""
        return {index: buffer for index, buffer in enumerate(buffers) if isinstance(buffer, StateBuffer)}

    @property
    def hidden_bytes_per_token(self) -> int:
        """Bytes of one token's captured attention inputs X over all layers: layers·d_model·itemsize."""
        return self.num_layers * self.hidden_size * self.dtype.itemsize

    def _role_prompt_ids(self, prompt: str) -> list[int]:
        """A role prompt's tokens as calls start: alone, or as the chat template's system message."""
        template = self.agents.spec.chat_template
        if template is None:
            return self.agents.tokenizer.encode(prompt, add_special_tokens=False)
        (system,), _ = ChatFormat(self.agents.tokenizer, template).spans([Message("system", prompt)])
        return system

    def prefix(self, agent: str) -> list[int]:
        """The agent's private prefix in the served trajectory (role prompt, then the task's private text)."""
        return self.prefixes.get(agent, [])

    def serve_trajectory(self, traj: Trajectory) -> None:
        """Serve `traj`'s captured private prefixes (`Trajectory.served_prefixes`); call before policies' `reset`."""
        self.prefixes = traj.served_prefixes(self.role_prefixes) if self.role_prefixes else {}

    def serve_task(self, task: Task) -> None:
        """Serve `task`'s private prefixes for an online re-run, as the workflow lays them out."""
        spec = self.agents.spec
        self.prefixes = {
            name: self._role_prompt_ids(private_prompt(spec, task, name)) if task.private.get(name) else ids
            for name, ids in self.role_prefixes.items()
        }

    @contextlib.contextmanager
    def serving_call(self, agent: str, input_ids: list[int]) -> Iterator[None]:
        """Inside, `agent`'s forwards belong to its call on `input_ids`: an aLoRA acts from the last invocation on,
        in every forward (decode steps included), as peft's `generate`; never without one."""
        if agent not in self.invocations:
            yield
            return
        self.call = (agent, last_occurrence(input_ids, self.invocations[agent]))
        try:
            yield
        finally:
            self.call = None

    def adapter_acts_from(self, agent: str) -> int | None:
        """Within `serving_call`: the input position (prefix included) from which `agent`'s aLoRA acts; None for
        plain LoRA or a call without the invocation."""
        if self.call is None or self.call[0] != agent:
            return None
        return self.call[1]

    def alora_offsets(self, rows: list[str | None], start: int, count: int) -> list[int | None] | None:
        """peft's `alora_offsets` for a forward of `count` tokens at start..: per row, the last tokens the adapter
        acts on; None outside the served call."""
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
        """A cache of copies of per-layer (K, V) (B, H_kv, L, D) with room for `spare` more (appends in place);
        recurrent layers start from `states`."""
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
        """A cache with context `kv` (per layer (B, H_kv, L, D)): in place over `buffers` when they hold it, else a
        copy (`cache_from`)."""
        if buffers is None or not self.fast_paths:
            return self.cache_from(kv, spare, rewrite, buffers)
        return self.buffer_cache(buffers, int(kv[0][0].shape[2]), rewrite)

    def buffer_cache(self, buffers: list[KVBuffer], length: int, rewrite: Rewrite | None = None) -> BufferCache:
        """A cache over `buffers` with `length` context tokens, appended in place."""
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
        """Tokens a cache holds, as its attention layers count them (not a hybrid's first layer)."""
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
        """Run `ids` (n, or (B, n)) at positions start.. over `cache` with `agent`'s adapter (None: off) or one per
        row (`adapter_names`, "__base__": none); `last_logits_only`: logits (B, 1, vocab)."""
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
                scope.enter_context(per_shape_free_sdpa(self.device))
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

    def values_as_stored(self, tokens: int, keys: int) -> bool:
        """Whether a low-rank view of `keys` cached tokens, for a forward of `tokens` new tokens, keeps V_base and
        hands V_lr to the attention (Flash-LoRA-Attention) instead of expanding the values: always with "kernel";
        with "short", where kvprof's attention runs (`kvprof_attention`) and it pays (`values_as_stored_pay`)."""
        if self.lora_attention != SHORT:
            return self.lora_attention == KERNEL
        previous = self.agents.base_model.config._attn_implementation
        kvprof_attends = previous == self.attention or self._switches_to_kvprof(previous)
        group = self.query_heads // self.kv_heads
        return kvprof_attends and values_as_stored_pay(group, tokens, self.value_dim, keys)

    def _switches_to_kvprof(self, previous: str) -> bool:
        """Whether `kvprof_attention` switches a model attending with `previous` to kvprof's attention:
        Flash-LoRA-Attention in every forward, or an sdpa model on the fast paths."""
        return self.lora_attention == KERNEL or (self.fast_paths and previous == "sdpa")

    @contextlib.contextmanager
    def kvprof_attention(self) -> Iterator[None]:
        """Attend through kvprof's implementation inside the block (sdpa models, or with Flash-LoRA-Attention;
        eager models and the plain path keep theirs); nested, a no-op."""
        model = self.agents.base_model
        previous = model.config._attn_implementation
        if previous == self.attention or not self._switches_to_kvprof(previous):
            yield
            return
        model.set_attn_implementation(self.attention)
        try:
            yield
        finally:
            model.set_attn_implementation(previous)

    def stops(self, new_tokens: list[int], max_new: int) -> bool:
        """Capture's stopping rules (`kvprof.traces.stopping`): an end id, a stop string, or the budget."""
        if len(new_tokens) >= max_new or new_tokens[-1] in self._end:
            return True
        return self._stop is not None and self._stop.found(new_tokens)

    def flops(self, tokens: int, context: int) -> float:
        """Analytic FLOPs of `tokens` after `context`: 2·params per token + `layer_pair_flops` per `attended` pair."""
        attention = sum(
            self.layer_pair_flops[layer] * self.attended(layer, context, tokens) for layer in range(self.num_layers)
        )
        return 2.0 * self.linear_params * tokens + attention

    @functools.cached_property
    def layer_pair_flops(self) -> list[float]:
        """Per layer FLOPs of one (query, key) pair (`LayerKind.pair_flops`): 2·H_q·(D_qk + D_v) (0 in a recurrent
        layer)."""
        layers = zip(decoder_layers(self.agents.base_model), self.agents.layer_kinds)
        return [
            kind.pair_flops(layer, index, self.cache_shapes[index], self.query_heads)
            for index, (layer, kind) in enumerate(layers)
        ]

    def attended(self, layer: int, start: int, count: int) -> int:
        """(query, key) pairs layer `layer` computes for `count` tokens at start.. (`LayerKind.attended`: causal,
        window or chunk)."""
        return self.agents.layer_kinds[layer].attended(start, count)

    def attended_at(self, layer: int, positions: torch.Tensor) -> int:
        """`attended` for tokens at cache positions `positions` (m,), not necessarily contiguous."""
        return self.agents.layer_kinds[layer].attended_at(positions)
