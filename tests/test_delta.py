"""Delta correction (KVComm, KVCMAS, GraphFlow) and its anchor pools: the gate's extremes against the dense run, ρ
against the threshold, low-rank against full-dimensional anchors, pool bytes against the formula, pool files, and
the fit-anchors / tune-tau commands on the tiny world."""

from __future__ import annotations

import json

import pytest
import torch

from kvprof.errors import KvprofError
from kvprof.model.agents import load_agents_for_trace
from kvprof.model.runtime import Runtime
from kvprof.policies import PolicyVariant
from kvprof.policies.anchors import AnchorPool, Match, Stored, mixed_delta, stored_bytes
from kvprof.policies.delta import SegmentLog, pool_identity
from kvprof.replay.lockstep import replay_trace
from kvprof.traces.trace import read_trace
from kvprof.tuning.anchor_fit import fit_anchors, truncated

GRID = ("0", "0.1", "0.3", "0.6", "1")


@pytest.fixture(scope="module")
def agents(prompt_trace):
    return load_agents_for_trace(prompt_trace, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def trajectories(prompt_trace):
    return read_trace(prompt_trace).trajectories


@pytest.fixture(scope="module")
def pools(agents, trajectories, tmp_path_factory):
    """Pools fitted on every trajectory of the tiny prompt trace: full-dimensional, rank 4, and at full rank."""
    folder = tmp_path_factory.mktemp("pools")
    identity = pool_identity(Runtime(agents))
    full, _ = fit_anchors(agents, trajectories, None, 10)
    head_dim = Runtime(agents).head_dim
    paths = {"full": full.save(folder / "full.safetensors", identity)}
    for rank in (4, head_dim):
        paths[rank] = truncated(full, rank).save(folder / f"rank{rank}.safetensors", identity)
    return full, paths


def _replay(agents, trajectories, variants):
    return replay_trace(agents, trajectories, variants, check_memory=True)["policies"]


@pytest.mark.parametrize("policy, key", [("kvcmas", "tau"), ("kvcomm", "gamma")])
@pytest.mark.parametrize("pool", ["grow", "frozen"])
def test_strict_threshold_is_nonshared(agents, trajectories, pools, policy, key, pool):
    """A threshold of 0 accepts nothing: every segment of another agent is prefilled densely, which is exactly what
    NonShared computes (its chunk), with ρ = 0."""
    anchors = pools[1]["full" if policy == "kvcomm" else 4]
    rank = {} if policy == "kvcomm" else {"rank": "4"}
    variant = PolicyVariant(policy, {key: "0", "anchors": str(anchors), "pool": pool, **rank})
    entry = _replay(agents, trajectories, [variant])[variant.label]
    summary = entry["summary"]
    assert entry["memory_accounting_exact"]
    assert summary["delta_reuse"] == 0.0 and summary["reuse_per_token"] == 0.0
    assert summary["kl"] == 0.0 and summary["top1"] == 1.0
    assert all(turn["kl"] == 0.0 for turn in entry["turns"])
    assert all(layer["k_error"] == 0.0 and layer["v_error"] == 0.0 for t in entry["turns"] for layer in t["layers"])


@pytest.mark.parametrize(
    "policy, key, options",
    [("kvcmas", "tau", {"rank": "4"}), ("kvcmas", "tau", {"chain": "star", "rank": "4"}), ("kvcomm", "gamma", {})],
)
def test_reuse_never_decreases_as_the_threshold_loosens(agents, trajectories, pools, policy, key, options):
    anchors = pools[1]["full" if policy == "kvcomm" else 4]
    variants = [
        PolicyVariant(policy, {**options, key: value, "anchors": str(anchors), "pool": "frozen"}) for value in GRID
    ]
    entries = _replay(agents, trajectories, variants)
    rho = [entries[variant.label]["summary"]["delta_reuse"] for variant in variants]
    assert rho == sorted(rho), rho
    assert rho[0] == 0.0 and rho[-1] > 0.0  # the fitted pool lets a loose gate correct something


def test_low_rank_at_full_rank_reproduces_full_dimensional_corrections(agents, pools):
    """Per-layer factors at rank H_kv·D reconstruct every stored matrix, so the fused low-rank correction (per-token
    weights folded into U's rows) equals the full-dimensional one, for an output anchor (the producer's cache as
    base: Δ_source = 0) and an input anchor (a context-free base: both deltas)."""
    full, _ = pools
    runtime = Runtime(agents)
    low = truncated(full, runtime.kv_heads * runtime.head_dim)
    checked = set()
    for slot, anchors in full.slots.items():
        if len(anchors) < 2:
            continue
        owner = anchors[0].owner
        agents_known = set.intersection(*(set(a.agents()) for a in anchors)) - {owner}
        reader = sorted(agents_known)[0]
        source = owner if owner is not None else sorted(agents_known)[-1]
        length = min(a.length for a in anchors)
        token_weights = torch.softmax(torch.randn(len(anchors), length), 0)
        source_cache = torch.randn(runtime.kv_heads, length, runtime.head_dim)
        for values in (False, True):
            corrected = []
            for pool_anchors in (anchors, low.slots[slot]):
                match = Match(pool_anchors, source, token_weights[:, 0], 0.0, token_weights, token_weights)
                out = torch.empty_like(source_cache)
                mixed_delta(match, reader, 1, values, source_cache, out)
                corrected.append(out)
            reference, factored = corrected
            assert torch.linalg.vector_norm(factored - reference) <= 1e-5 * torch.linalg.vector_norm(reference)
            assert not torch.allclose(reference, source_cache)
        checked.add(owner is None)
    assert checked == {True, False}


@pytest.mark.parametrize("rank", [None, 2, 4, 1000])
def test_pool_bytes_equal_the_formula(pools, agents, rank):
    full = pools[0]
    pool = full if rank is None else truncated(full, rank)
    runtime = Runtime(agents)
    shape = (runtime.num_layers, runtime.kv_heads, (runtime.key_dim, runtime.value_dim), runtime.dtype.itemsize)
    assert pool.nbytes() == pool.analytic_bytes(*shape) > 0
    lengths = {a.length for anchors in pool.slots.values() for a in anchors}
    assert min(lengths) < 4 < max(lengths)  # segments shorter and longer than the rank: both branches of r_eff
    assert stored_bytes(2, 3, 10, 8, 4, 2) == 2 * 4 * (10 + 3 * 8) * 2  # per layer r·(L + H·D)
    assert stored_bytes(2, 3, 3, 8, 4, 2) == 2 * 3 * (3 + 3 * 8) * 2  # r_eff = min(r, L, H·D)


def test_stored_factors_reconstruct_the_tensor():
    tensor = torch.randn(2, 3, 7, 5)
    assert torch.allclose(Stored.of(tensor, 7).dense(7), tensor, atol=1e-5)
    assert torch.allclose(Stored.of(tensor, 7).dense(4), tensor[:, :, :4], atol=1e-5)
    assert Stored.of(tensor, 2).rank == 2 and Stored.of(tensor, 50).rank == 7  # min(r, L, H·D)
    assert not torch.allclose(Stored.of(tensor, 5).dense(7), tensor, atol=1e-3)


def test_pool_files_round_trip_and_refuse_another_model(pools, agents, tmp_path):
    full, paths = pools
    identity = pool_identity(Runtime(agents))
    loaded = AnchorPool.load(paths[4], identity, torch.device("cpu"))
    assert loaded.rank == 4 and sum(map(len, loaded.slots.values())) == sum(map(len, full.slots.values()))
    with pytest.raises(KvprofError, match="fitted on another model"):
        AnchorPool.load(paths[4], identity | {"model": "elsewhere"}, torch.device("cpu"))
    (tmp_path / "junk.safetensors").write_bytes(b"not a pool")
    with pytest.raises(KvprofError, match="cannot be read"):
        AnchorPool.load(tmp_path / "junk.safetensors", identity, torch.device("cpu"))
    with pytest.raises(KvprofError, match="rank-4 anchors but kvcmas"):
        PolicyVariant("kvcmas", {"anchors": str(paths[4]), "rank": "8"}).build(Runtime(agents))


def test_delta_policies_refuse_lora_traces(lora_trace):
    runtime = Runtime(load_agents_for_trace(lora_trace, device="cpu", dtype="float32"))
    for name in ("kvcmas", "kvcomm", "graphflow"):
        with pytest.raises(KvprofError, match="prompt-mode traces"):
            PolicyVariant(name).build(runtime)


def test_fit_anchors_and_tune_tau_commands(run_cli, prompt_trace, tmp_path):
    code, out, err = run_cli("fit-anchors", prompt_trace, "--rank", "4", "--out", tmp_path / "fit", "--device", "cpu")
    assert code == 0, err
    report = json.loads((tmp_path / "fit" / "fit_anchors.json").read_text())
    assert report["memory"]["low_rank_bytes"] == report["memory"]["low_rank_formula_bytes"]
    assert report["memory"]["full_bytes"] == report["memory"]["full_formula_bytes"] > report["memory"]["low_rank_bytes"]
    assert "relative error at rank k" in out and (tmp_path / "fit" / "anchors.safetensors").exists()

    code, out, err = run_cli(
        "tune-tau", prompt_trace, "--grid", "0,0.5,1", "--tune", "2", "--option", "rank=4", "--max-kl", "1e-3",
        "--no-online", "--out", tmp_path / "tune", "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads((tmp_path / "tune" / "tune_tau.json").read_text())
    rows = result["rows"]
    assert [row["threshold"] for row in rows] == [0.0, 0.5, 1.0] and rows[0]["rho"] == 0.0 and rows[0]["kl"] == 0.0
    best = result["recommended"]
    assert best is not None and best["rho"] == max(row["rho"] for row in rows if row["kl"] <= 1e-3)
    assert result["heldout"]["target_met"] == (result["heldout"]["kl"] <= 1e-3)
    tuned = tmp_path / "tune" / "tuned.json"
    code, out, err = run_cli("replay", prompt_trace, "--tuned", tuned, "--repeats", "1", "--out", tmp_path / "replay")
    assert code == 0, err
    assert "delta correction: the gate's reuse" in out
    replayed = json.loads((tmp_path / "replay" / "replay.json").read_text())["policies"]
    (label,) = replayed
    assert label.startswith("kvcmas") and replayed[label]["options"]["tau"] == f"{best['threshold']:g}"

    code, _, err = run_cli("tune-tau", prompt_trace, "--policy", "fullshared", "--out", tmp_path / "bad")
    assert code != 0 and "no acceptance threshold" in err


def test_tune_tau_resumes_an_interrupted_sweep(run_cli, prompt_trace, tmp_path, monkeypatch):
    """A sweep interrupted after its teacher-forced replay resumes from OUT/tune_tau.partial.json and gives the
    uninterrupted sweep's rows; a checkpoint made with other settings is refused in one sentence."""
    import kvprof.commands.tune_tau as tune_tau

    args = ("tune-tau", prompt_trace, "--grid", "0,1", "--tune", "2", "--option", "rank=4", "--max-kl", "1e-3",
            "--no-online", "--device", "cpu")  # fmt: skip
    code, _, err = run_cli(*args, "--out", tmp_path / "whole")
    assert code == 0, err
    real_finish = tune_tau.finish

    def interrupted(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune_tau, "finish", interrupted)
    code, _, _ = run_cli(*args, "--out", tmp_path / "cut")
    assert code != 0 and (tmp_path / "cut" / "tune_tau.partial.json").exists()
    monkeypatch.setattr(tune_tau, "finish", real_finish)
    code, out, err = run_cli(*args, "--out", tmp_path / "cut", "--resume")
    assert code == 0, err
    assert "resuming after 2 replayed tuning trajectories" in out
    whole, resumed = (json.loads((tmp_path / run / "tune_tau.json").read_text()) for run in ("whole", "cut"))
    assert [(r["rho"], r["kl"]) for r in resumed["rows"]] == [(r["rho"], r["kl"]) for r in whole["rows"]]
    assert not (tmp_path / "cut" / "tune_tau.partial.json").exists()
    monkeypatch.setattr(tune_tau, "finish", interrupted)
    run_cli(*args, "--out", tmp_path / "again")
    monkeypatch.setattr(tune_tau, "finish", real_finish)
    other = [arg if arg != "0,1" else "0,0.5,1" for arg in args]
    code, _, err = run_cli(*other, "--out", tmp_path / "again", "--resume")
    assert code == 2 and "was made with other settings" in err


def test_a_segment_cut_by_a_divergence_is_a_new_segment():
    """A turn that leaves the timeline inside a segment keeps its first part under a name of its own: an anchor
    learnt of the whole segment (its K/V longer) is never taken as the cut one's."""
    log = SegmentLog("t")
    log.observe("plan", 10, 30)  # input [0, 10), output [10, 30)
    dropped, renamed = log.truncate(20)
    assert dropped == [] and renamed == {"t#1": "t#1[:10]"}
    assert [(s.start, s.end, s.name, s.slot) for s in log.segments] == [
        (0, 10, "t#0", "plan.in0"),
        (10, 20, "t#1[:10]", "plan.out0"),
    ]
    dropped, renamed = log.truncate(10)
    assert [s.name for s in dropped] == ["t#1[:10]"] and renamed == {} and log.length == 10
