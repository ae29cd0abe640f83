"""kvprof on architectures beyond Llama, through the command line (capture, rank-analysis and replay, in lora and
prompt mode) on tiny worlds of Qwen2 (q/k/v biases), Mistral (sliding-window attention), Qwen3 (query and key norms
before RoPE), Phi (partial rotary, biases, parallel attention and MLP) and Phi-3 (fused qkv_proj); Llama: the other
tests."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvprof.model.agents import load_agents, load_agents_for_trace
from kvprof.model.architecture import head_dim
from kvprof.model.lora import HiddenTap, heads, key_norms, layer_splits
from kvprof.model.rope import apply_rope
from kvprof.model.runtime import Runtime
from kvprof.model.tiny import AGENTS, MISTRAL_WINDOW, TinyWorld, build_tiny_world
from kvprof.policies import PolicyVariant, enumerate_variants
from kvprof.rank.kv_capture import capture_turn
from kvprof.replay.lockstep import replay_trace
from kvprof.traces.spec import build_spec
from kvprof.traces.trace import Segment, Trace, Trajectory, read_trace, write_trace

DEVICE = ("--device", "cpu")


@pytest.fixture(scope="module", params=["qwen2", "mistral", "qwen3", "phi", "phi3"])
def world(request, tmp_path_factory) -> TinyWorld:
    """The tiny world of each architecture, built once per module."""
    return build_tiny_world(tmp_path_factory.mktemp(f"tiny_{request.param}"), arch=request.param)


def _capture(run_cli, world: TinyWorld, workflow, out) -> str:
    code, _, err = run_cli(
        "capture",
        "--model",
        world.model,
        "--workflow",
        workflow,
        "--tasks",
        world.tasks,
        "--limit",
        "1",
        "--out",
        out,
        *DEVICE,
    )
    assert code == 0, err
    return str(out / "trace.jsonl")


def _replay(run_cli, trace: str, out, *args: str) -> dict:
    code, _, err = run_cli("replay", trace, "--repeats", "1", "--out", out, *DEVICE, *args)
    assert code == 0, err
    return json.loads((out / "replay.json").read_text())


def _check_exact_and_shared(result: dict) -> None:
    """The dense run reproduces the captured outputs; NonShared is exact, FullShared is not."""
    assert result["dense"]["summary"]["trace_agreement"] == 1.0
    nonshared = result["policies"]["nonshared"]["summary"]
    fullshared = result["policies"]["fullshared"]["summary"]
    assert nonshared["k_error"] == 0.0 and nonshared["v_error"] == 0.0
    assert fullshared["k_error"] > 0 and fullshared["v_error"] > 0


def _check_selective_recompute_at_ratio_one(run_cli, trace: str, out) -> None:
    """Selective recompute of every reused (token, layer) entry, layer by layer through this architecture's
    decoder layers (biases, sliding-window attention), is the dense run."""
    flags = [
        arg
        for name in ("cacheblend", "droidspeak", "relaycaching")
        for arg in ("--policy", name, "--policy-option", f"{name}.ratio=1")
    ]
    for label, entry in _replay(run_cli, trace, out, *flags)["policies"].items():
        summary = entry["summary"]
        assert summary["recompute_ratio"] == 1.0, label
        assert summary["k_error"] < 1e-5 and summary["v_error"] < 1e-5 and summary["kl"] < 1e-9, label


def test_selective_recompute_at_ratio_one_honours_a_window_shorter_than_the_trace(run_cli, tmp_path):
    """Mistral with a 24-token sliding window, on a trace whose inputs are longer: recomputing every reused
    (token, layer) entry layer by layer attends each token's last 24 keys, as the model does — the dense run."""
    window = 24
    world = build_tiny_world(tmp_path / "world", arch="mistral")
    config_path = world.model / "config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"sliding_window": window}))
    trace = _capture(run_cli, world, world.lora_workflow, tmp_path / "capture")
    trajectories = read_trace(trace).trajectories
    assert max(len(t.input_tokens(turn)) for t in trajectories for turn in t.turns) > 3 * window
    _check_selective_recompute_at_ratio_one(run_cli, trace, tmp_path / "recompute")


