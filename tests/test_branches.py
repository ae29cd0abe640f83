"""Replay of traces whose turns do not extend one shared context (`kvprof.replay.branches`): each turn reuses its
longest common prefix with any earlier turn's sequence and recomputes the rest, under every policy; nothing is refused
unless --strict asks for it."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from test_policies import CASES, check_variant

from kvprof.model.agents import load_agents_for_trace
from kvprof.model.runtime import Runtime
from kvprof.policies import PolicyVariant, TurnRequest, runnable_variants
from kvprof.replay.branches import BranchingTimeline, plan_of, plan_trajectory
from kvprof.replay.lockstep import replay_trace
from kvprof.replay.setting import ReplaySettings
from kvprof.traces.trace import Segment, Trace, Trajectory, read_trace, write_trace


def brute_force_prefix(ids: list[int], earlier: list[list[int]]) -> int:
    """The longest common prefix of `ids` with any sequence of `earlier`, one id at a time."""
    best = 0
    for sequence in earlier:
        length = 0
        while length < min(len(ids), len(sequence)) and ids[length] == sequence[length]:
            length += 1
        best = max(best, length)
    return best


def test_plan_reuses_the_longest_prefix_of_any_earlier_turn():
    rng = random.Random(3)
    for _ in range(200):
        inputs, outputs, sequences = [], [], []
        for _ in range(rng.randint(1, 8)):
            base = rng.choice(sequences) if sequences and rng.random() < 0.8 else []
            cut = rng.randint(0, len(base))
            ids = base[:cut] + [rng.randint(0, 3) for _ in range(rng.randint(1, 6))]
            out = [rng.randint(0, 3) for _ in range(rng.randint(1, 4))]
            inputs.append(ids)
            outputs.append(out)
            sequences.append(ids + out)
        previous: list[int] = []
        for index, start in enumerate(plan_trajectory(inputs, outputs)):
            ids = inputs[index]
            assert start.keep == brute_force_prefix(ids, sequences[:index])
            from_previous = brute_force_prefix(ids, [previous])
            if start.restore is None:
                assert start.keep == from_previous and start.dropped == len(previous) - start.keep
            else:
                source = sequences[start.restore]
                assert start.keep > from_previous and ids[: start.keep] == source[: start.keep]
                assert start.dropped == len(source) - start.keep
            if start.divergence is not None:
                assert start.divergence.position == start.keep < len(ids)
            previous = sequences[index]


def test_plan_of_an_alternating_group_chat():
    """Two agents each read their own replies under one header (7, also their generation prompt) and the other's
    under another (8): every turn from the third on returns to its own agent's previous turn."""
    question = [1, 2, 3]
    own, other = 7, 8
    a1, b1, a2 = [20, 21], [30, 31], [22, 23]
    inputs = [
        question + [own],
        question + [other, *a1, own],
        question + [own, *a1, other, *b1, own],
        question + [other, *a1, own, *b1, other, *a2, own],
    ]
    outputs = [a1, b1, a2, [32]]
    starts = plan_trajectory(inputs, outputs)
    assert [s.restore for s in starts] == [None, None, 0, 1]
    assert [s.keep for s in starts] == [0, 3, 3 + 1 + 2, 3 + 1 + 2 + 1 + 2]
    assert [s.divergence.position if s.divergence else None for s in starts] == [None, 3, None, None]
    assert [s.dropped for s in starts] == [0, 3, 0, 0]


def re_rendered(traj: Trajectory) -> Trajectory:
    """`traj` as a server may have rendered it: every second turn reads the latest reply it reads with its first id
    changed (a trimmed space, another header), so that turn leaves the context and the next one returns to an
    earlier turn's."""
    segments = dict(traj.segments)
    turns = []
    for index, turn in enumerate(traj.turns):
        outputs = [i for i, seg_id in enumerate(turn.input) if segments[seg_id].kind == "output"]
        if index % 2 and outputs:
            position = outputs[-1]
            old = segments[turn.input[position]]
            copy = f"{turn.input[position]}:re-rendered"
            segments[copy] = Segment(
                "message", old.scope, [(old.tokens[0] + 1) % 50, *old.tokens[1:]], old.text, old.producer
            )
            turn = dataclasses.replace(turn, input=[*turn.input[:position], copy, *turn.input[position + 1 :]])
        turns.append(turn)
    return dataclasses.replace(traj, segments=segments, turns=turns)


def branching_trace(trace_path, folder):
    trace = read_trace(trace_path)
    path = write_trace(folder / "branching.jsonl", Trace(trace.header, [re_rendered(t) for t in trace.trajectories]))
    return path, read_trace(path).trajectories


