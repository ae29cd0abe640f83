"""A decoder's structure as kvprof reads it, from the model alone: its layer list, each layer's attention module or
a hybrid's recurrent token mixer in its place, and the head sizes of its config.

The bottom of `kvprof.model`: it imports no other module of the package, and every module that walks a model's
layers (`latent`, `layers`, `lora`, `recurrent`, `agents`, ...) reads them here.
"""

from __future__ import annotations

import torch

from kvprof.errors import KvprofError

ATTENTION_NAMES = ("self_attn", "attention", "attn")  # a decoder layer's attention module, by architecture
RECURRENT_NAMES = ("linear_attn", "mamba", "conv", "mixer")  # a hybrid's recurrent layer: Qwen 3.5, Granite 4, LFM2


def head_dim(config) -> int:
    """Head size D: `config.head_dim` when set (Mistral-Nemo, Gemma, Qwen3), else hidden_size // num_attention_heads
    (Qwen2 and older configs have no such field or store None)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_heads(config) -> int:
    """H_kv: `num_key_value_heads`, else every attention head (no GQA: GPT-NeoX, Persimmon)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM (adapted too: LoRA is injected in place)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:  # a causal LM whose get_decoder() is itself (Llama 4): its decoder is `model`
        layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise KvprofError(
            f"model {model.config.name_or_path!r} has no decoder layer list (model.layers); kvprof supports "
            "decoders that keep one, as Llama, Qwen, Mistral, Gemma and Phi do."
        )
    return layers


def recurrent_of(layer: torch.nn.Module) -> str | None:
    """A hybrid's recurrent token mixer name (`linear_attn`, `mamba`, `conv`, `mixer`), None for attention."""
    if any(isinstance(getattr(layer, name, None), torch.nn.Module) for name in ATTENTION_NAMES):
        return None
    return next((name for name, _ in layer.named_children() if name in RECURRENT_NAMES), None)


def attention_of(layer: torch.nn.Module, index: int) -> torch.nn.Module:
    """Layer `index`'s attention module (`self_attn`, or GPT-NeoX's `attention`); refuses a layer without one."""
    for name in ATTENTION_NAMES:
        module = getattr(layer, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    recurrent = recurrent_of(layer)
    if recurrent is not None:
        raise KvprofError(
            f"decoder layer {index} is a recurrent layer ({recurrent}: linear attention, a state space or a short "
            "convolution), which keeps a state rather than a K/V cache per token, and kvprof needed its attention."
        )
    raise KvprofError(
        f"decoder layer {index} has no attention module ({', '.join(ATTENTION_NAMES)}); kvprof supports decoders "
        "whose layers hold one."
    )


def mixer_of(layer: torch.nn.Module, index: int) -> torch.nn.Module:
    """Decoder layer `index`'s token mixer: its attention module, or a hybrid's recurrent module in its place."""
    recurrent = recurrent_of(layer)
    return getattr(layer, recurrent) if recurrent is not None else attention_of(layer, index)


def weights_bytes(model) -> int:
    """Bytes of every parameter and buffer of `model` (base + all adapters) as stored: what
    `torch.cuda.max_memory_allocated` counts besides caches. A bitsandbytes 4-bit weight counts its packed bytes
    and its quantization state."""
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        total += tensor.numel() * tensor.element_size()
        state = getattr(tensor, "quant_state", None)
        if state is not None:
            total += sum(t.numel() * t.element_size() for t in state.as_dict().values() if isinstance(t, torch.Tensor))
    return total
