"""Selective recompute: the machinery DroidSpeak, CacheBlend and RelayCaching share (`droidspeak`, `cacheblend`,
`relaycaching`).

The three keep FullShared's store (keys re-rotated once, by `FullShared.assemble`) and differ only in which
(token, layer) K/V entries of the reused span they recompute for the acting agent before its chunk, and from which
hidden states. `LayerStack` runs the model one layer at a time; `Blend` is a turn's blended context on which
recomputed K/V are scattered (`Blend.layer`, `Blend.carry`; `Blend.probe` projects only, for selection); one knob R
(`ratio_option`, `budget`; `--policy all` sweeps 0.1, 0.2, 0.3). Every recomputed (token, layer) entry is counted
(`Context.recomputed`: the ratio actually run; KV reuse = 1 − it) and every pass's FLOPs are `extra_flops`, all in
`assemble`: selection is charged to TTFT. R = 1: NonShared to float rounding; R = 0: FullShared. How the blend works:
docs/policies/selective.md.
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
from kvprof.model.architecture import attention_of, decoder_layers, head_dim, mixer_of
from kvprof.model.buffers import KVBuffer
from kvprof.model.latent import MLA_PROJECTIONS
from kvprof.model.layers import LayerKind
from kvprof.model.lora import FUSED_QKV, QKV
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
    """Indices (ascending) of the `count` highest of `scores` (n,), compared at 1e-4 of the largest, ties to the
    earlier token (so float rounding does not reorder them)."""
    scale = scores.abs().max().clamp_min(torch.finfo(scores.dtype).tiny)
    ranked = torch.sort(torch.round(scores / scale * 1e4), descending=True, stable=True).indices
    return ranked[:count].sort().values


PROJECTIONS = (*QKV, *MLA_PROJECTIONS, FUSED_QKV, "query_key_value")  # the attention's input projections


class LayerStack:
    """The model's input embeddings, decoder layers and rotary embedding, for forwards one layer at a time.

    Refuses a model whose first layer transforms the input embeddings (recomputing from layer 0 starts from them)."""

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
        """The layer's cache argument: `cache` (Llama-style) or `layer_past` (GPT-NeoX); refuses others."""
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
        """Whether kvprof's attention is on (chunks after a cache need no mask); else passes get explicit masks."""
        return self.runtime.agents.base_model.config._attn_implementation == self.runtime.attention

    def embed(self, ids: list[int]) -> torch.Tensor:
        """The hidden states entering layer 0: the input embeddings of `ids`, (1, n, d_model)."""
        with torch.inference_mode():
            return self.embeddings(torch.tensor([ids], device=self.runtime.device))

    def layer_type(self, layer: int) -> str | None:
        """The config's type of `layer` (Gemma 3 / 4 rotate sliding and full layers differently), else None."""
        layer_types = getattr(self.runtime.agents.config, "layer_types", None)
        return layer_types[layer] if layer_types else None

    def position_embeddings(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor):
        """The layer's `position_embeddings` (cos, sin) at `positions` (n,), per layer type (Gemma 3 / 4)."""
        return layer_position_embeddings(self.rotary, hidden, positions[None], self.layer_type(layer))

    def layer_flops(self, layer: int, positions: torch.Tensor) -> float:
        """Analytic FLOPs of one layer for `positions` (m,): 2·params per token + `layer_pair_flops` per pair."""
        runtime = self.runtime
        pairs = runtime.attended_at(layer, positions)
        return 2.0 * self.linear_params[layer] * len(positions) + runtime.layer_pair_flops[layer] * pairs

    def probe_flops(self, layer: int, tokens: int) -> float:
        """Analytic FLOPs of the query, key and value projections of `tokens` tokens at `layer`."""
        return 2.0 * self.projection_params[layer] * tokens


class LayerCache:
    """A cache's tokens before the layer's new ones: the first of `positions` (m,) (Llama 4's NoPE layers count
    positions from there; exact only without gaps, `check_position_scaling`)."""

    positions: torch.Tensor
    latent: bool  # an MLA layer: the model passes and reads (latent, k_rot), kvprof holds (k_rot, latent)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.positions[0])

    def swapped(self, first: torch.Tensor, second: torch.Tensor) -> KV:
        """(K, V) in kvprof's order from the model's, or back (`kvprof.model.latent`)."""
        return (second, first) if self.latent else (first, second)


