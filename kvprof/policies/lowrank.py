"""The store the low-rank policies share: a base cache plus rank-r LR caches, on the shared timeline (lora mode).

Per layer the store holds K_base = RoPE(X·W0_kᵀ) and V_base = X·W0_vᵀ, each (1, H_kv, N, D), for the N tokens of the
timeline processed so far, and any number of LR caches `X·Aᵀ` (1, N_c, r) under a name (an agent, or "shared"),
each for the projections its adapter targets. Which forward feeds it — the processing agent's (BaseShared,
BaseLRShared, PreLRShared) or an adapter-free one (ReBaseShared) — is the policy's choice. What that forward
computed is stored, never projected again, as the authors' code takes it: the base K/V from the forward's own
projections (`LowRankStore.base_update`: V from v_proj's `base_layer`, K from k_proj when the adapter leaves it
alone, else its base output rotated) and the processing agent's X·Aᵀ from its own `lora_A`
(`LowRankStore.forward_down_projections`); only the other agents' X·A_kᵀ (PReCache's precomputation) are extra
GEMMs (`LowRankStore.down_projections`).

`assemble` rebuilds what agent j attends to: K = K_base + RoPE((X·Aᵀ)·s·B_jᵀ) and V = V_base + (X·Aᵀ)·s·B_jᵀ.
The value expansion is the torch reference of Flash-LoRA-Attention's O = P·V_base + (P·V_lr)·B (same result); the
key expansion is inherent to LoRA on k_proj (RoPE does not commute with the rank-r factorisation).

A model that normalises its keys between k_proj and RoPE (`k_norm`: Qwen3, OLMo 2) caches
K = RoPE(k_norm(X·W0_kᵀ + (X·Aᵀ)·s·B_jᵀ)), which is not a base plus a low-rank part. For it the store keeps the
un-normalised, un-rotated K_base = X·W0_kᵀ and every view computes k_norm and RoPE of the sum, for every agent and
token it assembles (a cost Llama-style models do not pay, counted in the view's FLOPs). Values split as before.

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

from kvprof.errors import KvprofError
from kvprof.kernels.attention import lora_b_per_head
from kvprof.kernels.transformers_attention import LoraValues
from kvprof.model.buffers import GrowingTensor, KVBuffer
from kvprof.model.lora import SPLIT_SIDES, heads
from kvprof.model.runtime import KV, ChunkForward, Runtime
from kvprof.policies.base import SharingPolicy
from kvprof.policies.options import Option
from kvprof.policies.turns import Chunk, Context
from kvprof.traces.reuse import MovedSpan

KEY_FINISH_FLOPS = 10.0  # per key entry, k_norm (≈ 4) and RoPE (6) of a view's keys, for models with a key norm


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


@dataclass
class StoreView:
    """What an agent attends to from the store (`LowRankStore.assemble`).

    kv: per layer (K, V), (1, H_kv, length, D), views of `buffers` (per layer a `KVBuffer` the turn may append to
    in place); flops: the analytic FLOPs of the expansions; lora_values: per layer the rank-r value side for
    Flash-LoRA-Attention, or None when the values are complete."""

    kv: list[KV]
    flops: float
    lora_values: list[LoraValues | None] | None
    buffers: list[KVBuffer] | None


class LowRankStore:
    """The base cache (per layer a `KVBuffer`) and the named LR caches (per layer {"key"|"value": a
    `GrowingTensor` (1, ≥ n, r)}), all growing in place (`kvprof.model.buffers`)."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.base: list[KVBuffer] = []
        self.low_rank: dict[str, list[dict[str, GrowingTensor]]] = {}
        self.lr_lengths: dict[str, int] = {}
        self.producers: list[str] = []

    def __len__(self) -> int:
        return len(self.producers)

    def lr_length(self, name: str) -> int:
        """Tokens the LR cache `name` covers: an adapter that adapts no cached projection (an MLP-only adapter:
        its agents' K/V differ only through the hidden states) has an empty LR cache that covers every token."""
        return self.lr_lengths.get(name, 0) if self.adapts_cache(name) else len(self)

    def adapts_cache(self, name: str) -> bool:
        """Whether the adapter behind LR cache `name` (an agent's, or the first agent's for a shared cache) adapts
        k_proj or v_proj in any layer."""
        names = self.runtime.agents.spec.names
        agent = name if name in names else names[0]
        return any(agent in getattr(split, side).down for split in self.runtime.splits for side in SPLIT_SIDES)

    def lr(self, name: str) -> list[dict[str, torch.Tensor]] | None:
        """The LR cache `name` (per layer {"key"|"value": (1, n, r)}, views), or None if there is none."""
        layers = self.low_rank.get(name)
        if layers is None:
            return None
        length = self.lr_length(name)
        return [{side: grown.view(length) for side, grown in layer.items()} for layer in layers]

    # ------------------------------------------------------------------------------------------- writing

    def base_update(
        self, forward: ChunkForward, start: int, producer: str, adapter: str | None, row: int = 0, skip: int = 0
    ) -> tuple[StoreUpdate, float]:
        """The base K/V of the tokens `forward` computed from its `skip`-th on (timeline indices start..), batch row
        `row`, taken from the forward itself, as an update (the store is not changed), and its FLOPs.

        V_base is the value projection's base output (peft's `base_layer`, `HiddenTap.base`), as PReCache's
        `precache_value` and LRAgent's `Linear.forward` take it. K_base is the forward's own cached key where the
        row's adapter (`adapter`; None: adapters off) does not target k_proj — it is the base key, as the papers'
        code reads it from k_proj — else RoPE of the key projection's base output (6 FLOPs per entry: a rotation the
        forward's own keys do not give); for a model with a key norm, that base output un-normalised and
        un-rotated (every view normalises and rotates base + adapter). Nothing is projected again: the only FLOPs
        are those rotations."""
        runtime = self.runtime
        assert forward.base is not None  # captured: every forward of a low-rank policy's turn captures
        cached = runtime.kv_of(forward.cache)
        base, flops = [], 0.0
        for layer, (split, outputs) in enumerate(zip(runtime.splits, forward.base)):
            values = heads(outputs["value"][row : row + 1, skip:], runtime.head_dim)
            count = int(values.shape[2])
            if runtime.key_norms is None and (adapter is None or adapter not in split.key.up):
                keys = cached[layer][0]
                end = int(keys.shape[2])
                keys = keys[row : row + 1, :, end - count : end]
            else:
                keys = heads(outputs["key"][row : row + 1, skip:], runtime.head_dim)
                if runtime.key_norms is None:
                    cos, sin = runtime.rope_tables(start + count, layer)
                    keys = runtime.ropes[layer].rotate(keys.float(), cos[start:], sin[start:]).to(keys.dtype)
                    flops += 6.0 * keys.numel()
            base.append((keys, values))
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
            if not self.base:
                self.base = [KVBuffer.of(keys, values) for keys, values in update.base]
            else:
                for buffer, (keys, values) in zip(self.base, update.base):
                    buffer.write(len(self), keys[:, :, skip:], values[:, :, skip:])
            for name, layers in update.low_rank.items():
                self.write_low_rank(
                    name, self.lr_length(name), [{p: t[:, skip:] for p, t in layer.items()} for layer in layers]
                )
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
    def forward_down_projections(
        runtime: Runtime, forward: ChunkForward, agent: str, skip: int = 0
    ) -> list[dict[str, torch.Tensor]]:
        """X·A_agentᵀ of the tokens `forward` computed from its `skip`-th on, as the forward's own LoRA layers
        computed them (`HiddenTap.down`: the adapter's rows of the batch): per layer {"key"|"value": (1, n, r)} for
        the projections `agent` adapts, in the forward's hidden dtype (the LR cache's storage dtype). No FLOPs
        beyond the forward's: LRAgent's and PReCache's code append the forward's own `lora_A(x)` to the LR cache."""
        assert forward.down is not None and forward.hidden is not None  # captured
        dtype = forward.hidden[0].dtype
        return [
            {
                side: layer[side][agent][:1, skip:].to(dtype)
                for side in SPLIT_SIDES
                if agent in layer.get(side, {}) and agent in getattr(split, side).down
            }
            for split, layer in zip(runtime.splits, forward.down)
        ]

    @staticmethod
    def down_projection_flops(runtime: Runtime, projections: dict[str, list[dict[str, torch.Tensor]]]) -> float:
        """Analytic FLOPs of `down_projections`' result: 2·n·d_model per output column."""
        return sum(
            2.0 * t.shape[1] * runtime.hidden_size * t.shape[-1]
            for layers in projections.values()
            for layer in layers
            for t in layer.values()
        )

    def write_low_rank(self, name: str, start: int, layers: list[dict[str, torch.Tensor]]) -> None:
        """Write `layers` (per layer {"key"|"value": (1, n, r)}) into the LR cache `name` at tokens start..start+n
        (start ≤ its length); its length becomes start + n. Nothing for an adapter that adapts no cached projection
        (`adapts_cache`)."""
        if not any(layer for layer in layers):
            return
        current = self.low_rank.get(name)
        if current is None:
            if start:
                raise RuntimeError(f"LR cache {name} does not exist; it cannot start at token {start}")
            self.low_rank[name] = [{p: GrowingTensor.of(t, 1) for p, t in layer.items()} for layer in layers]
        else:
            for grown, new in zip(current, layers):
                for p, t in new.items():
                    grown[p].write(start, t)
        self.lr_lengths[name] = start + next(t.shape[1] for layer in layers for t in layer.values())

    # ------------------------------------------------------------------------------------------- reading

    def sides(
        self, layer: int, agent: str | None, low_rank: list[dict[str, torch.Tensor]] | None
    ) -> dict[str, torch.Tensor]:
        """The LR caches of `low_rank` at `layer` that `agent`'s B applies to: "key"/"value" → (1, n, r)."""
        if agent is None or low_rank is None:
            return {}
        split = self.runtime.splits[layer]
        return {
            projection: low_rank[layer][projection]
            for projection in SPLIT_SIDES
            if projection in low_rank[layer] and agent in getattr(split, projection).up
        }

    def expand(
        self, layer: int, agent: str | None, sides: dict[str, torch.Tensor], base: KV, begin: int
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], float]:
        """One layer's (K, V) of n tokens at timeline indices begin.. as `agent` sees them — their base `base`
        ((1, H_kv, n, D) each) plus B applied to each LR cache in `sides` ("key"|"value" → (1, n, r)); the other
        side the base itself; keys normalised and rotated for a model with a key norm — and the FLOPs. Expansions
        run in the adapter's dtype, RoPE from the runtime's cos/sin tables, sums in float32 (returned so: the
        caller casts where it stores them)."""
        runtime = self.runtime
        split = runtime.splits[layer]
        key_norm = None if runtime.key_norms is None else runtime.key_norms[layer]
        end = begin + int(base[0].shape[2])
        flops = 0.0
        finished: list[torch.Tensor] = []
        for projection, source in zip(("key", "value"), base):
            norm = key_norm if projection == "key" else None
            summed = source
            if projection in sides:
                assert agent is not None  # sides is empty without an agent
                proj = getattr(split, projection)
                factors = sides[projection]
                expanded = heads(proj.expand(factors.to(proj.up[agent].dtype), agent), runtime.head_dim).float()
                flops += 2.0 * expanded.numel() * factors.shape[-1]
                if projection == "key" and norm is None:
                    cos, sin = runtime.rope_tables(end, layer)
                    expanded = runtime.ropes[layer].rotate(expanded, cos[begin:], sin[begin:])
                summed = expanded.add_(source)
            if norm is not None:  # k_norm of the sum in the model's dtype, as the layer applies it, then RoPE
                cos, sin = runtime.rope_tables(end, layer)
                summed = runtime.ropes[layer].rotate(norm(summed.to(source.dtype)).float(), cos[begin:], sin[begin:])
                flops += KEY_FINISH_FLOPS * summed.numel()
            finished.append(summed)
        return (finished[0], finished[1]), flops

    def write_expanded(
        self,
        layer: int,
        agent: str | None,
        sides: dict[str, torch.Tensor],
        target: KVBuffer,
        begin: int,
        end: int,
        offset: int = 0,
    ) -> float:
        """Write one layer's K/V of the store's tokens begin..end as `agent` sees them (`expand`; `sides`:
        "key"|"value" → (1, ≥ end − offset, r), its first token at timeline index `offset`) into the same slots of
        `target`; returns the FLOPs."""
        base_keys, base_values = self.base[layer].view(end)
        sliced = {side: t[:, begin - offset : end - offset] for side, t in sides.items()}
        (keys, values), flops = self.expand(
            layer, agent, sliced, (base_keys[:, :, begin:end], base_values[:, :, begin:end]), begin
        )
        target.keys.slot(begin, end - begin).copy_(keys)
        target.values.slot(begin, end - begin).copy_(values)
        return flops

    def assemble(
        self,
        agent: str | None,
        low_rank: list[dict[str, torch.Tensor]] | None,
        length: int,
        expand_values: bool = True,
        spare: int = 0,
    ) -> StoreView:
        """Per layer (K, V) of the first `length` tokens as `agent` sees them: the base plus `agent`'s B applied to
        the LR cache `low_rank` (per layer {"key"|"value": (1, ≥length, r)}); with `low_rank=None`, the base alone.

        With `expand_values=False` the values stay V_base and the rank-r part is returned per layer as
        `LoraValues(v_lr (1, length, r), lora_b (H_kv, r, D))`, both in the cache's dtype, for
        Flash-LoRA-Attention. Expanded layers are written in the cache's dtype into a fresh buffer with room for
        `spare` more tokens; a layer with nothing to expand is the base itself, appendable in place when `length`
        is the store's length."""
        runtime = self.runtime
        if not self.base:
            return StoreView(runtime.empty_kv(), 0.0, None, None)
        kv: list[KV] = []
        buffers: list[KVBuffer] = []
        lora_values: list[LoraValues | None] = []
        flops = 0.0
        for layer, base in enumerate(self.base):
            base_keys, base_values = base.view(length)
            sides = self.sides(layer, agent, low_rank)
            layer_lora = None
            if agent is not None and "value" in sides and not expand_values:
                up = runtime.splits[layer].value.up[agent]
                lora_b = lora_b_per_head(up, runtime.kv_heads, 1.0).to(base_values.dtype)
                layer_lora = LoraValues(sides.pop("value")[:, :length], lora_b)
            lora_values.append(layer_lora)
            if not sides and runtime.key_norms is None:
                kv.append((base_keys, base_values))
                buffers.append(base if length == len(self) else KVBuffer.of(base_keys, base_values, spare))
                continue
            turn = KVBuffer.like(base_keys, base_values, length + spare)
            flops += self.write_expanded(layer, agent, sides, turn, 0, length)
            kv.append(turn.view(length))
            buffers.append(turn)
        return StoreView(kv, flops, lora_values if any(v is not None for v in lora_values) else None, buffers)

    def extend_view(
        self,
        agent: str,
        low_rank: list[dict[str, torch.Tensor]] | None,
        view: list[KVBuffer] | None,
        have: int,
        length: int,
        spare: int = 0,
    ) -> tuple[list[KVBuffer], float]:
        """An agent's kept view (per layer a `KVBuffer` holding what `assemble` would give for its first `have`
        tokens) extended to `length` tokens: only tokens have..length are expanded and written (into the slots
        after the valid ones; a new view is allocated when `view` is None). Returns the view and the FLOPs."""
        if view is None:
            view = [KVBuffer.like(*buffer.view(0), length + spare) for buffer in self.base]
        flops = sum(
            self.write_expanded(layer, agent, self.sides(layer, agent, low_rank), target, have, length)
            for layer, target in enumerate(view)
        )
        return view, flops

    def truncate(self, keep: int) -> None:
        """Forget the tokens at timeline index `keep` or later (base and LR caches)."""
        del self.producers[keep:]
        self.lr_lengths = {name: min(length, keep) for name, length in self.lr_lengths.items()}

    # ------------------------------------------------------------------------------------------- memory

    def live_tensors(self) -> dict[str, list[torch.Tensor]]:
        runtime = self.runtime
        tensors = {"base cache": runtime.held(self.base, len(self))}
        for name, layers in self.low_rank.items():
            length = self.lr_length(name)
            held = [runtime.held_length(index, length) for index in range(len(layers))]
            tensors[f"LR cache:{name}"] = [
                t.view(length).narrow(1, length - keep, keep)
                for layer, keep in zip(layers, held)
                for t in layer.values()
            ]
        return tensors

    def analytic_bytes(self) -> dict[str, int]:
        runtime = self.runtime
        itemsize = runtime.dtype.itemsize
        sizes = {"base cache": runtime.kv_bytes(len(self))}
        for name in self.low_rank:
            agent = name if name in runtime.agents.spec.names else runtime.agents.spec.names[0]
            length = self.lr_length(name)
            sizes[f"LR cache:{name}"] = itemsize * sum(
                getattr(split, p).down[agent].shape[0] * runtime.held_length(index, length)
                for index, split in enumerate(runtime.splits)
                for p in SPLIT_SIDES
                if agent in getattr(split, p).down
            )
        return sizes


