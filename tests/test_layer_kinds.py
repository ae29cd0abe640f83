"""Models whose layers differ, through the command line on tiny worlds of their own config classes: Gemma 3 (five
local layers with a 24-token sliding window and their own RoPE base, then a global layer), Llama 4 (chunked
attention in 24-token chunks, NoPE every fourth layer, an L2 key norm after RoPE), on traces longer than the window,
and DeepSeek V3 (multi-head latent attention: a cached latent and RoPE key, LoRA on its MLA projections). kvprof
reads each layer's kind and RoPE from the model, captures as peft generates, and replays against the oracles:
NonShared exact, the selective policies at ratio 1 the dense run, the low-rank split exact or refused in one
sentence."""

from __future__ import annotations

import json

import pytest
from peft_oracle import assert_keys_realign, assert_peft_generations

from kvprof.model.tiny import AGENTS, MLA_SIZES, TinyWorld, build_tiny_world, tiny_sizes
from kvprof.traces.trace import read_trace

WINDOW = 24  # tokens of a sliding window or an attention chunk: shorter than every trace's inputs
DEVICE = ("--device", "cpu", "--dtype", "float32")


def gemma3(vocab: int, eos: int):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**tiny_sizes(vocab, eos, layers=6), head_dim=16, sliding_window=WINDOW)


def llama4(vocab: int, eos: int):
    from transformers import Llama4TextConfig

    sizes = tiny_sizes(vocab, eos, layers=4) | {"intermediate_size": 64, "intermediate_size_mlp": 128}
    return Llama4TextConfig(**sizes, head_dim=16, attention_chunk_size=WINDOW, num_local_experts=2)


def deepseek_v3(vocab: int, eos: int):
    from transformers import DeepseekV3Config

    sizes = tiny_sizes(vocab, eos) | MLA_SIZES | {"moe_intermediate_size": 32, "n_routed_experts": 4}
    return DeepseekV3Config(**sizes, num_experts_per_tok=2)


LATENT, ROPE_KEY = MLA_SIZES["kv_lora_rank"], MLA_SIZES["qk_rope_head_dim"]  # channels of the latent and RoPE key

# architecture → (its config, each layer's kind as `kvprof.model.layers.describe_layers` names them)
WORLDS = {
    "gemma3": (
        gemma3,
        f"sliding attention, W = {WINDOW}, rope (sliding_attention): layers 0–4; "
        "full attention, rope (full_attention): layer 5",
    ),
    "llama4": (
        llama4,
        f"chunked attention, W = {WINDOW}, rope interleaved: layers 0–2; full attention, NoPE: layer 3",
    ),
    "deepseek_v3": (
        deepseek_v3,
        f"all 2 layers: multi-head latent full attention (latent C = {LATENT} + RoPE key R = {ROPE_KEY}), rope",
    ),
}
ATTENTION = {"gemma3": ["sliding"] * 5 + ["full"], "llama4": ["chunked"] * 3 + ["full"], "deepseek_v3": ["full"] * 2}


@pytest.fixture(scope="module", params=list(WORLDS))
def world(request, tmp_path_factory) -> tuple[str, TinyWorld]:
    configure, _ = WORLDS[request.param]
    return request.param, build_tiny_world(tmp_path_factory.mktemp(request.param), configure=configure)


def _capture(run_cli, world: TinyWorld, workflow, out) -> tuple[str, str]:
    code, stdout, err = run_cli(
        "capture", "--model", world.model, "--workflow", workflow, "--tasks", world.tasks, "--limit", "2",
        "--out", out, *DEVICE,
    )  # fmt: skip
    assert code == 0, err
    return str(out / "trace.jsonl"), stdout


def _replay(run_cli, trace: str, out, *args) -> dict:
    code, _, err = run_cli("replay", trace, "--repeats", "1", "--out", out, *DEVICE, *args)
    assert code == 0, err
    return json.loads((out / "replay.json").read_text())


