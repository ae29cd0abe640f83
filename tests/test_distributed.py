"""Sharded replay (`kvprof.replay.shards`, `kvprof.replay.ray_cluster`, `kvprof replay --ray`): shards merge into the
single-process result per turn (apart from timings and the environment), policies with state across trajectories are
not split, a worker killed mid-run costs nothing but time, an interrupted run resumes at shard granularity. The Ray
tests share one local Ray instance (`ray.init(address="local", num_cpus=2)`)."""

from __future__ import annotations

import copy
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from kvprof.errors import KvprofError
from kvprof.model.agents import load_agents_for_trace, trace_header
from kvprof.policies import Option, PolicyVariant, policy_class
from kvprof.policies.fullshared import FullShared
from kvprof.replay.engine import run_replay
from kvprof.replay.lockstep import ReplayProgress, replay_trace
from kvprof.replay.ray_cluster import (
    AgentSource,
    RayCluster,
    absolute_files,
    absolute_source,
    refuse_unlike_worker,
    replay_sharded,
)
from kvprof.replay.ray_worker import ShardCounter
from kvprof.replay.setting import ReplaySettings
from kvprof.replay.shards import makespan, merge, plan_shards, run_shard, shard_checkpoint, shard_groups
from kvprof.replay.summary import summarise
from kvprof.traces.trace import read_trace

TIMINGS = {"ttft_s", "decode_s", "latency_s"}
TIMED_SUMMARY = TIMINGS | {
    "tpot_s",
    "trajectory_ttft_s",
    "decode_tokens_per_s",
    "tokens_per_s",
    "ttft_speedup",
    "tpot_speedup",
    "latency_speedup",
    "harness_efficiency",
}


class OrderedFullShared(FullShared):
    """FullShared that keeps state across trajectories: each turn's `recomputed` counts the trajectories the policy
    has started (times `step`), so a replay that split its trajectories over workers would record other numbers."""

    name = "orderedfullshared"
    options: ClassVar[dict[str, Option]] = {"step": Option(default="1")}
    trajectory_independent = False
    started = 0

    def reset(self) -> None:
        super().reset()
        self.started += 1

    def run_turn(self, request, repeats=1, timed=None):
        result = super().run_turn(request, repeats, timed)
        result.recomputed = self.started * int(self.values["step"])
        return result


