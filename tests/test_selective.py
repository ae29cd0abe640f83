"""Selective recompute (DroidSpeak, CacheBlend, RelayCaching): the ratio's end points are the dense run and
FullShared, error falls as the ratio grows, the recompute is accounted for and charged to TTFT, DroidSpeak's layer
profile is saved, reused and refused when it does not fit, and its stored hidden states count in memory."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvprof.demo.assets import demo_world
from kvprof.errors import KvprofError
from kvprof.model.agents import load_agents_for_trace
from kvprof.model.runtime import Runtime
from kvprof.policies import PolicyVariant, TurnRequest, enumerate_variants, parse_policy_options
from kvprof.policies.base import tensor_bytes
from kvprof.policies.droidspeak import DroidSpeak
from kvprof.policies.selective import LayerStack, budget, select_top
from kvprof.replay.lockstep import replay_trace
from kvprof.traces.trace import read_trace

SELECTIVE = ("cacheblend", "droidspeak", "relaycaching")
RATIOS = ("0", "0.1", "0.2", "0.3", "1")


@pytest.fixture(scope="module")
def runtimes(lora_trace, prompt_trace, tiny_world):
    flags = [f"{name}={tiny_world.adapter(name)}" for name in ("plan", "act", "reflect")]
    lora = load_agents_for_trace(lora_trace, agent_flags=flags, device="cpu", dtype="float32")
    prompt = load_agents_for_trace(prompt_trace, device="cpu", dtype="float32")
    return {"lora": (Runtime(lora), read_trace(lora_trace)), "prompt": (Runtime(prompt), read_trace(prompt_trace))}


def _requests(trajectory):
    return [
        TurnRequest(turn.agent, trajectory.input_tokens(turn), trajectory.output_tokens(turn))
        for turn in trajectory.turns
    ]


@pytest.mark.parametrize("mode", ["lora", "prompt"])
@pytest.mark.parametrize("name", SELECTIVE)
def test_ratio_one_is_nonshared_and_ratio_zero_is_fullshared(runtimes, mode, name):
    runtime, trace = runtimes[mode]
    pairs = {
        "1": (PolicyVariant(name, {"ratio": "1"}).build(runtime), PolicyVariant("nonshared").build(runtime)),
        "0": (PolicyVariant(name, {"ratio": "0"}).build(runtime), PolicyVariant("fullshared").build(runtime)),
    }
    recomputed = 0
    for trajectory in trace.trajectories:
        for policy, reference in pairs.values():
            policy.reset()
            reference.reset()
        for request in _requests(trajectory):
            for ratio, (policy, reference) in pairs.items():
                got, expected = policy.run_turn(request), reference.run_turn(request)
                tolerance = {"atol": 1e-5, "rtol": 1e-5} if ratio == "1" else {"atol": 0.0, "rtol": 0.0}
                torch.testing.assert_close(got.logits, expected.logits, **tolerance)
                for (keys, values), (dense_keys, dense_values) in zip(got.input_kv, expected.input_kv):
                    torch.testing.assert_close(keys, dense_keys, **tolerance)
                    torch.testing.assert_close(values, dense_values, **tolerance)
                if ratio == "1":
                    assert got.recomputed == got.reused * runtime.num_layers
                    recomputed += got.recomputed
                else:
                    assert got.recomputed == 0 and got.ttft_flops == expected.ttft_flops
    assert recomputed > 0  # the trace reuses: R = 1 really recomputed the reused span


@pytest.fixture(scope="module")
def demo_sweeps():
    """Each selective policy at every ratio of `RATIOS` on the first two trajectories of the demo's short sample
    trace of each mode (DroidSpeak profiles on the first)."""
    world = demo_world()
    sweeps = {}
    for mode in ("lora", "prompt"):
        trace = world.sample_traces[f"{mode}_short"]
        agents = load_agents_for_trace(trace, device="cpu", dtype="float32")
        variants = [PolicyVariant(name, {"ratio": ratio}) for name in SELECTIVE for ratio in RATIOS]
        sweeps[mode] = replay_trace(agents, read_trace(trace).trajectories[:2], variants)
    return sweeps


@pytest.mark.parametrize("mode", ["lora", "prompt"])
@pytest.mark.parametrize("name", SELECTIVE)
def test_error_does_not_grow_with_the_ratio_on_the_demo_traces(demo_sweeps, mode, name):
    """K/V error on the reused span is non-increasing in R, from FullShared's at R = 0 to none at R = 1."""
    policies = demo_sweeps[mode]["policies"]
    summaries = [policies[f"{name}-ratio={ratio}"]["summary"] for ratio in RATIOS]
    for key in ("k_error", "v_error"):
        errors = [summary[key] for summary in summaries]
        assert all(later <= earlier + 1e-9 for earlier, later in zip(errors, errors[1:])), (key, errors)
        assert errors[0] > 0.01 and errors[-1] < 1e-5  # FullShared's error at R = 0, none at R = 1
    # KL on the output tokens follows, but not step by step: between nearby ratios it moves at the level of
    # rounding (FullShared's KL in prompt mode is ~3e-7) — at most a few per cent of FullShared's here
    kl = [summary["kl"] for summary in summaries]
    assert all(value <= 1.05 * kl[0] for value in kl) and kl[-1] < 1e-9
    if mode == "lora":  # where sharing costs fidelity, any recompute recovers most of it
        assert max(kl[1:]) < 0.5 * kl[0]
    ran = [summary["recompute_ratio"] for summary in summaries]
    assert ran[0] == 0.0 and ran[-1] == 1.0 and ran == sorted(ran)