def test_low_rank_policies_split_keys_normalised_by_a_k_layernorm(run_cli, tmp_path):
    """LFM2 normalises keys with `k_layernorm` (Qwen3's `k_norm` under another name): with one adapter for every
    agent BaseShared must reproduce the dense run and PreLRShared FullShared's turns (it moves the trace's repeated
    spans as FullShared does), which they do only if the store keeps keys before that norm (they were 47 % off while
    it went unseen)."""
    from transformers import Lfm2Config

    from kvprof.model.tiny import tiny_sizes

    world = build_tiny_world(tmp_path / "world", configure=lambda vocab, eos: Lfm2Config(**tiny_sizes(vocab, eos)))
    agents = load_agents(build_spec(world.lora_workflow), str(world.model), device="cpu", dtype="float32")
    assert key_norms(agents.base_model) is not None
    trace = _capture(run_cli, world, world.lora_workflow, tmp_path / "capture")
    same = [arg for name in AGENTS for arg in ("--agent", f"{name}={world.adapter('act')}")]
    policies = ("--policy", "baseshared", "--policy", "prelrshared", "--policy", "fullshared")
    result = _replay(run_cli, trace, tmp_path / "same", *policies, *same)["policies"]
    summary = result["baseshared-code"]["summary"]
    assert summary["reuse_per_token"] > 0.3
    assert summary["k_error"] < 1e-5 and summary["v_error"] < 1e-5 and summary["kl"] < 1e-9
    for turn, reference in zip(result["prelrshared"]["turns"], result["fullshared"]["turns"], strict=True):
        assert turn["kl_sum"] == pytest.approx(reference["kl_sum"], rel=1e-3, abs=1e-6)
        for layer, reference_layer in zip(turn["layers"], reference["layers"], strict=True):
            assert layer["k_error"] == pytest.approx(reference_layer["k_error"], rel=1e-3, abs=1e-5)


