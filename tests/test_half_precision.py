"""Half precision (bfloat16, the CUDA default, and float16): every policy variant replays, on the tiny world (both
dtypes) and on the shipped demo trace (bfloat16), and its cache error and KL match the float32 run's within stated
tolerances.

Tolerances, relative to the float32 value of the same policy on the same trace (measured on the tiny world: bfloat16
moves K/V error by ≤ 2.2 % and KL by ≤ 2.4 %, float16 by ≤ 0.3 %):

- K and V relative error: within 5 % (bfloat16) / 1 % (float16);
- KL(dense ‖ policy): within 5 % (bfloat16) / 1 % (float16);
- top-1 agreement: within 0.05 (the untrained tiny model has near-tied logits, so a few argmaxes flip);
- the exact policy (NonShared) stays exactly equal to the dense run: same computation, same dtype;
- KL below 1e-6 (bfloat16) / 1e-7 (float16) nats per token: within that absolutely (the rounding of the two runs
  alone moves a KL that small: CacheBlend recomputing every token at its check layer, KL 1e-15 in float32, gives
  3e-7 in bfloat16);
- K/V error: also within half the dtype's rounding unit absolutely (bfloat16 2^-9, float16 2^-12): an error that
  small is the rounding of the caches themselves (a chained correction's K error of 0.003 moves by 0.0005);
- selective recompute and delta correction: 15 % / 5 % (a token ranking that rounding can reorder; differences of
  half-precision caches).
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kvprof.kernels.attention import EXPAND, KERNEL
from kvprof.model.agents import load_agents_for_trace
from kvprof.model.runtime import Runtime
from kvprof.policies import enumerate_variants, runnable_variants
from kvprof.rank.kv_capture import capture_turn
from kvprof.replay.lockstep import replay_trace
from kvprof.replay.setting import ReplaySettings
from kvprof.traces.trace import read_trace

TOLERANCE = {"bfloat16": 0.05, "float16": 0.01}
# selective recompute selects tokens by ranking their deviations, and rounding can reorder near-equal ones
SELECTION_TOLERANCE = {"bfloat16": 0.15, "float16": 0.05}
# delta correction adds differences of half-precision caches (the anchors' deltas C − B) to a half-precision
# reference: their rounding is relative to the caches, not to the much smaller differences
DELTA_TOLERANCE = {"bfloat16": 0.15, "float16": 0.05}
TOP1_TOLERANCE = 0.05
# KL below this (nats per token) is compared absolutely: the dtype's rounding alone moves it that far (bfloat16: a
# policy that recomputes every token at CacheBlend's check layer, KL 1e-15 in float32, gives 3e-7)
KL_FLOOR = {"bfloat16": 1e-6, "float16": 1e-7}
ERROR_FLOOR = {"bfloat16": 2.0**-9, "float16": 2.0**-12}  # half the rounding unit: K/V errors compared absolutely


def tolerance(entry: dict, dtype: str) -> float:
    """The relative tolerance of a policy's error and KL in `dtype` against float32."""
    family = {"selective recompute": SELECTION_TOLERANCE, "delta": DELTA_TOLERANCE}
    return family.get(entry["family"], TOLERANCE)[dtype]


def _agents(trace, world, dtype):
    if read_trace(trace).header.mode == "prompt":
        return load_agents_for_trace(trace, device="cpu", dtype=dtype)
    flags = [f"{name}={world.shared_a_adapter(name)}" for name in ("plan", "act", "reflect")]
    return load_agents_for_trace(trace, agent_flags=flags, device="cpu", dtype=dtype)


def _replay(trace, world, dtype, lora_attention=EXPAND):
    agents = _agents(trace, world, dtype)
    mode = agents.spec.mode
    variants = [variant for variant in enumerate_variants() if mode in variant.policy.modes]
    variants, skipped = runnable_variants(variants, Runtime(agents), skip=True)
    assert not skipped, skipped
    return replay_trace(
        agents,
        read_trace(trace).trajectories,
        variants,
        ReplaySettings(lora_attention=lora_attention),
        check_memory=True,
    )


@pytest.fixture(scope="module")
def float32_run(lora_trace, prompt_trace, tiny_world):
    runs = {attention: _replay(lora_trace, tiny_world, "float32", attention) for attention in (EXPAND, KERNEL)}
    return runs | {"prompt": _replay(prompt_trace, tiny_world, "float32")}