class KilledFullShared(FullShared):
    """FullShared whose worker process is killed (SIGKILL) at its second turn, once: the file `marker` records that
    it happened."""

    name = "killedfullshared"
    options: ClassVar[dict[str, Option]] = {"marker": Option(default="", labelled=False)}

    def run_turn(self, request, repeats=1, timed=None):
        self.turns = getattr(self, "turns", 0) + 1
        if self.turns == 2:
            try:  # the first process to get here creates the marker (atomically) and is killed
                handle = os.open(self.values["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return super().run_turn(request, repeats, timed)
            os.write(handle, str(os.getpid()).encode())
            os.close(handle)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().run_turn(request, repeats, timed)


TEST_POLICIES = {cls.name: cls for cls in (OrderedFullShared, KilledFullShared)}


@dataclass(frozen=True)
class LocalVariant(PolicyVariant):
    """A variant of a test-only policy (not in the registry), so workers get the class itself."""

    @property
    def policy(self):
        return TEST_POLICIES.get(self.name) or policy_class(self.name)


def same_records(merged: dict, single: dict) -> None:
    """Per-turn records equal apart from timings; summaries equal apart from timing-derived figures; every other
    field of a policy's entry equal, its notes too but for the one a sequential shard adds; the same top-level
    fields but for the `distributed` block."""
    assert set(merged) - {"distributed"} == set(single) - {"distributed"}
    assert list(merged["policies"]) == list(single["policies"])
    for label, theirs in single["policies"].items():
        ours = merged["policies"][label]
        rest = ("turns", "summary", "notes")
        assert {k: v for k, v in ours.items() if k not in rest} == {k: v for k, v in theirs.items() if k not in rest}
        added = ours["notes"][len(theirs["notes"]) :]
        assert ours["notes"][: len(theirs["notes"])] == theirs["notes"], label
        assert all("replayed in order in one shard" in note for note in added), label
    for label in ["dense", *single["policies"]]:
        ours = merged["dense"] if label == "dense" else merged["policies"][label]
        theirs = single["dense"] if label == "dense" else single["policies"][label]
        assert len(ours["turns"]) == len(theirs["turns"]) > 0, label
        for mine, reference in zip(ours["turns"], theirs["turns"]):
            assert {k: v for k, v in mine.items() if k not in TIMINGS} == {
                k: v for k, v in reference.items() if k not in TIMINGS
            }, label
        assert {k: v for k, v in ours["summary"].items() if k not in TIMED_SUMMARY} == {
            k: v for k, v in theirs["summary"].items() if k not in TIMED_SUMMARY
        }, label
    assert merged.get("online") == single.get("online")
    for key in ("model", "mode", "repeats", "lora_attention", "device", "dtype"):
        assert merged[key] == single[key], key


@pytest.fixture(scope="module")
def agents(lora_trace):
    return load_agents_for_trace(lora_trace, device="cpu", dtype="float32")


def test_a_worker_expanding_views_another_way_is_refused():
    """Workers whose low-rank views are expanded by the fused CPU kernel and by torch would mix their shards' timings:
    the second is refused in one sentence; other agents are refused first."""
    identity = {"model": "m", "agents": [], "dtype": "float32", "device": "cpu"}
    first = {"id": "a:1", "identity": identity, "expansion": "kvprof's fused CPU kernel"}
    refuse_unlike_worker(first, dict(first, id="b:2"))
    with pytest.raises(KvprofError, match=r"^Ray worker b:2 expands low-rank views with torch and worker a:1 with"):
        refuse_unlike_worker(first, dict(first, id="b:2", expansion="torch"))
    with pytest.raises(KvprofError, match="loaded other agents"):
        refuse_unlike_worker(first, dict(first, id="b:2", identity=dict(identity, dtype="bfloat16"), expansion="torch"))


def test_plan_keeps_stateful_variants_whole(lora_trace):
    trajectories = read_trace(lora_trace).trajectories
    variants = [PolicyVariant("fullshared"), LocalVariant("orderedfullshared"), PolicyVariant("nonshared")]
    shards = plan_shards(trajectories, variants)
    assert [shard.key for shard in shards] == [f"trajectory:{t.id}" for t in trajectories] + [
        "variant:orderedfullshared"
    ]
    assert all([v.label for v in s.variants] == ["fullshared", "nonshared"] for s in shards[:-1])
    assert [t.id for t in shards[-1].trajectories] == [t.id for t in trajectories] and shards[-1].sequential
    only_stateful = plan_shards(trajectories, [LocalVariant("orderedfullshared")])
    assert [shard.key for shard in only_stateful] == ["variant:orderedfullshared"]
    profiling, profiled = PolicyVariant("droidspeak"), PolicyVariant("droidspeak", {"profile": "profile.json"})
    by_options = plan_shards(trajectories, [profiling, profiled])  # a profile file: nothing kept across trajectories
    assert [v.label for v in by_options[0].variants] == [profiled.label] and not by_options[0].sequential
    assert by_options[-1].variants == [profiling] and by_options[-1].sequential


STATEFUL = [LocalVariant("orderedfullshared", {"step": str(step)}) for step in (1, 2, 3, 4)]


def test_plan_groups_stateful_variants_for_the_workers(lora_trace):
    """Few workers: the stateful variants share sequential shards (each group repeats the dense run once); many:
    one shard each; the chosen plan's estimated wall time is the least of every grouping's."""
    trajectories = read_trace(lora_trace).trajectories
    labels = [v.label for v in STATEFUL]
    assert shard_groups(plan_shards(trajectories, STATEFUL, workers=1)) == [labels]
    assert shard_groups(plan_shards(trajectories, STATEFUL, workers=2)) == [labels[:2], labels[2:]]
    assert shard_groups(plan_shards(trajectories, STATEFUL, workers=4)) == [[label] for label in labels]
    assert shard_groups(plan_shards(trajectories, STATEFUL)) == [[label] for label in labels]
    mixed = [PolicyVariant("fullshared"), *STATEFUL[:3]]
    for workers in (1, 2, 3, 8):
        plan = plan_shards(trajectories, mixed, workers)
        assert all(makespan(plan, workers) <= makespan(other, workers) for other in _every_grouping(trajectories))
    kept = plan_shards(trajectories, STATEFUL, workers=4, groups=[labels[:3], labels[3:]])
    assert [shard.key for shard in kept] == [f"variant:{' + '.join(labels[:3])}", f"variant:{labels[3]}"]
    assert makespan(kept, 1) == sum(shard.cost for shard in kept)


def _every_grouping(trajectories):
    """Every plan of fullshared plus three stateful variants cut into contiguous groups."""
    stateful = [v.label for v in STATEFUL[:3]]
    mixed = [PolicyVariant("fullshared"), *STATEFUL[:3]]
    cuts = [[stateful], [stateful[:1], stateful[1:]], [stateful[:2], stateful[2:]], [[label] for label in stateful]]
    return [plan_shards(trajectories, mixed, groups=groups) for groups in cuts]


@pytest.mark.parametrize("mode", ["lora", "prompt"])
def test_shards_merge_into_the_single_process_result(mode, request):
    """Shards replayed one by one here and merged equal one `run_replay`, online re-runs included (prompt mode:
    each trajectory's own private prefixes), with the stateful variants in one shard each or grouped in one; a
    stateful policy's numbers depend on its trajectories' order, and a naive split would change them."""
    trace = request.getfixturevalue(f"{mode}_trace")
    agents = request.getfixturevalue("agents") if mode == "lora" else load_agents_for_trace(trace, device="cpu")
    trajectories = read_trace(trace).trajectories
    variants = [PolicyVariant("fullshared"), *STATEFUL[:2], PolicyVariant("nonshared")]
    single = run_replay(agents, trajectories, variants, ReplaySettings(online=True))
    for workers in (None, 1):
        shards = plan_shards(trajectories, variants, workers)
        assert len(shard_groups(shards)) == (2 if workers is None else 1)
        results = {shard.key: run_shard(agents, shard, ReplaySettings(online=True)) for shard in shards}
        merged = merge(shards, results, variants, online=True)
        same_records(merged, single)
        for shard in shards[-len(shard_groups(shards)) :]:
            own_dense = summarise(results[shard.key].progress.records["dense"])
            for variant in shard.variants:
                entry = merged["policies"][variant.label]
                assert any("replayed in order in one shard" in note for note in entry["notes"])
                assert entry["summary"]["ttft_speedup"] == own_dense.ttft_s / entry["summary"]["ttft_s"]
    alone = run_shard(agents, plan_shards(trajectories[-1:], variants)[-1], ReplaySettings())  # a naive split
    last = merged["policies"][STATEFUL[1].label]["turns"][-1]
    assert alone.progress.records[STATEFUL[1].label][-1].recomputed < last["recomputed"]


def test_resumed_single_process_replay_rebuilds_cross_trajectory_state(agents, lora_trace):
    """A replay resumed in one process after its first trajectory (a checkpoint) records what an uninterrupted one
    does, also for a policy that keeps state across trajectories (its state is rebuilt first)."""
    trajectories = read_trace(lora_trace).trajectories
    variants = [PolicyVariant("fullshared"), STATEFUL[1]]
    whole = run_replay(agents, trajectories, variants)
    saved: list[ReplayProgress] = []
    replay_trace(agents, trajectories[:1], variants, on_trajectory=lambda state: saved.append(copy.deepcopy(state)))
    resumed = run_replay(agents, trajectories, variants, progress=saved[0])
    same_records(resumed, whole)
    fresh = run_replay(agents, trajectories[1:], variants)  # what a resume without the rebuilt state records
    last = STATEFUL[1].label
    assert fresh["policies"][last]["turns"][-1]["recomputed"] < whole["policies"][last]["turns"][-1]["recomputed"]


def test_shard_checkpoint_resumes_only_whole_planned_shards(agents, lora_trace, tmp_path):
    """A sharded checkpoint keeps its grouping (a cluster of another size resumes the same shards); a saved shard
    that is not exactly a planned one (another --limit) is dropped to be replayed again; a checkpoint of other
    trajectories, or not of this shape, is refused in one sentence."""
    from kvprof.replay.checkpoint import Checkpoint

    trajectories = read_trace(lora_trace).trajectories
    variants = [PolicyVariant("fullshared"), *STATEFUL[:2]]
    shards = plan_shards(trajectories[:2], variants, workers=1)  # one group of both stateful variants
    results = {shard.key: run_shard(agents, shard, ReplaySettings()) for shard in shards}
    checkpoint = tmp_path / "replay.partial.json"
    groups = shard_groups(shards)
    progress = shard_checkpoint(results, groups)
    checkpoint.write_text(json.dumps({"identity": {"x": 1}, "progress": progress}))
    kept, kept_groups = Checkpoint(checkpoint, {"x": 1}).read_shards(trajectories[:2], variants)
    assert kept.keys() == results.keys() and kept_groups == groups == [[v.label for v in STATEFUL[:2]]]
    more, more_groups = Checkpoint(checkpoint, {"x": 1}).read_shards(trajectories, variants)  # a larger --limit
    assert set(more) == {f"trajectory:{t.id}" for t in trajectories[:2]} and more_groups == groups
    with pytest.raises(KvprofError, match="holds trajectories tiny1 that this replay does not include"):
        Checkpoint(checkpoint, {"x": 1}).read_shards(trajectories[:1], variants)
    checkpoint.write_text(json.dumps({"identity": {"x": 1}, "progress": {"trajectories": []}}))
    with pytest.raises(KvprofError, match="is not a sharded replay's checkpoint"):
        Checkpoint(checkpoint, {"x": 1}).read_shards(trajectories, variants)


def test_paths_reach_workers_absolute(lora_trace, tmp_path, monkeypatch):
    """A worker resolves paths against its own working directory: the driver sends the model, the adapters and
    every policy file option absolute; other options and hub ids stay as given."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adapter").mkdir()
    source = absolute_source(
        AgentSource(trace_header(lora_trace), str(lora_trace), "adapter", ["act=adapter", "plan=org/hub-adapter"])
    )
    assert source.model == str(tmp_path / "adapter") and source.agent_flags == [
        f"act={tmp_path / 'adapter'}",
        "plan=org/hub-adapter",
    ]
    (variant,) = absolute_files([PolicyVariant("kvcmas", {"anchors": "pool.safetensors", "chain": "star"})])
    assert variant.options == {"anchors": str(tmp_path / "pool.safetensors"), "chain": "star"}


def test_ray_missing_is_one_sentence(run_cli, lora_trace, prompt_trace, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    for command, trace in (("replay", lora_trace), ("tune-tau", prompt_trace)):  # tune-tau: before fitting a pool
        code, out, err = run_cli(command, trace, "--ray", "--out", tmp_path)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "pip install 'kvprof[ray]'" in lines[0] and "Traceback" not in err
        assert not (tmp_path / "anchors.safetensors").exists()


@pytest.fixture(scope="module")
def ray_instance():
    """One local Ray instance with 2 CPUs for the module's tests (skipped without Ray, unless KVPROF_REQUIRE_RAY is
    set, as `make test` does)."""
    if os.environ.get("KVPROF_REQUIRE_RAY"):
        import ray
    else:
        ray = pytest.importorskip("ray")
    import logging

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers get this module's test policies
    # Ray starts its workers at niceness 15: beside another test process (pytest-xdist's other worker) they would
    # get almost no CPU, and a replay of seconds took minutes
    os.environ["RAY_worker_niceness"] = "0"
    ray.init(address="local", num_cpus=2, log_to_driver=False, logging_level=logging.WARNING)
    # A worker holds one CPU, and Ray runs it with one thread; the single-process runs these tests compare with must
    # too, or their floats differ in the last bits (the order of a matmul's reductions depends on the thread count).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield ray
    torch.set_num_threads(threads)
    ray.shutdown()


def _cpus_back(ray, expected: float, wait_s: float = 20.0) -> bool:
    """Whether every CPU is free again (the workers were killed) within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) == expected:
            return True
        time.sleep(0.2)
    return False