def test_cache_split_and_base_kv_carry_the_biases(world):
    """base + adapter is the cached K/V, and the base part the forward's own projections give (`HiddenTap.base`,
    which the low-rank stores keep) equals the captured one: with Qwen2's and Phi's biases, both must include the
    bias (before RoPE for keys); Qwen3 normalises keys before RoPE, so its key split is the projection's output and
    RoPE(k_norm(base + adapter)) is the cached key. The tapped down-projections are X·Aᵀ of the split's A."""
    agents = load_agents(build_spec(world.lora_workflow), str(world.model), device="cpu", dtype="float32")
    ids = agents.tokenizer.encode("Question: Where was Kalomir born?\nplan:", add_special_tokens=False)
    splits = layer_splits(agents)
    model_type = agents.config.model_type
    assert model_type in ("qwen2", "mistral", "qwen3", "phi", "phi3")
    if model_type == "mistral":
        assert agents.config.sliding_window == MISTRAL_WINDOW
    if model_type == "phi":
        assert {rope.rotary_dim for rope in agents.ropes} == {head_dim(agents.config) // 2}
    biased = model_type in ("qwen2", "phi")
    assert all((split.key.base_bias is not None) == biased for split in splits)
    if biased:
        assert all(float(split.value.base_bias.abs().mean()) > 0.01 for split in splits)
    norms = key_norms(agents.base_model)
    assert (norms is not None) == (model_type == "qwen3")
    tap = HiddenTap(agents.base_model)
    positions = torch.arange(len(ids))
    for agent in AGENTS:
        captured = capture_turn(agents, agent, ids, parts=("kv", "split"))
        with tap.capture(), agents.activate(agent), torch.no_grad():
            agents.model(input_ids=torch.tensor([ids]))
        for index, layer in captured.layers.items():
            keys, values = layer.split["k_proj"], layer.split["v_proj"]
            norm = None if norms is None else norms[index]
            assert keys.normalised == (norm is not None) and not values.normalised
            rope = agents.ropes[index]
            cached_keys = keys.total if norm is None else apply_rope(norm(keys.total[None]), positions, rope)[0]
            torch.testing.assert_close(cached_keys, layer.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(values.total, layer.values, rtol=1e-4, atol=1e-5)
            hidden = tap.hidden[index]
            assert hidden is not None
            size = head_dim(agents.config)
            base_k, base_v = (heads(tap.base[index][side], size) for side in ("key", "value"))
            if norm is None:
                base_k = apply_rope(base_k, positions, rope)
            torch.testing.assert_close(base_k[0], keys.base, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(base_v[0], values.base, rtol=1e-4, atol=1e-5)
            for side in ("key", "value"):
                down = getattr(splits[index], side).down[agent]
                torch.testing.assert_close(tap.down[index][side][agent], hidden @ down.T, rtol=1e-4, atol=1e-5)


def shifted(traj: Trajectory) -> Trajectory:
    """`traj` with a three-token header inserted after the first segment of every second turn's input: what that
    turn reads after it (the task, earlier replies) lies at other positions than where it was computed, as a group
    chat's agent reads it after its own system prompt — moved spans."""
    segments = dict(traj.segments)
    turns = []
    for index, turn in enumerate(traj.turns):
        if index % 2:
            first = segments[turn.input[0]]
            header = f"header:{index}"
            segments[header] = Segment("message", first.scope, [(t + 7) % 50 for t in first.tokens[:3]], "", None)
            turn = dataclasses.replace(turn, input=[turn.input[0], header, *turn.input[1:]])
        turns.append(turn)
    return dataclasses.replace(traj, segments=segments, turns=turns)


def test_low_rank_policies_with_one_adapter_reproduce_the_dense_run_or_fullshared(world, run_cli, tmp_path):
    """With one adapter for every agent, a token's base plus the reader's adapter part is the producer's own cache.
    So, through this architecture's biases, partial rotary or key norm (Qwen3: the store keeps keys before the norm
    and RoPE): BaseShared (which computes moved spans) and PreLRShared on the turns where nothing moved reproduce the
    dense run; and where spans move — the captured trace's own, and those of the trace with every second turn's
    input shifted by a header (`shifted`) — PreLRShared (base keys re-rotated, or Qwen3's un-rotated keys normalised
    and rotated at the reader's positions; the key LR term rotated there; LR caches copied) serves exactly the K/V
    FullShared re-rotates: every turn's K/V error and KL are FullShared's."""
    captured = _capture(run_cli, world, world.lora_workflow, tmp_path / "capture")
    trace = read_trace(captured)
    moved = write_trace(tmp_path / "moved.jsonl", Trace(trace.header, [shifted(t) for t in trace.trajectories]))
    same = [arg for name in AGENTS for arg in ("--agent", f"{name}={world.adapter('act')}")]
    policies = ("--policy", "baseshared", "--policy", "prelrshared", "--policy", "fullshared")
    for path, out in ((captured, "same"), (str(moved), "moved")):
        result = _replay(run_cli, path, tmp_path / out, *policies, *same)
        assert set(result["policies"]) == {"baseshared-code", "prelrshared", "fullshared"}
        summary = result["policies"]["baseshared-code"]["summary"]
        assert summary["reuse_per_token"] > 0.3
        assert summary["k_error"] < 1e-5 and summary["v_error"] < 1e-5 and summary["kl"] < 1e-9
        full, low_rank = result["policies"]["fullshared"], result["policies"]["prelrshared"]
        assert low_rank["summary"]["moved"] == full["summary"]["moved"]
        assert low_rank["summary"]["prefilled"] == full["summary"]["prefilled"]
        for turn, reference in zip(low_rank["turns"], full["turns"], strict=True):
            if not turn["moved"]:
                assert turn["kl_sum"] < 1e-8 and all(layer["k_error"] < 1e-5 for layer in turn["layers"])
            assert turn["kl_sum"] == pytest.approx(reference["kl_sum"], rel=1e-3, abs=1e-6)
            for layer, reference_layer in zip(turn["layers"], reference["layers"], strict=True):
                for side in ("k_error", "v_error"):
                    assert layer[side] == pytest.approx(reference_layer[side], rel=1e-3, abs=1e-5)
    assert full["summary"]["moved"] > 0  # the shifted trace moves spans


def test_lora_capture_rank_analysis_and_replay(world, run_cli, tmp_path):
    trace = _capture(run_cli, world, world.lora_workflow, tmp_path / "capture")
    code, _, err = run_cli("rank-analysis", trace, "--out", tmp_path / "rank", *DEVICE)
    assert code == 0, err
    analysis = json.loads((tmp_path / "rank" / "rank_analysis.json").read_text())
    for kv in ("K", "V"):  # every agent feeds the same embeddings into layer 0: identical base parts
        assert analysis["layer_means"][0][kv]["base_cosine"] == pytest.approx(1.0, abs=1e-6)
    result = _replay(run_cli, trace, tmp_path / "replay", "--online")
    variants = {variant.label for variant in enumerate_variants() if "lora" in variant.policy.modes}
    prompt_only = {variant.label for variant in enumerate_variants()} - variants
    assert set(result["skipped"]) == {"baselrshared"} | prompt_only  # the adapters do not share A
    assert all("prompt-mode" in result["skipped"][label] for label in prompt_only)
    assert set(result["policies"]) == variants - {"baselrshared"}
    assert set(result["online"]) == set(result["policies"]) | {"dense"}
    _check_exact_and_shared(result)
    _check_selective_recompute_at_ratio_one(run_cli, trace, tmp_path / "recompute")
    # adapters that share A: BaseLRShared runs too
    shared_a = [arg for name in AGENTS for arg in ("--agent", f"{name}={world.shared_a_adapter(name)}")]
    result = _replay(run_cli, trace, tmp_path / "shared_a", "--policy", "baselrshared", *shared_a)
    assert set(result["policies"]) == {"baselrshared"} and not result.get("skipped")
    assert result["policies"]["baselrshared"]["summary"]["k_error"] > 0


def test_prompt_capture_rank_analysis_and_replay(world, run_cli, tmp_path):
    trace = _capture(run_cli, world, world.prompt_workflow, tmp_path / "capture")
    code, _, err = run_cli("rank-analysis", trace, "--out", tmp_path / "rank", *DEVICE)
    assert code == 0, err
    context_free = json.loads((tmp_path / "rank" / "rank_analysis.json").read_text())["context_free"]
    for kv in ("K", "V"):  # layer 0: a segment's cache is its context-free encoding, re-aligned (RoPE θ = 10⁶)
        assert context_free["layer_means"][0][kv]["delta_rank"] == 0.0
        assert context_free["layer_means"][0][kv]["delta_relative"] < 1e-5
    result = _replay(run_cli, trace, tmp_path / "replay", "--online")
    prompt = {variant.label for variant in enumerate_variants() if "prompt" in variant.policy.modes}
    assert set(result["policies"]) == prompt and {"fullshared", "nonshared", "cacheblend-ratio=0.1"} <= prompt
    assert all("lora-mode" in reason for reason in result["skipped"].values())
    assert set(result["online"]) == prompt | {"dense"}
    _check_exact_and_shared(result)
    _check_selective_recompute_at_ratio_one(run_cli, trace, tmp_path / "recompute")


def test_a_config_its_model_cannot_run_is_refused_in_one_sentence(run_cli, tmp_path):
    """The first survey's DeepSeek V3 config (a 16-channel head_dim against its default 64-channel RoPE key) crashed
    capture with a traceback inside the model's own forward; kvprof refuses it at load in one sentence, exit 2."""
    from transformers import DeepseekV3Config

    from kvprof.model.tiny import tiny_sizes

    def configure(vocab, eos):
        sizes = tiny_sizes(vocab, eos) | {"head_dim": 16}
        return DeepseekV3Config(**sizes, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

    world = build_tiny_world(tmp_path / "world", configure=configure)
    code, _, err = run_cli(
        "capture", "--model", world.model, "--workflow", world.lora_workflow, "--tasks", world.tasks,
        "--limit", "1", "--out", tmp_path / "capture", *DEVICE,
    )  # fmt: skip
    assert code == 2 and "fails its own forward pass" in err and "Traceback" not in err


def test_gemma4s_layers_of_two_head_sizes_replay(run_cli, tmp_path):
    """Gemma 4's global layers have heads of their own size (32 channels against the local layers' 16 here) and
    each layer reads a per-layer embedding of the input: kvprof keeps each layer's cache in its own shape, so the
    dense run reproduces the capture, NonShared is exact and FullShared re-aligns every layer with its own RoPE, in
    lora and prompt mode; memory counts each layer's heads. The policies that keep every layer in one shape and the
    selective ones (which would have to compute the per-layer inputs) are refused in one sentence each."""
    from transformers import Gemma4TextConfig

    from kvprof.model.tiny import tiny_sizes

    def configure(vocab, eos):
        sizes = tiny_sizes(vocab, eos, layers=6) | {"head_dim": 16, "global_head_dim": 32}
        return Gemma4TextConfig(**sizes, vocab_size_per_layer_input=vocab, hidden_size_per_layer_input=16)

    world = build_tiny_world(tmp_path / "world", configure=configure)
    for mode in ("lora", "prompt"):
        code, _, err = run_cli(
            "capture", "--model", world.model, "--workflow", getattr(world, f"{mode}_workflow"),
            "--tasks", world.tasks, "--limit", "1", "--out", tmp_path / mode, *DEVICE,
        )  # fmt: skip
        assert code == 0, err
        trace = tmp_path / mode / "trace.jsonl"
        code, _, err = run_cli("replay", trace, "--repeats", "1", "--out", tmp_path / f"{mode}-all", *DEVICE)
        assert code == 0, err
        result = json.loads((tmp_path / f"{mode}-all" / "replay.json").read_text())
        assert result["dense"]["summary"]["trace_agreement"] == 1.0
        assert result["policies"]["nonshared"]["summary"]["k_error"] == 0.0
        assert result["policies"]["fullshared"]["summary"]["k_error"] > 0
        reasons = set(result["skipped"].values())
        assert any("per-layer embedding of the input" in reason for reason in reasons)
        shapes = "attention layers of different shapes (2 KV heads of 16 and 2 KV heads of 32 channels)"
        assert any(shapes in reason for reason in reasons)
    agents = load_agents_for_trace(trace, device="cpu", dtype="float32")
    runtime = Runtime(agents)
    assert runtime.kv_bytes_per_token == 4 * 2 * 2 * (5 * 16 + 32)  # float32, K and V, 2 heads: 5 local, 1 global
    variants = [PolicyVariant("fullshared"), PolicyVariant("nonshared")]
    replayed = replay_trace(agents, read_trace(trace).trajectories, variants, check_memory=True)["policies"]
    assert all(entry["memory_accounting_exact"] for entry in replayed.values())


def test_selective_recompute_runs_where_keys_and_values_are_not_split(run_cli, tmp_path):
    """GPT-NeoX's per-head interleaved query_key_value has no separate key and value outputs: the low-rank split
    refuses it, but CacheBlend and DroidSpeak only run its layers, and at ratio 1 equal the dense run."""
    from transformers import GPTNeoXConfig

    from kvprof.model.tiny import tiny_sizes

    def configure(vocab, eos):
        sizes = {k: v for k, v in tiny_sizes(vocab, eos).items() if k != "num_key_value_heads"}
        return GPTNeoXConfig(**sizes)

    world = build_tiny_world(tmp_path / "world", configure=configure)
    trace = _capture(run_cli, world, world.prompt_workflow, tmp_path / "capture")
    flags = [
        arg for name in ("cacheblend", "droidspeak") for arg in ("--policy", name, "--policy-option", f"{name}.ratio=1")
    ]
    for label, entry in _replay(run_cli, trace, tmp_path / "recompute", *flags)["policies"].items():
        assert entry["summary"]["k_error"] < 1e-5 and entry["summary"]["v_error"] < 1e-5, label
