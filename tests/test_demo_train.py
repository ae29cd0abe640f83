"""The demo trainer's adapter sets, checked without training: the papers' q/v setting (r=8, α=16) and its twin with
A shared on v_proj only, reproducibly initialised; and BaseLRShared's shared-A check asks only for the cached
projections the adapters adapt."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvprof.demo.train import LORA_TARGETS, AdapterSet, TrainConfig, adapter_sets, role_adapters, trained
from kvprof.demo.world import ROLES
from kvprof.errors import KvprofError
from kvprof.model.agents import load_agents_for_trace
from kvprof.model.lora import unshared_down_projections
from kvprof.model.runtime import Runtime
from kvprof.policies import PolicyVariant

SETS = {adapter_set.name: adapter_set for adapter_set in adapter_sets(TrainConfig())}


def _down(peft_model, projection: str, role: str) -> list[torch.Tensor]:
    return [
        module.lora_A[role].weight.detach().clone()
        for name, module in peft_model.named_modules()
        if name.endswith(projection) and role in getattr(module, "lora_A", {})
    ]


@pytest.fixture
def base(tiny_world):
    return AutoModelForCausalLM.from_pretrained(tiny_world.model, dtype=torch.float32)


def test_the_papers_adapter_setting_is_a_shipped_set():
    qv, twin = SETS["lora_qv"], SETS["shared_a_qv"]
    assert (qv.targets, qv.rank, qv.alpha, qv.shared_a) == (("q_proj", "v_proj"), 8, 16, ())
    assert (twin.targets, twin.rank, twin.alpha, twin.shared_a) == (("q_proj", "v_proj"), 8, 16, ("v_proj",))
    assert SETS["shared_a"].shared_a == LORA_TARGETS and SETS["lora"].targets == LORA_TARGETS
    assert len({adapter_set.seed_offset for adapter_set in SETS.values()}) == len(SETS)


def test_the_twin_shares_a_on_v_proj_only_and_trains_the_rest(base):
    twin = SETS["shared_a_qv"]
    peft_model = role_adapters(base, twin, seed=0, tokenizer=None)
    for other in ROLES[1:]:
        assert all(
            torch.equal(a, b) for a, b in zip(_down(peft_model, "v_proj", ROLES[0]), _down(peft_model, "v_proj", other))
        )
        assert not any(
            torch.equal(a, b) for a, b in zip(_down(peft_model, "q_proj", ROLES[0]), _down(peft_model, "q_proj", other))
        )
    assert not _down(peft_model, "k_proj", ROLES[0])
    names = [name for name, _ in peft_model.named_parameters()]
    for role in ROLES:
        kinds = {
            name.split(".lora_", 1)[0].rsplit(".", 1)[-1] + ".lora_" + name.split(".lora_", 1)[1].split(".")[0]
            for name in names
            if trained(name, role, twin)
        }
        assert kinds == {"q_proj.lora_A", "q_proj.lora_B", "v_proj.lora_B"}, role
    # the q/k/v/o shared-A set trains B alone, as before
    assert not any(trained(name, ROLES[0], SETS["shared_a"]) for name in names if "lora_A" in name)
    again = role_adapters(peft_model.unload(), twin, seed=0, tokenizer=None)
    assert all(
        torch.equal(a, b) for a, b in zip(_down(again, "q_proj", ROLES[1]), _down(peft_model, "q_proj", ROLES[1]))
    )


def _agents(base, tmp_path, lora_trace, adapters: AdapterSet):
    peft_model = role_adapters(base, adapters, seed=0, tokenizer=None)
    peft_model.save_pretrained(tmp_path / adapters.name)
    peft_model.unload()  # `base` without adapters again
    flags = [f"{role}={tmp_path / adapters.name / role}" for role in ("plan", "act", "reflect")]
    return load_agents_for_trace(lora_trace, agent_flags=flags, device="cpu", dtype="float32")


def test_baselrshared_asks_for_a_shared_a_only_where_it_shares_an_lr_cache(base, tmp_path, lora_trace):
    assert ROLES == ("plan", "act", "reflect")
    runtime = Runtime(_agents(base, tmp_path, lora_trace, SETS["shared_a_qv"]))
    assert unshared_down_projections(runtime.splits, ROLES) == []  # K unadapted, q_proj's A outside the cache
    PolicyVariant("baselrshared").build(runtime)
    # q/k/v/o with A shared on v_proj only: BaseLRShared would share the keys' LR cache too, whose A differ
    qkvo = AdapterSet("qkvo_v", "qkvo_v", LORA_TARGETS, 8, 16, ("v_proj",), 9)
    runtime = Runtime(_agents(base, tmp_path, lora_trace, qkvo))
    assert unshared_down_projections(runtime.splits, ROLES) == ["layer 0 k_proj", "layer 1 k_proj"]
    with pytest.raises(KvprofError, match="differ on layer 0 k_proj, layer 1 k_proj"):
        PolicyVariant("baselrshared").build(runtime)


def test_the_activated_twins_train_from_the_cue_on(base, tiny_world):
    """The aLoRA sets' adapters are invoked by the cue's ids with a causal-LM task type, and training reaches them
    through peft's forward: the loss on an output after the cue gives every B a gradient (the decoder alone would
    run the base and give none), while a row without the cue gives none."""
    from transformers import AutoTokenizer

    from kvprof.demo.data import IGNORE
    from kvprof.demo.train import output_loss
    from kvprof.demo.world import CUE

    tokenizer = AutoTokenizer.from_pretrained(tiny_world.model)
    assert SETS["alora"].activated and SETS["alora_qv"].activated and SETS["alora_qv"].targets == ("q_proj", "v_proj")
    assert not any(SETS[name].activated for name in ("lora", "shared_a", "lora_qv", "shared_a_qv"))
    peft_model = role_adapters(base, SETS["alora"], seed=0, tokenizer=tokenizer)
    cue = tokenizer.encode(CUE, add_special_tokens=False)
    assert peft_model.peft_config[ROLES[0]].alora_invocation_tokens == cue
    assert peft_model.peft_config[ROLES[0]].task_type == "CAUSAL_LM"
    context = tokenizer.encode("Question: where?\n", add_special_tokens=False)
    answer = tokenizer.encode(" search[x]\n", add_special_tokens=False)
    for ids, reached in ((context + cue + answer, True), (context + context + answer, False)):
        input_ids = torch.tensor([ids])
        labels = torch.full_like(input_ids, IGNORE)
        labels[0, -len(answer) :] = input_ids[0, -len(answer) :]
        peft_model.zero_grad(set_to_none=True)
        output_loss(peft_model, input_ids, labels, torch.ones_like(input_ids, dtype=torch.bool), 0.0).backward()
        grads = [p.grad for name, p in peft_model.named_parameters() if f"lora_B.{ROLES[0]}" in name]
        assert grads and all((g is not None and g.abs().sum() > 0) == reached for g in grads)
