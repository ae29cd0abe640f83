"""Selective recompute: reuse the shared cache and recompute part of it for the acting agent — the machinery
DroidSpeak, CacheBlend and RelayCaching share (one module per method: `droidspeak`, `cacheblend`, `relaycaching`).

The three keep FullShared's store (one cache of the shared timeline, each token's K/V from the first agent that
processed it, keys re-rotated to the reader's positions in prompt mode by `FullShared.assemble`: one re-alignment
for every policy) and differ only in which (token, layer) K/V entries of the reused span they recompute for the
acting agent before its chunk, and from which hidden states:

- `LayerStack`: the model's input embeddings, decoder layers and rotary embedding, called one layer at a time.
- `Blend`: one turn's blended context — the reused context in buffers of the turn's own (the store keeps the
  producers' K/V), on which recomputed K/V are scattered layer by layer. `Blend.layer(l, h, positions)` runs
  decoder layer l, with the acting agent's adapter, for the tokens at cache `positions` (m,) whose hidden states
  entering the layer are h (1, m, d_model): their K/V (1, H_kv, m, D) are written over the reused ones at those
  positions, then they attend causally (keys at positions ≤ their own) to the blended cache — the agent's prefix,
  the reused span with this layer's recomputed entries in place — and the layer's output (1, m, d_model) carries
  them to the next layer (CacheBlend's "selected tokens carried through the remaining layers"; `Blend.carry` runs
  a band of layers, the last of which only needs their K/V). `Blend.probe(l, h, positions)` only projects their
  queries, keys and values at layer l: the selection work (CacheBlend's check layer, RelayCaching's deviation and
  attention influence) without the layer's attention and MLP.
- the knob: one recompute ratio R per policy (`ratio_option`; `--policy all` sweeps R = 0.1, 0.2, 0.3) and
  `budget`, the tokens R selects.
- the accounting: every recomputed (token, layer) entry is counted (`Context.recomputed`; the replay reports
  recomputed ÷ (reused tokens × layers), the ratio actually run, and KV reuse is 1 − it), and the FLOPs of every
  layer pass and probe are the policy's `extra_flops`. All of it runs in `assemble`, inside the timed prefill:
  selection is charged to TTFT.

The chunk (the agent's new input tokens: CacheBlend's query suffix, always recomputed) is the turn's own forward
over the blended context; since it follows every reused token, computing it after the blend equals computing it in
one pass with the recomputed tokens (causal attention: no reused token attends to it).

At R = 1 each policy recomputes every layer of every reused token from the input embeddings: the agent's own dense
cache (NonShared, to float rounding). At R = 0 it recomputes nothing (no check-layer pass either: there is nothing to
select) and is FullShared.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from abc import abstractmethod
from dataclasses import dataclass

import torch

from kvprof.errors import KvprofError
from kvprof.kernels.transformers_attention import scattered_queries
from kvprof.model.agents import head_dim
from kvprof.model.buffers import KVBuffer
from kvprof.model.latent import MLA_PROJECTIONS
from kvprof.model.lora import FUSED_QKV, QKV, attention_of, decoder_layers, mixer_of
from kvprof.model.rope import layer_position_embeddings, rotary_embedding
from kvprof.model.runtime import KV, Runtime
from kvprof.policies.fullshared import FullShared, FullSharedContext
from kvprof.policies.options import Option, unit_interval

RATIO_SWEEP = ("0.1", "0.2", "0.3")
CACHE_ARGUMENTS = ("cache", "layer_past")  # what a decoder layer's forward calls its cache, by architecture


def ratio_option(default: str, meaning: str) -> Option:
    """The recompute ratio R of a selective-recompute policy (`meaning`: what it is a share of, for `--help`)."""
    return Option(default, sweep=RATIO_SWEEP, parse=unit_interval, help=f"R, {meaning}")


def budget(ratio: float, count: int) -> int:
    """How many of `count` tokens a ratio R selects: ⌈R·count⌉ (at least one for any R > 0, all for R = 1)."""
    return min(count, math.ceil(ratio * count - 1e-9))


def select_top(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices (ascending) of the `count` highest of `scores` (n,). Scores are compared at a resolution of 1e-4 of
    the largest, ties going to the earlier token: float rounding (another attention path, another dtype) does not
    reorder tokens whose scores it cannot tell apart."""
    scale = scores.abs().max().clamp_min(torch.finfo(scores.dtype).tiny)
    ranked = torch.sort(torch.round(scores / scale * 1e4), descending=True, stable=True).indices
    return ranked[:count].sort().values


