"""Every registered policy variant against the dense oracle, on a trace of each mode it supports (teacher-forced
and online). The matrix is built from the registry: a new policy module is covered with no test edit."""

from __future__ import annotations

import math

import pytest
import torch

from kvprof.errors import KvprofError
from kvprof.kernels import attention
from kvprof.kernels.attention import EXPAND, KERNEL, MIN_STORED_KEYS, SHORT
from kvprof.kernels.expansion import expand_into as native_expand_into
from kvprof.kernels.expansion import native_library
from kvprof.kernels.transformers_attention import stored_value_calls
from kvprof.model.agents import load_agents_for_trace
from kvprof.model.architecture import decoder_layers
from kvprof.model.runtime import Runtime
from kvprof.model.tiny import build_adapter, build_tiny_world, tiny_config
from kvprof.policies import PolicyVariant, TurnRequest, enumerate_variants, lowrank, runnable_variants
from kvprof.replay.engine import run_replay
from kvprof.replay.lockstep import replay_trace
from kvprof.replay.online import run_online, summarise_online
from kvprof.replay.records import DENSE
from kvprof.replay.setting import ReplaySettings
from kvprof.results.replay import FUSED_EXPANSION
from kvprof.traces.tasks import load_tasks
from kvprof.traces.trace import read_trace

MODES = ("lora", "prompt")
CASES = [(mode, variant) for mode in MODES for variant in enumerate_variants() if mode in variant.policy.modes]