def test_layers_are_read_from_the_model_and_captures_are_peft_generations(world, run_cli, tmp_path):
    """Each layer's kind is named at capture, recorded by replay and printed by `inspect --model`; every captured
    output is peft's own greedy generation with its agent's adapter, token for token, on inputs longer than the
    window."""
    name, tiny = world
    trace_path, stdout = _capture(run_cli, tiny, tiny.lora_workflow, tmp_path / "capture")
    assert WORLDS[name][1] in " ".join(stdout.split())
    code, stdout, err = run_cli("inspect", trace_path, "--model", tiny.model, "--out", tmp_path / "inspect", *DEVICE)
    assert code == 0, err
    assert WORLDS[name][1] in " ".join(stdout.split())
    trace = read_trace(trace_path)
    assert max(len(t.input_tokens(turn)) for t in trace.trajectories for turn in t.turns) > 3 * WINDOW
    assert_peft_generations(tiny.model, {agent: tiny.adapter(agent) for agent in AGENTS}, tmp_path)
    _capture(run_cli, tiny, tiny.prompt_workflow, tmp_path / "prompt")
    assert_peft_generations(tiny.model, {}, tmp_path, capture="prompt")


def test_every_layers_keys_realign_by_its_own_rope(world):
    """Re-alignment is exact per layer: each layer's cached keys at shifted positions are kvprof's re-rotation of
    them (its own RoPE base, none in a NoPE layer, only an MLA layer's RoPE key)."""
    from transformers import AutoModelForCausalLM

    from kvprof.model.rope import model_ropes

    _, tiny = world
    assert_keys_realign(tiny.model, model_ropes(AutoModelForCausalLM.from_pretrained(tiny.model)))


@pytest.mark.parametrize("mode", ["lora", "prompt"])
def test_every_policy_replays_against_its_oracle(world, mode, run_cli, tmp_path):
    """`--policy all` runs (the dense run reproduces the capture, NonShared is exact), and recomputing every reused
    (token, layer) entry one layer at a time, each layer with its own RoPE, window or chunk, is the dense run."""
    name, tiny = world
    trace, _ = _capture(run_cli, tiny, getattr(tiny, f"{mode}_workflow"), tmp_path / "capture")
    result = _replay(run_cli, trace, tmp_path / "all", "--policy", "all")
    assert result["dense"]["summary"]["trace_agreement"] == 1.0
    assert [kind["attention"] for kind in result["layers"]] == ATTENTION[name]
    nonshared = result["policies"]["nonshared"]["summary"]
    assert nonshared["k_error"] == 0.0 and nonshared["v_error"] == 0.0
    assert result["policies"]["fullshared"]["summary"]["k_error"] > 0
    selective = ["cacheblend", "droidspeak", "relaycaching"]
    if name == "deepseek_v3":  # RelayCaching scores queries against per-head keys, which MLA does not cache
        code, _, err = run_cli("replay", trace, "--policy", selective.pop(), "--out", tmp_path / "relay", *DEVICE)
        assert code == 2 and "multi-head latent attention layer" in err and "Traceback" not in err
    flags = [arg for policy in selective for arg in ("--policy", policy)]
    flags += [arg for policy in selective for arg in ("--policy-option", f"{policy}.ratio=1")]
    for label, entry in _replay(run_cli, trace, tmp_path / "ratio1", *flags)["policies"].items():
        summary = entry["summary"]
        assert summary["recompute_ratio"] == 1.0, label
        assert summary["k_error"] < 1e-5 and summary["v_error"] < 1e-5 and summary["kl"] < 1e-9, label


