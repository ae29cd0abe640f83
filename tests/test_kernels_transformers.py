"""Flash-LoRA-Attention registered as transformers' "kvprof_lora" attention, on a tiny Llama built from a config.

Expected outputs come from the same weights under "sdpa" with a forward hook on every v_proj that adds V_lr·B to
the projected values, i.e. attention over the expanded V = V_base + V_lr·B.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface

from kvprof.errors import KvprofError
from kvprof.kernels.chunk_attention import chunk_mask
from kvprof.kernels.transformers_attention import (
    LORA_ATTENTION,
    LoraAttentionContext,
    lora_attention_forward,
    register_lora_attention,
    use_lora_attention,
)

LAYERS, HEADS, KV_HEADS, RANK, VOCAB = 2, 4, 2, 8, 101


def tiny_llama(head_dim: int) -> LlamaForCausalLM:
    """A tiny Llama with seeded random weights under "sdpa" ("kvprof_lora" registered)."""
    register_lora_attention()
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HEADS * head_dim,
        intermediate_size=2 * HEADS * head_dim,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=head_dim,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def tiny_llama_pair(head_dim: int) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """The same random weights twice: under "sdpa" and under "kvprof_lora"."""
    sdpa_model = tiny_llama(head_dim)
    lora_model = copy.deepcopy(sdpa_model)
    lora_model.set_attn_implementation(LORA_ATTENTION)
    return sdpa_model, lora_model


def lora_values(total_len: int, head_dim: int, batch: int = 1, seed: int = 1) -> dict[int, tuple]:
    """Per layer: V_lr (B, L, r) shared by the KV heads and B (H_kv, r, D)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        layer: (
            torch.randn(batch, total_len, RANK, generator=generator),
            0.5 * torch.randn(KV_HEADS, RANK, head_dim, generator=generator) / RANK**0.5,
        )
        for layer in range(LAYERS)
    }


class ExpandedValueHooks:
    """Adds V_lr·B for positions [start, start + L) to each layer's v_proj output (B, L, H_kv·D)."""

    def __init__(self, model: LlamaForCausalLM, values: dict[int, tuple]):
        self.start = 0
        self.handles = []
        for layer, (v_lr, lora_b) in values.items():
            delta = torch.einsum("blr,hrd->blhd", v_lr, lora_b).flatten(2)
            self.handles.append(
                model.model.layers[layer].self_attn.v_proj.register_forward_hook(
                    lambda module, args, output, delta=delta: (
                        output + delta[:, self.start : self.start + output.shape[1]]
                    )
                )
            )

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def continuation_errors(head_dim: int, device: str = "cpu") -> list[float]:
    """Max |logits(kvprof_lora) − logits(expanded sdpa)| for a prefill of 10, a chunk of 5 and a decode step."""
    sdpa_model, lora_model = (model.to(device) for model in tiny_llama_pair(head_dim))
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(3)).to(device)
    values = {
        layer: (v_lr.to(device), lora_b.to(device)) for layer, (v_lr, lora_b) in lora_values(16, head_dim).items()
    }
    hooks = ExpandedValueHooks(sdpa_model, values)
    expected_cache, actual_cache = DynamicCache(), DynamicCache()
    errors = []
    with torch.no_grad():
        for start, stop in ((0, 10), (10, 15), (15, 16)):
            hooks.start = start
            expected = sdpa_model(ids[:, start:stop], cache=expected_cache).logits
            context = LoraAttentionContext()
            for layer, (v_lr, lora_b) in values.items():
                context.set(layer, v_lr[:, :stop], lora_b)
            with use_lora_attention(context):
                actual = lora_model(ids[:, start:stop], cache=actual_cache).logits
            errors.append((actual - expected).abs().max().item())
    hooks.remove()
    return errors