def _load(result_dir: Path) -> dict:
    return json.loads((result_dir / "replay.json").read_text())


def test_ray_replay_equals_single_process(ray_instance, run_cli, lora_trace, tmp_path):
    """Every variant, online: two trajectories (a shard each, the two workers busy at once) and DroidSpeak's
    sequential group."""
    replayed = 2
    common = ("replay", lora_trace, "--policy", "all", "--online", "--repeats", "1", "--device", "cpu")
    common += ("--limit", str(replayed))
    code, out, err = run_cli(*common, "--out", tmp_path / "single")
    assert code == 0, err
    code, out, err = run_cli(*common, "--out", tmp_path / "ray", "--ray", "--ray-workers", "2")
    assert code == 0, err
    single, merged = _load(tmp_path / "single"), _load(tmp_path / "ray")
    same_records(merged, single)
    assert merged["skipped"] == single["skipped"] and merged["args"]["ray"] is True
    workers = merged["environment"]["workers"]  # those that replayed a shard: one, or both if the second loaded in time
    assert 1 <= len(workers) <= 2 and {w["device"] for w in workers} == {"cpu"} and all(w["host"] for w in workers)
    assert set(merged["distributed"]["shards"].values()) == {w["id"] for w in workers}
    sequential = [label for label in merged["policies"] if label.startswith("droidspeak")]  # profiles on traj. 1
    groups = merged["distributed"]["sequential"]
    assert sequential and [label for group in groups for label in group] == sequential
    assert len(read_trace(lora_trace).trajectories) > replayed
    assert len(merged["distributed"]["shards"]) == replayed + len(groups)
    assert merged["distributed"]["retried"] == []
    assert _cpus_back(ray_instance, 2.0), "the workers must be gone after the replay"


