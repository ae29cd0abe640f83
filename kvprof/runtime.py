"""Model execution for replay: one forward of a chunk over a given cache, greedy decoding, cache construction.

A `Runtime` wraps an `AgentSet` and knows the shapes every policy needs: layers, KV heads `H_kv`, head size `D`,
the rotary frequencies, the per-layer LoRA splits (`kvprof.lora`), and each agent's private prefix (its role
prompt in prompt mode; empty in lora mode). Caches handed to the model are transformers `DynamicCache`s built
from per-layer `(K, V)` tensors of shape (B, H_kv, L, D); keys post-RoPE, as transformers stores them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvprof.errors import KvprofError
from kvprof.kernels.transformers_attention import register_lora_attention
from kvprof.lora import HiddenTap, layer_splits
from kvprof.model import AgentSet, head_dim
from kvprof.rope import rotary_embedding
from kvprof.stopping import StopStrings

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class ChunkForward:
    """What one forward over a chunk of n tokens returns.

    logits: (B, n, vocab) fp32; hidden: per layer the attention inputs X, (B, n, d_model), when captured;
    cache: the DynamicCache after the forward (context + chunk).
    """

    logits: torch.Tensor
    hidden: list[torch.Tensor] | None
    cache: DynamicCache


class Runtime:
    """See module docstring. With `lora_attention`, the model attends through the registered "kvprof_lora"
    implementation (Flash-LoRA-Attention: the Triton kernel on CUDA, its torch reference elsewhere) and the
    low-rank policies hand it V_base and V_lr instead of expanded values; it behaves as sdpa otherwise."""

    def __init__(self, agents: AgentSet, lora_attention: bool = False):
        self.agents = agents
        self.lora_attention = lora_attention
        if lora_attention:
            agents.base_model.set_attn_implementation(register_lora_attention())
        self.model = agents.model
        config = agents.config
        self.num_layers = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        self.query_heads = config.num_attention_heads
        self.hidden_size = config.hidden_size
        rotary = rotary_embedding(agents.base_model)
        self.inv_freq = rotary.inv_freq.detach().float()
        self.attention_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.splits = layer_splits(agents) if agents.spec.mode == "lora" else []
        self.tap = HiddenTap(agents.base_model)
        self.dtype = agents.base_model.dtype
        self.device = agents.device
        self.prefixes: dict[str, list[int]] = {}
        if agents.spec.mode == "prompt":
            self.prefixes = {
                a.name: agents.tokenizer.encode(a.prompt, add_special_tokens=False) for a in agents.spec.agents
            }
        self._stop = StopStrings(agents.tokenizer, agents.spec.stop) if agents.spec.stop else None
        self.linear_params = sum(
            p.numel()
            for name, p in agents.base_model.named_parameters()
            if p.dim() == 2 and "embed" not in name and "lora_" not in name
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token's K and V take in the cache, over all layers: 2·layers·H_kv·D·itemsize."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def hidden_bytes_per_token(self) -> int:
        """Bytes of one token's captured attention inputs X over all layers: layers·d_model·itemsize."""
        return self.num_layers * self.hidden_size * self.dtype.itemsize

    def prefix(self, agent: str) -> list[int]:
        """The agent's private prefix tokens (its role prompt in prompt mode)."""
        return self.prefixes.get(agent, [])

    # ------------------------------------------------------------------------------------------ caches

    def cache_from(self, layers: list[KV]) -> DynamicCache:
        """A fresh DynamicCache holding `layers[i] = (K, V)`, each (B, H_kv, L, D). The tensors are not copied;
        the model's appends create new tensors, so the inputs stay untouched."""
        cache = DynamicCache()
        for index, (keys, values) in enumerate(layers):
            cache.update(keys, values, index)
        return cache

    def empty_kv(self, batch: int = 1) -> list[KV]:
        empty = torch.zeros(batch, self.kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
        return [(empty, empty) for _ in range(self.num_layers)]

    @staticmethod
    def kv_of(cache: DynamicCache) -> list[KV]:
        return [(layer.keys, layer.values) for layer in cache.layers]

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
        kwargs: dict[str, int | list[str]] = {"logits_to_keep": 1} if last_logits_only else {}
        if adapter_names is not None:
            kwargs["adapter_names"] = adapter_names
        try:
            with torch.inference_mode(), self.tap.capture() if capture else contextlib.nullcontext():
                with self.agents.activate(agent) if adapter_names is None else contextlib.nullcontext():
                    out = self.model(input_ids=tokens, position_ids=positions, cache=cache, use_cache=True, **kwargs)
        except torch.OutOfMemoryError:
            raise KvprofError(
                f"out of memory replaying a {tokens.shape[1]}-token chunk at position {start}; "
                "replay fewer trajectories, use --dtype bfloat16, or a larger device."
            ) from None
        hidden: list[torch.Tensor] | None = None
        if capture:
            hidden = []
            for h in self.tap.hidden:
                # The forward above ran every decoder layer inside tap.capture(), whose pre-hooks set each entry.
                assert h is not None
                hidden.append(h.detach())
        return ChunkForward(logits=out.logits.float(), hidden=hidden, cache=out.cache)

    def stops(self, new_tokens: list[int], max_new: int) -> bool:
        """Capture's stopping rules, for greedy generation: EOS, a stop string in the text of `new_tokens`
        (`kvprof.stopping`), or the token budget."""
        if len(new_tokens) >= max_new or new_tokens[-1] == self.agents.tokenizer.eos_token_id:
            return True
        return self._stop is not None and self._stop.found(new_tokens)

    def flops(self, tokens: int, context: int) -> float:
        """Analytic forward FLOPs of `tokens` new tokens after `context` cached ones: 2·params per token in the
        linear layers plus 4·H_q·D per attended key per layer (QKᵀ and PV)."""
        attended = tokens * context + tokens * (tokens + 1) / 2
        return 2.0 * self.linear_params * tokens + 4.0 * self.num_layers * self.query_heads * self.head_dim * attended