def peft_continuation_logits(
    head_dim: int, mode: str, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> list[torch.Tensor]:
    """Logits of a tiny Llama with a peft LoRA adapter on v_proj (random A and B), for a prefill of 10, a chunk of 5
    and a decode step over one cache. mode "adapter": the adapter active under "sdpa" (the expected values);
    "base": the adapter disabled; "low_rank": the adapter disabled under "kvprof_lora", each layer's V_lr = A·x
    captured by a pre-hook on its v_proj and B = scaling·B_lora (`lora_b_per_head`), i.e. Flash-LoRA-Attention
    over the base values. The model is built in `dtype`; peft keeps the adapter in float32 for a 16-bit model, so
    V_lr and B then come in float32."""
    from peft import LoraConfig, get_peft_model

    from kvprof.kernels.attention import lora_b_per_head

    base = tiny_llama(head_dim).to(device=device, dtype=dtype)
    lora = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["v_proj"], init_lora_weights=False)
    model = get_peft_model(base, lora).eval()
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(3)).to(device)
    context, captured = LoraAttentionContext(), {}

    def capture(module, args, layer):
        lora_a = module.lora_A["default"]
        captured.setdefault(layer, []).append(lora_a(args[0].to(lora_a.weight.dtype)))
        lora_b = lora_b_per_head(module.lora_B["default"].weight, KV_HEADS, module.scaling["default"])
        context.set(layer, torch.cat(captured[layer], dim=1), lora_b)

    handles = []
    low_rank = mode == "low_rank"
    if low_rank:
        model.get_base_model().set_attn_implementation(LORA_ATTENTION)
        for layer, decoder in enumerate(model.get_base_model().model.layers):
            handles.append(
                decoder.self_attn.v_proj.register_forward_pre_hook(
                    lambda module, args, layer=layer: capture(module, args, layer)
                )
            )
    adapter = contextlib.nullcontext() if mode == "adapter" else model.disable_adapter()
    cache, logits = DynamicCache(), []
    with torch.no_grad(), adapter, use_lora_attention(context):
        for start, stop in ((0, 10), (10, 15), (15, 16)):
            logits.append(model(input_ids=ids[:, start:stop], cache=cache).logits.float())
    for handle in handles:
        handle.remove()
    return logits


def test_peft_adapter_through_the_low_rank_path_equals_the_adapter():
    expected = peft_continuation_logits(16, "adapter")
    actual = peft_continuation_logits(16, "low_rank")
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    base = peft_continuation_logits(16, "base")
    assert min((without - want).abs().max() for without, want in zip(base, expected, strict=True)) > 1e-2


def test_registration_is_idempotent_and_registers_a_mask_function():
    assert register_lora_attention() == register_lora_attention() == LORA_ATTENTION
    assert "flash" not in LORA_ATTENTION
    assert AttentionInterface._global_mapping[LORA_ATTENTION] is lora_attention_forward
    assert AttentionMaskInterface._global_mapping[LORA_ATTENTION] is chunk_mask


def test_without_context_it_is_sdpa():
    sdpa_model, lora_model = tiny_llama_pair(head_dim=16)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(lora_model(ids).logits, sdpa_model(ids).logits)


def test_without_context_chunks_after_a_cache_equal_sdpa():
    """Prefill, chunks after the cache (the unmasked chunk path) and a decode step: the same logits as sdpa."""
    sdpa_model, lora_model = tiny_llama_pair(head_dim=16)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(7))
    expected_cache, actual_cache = DynamicCache(), DynamicCache()
    with torch.no_grad():
        for start, stop in ((0, 10), (10, 30), (30, 31), (31, 40)):
            expected = sdpa_model(ids[:, start:stop], cache=expected_cache).logits
            actual = lora_model(ids[:, start:stop], cache=actual_cache).logits
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_zero_low_rank_values_equal_sdpa_with_padding():
    sdpa_model, lora_model = tiny_llama_pair(head_dim=16)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, :3] = 0
    context = LoraAttentionContext()
    for layer, (v_lr, lora_b) in lora_values(9, 16, batch=2).items():
        context.set(layer, torch.zeros_like(v_lr), lora_b)
    with torch.no_grad(), use_lora_attention(context):
        actual = lora_model(ids, attention_mask=attention_mask).logits
    with torch.no_grad():
        expected = sdpa_model(ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(actual[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual[1, 3:], expected[1, 3:], atol=1e-5, rtol=1e-5)


def test_low_rank_values_equal_attention_over_expanded_values():
    sdpa_model, lora_model = tiny_llama_pair(head_dim=16)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(6))
    values = lora_values(12, 16)
    hooks = ExpandedValueHooks(sdpa_model, values)
    context = LoraAttentionContext()
    for layer, (v_lr, lora_b) in values.items():
        context.set(layer, v_lr, lora_b)
    with torch.no_grad():
        expected = sdpa_model(ids).logits
        plain = lora_model(ids).logits
        with use_lora_attention(context):
            actual = lora_model(ids).logits
    hooks.remove()
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert (plain - expected).abs().max() > 1e-2


def test_continuing_from_a_cache_chunk_and_decode():
    assert max(continuation_errors(head_dim=16)) < 1e-5


def test_padded_chunk_after_a_cache_keeps_the_padding_mask():
    """With padding the mask function hands sdpa's mask over (no unmasked chunk path): the same logits as sdpa."""
    sdpa_model, lora_model = tiny_llama_pair(head_dim=16)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(8))
    attention_mask = torch.ones(2, 10, dtype=torch.long)
    attention_mask[1, :2] = 0
    expected_cache, actual_cache = DynamicCache(), DynamicCache()
    with torch.no_grad():
        for start, stop in ((0, 6), (6, 10)):
            mask = attention_mask[:, :stop]
            expected = sdpa_model(ids[:, start:stop], attention_mask=mask, cache=expected_cache).logits
            actual = lora_model(ids[:, start:stop], attention_mask=mask, cache=actual_cache).logits
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_context_must_cover_every_key():
    _, lora_model = tiny_llama_pair(head_dim=16)
    context = LoraAttentionContext()
    for layer, (v_lr, lora_b) in lora_values(7, 16).items():
        context.set(layer, v_lr, lora_b)
    with pytest.raises(KvprofError, match="layer 0 attends 8 keys but its V_lr covers 7"):
        with torch.no_grad(), use_lora_attention(context):
            lora_model(torch.zeros(1, 8, dtype=torch.long))