@pytest.mark.parametrize("check_update", ["original", "lmcache"])
def test_recompute_is_counted_and_charged_to_ttft(runtimes, check_update):
    runtime, trace = runtimes["lora"]
    layers = runtime.num_layers
    blend = PolicyVariant("cacheblend", {"ratio": "0.3", "check_update": check_update}).build(runtime)
    relay = PolicyVariant("relaycaching", {"ratio": "0.3", "check_layer": "0", "skip_layers": "1"}).build(runtime)
    full = PolicyVariant("fullshared").build(runtime)
    reused = 0
    for trajectory in trace.trajectories:
        for policy in (blend, relay, full):
            policy.reset()
        for request in _requests(trajectory):
            got, plain, skipped = blend.run_turn(request), full.run_turn(request), relay.run_turn(request)
            # CacheBlend: layer 0 in full, the top 30 % from the check layer (1) on; the original code also writes
            # every token's new K/V at the check layer, LMCache's only the selected ones'
            carried = budget(0.3, got.reused) * (layers - 1)
            check = got.reused - budget(0.3, got.reused) if check_update == "original" else 0
            assert got.recomputed == (got.reused + check + carried if got.reused else 0)
            # RelayCaching with the check at layer 0 and a skip band of one layer: 30 % through layers 0 .. L − 2
            assert skipped.recomputed == budget(0.3, skipped.reused) * (layers - 1)
            if got.reused:
                assert got.ttft_flops > plain.ttft_flops and got.prefilled > plain.prefilled
            reused += got.reused
    assert reused > 0


def test_select_top_ignores_rounding_noise():
    scores = torch.tensor([1.0, 3.0, 3.0 + 1e-7, 2.0, 3.0 - 1e-7])
    assert select_top(scores, 2).tolist() == [1, 2]  # three tie at the resolution: the earlier ones win
    assert select_top(scores, 0).tolist() == []
    assert budget(0.1, 95) == 10 and budget(0.1, 1) == 1 and budget(1.0, 7) == 7 and budget(0.0, 7) == 0


def _replay(policy, trajectories):
    results = []
    for trajectory in trajectories:
        policy.reset()
        results.append([policy.run_turn(request) for request in _requests(trajectory)])
    return results


def test_droidspeak_profiles_the_first_trajectory_then_saves_and_reuses_its_profile(runtimes, tmp_path):
    runtime, trace = runtimes["lora"]
    layers = runtime.num_layers
    saved = tmp_path / "profile.json"
    profiling = PolicyVariant("droidspeak", {"ratio": "0.3", "profile_out": str(saved)}).build(runtime)
    assert isinstance(profiling, DroidSpeak) and profiling.calibrating
    first, *later = _replay(profiling, trace.trajectories)
    assert all(turn.recomputed == turn.reused * layers for turn in first)  # calibration turns: every layer
    profile = json.loads(saved.read_text())
    assert (
        profile["layers"] == layers
        and profile["turns"] == sum(1 for turn in first if turn.reused)
        and len(profile["deviation"]) == layers
    )
    assert all(value > 0 for value in profile["deviation"])  # lora mode: every layer's reused K/V deviate
    start, end = profiling.block
    assert end - start == 1 and not profiling.calibrating
    assert all(turn.recomputed == turn.reused for turns in later for turn in turns)  # one layer of every token
    assert "chosen from a profile of this replay's first trajectory" in profiling.notes()[0]

    loaded = PolicyVariant("droidspeak", {"ratio": "0.3", "profile": str(saved)}).build(runtime)
    assert isinstance(loaded, DroidSpeak) and not loaded.calibrating and loaded.block == (start, end)
    assert all(turn.recomputed == turn.reused for turns in _replay(loaded, trace.trajectories) for turn in turns)
    assert str(saved) in loaded.notes()[0]