def test_worker_killed_mid_run_still_yields_the_whole_result(ray_instance, agents, lora_trace, tmp_path):
    trajectories = read_trace(lora_trace).trajectories
    marker = tmp_path / "killed"
    variants = [LocalVariant("killedfullshared", {"marker": str(marker)}), LocalVariant("orderedfullshared")]
    source = AgentSource(trace_header(lora_trace), str(lora_trace), device="cpu", dtype="float32")
    with RayCluster(source, workers=2) as cluster:
        assert len(cluster.ready()) == 2  # both loaded: the first two shards start at once
        merged = replay_sharded(cluster, trajectories, variants, ReplaySettings(online=False))
    assert marker.exists(), "a worker must have been killed"
    killed = int(marker.read_text())
    retried = merged["distributed"]["retried"]
    assert len(retried) == 1 and retried[0]["worker"].endswith(f":{killed}")
    assert merged["distributed"]["sequential"] == [["orderedfullshared"]]
    marker.write_text("done")  # the reference run must not kill this process
    same_records(merged, run_replay(agents, trajectories, variants))


def test_interrupted_ray_replay_resumes_from_its_shards(ray_instance, run_cli, lora_trace, tmp_path, monkeypatch):
    """Ctrl-C after the first shard: workers are killed, the checkpoint holds that shard; --resume replays the
    others only and writes the uninterrupted result; a checkpoint of one mode is refused by the other."""
    import kvprof.replay.checkpoint as checkpoint_module

    write_json = checkpoint_module.write_json

    def write_then_interrupt(path, payload):
        write_json(path, payload)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module, "write_json", write_then_interrupt)
    args = ("replay", lora_trace, "--policy", "fullshared", "--repeats", "1", "--device", "cpu", "--out", tmp_path)
    code, _, err = run_cli(*args, "--ray")
    checkpoint = tmp_path / "replay.partial.json"
    assert code == 130 and checkpoint.exists() and not (tmp_path / "replay.json").exists()
    assert _cpus_back(ray_instance, 2.0), "Ctrl-C must kill the workers"
    monkeypatch.undo()
    code, _, err = run_cli(*args, "--resume")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "other settings (--ray" in lines[0], err
    code, out, err = run_cli(*args, "--ray", "--resume")
    assert code == 0, err
    shards = len(read_trace(lora_trace).trajectories)
    assert f"resuming after 1 of {shards} replayed shards" in out and not checkpoint.exists()
    code, _, err = run_cli(*args, "--out", tmp_path / "single")
    assert code == 0, err
    same_records(_load(tmp_path), _load(tmp_path / "single"))