PROJECTIONS = (*QKV, *MLA_PROJECTIONS, FUSED_QKV, "query_key_value")  # the attention's input projections


class LayerStack:
    """The model's input embeddings, decoder layers and rotary embedding, for forwards one layer at a time.

    Refuses a model whose first decoder layer does not read the input embeddings as they are (a decoder that
    scales or transforms them inside its forward): recomputing from layer 0 starts from the embeddings.
    """

    def __init__(self, runtime: Runtime):
        model = runtime.agents.base_model
        self.runtime = runtime
        self.layers = decoder_layers(model)
        self.embeddings = model.get_input_embeddings()
        rotary = rotary_embedding(model)
        if rotary is None:
            raise KvprofError(
                f"model {model.config.name_or_path!r} has no rotary embedding, which selective recompute runs its "
                "decoder layers with one at a time; pick another policy for this model."
            )
        self.rotary = rotary
        self.linear_params = [
            sum(p.numel() for name, p in layer.named_parameters() if p.dim() == 2 and "lora_" not in name)
            for layer in self.layers
        ]
        self.projection_params = [
            sum(
                p.numel()
                for name, p in mixer_of(layer, index).named_parameters()
                if p.dim() == 2 and "lora_" not in name and name.split(".")[0] in PROJECTIONS
            )
            for index, layer in enumerate(self.layers)
        ]
        self.cache_argument = self._cache_argument()
        self.kinds = runtime.agents.layer_kinds  # each layer's attention: full, sliding or chunked, its W
        self.latent = runtime.latent  # the MLA layers
        self.position_scaled = [position_scale_floor(mixer_of(layer, i)) for i, layer in enumerate(self.layers)]
        self._check_embeddings()

    def _cache_argument(self) -> str:
        """The name under which a decoder layer takes the cache it writes to: `cache` (Llama-style layers) or
        `layer_past` (GPT-NeoX). Refuses a layer that takes neither."""
        parameters = inspect.signature(self.layers[0].forward).parameters
        if "per_layer_input" in parameters and getattr(self.runtime.agents.config, "hidden_size_per_layer_input", None):
            raise KvprofError(
                f"the decoder layers of model {self.runtime.agents.base_model.config.name_or_path!r} each read a "
                "per-layer embedding of the input (Gemma 3n's and Gemma 4's per-layer inputs), which selective "
                "recompute does not compute for the tokens it recomputes; pick another policy for this model."
            )
        for name in CACHE_ARGUMENTS:
            if name in parameters:
                return name
        raise KvprofError(
            f"the decoder layers of model {self.runtime.agents.base_model.config.name_or_path!r} take no cache "
            f"argument ({' or '.join(CACHE_ARGUMENTS)}), so selective recompute cannot run them one at a time; "
            "pick another policy for this model."
        )

    def _check_embeddings(self) -> None:
        runtime = self.runtime
        ids = [0, 1]
        out = runtime.forward(None, ids, runtime.cache_from(runtime.empty_kv()), 0, capture=True)
        assert out.residual is not None  # captured: capture=True
        if not torch.allclose(out.residual[0], self.embed(ids)):
            raise KvprofError(
                f"model {runtime.agents.base_model.config.name_or_path!r} transforms its input embeddings before the "
                "first decoder layer, so selective recompute cannot start from them; pick another policy for this "
                "model."
            )

    def unmasked_chunks(self) -> bool:
        """Whether the model attends through kvprof's attention now (inside a turn), which attends a chunk after a
        cache without a mask (bottom-right causal); otherwise every layer pass gets an explicit mask."""
        return self.runtime.agents.base_model.config._attn_implementation == self.runtime.attention

    def embed(self, ids: list[int]) -> torch.Tensor:
        """The hidden states entering layer 0: the input embeddings of `ids`, (1, n, d_model)."""
        with torch.inference_mode():
            return self.embeddings(torch.tensor([ids], device=self.runtime.device))

    def position_embeddings(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor):
        """What the model passes decoder layer `layer` as `position_embeddings` at `positions` (n,): its rotary
        embedding's cos/sin, of the layer's type where the model has one RoPE per layer type (Gemma 3 / 4)."""
        layer_types = getattr(self.runtime.agents.config, "layer_types", None)
        layer_type = layer_types[layer] if layer_types else None
        return layer_position_embeddings(self.rotary, hidden, positions[None], layer_type)

    def layer_flops(self, layer: int, positions: torch.Tensor) -> float:
        """Analytic FLOPs of one decoder layer for the tokens at cache positions `positions` (m,): 2·params per
        token in its linear layers plus the runtime's `layer_pair_flops` per (query, key) pair they attend there."""
        runtime = self.runtime
        pairs = runtime.attended_at(layer, positions)
        return 2.0 * self.linear_params[layer] * len(positions) + runtime.layer_pair_flops[layer] * pairs

    def probe_flops(self, layer: int, tokens: int) -> float:
        """Analytic FLOPs of the query, key and value projections of `tokens` tokens at `layer`."""
        return 2.0 * self.projection_params[layer] * tokens