def _agents(trace, world, adapters="adapter"):
    flags = [f"{name}={getattr(world, adapters)(name)}" for name in ("plan", "act", "reflect")]
    return load_agents_for_trace(trace, agent_flags=flags, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def shared_a_agents(lora_trace, tiny_world):
    return _agents(lora_trace, tiny_world, "shared_a_adapter")


@pytest.fixture(scope="module")
def matrices(request):
    """Per mode, every variant that supports it replayed in lockstep on that mode's trace (lora: adapters that
    share A, so every LoRA policy can run), computed on first use."""
    cache: dict[str, dict] = {}

    def replay(mode: str) -> dict:
        if mode not in cache:
            if mode == "lora":
                agents, trace = request.getfixturevalue("shared_a_agents"), request.getfixturevalue("lora_trace")
            else:
                trace = request.getfixturevalue("prompt_trace")
                agents = load_agents_for_trace(trace, device="cpu", dtype="float32")
            variants = [variant for case_mode, variant in CASES if case_mode == mode]
            runnable, skipped = runnable_variants(variants, Runtime(agents), skip=True)
            assert not skipped, f"the test world must let every {mode}-mode variant run: {skipped}"
            cache[mode] = replay_trace(agents, read_trace(trace).trajectories, runnable, check_memory=True)
        return cache[mode]

    return replay


def check_variant(entry: dict, dense: dict, memory_checked: bool = True) -> None:
    """What every policy variant must satisfy against the dense run, whatever the policy (used for registered
    and throwaway policies alike). `memory_checked`: the replay compared analytic and live bytes."""
    summary = entry["summary"]
    if memory_checked:
        assert entry["memory_accounting_exact"], "analytic bytes must equal the live tensors' bytes"
    assert summary["turns"] == len(dense["turns"]) and summary["input_tokens"] == dense["summary"]["input_tokens"]
    for turn, dense_turn in zip(entry["turns"], dense["turns"]):
        assert turn["agent"] == dense_turn["agent"] and turn["output_tokens"] == dense_turn["output_tokens"]
        assert math.isfinite(turn["kl"]) and turn["kl"] >= -1e-12
        served = turn["reused"] + turn.get("moved", 0)  # the kept prefix and the moved spans served re-aligned
        assert 0 <= turn["from_others"] <= served < turn["input_tokens"]
        assert bool(turn["layers"]) == bool(served)  # error is measured exactly where tokens are reused
        for layer in turn["layers"]:
            assert all(math.isfinite(value) for value in layer.values())
            assert layer["k_error"] >= 0 and layer["v_error"] >= 0
            assert -1 - 1e-9 <= layer["k_cosine"] <= 1 + 1e-9 and -1 - 1e-9 <= layer["v_cosine"] <= 1 + 1e-9
    if entry["name"] == "nonshared":  # the dense run's own forwards: bit for bit
        assert summary["kl"] == 0.0 and summary["k_error"] == 0.0 and summary["v_error"] == 0.0
    if not entry["approximate"]:
        # an exact policy computes what the dense run computes (in other forwards: to float rounding)
        assert summary["kl"] < 1e-9 and summary["k_error"] < 1e-5 and summary["v_error"] < 1e-5
        assert summary["top1"] == 1.0 and summary["first_token_match"] == 1.0
    elif summary["reuse_per_token"] > 0:
        # an approximate policy that reuses reports its error on every layer of the reused span
        assert summary["layers"] and all({"k_error", "v_error"} <= set(row) for row in summary["layers"])


@pytest.mark.parametrize("mode, variant", CASES, ids=[f"{mode}-{variant.label}" for mode, variant in CASES])
def test_policy_matrix(matrices, mode, variant):
    result = matrices(mode)
    check_variant(result["policies"][variant.label], result["dense"])


@pytest.mark.parametrize("mode", MODES)
def test_records_count_the_traces_tokens(matrices, request, mode):
    """Each turn's record counts the turn's input and output tokens as the trace holds them (the input is what the
    agent attended to before decoding)."""
    trace = read_trace(request.getfixturevalue("lora_trace" if mode == "lora" else "prompt_trace"))
    expected = [
        (len(traj.input_tokens(turn)), len(traj.output_tokens(turn)))
        for traj in trace.trajectories
        for turn in traj.turns
    ]
    result = matrices(mode)
    for records in [result["dense"]["turns"], *(entry["turns"] for entry in result["policies"].values())]:
        assert [(turn["input_tokens"], turn["output_tokens"]) for turn in records] == expected


@pytest.fixture(scope="module")
def matrix(matrices):
    return matrices("lora")


def test_sharing_saves_prefill_and_memory(matrix):
    dense = matrix["dense"]["summary"]
    policies = matrix["policies"]
    assert policies["fullshared"]["summary"]["prefilled"] < dense["prefilled"]
    full = policies["fullshared"]["summary"]  # the same prefixes and moved spans, re-aligned by both
    assert full["moved"] > 0
    assert policies["prelrshared"]["summary"]["prefilled"] == full["prefilled"]
    assert policies["prelrshared"]["summary"]["moved"] == full["moved"]
    assert policies["baseshared-full"]["summary"]["prefilled"] > dense["prefilled"]  # the LR prefill
    assert policies["fullshared"]["summary"]["memory_ratio"] < 1.0
    assert (
        policies["baselrshared"]["summary"]["peak_memory_bytes"]
        < policies["prelrshared"]["summary"]["peak_memory_bytes"]
    )  # one LR cache instead of one per agent


def test_baselrshared_equals_prelrshared_with_shared_a(matrix):
    """With a shared A, X_i·A_j is the same for every j: the two policies must agree."""
    a = matrix["policies"]["baselrshared"]["turns"]
    b = matrix["policies"]["prelrshared"]["turns"]
    for turn_a, turn_b in zip(a, b):
        assert turn_a["kl"] == pytest.approx(turn_b["kl"], rel=1e-4, abs=1e-9)


def test_baselrshared_refuses_different_a(lora_trace, tiny_world):
    agents = _agents(lora_trace, tiny_world)
    with pytest.raises(KvprofError, match="share their down-projection A"):
        PolicyVariant("baselrshared").build(Runtime(agents))


def test_fullshared_identical_adapters_is_exact(lora_trace, tiny_world):
    same = tiny_world.adapter("act")
    agents = load_agents_for_trace(
        lora_trace, agent_flags=[f"{n}={same}" for n in ("plan", "act", "reflect")], device="cpu", dtype="float32"
    )
    result = replay_trace(agents, read_trace(lora_trace).trajectories[:1], [PolicyVariant("fullshared")])
    summary = result["policies"]["fullshared"]["summary"]
    assert summary["reuse_per_token"] > 0.3
    # exact on the prefixes it reuses: every turn before the first moved span (the tiny model's outputs repeat runs
    # of ids, which FullShared re-aligns from another context, and stores)
    turns = result["policies"]["fullshared"]["turns"]
    first_moved = next((index for index, turn in enumerate(turns) if turn["moved"]), len(turns))
    exact = [turn for turn in turns[:first_moved] if turn["reused"]]
    assert len(exact) >= 2
    for turn in exact:
        assert turn["kl"] < 1e-8
        assert all(layer["k_error"] < 1e-5 and layer["v_error"] < 1e-5 for layer in turn["layers"])
    different = replay_trace(
        _agents(lora_trace, tiny_world), read_trace(lora_trace).trajectories[:1], [PolicyVariant("fullshared")]
    )["policies"]["fullshared"]["summary"]
    assert different["v_error"] > 1e-2


def _run_trajectory(policy, traj):
    policy.reset()
    for turn in traj.turns:
        policy.run_turn(TurnRequest(turn.agent, traj.input_tokens(turn), traj.output_tokens(turn)))


def test_rebaseshared_lp_and_db_reach_the_same_cache(lora_trace, tiny_world):
    runtime = Runtime(_agents(lora_trace, tiny_world))
    traj = read_trace(lora_trace).trajectories[0]
    lazy = PolicyVariant("rebaseshared", {"schedule": "lp"}).build(runtime)
    batched = PolicyVariant("rebaseshared", {"schedule": "db"}).build(runtime)
    _run_trajectory(lazy, traj)
    _run_trajectory(batched, traj)
    lazy_tensors, batched_tensors = lazy.live_tensors(), batched.live_tensors()
    assert lazy_tensors.keys() == batched_tensors.keys() and len(lazy.store) == len(batched.store) > 50
    for name in lazy_tensors:
        for a, b in zip(lazy_tensors[name], batched_tensors[name]):
            assert a.shape == b.shape
            assert float((a - b).norm() / b.norm()) <= 1e-5, name


def _attention_inputs(agents, agent, ids):
    """X entering every layer's v_proj, captured from peft's own base layer (independent of kvprof.model.lora)."""
    captured = {}
    layers = decoder_layers(agents.base_model)
    handles = [
        layer.self_attn.v_proj.base_layer.register_forward_pre_hook(
            lambda module, args, i=i: captured.__setitem__(i, args[0])
        )
        for i, layer in enumerate(layers)
    ]
    try:
        with torch.inference_mode(), agents.activate(agent):
            agents.model(input_ids=torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return [captured[i] for i in range(len(layers))], layers


def test_prelrshared_precomputes_every_agents_down_projection(lora_trace, tiny_world):
    agents = _agents(lora_trace, tiny_world)
    policy = PolicyVariant("prelrshared").build(Runtime(agents))
    traj = read_trace(lora_trace).trajectories[0]
    first = traj.turns[0]
    policy.reset()
    policy.run_turn(TurnRequest(first.agent, traj.input_tokens(first), traj.output_tokens(first)))
    ids = traj.input_tokens(first) + traj.output_tokens(first)
    hidden, layers = _attention_inputs(agents, first.agent, ids)
    assert len(policy.store) == len(ids)
    for agent in ("plan", "act", "reflect"):
        for index, layer in enumerate(layers):
            with torch.inference_mode():
                expected = layer.self_attn.v_proj.lora_A[agent](hidden[index])
            stored = policy.store.lr(agent)[index]["value"]
            torch.testing.assert_close(stored, expected, rtol=1e-5, atol=1e-6)


def test_baseshared_lr_cache_is_own_down_projection(lora_trace, tiny_world):
    """The paper text's LR prefill (`full`) re-runs the context with the agent's adapter from position 0: its LR
    cache is the agent's own dense down-projection."""
    agents = _agents(lora_trace, tiny_world)
    policy = PolicyVariant("baseshared", {"lr_prefill": "full"}).build(Runtime(agents))
    traj = read_trace(lora_trace).trajectories[0]
    policy.reset()
    for turn in traj.turns[:2]:
        result = policy.run_turn(TurnRequest(turn.agent, traj.input_tokens(turn), traj.output_tokens(turn)))
    second = traj.turns[1]
    assert second.agent != traj.turns[0].agent and result.reused > 0
    context = traj.input_tokens(second)[: result.reused]
    hidden, layers = _attention_inputs(agents, second.agent, context)
    for index, layer in enumerate(layers):
        with torch.inference_mode():
            expected = layer.self_attn.v_proj.lora_A[second.agent](hidden[index])
        stored = policy.store.lr(second.agent)[index]["value"][:, : result.reused]
        torch.testing.assert_close(stored, expected, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def deep_lora(tmp_path_factory):
    """A three-layer tiny world and its lora trace: in the two-layer world BaseShared's gap tokens reach the same
    K/V whatever they attend to (layer 0 reads the embeddings; only layer 1's output, which nothing reads, differs)."""
    from conftest import capture_tiny_trace

    world = build_tiny_world(
        tmp_path_factory.mktemp("deep"), configure=lambda vocab, eos: tiny_config(vocab, eos, layers=3)
    )
    return world, capture_tiny_trace(world, world.lora_workflow, world.root / "trace.jsonl")


def test_baseshared_code_prefills_since_own_last_turn(deep_lora):
    """BaseShared's default LR prefill (`code`, as LRAgent's code runs it) feeds each turn only the tokens after the
    agent's own LR cache — what others added since its last turn, then its chunk: per turn exactly what NonShared
    prefills. Those gap tokens attend to the shared base K/V plus their own LR term (the store's base plus B over
    the X·A the same forward computed, which the turn then stores), not to their own fresh K/V as `incremental`'s
    separate pass does. Layer 0 reads the embeddings and the shared base there is what the agent's own would be, so
    their layer-1 inputs, hence K/V, agree; at layer 1 they attend to the producer's base instead of their own, so
    from layer 2 on their K/V differ."""
    world, trace = deep_lora
    runtime = Runtime(_agents(trace, world))
    traj = read_trace(trace).trajectories[0]
    code = PolicyVariant("baseshared").build(runtime)
    incremental = PolicyVariant("baseshared", {"lr_prefill": "incremental"}).build(runtime)
    dense = PolicyVariant("nonshared").build(runtime)
    for policy in (code, incremental, dense):
        policy.reset()
    ends: dict[str, int] = {}
    gaps = 0
    for turn in traj.turns:
        request = TurnRequest(turn.agent, traj.input_tokens(turn), traj.output_tokens(turn))
        have = ends.get(turn.agent, 0)
        ours, theirs, nonshared = (policy.run_turn(request) for policy in (code, incremental, dense))
        assert ours.prefilled == len(request.input_ids) - have == nonshared.prefilled
        assert theirs.prefilled == ours.prefilled and theirs.reused == ours.reused
        with torch.inference_mode():
            view = code.store.assemble(turn.agent, code.store.lr(turn.agent), ours.reused).kv
        for layer, ((keys, values), (_, other_values)) in enumerate(zip(ours.input_kv, theirs.input_kv)):
            stored_keys, stored_values = view[layer]
            torch.testing.assert_close(keys[:, : ours.reused], stored_keys[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(values[:, : ours.reused], stored_values[0], rtol=1e-5, atol=1e-5)
            if ours.reused > have:
                gap = slice(have, ours.reused)
                difference = float((values[:, gap] - other_values[:, gap]).norm() / other_values[:, gap].norm())
                assert difference > 1e-3 if layer >= 2 else difference < 1e-5, (layer, difference)
        gaps += ours.reused - have
        ends[turn.agent] = len(request.input_ids) + len(ours.output_ids)
    assert gaps > 20


def test_prelrshared_and_rebaseshared_lp_charge_the_same_prefill_but_the_other_agents_a(lora_trace, tiny_world):
    """Base K/V and the acting agent's X·A come from the forward itself (never projected again), so where
    PreLRShared and ReBaseShared-LP prefill the same tokens their TTFT FLOPs are equal but for what PReCache's
    PreLRShared computes in prefill and LP after the turn: the other agents' down-projections X·A_k of the new
    tokens — and, with an adapter on k_proj (outside the papers' setting), the RoPE of the new tokens' base keys
    (6 FLOPs per entry), which the forward's adapted keys do not give."""
    runtime = Runtime(_agents(lora_trace, tiny_world))
    names = runtime.agents.spec.names
    precomputed = PolicyVariant("prelrshared").build(runtime)
    lazy = PolicyVariant("rebaseshared", {"schedule": "lp"}).build(runtime)
    ratios = []
    for traj in read_trace(lora_trace).trajectories:
        precomputed.reset()
        lazy.reset()
        for turn in traj.turns:
            request = TurnRequest(turn.agent, traj.input_tokens(turn), traj.output_tokens(turn))
            new = len(request.input_ids) - len(precomputed.store)
            ours, theirs = precomputed.run_turn(request), lazy.run_turn(request)
            assert ours.prefilled == theirs.prefilled and ours.reused == theirs.reused
            down = sum(
                2.0 * new * runtime.hidden_size * projection.down[other].shape[0]
                for split in runtime.splits
                for projection in (split.key, split.value)
                for other in names
                if other != turn.agent and other in projection.down
            )
            rotation = sum(
                6.0 * new * runtime.kv_heads * runtime.head_dim
                for split in runtime.splits
                if turn.agent in split.key.up
            )
            assert down > 0 and rotation > 0  # the tiny adapters target every attention projection
            assert ours.ttft_flops - theirs.ttft_flops == pytest.approx(down + rotation, rel=1e-9)
            ratios.append(ours.ttft_flops / theirs.ttft_flops)
    assert 1.0 < min(ratios) and max(ratios) < 1.05


@pytest.mark.parametrize("workflow", ["lora_workflow", "prompt_workflow"])
def test_nonshared_online_replay_reproduces_generate(tiny_world, tmp_path, run_cli, workflow):
    """The captured trace came from transformers' generate; NonShared online replay must regenerate it exactly."""
    code, _, err = run_cli(
        "capture",
        "--model",
        tiny_world.model,
        "--workflow",
        getattr(tiny_world, workflow),
        "--tasks",
        tiny_world.tasks,
        "--out",
        tmp_path,
        "--device",
        "cpu",
    )
    assert code == 0, err
    trace = read_trace(tmp_path / "trace.jsonl")
    agents = load_agents_for_trace(tmp_path / "trace.jsonl", device="cpu", dtype="float32")
    runs = run_online(agents, load_tasks(tiny_world.tasks), [PolicyVariant("fullshared")])
    for captured, replayed in zip(trace.trajectories, runs[DENSE]):
        assert [captured.output_tokens(t) for t in captured.turns] == [
            replayed.output_tokens(t) for t in replayed.turns
        ]
        assert captured.prediction == replayed.prediction
    summary = summarise_online(runs)
    assert summary[DENSE]["diverged_turns"] == 0.0
    assert list(summary[DENSE]["exact"]) == [traj.id for traj in trace.trajectories]
    assert sum(summary[DENSE]["exact"].values()) == summary[DENSE]["correct"]
    assert 0.0 <= summary["fullshared"]["diverged_turns"] <= 1.0


def test_flash_lora_attention_path_matches_expanded_values(lora_trace, shared_a_agents):
    """Low-rank policies attending through the registered Flash-LoRA-Attention (torch reference on CPU) must give
    what expanded values give: the same outputs, and the same cache error (the values attention effectively uses,
    V_base + V_lr·B, not the V_base the cache holds)."""
    trajectories = read_trace(lora_trace).trajectories[:1]
    choices = [
        PolicyVariant("prelrshared"),
        PolicyVariant("baselrshared"),
        PolicyVariant("rebaseshared", {"schedule": "db"}),
    ]
    expanded = replay_trace(shared_a_agents, trajectories, choices)
    kernel = replay_trace(shared_a_agents, trajectories, choices, ReplaySettings(lora_attention=KERNEL))
    for label in expanded["policies"]:
        for a, b in zip(expanded["policies"][label]["turns"], kernel["policies"][label]["turns"]):
            assert b["kl"] == pytest.approx(a["kl"], rel=1e-3, abs=1e-7)
            assert b["top1_sum"] == a["top1_sum"]
            for layer_a, layer_b in zip(a["layers"], b["layers"], strict=True):
                for key in ("k_error", "v_error", "k_cosine", "v_cosine"):
                    assert layer_b[key] == pytest.approx(layer_a[key], rel=0, abs=1e-5), key
    assert kernel["dense"]["summary"]["kl"] == 0.0


@pytest.fixture(scope="module")
def shared_a_qv_agents(lora_trace, tiny_world, tmp_path_factory):
    """The tiny world's agents with shared-A adapters on q_proj and v_proj only (PReCache's setting: keys shared)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("shared_a_qv")
    model = AutoModelForCausalLM.from_pretrained(tiny_world.model)
    flags = []
    for index, name in enumerate(("plan", "act", "reflect")):
        model = build_adapter(model, root / name, 40 + index, targets=("q_proj", "v_proj"), shared_a_seed=39)
        flags.append(f"{name}={root / name}")
    return load_agents_for_trace(lora_trace, agent_flags=flags, device="cpu", dtype="float32")


def _short_requests(traj, new: int) -> list[TurnRequest]:
    """Five calls of the trajectory's first two agents (a, a, b, b, a), each input the previous call's input and
    outputs plus `new` tokens (the first as the trace has it, four outputs a call): every call after the first is
    short, and an agent's second call in a row has no other agent's tokens to catch up on."""
    first, second = list(dict.fromkeys(turn.agent for turn in traj.turns))[:2]
    ids = traj.input_tokens(traj.turns[0])
    outputs = traj.output_tokens(traj.turns[0])[:4]
    requests = []
    for index, agent in enumerate((first, first, second, second, first)):
        if index:
            ids = ids + ids[-new - 7 : -7]  # tokens of the input itself: ordinary ids
        requests.append(TurnRequest(agent, ids, outputs))
        ids = ids + outputs
    return requests


LOW_RANK_SETTINGS = [
    ("prelrshared", {}),
    ("baselrshared", {}),
    ("rebaseshared", {"schedule": "lp"}),
    ("rebaseshared", {"schedule": "db"}),
    ("baseshared", {}),
    ("baseshared", {"lr_prefill": "full"}),
]


@pytest.mark.parametrize("adapters", ["shared_a_agents", "shared_a_qv_agents"], ids=["qkvo", "qv"])
@pytest.mark.parametrize("variant", LOW_RANK_SETTINGS, ids=lambda v: "-".join([v[0], *v[1].values()]))
def test_short_forwards_over_stored_values_equal_expanded_views(request, lora_trace, adapters, variant, monkeypatch):
    """`--lora-attention auto` on CPU ("short"): a turn of few new tokens attends V_base and the rank-r values as
    stored (the store's own values, its new tokens written after the store's) instead of an expanded view. Each
    turn's logits and reused K/V as attention sees them equal the expanded path's, and the store after every turn
    holds the same base and LR caches (the turn's scratch past the store's length never leaks into it)."""
    agents = request.getfixturevalue(adapters)
    traj = read_trace(lora_trace).trajectories[0]
    group = agents.base_model.config.num_attention_heads // agents.base_model.config.num_key_value_heads
    head_dim = agents.base_model.config.hidden_size // agents.base_model.config.num_attention_heads
    requests = _short_requests(traj, new=head_dim // group - 2)  # with the last output: one fewer than pays
    monkeypatch.setattr(attention, "MIN_STORED_KEYS", 1)  # the tiny trace's contexts are short
    runs, stores = {}, {}
    for mode in (EXPAND, SHORT):
        policy = PolicyVariant(*variant).build(Runtime(agents, mode))
        calls = stored_value_calls()
        runs[mode], stores[mode] = [], []
        for turn in requests:
            result = policy.run_turn(turn)
            # the reused span's K/V as the metrics read them (views of buffers the next turn rewrites: copied)
            end = result.prefix_len + result.reused
            reused_kv = [(keys[:, :end].clone(), values[:, :end].clone()) for keys, values in result.input_kv]
            runs[mode].append((result.logits, reused_kv))
            store = policy.store
            base = [tuple(side.clone() for side in buffer.view(len(store))) for buffer in store.base]
            low_rank = {name: [{p: t.clone() for p, t in layer.items()} for layer in store.lr(name) or []]
                        for name in store.low_rank}  # fmt: skip
            stores[mode].append((base, low_rank))
        assert (stored_value_calls() > calls) is (mode == SHORT)
    for (logits, kv), (plain_logits, plain_kv) in zip(runs[SHORT], runs[EXPAND], strict=True):
        torch.testing.assert_close(logits, plain_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv, plain_kv, atol=1e-5, rtol=1e-5)
    for (base, low_rank), (plain_base, plain_low_rank) in zip(stores[SHORT], stores[EXPAND], strict=True):
        torch.testing.assert_close(base, plain_base, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(low_rank, plain_low_rank, atol=1e-5, rtol=1e-5)


def test_which_forwards_attend_stored_values(shared_a_agents):
    """ "short" keeps the values as stored in forwards of few tokens through kvprof's attention only; "kernel" in
    every forward, "expand" in none."""
    runtime = Runtime(shared_a_agents, SHORT)
    assert runtime.values_as_stored(1, MIN_STORED_KEYS) and not runtime.values_as_stored(10_000, MIN_STORED_KEYS)
    assert not runtime.values_as_stored(1, MIN_STORED_KEYS - 1)  # a short context: its view is cheap
    assert not Runtime(shared_a_agents, SHORT, fast_paths=False).values_as_stored(1, MIN_STORED_KEYS)
    assert Runtime(shared_a_agents, KERNEL).values_as_stored(10_000, 1)
    assert not Runtime(shared_a_agents, EXPAND).values_as_stored(1, MIN_STORED_KEYS)


@pytest.mark.parametrize("policy", ["prelrshared", "baseshared", "rebaseshared"])
def test_low_rank_views_by_the_native_kernel_equal_torchs(lora_trace, shared_a_agents, monkeypatch, policy):
    """Each turn's view expanded by the fused CPU kernel (`kvprof.kernels.expansion`) and by the torch blocks gives
    the same logits and attention inputs; the kernel ran on every expansion where it is built."""
    if native_library() is None:
        pytest.skip("no C compiler to build the kernel")
    calls = []

    def counted(*args):
        calls.append(native_expand_into(*args))
        return calls[-1]

    traj = read_trace(lora_trace).trajectories[0]
    runs = {}
    for native in (True, False):
        monkeypatch.setattr(lowrank, "native_expand_into", counted if native else lambda *args: False)
        built = PolicyVariant(policy, {}).build(Runtime(shared_a_agents))
        runs[native] = [
            built.run_turn(TurnRequest(turn.agent, traj.input_tokens(turn), traj.output_tokens(turn)))
            for turn in traj.turns
        ]
    assert calls and all(calls)
    for fused, plain in zip(runs[True], runs[False]):
        torch.testing.assert_close(fused.logits, plain.logits, atol=1e-5, rtol=1e-5)
        for (keys, values), (plain_keys, plain_values) in zip(fused.input_kv, plain.input_kv):
            torch.testing.assert_close(keys, plain_keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(values, plain_values, atol=1e-5, rtol=1e-5)


def test_a_replay_records_whether_the_kernel_expanded_its_views(lora_trace, shared_a_agents):
    """`lora_attention` names the fused expansion only for a replay whose low-rank views it expanded."""
    if native_library() is None:
        pytest.skip("no C compiler to build the kernel")
    trajectories = read_trace(lora_trace).trajectories[:1]
    for name, fused in (("fullshared", False), ("prelrshared", True)):
        result = run_replay(shared_a_agents, trajectories, [PolicyVariant(name, {})])
        assert (FUSED_EXPANSION in result["lora_attention"]) is fused, name