def test_ctrl_c_on_a_cluster_stops_cleanly(ray_instance, lora_trace, tmp_path):
    """A real SIGINT to `kvprof replay --ray` on an existing cluster, once its first worker holds a CPU (loading
    the model, early in a run of seconds): exit 130 with one line, no result written, every worker gone from the
    cluster, which stays up. (Ctrl-C between shards, with its checkpoint: the resume test.)"""
    env = os.environ | {"RAY_ADDRESS": ray_instance.get_runtime_context().gcs_address, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    policies = ["--policy", "fullshared", "--policy", "droidspeak", "--repeats", "3", "--device", "cpu"]
    command = [sys.executable, "-m", "kvprof", "replay", str(lora_trace), *policies, "--ray", "--ray-workers", "2"]
    command += ["--out", str(out)]
    # A command run in the background by a shell without job control (as CI may run pytest) inherits SIGINT
    # ignored, and Python then never raises KeyboardInterrupt: give the replay a terminal's default, as a user has.
    restore = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=restore
    )
    deadline = time.monotonic() + 120
    while ray_instance.available_resources().get("CPU", 2.0) > 1.0 and proc.poll() is None:
        assert time.monotonic() < deadline, "no worker started"
        time.sleep(0.05)
    assert proc.poll() is None, "the replay ended before a worker was seen"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip() and "replaying" not in line]
    assert proc.returncode == 130 and len(lines) == 1 and "interrupted" in lines[0], err
    assert not (out / "replay.json").exists()
    assert _cpus_back(ray_instance, 2.0), "Ctrl-C must kill the workers"
    assert ray_instance.is_initialized()