@pytest.fixture(scope="module", params=["lora", "prompt"])
def branching(request, tiny_world, tmp_path_factory):
    """Per mode: the branching trace, its agents (lora: adapters sharing A, so every LoRA policy runs) and the replay
    of every variant of that mode."""
    mode = request.param
    source = request.getfixturevalue(f"{mode}_trace")
    path, trajectories = branching_trace(source, tmp_path_factory.mktemp(f"branching-{mode}"))
    flags = [f"{name}={tiny_world.shared_a_adapter(name)}" for name in ("plan", "act", "reflect")]
    agents = load_agents_for_trace(path, agent_flags=flags if mode == "lora" else None, device="cpu", dtype="float32")
    variants, skipped = runnable_variants([v for m, v in CASES if m == mode], Runtime(agents), skip=True)
    assert not skipped
    result = replay_trace(agents, trajectories[:2], variants, check_memory=True)
    return mode, path, trajectories[:2], agents, result


def test_every_policy_replays_every_turn_of_a_branching_trace(branching):
    mode, _, trajectories, _, result = branching
    starts = [turn["start"] for turn in result["dense"]["turns"]]
    assert len(starts) == sum(len(t.turns) for t in trajectories)
    assert any(s["divergence"] for s in starts) and any(s["restored_from"] is not None for s in starts)
    timeline = result["dense"]["summary"]["timeline"]
    assert timeline["left"] > 0 and timeline["restored"] > 0 and timeline["dropped_tokens"] > 0
    for entry in result["policies"].values():
        check_variant(entry, result["dense"])


def test_fullshared_reuses_the_longest_common_prefix(branching):
    """Per turn, FullShared (one cache for every agent) reuses exactly the input's longest common prefix with any
    earlier turn's input and outputs (lora mode; in prompt mode after the agents' private prefixes), short of the
    last input id, computed here from the trace's ids alone."""
    mode, _, trajectories, agents, result = branching
    runtime = Runtime(agents)
    reused = iter(turn["reused"] for turn in result["policies"]["fullshared"]["turns"])
    for traj in trajectories:
        runtime.serve_trajectory(traj)
        sequences: list[list[int]] = []
        for turn in traj.turns:
            shared = traj.input_tokens(turn)[len(runtime.prefix(turn.agent)) :]
            assert next(reused) == min(brute_force_prefix(shared, sequences), len(shared) - 1)
            sequences.append(shared + traj.output_tokens(turn))
    realigned = [turn["realigned"] for turn in result["policies"]["fullshared"]["turns"]]
    if mode == "lora":  # no private prefixes: every reused token sits where it was computed
        assert not any(runtime.prefix(turn.agent) for traj in trajectories for turn in traj.turns)
        assert not any(realigned)
    else:  # role prompts of different lengths: another agent's tokens are re-rotated to the reader's positions
        assert any(realigned)


def check_dense_is_a_full_forward(agents, trajectories) -> None:
    """NonShared, driven through each trajectory as replay drives it, against the model's own forward over each
    turn's whole input and outputs (transformers' attention, no cache, peft's adapter)."""
    runtime = Runtime(agents)
    dense = PolicyVariant("nonshared").build(runtime)
    for traj in trajectories:
        runtime.serve_trajectory(traj)
        dense.reset()
        timeline = BranchingTimeline(plan_of(traj, runtime.prefixes), [dense])
        for index, turn in enumerate(traj.turns):
            ids, outputs = traj.input_tokens(turn), traj.output_tokens(turn)
            timeline.begin(index)
            logits = dense.run_turn(TurnRequest(turn.agent, ids, outputs)).logits
            timeline.end(index, turn.agent, len(ids) - len(runtime.prefix(turn.agent)) + len(outputs))
            with torch.inference_mode(), agents.activate(turn.agent):
                full = agents.model(input_ids=torch.tensor([ids + outputs])).logits[0].float()
            torch.testing.assert_close(logits, full[len(ids) - 1 : len(ids) - 1 + len(outputs)], rtol=1e-4, atol=1e-4)


def test_nonshared_on_a_branching_trace_equals_a_full_forward(branching):
    """The dense run's logits on every turn equal the model's own forward, however much of each turn it reused."""
    _, _, trajectories, agents, _ = branching
    check_dense_is_a_full_forward(agents, trajectories)


