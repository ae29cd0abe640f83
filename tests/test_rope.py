"""kvprof's RoPE against the models' own: the layouts it reads (full or partial rotary, half-split or interleaved
pairs), checked by shifting an input on tiny models of architectures built from a config, and the one-sentence
refusal of a model whose keys do not move as one RoPE."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from kvprof.errors import KvprofError
from kvprof.rope import Rope, check_rope, model_rope, rotate_keys
from kvprof.tiny import tiny_sizes

COMMON = tiny_sizes(vocab_size=64, eos_id=0)

# architecture → (RoPE'd channels of a 16-channel head, interleaved pairs)
LAYOUTS = {
    "llama": (16, False),
    "phi": (8, False),  # partial_rotary_factor 0.5
    "stablelm": (4, False),  # partial_rotary_factor 0.25
    "cohere": (16, True),
    "glm": (8, True),  # partial and interleaved
}


def tiny_model(arch: str, **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIG_MAPPING[arch](**{**COMMON, **overrides})).eval()


@pytest.mark.parametrize("arch", LAYOUTS)
def test_model_rope_reads_the_layout_and_moves_keys_as_the_model_does(arch):
    model = tiny_model(arch, head_dim=16) if arch == "glm" else tiny_model(arch)  # GLM's default head is 128 wide
    rope = model_rope(model)  # checks every layer's shifted keys
    assert (rope.rotary_dim, rope.interleaved) == LAYOUTS[arch]
    wrong = dataclasses.replace(rope, interleaved=not rope.interleaved)
    with pytest.raises(KvprofError, match=r"layer 0's cached keys do not move with positions as one RoPE"):
        check_rope(model, wrong)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_check_tells_16_bit_rounding_from_a_wrong_layout(dtype):
    model = tiny_model("phi").to(dtype)
    rope = model_rope(model)
    assert rope.rotary_dim == 8
    with pytest.raises(KvprofError, match="do not move with positions"):
        check_rope(model, dataclasses.replace(rope, interleaved=True))


def test_rotation_passes_channels_past_the_rotary_dim_and_composes():
    rope = Rope(inv_freq=1.0 / 100 ** (torch.arange(4) / 4), interleaved=True)  # 8 of 12 channels
    keys = torch.randn(1, 2, 5, 12)
    moved = rotate_keys(keys, 7, rope)
    assert torch.equal(moved[..., 8:], keys[..., 8:])
    assert not torch.allclose(moved[..., :8], keys[..., :8])
    torch.testing.assert_close(rotate_keys(rotate_keys(keys, 3, rope), 4, rope), moved)
    torch.testing.assert_close(rotate_keys(moved, -7, rope), keys)
    pairs = moved[..., :8].reshape(1, 2, 5, 4, 2).norm(dim=-1)  # interleaved: each (2i, 2i+1) pair keeps its norm
    torch.testing.assert_close(pairs, keys[..., :8].reshape(1, 2, 5, 4, 2).norm(dim=-1))


def test_a_model_with_layers_without_rope_is_refused_in_one_sentence():
    """SmolLM3 leaves every 4th layer without RoPE (NoPE): one RoPE for all layers would re-align them wrongly."""
    model = tiny_model("smollm3", num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0])
    with pytest.raises(
        KvprofError, match=r"^model .*: layer 3's cached keys do not move .* cannot profile this model\.$"
    ):
        model_rope(model)


def test_a_rope_per_layer_type_is_refused_in_one_sentence():
    model = tiny_model("gemma3_text", head_dim=16, sliding_window=8)
    with pytest.raises(KvprofError, match=r"^model .* has a RoPE per layer type .* cannot profile this model\.$"):
        model_rope(model)