class LayerCache:
    """What a decoder layer asks of a cache besides `update`: how many tokens precede its new ones (Llama 4's NoPE
    layers scale queries by position, counting positions from there), the first of the cache `positions` (m,) the
    layer computes. Only exact where those positions run without a gap, or where the scale cannot change
    (`check_position_scaling`)."""

    positions: torch.Tensor
    latent: bool  # an MLA layer: the model passes and reads (latent, k_rot), kvprof holds (k_rot, latent)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.positions[0])

    def swapped(self, first: torch.Tensor, second: torch.Tensor) -> KV:
        """(K, V) in kvprof's order from the model's, or back (`kvprof.model.latent`)."""
        return (second, first) if self.latent else (first, second)


class ScatterCache(LayerCache):
    """A one-layer stand-in for the model's cache: `update` writes the layer's new K/V (1, H_kv, m, D) at cache
    `positions` (m,) of the blended `keys` / `values` (1, H_kv, T, D) and returns all T of them."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, latent: bool = False):
        self.keys, self.values, self.positions, self.latent = keys, values, positions, latent

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs) -> KV:
        keys, values = self.swapped(keys, values)
        self.keys.index_copy_(2, self.positions, keys)
        self.values.index_copy_(2, self.positions, values)
        return self.swapped(self.keys, self.values)


class _Projected(Exception):
    """Raised by `ProbeCache` once the layer has projected its keys and values: the probe stops the layer there."""


class ProbeCache(LayerCache):
    """A one-layer stand-in for the cache that keeps the layer's new K/V (1, H_kv, m, D) at `positions` (m,) and
    stops the layer."""

    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, positions: torch.Tensor, latent: bool = False):
        self.positions, self.latent = positions, latent

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs) -> KV:
        self.keys, self.values = self.swapped(keys, values)
        raise _Projected


@dataclass
class Probe:
    """The projections of m tokens at one layer, as the layer computes them: keys (post-RoPE) and values
    (1, H_kv, m, D); queries (1, m, H_q·D), the query projection's output (before RoPE and any query norm), when
    probed."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor | None


def position_scale_floor(attention: torch.nn.Module) -> int | None:
    """F of an attention module that scales its queries by position (Llama 4's NoPE layers: attention temperature
    tuning, 1 + β·log(1 + ⌊(p + 1)/F⌋)), None for one that does not."""
    if not getattr(attention, "attn_temperature_tuning", False) or getattr(attention, "use_rope", True):
        return None
    return int(attention.floor_scale)


def check_position_scaling(floor: int | None, index: int, positions: torch.Tensor) -> None:
    """Refuse recomputing tokens at gapped `positions` (m,) of layer `index`, which scales its queries by position
    past `floor` (`position_scale_floor`), once the scale can differ between them (p + 1 ≥ F): the layer counts
    positions from the first without gaps."""
    if floor is None or int(positions.max()) + 1 < floor:
        return
    if not bool(torch.equal(positions, torch.arange(int(positions[0]), int(positions[0]) + len(positions)))):
        raise KvprofError(
            f"layer {index} scales its queries by position past {floor} tokens (attention temperature tuning in a "
            "NoPE layer), which recomputing scattered tokens one layer at a time cannot follow; pick a policy that "
            "does not recompute selectively, or trajectories shorter than that."
        )


def causal_mask(
    positions: torch.Tensor, length: int, dtype: torch.dtype, window: int | None = None, chunked: bool = False
) -> torch.Tensor:
    """Additive mask (1, 1, m, length): query at cache position p sees keys 0..p (with a sliding `window` W, only
    keys p − W < k ≤ p; `chunked`, only keys of its own chunk of W: ⌊k/W⌋ = ⌊p/W⌋, as Llama 4's chunked layers)."""
    keys = torch.arange(length, device=positions.device)
    allowed = keys[None, :] <= positions[:, None]
    if window is not None and chunked:
        allowed &= keys[None, :] // window == positions[:, None] // window
    elif window is not None:
        allowed &= keys[None, :] > positions[:, None] - window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


