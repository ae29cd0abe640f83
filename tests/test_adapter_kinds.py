"""Adapters teams train besides attention LoRA: on the MLP only (its agents' K/V differ only through the hidden
states) and on every linear layer (attention and MLP), which every LoRA-family policy replays, never a traceback;
and Activated LoRA (peft's aLoRA: the adapter acts from its invocation ids on), which replay applies as peft's
`generate` does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from peft_oracle import assert_peft_generations
from transformers import AutoModelForCausalLM

from kvprof.model.agents import load_agents_for_trace
from kvprof.model.architecture import weights_bytes
from kvprof.model.runtime import Runtime
from kvprof.model.tiny import AGENTS, build_adapter, build_tiny_world
from kvprof.policies import PolicyVariant, runnable_variants
from kvprof.replay.lockstep import replay_trace
from kvprof.traces.trace import read_trace

MLP = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", *MLP)
LORA_FAMILY = [
    PolicyVariant("fullshared"),
    PolicyVariant("baseshared"),
    PolicyVariant("baseshared", {"lr_prefill": "full"}),
    PolicyVariant("baseshared", {"lr_prefill": "incremental"}),
    PolicyVariant("prelrshared"),
    PolicyVariant("prelrshared", {"views": "kept"}),
    PolicyVariant("baselrshared"),
    PolicyVariant("rebaseshared"),
    PolicyVariant("rebaseshared", {"schedule": "db"}),
]


@pytest.fixture(scope="module", params=["mlp", "all_linear"])
def adapted(request, tiny_world, lora_trace, tmp_path_factory):
    """The lora trace replayed by agents with adapters on the MLP only, or on every linear layer (sharing A, so that
    BaseLRShared runs too), under every LoRA-family policy."""
    targets = MLP if request.param == "mlp" else ALL_LINEAR
    folder = tmp_path_factory.mktemp(request.param)
    flags = []
    for seed, agent in enumerate(AGENTS):
        model = AutoModelForCausalLM.from_pretrained(tiny_world.model)
        build_adapter(model, folder / agent, seed=10 + seed, targets=targets, shared_a_seed=99)
        flags.append(f"{agent}={folder / agent}")
    agents = load_agents_for_trace(lora_trace, agent_flags=flags, device="cpu", dtype="float32")
    variants, skipped = runnable_variants(LORA_FAMILY, Runtime(agents), skip=True)
    assert not skipped
    result = replay_trace(agents, read_trace(lora_trace).trajectories[:2], variants)
    return request.param, result


def test_every_lora_family_policy_replays_them(adapted):
    kind, result = adapted
    dense = result["dense"]["summary"]
    for label, entry in result["policies"].items():
        summary = entry["summary"]
        assert summary["turns"] == dense["turns"], label
        assert summary["kl"] >= 0 and summary["prefilled"] > 0, label
    if kind == "all_linear":  # adapters on the cached projections: sharing costs fidelity
        assert result["policies"]["prelrshared"]["summary"]["k_error"] > 0


def test_an_mlp_only_adapter_leaves_an_empty_lr_cache(adapted):
    """With k_proj and v_proj unadapted, a token's cache is its producer's base K/V for every reader: PreLRShared and
    BaseLRShared serve exactly FullShared's K/V, and BaseShared, whose empty LR cache covers every token, has no LR
    prefill to run: it prefills what FullShared does and the moved spans it computes."""
    kind, result = adapted
    if kind != "mlp":
        pytest.skip("the MLP-only case")
    policies = result["policies"]
    full = policies["fullshared"]["turns"]
    assert policies["fullshared"]["summary"]["k_error"] > 0  # the hidden states differ between agents
    base, full_summary = policies["baseshared-code"]["summary"], policies["fullshared"]["summary"]
    assert base["prefilled"] == full_summary["prefilled"] + full_summary["moved"]
    for label in ("prelrshared", "prelrshared-kept", "baselrshared"):
        for turn, reference in zip(policies[label]["turns"], full, strict=True):
            assert turn["reused"] == reference["reused"], label
            assert turn["kl_sum"] == pytest.approx(reference["kl_sum"], rel=1e-4, abs=1e-7), label
            for layer, reference_layer in zip(turn["layers"], reference["layers"], strict=True):
                assert layer["k_error"] == pytest.approx(reference_layer["k_error"], rel=1e-4, abs=1e-6), label
        if label != "prelrshared-kept":  # no LR cache is kept: the base cache is FullShared's shared cache
            peak = policies[label]["summary"]["peak_memory_bytes"]
            assert peak == policies["fullshared"]["summary"]["peak_memory_bytes"], label


def alora_adapters(world, folder: Path, invocation: str = "{agent}:", task_type: str | None = "CAUSAL_LM") -> list[str]:
    """Activated LoRA adapters for the tiny world's agents, each invoked by `invocation` (default: its agent's cue,
    "plan:", ...), as `--agent NAME=DIR` flags."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(world.model)
    flags = []
    for seed, agent in enumerate(AGENTS):
        ids = tokenizer.encode(invocation.format(agent=agent), add_special_tokens=False)
        model = AutoModelForCausalLM.from_pretrained(world.model)
        build_adapter(model, folder / agent, seed=20 + seed, invocation=ids, task_type=task_type)
        flags += ["--agent", f"{agent}={folder / agent}"]
    return flags


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_activated_lora_agents_replay_their_capture(arch, tiny_world, run_cli, tmp_path):
    """aLoRA agents act from their invocation on, in every forward of the call: the dense replay of their capture
    (peft's own `generate`) reproduces it token for token, NonShared and ALoRAShared are exact, and with the
    adapters silent before the cue sharing costs less than with plain LoRA agents (Llama; Qwen 2.5's biases;
    Qwen3's key norm, which an adapter on k_proj feeds)."""
    world = tiny_world if arch == "llama" else build_tiny_world(tmp_path / "world", arch=arch)
    flags = alora_adapters(world, tmp_path / "alora")
    common = ("--device", "cpu", "--dtype", "float32")
    code, _, err = run_cli(
        "capture", "--model", world.model, "--workflow", world.lora_workflow, "--tasks", world.tasks,
        *flags, "--out", tmp_path / "capture", *common,
    )  # fmt: skip
    assert code == 0, err
    assert_peft_generations(world.model, {agent: tmp_path / "alora" / agent for agent in AGENTS}, tmp_path)
    trace = tmp_path / "capture" / "trace.jsonl"
    code, _, err = run_cli(
        "replay", trace, "--policy", "nonshared", "--policy", "fullshared", "--policy", "alorashared",
        "--repeats", "1", "--out", tmp_path / "replay", *common,
    )  # fmt: skip
    assert code == 0, err
    result = json.loads((tmp_path / "replay" / "replay.json").read_text())
    assert result["dense"]["summary"]["trace_agreement"] == 1.0
    nonshared = result["policies"]["nonshared"]["summary"]
    assert nonshared["kl"] == 0.0 and nonshared["k_error"] == 0.0
    assert result["policies"]["fullshared"]["summary"]["k_error"] > 0  # each agent's output is adapter-made
    exact = result["policies"]["alorashared"]["summary"]
    assert exact["kl"] <= 1e-6 and exact["k_error"] <= 1e-5 and exact["prefilled"] < nonshared["prefilled"]
    runnable, skipped = runnable_variants(
        LORA_FAMILY, Runtime(load_agents_for_trace(trace, device="cpu", dtype="float32")), skip=True
    )
    assert [variant.name for variant in runnable] == ["fullshared"]
    assert len(skipped) == len(LORA_FAMILY) - 1
    assert all("is an Activated LoRA, which acts only from its invocation on" in why for why in skipped.values())


