"""kvprof's RoPE against the models' own, per layer: the layouts it reads (full or partial rotary, half-split or
interleaved pairs), a RoPE per layer type (Gemma 3's local and global bases) and layers without RoPE (SmolLM3's,
Cohere 2's NoPE layers), found by shifting an input on tiny models of architectures built from a config; and the
one-sentence refusal of a model whose keys move as no RoPE it holds."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from kvprof.errors import KvprofError
from kvprof.model.rope import NO_ROPE, LayerRopes, Rope, check_ropes, model_ropes, rotate_keys
from kvprof.model.tiny import tiny_sizes

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


def flipped(ropes: LayerRopes, layer: int, rope: Rope | None = None) -> LayerRopes:
    """`ropes` with layer `layer`'s RoPE replaced by `rope` (default: its pairing flipped)."""
    layers = list(ropes.layers)
    layers[layer] = rope or dataclasses.replace(layers[layer], interleaved=not layers[layer].interleaved)
    return dataclasses.replace(ropes, layers=tuple(layers))


@pytest.mark.parametrize("arch", LAYOUTS)
def test_model_ropes_read_the_layout_and_move_keys_as_the_model_does(arch):
    model = tiny_model(arch, head_dim=16) if arch == "glm" else tiny_model(arch)  # GLM's default head is 128 wide
    ropes = model_ropes(model)  # checks every layer's shifted keys
    assert {(rope.rotary_dim, rope.interleaved) for rope in ropes} == {LAYOUTS[arch]}
    assert set(ropes.names) == {"rope"}
    with pytest.raises(KvprofError, match=r"layer 0's cached keys do not move with positions as any RoPE"):
        check_ropes(model, flipped(ropes, 0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_check_tells_16_bit_rounding_from_a_wrong_layout(dtype):
    model = tiny_model("phi").to(dtype)
    ropes = model_ropes(model)
    assert ropes[0].rotary_dim == 8
    with pytest.raises(KvprofError, match="do not move with positions"):
        check_ropes(model, flipped(ropes, 1))


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


def test_layers_without_rope_move_their_keys_as_they_are():
    """SmolLM3 leaves every 4th layer without RoPE (NoPE), Cohere 2 its global layers: found on the model, each such
    layer's keys are position-free, and rotating them is refused."""
    for model in (
        tiny_model("smollm3", num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0]),
        tiny_model("cohere2", num_hidden_layers=4, sliding_window=64),
    ):
        ropes = model_ropes(model)
        assert ropes.names == ("rope", "rope", "rope", "NoPE") and ropes[3] is NO_ROPE
        keys = torch.randn(1, 2, 5, 16)
        assert torch.equal(rotate_keys(keys, 9, ropes[3]), keys)
        with pytest.raises(KvprofError, match="layer 3's cached keys do not move"):
            check_ropes(model, flipped(ropes, 3, ropes[0]))


def test_a_rope_per_layer_type_is_read_per_layer():
    """Gemma 3's local (sliding) layers rotate with θ = 10⁴, its global layers with θ = 10⁶: each layer gets its
    own, and the other type's is refused."""
    model = tiny_model("gemma3_text", head_dim=16, num_hidden_layers=6, sliding_window=64)
    ropes = model_ropes(model)
    assert ropes.names == ("rope (sliding_attention)",) * 5 + ("rope (full_attention)",)
    assert not torch.equal(ropes[0].inv_freq, ropes[5].inv_freq)
    with pytest.raises(KvprofError, match="layer 5's cached keys do not move"):
        check_ropes(model, flipped(ropes, 5, ropes[0]))


def test_a_model_with_absolute_positions_is_refused_in_one_sentence():
    model = tiny_model("opt", word_embed_proj_dim=64, ffn_dim=128)
    with pytest.raises(
        KvprofError, match=r"^model .*: layer 0's cached keys do not move .* cannot profile this model\.$"
    ):
        model_ropes(model)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_quarters", [4, 2])
def test_the_swap_folds_into_a_low_rank_factor(interleaved, rotary_quarters):
    """RoPE of x·W equals (x·W)·cos + (x·swap(W))·sin on the rotary channels, the rest passing through: how the
    low-rank store rotates the rank-r key term without a context-sized swapped copy (`Rope.swap`)."""
    rotary = 4 * rotary_quarters  # of 16 channels
    rope = Rope(inv_freq=1.0 / 100 ** (torch.arange(rotary // 2) / (rotary // 2)), interleaved=interleaved)
    x, weights = torch.randn(1, 1, 30, 8, dtype=torch.float64), torch.randn(2, 8, 16, dtype=torch.float64)
    cos, sin = (table.double() for table in rope.tables(torch.arange(5, 35)))
    expected = rope.rotate(x @ weights, cos, sin)
    folded = x @ weights
    folded[..., :rotary].mul_(cos).addcmul_(x @ rope.swap(weights), sin)
    torch.testing.assert_close(folded, expected, rtol=1e-12, atol=1e-12)
    assert rope.swap(weights).shape == (2, 8, rotary)
