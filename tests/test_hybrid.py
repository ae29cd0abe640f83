"""Hybrid models (`kvprof.model.recurrent`): tiny Qwen 3.5 (Gated DeltaNet), Granite 4-H (Mamba-2) and LFM2 (short
convolutions) worlds, recurrent layers first as the released models start, in lora and prompt mode.

kvprof names the layers, captures as peft generates, and replays NonShared, FullShared and ALoRAShared with the
recurrent states kept where a checkpoint rule keeps them (`kvprof.policies.state_checkpoints`): every exact run
equals the model's own forward over each whole call while later calls resume from kept states; lora-mode FullShared
hands the producer's states to the reader and reports what that costs; every other policy is refused in one
sentence naming the recurrent layer. Rank analysis reads the attention layers only."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from peft_oracle import assert_keys_realign, assert_peft_generations

from kvprof.model.agents import load_agents_for_trace
from kvprof.model.runtime import Runtime
from kvprof.model.tiny import AGENTS, HYBRIDS, TinyWorld, build_adapter, build_tiny_world, hybrid_config
from kvprof.policies.base import tensor_bytes
from kvprof.policies.turns import TurnRequest
from kvprof.policies.variants import PolicyVariant
from kvprof.replay.timing import run_trajectory
from kvprof.simulate.workload import load_replay
from kvprof.traces.reuse import SpanMatching
from kvprof.traces.trace import read_trace

DEVICE = ("--device", "cpu", "--dtype", "float32")
RULES = {  # short intervals, so that the tiny traces' calls resume from kept states under every rule
    "vllm": SpanMatching(checkpoints="vllm", checkpoint_interval=16),
    "sglang": SpanMatching(checkpoints="sglang", checkpoint_interval=8),
    "boundaries": SpanMatching(checkpoints="boundaries"),
}


MIXERS = {"qwen3_5_text": "linear_attn", "granitemoehybrid": "mamba", "lfm2": "conv"}


def configure(arch: str):
    return partial(hybrid_config, arch)


@pytest.fixture(scope="module", params=HYBRIDS)
def world(request, tmp_path_factory) -> tuple[str, TinyWorld]:
    return request.param, build_tiny_world(tmp_path_factory.mktemp(request.param), configure=configure(request.param))


def capture(run_cli, world: TinyWorld, mode: str, out, *flags) -> str:
    code, stdout, err = run_cli(
        "capture", "--model", world.model, "--workflow", getattr(world, f"{mode}_workflow"),
        "--tasks", world.tasks, "--limit", "2", *flags, "--out", out, *DEVICE,
    )  # fmt: skip
    assert code == 0, err
    return str(out / "trace.jsonl")


@pytest.fixture(scope="module")
def traces(world, tmp_path_factory) -> dict[str, str]:
    from typer.testing import CliRunner

    from kvprof.cli import app

    _, tiny = world
    paths = {}
    for mode in ("lora", "prompt"):
        out = tmp_path_factory.mktemp(f"capture_{mode}")
        done = CliRunner().invoke(
            app,
            [
                "capture", "--model", str(tiny.model), "--workflow", str(getattr(tiny, f"{mode}_workflow")),
                "--tasks", str(tiny.tasks), "--limit", "2", "--out", str(out), *DEVICE,
            ],
        )  # fmt: skip
        assert done.exit_code == 0, done.output
        paths[mode] = str(out / "trace.jsonl")
    return paths


def replay_exactly(trace: str, policy: str, matching: SpanMatching) -> int:
    """Replay `trace`'s first trajectory under `policy` with `matching`'s checkpoint rule, holding every turn's logits
    to the model's own forward over the whole call from scratch and its memory to the live tensors; tokens reused."""
    agents = load_agents_for_trace(trace, device="cpu", dtype="float32")
    runtime = Runtime(agents, span_matching=matching)
    run = PolicyVariant(policy).build(runtime)
    assert runtime.checkpoint_rule is not None and runtime.checkpoint_rule.name == matching.checkpoints
    reused = 0
    for traj in read_trace(trace).trajectories[:1]:  # its agents call again
        runtime.serve_trajectory(traj)
        run.reset()
        for turn, (result,) in zip(traj.turns, run_trajectory(runtime, [run], traj)):
            ids, outputs = traj.input_tokens(turn), traj.output_tokens(turn)
            with torch.inference_mode(), agents.activate(turn.agent):
                reference = agents.model(input_ids=torch.tensor([ids + outputs])).logits[0].float()
            expected = reference[len(ids) - 1 : len(ids) - 1 + len(result.logits)]
            assert (result.logits - expected).abs().max() <= 1e-4 * expected.abs().max(), (policy, turn.agent)
            reused += result.reused
        live, formula = tensor_bytes(run.live_tensors()), run.analytic_bytes()
        assert live == formula
        states = {name: size for name, size in formula.items() if name.startswith("recurrent states")}
        assert all(size % runtime.state_bytes == 0 for size in states.values())
    return reused