VIEWS = Option(
    "per-turn",
    ("per-turn", "kept"),
    help="per-turn: the acting agent's view (base + its B over the LR cache) is expanded over the whole context every "
    "turn and only the base and LR caches are stored; kept: each agent keeps its expanded view and extends it with "
    "new tokens only (a kvprof extra: no re-expansion, one full cache per agent in memory)",
)


@dataclass
class LowRankContext(Context):
    """updates: the store updates the turn computed in `on_prefill` / `on_decode_step` (and for the new tokens
    between moved spans), appended by `commit`; view: with `views=kept`, the acting agent's kept view, valid for the
    `reused` tokens once committed; moved_updates: the store updates of the turn's moved spans (base K/V re-aligned,
    LR caches copied: `LowRankPolicy.moved_update`); pieces: the new tokens computed between them (timeline index of
    the first, ids)."""

    updates: list[StoreUpdate] = field(default_factory=list)
    view: list[KVBuffer] | None = None
    moved_updates: list[StoreUpdate] = field(default_factory=list)
    pieces: list[tuple[int, list[int]]] = field(default_factory=list)


LowRankContextT = TypeVar("LowRankContextT", bound=LowRankContext)


class LowRankPolicy(SharingPolicy[LowRankContextT]):
    """Shared base of the policies that keep a `LowRankStore` (lora mode): the store, its memory, the context an
    agent gets from it (base cache plus its B applied to the LR cache it reads), and the turn's store updates.

    Phases: the base K/V and LR caches of the tokens a turn adds to the timeline are taken from the forward that
    processed them (see the module docstring) — during prefill for the chunk, at each decode step for an output
    token — and appended after the turn by `commit`.

    What is recomputed per turn: with `views=per-turn` (a policy that declares the `VIEWS` option; the default)
    the acting agent's view of the whole reused context — K_base + RoPE(K_lr·B_j) and V_base + V_lr·B_j — is
    expanded again every turn (the stored state is only the base and LR caches; under Flash-LoRA-Attention the
    values are not expanded at all). A token's view for a given agent never changes once the token is stored, so
    `views=kept` keeps each agent's expanded view and extends it with the tokens added since its last turn
    (memory: one full cache per agent that has acted, counted as `view:AGENT`).

    Moved spans (`kvprof.policies.moved`; in lora mode, ids an earlier turn processed at other positions: the
    question or another agent's reply after this agent's own system prompt): the store keeps, of each turn later
    turns read from, its base cache and every LR cache of those tokens; a moved span's base K/V are re-aligned (keys
    re-rotated by the shift; a key-norm model's stored keys are un-rotated and move as they are) and its LR caches
    copied (X·Aᵀ is position-free), and the reader attends to them as to any stored token: the base plus its B over
    its LR cache, the key part rotated at the reader's positions. The new tokens between moved spans are computed by
    the agent over the cache so far and stored as its chunk's are (`extend_over_moved_store`). None of the authors'
    code meets a moved span (each stores one timeline per conversation); this is their stored state moved as
    FullShared moves a cache."""

    modes: ClassVar[tuple[str, ...]] = ("lora",)
    timeline_state: ClassVar[tuple[str, ...]] = ("store", "views", "view_lengths")
    moves_spans = True
    stacks_layers = True

    def check(self, runtime: Runtime) -> None:
        super().check(runtime)
        runtime.require_split()
        if self.settings.get("views") == "kept" and runtime.lora_attention:
            raise KvprofError(
                f"policy {self.name} option views=kept keeps each agent's expanded values, which "
                "Flash-LoRA-Attention never materialises; use views=per-turn with --lora-attention."
            )

    def reset(self) -> None:
        self.store = LowRankStore(self.runtime)
        self.views: dict[str, list[KVBuffer]] = {}
        self.view_lengths: dict[str, int] = {}

    @property
    def needs_hidden(self) -> bool:
        return True

    def lr_name(self, agent: str) -> str:
        """The LR cache agent `agent` reads."""
        return agent

    def reused_span(self, shared: list[int]) -> int:
        """Shared tokens the store can serve to an input of `shared` tokens (at least one is left to compute)."""
        return min(len(self.store), len(shared) - 1)

    def store_view(
        self, agent: str, low_rank: list[dict[str, torch.Tensor]] | None, reused: int, spare: int
    ) -> LowRankContext:
        """The context of `agent` from the store: base cache + `agent`'s B over `low_rank` on `reused` tokens,
        values expanded or handed to Flash-LoRA-Attention as the runtime says; room for `spare` more tokens. With
        `views=kept` the agent's kept view, extended to `reused` tokens, which the turn then appends to in place."""
        if self.settings.get("views") == "kept" and reused:
            have = min(self.view_lengths.get(agent, 0), reused)
            view, flops = self.store.extend_view(agent, low_rank, self.views.get(agent), have, reused, spare)
            return LowRankContext(
                kv=[buffer.view(reused) for buffer in view], reused=reused, extra_flops=flops, buffers=view, view=view
            )
        view_of_store = self.store.assemble(agent, low_rank, reused, not self.runtime.lora_attention, spare)
        return LowRankContext(
            kv=view_of_store.kv,
            reused=reused,
            extra_flops=view_of_store.flops,
            lora_values=view_of_store.lora_values,
            buffers=view_of_store.buffers,
        )

    def keep_span_source(self, turn: int, lo: int, hi: int) -> None:
        """Keep the store's tokens [lo, hi) of the last turn's sequence (turn `turn`): base K/V and every LR cache
        that covers them, copied (the store's storage is overwritten after a truncation)."""
        if self.last_turn is None:
            return
        hi = min(hi, len(self.store))
        low_rank = {name: self.store.lr(name) or [] for name in self.store.low_rank if self.store.lr_length(name) >= hi}
        agent, _, inputs, _ = self.last_turn
        base = [buffer.view(hi) for buffer in self.store.base]
        self.span_store.keep(turn, 0, base, lo, hi, agent, inputs, low_rank)

    def moved_update(self, span: MovedSpan) -> tuple[StoreUpdate, float]:
        """The store update of a moved span (timeline indices span.begin..): its kept base K/V, keys re-rotated by
        the shift (not for a key-norm model, whose stored keys are un-rotated), values as they are, and its kept LR
        caches; the FLOPs of the rotation."""
        kv, source = self.span_store.span(span)
        delta, flops = span.begin - source, 0.0
        if delta and self.runtime.key_norms is None:
            kv = self.runtime.ropes.rotate_kv(kv, delta)
            flops = 6.0 * sum(keys.numel() for keys, _ in kv)
        producer = self.span_store.source(span).agent
        return StoreUpdate(span.begin, producer, kv, self.span_store.low_rank(span)), flops

    def extend_over_moved_store(self, agent: str, shared: list[int], context: LowRankContextT) -> None:
        """Extend `context` over the turn's moved spans after its reused tokens (`extend_context`): the new tokens
        before each computed by the policy's own forward (`adapter_rows`, its attention context) and stored by
        `on_forward` as the chunk's are, then each span's store update (`moved_update`) and `agent`'s view of it —
        base plus its B over the span's LR cache `lr_name(agent)`, values expanded; with `adapter_rows`, each row as
        that row's adapter sees it, the adapter-free row the base alone — appended."""
        rows = self.adapter_rows(agent) or [agent]

        def span_kv(span: MovedSpan, position: int) -> tuple[list[KV], float]:
            update, flops = self.moved_update(span)
            context.moved_updates.append(update)
            low_rank = update.low_rank.get(self.lr_name(agent))
            kv = []
            for layer, base in enumerate(update.base):
                parts = []
                for row in rows:
                    reader = None if row == "__base__" else row
                    sides = self.store.sides(layer, reader, low_rank)
                    (keys, values), expansion = self.store.expand(layer, reader, sides, base, span.begin)
                    parts.append((keys.to(base[0].dtype), values.to(base[1].dtype)))
                    flops += expansion
                kv.append((torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])))
            return kv, flops

        def stored(begin: int, forward: ChunkForward) -> None:
            context.extra_flops += self.on_forward(agent, context, forward, begin)

        self.extend_context(
            agent,
            shared,
            context,
            on_piece=stored,
            span_kv=span_kv,
            forward=lambda ids, cache, start: self._forward(agent, ids, cache, start, context),
        )
        position = context.reused  # the new tokens between moved spans, for a policy that stores them after the turn
        for begin, end in context.moved_spans:
            if begin > position:
                context.pieces.append((position, shared[position:begin]))
            position = end

    def keep_view(self, chunk: Chunk[LowRankContextT]) -> None:
        """With `views=kept`, make the turn's extended view the agent's (valid up to the reused tokens: the turn
        wrote its own K/V after them)."""
        if chunk.context.view is not None:
            self.views[chunk.agent] = chunk.context.view
            self.view_lengths[chunk.agent] = chunk.context.reused

    def new_tokens(self, context: LowRankContext, forward: ChunkForward, start: int) -> int | None:
        """How many of the tokens `forward` computed (timeline indices start..; captured) the store or an earlier
        update of this turn already holds (the rest are new); None when every token is known."""
        assert forward.hidden is not None  # needs_hidden: every forward of the turn captures
        known = max([len(self.store)] + [u.start + len(u) for u in context.updates + context.moved_updates])
        skip = max(known - start, 0)
        return None if skip >= forward.hidden[0].shape[1] else skip

    def on_prefill(self, agent: str, context: LowRankContextT, forward: ChunkForward, start: int) -> float:
        return self.on_forward(agent, context, forward, start)

    def on_decode_step(self, agent: str, context: LowRankContextT, forward: ChunkForward, start: int) -> float:
        return self.on_forward(agent, context, forward, start)

    def on_forward(self, agent: str, context: LowRankContextT, forward: ChunkForward, start: int) -> float:
        """The store work on the tokens one forward of the turn computed (the chunk in prefill, one token per decode
        step: the same work in both phases); returns its analytic FLOPs."""
        return 0.0

    def commit(self, chunk: Chunk[LowRankContextT]) -> float:
        self.store.apply(chunk.context.updates + chunk.context.moved_updates)
        self.keep_view(chunk)
        return 0.0

    def truncate(self, keep: int) -> None:
        self.store.truncate(keep)
        self.view_lengths = {agent: min(length, keep) for agent, length in self.view_lengths.items()}

    def live_tensors(self) -> dict[str, list[torch.Tensor]]:
        tensors = self.store.live_tensors()
        for agent, view in self.views.items():
            tensors[f"view:{agent}"] = self.runtime.held(view, self.view_lengths[agent])
        return tensors

    def analytic_bytes(self) -> dict[str, int]:
        sizes = self.store.analytic_bytes()
        for agent, length in self.view_lengths.items():
            sizes[f"view:{agent}"] = self.runtime.kv_bytes(length)
        return sizes
