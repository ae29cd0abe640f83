"""`kvprof replay` from the command line: results, refusals, resumable sweeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvprof.kernels.expansion import native_library
from kvprof.model.agents import load_agents_for_trace
from kvprof.policies import PolicyVariant, enumerate_variants
from kvprof.replay.lockstep import ReplayProgress, replay_trace
from kvprof.traces.trace import read_trace


def test_replay_writes_json_and_html(run_cli, lora_trace, tmp_path):
    code, out, err = run_cli(
        "replay",
        lora_trace,
        "--policy",
        "fullshared",
        "--policy",
        "prelrshared",
        "--limit",
        "1",
        "--repeats",
        "2",
        "--out",
        tmp_path,
        "--device",
        "cpu",
    )
    assert code == 0, err
    assert "fidelity:" in out and "cost:" in out and "prelrshared" in out
    result = json.loads((tmp_path / "replay.json").read_text())
    assert result["schema"] == "kvprof.result.replay" and result["repeats"] == 2
    assert set(result["policies"]) == {"fullshared", "prelrshared"}
    assert len(result["dense"]["turns"]) == len(read_trace(lora_trace).trajectories[0].turns)
    html = (tmp_path / "replay.html").read_text()
    assert "plotly" in html and "Sharing policies against the dense run" in html
    assert not (tmp_path / "replay.partial.json").exists()


def test_policy_all_on_prompt_trace_skips_lora_policies(run_cli, tiny_world, tmp_path):
    trace_dir = tmp_path / "capture"
    assert (
        run_cli(
            "capture",
            "--model",
            tiny_world.model,
            "--workflow",
            tiny_world.prompt_workflow,
            "--tasks",
            tiny_world.tasks,
            "--limit",
            "1",
            "--out",
            trace_dir,
        )[0]
        == 0
    )
    code, out, err = run_cli("replay", trace_dir / "trace.jsonl", "--repeats", "1", "--out", tmp_path / "replay")
    assert code == 0, err
    result = json.loads((tmp_path / "replay" / "replay.json").read_text())
    prompt_variants = {v.label for v in enumerate_variants() if "prompt" in v.policy.modes}
    assert set(result["policies"]) == prompt_variants and "fullshared" in prompt_variants
    assert "prelrshared" in result["skipped"] and "lora-mode" in result["skipped"]["prelrshared"]
    fullshared = result["policies"]["fullshared"]["summary"]
    assert fullshared["reuse_per_token"] > 0 and fullshared["k_error"] > 0  # re-aligned keys from other prompts
    code, _, err = run_cli("replay", trace_dir / "trace.jsonl", "--policy", "prelrshared", "--out", tmp_path)
    assert code == 2 and "replays lora-mode traces" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (("--policy", "magic"), "unknown policy 'magic'"),
        (("--policy", "baselrshared"), "share their down-projection A"),
        (("--agent", "critic=x"), "unknown agent name 'critic'"),
    ],
)
def test_replay_bad_input(run_cli, lora_trace, tmp_path, args, message):
    code, out, err = run_cli("replay", lora_trace, *args, "--out", tmp_path)
    assert code == 2 and message in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1
    assert not (tmp_path / "replay.json").exists()


def test_resumed_replay_equals_uninterrupted(lora_trace, tmp_path):
    agents = load_agents_for_trace(lora_trace, device="cpu", dtype="float32")
    trajectories = read_trace(lora_trace).trajectories[:2]
    choices = [PolicyVariant("fullshared")]
    checkpoints = []
    full = replay_trace(
        agents,
        trajectories,
        choices,
        on_trajectory=lambda state: checkpoints.append(json.loads(json.dumps(state.to_json()))),
    )
    assert [len(c["trajectories"]) for c in checkpoints] == [1, 2]
    resumed = replay_trace(
        agents, trajectories, choices, progress=ReplayProgress.of_checkpoint(checkpoints[0], Path("checkpoint"))
    )
    for key in ("kl", "k_error", "v_error", "prefilled", "turns"):
        assert resumed["policies"]["fullshared"]["summary"][key] == pytest.approx(
            full["policies"]["fullshared"]["summary"][key]
        )


def test_report_merges_results(run_cli, lora_trace, tmp_path):
    assert (
        run_cli(
            "replay",
            lora_trace,
            "--policy",
            "fullshared",
            "--limit",
            "1",
            "--repeats",
            "1",
            "--out",
            tmp_path / "replay",
        )[0]
        == 0
    )
    assert (
        run_cli(
            "capture",
            "--model",
            read_trace(lora_trace).header.model["path"],
            "--shapes",
            _shape_csv(tmp_path),
            "--out",
            tmp_path / "capture",
        )[0]
        == 0
    )
    code, out, err = run_cli(
        "report",
        tmp_path / "capture" / "capture.json",
        tmp_path / "replay" / "replay.json",
        "--out",
        tmp_path / "dash.html",
    )
    assert code == 0, err
    assert "Captured trajectories" in out and "fidelity:" in out
    page = (tmp_path / "dash.html").read_text()
    assert page.count("<section id=") == 3  # the replay's decision and diagnostics, the capture
    assert page.index("Decision: which policy") < page.index("Captured trajectories")


def _shape_csv(tmp_path):
    path = tmp_path / "shape.csv"
    path.write_text("agent,prefill_len,decode_len\nplan,12,4\nact,6,3\n")
    return path


def test_report_refuses_non_results(run_cli, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = run_cli("report", bad)
    assert code == 2 and "is not valid JSON" in err
    bad.write_text('{"hello": 1}')
    code, _, err = run_cli("report", bad)
    assert code == 2 and "is not a kvprof result" in err
    code, _, err = run_cli("report", tmp_path / "missing.json")
    assert code == 2 and "does not exist" in err


def test_resume_refuses_a_checkpoint_of_other_settings(run_cli, lora_trace, tmp_path, monkeypatch):
    """A replay interrupted after its first trajectory resumes only with the settings its checkpoint was made
    with; with them it completes, replaying only the rest."""
    import kvprof.replay.checkpoint as checkpoint_module

    write_json = checkpoint_module.write_json

    def write_then_interrupt(path, payload):
        write_json(path, payload)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module, "write_json", write_then_interrupt)
    args = ("replay", lora_trace, "--limit", "2", "--out", tmp_path, "--device", "cpu")
    code, _, err = run_cli(*args, "--policy", "fullshared", "--repeats", "1")
    checkpoint = tmp_path / "replay.partial.json"
    assert code == 130 and checkpoint.exists() and not (tmp_path / "replay.json").exists()
    monkeypatch.undo()
    for other, difference in (
        (("--policy", "prelrshared", "--repeats", "1"), "(--policy fullshared, not prelrshared)"),
        (("--policy", "fullshared", "--repeats", "2"), "(--repeats 1, not 2)"),
        (("--policy", "fullshared", "--repeats", "1", "--dtype", "bfloat16"), "(--dtype float32, not bfloat16)"),
    ):
        code, out, err = run_cli(*args, *other, "--resume")
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and "Traceback" not in out + err and len(lines) == 1, err
        assert f"replay.partial.json was made with other settings {difference}" in lines[0]
    made = json.loads(checkpoint.read_text())
    earlier = dict(made, identity={k: v for k, v in made["identity"].items() if k != "expansion"})
    checkpoint.write_text(json.dumps(earlier))  # as a kvprof before the expansion path was recorded wrote it
    code, out, err = run_cli(*args, "--policy", "fullshared", "--repeats", "1", "--resume")
    assert code == 2 and "views expanded by: not recorded (a checkpoint of an earlier kvprof)" in err, err
    checkpoint.write_text(json.dumps(made))
    if native_library() is not None:  # views expanded by the fused kernel: resumed where they would be by torch
        with monkeypatch.context() as patched:
            patched.setenv("KVPROF_NATIVE", "0")
            native_library.cache_clear()
            code, out, err = run_cli(*args, "--policy", "fullshared", "--repeats", "1", "--resume")
        native_library.cache_clear()
        assert code == 2 and "kvprof's fused CPU kernel, not torch" in err, err
    code, out, err = run_cli(*args, "--policy", "fullshared", "--repeats", "1", "--resume")
    assert code == 0, err
    assert "resuming after 1 replayed trajectories" in out and not checkpoint.exists()
    trajectories = read_trace(lora_trace).trajectories[:2]
    result = json.loads((tmp_path / "replay.json").read_text())
    assert len(result["policies"]["fullshared"]["turns"]) == sum(len(t.turns) for t in trajectories)


@pytest.mark.parametrize("variant", [{"use_dora": True}, {"lora_bias": True}], ids=["dora", "lora_bias"])
def test_adapters_that_are_not_plain_lora_skip_the_low_rank_policies(
    run_cli, lora_trace, tiny_world, tmp_path, variant
):
    """A DoRA adapter (rescaled projection) or one with a bias on B has no X·A·B split: the low-rank policies are
    skipped with the reason under `--policy all` and refused in one sentence when named; the others replay."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_world.model)
    config = LoraConfig(r=4, target_modules=["k_proj", "v_proj"], init_lora_weights=False, **variant)
    get_peft_model(base, config).save_pretrained(tmp_path / "adapter")
    agents = ("--agent", f"plan={tmp_path / 'adapter'}")
    code, _, err = run_cli(
        "replay", lora_trace, "--policy", "all", "--repeats", "1", "--out", tmp_path / "all", *agents
    )
    assert code == 0, err
    result = json.loads((tmp_path / "all" / "replay.json").read_text())
    low_rank = {
        "baseshared-code",
        "baseshared-full",
        "baseshared-incremental",
        "prelrshared",
        "rebaseshared-lp",
        "rebaseshared-db",
    }
    assert low_rank <= set(result["skipped"]) and not low_rank & set(result["policies"])
    assert all("agent plan's adapter on layer 0 k_proj" in result["skipped"][label] for label in low_rank)
    assert {"nonshared", "fullshared", "cacheblend-ratio=0.1"} <= set(result["policies"])
    assert result["policies"]["nonshared"]["summary"]["k_error"] == 0.0
    code, _, err = run_cli("replay", lora_trace, "--policy", "baseshared", "--out", tmp_path / "named", *agents)
    assert code == 2 and err.count("\n") == 1 and "pick a policy that does not split the cache" in err