@pytest.mark.parametrize("name", sorted({v.name for _, v in CASES}))
def test_a_restored_snapshot_replays_the_next_turn_identically(name, lora_trace, prompt_trace, tiny_world):
    """`snapshot` / `restore` (the policy contract every policy inherits): a turn run after restoring the state of
    the turn before it gives the same logits and memory as the first time."""
    variant = next(v for _, v in CASES if v.name == name)
    mode = "lora" if "lora" in variant.policy.modes else "prompt"
    trace = lora_trace if mode == "lora" else prompt_trace
    flags = [f"{n}={tiny_world.shared_a_adapter(n)}" for n in ("plan", "act", "reflect")] if mode == "lora" else None
    runtime = Runtime(load_agents_for_trace(trace, agent_flags=flags, device="cpu", dtype="float32"))
    traj = read_trace(trace).trajectories[0]
    runtime.serve_trajectory(traj)
    policy = variant.build(runtime)
    requests = [TurnRequest(t.agent, traj.input_tokens(t), traj.output_tokens(t)) for t in traj.turns[:3]]
    for request in requests[:2]:
        policy.run_turn(request)
    saved = policy.snapshot()
    first = policy.run_turn(requests[2])
    policy.restore(saved)
    again = policy.run_turn(requests[2])
    torch.testing.assert_close(again.logits, first.logits, rtol=0, atol=0)
    assert again.memory == first.memory and again.reused == first.reused


def test_replay_cli_replays_a_branching_trace_and_strict_refuses_it(branching, run_cli, tmp_path):
    mode, path, *_ = branching
    if mode != "lora":
        pytest.skip("one mode is enough for the command line")
    code, out, err = run_cli("replay", str(path), "--policy", "fullshared", "--limit", "1", "--out", tmp_path)
    assert code == 0, err
    result = json.loads((tmp_path / "replay.json").read_text())
    assert result["dense"]["summary"]["timeline"]["left"] > 0
    assert "left the shared context" in out
    code, out, err = run_cli("inspect", str(path), "--out", tmp_path / "inspect")
    assert code == 0, err
    planned = json.loads((tmp_path / "inspect" / "inspect.json").read_text())["replay"]
    assert planned["restored"] > 0 and sum(planned["causes"].values()) > 0 and "replay: " in out
    code, _, err = run_cli("replay", str(path), "--strict", "--limit", "1", "--out", tmp_path / "strict")
    assert code == 2 and "--strict" in err and "turn 1" in err
    assert not (tmp_path / "strict" / "replay.json").exists()


NUMBERS = ("kl", "top1", "reused", "moved", "from_others", "prefilled", "flops", "ttft_flops", "memory", "layers")


def test_a_replay_within_a_kv_budget_computes_the_same_numbers(branching):
    """Every variant, on the branching trace (restores, truncations, snapshots): under a budget no run's stores fit
    in, each run's stores are written out after it runs and read back before it runs again — every number but the
    timings is the unbounded replay's, and the moves are counted apart."""
    mode, _, trajectories, agents, result = branching
    variants, _ = runnable_variants([v for m, v in CASES if m == mode], Runtime(agents), skip=True)
    budgeted = replay_trace(agents, trajectories, variants, ReplaySettings(kv_budget=1), check_memory=True)
    assert budgeted["kv_budget"]["parks"] > 0 and budgeted["kv_budget"]["moved_bytes"] > 0
    for label, entry in [("dense", result["dense"]), *result["policies"].items()]:
        again = budgeted["dense"] if label == "dense" else budgeted["policies"][label]
        assert len(again["turns"]) == len(entry["turns"])
        for turn, first in zip(again["turns"], entry["turns"]):
            assert {key: turn.get(key) for key in NUMBERS} == {key: first.get(key) for key in NUMBERS}, label
        if label != "dense":
            assert again["memory_accounting_exact"]


def test_a_run_holds_only_its_stores_while_another_runs(branching, monkeypatch):
    """Between its calls a run keeps its stores alone: its workspace is released when its call ends, and its last
    turn's cache once the timeline has kept what later turns move of it (`BranchingTimeline.finish`, right after the
    run's turn) — so the lockstep holds one run's transient buffers at a time, not every run's."""
    from kvprof.policies.base import SharingPolicy

    mode, _, trajectories, agents, result = branching
    variants, _ = runnable_variants([v for m, v in CASES if m == mode], Runtime(agents), skip=True)
    runs: dict[int, SharingPolicy] = {}
    held_by_others: list[str] = []
    run_turn = SharingPolicy.run_turn

    def watched(self, request, *args, **kwargs):
        runs[id(self)] = self
        for other in runs.values():
            if other is not self and (other.last_turn is not None or other.workspace.held):
                held_by_others.append(other.label)
        return run_turn(self, request, *args, **kwargs)

    monkeypatch.setattr(SharingPolicy, "run_turn", watched)
    again = replay_trace(agents, trajectories, variants)
    assert len(runs) == len(variants) + 1 and any(run.moves_spans for run in runs.values())
    assert held_by_others == []
    for label, entry in result["policies"].items():
        turns = again["policies"][label]["turns"]
        assert [turn["kl"] for turn in turns] == [turn["kl"] for turn in entry["turns"]], label