def test_activated_lora_that_peft_would_not_apply_or_never_invoked_is_refused(
    tiny_world, lora_trace, run_cli, tmp_path
):
    """An aLoRA adapter without task_type CAUSAL_LM (peft then runs the base model) is refused at load; a trace whose
    calls lack an agent's invocation ids is refused naming the first such call, and a capture whose workflow renders
    calls without them refuses the first; each in one sentence, exit 2, nothing written."""
    common = ("--repeats", "1", "--device", "cpu", "--dtype", "float32")
    flags = alora_adapters(tiny_world, tmp_path / "untyped", task_type=None)
    code, _, err = run_cli("replay", lora_trace, *flags, "--out", tmp_path / "untyped-replay", *common)
    assert code == 2 and "without task_type CAUSAL_LM" in err and "Traceback" not in err
    flags = alora_adapters(tiny_world, tmp_path / "absent", invocation="Kalomir {agent} Quessa")
    code, _, err = run_cli("replay", lora_trace, *flags, "--out", tmp_path / "absent-replay", *common)
    assert code == 2 and "turn 0 (plan): the input lacks the invocation ids" in err and "Traceback" not in err
    assert not (tmp_path / "absent-replay" / "replay.json").exists()
    code, _, err = run_cli(
        "capture", "--model", tiny_world.model, "--workflow", tiny_world.lora_workflow, "--tasks", tiny_world.tasks,
        *flags, "--out", tmp_path / "absent-capture", "--device", "cpu", "--dtype", "float32",
    )  # fmt: skip
    assert code == 2 and "a call of agent 'plan' lacks the invocation ids" in err and "Traceback" not in err
    assert not (tmp_path / "absent-capture" / "trace.jsonl").exists()


