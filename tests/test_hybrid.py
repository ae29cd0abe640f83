"""Hybrid models (`kvprof.model.recurrent`) on a tiny Qwen 3.5 world (three Gated DeltaNet layers, then an attention
layer, as Qwen 3.5 interleaves them), in lora and prompt mode: kvprof names the layers, captures as peft generates,
and replays NonShared exactly — each agent's recurrent layers continue from their state after its own cache, as a
hybrid prefix cache does — while every policy that would share or move caches is refused in one sentence naming the
recurrent layer. Rank analysis reads the attention layers only."""

from __future__ import annotations

import json

import pytest
import torch
from peft_oracle import assert_keys_realign, assert_peft_generations

from kvprof.model.agents import load_agents_for_trace
from kvprof.model.runtime import Runtime
from kvprof.model.tiny import AGENTS, TinyWorld, build_tiny_world, tiny_sizes
from kvprof.policies.base import tensor_bytes
from kvprof.policies.nonshared import NonShared
from kvprof.policies.turns import TurnRequest
from kvprof.replay.engine import paged_bytes
from kvprof.traces.trace import read_trace

DEVICE = ("--device", "cpu", "--dtype", "float32")
LAYERS = "recurrent (linear_attn: a state, no K/V per token): layers 0–2; full attention, rope: layer 3"


def qwen3_5(vocab: int, eos: int):
    from transformers import Qwen3_5TextConfig

    linear = {"linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2}
    return Qwen3_5TextConfig(**tiny_sizes(vocab, eos, layers=4), head_dim=16, linear_num_value_heads=4, **linear)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> TinyWorld:
    return build_tiny_world(tmp_path_factory.mktemp("qwen3_5"), configure=qwen3_5)


@pytest.fixture(scope="module", params=["lora", "prompt"])
def trace(request, world, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp(f"capture_{request.param}")
    from typer.testing import CliRunner

    from kvprof.cli import app

    done = CliRunner().invoke(
        app,
        [
            "capture", "--model", str(world.model), "--workflow", str(getattr(world, f"{request.param}_workflow")),
            "--tasks", str(world.tasks), "--limit", "2", "--out", str(out), *DEVICE,
        ],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    assert LAYERS in " ".join(done.output.split())
    return str(out / "trace.jsonl")


def test_layers_are_named_and_captures_are_peft_generations(world, run_cli, tmp_path):
    code, stdout, err = run_cli("inspect", _lora_trace(world, run_cli, tmp_path), "--model", world.model, *DEVICE)
    assert code == 0, err
    assert LAYERS in " ".join(stdout.split())
    assert_peft_generations(world.model, {agent: world.adapter(agent) for agent in AGENTS}, tmp_path)
    code, _, err = run_cli(
        "capture", "--model", world.model, "--workflow", world.prompt_workflow, "--tasks", world.tasks,
        "--limit", "2", "--out", tmp_path / "prompt", *DEVICE,
    )  # fmt: skip
    assert code == 0, err
    assert_peft_generations(world.model, {}, tmp_path, capture="prompt")


def test_the_attention_layers_keys_realign_by_their_rope(world):
    from transformers import AutoModelForCausalLM

    from kvprof.model.rope import model_ropes

    ropes = model_ropes(AutoModelForCausalLM.from_pretrained(world.model))
    assert ropes.names[:3] == ("no keys (recurrent)",) * 3
    assert_keys_realign(world.model, ropes)


def _lora_trace(world: TinyWorld, run_cli, tmp_path) -> str:
    code, _, err = run_cli(
        "capture", "--model", world.model, "--workflow", world.lora_workflow, "--tasks", world.tasks,
        "--limit", "2", "--out", tmp_path / "capture", *DEVICE,
    )  # fmt: skip
    assert code == 0, err
    return str(tmp_path / "capture" / "trace.jsonl")


def test_nonshared_replays_and_every_sharing_policy_is_refused_for_the_recurrent_layers(trace, run_cli, tmp_path):
    code, _, err = run_cli("replay", trace, "--policy", "all", "--repeats", "1", "--out", tmp_path, *DEVICE)
    assert code == 0, err
    result = json.loads((tmp_path / "replay.json").read_text())
    assert list(result["policies"]) == ["nonshared"]
    assert result["dense"]["summary"]["trace_agreement"] == 1.0
    assert [kind["attention"] for kind in result["layers"]] == ["recurrent"] * 3 + ["full"]
    mode_refusals = {label for label, reason in result["skipped"].items() if "-mode traces" in reason}
    for label, reason in result["skipped"].items():
        assert label in mode_refusals or "layer 0 of model" in reason and "recurrent layer (linear_attn)" in reason
    code, _, err = run_cli("replay", trace, "--policy", "cacheblend", "--out", tmp_path / "blend", *DEVICE)
    assert code == 2 and "recurrent layer (linear_attn)" in err and "Traceback" not in err


def test_nonshared_continues_each_agents_own_state_exactly(trace):
    """Every turn's logits equal the model's own forward of the whole call from scratch, while later turns of an
    agent reuse its cache (the recurrent layers restart from the state after it); memory counts each agent's
    states apart from its K/V, at their exact bytes in KV blocks too (they are not token-indexed)."""
    agents = load_agents_for_trace(trace, device="cpu", dtype="float32")
    runtime = Runtime(agents)
    policy = NonShared(runtime)
    reused = 0
    for traj in read_trace(trace).trajectories:
        runtime.serve_trajectory(traj)
        policy.reset()
        for turn in traj.turns:
            ids, outputs = traj.input_tokens(turn), traj.output_tokens(turn)
            result = policy.run_turn(TurnRequest(turn.agent, ids, outputs))
            reused += result.reused
            with torch.inference_mode(), agents.activate(turn.agent):
                reference = agents.model(input_ids=torch.tensor([ids + outputs])).logits[0].float()
            expected = reference[len(ids) - 1 : len(ids) - 1 + len(result.logits)]
            assert (result.logits - expected).abs().max() <= 1e-4 * expected.abs().max()
            live, formula = tensor_bytes(policy.live_tensors()), policy.analytic_bytes()
            assert live == formula and formula[f"cache:{turn.agent}"] >= runtime.kv_bytes_per_token * len(ids)
            states = {name: tensors for name, tensors in policy.live_tensors().items() if name.startswith("recurrent")}
            assert paged_bytes(states, 16) == sum(formula[name] for name in states) == len(states) * runtime.state_bytes
    assert reused > 0 and runtime.state_bytes > 0


def test_rank_analysis_reads_the_attention_layers(trace, run_cli, tmp_path):
    code, _, err = run_cli("rank-analysis", trace, "--out", tmp_path / "rank", *DEVICE)
    assert code == 0, err
    analysis = json.loads((tmp_path / "rank" / "rank_analysis.json").read_text())
    assert analysis["layers"] == [3]
    assert [kind["attention"] for kind in analysis["layer_kinds"]] == ["recurrent"] * 3 + ["full"]
    code, _, err = run_cli("rank-analysis", trace, "--layers", "0", "--out", tmp_path / "r0", *DEVICE)
    assert code == 2 and "layer 0 is a recurrent layer (linear_attn)" in err and "attention layers (layer 3)" in err
