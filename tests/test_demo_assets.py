"""The shipped demo world: it loads, its adapters are what they claim, capture and `kvprof demo` run on it."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from kvprof.cli import app
from kvprof.commands import capture
from kvprof.demo.assets import demo_world
from kvprof.demo.world import ROLES, read_tasks, workflow_spec
from kvprof.errors import KvprofError
from kvprof.model.agents import load_agents
from kvprof.policies import enumerate_variants, parse_policy_options
from kvprof.traces.spec import build_spec
from kvprof.traces.trace import read_trace, shared_segment_ids


@pytest.fixture(scope="module")
def world():
    return demo_world()


def test_world_files(world):
    config = json.loads((world.model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["head_dim"] >= 32 and config["max_position_embeddings"] >= 32768
    assert len(read_tasks(world.heldout_tasks)) >= 200
    for path in [*world.adapters.values(), *world.shared_a_adapters.values()]:
        adapter = json.loads((path / "adapter_config.json").read_text())
        assert adapter["r"] == 8 and set(adapter["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_workflows_match_the_world(world):
    assert build_spec(world.prompt_workflow) == workflow_spec("prompt")
    lora = build_spec(world.lora_workflow)
    assert [a.adapter for a in lora.agents] == [str(world.adapters[r].resolve()) for r in ROLES]
    prompts = [a.prompt for a in build_spec(world.prompt_workflow).agents]
    assert len({len(p) for p in prompts}) == len(prompts)


def test_shared_a_adapters_share_a_and_differ_in_b(world):
    weights = {
        role: load_file(str(path / "adapter_model.safetensors")) for role, path in world.shared_a_adapters.items()
    }
    keys_a = [k for k in weights["plan"] if "lora_A" in k]
    keys_b = [k for k in weights["plan"] if "lora_B" in k]
    assert keys_a and keys_b
    for key in keys_a:
        assert all(torch.equal(weights["plan"][key], weights[r][key]) for r in ROLES)
    assert not all(torch.equal(weights["plan"][k], weights["act"][k]) for k in keys_b)
    primary = {role: load_file(str(path / "adapter_model.safetensors")) for role, path in world.adapters.items()}
    assert not torch.equal(primary["plan"][keys_a[0]], primary["act"][keys_a[0]])


def test_sample_traces(world):
    for name, path in world.sample_traces.items():
        trace = read_trace(path)
        assert trace.header.mode == name.split("_")[0]
        assert trace.header.model["path"] == "../model"
        if name.endswith("long"):
            traj = trace.trajectories[0]
            shared = sum(len(traj.segments[s]) for s in shared_segment_ids(traj))
            assert shared >= 4000


def test_capture_two_tasks(world, tmp_path):
    for mode in ("prompt", "lora"):
        out = tmp_path / mode
        capture.command(
            model=str(world.model),
            tasks=world.heldout_tasks,
            workflow=world.workflow(mode),
            limit=2,
            out=out,
            device="cpu",
        )
        trace = read_trace(out / "trace.jsonl")
        assert len(trace.trajectories) == 2 and all(t.prediction for t in trace.trajectories)


def test_adapters_set_the_role(world):
    """On one gold lora-mode input (an act turn), the act adapter acts, the plan adapter plans and the reflect
    adapter says that the answer is not known yet."""
    from kvprof.capture.workflow import Sampling, generate
    from kvprof.demo.data import oracle_trajectory

    agents = load_agents(build_spec(world.lora_workflow), str(world.model), device="cpu")
    task = read_tasks(world.heldout_tasks)[0]
    traj = oracle_trajectory(agents.spec, agents.tokenizer, task)
    act_turn = traj.turns[1]
    ids = traj.input_tokens(act_turn)
    as_act = agents.tokenizer.decode(generate(agents, "act", ids, 16, agents.spec, Sampling()))
    as_plan = agents.tokenizer.decode(generate(agents, "plan", ids, 24, agents.spec, Sampling()))
    as_reflect = agents.tokenizer.decode(generate(agents, "reflect", ids, 12, agents.spec, Sampling()))
    assert as_act == task.output("act", 0)
    assert as_plan.startswith(" Plan:")
    assert as_reflect == task.output("reflect", 0)


def test_quick_demo_decides_for_both_families(tmp_path):
    from kvprof.commands.demo import QUICK_STAGES

    result = CliRunner().invoke(
        app, ["demo", "--tasks", "2", "--replay-tasks", "1", "--repeats", "1", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "demo.json").read_text())
    assert list(record["stages"]) == [stage.name for stage in QUICK_STAGES] and record["full"] is False
    for index, stage in enumerate(QUICK_STAGES, start=1):  # progress: what runs and how long is left
        assert f"[{index}/{len(QUICK_STAGES)}] {stage.name}" in result.output
    assert result.output.count("left in all") == len(QUICK_STAGES)
    lora = [label.split("-")[0] for label in record["stages"]["replay lora"]["online_accuracy"]]
    # every LoRA-family and selective policy, once: at its published defaults, no sweep
    assert {"dense", "fullshared", "baselrshared", "prelrshared", "cacheblend", "droidspeak", "relaycaching"} <= set(
        lora
    )
    assert len(lora) == len(set(lora))
    prompt = record["stages"]["prompt-role sharing"]["online_accuracy"]
    assert {"dense", "fullshared", "kvcomm", "kvcmas-chain"} <= set(prompt)
    report = (tmp_path / "report.html").read_text()
    assert report.index("Decision: which policy") < report.index("fidelity: ")  # the decision first
    assert report.index("Recommendation") < report.index("Decision: which policy")  # the recommendation before it
    decision = record["stages"]["recommend"]["recommendation"]  # over both families, printed last
    assert decision[1].startswith(("Recommended: lora/", "Recommended: prompt/", "Nothing meets the target"))
    flat = " ".join(result.output.split())
    last = flat[flat.rindex("Recommendation for the demo's target") :]
    assert all(" ".join(line.split()) in last for line in decision)
    written = json.loads((tmp_path / "replay" / "replay.json").read_text())  # the recorded command replays it
    args = written["args"]
    replayed = enumerate_variants(args["policy"], parse_policy_options(args["policy_option"]))
    assert sorted(v.label for v in replayed) == sorted(written["policies"])


def test_full_demo(tmp_path):
    from kvprof.commands.demo import FULL_STAGES

    result = CliRunner().invoke(
        app, ["demo", "--full", "--tasks", "2", "--replay-tasks", "1", "--repeats", "1", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "demo.json").read_text())
    assert list(record["stages"]) == [stage.name for stage in FULL_STAGES] and record["full"] is True
    recommended = json.loads((tmp_path / "recommend" / "recommend.json").read_text())
    assert [result["name"] for result in recommended["results"]] == ["lora", "alora", "prompt"]
    captures = [stage for name, stage in record["stages"].items() if "accuracy" in stage]
    assert len(captures) == 7 and all(0.0 <= stage["accuracy"] <= 1.0 for stage in captures)
    online = record["stages"]["replay"]["online_accuracy"]
    assert {"dense", "fullshared", "baselrshared", "rebaseshared-lp"} <= set(online)
    qv = record["stages"]["replay lora q/v"]  # the papers' setting: BaseLRShared runs (A shared on v_proj)
    assert {"dense", "fullshared", "baselrshared", "prelrshared"} <= set(qv["online_accuracy"])
    assert not any(label.startswith(("droidspeak", "cacheblend", "relaycaching")) for label in qv["k_error"])
    comparison = record["stages"]["aLoRA agents or LoRA agents"]["comparison"]
    for targets in ("q/k/v/o", "q/v"):  # plain LoRA agents under the LoRA family, aLoRA twins under exact sharing
        rows = {(row["agents"], row["policy"]): row for row in comparison[targets]}
        assert {("LoRA", "prelrshared"), ("LoRA", "baselrshared"), ("aLoRA", "alorashared")} <= set(rows)
        assert {("aLoRA", "fullshared"), ("aLoRA", "nonshared")} <= set(rows)
        assert rows[("aLoRA", "alorashared")]["kl"] <= 1e-6  # exact, on the demo's own adapters
        assert rows[("aLoRA", "alorashared")]["prefilled"] < rows[("aLoRA", "nonshared")]["prefilled"]
    assert "LoRA agents (the shared-A set) or aLoRA agents (q/v, r=8)" in result.output
    assert (tmp_path / "report.html").stat().st_size > 0
    recorded = json.loads((tmp_path / "capture_lora" / "capture.json").read_text())["args"]
    assert list(recorded) == list(inspect.signature(capture.command).parameters)  # what `kvprof capture` records
    # the recorded command replays its variants
    for stage in ("prompt_sharing", "codebook_sharing", "replay_qv", "replay_alora"):
        written = json.loads((tmp_path / stage / "replay.json").read_text())
        args = written["args"]
        replayed = enumerate_variants(args["policy"], parse_policy_options(args["policy_option"]))
        assert sorted(v.label for v in replayed) == sorted(written["policies"]), stage


def test_commands_default_to_the_demo_world(tmp_path):
    """`kvprof replay --policy rebaseshared --schedule lp` and `kvprof rank-analysis` run as typed."""
    result = CliRunner().invoke(
        app,
        [
            "replay",
            "--policy",
            "rebaseshared",
            "--schedule",
            "lp",
            "--limit",
            "1",
            "--repeats",
            "1",
            "--out",
            str(tmp_path / "replay"),
        ],
    )
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "replay" / "replay.json").read_text())
    assert record["trace"] == str(demo_world().sample_traces["lora_short"])
    assert list(record["policies"]) == ["rebaseshared-lp"]
    result = CliRunner().invoke(app, ["rank-analysis", "--limit", "1", "--out", str(tmp_path / "rank")])
    assert result.exit_code == 0, result.output


def test_incomplete_world_is_refused(tmp_path):
    with pytest.raises(KvprofError, match="incomplete"):
        demo_world(tmp_path)
