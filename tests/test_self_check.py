"""kvprof checks its policies on the user's model before a replay reports (`kvprof.replay.self_check`): a policy whose
exact setting does not reproduce the dense run there is refused with the measured error. Shown by making kvprof miss
what it once missed: a sliding window shorter than the trace (the selective policies were 5–29 % off) and LFM2's key
norm (the low-rank split was 47 % off)."""

from __future__ import annotations

import json

import pytest

from kvprof.model.tiny import AGENTS, build_tiny_world, tiny_sizes

DEVICE = ("--device", "cpu", "--dtype", "float32")
SELECTIVE = ("cacheblend", "droidspeak", "relaycaching")
LOW_RANK = ("baseshared", "prelrshared")


def _capture(run_cli, world, out) -> str:
    code, _, err = run_cli(
        "capture", "--model", world.model, "--workflow", world.lora_workflow, "--tasks", world.tasks,
        "--limit", "1", "--out", out, *DEVICE,
    )  # fmt: skip
    assert code == 0, err
    return str(out / "trace.jsonl")


def _replay(run_cli, trace: str, out, policies, *extra) -> tuple[dict | None, str]:
    flags = [arg for policy in policies for arg in ("--policy", policy)]
    code, stdout, err = run_cli("replay", trace, *flags, "--repeats", "1", "--out", out, *DEVICE, *extra)
    result = json.loads((out / "replay.json").read_text()) if code == 0 else None
    return result, stdout + err


def test_policies_that_hold_on_the_model_pass_and_record_their_error(lora_trace, run_cli, tmp_path):
    result, _ = _replay(run_cli, lora_trace, tmp_path, (*SELECTIVE, *LOW_RANK, "rebaseshared", "fullshared"))
    assert result is not None
    checked = result["self_check"]
    assert {label.split("-")[0] for label in checked} == {*SELECTIVE, "baseshared", "prelrshared"}
    assert len(checked) == 5
    assert all(0 <= error < 1e-5 for error in checked.values())
    assert {"rebaseshared-lp", "fullshared"} <= set(result["policies"])


def test_a_window_kvprof_does_not_see_refuses_the_selective_policies(run_cli, tmp_path, monkeypatch):
    """Mistral with a 24-token window on longer traces: told every layer attends fully, recomputing at ratio 1 is
    off the dense run, and each selective policy is refused naming the error; the others replay."""
    import kvprof.model.agents
    from kvprof.model.layers import FullAttention

    world = build_tiny_world(tmp_path / "world", arch="mistral")
    config_path = world.model / "config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"sliding_window": 24}))
    trace = _capture(run_cli, world, tmp_path / "capture")
    full = [FullAttention("rope")] * 2
    monkeypatch.setattr(kvprof.model.agents, "layer_kinds", lambda model, ropes: full)
    result, output = _replay(run_cli, trace, tmp_path / "replay", (*SELECTIVE, "fullshared"))
    assert result is not None and set(result["policies"]) == {"fullshared"}
    errors = {label.split("-")[0]: error for label, error in result["self_check"].items()}
    for name in SELECTIVE:
        assert errors[name] > 1e-2
        assert f"on this model, {name}-ratio=" in " ".join(output.split())


def test_a_key_norm_kvprof_does_not_see_refuses_the_low_rank_policies(run_cli, tmp_path, monkeypatch):
    """LFM2 normalises keys with `k_layernorm`: with the name unknown, the split of an agent's own cache is off its
    K/V and BaseShared and PreLRShared are refused (exit 2 when nothing is left), never reported."""
    from transformers import Lfm2Config

    import kvprof.model.lora

    world = build_tiny_world(tmp_path / "world", configure=lambda vocab, eos: Lfm2Config(**tiny_sizes(vocab, eos)))
    trace = _capture(run_cli, world, tmp_path / "capture")
    monkeypatch.setitem(kvprof.model.lora.NORM_NAMES, "k_proj", ("k_norm",))
    result, output = _replay(run_cli, trace, tmp_path / "replay", (*LOW_RANK, "nonshared"))
    assert result is not None and set(result["policies"]) == {"nonshared"}
    assert result["self_check"]["baseshared-code"] > 1e-2 and result["self_check"]["prelrshared"] > 1e-2
    assert "leaves a relative K/V error of" in " ".join(output.split())
    _, output = _replay(run_cli, trace, tmp_path / "alone", ("prelrshared",))
    assert "no policy can replay this trace" in output and "Traceback" not in output
    assert not (tmp_path / "alone" / "replay.json").exists()


@pytest.mark.parametrize("agent", AGENTS[:1])
def test_the_one_agent_setting_gives_every_turn_to_one_agent(lora_trace, agent):
    from kvprof.replay.self_check import one_agent
    from kvprof.traces.trace import read_trace

    trajectory = read_trace(lora_trace).trajectories[0]
    assert {turn.agent for turn in one_agent(trajectory, agent).turns} == {agent}
    assert len({turn.agent for turn in trajectory.turns}) > 1