def test_a_worker_waiting_for_room_is_announced(ray_instance, lora_trace, monkeypatch):
    """While another job holds the CPUs a worker needs, the cluster waits and says so once; it starts when they
    are free."""
    import kvprof.replay.ray_cluster as distributed

    monkeypatch.setattr(distributed, "WAIT_NOTE_S", 1.0)
    holder = ray_instance.remote(num_cpus=1)(ShardCounter).remote()  # another job's actor, holding one CPU
    ray_instance.get(holder.snapshot.remote())
    said: list[str] = []
    source = AgentSource(trace_header(lora_trace), str(lora_trace), device="cpu", dtype="float32")
    with RayCluster(source, worker_cpus=2, on_wait=said.append) as cluster:
        freed = threading.Timer(3.0, lambda: ray_instance.kill(holder))
        freed.start()
        assert cluster.first()["cpu_threads"] == 2
        freed.join()
    assert len(said) == 1 and "no Ray worker has loaded the model after 1 s" in said[0] and "ray status" in said[0]


def test_ray_refusals(ray_instance, run_cli, lora_trace, tmp_path):
    code, _, err = run_cli("replay", lora_trace, "--ray", "--ray-workers", "3", "--out", tmp_path)
    assert code == 2 and "--ray-workers 3 is not between 1 and the 2 workers the cluster's 2 CPUs hold" in err
    assert "Traceback" not in err
    code, _, err = run_cli("replay", lora_trace, "--ray", "--ray-worker-cpus", "3", "--out", tmp_path)
    assert (
        code == 2
        and "--ray-worker-cpus 3 is more than any node of the Ray cluster has (2 CPUs at most)" in err
        and "Traceback" not in err
    )
    code, _, err = run_cli(
        "replay", lora_trace, "--ray", "--ray-workers", "2", "--ray-worker-cpus", "2", "--out", tmp_path
    )
    assert code == 2 and "between 1 and the 1 worker the cluster's 2 CPUs at 2 CPUs per worker hold" in err
    source = AgentSource(trace_header(lora_trace), str(lora_trace), device="cpu", dtype="float32")
    with RayCluster(source, worker_cpus=2) as cluster:  # one worker holding both CPUs runs two threads
        assert cluster.size == 1 and cluster.first()["cpu_threads"] == 2
    code, _, err = run_cli("replay", lora_trace, "--ray", "--agent", "critic=x", "--out", tmp_path)
    assert code == 2 and "unknown agent name 'critic'" in err and "Traceback" not in err
    with pytest.raises(KvprofError, match="has no GPUs"):
        with RayCluster(AgentSource(trace_header(lora_trace), str(lora_trace), device="cuda")):
            pass


