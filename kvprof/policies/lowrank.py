"""The store the low-rank policies share: a base cache plus rank-r LR caches, on the shared timeline (lora mode).

Per layer the store holds K_base = RoPE(X·W0_kᵀ) and V_base = X·W0_vᵀ, each (1, H_kv, N, D), for the N tokens of the
timeline processed so far, and any number of LR caches `X·Aᵀ` (1, N_c, r) under a name (an agent, or "shared"),
each for the projections its adapter targets. Which hidden states X feed it — the processing agent's (BaseShared,
BaseLRShared, PreLRShared) or adapter-free ones (ReBaseShared) — is the policy's choice.

`assemble` rebuilds what agent j attends to: K = K_base + RoPE((X·Aᵀ)·s·B_jᵀ) and V = V_base + (X·Aᵀ)·s·B_jᵀ.
The value expansion is the torch reference of Flash-LoRA-Attention's O = P·V_base + (P·V_lr)·B (same result); the
key expansion is inherent to LoRA on k_proj (RoPE does not commute with the rank-r factorisation).

Dtypes, per operation, so that half-precision models (bfloat16 / float16, the CUDA default) replay as peft runs
them: peft keeps adapter factors in float32 and computes a LoRA branch by upcasting X, so the down-projections X·Aᵀ
and the expansions (X·Aᵀ)·s·Bᵀ run in the adapter's dtype (float32 for peft's default) and each sum
base + low-rank is formed in float32 before it is cast to the model's dtype, as peft adds its branch. The stored
caches (base and LR) are kept in the model's dtype, as a server keeps them; Flash-LoRA-Attention gets V_lr and B in
the model's dtype and accumulates in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import torch

from kvprof.kernels.attention import lora_b_per_head
from kvprof.kernels.transformers_attention import LoraValues
from kvprof.lora import base_kv, heads
from kvprof.policies.base import Chunk, Context, SharingPolicy
from kvprof.rope import apply_rope
from kvprof.runtime import KV, ChunkForward, Runtime

SPLIT_SIDES = ("key", "value")  # the fields of a `kvprof.lora.LayerSplit` whose LR caches the store keeps


@dataclass
class StoreUpdate:
    """Base K/V and LR caches of consecutive timeline tokens, computed during a turn (in the phase serving computes
    them) and appended by the policy's `commit`.

    start: timeline index of the first token; producer: who processed them (an agent, or "neutral");
    base: per layer (K_base, V_base), each (1, H_kv, n, D); low_rank: LR cache name → per layer
    {"key"|"value": (1, n, r)}.
    """

    start: int
    producer: str
    base: list[KV]
    low_rank: dict[str, list[dict[str, torch.Tensor]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.base[0][0].shape[2]) if self.base else 0


class LowRankStore:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.base: list[KV] = []
        self.low_rank: dict[str, list[dict[str, torch.Tensor]]] = {}
        self.producers: list[str] = []

    def __len__(self) -> int:
        return len(self.producers)

    def lr_length(self, name: str) -> int:
        layers = self.low_rank.get(name)
        if not layers or not layers[0]:
            return 0
        return next(iter(layers[0].values())).shape[1]

    # ------------------------------------------------------------------------------------------- writing

    def base_update(self, hidden: list[torch.Tensor], start: int, producer: str) -> tuple[StoreUpdate, float]:
        """The base K/V of tokens at timeline indices start.. with attention inputs `hidden` (per layer
        (1, n, d_model)), as an update (the store is not changed), and its FLOPs."""
        runtime = self.runtime
        count = hidden[0].shape[1]
        positions = torch.arange(start, start + count, device=hidden[0].device)
        base = [
            base_kv(split, x, positions, runtime.inv_freq, runtime.attention_scaling, runtime.head_dim)
            for split, x in zip(runtime.splits, hidden)
        ]
        flops = 2.0 * count * runtime.hidden_size * 2 * runtime.kv_heads * runtime.head_dim * runtime.num_layers
        return StoreUpdate(start=start, producer=producer, base=base), flops

    def apply(self, updates: list[StoreUpdate]) -> None:
        """Append the updates' tokens the store does not hold yet, in timeline order (each update must start at or
        before the store's end)."""
        for update in sorted(updates, key=lambda u: u.start):
            skip = len(self) - update.start
            if skip < 0:
                raise RuntimeError(f"store update at {update.start} leaves a gap after {len(self)} tokens")
            if skip >= len(update):
                continue
            base = [(k[:, :, skip:], v[:, :, skip:]) for k, v in update.base]
            self.base = (
                base
                if not self.base
                else [(torch.cat([k, nk], 2), torch.cat([v, nv], 2)) for (k, v), (nk, nv) in zip(self.base, base)]
            )
            for name, layers in update.low_rank.items():
                self.append_low_rank(name, [{p: t[:, skip:] for p, t in layer.items()} for layer in layers])
            self.producers += [update.producer] * (len(update) - skip)

    @staticmethod
    def down_projections(
        runtime: Runtime, hidden: list[torch.Tensor], agents: list[str]
    ) -> dict[str, list[dict[str, torch.Tensor]]]:
        """X·A_kᵀ for every agent k in one GEMM per projection (PReCache's precomputation).

        hidden: per layer (1, n, d_model) → {agent: per layer {"key"|"value": (1, n, r)}}. Computed in the adapter
        factors' dtype (X upcast, as peft does), returned in X's dtype (the LR cache's storage dtype).
        """
        result: dict[str, list[dict[str, torch.Tensor]]] = {agent: [] for agent in agents}
        for split, x in zip(runtime.splits, hidden):
            parts: dict[str, dict[str, torch.Tensor]] = {agent: {} for agent in agents}
            for projection in SPLIT_SIDES:
                proj = getattr(split, projection)
                adapted = [agent for agent in agents if agent in proj.down]
                if not adapted:
                    continue
                stacked = torch.cat([proj.down[agent] for agent in adapted])
                products = (x.to(stacked.dtype) @ stacked.T).to(x.dtype)
                outputs = torch.split(products, [proj.down[agent].shape[0] for agent in adapted], dim=-1)
                for agent, out in zip(adapted, outputs):
                    parts[agent][projection] = out
            for agent in agents:
                result[agent].append(parts[agent])
        return result

    @staticmethod
    def down_projection_flops(runtime: Runtime, projections: dict[str, list[dict[str, torch.Tensor]]]) -> float:
        """Analytic FLOPs of `down_projections`' result: 2·n·d_model per output column."""
        return sum(
            2.0 * t.shape[1] * runtime.hidden_size * t.shape[-1]
            for layers in projections.values()
            for layer in layers
            for t in layer.values()
        )

    def append_low_rank(self, name: str, layers: list[dict[str, torch.Tensor]]) -> None:
        current = self.low_rank.get(name)
        if current is None:
            self.low_rank[name] = layers
            return
        self.low_rank[name] = [{p: torch.cat([old[p], new[p]], 1) for p in old} for old, new in zip(current, layers)]

    # ------------------------------------------------------------------------------------------- reading

    def assemble(
        self, agent: str | None, low_rank: list[dict[str, torch.Tensor]] | None, length: int, expand_values: bool = True
    ) -> tuple[list[KV], float, list[LoraValues | None] | None]:
        """Per layer (K, V) of the first `length` tokens as `agent` sees them: the base plus `agent`'s B applied to
        the LR cache `low_rank` (per layer {"key"|"value": (1, ≥length, r)}); with `low_rank=None`, the base alone.

        With `expand_values=False` the values stay V_base and the rank-r part is returned per layer as
        `LoraValues(v_lr (1, length, r), lora_b (H_kv, r, D))`, both in the cache's dtype, for
        Flash-LoRA-Attention. Expansions run in the adapter's dtype; sums in float32, cast to the cache's. Returns
        (kv, expansion FLOPs, lora values or None)."""
        runtime = self.runtime
        if not self.base:
            return runtime.empty_kv(), 0.0, None
        kv, flops = [], 0.0
        lora_values: list[LoraValues | None] = []
        positions = torch.arange(length, device=runtime.device)
        for layer, (split, (keys, values)) in enumerate(zip(runtime.splits, self.base)):
            keys, values = keys[:, :, :length], values[:, :, :length]
            layer_lora = None
            if agent is not None and low_rank is not None:
                for projection in SPLIT_SIDES:
                    proj = getattr(split, projection)
                    if agent not in proj.up or projection not in low_rank[layer]:
                        continue
                    factors = low_rank[layer][projection][:, :length]
                    if projection == "value" and not expand_values:
                        lora_b = lora_b_per_head(proj.up[agent], runtime.kv_heads, 1.0).to(values.dtype)
                        layer_lora = LoraValues(factors, lora_b)
                        continue
                    expanded = heads(proj.expand(factors.to(proj.up[agent].dtype), agent), runtime.head_dim)
                    flops += 2.0 * expanded.numel() * factors.shape[-1]
                    if projection == "key":
                        rotated = apply_rope(expanded, positions, runtime.inv_freq, runtime.attention_scaling)
                        keys = (keys.float() + rotated.float()).to(keys.dtype)
                    else:
                        values = (values.float() + expanded.float()).to(values.dtype)
            kv.append((keys, values))
            lora_values.append(layer_lora)
        return kv, flops, (lora_values if any(v is not None for v in lora_values) else None)

    # ------------------------------------------------------------------------------------------- memory

    def live_tensors(self) -> dict[str, list[torch.Tensor]]:
        tensors = {"base cache": [t for pair in self.base for t in pair]}
        for name, layers in self.low_rank.items():
            tensors[f"LR cache:{name}"] = [t for layer in layers for t in layer.values()]
        return tensors

    def analytic_bytes(self) -> dict[str, int]:
        runtime = self.runtime
        itemsize = runtime.dtype.itemsize
        sizes = {"base cache": runtime.kv_bytes_per_token * len(self)}
        for name in self.low_rank:
            agent = name if name in runtime.agents.spec.names else runtime.agents.spec.names[0]
            rank_sum = sum(
                getattr(split, p).down[agent].shape[0]
                for split in runtime.splits
                for p in SPLIT_SIDES
                if agent in getattr(split, p).down
            )
            sizes[f"LR cache:{name}"] = rank_sum * self.lr_length(name) * itemsize
        return sizes