def test_activated_lora_agents_share_base_caches_exactly(tiny_world, run_cli, tmp_path):
    """ALoRAShared reuses, across agents, the K/V every call computes before its invocation and recomputes the
    adapter-made rest with the base weights: NonShared's caches and outputs (KL ≤ 1e-6), fewer tokens prefilled.
    With a plain LoRA agent among them (act), its calls share nothing and the result stays exact."""
    common = ("--repeats", "1", "--device", "cpu", "--dtype", "float32")
    flags = alora_adapters(tiny_world, tmp_path / "alora")
    code, _, err = run_cli(
        "capture", "--model", tiny_world.model, "--workflow", tiny_world.lora_workflow, "--tasks", tiny_world.tasks,
        *flags, "--out", tmp_path / "capture", "--device", "cpu", "--dtype", "float32",
    )  # fmt: skip
    assert code == 0, err
    trace = tmp_path / "capture" / "trace.jsonl"
    pairs = [(flags[i], flags[i + 1]) for i in range(0, len(flags), 2)]
    plain = ("--agent", f"act={tiny_world.adapter('act')}")
    mixed = [part for pair in pairs for part in (plain if pair[1].startswith("act=") else pair)]
    for name, agent_flags in (("alora", flags), ("mixed", mixed)):
        code, _, err = run_cli(
            "replay", trace, "--policy", "alorashared", "--policy", "nonshared", *agent_flags,
            "--out", tmp_path / name, *common,
        )  # fmt: skip
        assert code == 0, err
        result = json.loads((tmp_path / name / "replay.json").read_text())
        shared, dense = result["policies"]["alorashared"]["summary"], result["dense"]["summary"]
        assert shared["kl"] <= 1e-6 and shared["k_error"] <= 1e-5 and shared["v_error"] <= 1e-5, name
        assert shared["top1"] == 1.0, name
        assert shared["prefilled"] < result["policies"]["nonshared"]["summary"]["prefilled"], name
        assert shared["prefilled"] < dense["prefilled"], name
        assert 0 < shared["adapter_made"] < shared["prefilled"], name  # cues and outputs, recomputed with the base