class ScatterCache(LayerCache):
    """One-layer cache: `update` writes new K/V (1, H_kv, m, D) at `positions` (m,) of the blend (1, H_kv, T, D)."""

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
    """One-layer cache that keeps the new K/V (1, H_kv, m, D) and stops the layer."""

    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, positions: torch.Tensor, latent: bool = False):
        self.positions, self.latent = positions, latent

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs) -> KV:
        self.keys, self.values = self.swapped(keys, values)
        raise _Projected


@dataclass
class Probe:
    """m tokens' projections at one layer: keys (post-RoPE), values (1, H_kv, m, D); queries (1, m, H_q·D),
    before RoPE and query norm, when probed."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor | None


def position_scale_floor(attention: torch.nn.Module) -> int | None:
    """F of a module scaling queries by 1 + β·log(1 + ⌊(p + 1)/F⌋) (Llama 4's NoPE layers), else None."""
    if not getattr(attention, "attn_temperature_tuning", False) or getattr(attention, "use_rope", True):
        return None
    return int(attention.floor_scale)


def check_position_scaling(floor: int | None, index: int, positions: torch.Tensor) -> None:
    """Refuse gapped `positions` (m,) at a position-scaled layer once the scale can differ (p + 1 ≥ F)."""
    if floor is None or int(positions.max()) + 1 < floor:
        return
    if not bool(torch.equal(positions, torch.arange(int(positions[0]), int(positions[0]) + len(positions)))):
        raise KvprofError(
            f"layer {index} scales its queries by position past {floor} tokens (attention temperature tuning in a "
            "NoPE layer), which recomputing scattered tokens one layer at a time cannot follow; pick a policy that "
            "does not recompute selectively, or trajectories shorter than that."
        )


def causal_mask(
    positions: torch.Tensor, length: int, dtype: torch.dtype, kind: LayerKind | None = None
) -> torch.Tensor:
    """Additive mask (1, 1, m, length): query at cache position p sees keys 0..p, or those of them a `kind` layer
    attends (`LayerKind.visible`: with a sliding window W, p − W < k ≤ p; chunked, its own chunk of W)."""
    keys = torch.arange(length, device=positions.device)
    allowed = keys[None, :] <= positions[:, None] if kind is None else kind.visible(keys, positions)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


class Blend:
    """One turn's blended context: per layer (K, V), (1, H_kv, P + n, D) (P prefix, n reused tokens); counts
    `recomputed` (token, layer) entries, `flops`, and `hidden_bytes` (largest carried hidden states)."""

    def __init__(self, stack: LayerStack, kv: list[KV], buffers: list[KVBuffer], prefix_len: int):
        self.stack = stack
        self.buffers = buffers
        self.kv = kv
        self.prefix_len = prefix_len
        self.recomputed = 0
        self.flops = 0.0
        self.hidden_bytes = 0
        self._rotations: dict[str | None, tuple[torch.Tensor, tuple]] = {}  # per layer type: positions, (cos, sin)

    def positions(self, count: int) -> torch.Tensor:
        """Cache positions of the first `count` reused tokens, (count,)."""
        return torch.arange(self.prefix_len, self.prefix_len + count, device=self.stack.runtime.device)

    def reused(self, layer: int, side: int, count: int) -> torch.Tensor:
        """The reused span's keys (side 0) or values (side 1) at `layer` as they stand, (1, H_kv, count, D)."""
        return self.kv[layer][side][:, :, self.prefix_len : self.prefix_len + count]

    def position_embeddings(self, index: int, hidden: torch.Tensor, positions: torch.Tensor) -> tuple:
        """Layer `index`'s (cos, sin) at `positions`, computed once per layer type for the same positions tensor
        (the layers of one pass share it, as a model's forward does)."""
        layer_type = self.stack.layer_type(index)
        kept = self._rotations.get(layer_type)
        if kept is None or kept[0] is not positions:
            kept = (positions, self.stack.position_embeddings(index, hidden, positions))
            self._rotations[layer_type] = kept
        return kept[1]

    def layer(self, index: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Recompute decoder layer `index` for the tokens at `positions` (hidden states entering it (1, m, d));
        their K/V are scattered into the blend; returns their hidden states leaving the layer (1, m, d)."""
        keys, values = self.kv[index]
        length = int(keys.shape[2])
        kind = self.stack.kinds[index]
        mask = None
        scattered: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if kind.limits(length):  # its last W keys only, or those of its chunk of W
            mask = causal_mask(positions, length, hidden.dtype, kind)
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
                position_embeddings=self.position_embeddings(index, hidden, positions),
            )
        out = out[0] if isinstance(out, tuple) else out
        self.recomputed += len(positions)
        self.flops += self.stack.layer_flops(index, positions)
        self.hidden_bytes = max(self.hidden_bytes, 2 * hidden.numel() * hidden.element_size())
        return out

    def full_then_probe(
        self, ids: list[int], check: int, queries: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, Probe]:
        """Recompute layers 0 .. check − 1 for every reused token, probe layer `check`: hidden states entering it
        (1, n, d), positions (n,), the probe."""
        positions = self.positions(len(ids))
        hidden = self.stack.embed(ids)
        for index in range(check):
            hidden = self.layer(index, hidden, positions)
        return hidden, positions, self.probe(check, hidden, positions, queries)

    def carry(self, start: int, end: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Recompute layers start .. end − 1 for `positions` (the last only writes K/V); hidden states entering
        layer end − 1."""
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
        """Project layer `index` for `positions` (hidden states (1, m, d)), queries too with `queries`; no writes."""
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
                position_embeddings=self.position_embeddings(index, hidden, positions),
            )
        except _Projected:
            pass
        finally:
            if handle is not None:
                handle.remove()
        self.flops += self.stack.probe_flops(index, len(positions))
        return Probe(keys=cache.keys, values=cache.values, queries=outputs[0] if outputs else None)


def query_projection(attention: torch.nn.Module) -> tuple[torch.nn.Module, int] | None:
    """The module holding a layer's queries and their column count: `q_proj`, Phi-3's `qkv_proj` (first H_q·D), or
    None."""
    size = getattr(attention, "head_dim", None)  # the layer's own (Gemma 4's global layers), else the model's
    width = attention.config.num_attention_heads * (size if isinstance(size, int) else head_dim(attention.config))
    for name in ("q_proj", FUSED_QKV):
        module = getattr(attention, name, None)
        if isinstance(module, torch.nn.Module):
            return module, width
    return None


class SelectiveRecompute(FullShared):
    """FullShared's store, then `recompute` on a `Blend` inside `assemble`; subclasses declare `ratio` and
    implement `recompute`."""

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
        """Recompute the selected reused tokens `ids` (kept prefix, moved spans, and `context.placeholders`' new
        tokens) into `blend`, with the agent's adapter."""

    def assemble(self, agent: str, shared: list[int]) -> FullSharedContext:
        context = super().assemble(agent, shared)
        if not context.covered or not self.recomputes():
            return context
        stored = self.shared is not None and context.buffers is not None and context.buffers[0] is self.shared[0]
        if stored or context.buffers is None:  # the store's own buffers: the blend writes into a copy
            spare = self.with_output(len(shared) - context.covered)
            copy = self.workspace.copy
            context.buffers = [
                copy("blend", layer, keys, values, spare) for layer, (keys, values) in enumerate(context.kv)
            ]
            context.kv = [buffer.view(int(keys.shape[2])) for buffer, (keys, _) in zip(context.buffers, context.kv)]
        blend = Blend(self.stack, context.kv, context.buffers, len(self.runtime.prefix(agent)))
        with self.runtime.agents.activate(agent):
            self.recompute(blend, shared[: context.covered], context)
        context.recomputed = blend.recomputed
        context.extra_flops += blend.flops
        context.extra_prefill += round(blend.recomputed / self.runtime.num_layers)
        context.working_bytes += blend.hidden_bytes
        return context