def test_tune_tau_on_ray_equals_single_process(ray_instance, run_cli, prompt_trace, tmp_path, monkeypatch):
    """Every threshold is a stateful (anchor-pool) variant, one shard each on 2 workers; the sweep's rows and
    recommendation are the ones a single-process tune-tau computes, also after Ctrl-C and --resume (at shard
    granularity; a checkpoint of a run on Ray is refused without --ray)."""
    common = ("tune-tau", prompt_trace, "--grid", "0,1", "--tune", "2", "--option", "rank=4", "--max-kl", "1e-3",
              "--no-online", "--device", "cpu")  # fmt: skip
    code, _, err = run_cli(*common, "--out", tmp_path / "one")
    assert code == 0, err
    code, _, err = run_cli(*common, "--out", tmp_path / "ray", "--ray", "--ray-workers", "2")
    assert code == 0, err
    one, sharded = (json.loads((tmp_path / run / "tune_tau.json").read_text()) for run in ("one", "ray"))
    for key in ("rho", "kl", "k_error", "v_error", "threshold", "target_met"):
        assert [row[key] for row in sharded["rows"]] == [row[key] for row in one["rows"]], key
    assert sharded["recommended"]["threshold"] == one["recommended"]["threshold"]
    assert sharded["heldout"]["kl"] == one["heldout"]["kl"]

    import kvprof.replay.checkpoint as checkpoint_module

    write_json = checkpoint_module.write_json

    def write_then_interrupt(path, payload):
        write_json(path, payload)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module, "write_json", write_then_interrupt)
    cut = ("--out", tmp_path / "cut", "--ray", "--ray-workers", "2")
    code, _, _ = run_cli(*common, *cut)
    assert code == 130 and (tmp_path / "cut" / "tune_tau.partial.json").exists()
    assert _cpus_back(ray_instance, 2.0), "Ctrl-C must kill the workers"
    monkeypatch.undo()
    code, _, err = run_cli(*common, "--out", tmp_path / "cut", "--resume")
    assert code == 2 and "with/without --ray" in err and "Traceback" not in err
    code, out, err = run_cli(*common, *cut, "--resume")
    assert code == 0, err
    assert "resuming after 1 of 2 replayed shards" in out
    resumed = json.loads((tmp_path / "cut" / "tune_tau.json").read_text())
    for key in ("rho", "kl", "k_error", "v_error", "threshold", "target_met"):
        assert [row[key] for row in resumed["rows"]] == [row[key] for row in one["rows"]], key
    assert not (tmp_path / "cut" / "tune_tau.partial.json").exists()