@pytest.mark.parametrize(
    "setting", [EXPAND, KERNEL, "prompt"], ids=["expanded-values", "flash-lora-attention", "prompt"]
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_policy_runs_in_half_precision_and_matches_float32(
    lora_trace, prompt_trace, tiny_world, float32_run, dtype, setting
):
    if setting == "prompt":
        half = _replay(prompt_trace, tiny_world, dtype)
    else:
        half = _replay(lora_trace, tiny_world, dtype, setting)
    reference = float32_run[setting]
    assert half["policies"].keys() == reference["policies"].keys()
    assert len(half["policies"]) >= 8
    for label, entry in half["policies"].items():
        summary, expected = entry["summary"], reference["policies"][label]["summary"]
        assert entry["memory_accounting_exact"], label
        if entry["name"] == "nonshared":  # the dense run's own forwards: bit for bit
            assert summary["kl"] == 0.0 and summary["k_error"] == 0.0 and summary["v_error"] == 0.0, label
            continue
        if not entry["approximate"]:  # other forwards of the same computation: half-precision rounding
            assert summary["kl"] <= KL_FLOOR[dtype] and summary["k_error"] <= ERROR_FLOOR[dtype], label
            assert summary["top1"] >= 1 - TOP1_TOLERANCE, label
            continue
        for key in ("k_error", "v_error", "kl"):
            floor = KL_FLOOR[dtype] if key == "kl" else ERROR_FLOOR[dtype]
            assert summary[key] == pytest.approx(expected[key], rel=tolerance(entry, dtype), abs=floor), (label, key)
        assert abs(summary["top1"] - expected["top1"]) <= TOP1_TOLERANCE, label


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cache_split_in_half_precision(lora_trace, tiny_world, dtype):
    """The base + adapter split of a half-precision model adds up to the cached K/V within the dtype's rounding,
    and its LR activations are peft's own X·A."""
    agents = _agents(lora_trace, tiny_world, dtype)
    traj = read_trace(lora_trace).trajectories[0]
    turn = traj.turns[0]
    captured = capture_turn(agents, turn.agent, traj.input_tokens(turn))
    eps = torch.finfo(getattr(torch, dtype)).eps
    for layer in captured.layers.values():
        assert layer.keys.dtype == torch.float32
        for name, cached in (("k_proj", layer.keys), ("v_proj", layer.values)):
            split = layer.split[name]
            error = float((split.total - cached).norm() / cached.norm())
            assert error < 8 * eps, (name, error)
        assert set(layer.lr["v_proj"]) == {"plan", "act", "reflect"}


@pytest.fixture(scope="module")
def demo_replays(tmp_path_factory):
    """`kvprof replay` of the shipped demo trace (first trajectory, shared-A adapters so every policy runs) in float32
    and bfloat16, through the CLI: {dtype: result JSON}. float16 takes the same paths; the tiny world checks it."""
    from kvprof.cli import app
    from kvprof.demo.assets import demo_world

    world = demo_world()
    flags = [arg for role, path in world.shared_a_adapters.items() for arg in ("--agent", f"{role}={path}")]
    runner, results = CliRunner(), {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path_factory.mktemp(f"demo_{dtype}")
        done = runner.invoke(
            app,
            [
                "replay",
                "--dtype",
                dtype,
                "--device",
                "cpu",
                "--limit",
                "1",
                "--repeats",
                "1",
                "--out",
                str(out),
                *flags,
            ],
        )
        assert done.exit_code == 0, done.output
        results[dtype] = json.loads((out / "replay.json").read_text())
    return results


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_demo_trace_replays_every_policy_in_half_precision(demo_replays, dtype):
    half, reference = demo_replays[dtype], demo_replays["float32"]
    prompt_only = {variant.label for variant in enumerate_variants() if "lora" not in variant.policy.modes}
    assert half["dtype"] == dtype and set(half["skipped"]) == prompt_only
    assert half["policies"].keys() == reference["policies"].keys() and len(half["policies"]) >= 8
    for label, entry in half["policies"].items():
        summary, expected = entry["summary"], reference["policies"][label]["summary"]
        if entry["name"] == "nonshared":  # the dense run's own forwards: bit for bit
            assert summary["kl"] == 0.0 and summary["k_error"] == 0.0 and summary["v_error"] == 0.0, label
            continue
        if not entry["approximate"]:  # other forwards of the same computation: half-precision rounding
            assert summary["kl"] <= KL_FLOOR[dtype] and summary["k_error"] <= ERROR_FLOOR[dtype], label
            assert summary["top1"] >= 1 - TOP1_TOLERANCE, label
            continue
        for key in ("k_error", "v_error", "kl"):
            if expected[key] < 1e-5:  # a policy that recomputed everything (DroidSpeak calibrating on its only
                # trajectory) is exact up to rounding: up to this dtype's rounding, not within a relative tolerance
                assert summary[key] < 10 * torch.finfo(getattr(torch, dtype)).eps, (label, key)
                continue
            assert summary[key] == pytest.approx(expected[key], rel=tolerance(entry, dtype)), (label, key)
        assert abs(summary["top1"] - expected["top1"]) <= TOP1_TOLERANCE, label
