"""The store the low-rank policies share: a base cache plus named rank-r LR caches on the shared timeline (lora mode).

Per layer: K_base = RoPE(X·W0_kᵀ), V_base = X·W0_vᵀ, each (1, H_kv, N, D), and LR caches X·Aᵀ (1, N_c, r) named by
agent or "shared". Agent j sees K = K_base + RoPE((X·Aᵀ)·s·B_jᵀ), V = V_base + (X·Aᵀ)·s·B_jᵀ (the value expansion is
the torch reference of Flash-LoRA-Attention, same result). Key-norm models (Qwen3, OLMo 2) store K_base un-normalised
and un-rotated; every view applies k_norm and RoPE to the sum (counted in its FLOPs). Dtypes as peft: adapter-dtype
expansions, float32 sums, caches stored in the model's dtype. Background: docs/design.md#sharing-policies.

- As the authors' code (LRAgent, PReCache), what the processing forward computed is stored, never projected again:
  base K/V from its projections (`LowRankStore.base_update`), its X·Aᵀ from its own `lora_A`
  (`LowRankStore.forward_down_projections`); only other agents' X·A_kᵀ (PReCache's precomputation) are extra GEMMs.
- Moved spans (kvprof; the authors' code stores one timeline per conversation and never meets one): base K/V
  re-aligned (a key-norm model's un-rotated keys move as they are), LR caches copied (position-free).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import torch

from kvprof.errors import KvprofError
from kvprof.kernels.attention import KERNEL, lora_b_per_head
from kvprof.kernels.expansion import expand_into as native_expand_into
from kvprof.kernels.transformers_attention import LoraValues
from kvprof.model.buffers import GrowingTensor, KVBuffer, Workspace
from kvprof.model.lora import SPLIT_SIDES, heads
from kvprof.model.runtime import KV, ChunkForward, Runtime
from kvprof.policies.base import SharingPolicy
from kvprof.policies.options import Option
from kvprof.policies.turns import Chunk, Context
from kvprof.traces.reuse import MovedSpan

KEY_FINISH_FLOPS = 10.0  # per key entry, k_norm (≈ 4) and RoPE (6) of a view's keys, for models with a key norm
EXPANSION_BLOCK = 2048  # tokens of a view expanded at a time: its float32 intermediates stay in cache


@dataclass
class StoreUpdate:
    """Base K/V and LR caches of consecutive timeline tokens from `start`, computed in a turn, appended by `commit`.

    producer: an agent or "neutral"; base: per layer (K_base, V_base) (1, H_kv, n, D); low_rank: name → per layer
    {"key"|"value": (1, n, r)}."""

    start: int
    producer: str
    base: list[KV]
    low_rank: dict[str, list[dict[str, torch.Tensor]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.base[0][0].shape[2]) if self.base else 0


@dataclass
class StoreView:
    """What an agent attends to: per layer (K, V) (1, H_kv, length, D), views of `buffers`; the expansions' `flops`;
    `lora_values`: rank-r value sides for Flash-LoRA-Attention, or None."""

    kv: list[KV]
    flops: float
    lora_values: list[LoraValues | None] | None
    buffers: list[KVBuffer] | None


def copy_unless_same(target: torch.Tensor, source: torch.Tensor) -> None:
    """target ← source, unless target is source's own memory (the store's values a view keeps, `assemble`)."""
    if target.data_ptr() != source.data_ptr():
        target.copy_(source)


class LowRankStore:
    """Base cache (per layer a `KVBuffer`) and named LR caches (per layer {"key"|"value": `GrowingTensor`
    (1, ≥ n, r)}), growing in place."""

    def __init__(self, runtime: Runtime, workspace: Workspace):
        self.runtime = runtime
        self.workspace = workspace
        self.up_heads: dict[tuple[int, str, str], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.base: list[KVBuffer] = []
        self.low_rank: dict[str, list[dict[str, GrowingTensor]]] = {}
        self.lr_lengths: dict[str, int] = {}
        self.producers: list[str] = []

    def __len__(self) -> int:
        return len(self.producers)

    def lr_length(self, name: str) -> int:
        """Tokens the LR cache `name` covers (every token for an adapter adapting no cached projection)."""
        return self.lr_lengths.get(name, 0) if self.adapts_cache(name) else len(self)

    def adapts_cache(self, name: str) -> bool:
        """Whether the adapter behind LR cache `name` adapts k_proj or v_proj in any layer."""
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
        """Base K/V of row `row`'s tokens from the `skip`-th on (timeline start..) as an update, and its FLOPs.

        V_base: v_proj's `base_layer` output (as PReCache's `precache_value`, LRAgent's `Linear.forward`). K_base: the
        forward's key unless `adapter` targets k_proj, else RoPE of k_proj's base output (6 FLOPs per entry; a
        key-norm model's un-normalised, un-rotated)."""
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

    def make_room(self, end: int) -> None:
        """Room for `end` timeline tokens in the base cache and every LR cache (`KVBuffer.make_room`; a policy that
        extends only the acting agent's LR cache, as BaseShared's commit does, leaves the others' rank-r room unused
        until their own calls)."""
        for buffer in self.base:
            buffer.make_room(end)
        for layers in self.low_rank.values():
            for layer in layers:
                for grown in layer.values():
                    grown.make_room(end)

    def apply(self, updates: list[StoreUpdate]) -> None:
        """Append the updates' tokens the store lacks, in order (each starting at or before the store's end)."""
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
        """X·A_kᵀ for every agent k, one GEMM per projection: per layer (1, n, d_model) → {agent: per layer
        {"key"|"value": (1, n, r)}}, computed in the adapters' dtype, returned in X's."""
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
        """X·A_agentᵀ of the forward's tokens from the `skip`-th on, from its own LoRA layers (`HiddenTap.down`):
        per layer {"key"|"value": (1, n, r)}; no extra FLOPs (as the authors' code appends `lora_A(x)`)."""
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
        """Write `layers` (per layer {"key"|"value": (1, n, r)}) into LR cache `name` at start..start+n (start ≤ its
        length), which becomes its length."""
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
        """One layer's (K, V) (1, H_kv, n, D) from timeline index `begin` as `agent` sees them: `base` plus B over
        `sides` ("key"|"value" → (1, n, r)), summed in float32, in `base`'s dtype; and the FLOPs."""
        keys, values = (torch.empty_like(side) for side in base)
        return (keys, values), self.expand_into(layer, agent, sides, base, begin, (keys, values))

    def expand_into(
        self, layer: int, agent: str | None, sides: dict[str, torch.Tensor], base: KV, begin: int, out: KV
    ) -> float:
        """`expand` written into `out` ((K, V) (1, H_kv, n, D), any dtype): by the fused CPU kernel where it runs
        (`kvprof.kernels.expansion`), else in torch `EXPANSION_BLOCK` tokens at a time; the FLOPs."""
        if not self._expand_native(layer, agent, sides, base, begin, out):
            length = int(base[0].shape[2])
            for lo in range(0, length, EXPANSION_BLOCK):
                hi = min(lo + EXPANSION_BLOCK, length)
                block_sides = {side: t[:, lo:hi] for side, t in sides.items()}
                block_base = (base[0][:, :, lo:hi], base[1][:, :, lo:hi])
                block_out = (out[0][:, :, lo:hi], out[1][:, :, lo:hi])
                self._expand_block(layer, agent, block_sides, block_base, begin + lo, block_out)
        return self._expansion_flops(layer, agent, sides, base)

    def _expansion_flops(self, layer: int, agent: str | None, sides: dict[str, torch.Tensor], base: KV) -> float:
        """FLOPs of `expand_into`: 2·r per expanded entry, RoPE of the rank-r key term (2·r + 3 per rotary entry), and
        for a key-norm model k_norm and RoPE of every key (`KEY_FINISH_FLOPS`)."""
        keys = base[0]
        flops = KEY_FINISH_FLOPS * keys.numel() if self.runtime.key_norms is not None else 0.0
        for projection, factors in sides.items():
            assert agent is not None  # sides is empty without an agent
            rank = factors.shape[-1]
            flops += 2.0 * base[SPLIT_SIDES.index(projection)].numel() * rank
            swapped = self._up_heads(layer, projection, agent)[1]
            if swapped is not None:
                flops += (2.0 * rank + 3.0) * (keys.numel() // keys.shape[-1]) * swapped.shape[-1]
        return flops

    def _expand_native(
        self, layer: int, agent: str | None, sides: dict[str, torch.Tensor], base: KV, begin: int, out: KV
    ) -> bool:
        """`expand_into` by the fused kernel; False where it cannot run (then the torch path writes all of `out`):
        a key-norm model, inputs other than float32 on CPU, no C compiler."""
        runtime = self.runtime
        if runtime.key_norms is not None:
            return False
        end = begin + int(base[0].shape[2])
        for projection, source, target in zip(("key", "value"), base, out):
            if projection not in sides:
                copy_unless_same(target, source)
                continue
            assert agent is not None  # sides is empty without an agent
            per_head, swapped = self._up_heads(layer, projection, agent)
            cos = sin = None
            if swapped is not None:
                cos, sin = runtime.rope_tables(end, layer)
                cos, sin = cos[begin:], sin[begin:]
            if not native_expand_into(source, sides[projection], per_head, swapped, cos, sin, target):
                return False
        return True

    def _expand_block(
        self, layer: int, agent: str | None, sides: dict[str, torch.Tensor], base: KV, begin: int, out: KV
    ) -> None:
        """`expand_into` a block of tokens in torch (the sums in float32, cast once into `out`)."""
        runtime = self.runtime
        key_norm = None if runtime.key_norms is None else runtime.key_norms[layer]
        end = begin + int(base[0].shape[2])
        for projection, source, target in zip(("key", "value"), base, out):
            norm = key_norm if projection == "key" else None
            summed = source
            if projection in sides:
                assert agent is not None  # sides is empty without an agent
                per_head, swapped = self._up_heads(layer, projection, agent)
                factors = sides[projection].to(per_head.dtype)[:, None]  # (1, 1, n, r)
                expanded = (factors @ per_head).float()  # (1, H_kv, n, D)
                if swapped is not None:  # RoPE of the rank-r term: B·cos + swap(B)·sin, the swap folded into B
                    cos, sin = runtime.rope_tables(end, layer)
                    turned = expanded[..., : swapped.shape[-1]]
                    turned.mul_(cos[begin:]).addcmul_((factors @ swapped).float(), sin[begin:])
                if norm is None:
                    torch.add(expanded, source, out=target)
                    continue
                summed = expanded.add_(source)
            if norm is None:
                copy_unless_same(target, source)
                continue
            # k_norm of the sum in the model's dtype, as the layer applies it, then RoPE
            cos, sin = runtime.rope_tables(end, layer)
            target.copy_(runtime.ropes[layer].rotate(norm(summed.to(source.dtype)).float(), cos[begin:], sin[begin:]))

    def _up_heads(self, layer: int, projection: str, agent: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`agent`'s s·B of `projection` at `layer` per head (H_kv, r, D) and, for keys RoPE applies to without a key
        norm, its rotary channels swapped (H_kv, r, R) (`Rope.swap`); cached."""
        cached = self.up_heads.get((layer, projection, agent))
        if cached is None:
            runtime = self.runtime
            per_head = getattr(runtime.splits[layer], projection).up_per_head(agent, runtime.head_dim)
            rotated = projection == "key" and runtime.key_norms is None
            cached = (per_head, runtime.ropes[layer].swap(per_head) if rotated else None)
            self.up_heads[(layer, projection, agent)] = cached
        return cached

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
        """Write `expand` of tokens begin..end into the same slots of `target` (`sides` start at `offset`); FLOPs."""
        base_keys, base_values = self.base[layer].view(end)
        sliced = {side: t[:, begin - offset : end - offset] for side, t in sides.items()}
        slots = (target.keys.slot(begin, end - begin), target.values.slot(begin, end - begin))
        return self.expand_into(
            layer, agent, sliced, (base_keys[:, :, begin:end], base_values[:, :, begin:end]), begin, slots
        )

    def assemble(
        self,
        agent: str | None,
        low_rank: list[dict[str, torch.Tensor]] | None,
        length: int,
        expand_values: bool = True,
        spare: int = 0,
        slot: str = "view",
    ) -> StoreView:
        """Per layer (K, V) of the first `length` tokens as `agent` sees them: base + B over `low_rank` (per layer
        {"key"|"value": (1, ≥ length, r)}; None: the base alone), with room for `spare` more, written into the
        workspace's buffers `slot` (views alive at once need different slots).

        `expand_values=False`: values stay V_base, the rank-r side returned as `LoraValues(v_lr (1, length, r),
        lora_b (H_kv, r, D))`."""
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
                buffers.append(
                    base if length == len(self) else self.workspace.copy(slot, layer, base_keys, base_values, spare)
                )
                continue
            turn = self.workspace.buffer(slot, layer, base_keys, base_values, length + spare)
            if layer_lora is not None and length == len(self):
                # V_base is the store's own: the turn appends after the store's tokens (scratch until `commit`
                # writes their base values there), as the no-side views above do
                turn = KVBuffer(turn.keys, base.values)
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
        """Extend a kept view (valid for `have` tokens; None: new) to `length` tokens; the view and the FLOPs."""
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
    """updates: the turn's store updates, appended by `commit`; view: the kept view (`views=kept`); moved_updates:
    the moved spans' updates; pieces: new tokens between them (first timeline index, ids)."""

    updates: list[StoreUpdate] = field(default_factory=list)
    view: list[KVBuffer] | None = None
    moved_updates: list[StoreUpdate] = field(default_factory=list)
    pieces: list[tuple[int, list[int]]] = field(default_factory=list)


LowRankContextT = TypeVar("LowRankContextT", bound=LowRankContext)


class LowRankPolicy(SharingPolicy[LowRankContextT]):
    """Base of the policies keeping a `LowRankStore`: the store, its memory, agents' views, the turn's updates.

    Store updates come from the forward that processed the tokens (prefill, each decode step), appended by `commit`.
    `views=per-turn` (default): the agent's view of the reused context is expanded every turn; `views=kept`
    (kvprof): each agent's view is kept and extended (memory `view:AGENT`)."""

    modes: ClassVar[tuple[str, ...]] = ("lora",)
    timeline_state: ClassVar[tuple[str, ...]] = ("store", "views", "view_lengths")
    moves_spans = True
    stacks_layers = True

    def check(self, runtime: Runtime) -> None:
        super().check(runtime)
        runtime.require_split()
        if self.settings.get("views") == "kept" and runtime.lora_attention == KERNEL:
            raise KvprofError(
                f"policy {self.name} option views=kept keeps each agent's expanded values, which "
                "Flash-LoRA-Attention never materialises; use views=per-turn with --lora-attention."
            )

    def reset(self) -> None:
        self.store = LowRankStore(self.runtime, self.workspace)
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
        """`agent`'s context from the store on `reused` tokens (room for `spare` and the call's output); the kept view
        with `views=kept`."""
        room = self.with_output(spare)
        if self.settings.get("views") == "kept" and reused:
            have = min(self.view_lengths.get(agent, 0), reused)
            view, flops = self.store.extend_view(agent, low_rank, self.views.get(agent), have, reused, room)
            return LowRankContext(
                kv=[buffer.view(reused) for buffer in view], reused=reused, extra_flops=flops, buffers=view, view=view
            )
        expand_values = not self.runtime.values_as_stored(spare, reused)
        view_of_store = self.store.assemble(agent, low_rank, reused, expand_values, room)
        return LowRankContext(
            kv=view_of_store.kv,
            reused=reused,
            extra_flops=view_of_store.flops,
            lora_values=view_of_store.lora_values,
            buffers=view_of_store.buffers,
        )

    def keep_span_source(self, turn: int, lo: int, hi: int) -> None:
        """Copy the store's tokens [lo, hi) of turn `turn` (base K/V, every covering LR cache) for moved spans."""
        if self.last_turn is None:
            return
        hi = min(hi, len(self.store))
        low_rank = {name: self.store.lr(name) or [] for name in self.store.low_rank if self.store.lr_length(name) >= hi}
        agent, _, inputs, _ = self.last_turn
        base = [buffer.view(hi) for buffer in self.store.base]
        self.span_store.keep(turn, 0, base, lo, hi, agent, inputs, low_rank)

    def moved_update(self, span: MovedSpan) -> tuple[StoreUpdate, float]:
        """A moved span's store update (kept base K/V re-rotated unless key-norm, kept LR caches) and its FLOPs."""
        kv, source = self.span_store.span(span)
        delta, flops = span.begin - source, 0.0
        if delta and self.runtime.key_norms is None:
            kv = self.runtime.ropes.rotate_kv(kv, delta)
            flops = 6.0 * sum(keys.numel() for keys, _ in kv)
        producer = self.span_store.source(span).agent
        return StoreUpdate(span.begin, producer, kv, self.span_store.low_rank(span)), flops

    def extend_over_moved_store(self, agent: str, shared: list[int], context: LowRankContextT) -> None:
        """`extend_context` for the store: new tokens by the policy's own forward (stored by `on_forward`), each
        span's `moved_update` and the agent's view of it (per batch row: its adapter's; adapter-free: the base)."""
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
                    parts.append((keys, values))
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
        """With `views=kept`, keep the turn's view as the agent's (valid up to the reused tokens)."""
        if chunk.context.view is not None:
            self.views[chunk.agent] = chunk.context.view
            self.view_lengths[chunk.agent] = chunk.context.reused

    def new_tokens(self, context: LowRankContext, forward: ChunkForward, start: int) -> int | None:
        """How many of the forward's tokens (from `start`) are already held; None when all are."""
        assert forward.hidden is not None  # needs_hidden: every forward of the turn captures
        known = max([len(self.store)] + [u.start + len(u) for u in context.updates + context.moved_updates])
        skip = max(known - start, 0)
        return None if skip >= forward.hidden[0].shape[1] else skip

    def on_prefill(self, agent: str, context: LowRankContextT, forward: ChunkForward, start: int) -> float:
        return self.on_forward(agent, context, forward, start)

    def on_decode_step(self, agent: str, context: LowRankContextT, forward: ChunkForward, start: int) -> float:
        return self.on_forward(agent, context, forward, start)

    def on_forward(self, agent: str, context: LowRankContextT, forward: ChunkForward, start: int) -> float:
        """The store work on one forward's tokens (prefill chunk or decode token); its analytic FLOPs."""
        return 0.0

    def make_room(self, agent: str, shared: list[int]) -> None:
        end = self.with_output(len(shared))
        self.store.make_room(end)
        for buffer in self.views.get(agent, []):  # views=kept: the call appends to the agent's view in place
            buffer.make_room(end)

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