def test_the_low_rank_split_is_exact_or_refused(world, run_cli, tmp_path):
    """With one adapter for every agent: on Gemma 3 (a key norm in every layer, before RoPE) and Llama 4 (an L2 key
    norm in its RoPE layers only, after RoPE, which commutes with it) BaseShared is the dense run and PreLRShared
    FullShared's turns; DeepSeek V3's latent is a norm of its projection, which the split refuses in one sentence."""
    name, tiny = world
    trace, _ = _capture(run_cli, tiny, tiny.lora_workflow, tmp_path / "capture")
    same = [arg for agent in AGENTS for arg in ("--agent", f"{agent}={tiny.adapter('act')}")]
    policies = ("--policy", "baseshared", "--policy", "prelrshared", "--policy", "fullshared")
    refusal = {"deepseek_v3": "multi-head latent attention layer"}
    if name in refusal:
        code, _, err = run_cli("replay", trace, *policies, *same, "--repeats", "1", "--out", tmp_path / "r", *DEVICE)
        assert code == 2 and refusal[name] in err and "Traceback" not in err
        return
    result = _replay(run_cli, trace, tmp_path / "same", *policies, *same)["policies"]
    base = result["baseshared-code"]["summary"]
    assert base["k_error"] < 1e-5 and base["v_error"] < 1e-5 and base["kl"] < 1e-9
    for turn, reference in zip(result["prelrshared"]["turns"], result["fullshared"]["turns"], strict=True):
        for layer, reference_layer in zip(turn["layers"], reference["layers"], strict=True):
            assert layer["k_error"] == pytest.approx(reference_layer["k_error"], rel=1e-3, abs=1e-5)


def test_layer_kinds_read_as_a_pattern_over_many_layers():
    from kvprof.model.layers import ChunkedAttention, FullAttention, describe_layers

    chunked, nope = ChunkedAttention(8192, "rope interleaved"), FullAttention("NoPE")
    kinds = [nope if index % 4 == 3 else chunked for index in range(48)]
    assert describe_layers(kinds) == (
        "chunked attention, W = 8192, rope interleaved: layers 0–2, 4–6, …, 44–46 (36 layers); "
        "full attention, NoPE: layers 3, 7, …, 47 (12 layers)"
    )
    assert describe_layers([chunked] * 3) == "all 3 layers: chunked attention, W = 8192, rope interleaved"


def test_memory_counts_what_each_layer_keeps(world, tmp_path, run_cli):
    """Every runnable policy's stored memory, in lora and prompt mode, is the tensors an engine keeps — a sliding
    layer its last W tokens, a chunked one its current chunk's — and its formula equals them; on traces past the
    window that is less than every token of every layer."""
    from kvprof.model.agents import load_agents_for_trace
    from kvprof.model.runtime import Runtime
    from kvprof.policies.variants import enumerate_variants, runnable_variants
    from kvprof.replay.lockstep import replay_trace

    name, tiny = world
    for mode in ("lora", "prompt"):
        trace, _ = _capture(run_cli, tiny, getattr(tiny, f"{mode}_workflow"), tmp_path / mode)
        agents = load_agents_for_trace(trace, device="cpu", dtype="float32")
        runtime = Runtime(agents)
        variants, _ = runnable_variants(enumerate_variants(["all"], {}), runtime, skip=True)
        result = replay_trace(agents, read_trace(trace).trajectories[:1], variants, check_memory=True)
        assert all(entry["memory_accounting_exact"] for entry in result["policies"].values())
        longest = max(len(traj.input_tokens(turn)) for traj in read_trace(trace).trajectories for turn in traj.turns)
        windowed = name != "deepseek_v3"
        assert (runtime.kv_bytes(longest) < runtime.kv_bytes_per_token * longest) == windowed


def test_a_window_layers_error_counts_the_reused_tokens_the_turn_can_attend():
    """A reused token further back than a window layer's W from the turn's first computed token (or in an earlier
    chunk of a chunked layer) cannot change the turn's outputs through that layer: its K/V error there is not
    counted."""
    from kvprof.model.layers import ChunkedAttention, FullAttention, SlidingAttention

    full, sliding, chunked = FullAttention("rope"), SlidingAttention(24, "rope"), ChunkedAttention(24, "NoPE")
    assert full.first_attended(100) == 0
    assert sliding.first_attended(100) == 77 and sliding.first_attended(10) == 0  # 77..100: the window of 100
    assert chunked.first_attended(100) == 96 and chunked.first_attended(96) == 96


