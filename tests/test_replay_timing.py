"""Timing as the papers time it: `--timing trajectory` (PReCache's bench/single_stream.py: one untimed warm-up run
of each trajectory, then the mean over timed runs of the sum of its synced prefill calls) beside per-turn medians."""

from __future__ import annotations

import json
import statistics
import time

import pytest
from test_policies import shared_a_agents  # noqa: F401  (fixture)

from kvprof.policies import PolicyVariant, SharingPolicy
from kvprof.policies.nonshared import NonShared
from kvprof.policies.prelrshared import PreLRShared
from kvprof.profiling import keep_freed_memory
from kvprof.replay.engine import run_replay
from kvprof.replay.lockstep import replay_trace
from kvprof.replay.records import DENSE
from kvprof.replay.setting import ReplaySettings
from kvprof.report.replay import cost_table
from kvprof.traces.trace import read_trace

VARIANTS = [
    PolicyVariant("fullshared"),
    PolicyVariant("prelrshared"),
    PolicyVariant("rebaseshared", {"schedule": "lp"}),
    PolicyVariant("rebaseshared", {"schedule": "db"}),
]


@pytest.fixture(scope="module")
def trajectories(lora_trace):
    return read_trace(lora_trace).trajectories[:2]


@pytest.fixture(scope="module")
def timed(shared_a_agents, trajectories):  # noqa: F811
    return run_replay(shared_a_agents, trajectories, VARIANTS, ReplaySettings(repeats=2, timing="trajectory"))


def test_the_timing_mode_is_recorded(timed, shared_a_agents, trajectories):  # noqa: F811
    kept = keep_freed_memory()  # on CPU, before timing (glibc)
    load_fields = {"seconds", "other_cores", "cores", "threads", "contended"}  # the machine's load while timing
    timing = dict(timed["timing"])
    assert set(timing.pop("load")) == load_fields
    assert timing == {
        "mode": "trajectory",
        "origin": "code",
        "runs": 2,
        "warm_up_runs": 1,
        "interleaved": False,
        "heap_kept": kept,
    }
    assert "trajectory timing (code: PReCache's bench/single_stream.py)" in cost_table(timed).title
    per_turn = run_replay(shared_a_agents, trajectories[:1], VARIANTS[:1], ReplaySettings(repeats=1))
    timing = dict(per_turn["timing"])
    assert set(timing.pop("load")) == load_fields
    assert timing == {
        "mode": "turn",
        "origin": "kvprof",
        "runs": 1,
        "warm_up_runs": 0,
        "interleaved": False,
        "heap_kept": kept,
    }
    title = "turn timing (kvprof): TTFT = median of 1 repeats per turn (no warm-up)" + (
        "; the CPU allocator kept freed memory" if kept else ""
    )
    assert title in cost_table(per_turn).title
    assert per_turn["dense"]["summary"]["timing"] == "turn"
    assert "runs" not in per_turn["dense"]["turns"][0]


def test_every_policy_gets_trajectory_ttfts(timed, trajectories):
    entries = {DENSE: timed["dense"], **timed["policies"]}
    assert set(entries) == {DENSE, "fullshared", "prelrshared", "rebaseshared-lp", "rebaseshared-db"}
    for label, entry in entries.items():
        summary, turns = entry["summary"], entry["turns"]
        assert summary["timing"] == "trajectory", label
        assert len(turns) == sum(len(traj.turns) for traj in trajectories)
        for turn in turns:
            assert len(turn["runs"]["ttft_s"]) == len(turn["runs"]["latency_s"]) == 2, label
            assert all(value > 0 for value in turn["runs"]["ttft_s"]), label
            assert turn["warm_up"]["ttft_s"] > 0, label
        # a trajectory's TTFT: the mean over its timed runs of the sum of its turns' prefill calls
        for traj in trajectories:
            rows = [turn for turn in turns if turn["trajectory"] == traj.id]
            runs = [sum(turn["runs"]["ttft_s"][run] for turn in rows) for run in range(2)]
            assert summary["trajectory_ttft_s"][traj.id] == pytest.approx(statistics.fmean(runs)), label
        assert summary["ttft_s"] == pytest.approx(sum(summary["trajectory_ttft_s"].values())), label
        assert summary["latency_s"] == pytest.approx(
            sum(statistics.fmean(turn["runs"]["latency_s"]) for turn in turns)
        ), label
    assert timed["policies"]["prelrshared"]["summary"]["ttft_speedup"] == pytest.approx(
        timed["dense"]["summary"]["ttft_s"] / timed["policies"]["prelrshared"]["summary"]["ttft_s"]
    )
    json.dumps(timed)


def test_the_timed_runs_leave_the_lockstep_records_as_they_are(timed, shared_a_agents, trajectories):  # noqa: F811
    """The timed runs replay on instances of their own: fidelity and work equal a per-turn replay's."""
    per_turn = replay_trace(shared_a_agents, trajectories, VARIANTS, ReplaySettings(repeats=1))
    for label in ("prelrshared", "rebaseshared-db"):
        for a, b in zip(timed["policies"][label]["turns"], per_turn["policies"][label]["turns"], strict=True):
            for key in ("kl_sum", "top1_sum", "layers", "reused", "prefilled", "ttft_flops", "memory_bytes"):
                assert a[key] == b[key], (label, key)


