"""Replay figures measured where serving pays them, the same way for every policy: real decode steps, work in the
right phase, memory with transients, one reuse definition, the dense oracle checked against the trace, and token
identity checked before anything is reused."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch
from test_policies import matrices, shared_a_agents  # noqa: F401  (fixtures)

from kvprof.demo.assets import demo_world
from kvprof.model.agents import load_agents_for_trace
from kvprof.model.runtime import Runtime
from kvprof.policies import PolicyVariant, TurnRequest
from kvprof.policies.prelrshared import PreLRShared
from kvprof.replay.branches import BranchingTimeline, plan_trajectory
from kvprof.replay.lockstep import replay_trace
from kvprof.traces.trace import Trajectory, read_header, read_trace


@pytest.fixture(scope="module")
def lora(matrices):  # noqa: F811
    return matrices("lora")


def test_decode_is_timed_per_output_token(lora):
    for records in [lora["dense"]["turns"], *(entry["turns"] for entry in lora["policies"].values())]:
        for turn in records:
            assert turn["decode_steps"] == turn["output_tokens"] and turn["decode_s"] > 0
    for entry in [lora["dense"], *lora["policies"].values()]:
        summary = entry["summary"]
        assert summary["tpot_s"] == pytest.approx(summary["decode_s"] / summary["output_tokens"])
        assert summary["decode_tokens_per_s"] == pytest.approx(1 / summary["tpot_s"])


@pytest.mark.parametrize("name", ["nonshared", "prelrshared"])
def test_a_decode_steps_first_run_cost_stays_out_of_tpot(lora_trace, shared_a_agents, monkeypatch, name):  # noqa: F811
    """With repeats (a warm-up), the first decode step's forward runs once untimed before the timed steps, so a
    cost paid only on a kernel's first run (Triton's compilation: here a sleep on the first one-token forward) is
    not in TPOT; without repeats it is. The warm-up changes nothing decoded: same tokens, same logits, same cache."""
    policy = PolicyVariant(name).build(Runtime(shared_a_agents))
    traj = read_trace(lora_trace).trajectories[0]
    turn = traj.turns[0]
    request = TurnRequest(turn.agent, traj.input_tokens(turn), traj.output_tokens(turn))
    original = type(policy)._forward
    calls = []

    def first_decode_is_slow(self, agent, ids, *args, **kwargs):
        if len(ids) == 1 and not calls:
            calls.append(True)
            time.sleep(0.2)
        return original(self, agent, ids, *args, **kwargs)

    monkeypatch.setattr(type(policy), "_forward", first_decode_is_slow)
    runs = {}
    for repeats in (1, 2):
        calls.clear()
        policy.reset()
        runs[repeats] = policy.run_turn(request, repeats)
    assert len(request.output_ids) > 1
    assert runs[1].decode_s >= 0.2 > runs[2].decode_s
    assert runs[1].output_ids == runs[2].output_ids == request.output_ids
    assert torch.equal(runs[1].logits, runs[2].logits)
    stored = [policy.live_tensors()]
    calls.clear()
    policy.reset()
    policy.run_turn(request, 1)
    stored.append(policy.live_tensors())
    for name_, tensors in stored[0].items():
        for a, b in zip(tensors, stored[1][name_], strict=True):
            assert torch.equal(a, b), name_


def test_prelrshared_down_projections_are_charged_to_ttft(lora_trace, shared_a_agents, monkeypatch):  # noqa: F811
    """The chunk's base K/V and every agent's X·A_k are computed inside the timed prefill (as serving computes them
    while prefilling), not after decoding."""
    policy = PolicyVariant("prelrshared").build(Runtime(shared_a_agents))
    traj = read_trace(lora_trace).trajectories[0]
    turn = traj.turns[0]
    first = policy.prefill(turn.agent, traj.input_tokens(turn))
    (update,) = first.context.updates
    assert len(update) == len(traj.input_tokens(turn)) and set(update.low_rank) == {"plan", "act", "reflect"}
    assert len(policy.store) == 0, "prefill must not change the store"

    original = PreLRShared.on_prefill

    def slow(self, *args):
        time.sleep(0.05)
        return original(self, *args)

    monkeypatch.setattr(PreLRShared, "on_prefill", slow)
    slowed = policy.run_turn(TurnRequest(turn.agent, traj.input_tokens(turn), traj.output_tokens(turn)))
    assert slowed.ttft_s >= 0.05
    assert len(policy.store) == len(traj.input_tokens(turn)) + len(traj.output_tokens(turn))


def test_memory_counts_transients(lora):
    policies = lora["policies"]
    for label, entry in [("dense", lora["dense"]), *policies.items()]:
        summary = entry["summary"]  # (ALoRAShared stores nothing of plain LoRA agents' calls)
        assert summary["peak_working_bytes"] > 0 and summary["peak_working_bytes"] >= summary["peak_memory_bytes"]
        assert summary["peak_memory_bytes"] > 0 or label == "alorashared", label
    # the full LR prefill re-processes the whole context: its working set exceeds what BaseShared stores
    baseshared = policies["baseshared-full"]["summary"]
    assert baseshared["peak_working_bytes"] > 1.5 * baseshared["peak_memory_bytes"]
    # double batching holds a 2-row cache during the turn
    assert (
        policies["rebaseshared-db"]["summary"]["peak_working_bytes"]
        > policies["rebaseshared-lp"]["summary"]["peak_working_bytes"]
    )


def test_reuse_has_one_definition(lora):
    """Policies that reuse the same spans report the same ρ, whatever cache serves the tokens."""
    policies = lora["policies"]
    spans = {label: [(turn["reused"], turn["moved"]) for turn in entry["turns"]] for label, entry in policies.items()}
    same = [label for label in policies if spans[label] == spans["prelrshared"]]
    assert {"prelrshared", "rebaseshared-lp", "rebaseshared-db", "baselrshared"} <= set(same)
    for label in same:
        assert policies[label]["summary"]["reuse_per_token"] == policies["prelrshared"]["summary"]["reuse_per_token"]
    # FullShared reuses the same prefixes and moved spans (the tiny model's outputs repeat whole replies); BaseShared
    # the same prefixes, computing the moved spans
    assert "fullshared" in same
    assert [reused for reused, _ in spans["baseshared-code"]] == [reused for reused, _ in spans["prelrshared"]]
    moved = sum(moved for _, moved in spans["fullshared"])
    base, low_rank = policies["baseshared-code"]["summary"], policies["prelrshared"]["summary"]
    assert (low_rank["reuse_per_token"] > base["reuse_per_token"]) == (moved > 0)
    assert policies["nonshared"]["summary"]["reuse_per_token"] == 0.0
    assert policies["rebaseshared-lp"]["summary"]["adapter_free_per_token"] > 0.0
    assert policies["prelrshared"]["summary"]["adapter_free_per_token"] == 0.0


@pytest.mark.parametrize("name", ["lora_short", "prompt_short"])
def test_dense_run_reproduces_every_captured_sample_trace(name):
    world = demo_world()
    path = world.sample_traces[name]
    assert read_header(path).source == "capture"
    agents = load_agents_for_trace(path, device="cpu", dtype="float32")
    result = replay_trace(agents, read_trace(path).trajectories, [])
    assert result["dense"]["summary"]["trace_agreement"] == 1.0


def test_a_turn_that_leaves_the_timeline_reuses_its_common_prefix(lora_trace, monkeypatch):
    agents = load_agents_for_trace(lora_trace, device="cpu", dtype="float32")
    traj = read_trace(lora_trace).trajectories[0]
    original = Trajectory.input_tokens

    def corrupted(self, turn):
        ids = original(self, turn)
        if turn is self.turns[2]:
            ids = ids[:3] + [(ids[3] + 1) % 50] + ids[4:]
        return ids

    monkeypatch.setattr(Trajectory, "input_tokens", corrupted)
    result = replay_trace(agents, [traj], [PolicyVariant("fullshared")])
    start = result["dense"]["turns"][2]["start"]
    assert start["kept"] == 3 and start["divergence"]["position"] == 3 and start["restored_from"] is None
    assert result["policies"]["fullshared"]["turns"][2]["reused"] == 3
    assert result["dense"]["summary"]["timeline"]["left"] == 1


def test_the_timeline_records_who_processed_each_token_first():
    policy = SimpleNamespace(truncate=lambda keep: None, forget_spans=lambda: None, release_last_turn=lambda: None)
    timeline = BranchingTimeline(plan_trajectory([[1, 2], [1, 2, 3, 4], [1, 9]], [[3], [5], [6]]), [policy])
    for index, (agent, length) in enumerate([("plan", 3), ("act", 5), ("plan", 3)]):
        timeline.begin(index)
        timeline.end(index, agent, length)
        if index == 1:
            assert timeline.producers == ["plan", "plan", "plan", "act", "act"]
    assert timeline.producers == ["plan", "plan", "plan"]


def test_ttft_flops_give_the_speed_up_the_work_allows(lora):
    policies = lora["policies"]
    for label, entry in policies.items():
        summary = entry["summary"]
        assert 0 < summary["ttft_flops"] <= summary["flops"], label
        implied = lora["dense"]["summary"]["ttft_flops"] / summary["ttft_flops"]
        assert summary["ttft_speedup_implied_flops"] == pytest.approx(implied)
        assert summary["harness_efficiency"] == pytest.approx(summary["ttft_speedup"] / implied)
    # double batching computes both rows in the prefill; lazy prefill defers the adapter-free pass past the turn
    lazy, batched = policies["rebaseshared-lp"]["summary"], policies["rebaseshared-db"]["summary"]
    assert batched["ttft_flops"] > 1.5 * lazy["ttft_flops"]
    assert policies["nonshared"]["summary"]["ttft_flops"] == lora["dense"]["summary"]["ttft_flops"]


def test_results_name_the_cpu_they_were_measured_on(run_cli, lora_trace, tmp_path):
    code, out, err = run_cli(
        "replay",
        lora_trace,
        "--policy",
        "fullshared",
        "--limit",
        "1",
        "--repeats",
        "1",
        "--device",
        "cpu",
        "--out",
        tmp_path,
    )
    assert code == 0, err
    result = json.loads((tmp_path / "replay.json").read_text())
    assert result["cpu"]["name"] and result["environment"]["cpu"] == result["cpu"]
    assert set(result["cpu"]["matrix_flags"]) <= {
        "amx_bf16",
        "amx_tile",
        "avx512_bf16",
        "avx512_fp16",
        "avx512f",
        "avx2",
    }
    assert f"cost: cpu ({result['cpu']['name']}" in out