@pytest.mark.parametrize("rule", list(RULES))
def test_exact_runs_resume_from_kept_states_and_equal_the_models_forward(world, traces, rule):
    """NonShared (both modes) and prompt-mode FullShared (agents' role prompts differ: one prefix cache serves each
    agent its own sequences) equal the model's own forward of every whole call, while later calls resume from the
    states the rule kept."""
    for mode, policy in (("lora", "nonshared"), ("prompt", "nonshared"), ("prompt", "fullshared")):
        assert replay_exactly(traces[mode], policy, RULES[rule]) > 0, (mode, policy)


def test_replay_runs_fullshared_on_hybrids_and_refuses_the_others_naming_the_layer(world, traces, run_cli, tmp_path):
    arch, _ = world
    mixer = f"recurrent layer ({MIXERS[arch]})"
    code, _, err = run_cli("replay", traces["lora"], "--policy", "all", "--repeats", "2", "--out", tmp_path, *DEVICE)
    assert code == 0, err
    result = json.loads((tmp_path / "replay.json").read_text())
    assert set(result["policies"]) == {"nonshared", "fullshared", "alorashared"}
    assert result["dense"]["summary"]["trace_agreement"] == 1.0
    assert result["span_matching"]["checkpoints"] == "vllm"
    rule = result["checkpoint_rule"]  # as resolved on the model: vLLM's B from its sizes, on a GPU's kernel block
    assert rule["name"] == "vllm" and rule["interval"] % 16 == 0 and rule["label"] == f"vllm (B = {rule['interval']})"
    assert result["policies"]["nonshared"]["summary"]["kl"] == 0.0
    shared = result["policies"]["fullshared"]["summary"]
    assert shared["kl"] > 0 and shared["reuse_per_token"] > 0 and 0 <= shared["trace_agreement"] <= 1
    for label, reason in result["skipped"].items():
        assert "-mode traces" in reason or mixer in reason and "no per-token entries" in reason, label
    work = load_replay(tmp_path / "replay.json").policies["nonshared"]
    dense_turns = result["policies"]["nonshared"]["turns"]
    kept = [request.kept_bytes for traj in work for request in traj.requests]
    assert kept == [turn["memory_bytes"] for turn in dense_turns]  # the stored K/V and kept states (memory test)
    code, _, err = run_cli("simulate", tmp_path / "replay.json", "--qps", "1", "--duration", "5", "--out", tmp_path)
    assert code == 0, err
    code, _, err = run_cli("replay", traces["lora"], "--policy", "cacheblend", "--out", tmp_path / "blend", *DEVICE)
    assert code == 2 and mixer in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_anchor_pools_are_refused_on_hybrids_naming_the_layer(world, traces, run_cli, tmp_path):
    """fit-anchors and tune-tau (which fits a pool first) refuse a hybrid in one sentence, as the policies that read
    a pool are refused; so does fit-anchors' plan, whose probe meets the same refusal on the first layers."""
    arch, _ = world
    commands = [("fit-anchors",), ("tune-tau",)] + [("fit-anchors", "--plan")] * (arch == "lfm2")
    for command in commands:
        code, _, err = run_cli(*command[:1], traces["prompt"], *command[1:], "--out", tmp_path / command[0], *DEVICE)
        lines = [line for line in err.strip().splitlines() if line.startswith("error: ")]
        assert code == 2 and "Traceback" not in err and len(lines) == 1, (command, err)
        assert f"recurrent layer ({MIXERS[arch]})" in lines[0] and "anchor pools" in lines[0], (command, err)
        assert not (tmp_path / command[0] / "anchors.safetensors").exists()


def test_memory_counts_one_state_per_kept_position(world, traces):
    """With states kept at every message boundary, NonShared holds per agent one state per boundary of its stored
    sequence, beside its attention K/V; a rule keeping fewer holds fewer."""
    trace = traces["lora"]
    agents = load_agents_for_trace(trace, device="cpu", dtype="float32")
    held = {}
    for rule in ("boundaries", "vllm"):
        runtime = Runtime(agents, span_matching=RULES[rule])
        run = PolicyVariant("nonshared").build(runtime)
        traj = read_trace(trace).trajectories[0]
        runtime.serve_trajectory(traj)
        run.reset()
        run_trajectory(runtime, [run], traj)
        held[rule] = {
            name: size // runtime.state_bytes for name, size in run.analytic_bytes().items() if "states" in name
        }
    assert set(held["boundaries"]) == {f"recurrent states:{agent}" for agent in AGENTS}
    assert all(count >= 2 for count in held["boundaries"].values())
    assert sum(held["vllm"].values()) < sum(held["boundaries"].values())


