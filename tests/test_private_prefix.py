"""Per-task private text: each agent reads its own notes for a task after its role prompt (prompt mode), so private
prefixes differ from trajectory to trajectory; capture records them, replay serves each trajectory's own, and an
online re-run rebuilds them from the task."""

from __future__ import annotations

import json

from kvprof.model.agents import load_agents_for_trace
from kvprof.policies import PolicyVariant
from kvprof.replay.lockstep import replay_trace
from kvprof.replay.online import run_online
from kvprof.replay.records import DENSE
from kvprof.traces.tasks import load_tasks, task_of
from kvprof.traces.trace import read_trace


def test_capture_puts_each_agents_notes_after_its_role_prompt(prompt_trace, tiny_world):
    trace = read_trace(prompt_trace)
    tasks = {task.id: task for task in load_tasks(tiny_world.tasks)}
    spec_prompts = {agent["name"]: agent["prompt"] for agent in trace.header.workflow["agents"]}
    prefixes = {traj.id: traj.private_prefixes() for traj in trace.trajectories}
    for traj in trace.trajectories:
        assert traj.private == tasks[traj.id].private
        for turn in traj.turns:
            prompt = traj.segments[turn.input[0]]
            assert prompt.scope == "private"
            assert prompt.text == spec_prompts[turn.agent] + traj.private.get(turn.agent, "")
            assert traj.input_tokens(turn)[: len(prefixes[traj.id][turn.agent])] == prefixes[traj.id][turn.agent]
    # tiny0 has no notes, tiny1 and tiny2 have notes of different lengths per agent and per task
    assert not trace.trajectories[0].private
    lengths = {
        (traj.id, agent): len(tokens)
        for traj_id, per in prefixes.items()
        for agent, tokens in per.items()
        for traj in trace.trajectories
        if traj.id == traj_id
    }
    assert len(set(lengths.values())) > 3


def test_replay_serves_each_trajectorys_own_prefixes(prompt_trace):
    """NonShared reproduces the dense run on every turn of every trajectory (notes or not); FullShared re-rotates
    shared keys from the producer's prefix length to the reader's, which differ per task."""
    agents = load_agents_for_trace(prompt_trace, device="cpu", dtype="float32")
    trace = read_trace(prompt_trace)
    result = replay_trace(agents, trace.trajectories, [PolicyVariant("nonshared"), PolicyVariant("fullshared")])
    nonshared = result["policies"]["nonshared"]
    assert nonshared["summary"]["kl"] == 0.0 and nonshared["summary"]["k_error"] == 0.0
    assert result["policies"]["fullshared"]["summary"]["reuse_per_token"] > 0
    assert len(result["dense"]["turns"]) == sum(len(traj.turns) for traj in trace.trajectories)


def test_online_rerun_rebuilds_the_notes_from_the_task(prompt_trace):
    """The dense online re-run of a captured task (greedy, as capture ran) reproduces its trajectory token for
    token, notes included."""
    agents = load_agents_for_trace(prompt_trace, device="cpu", dtype="float32")
    trace = read_trace(prompt_trace)
    captured = trace.trajectories[1]
    assert captured.private
    runs = run_online(agents, [task_of(captured)], [])
    rerun = runs[DENSE][0]
    assert rerun.private == captured.private
    assert [rerun.input_tokens(t) for t in rerun.turns] == [captured.input_tokens(t) for t in captured.turns]
    assert [rerun.output_tokens(t) for t in rerun.turns] == [captured.output_tokens(t) for t in captured.turns]


def test_malformed_private_field_is_one_sentence(run_cli, tiny_world, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "x", "question": "Where?", "private": {"plan": 3}}) + "\n")
    code, out, err = run_cli(
        "capture",
        "--model",
        tiny_world.model,
        "--workflow",
        tiny_world.prompt_workflow,
        "--tasks",
        tasks,
        "--out",
        tmp_path / "out",
        "--device",
        "cpu",
    )
    assert code != 0
    assert "field 'private' should map agent names to texts" in out + err
    assert "Traceback" not in out + err
    assert not (tmp_path / "out" / "trace.jsonl").exists()