def test_droidspeak_recomputes_from_stored_hidden_states_counted_in_memory(runtimes, tmp_path):
    runtime, trace = runtimes["prompt"]
    layers = runtime.num_layers
    profile = tmp_path / "last_layer.json"
    deviation = [0.0] * (layers - 1) + [1.0]
    profile.write_text(
        json.dumps(
            {
                "kind": "kvprof.droidspeak-profile",
                "layers": layers,
                "turns": 1,
                "error": deviation,
                "norm": [1.0] * layers,
            }
        )
    )
    policy = PolicyVariant("droidspeak", {"ratio": "0.1", "profile": str(profile)}).build(runtime)
    assert isinstance(policy, DroidSpeak) and policy.block == (layers - 1, layers) and policy.needs_hidden
    trajectory = trace.trajectories[0]
    requests = _requests(trajectory)
    policy.reset()
    first = policy.run_turn(requests[0])
    assert first.memory["hidden states"] == len(policy.producers) * runtime.hidden_size * runtime.dtype.itemsize
    assert tensor_bytes(policy.live_tensors()) == policy.analytic_bytes()
    # the stored states are what the first agent's forward fed the block's first layer
    agent, ids = requests[0].agent, requests[0].input_ids + first.output_ids
    prefix = len(runtime.prefix(agent))
    out = runtime.forward(agent, ids, runtime.cache_from(runtime.empty_kv()), 0, capture=True)
    assert policy.states is not None and out.residual is not None
    stored = policy.states.view(len(policy.producers))
    torch.testing.assert_close(stored, out.residual[layers - 1][:, prefix : prefix + stored.shape[1]])
    for request in requests[1:]:
        result = policy.run_turn(request)
        assert result.recomputed == result.reused
        assert tensor_bytes(policy.live_tensors()) == policy.analytic_bytes()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"ratio": "1.5"}, "ratio='1.5' is not a number in [0, 1]"),
        ({"ratio": "0.2", "check_layer": "7"}, "check_layer=7 is past the model's 2 layers"),
    ],
)
def test_bad_options_are_refused(runtimes, options, message):
    runtime, _ = runtimes["lora"]
    with pytest.raises(KvprofError, match=re.escape(message)):
        PolicyVariant("cacheblend", options).build(runtime)


def test_bad_droidspeak_profiles_are_refused(runtimes, tmp_path):
    runtime, _ = runtimes["lora"]
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"kind": "kvprof.droidspeak-profile", "layers": 32, "turns": 1}))
    cases = {
        str(tmp_path / "missing.json"): "does not exist",
        str(wrong): "is for a model with 32 layers, this one has 2",
    }
    (tmp_path / "other.json").write_text("{}")
    cases[str(tmp_path / "other.json")] = "is not a DroidSpeak layer profile"
    for path, message in cases.items():
        with pytest.raises(KvprofError, match=message):
            PolicyVariant("droidspeak", {"ratio": "0.2", "profile": path}).build(runtime)


def test_a_model_that_transforms_its_embeddings_is_refused(runtimes, monkeypatch):
    runtime, _ = runtimes["lora"]
    embed = LayerStack.embed
    monkeypatch.setattr(LayerStack, "embed", lambda self, ids: 2.0 * embed(self, ids))
    with pytest.raises(KvprofError, match="transforms its input embeddings"):
        PolicyVariant("cacheblend").build(runtime)


def test_profile_paths_stay_out_of_labels_and_take_one_value(tmp_path):
    one = parse_policy_options([f"droidspeak.profile={tmp_path / 'a.json'}"])
    assert [variant.label for variant in enumerate_variants(["droidspeak"], one)] == ["droidspeak-ratio=0.2"]
    two = parse_policy_options([f"droidspeak.profile={tmp_path / name}" for name in ("a.json", "b.json")])
    with pytest.raises(KvprofError, match="both be labelled droidspeak-ratio=0.2"):
        enumerate_variants(["droidspeak"], two)
