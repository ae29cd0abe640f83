"""The shipped codebook world: its agents answer held-out tasks, and reusing the other agent's cache costs accuracy."""

from __future__ import annotations

import json

import pytest

from kvprof.capture.workflow import exact_match
from kvprof.demo.codebook import workflow_spec
from kvprof.demo.codebook_world import codebook_world
from kvprof.model.agents import load_agents_for_trace
from kvprof.policies import PolicyVariant
from kvprof.replay.branches import ReplayPlanSummary
from kvprof.replay.engine import run_replay
from kvprof.replay.records import DENSE
from kvprof.replay.setting import ReplaySettings
from kvprof.traces.spec import build_spec
from kvprof.traces.trace import read_trace


@pytest.fixture(scope="module")
def world():
    return codebook_world()


def accuracy(trajectories) -> float:
    return sum(exact_match(t.prediction, t.answer) for t in trajectories) / len(trajectories)


def test_world_files(world):
    config = json.loads((world.model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 2
    assert build_spec(world.workflow) == workflow_spec()
    group_chat = build_spec(world.group_chat_workflow)
    assert group_chat.group_chat and group_chat.chat_template and group_chat.agents == workflow_spec().agents
    training = json.loads(world.training_record.read_text())
    assert {"recall", "lookup", "decode"} <= set(training["phases"])
    for path in world.sample_traces.values():
        header = json.loads(path.read_text().splitlines()[0])
        assert header["model"]["path"] == "../model"  # relative: the files name no machine's folders


def test_heldout_capture_answers(world):
    """NonShared (the agents generating, greedy) on the 100 captured held-out and standing-key tasks."""
    assert accuracy(read_trace(world.sample_traces["heldout"]).trajectories) >= 0.9
    assert accuracy(read_trace(world.sample_traces["standing"]).trajectories) >= 0.9


@pytest.fixture(scope="module")
def replayed(world):
    trace = world.sample_traces["short"]
    agents = load_agents_for_trace(trace, dtype="float32")
    return read_trace(trace).trajectories, run_replay(
        agents, read_trace(trace).trajectories, [PolicyVariant("fullshared")], ReplaySettings(online=True)
    )


def test_nonshared_replay_reproduces_the_capture(replayed):
    trajectories, result = replayed
    assert result["dense"]["summary"]["trace_agreement"] == 1.0
    assert result["online"][DENSE]["accuracy"] == accuracy(trajectories)


def test_fullshared_costs_accuracy(replayed):
    _, result = replayed
    fullshared = result["policies"]["fullshared"]
    assert result["online"]["fullshared"]["accuracy"] <= result["online"][DENSE]["accuracy"] - 0.2
    assert fullshared["summary"]["kl"] > 1e-2
    assert result["online"]["fullshared"]["diverged_turns"] > 0


def test_evaluation_record(world):
    record = json.loads(world.evaluation_record.read_text())
    for rows in (record["replay_online"], record["replay_online_standing"], record["replay_online_group_chat"]):
        assert rows["nonshared"]["accuracy"] >= 0.9
        assert rows["fullshared"]["accuracy"] <= rows["nonshared"]["accuracy"] - 0.2
        assert rows["fullshared"]["kl"] > 1e-2
    assert record["traces"]["heldout"]["accuracy"] == record["replay_online"]["nonshared"]["accuracy"]
    assert record["traces"]["group_chat"]["accuracy"] == record["replay_online_group_chat"]["nonshared"]["accuracy"]
    # the same tasks as a group chat: every prompt-mode policy serves moved spans (none in kvprof's own layout)
    assert set(record["replay_online_group_chat"]) == set(record["replay_online"])
    for label, row in record["replay_online_group_chat"].items():
        assert (row["moved"] > 0) == (label != "nonshared"), label
        assert record["replay_online"][label]["moved"] == 0


def test_group_chat_rendering(world):
    """The group-chat sample trace: the same held-out tasks through a chat template, each agent reading the other's
    outputs as user messages, so the manifest and the question move."""
    trace = read_trace(world.sample_traces["group_chat"])
    assert trace.header.workflow["group_chat"] is True and trace.header.workflow["chat_template"]
    plan = ReplayPlanSummary()
    for traj in trace.trajectories:
        plan.add(traj, "prompt")
    assert plan.moved > 0 and sum(plan.causes.values()) > 0