def test_an_activated_lora_that_acts_before_its_invocation_is_refused_at_load(tiny_world, monkeypatch, tmp_path):
    """Load checks on the model that an aLoRA agent's K/V before its invocation are the base model's; an adapter
    that acts on every token (here: peft's aLoRA forward replaced by plain LoRA's) is refused in one sentence."""
    from peft.tuners.lora.variants import ALoraLinearVariant

    from kvprof.errors import KvprofError
    from kvprof.model.agents import load_agents
    from kvprof.traces.spec import build_spec

    flags = alora_adapters(tiny_world, tmp_path / "alora")
    spec = build_spec(tiny_world.lora_workflow, agent_flags=flags[1::2])
    load_agents(spec, str(tiny_world.model), device="cpu", dtype="float32")  # a true aLoRA passes

    def everywhere(module, active_adapter, x, result, **kwargs):
        lora_A, lora_B = module.lora_A[active_adapter], module.lora_B[active_adapter]
        return result + lora_B(lora_A(x.to(lora_A.weight.dtype))) * module.scaling[active_adapter]

    monkeypatch.setattr(ALoraLinearVariant, "forward", staticmethod(everywhere))
    with pytest.raises(KvprofError, match="changes the K/V or states before its invocation"):
        load_agents(spec, str(tiny_world.model), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def nf4_base(tiny_world, tmp_path_factory) -> Path:
    """The tiny world's base model quantized to 4-bit NF4 by bitsandbytes and saved, as a QLoRA team holds it."""
    pytest.importorskip("bitsandbytes")
    import torch
    from transformers import AutoTokenizer, BitsAndBytesConfig

    folder = tmp_path_factory.mktemp("nf4") / "model"
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    AutoModelForCausalLM.from_pretrained(tiny_world.model, quantization_config=quantization).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_world.model).save_pretrained(folder)
    return folder


def test_qlora_agents_capture_as_peft_and_replay_every_lora_family_policy(tiny_world, nf4_base, run_cli, tmp_path):
    """QLoRA agents (LoRA adapters on a 4-bit NF4 base, bitsandbytes on CPU): every captured output is peft's own
    greedy generation on that base, token for token; every LoRA-family policy replays the trace (the dense run
    reproducing the capture); the weights count as stored, packed 4-bit plus their quantization state."""
    import torch

    flags = [part for agent in AGENTS for part in ("--agent", f"{agent}={tiny_world.shared_a_adapter(agent)}")]
    common = ("--device", "cpu", "--dtype", "float32")
    code, _, err = run_cli(
        "capture", "--model", nf4_base, "--workflow", tiny_world.lora_workflow, "--tasks", tiny_world.tasks,
        *flags, "--out", tmp_path / "capture", *common,
    )  # fmt: skip
    assert code == 0, err
    assert_peft_generations(nf4_base, {agent: tiny_world.shared_a_adapter(agent) for agent in AGENTS}, tmp_path)
    names = dict.fromkeys(variant.name for variant in LORA_FAMILY)
    code, _, err = run_cli(
        "replay", tmp_path / "capture" / "trace.jsonl", *[part for name in names for part in ("--policy", name)],
        "--limit", "2", "--repeats", "1", "--out", tmp_path / "replay", *common,
    )  # fmt: skip
    assert code == 0, err
    result = json.loads((tmp_path / "replay" / "replay.json").read_text())
    assert result["dense"]["summary"]["trace_agreement"] == 1.0
    expected = {"fullshared", "baseshared-code", "prelrshared", "baselrshared", "rebaseshared-lp"}
    assert set(result["policies"]) >= expected
    assert result["policies"]["prelrshared"]["summary"]["k_error"] > 0
    full_precision = AutoModelForCausalLM.from_pretrained(tiny_world.model)
    linears = [m for m in full_precision.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    packed = sum(m.weight.numel() for m in linears)
    # float32 weights, less the linear layers' 4 bytes a weight, plus half a byte a weight, a float32 absmax per
    # block of 64 and a 16-entry float32 code book per layer
    stored = sum(p.numel() * 4 for p in full_precision.parameters()) - 4 * packed + packed // 2 + packed // 16
    stored += 64 * len(linears) + sum(b.numel() * b.element_size() for b in full_precision.buffers())
    assert weights_bytes(AutoModelForCausalLM.from_pretrained(nf4_base)) == stored
    assert stored < result["weights_bytes"] < stored + sum(p.numel() * 4 for p in full_precision.parameters()) // 4