class Blend:
    """One turn's blended context (see module docstring): per layer (K, V), (1, H_kv, P + n, D), views of the
    turn's buffers; P the agent's prefix, n the reused tokens. `recomputed` counts the (token, layer) entries
    written, `flops` the analytic FLOPs of the layer passes and probes, `hidden_bytes` the largest carried hidden
    states (a layer's input and output)."""

    def __init__(self, stack: LayerStack, kv: list[KV], buffers: list[KVBuffer], prefix_len: int):
        self.stack = stack
        self.buffers = buffers
        self.kv = kv
        self.prefix_len = prefix_len
        self.recomputed = 0
        self.flops = 0.0
        self.hidden_bytes = 0

    def positions(self, count: int) -> torch.Tensor:
        """Cache positions of the first `count` reused tokens, (count,)."""
        return torch.arange(self.prefix_len, self.prefix_len + count, device=self.stack.runtime.device)

    def reused(self, layer: int, side: int, count: int) -> torch.Tensor:
        """The reused span's keys (side 0) or values (side 1) at `layer` as they stand, (1, H_kv, count, D)."""
        return self.kv[layer][side][:, :, self.prefix_len : self.prefix_len + count]

    def layer(self, index: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Recompute decoder layer `index` for the tokens at `positions` (hidden states entering it (1, m, d));
        their K/V are scattered into the blend; returns their hidden states leaving the layer (1, m, d)."""
        keys, values = self.kv[index]
        length = int(keys.shape[2])
        kind = self.stack.kinds[index]
        mask = None
        scattered: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if kind.window is not None and kind.window < length:  # its last W keys only, or those of its chunk of W
            mask = causal_mask(positions, length, hidden.dtype, kind.window, chunked=kind.attention == "chunked")
        elif not self.stack.unmasked_chunks():
            mask = causal_mask(positions, length, hidden.dtype)
        elif len(positions) < length - self.prefix_len:  # kvprof's attention attends them without a mask
            scattered = scattered_queries(positions)
        check_position_scaling(self.stack.position_scaled[index], index, positions)
        with scattered:
            out = self.stack.layers[index](
                hidden,
                attention_mask=mask,
                position_ids=positions[None],
                **{self.stack.cache_argument: ScatterCache(keys, values, positions, index in self.stack.latent)},
                use_cache=True,
                position_embeddings=self.stack.position_embeddings(index, hidden, positions),
            )
        out = out[0] if isinstance(out, tuple) else out
        self.recomputed += len(positions)
        self.flops += self.stack.layer_flops(index, positions)
        self.hidden_bytes = max(self.hidden_bytes, 2 * hidden.numel() * hidden.element_size())
        return out

    def full_then_probe(
        self, ids: list[int], check: int, queries: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, Probe]:
        """Recompute layers 0 .. check − 1 for every reused token (`ids`, from their input embeddings), then probe
        layer `check` for all of them: the work a check-layer selection needs. Returns the hidden states entering
        `check` (1, n, d), the tokens' cache positions (n,) and the probe."""
        positions = self.positions(len(ids))
        hidden = self.stack.embed(ids)
        for index in range(check):
            hidden = self.layer(index, hidden, positions)
        return hidden, positions, self.probe(check, hidden, positions, queries)

    def carry(self, start: int, end: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Recompute layers start .. end − 1 for the tokens at `positions` (hidden states entering `start`); the
        last of them only projects and scatters their K/V (nothing after it reads their hidden states). Returns the
        hidden states entering layer end − 1."""
        for index in range(start, end - 1):
            hidden = self.layer(index, hidden, positions)
        if end > start:
            probe = self.probe(end - 1, hidden, positions)
            keys, values = self.kv[end - 1]
            keys.index_copy_(2, positions, probe.keys)
            values.index_copy_(2, positions, probe.values)
            self.recomputed += len(positions)
        return hidden

    def probe(self, index: int, hidden: torch.Tensor, positions: torch.Tensor, queries: bool = False) -> Probe:
        """The keys and values layer `index` computes for the tokens at `positions` (hidden states entering it
        (1, m, d)), and with `queries` its query projection's output (`query_projection`); nothing is written."""
        layer = self.stack.layers[index]
        outputs: list[torch.Tensor] = []
        handle = None
        if queries:
            projection = query_projection(attention_of(layer, index))
            assert projection is not None, "queries probed on a model without a query projection"
            module, width = projection
            handle = module.register_forward_hook(lambda module, args, out: outputs.append(out[..., :width]))
        check_position_scaling(self.stack.position_scaled[index], index, positions)
        cache = ProbeCache(positions, index in self.stack.latent)
        try:
            layer(
                hidden,
                position_ids=positions[None],
                **{self.stack.cache_argument: cache},
                use_cache=True,
                position_embeddings=self.stack.position_embeddings(index, hidden, positions),
            )
        except _Projected:
            pass
        finally:
            if handle is not None:
                handle.remove()
        self.flops += self.stack.probe_flops(index, len(positions))
        return Probe(keys=cache.keys, values=cache.values, queries=outputs[0] if outputs else None)


def query_projection(attention: torch.nn.Module) -> tuple[torch.nn.Module, int] | None:
    """The module whose output holds an attention layer's queries, and how many of its first columns they are:
    `q_proj` (all of them), or Phi-3's fused `qkv_proj` (the first H_q·D); None for any other layout."""
    size = getattr(attention, "head_dim", None)  # the layer's own (Gemma 4's global layers), else the model's
    width = attention.config.num_attention_heads * (size if isinstance(size, int) else head_dim(attention.config))
    for name in ("q_proj", FUSED_QKV):
        module = getattr(attention, name, None)
        if isinstance(module, torch.nn.Module):
            return module, width
    return None


class SelectiveRecompute(FullShared):
    """Base of the selective-recompute policies: FullShared's store and re-aligned context, then `recompute` on a
    `Blend` of it, inside `assemble` (timed into TTFT). A subclass declares `ratio` among its options and
    implements `recompute`."""

    family = "selective recompute"
    approximate = True
    modes = ("lora", "prompt")
    exact_setting = "recompute all"

    def __init__(self, runtime: Runtime, **options: str):
        self.check_recurrent(runtime)  # before the layer stack, which needs every layer's attention
        self.stack = LayerStack(runtime)
        super().__init__(runtime, **options)

    @property
    def ratio(self) -> float:
        ratio = self.settings["ratio"]
        assert isinstance(ratio, float)  # parsed by unit_interval
        return ratio

    def layer_setting(self, key: str) -> int:
        """The layer option `key` (parsed by `layer_index`)."""
        value = self.settings[key]
        assert isinstance(value, int)
        return value

    def check_layer_option(self, runtime: Runtime, key: str, value: int) -> None:
        """Refuse a layer option `key` at or past the model's last layer."""
        if value >= runtime.num_layers:
            raise KvprofError(
                f"policy {self.name} option {key}={value} is past the model's {runtime.num_layers} layers; pass "
                f"{key} < {runtime.num_layers}."
            )

    def recomputes(self) -> bool:
        """Whether this turn recomputes anything (R > 0 by default)."""
        return self.ratio > 0

    @abstractmethod
    def recompute(self, blend: Blend, ids: list[int], context: FullSharedContext) -> None:
        """Recompute what the policy selects of the reused tokens `ids` (the first `context.covered` of the shared
        input: the kept prefix and, past it, the moved spans and the new tokens between them, whose (begin, end)
        `context.placeholders` gives when the extension left them uncomputed) into `blend`, with the acting agent's
        adapter active."""

    def assemble(self, agent: str, shared: list[int]) -> FullSharedContext:
        context = super().assemble(agent, shared)
        if not context.covered or not self.recomputes():
            return context
        stored = self.shared is not None and context.buffers is not None and context.buffers[0] is self.shared[0]
        if stored or context.buffers is None:  # the store's own buffers: the blend writes into a copy
            context.buffers = [KVBuffer.of(keys, values, len(shared) - context.covered) for keys, values in context.kv]
            context.kv = [buffer.view(int(keys.shape[2])) for buffer, (keys, _) in zip(context.buffers, context.kv)]
        blend = Blend(self.stack, context.kv, context.buffers, len(self.runtime.prefix(agent)))
        with self.runtime.agents.activate(agent):
            self.recompute(blend, shared[: context.covered], context)
        context.recomputed = blend.recomputed
        context.extra_flops += blend.flops
        context.extra_prefill += round(blend.recomputed / self.runtime.num_layers)
        context.working_bytes += blend.hidden_bytes
        return context
