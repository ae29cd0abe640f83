"""Multi-head latent attention (DeepSeek V3, Kimi K2) as kvprof holds it (`kvprof.model.latent`): per layer the RoPE key
(K, rotated at each token's position) and the latent (V, position-free), exactly what the model caches, re-aligned
to other positions by rotating K alone; memory counted as engines hold it."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DynamicCache

from kvprof.model.agents import load_agents
from kvprof.model.rope import rotate_keys
from kvprof.model.runtime import Runtime
from kvprof.model.tiny import MLA_SIZES, build_tiny_world, tiny_sizes
from kvprof.traces.spec import build_spec

LATENT, ROPE_KEY = MLA_SIZES["kv_lora_rank"], MLA_SIZES["qk_rope_head_dim"]
SHIFT = 37  # positions a span moves by


def deepseek_v3(vocab: int, eos: int) -> DeepseekV3Config:
    sizes = tiny_sizes(vocab, eos) | MLA_SIZES | {"moe_intermediate_size": 32, "n_routed_experts": 4}
    return DeepseekV3Config(**sizes, num_experts_per_tok=2, first_k_dense_replace=1)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory) -> Runtime:
    world = build_tiny_world(tmp_path_factory.mktemp("mla"), configure=deepseek_v3)
    return Runtime(load_agents(build_spec(world.prompt_workflow), str(world.model), device="cpu", dtype="float32"))


def _forward(runtime: Runtime, ids: list[int], start: int):
    return runtime.kv_of(runtime.forward(None, ids, runtime.cache_from(runtime.empty_kv()), start).cache)


def test_the_cache_holds_the_rope_key_and_the_latent_the_model_caches(runtime):
    """K (1, 1, L, R) and V (1, 1, L, C) per layer, equal to what transformers' own cache holds (latent, k_rot);
    a token's memory is layers·(R + C)·itemsize, as a serving engine holds an MLA cache."""
    ids = list(range(3, 40))
    ours = _forward(runtime, ids, 0)
    with torch.inference_mode():
        theirs = runtime.model(input_ids=torch.tensor([ids]), cache=DynamicCache(config=runtime.agents.config)).cache
    assert (runtime.kv_heads, runtime.key_dim, runtime.value_dim) == (1, ROPE_KEY, LATENT)
    for (keys, values), layer in zip(ours, theirs.layers, strict=True):
        assert keys.shape == (1, 1, len(ids), ROPE_KEY) and values.shape == (1, 1, len(ids), LATENT)
        torch.testing.assert_close(keys, layer.values, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(values, layer.keys, rtol=1e-6, atol=1e-6)
    assert runtime.kv_bytes_per_token == runtime.num_layers * (ROPE_KEY + LATENT) * 4
    assert [kind.latent for kind in runtime.agents.layer_kinds] == [
        f"latent C = {LATENT} + RoPE key R = {ROPE_KEY}"
    ] * 2


def test_re_alignment_rotates_the_rope_key_of_every_layer_and_leaves_the_latent(runtime):
    """The same tokens at positions moved by SHIFT: each layer's K is its own RoPE's rotation of K at 0.., to float32
    rounding; V (the latent) is unchanged; not rotating K would be far off."""
    ids = list(range(5, 45))
    at_start, moved = _forward(runtime, ids, 0), _forward(runtime, ids, SHIFT)
    assert runtime.ropes.names == ("rope", "rope")
    for layer, ((keys, values), (moved_keys, moved_values)) in enumerate(zip(at_start, moved, strict=True)):
        realigned = rotate_keys(keys, SHIFT, runtime.ropes[layer])
        assert (realigned - moved_keys).norm() <= 1e-5 * moved_keys.norm()
        assert (keys - moved_keys).norm() > 0.1 * moved_keys.norm()
        torch.testing.assert_close(values, moved_values, rtol=1e-5, atol=1e-6)