def test_activated_lora_agents_share_the_base_states_exactly(run_cli, tmp_path):
    """aLoRA agents on a tiny Qwen 3.5: the adapters act from their invocation on (the check at load compares every
    layer's output before it, recurrent layers included); ALoRAShared reuses the base model's K/V and states up to
    each call's invocation from the last kept state and equals NonShared, prefilling less."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    world = build_tiny_world(tmp_path / "world", configure=configure("qwen3_5_text"))
    tokenizer = AutoTokenizer.from_pretrained(world.model)
    flags = []
    for seed, agent in enumerate(AGENTS):
        ids = tokenizer.encode(f"{agent}:", add_special_tokens=False)
        model = AutoModelForCausalLM.from_pretrained(world.model)
        build_adapter(
            model, tmp_path / "alora" / agent, seed=20 + seed, targets=("q_proj", "k_proj", "v_proj"), invocation=ids
        )
        flags += ["--agent", f"{agent}={tmp_path / 'alora' / agent}"]
    trace = capture(run_cli, world, "lora", tmp_path / "capture", *flags)
    assert_peft_generations(world.model, {agent: tmp_path / "alora" / agent for agent in AGENTS}, tmp_path)
    code, _, err = run_cli(
        "replay", trace, "--policy", "nonshared", "--policy", "alorashared", "--checkpoints", "boundaries",
        "--repeats", "1", "--out", tmp_path / "replay", *DEVICE,
    )  # fmt: skip
    assert code == 0, err
    result = json.loads((tmp_path / "replay" / "replay.json").read_text())
    nonshared, shared = (result["policies"][label]["summary"] for label in ("nonshared", "alorashared"))
    assert shared["kl"] <= 1e-6 and shared["k_error"] <= 1e-5
    assert shared["prefilled"] < nonshared["prefilled"]


def test_layers_are_named_and_captures_are_peft_generations(world, run_cli, tmp_path):
    arch, tiny = world
    trace = capture(run_cli, tiny, "lora", tmp_path / "capture")
    code, stdout, err = run_cli("inspect", trace, "--model", tiny.model, *DEVICE)
    assert code == 0, err
    assert f"recurrent ({MIXERS[arch]}: a state, no K/V per token)" in " ".join(stdout.split())
    assert "alorashared" in stdout and "baseshared" not in stdout  # the policies that replay a hybrid
    assert_peft_generations(tiny.model, {agent: tiny.adapter(agent) for agent in AGENTS}, tmp_path)


def test_the_attention_layers_keys_realign_by_their_rope(world):
    from transformers import AutoModelForCausalLM

    from kvprof.model.rope import model_ropes

    arch, tiny = world
    ropes = model_ropes(AutoModelForCausalLM.from_pretrained(tiny.model))
    assert "no keys (recurrent)" in ropes.names
    if arch == "granitemoehybrid":  # Granite 4.0-H's attention layers have no position embedding
        assert set(ropes.names) == {"no keys (recurrent)", "NoPE"}
        return
    assert_keys_realign(tiny.model, ropes)


def test_rank_analysis_reads_the_attention_layers(world, traces, run_cli, tmp_path):
    arch, _ = world
    attention = 2 if arch == "lfm2" else 3
    code, _, err = run_cli("rank-analysis", traces["lora"], "--out", tmp_path / "rank", *DEVICE)
    assert code == 0, err
    analysis = json.loads((tmp_path / "rank" / "rank_analysis.json").read_text())
    assert analysis["layers"] == [attention]
    code, _, err = run_cli("rank-analysis", traces["lora"], "--layers", "0", "--out", tmp_path / "r0", *DEVICE)
    assert code == 2 and f"layer 0 is a recurrent layer ({MIXERS[arch]})" in err


def test_a_greedy_call_keeps_its_end_as_an_engine_computes_it(world, traces):
    """Generating, a call's last id is sampled and never computed by an engine: with states kept at each call's end,
    NonShared keeps them after the last id but one (found one step ahead) and the agent's next call resumes there,
    equal to the model's own forward."""
    trace = traces["lora"]
    agents = load_agents_for_trace(trace, device="cpu", dtype="float32")
    runtime = Runtime(agents, span_matching=RULES["boundaries"])
    run = PolicyVariant("nonshared").build(runtime)
    traj = read_trace(trace).trajectories[0]
    runtime.serve_trajectory(traj)
    run.reset()
    turn = traj.turns[0]
    ids = traj.input_tokens(turn)
    first = run.run_turn(TurnRequest(turn.agent, ids, max_new_tokens=6, boundaries=frozenset({len(ids)})))
    end = len(ids) + len(first.output_ids) - 1
    assert max(run.checkpoints[turn.agent].states) == end
    follow = ids + first.output_ids + ids[:8]
    second = run.run_turn(TurnRequest(turn.agent, follow, output_ids=ids[8:12]))
    assert second.reused == end
    with torch.inference_mode(), agents.activate(turn.agent):
        reference = agents.model(input_ids=torch.tensor([follow + ids[8:12]])).logits[0].float()
    expected = reference[len(follow) - 1 : len(follow) + 3]
    assert (second.logits - expected).abs().max() <= 1e-4 * expected.abs().max()