def test_attention_flops_count_the_pairs_each_layer_attends():
    """The closed forms of `Runtime.attended` (a turn's contiguous tokens) equal the count over positions
    (`attended_at`) in full, sliding-window, chunked and recurrent layers, and a window caps what a token attends."""
    from types import SimpleNamespace

    import torch

    from kvprof.model.layers import ChunkedAttention, FullAttention, RecurrentLayer, SlidingAttention
    from kvprof.model.runtime import Runtime

    kinds = [
        FullAttention("rope"),
        SlidingAttention(24, "rope"),
        ChunkedAttention(24, "rope"),
        RecurrentLayer("linear_attn"),
    ]
    runtime = SimpleNamespace(agents=SimpleNamespace(layer_kinds=kinds))
    for layer in range(len(kinds)):
        for start, count in ((0, 1), (0, 30), (5, 10), (20, 9), (23, 1), (24, 48), (70, 3), (100, 57)):
            positions = torch.arange(start, start + count)
            expected = Runtime.attended_at(runtime, layer, positions)  # type: ignore[arg-type]
            assert Runtime.attended(runtime, layer, start, count) == expected, (kinds[layer], start, count)  # type: ignore[arg-type]
    assert Runtime.attended(runtime, 1, 1000, 1) == 24 and Runtime.attended(runtime, 2, 1000, 1) == 1000 % 24 + 1  # type: ignore[arg-type]


def test_a_layer_kind_is_one_class_the_runtime_asks(monkeypatch):
    """A kind kvprof does not ship, as a `LayerKind` subclass in its place in `KINDS`: layers read as it, the
    runtime's questions (tokens held, pairs attended, bytes per token) answered by it, results and text naming it."""
    from dataclasses import dataclass, field
    from types import SimpleNamespace

    import torch

    import kvprof.model.layers as layers
    from kvprof.model.rope import model_ropes
    from kvprof.model.runtime import Runtime
    from kvprof.model.tiny import build_model, tiny_config

    @dataclass(frozen=True)
    class LastToken(layers.LayerKind):  # a toy: each token attends itself alone and the layer keeps one token
        attention: str = field(default="last-token", init=False)
        window: int = field(default=1, init=False)

        @classmethod
        def read(cls, model, index, layer, position):
            return cls(position) if index == 0 else None

        def held(self, length):
            return min(length, 1)

        def attended(self, start, count):
            return count

        def attended_at(self, positions):
            return len(positions)

        def first_attended(self, position):
            return position

    monkeypatch.setattr(layers, "KINDS", (LastToken, *layers.KINDS))
    torch.manual_seed(0)
    model = build_model(tiny_config(384, 0))
    kinds = layers.layer_kinds(model, model_ropes(model))
    assert kinds == [LastToken("rope"), layers.FullAttention("rope")]
    assert kinds[0].to_json() == {"attention": "last-token", "window": 1, "position": "rope", "latent": None}
    assert layers.describe_layers(kinds) == (
        "last-token attention, W = 1, rope: layer 0; full attention, rope: layer 1"
    )
    shapes = layers.cache_shapes(model, kinds)
    runtime = SimpleNamespace(agents=SimpleNamespace(layer_kinds=kinds), cache_shapes=shapes, dtype=torch.float32)
    assert [Runtime.held_length(runtime, layer, 10) for layer in (0, 1)] == [1, 10]  # type: ignore[arg-type]
    assert [Runtime.attended(runtime, layer, 4, 3) for layer in (0, 1)] == [3, 5 + 6 + 7]  # type: ignore[arg-type]
    assert Runtime.layer_token_bytes(runtime, 0) == Runtime.layer_token_bytes(runtime, 1) == 2 * 2 * 16 * 4  # type: ignore[arg-type]
    assert kinds[0].limits(10) and not kinds[1].limits(10)