def test_per_turn_prefills_are_timed_round_robin(shared_a_agents, trajectories, monkeypatch):  # noqa: F811
    """With --repeats > 1 a turn's prefills run round-robin across the dense run and the policies, one untimed
    round first, the last round inside each run's turn (so no extra prefill), and a drift of the machine's speed
    reaches every run alike; each TTFT is the median of its run's timed prefills, and what the runs compute equals
    a replay timed once."""
    calls: list[tuple[int, float]] = []
    prefill = SharingPolicy.prefill

    def logged(self, *args, **kwargs):
        result = prefill(self, *args, **kwargs)
        calls.append((id(self), result.seconds))
        return result

    monkeypatch.setattr(SharingPolicy, "prefill", logged)
    traj = trajectories[0]
    repeats, runs = 3, 3  # the dense run and two policies
    result = run_replay(shared_a_agents, [traj], VARIANTS[:2], ReplaySettings(repeats=repeats))
    assert result["timing"]["interleaved"] and "timed round-robin across the runs" in cost_table(result).title
    per_turn = (repeats + 1) * runs  # an untimed round, then `repeats` timed ones
    assert len(calls) == len(traj.turns) * per_turn
    for index in range(len(traj.turns)):
        turn = calls[index * per_turn : (index + 1) * per_turn]
        order = [run for run, _ in turn]
        assert order == order[:runs] * (repeats + 1) and len(set(order[:runs])) == runs
        for position, label in enumerate([DENSE, "fullshared", "prelrshared"]):
            record = (result["dense"] if label == DENSE else result["policies"][label])["turns"][index]
            timed_rounds = [turn[runs * round_ + position][1] for round_ in range(1, repeats + 1)]
            assert record["ttft_s"] == pytest.approx(statistics.median(timed_rounds)), (index, label)
    monkeypatch.undo()
    once = run_replay(shared_a_agents, [traj], VARIANTS[:2], ReplaySettings(repeats=1))
    assert not once["timing"]["interleaved"]
    for label in ("fullshared", "prelrshared"):
        for a, b in zip(result["policies"][label]["turns"], once["policies"][label]["turns"], strict=True):
            for key in ("kl_sum", "top1_sum", "layers", "reused", "prefilled", "ttft_flops", "memory_bytes"):
                assert a[key] == b[key], (label, key)


def test_the_warm_up_run_is_excluded(shared_a_agents, trajectories, monkeypatch):  # noqa: F811
    """A cost paid only on a policy instance's first prefill (a kernel's compilation: here a sleep) falls in the
    warm-up run of the timed instance, not in any timed run nor in the reported TTFT."""
    seen: set[int] = set()
    for cls in (NonShared, PreLRShared):

        def first_prefill_is_slow(self, *args, original=cls.assemble, **kwargs):
            if id(self) not in seen:  # the context is assembled inside the timed prefill
                seen.add(id(self))
                time.sleep(0.5)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "assemble", first_prefill_is_slow)
    result = replay_trace(
        shared_a_agents, trajectories[:1], VARIANTS[1:2], ReplaySettings(repeats=2, timing="trajectory")
    )
    for entry in (result["dense"], result["policies"]["prelrshared"]):
        first, *rest = entry["turns"]
        assert first["warm_up"]["ttft_s"] >= 0.5
        assert all(turn["warm_up"]["ttft_s"] < 0.5 for turn in rest)
        assert max(value for turn in entry["turns"] for value in turn["runs"]["ttft_s"]) < 0.5
        assert entry["summary"]["ttft_s"] == pytest.approx(
            sum(statistics.fmean(turn["runs"]["ttft_s"]) for turn in entry["turns"])
        )
    # the lockstep pass's own first prefill paid it too: per-turn timing would have reported it
    assert result["policies"]["prelrshared"]["turns"][0]["ttft_s"] >= 0.5


def test_replay_command_takes_the_timing_mode(run_cli, lora_trace, tmp_path):
    args = ("replay", lora_trace, "--policy", "fullshared", "--limit", "1", "--repeats", "1", "--device", "cpu")
    code, out, err = run_cli(*args, "--timing", "trajectory", "--out", tmp_path)
    assert code == 0, err
    result = json.loads((tmp_path / "replay.json").read_text())
    assert result["timing"]["mode"] == "trajectory" and result["policies"]["fullshared"]["summary"]["timing"] == (
        "trajectory"
    )
    assert "trajectory timing (code" in " ".join(out.split())
    code, out, err = run_cli(*args, "--timing", "median", "--out", tmp_path / "other")
    assert code != 0 and "--timing 'median' is not turn or trajectory" in " ".join((out + err).split())