def test_chunk_after_a_cache_builds_no_mask_without_padding(monkeypatch):
    """A chunk (Lq = 6) after a 10-token cache through the LoRA path: with no padding no (B, 1, Lq, Lk) mask is
    built (the mask function never reaches sdpa_mask) and the attention gets None, i.e. bottom-right causal with
    block skipping; with padding the mask is built and handed over."""
    from kvprof.kernels import chunk_attention, transformers_attention

    built, attended = [], []
    sdpa_mask, attention = chunk_attention.sdpa_mask, transformers_attention.flash_lora_attention

    def recording_mask(*args, **kwargs):
        mask = sdpa_mask(*args, **kwargs)
        built.append(None if mask is None else tuple(mask.shape))
        return mask

    def recording_attention(query, key, *args, attn_mask=None, **kwargs):
        attended.append((query.shape[2], key.shape[2], None if attn_mask is None else tuple(attn_mask.shape)))
        return attention(query, key, *args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(chunk_attention, "sdpa_mask", recording_mask)
    monkeypatch.setattr(transformers_attention, "flash_lora_attention", recording_attention)
    _, lora_model = tiny_llama_pair(head_dim=16)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(9))
    for padded in (False, True):
        attention_mask = torch.ones(2, 16, dtype=torch.long)
        if padded:
            attention_mask[1, :2] = 0
        cache = DynamicCache()
        with torch.no_grad():
            lora_model(ids[:, :10], attention_mask=attention_mask[:, :10], cache=cache)
            built.clear()
            attended.clear()
            context = LoraAttentionContext()
            for layer, (v_lr, lora_b) in lora_values(16, 16, batch=2).items():
                context.set(layer, v_lr, lora_b)
            with use_lora_attention(context):
                lora_model(ids[:, 10:], attention_mask=attention_mask, cache=cache)
        assert [call[:2] for call in attended] == [(6, 16)] * LAYERS
        if padded:
            assert built and all(shape == (2, 1, 6, 16) for shape in built), built
            assert all(call[2] == (2, 1, 6, 16) for call in attended), attended
        else:
            assert built == [] and all(call[2] is None for call in attended), (built, attended)


def test_float32_factors_with_a_16_bit_model_are_cast():
    """peft keeps LoRA factors in float32; a bfloat16 query takes them (cast to bfloat16 where they enter)."""
    from kvprof.kernels.attention import flash_lora_attention, flash_lora_attention_ref

    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=generator).to(torch.bfloat16) for _ in range(3))
    v_lr, lora_b = torch.randn(1, 5, 4, generator=generator), torch.randn(2, 4, 16, generator=generator)
    expected = flash_lora_attention_ref(q, k, v, v_lr.to(torch.bfloat16), lora_b.to(torch.bfloat16))
    torch.testing.assert_close(flash_lora_attention(q, k, v, v_lr, lora_b), expected)
