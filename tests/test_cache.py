"""kvprof.rank.kv_capture: captured K/V are the model's cache; the LoRA split adds up to it; LR activations; RoPE
re-alignment."""

from __future__ import annotations

import pytest
import torch

from kvprof.errors import KvprofError
from kvprof.model.agents import load_agents
from kvprof.model.architecture import decoder_layers
from kvprof.model.rope import rotate_keys
from kvprof.rank.kv_capture import capture_turn
from kvprof.traces.spec import build_spec

TOKENS = list(range(3, 3 + 60))


@pytest.fixture(scope="module")
def lora_agents(tiny_world):
    return load_agents(build_spec(tiny_world.lora_workflow), str(tiny_world.model), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def prompt_agents(tiny_world):
    return load_agents(build_spec(tiny_world.prompt_workflow), str(tiny_world.model), device="cpu", dtype="float32")


def _model_cache(agents, agent, tokens, positions=None):
    kwargs = {} if positions is None else {"position_ids": torch.as_tensor(positions)[None]}
    with agents.activate(agent), torch.inference_mode():
        return agents.model(input_ids=torch.tensor([tokens]), **kwargs).cache


def _relative(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("agent", ["plan", "act", None])
def test_kv_equal_model_cache_exactly(lora_agents, agent):
    capture = capture_turn(lora_agents, agent, TOKENS)
    cache = _model_cache(lora_agents, agent, TOKENS)
    assert list(capture.layers) == list(range(len(decoder_layers(lora_agents.base_model))))
    for index, layer in capture.layers.items():
        assert layer.keys.shape == (2, len(TOKENS), 16)
        assert torch.equal(layer.keys, cache.layers[index].keys[0])
        assert torch.equal(layer.values, cache.layers[index].values[0])


def test_split_adds_up_to_the_cache_on_every_layer(lora_agents):
    assert lora_agents.adapters["plan"].targets == ["q_proj", "k_proj", "v_proj", "o_proj"]
    capture = capture_turn(lora_agents, "plan", TOKENS, projections=("q_proj", "k_proj", "v_proj", "o_proj"))
    for layer in capture.layers.values():
        for name, cached in (("k_proj", layer.keys), ("v_proj", layer.values)):
            split = layer.split[name]
            assert _relative(split.total, cached) <= 1e-5
            # the adapter part is a real share of the cache, so the check above could fail
            assert float(split.adapter.norm() / cached.norm()) > 0.1
        assert layer.split["q_proj"].base.shape == (4, len(TOKENS), 16)
        assert layer.split["o_proj"].base.shape == (len(TOKENS), 64)


def test_split_with_adapters_disabled_has_zero_adapter_part(lora_agents):
    capture = capture_turn(lora_agents, None, TOKENS, parts=("kv", "split"))
    for layer in capture.layers.values():
        assert float(layer.split["v_proj"].adapter.abs().max()) == 0.0
        assert torch.equal(layer.split["v_proj"].base, layer.values)


def test_lr_activations_rebuild_the_adapter_output(lora_agents):
    capture = capture_turn(lora_agents, "act", TOKENS, parts=("split", "lr", "hidden"))
    for index, layer in capture.layers.items():
        module = decoder_layers(lora_agents.base_model)[index].self_attn.v_proj
        assert set(layer.lr["v_proj"]) == {"plan", "act", "reflect"}
        lr = layer.lr["v_proj"]["act"]
        assert lr.shape == (len(TOKENS), 4)
        with torch.no_grad():
            rebuilt = (lr @ module.lora_B["act"].weight.T) * module.scaling["act"]
            normed = decoder_layers(lora_agents.base_model)[index].input_layernorm(layer.hidden)
            down = normed @ module.lora_A["plan"].weight.T
        adapter = layer.split["v_proj"].adapter  # (H_kv, L, D)
        assert _relative(rebuilt.view(len(TOKENS), 2, 16).transpose(0, 1), adapter) <= 1e-5
        assert _relative(down, layer.lr["v_proj"]["plan"]) <= 1e-5


def test_hidden_states_match_the_model(lora_agents):
    capture = capture_turn(lora_agents, "reflect", TOKENS, parts=("hidden",))
    with lora_agents.activate("reflect"), torch.inference_mode():
        hidden = lora_agents.model(input_ids=torch.tensor([TOKENS]), output_hidden_states=True).hidden_states
    for index, layer in capture.layers.items():
        assert torch.equal(layer.hidden, hidden[index][0])


def test_layer_selection_and_keep_are_slices_of_the_full_capture(lora_agents):
    full = capture_turn(lora_agents, "plan", TOKENS)
    part = capture_turn(lora_agents, "plan", TOKENS, layers=[1], keep=(10, 30))
    assert list(part.layers) == [1]
    assert part.positions.tolist() == list(range(10, 30)) and part.token_ids.tolist() == TOKENS[10:30]
    assert torch.equal(part.layers[1].keys, full.layers[1].keys[:, 10:30])
    assert torch.equal(part.layers[1].split["k_proj"].adapter, full.layers[1].split["k_proj"].adapter[:, 10:30])
    assert torch.equal(part.layers[1].lr["k_proj"]["reflect"], full.layers[1].lr["k_proj"]["reflect"][10:30])


def test_positions_offset_matches_the_model_and_rotation(lora_agents):
    """Context-free keys at positions p + δ are the keys at p rotated by δ, and rotation round-trips."""
    delta = 37
    at_zero = capture_turn(lora_agents, "plan", TOKENS, parts=("kv",))
    shifted_positions = torch.arange(len(TOKENS)) + delta
    shifted = capture_turn(lora_agents, "plan", TOKENS, parts=("kv", "split"), positions=shifted_positions)
    cache = _model_cache(lora_agents, "plan", TOKENS, shifted_positions)
    for index, layer in shifted.layers.items():
        rope = lora_agents.ropes[index]
        assert torch.equal(layer.keys, cache.layers[index].keys[0])
        assert _relative(layer.split["k_proj"].total, layer.keys) <= 1e-5
        moved = rotate_keys(at_zero.layers[index].keys, delta, rope)
        assert _relative(moved, layer.keys) <= 1e-5
        back = rotate_keys(layer.keys, -delta, rope)
        assert _relative(back, at_zero.layers[index].keys) <= 1e-5
        assert _relative(rotate_keys(rotate_keys(layer.keys, delta, rope), -delta, rope), layer.keys) <= 1e-5
        # values do not move; keys really did (the check above is not vacuous)
        assert _relative(layer.values, at_zero.layers[index].values) <= 1e-5
        assert _relative(layer.keys, at_zero.layers[index].keys) > 0.1


def test_prompt_mode_captures_kv_but_refuses_split(prompt_agents):
    capture = capture_turn(prompt_agents, "plan", TOKENS)  # default parts: what prompt mode has
    cache = _model_cache(prompt_agents, "plan", TOKENS)
    assert torch.equal(capture.layers[0].keys, cache.layers[0].keys[0])
    assert capture.layers[1].hidden.shape == (len(TOKENS), 64) and not capture.layers[1].split
    with pytest.raises(KvprofError, match="need LoRA agents"):
        capture_turn(prompt_agents, "plan", TOKENS, parts=("kv", "split"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"layers": [0, 5]}, "layer 5 is out of range: this model has 2 layers"),
        ({"parts": ("kv", "attention")}, "unknown capture part attention"),
        ({"keep": (50, 70)}, "not a token range"),
        ({"lr_adapters": ["critic"]}, "unknown adapter critic"),
        ({"projections": ("x_proj",)}, "has no projection 'x_proj'"),
    ],
)
def test_bad_arguments_are_one_clear_error(lora_agents, kwargs, message):
    with pytest.raises(KvprofError, match=message):
        capture_turn(lora_agents, "plan", TOKENS, **kwargs)