@dataclass
class LowRankContext(Context):
    """updates: the store updates the turn computed in `on_prefill` / `on_decode_step`, appended by `commit`."""

    updates: list[StoreUpdate] = field(default_factory=list)


LowRankContextT = TypeVar("LowRankContextT", bound=LowRankContext)


class LowRankPolicy(SharingPolicy[LowRankContextT]):
    """Shared base of the policies that keep a `LowRankStore` (lora mode): the store, its memory, the context an
    agent gets from it (base cache plus its B applied to the LR cache it reads), and the turn's store updates.

    Phases: the base K/V and LR caches of the tokens a turn adds to the timeline are computed from the hidden states
    of the forward that processed them — during prefill for the chunk, at each decode step for an output token —
    and appended after the turn by `commit`."""

    modes: ClassVar[tuple[str, ...]] = ("lora",)

    def reset(self) -> None:
        self.store = LowRankStore(self.runtime)

    @property
    def needs_hidden(self) -> bool:
        return True

    def reused_span(self, shared: list[int]) -> int:
        """Shared tokens the store can serve to an input of `shared` tokens (at least one is left to compute)."""
        return min(len(self.store), len(shared) - 1)

    def store_view(self, agent: str, low_rank: list[dict[str, torch.Tensor]] | None, reused: int) -> LowRankContext:
        """The context of `agent` from the store: base cache + `agent`'s B over `low_rank` on `reused` tokens,
        values expanded or handed to Flash-LoRA-Attention as the runtime says."""
        kv, flops, lora_values = self.store.assemble(
            agent, low_rank, reused, expand_values=not self.runtime.lora_attention
        )
        return LowRankContext(kv=kv, reused=reused, extra_flops=flops, lora_values=lora_values)

    def new_tokens(
        self, context: LowRankContext, hidden: list[torch.Tensor], start: int
    ) -> tuple[list[torch.Tensor], int] | None:
        """The part of `hidden` (per layer (B, n, d_model), tokens at timeline indices start..) that neither the
        store nor an earlier update of this turn holds, and the timeline index of its first token; None when every
        token is known."""
        known = max([len(self.store)] + [u.start + len(u) for u in context.updates])
        skip = max(known - start, 0)
        if skip >= hidden[0].shape[1]:
            return None
        return [x[:, skip:] for x in hidden], start + skip

    def on_prefill(self, agent: str, context: LowRankContextT, forward: ChunkForward, start: int) -> float:
        return self.on_forward(agent, context, forward, start)

    def on_decode_step(self, agent: str, context: LowRankContextT, forward: ChunkForward, start: int) -> float:
        return self.on_forward(agent, context, forward, start)

    def on_forward(self, agent: str, context: LowRankContextT, forward: ChunkForward, start: int) -> float:
        """The store work on the tokens one forward of the turn computed (the chunk in prefill, one token per decode
        step: the same work in both phases); returns its analytic FLOPs."""
        return 0.0

    def commit(self, chunk: Chunk[LowRankContextT]) -> float:
        self.store.apply(chunk.context.updates)
        return 0.0

    def live_tensors(self) -> dict[str, list[torch.Tensor]]:
        return self.store.live_tensors()

    def analytic_bytes(self) -> dict[str, int]:
        return self.store.analytic_bytes()
