"""The fast cache paths — buffers appended in place (`kvprof.model.buffers`), chunks attended without a mask
(`kvprof.kernels.chunk_attention`), RoPE from cached tables — give what the plain path gives (fresh copied caches,
sdpa with transformers' masks): K/V, logits and replay metrics to 1e-5, for every variant on the tiny worlds of both
modes and on the shipped demo trace."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_policies import CASES, shared_a_agents  # noqa: F401  (fixture)

from kvprof.demo.assets import demo_world
from kvprof.errors import KvprofError
from kvprof.kernels.attention import KERNEL
from kvprof.model.agents import load_agents_for_trace
from kvprof.model.architecture import decoder_layers
from kvprof.model.buffers import BufferCache, GrowingTensor, KVBuffer, Workspace
from kvprof.model.rope import apply_rope, rotate_half
from kvprof.model.runtime import Runtime
from kvprof.policies import PolicyVariant, TurnRequest, lowrank, runnable_variants
from kvprof.policies.base import tensor_bytes
from kvprof.policies.nonshared import NonShared
from kvprof.replay.records import compare_turn
from kvprof.traces.trace import read_trace

# The two runtimes attend through different kernels (chunked LSE merge against masked SDPA); at the demo trace's 3.2k
# tokens their keys and logits differ by up to ~1.6e-5 in float32, a wrong fast path by orders of magnitude more.
TOLERANCE = 2e-5
METRICS = ("kl", "kl_sum", "top1_sum", "trace_agreement_sum", "reused", "prefilled", "flops", "ttft_flops")


def one_ratio_each(variants: list[PolicyVariant]) -> list[PolicyVariant]:
    """Each policy's variants but those that differ from an earlier one by their ratio alone: a ratio changes how
    many tokens or layers take a path, not which paths run."""
    kept, seen = [], set()
    for variant in variants:
        key = (variant.policy.name, tuple(sorted((k, v) for k, v in variant.options.items() if k != "ratio")))
        if key not in seen:
            seen.add(key)
            kept.append(variant)
    return kept


def replay_both_ways(agents, trajectory, mode: str, turns: int | None = None, ratios: bool = True) -> None:
    """Every runnable variant of `mode` (`ratios` False: one ratio each, `one_ratio_each`) over `trajectory` (its
    first `turns` turns) on the fast and the plain runtime, turn by turn."""
    runs = {fast: Runtime(agents, fast_paths=fast) for fast in (True, False)}
    variants, _ = runnable_variants(
        [variant for case_mode, variant in CASES if case_mode == mode], runs[True], skip=True
    )
    variants = variants if ratios else one_ratio_each(variants)
    assert variants
    dense = {fast: NonShared(runtime) for fast, runtime in runs.items()}
    policies = {fast: [variant.build(runtime) for variant in variants] for fast, runtime in runs.items()}
    for turn in trajectory.turns[:turns]:
        request = TurnRequest(turn.agent, trajectory.input_tokens(turn), trajectory.output_tokens(turn))
        dense_results = {fast: dense[fast].run_turn(request) for fast in runs}
        for index, variant in enumerate(variants):
            results = {fast: policies[fast][index].run_turn(request) for fast in runs}
            fast, plain = results[True], results[False]
            torch.testing.assert_close(fast.logits, plain.logits, atol=TOLERANCE, rtol=TOLERANCE)
            for (keys, values), (plain_keys, plain_values) in zip(fast.input_kv, plain.input_kv):
                torch.testing.assert_close(keys, plain_keys, atol=TOLERANCE, rtol=TOLERANCE)
                torch.testing.assert_close(values, plain_values, atol=TOLERANCE, rtol=TOLERANCE)
            assert fast.memory == plain.memory, variant.label
            records = {
                way: compare_turn(results[way], dense_results[way], 0, request.output_ids or [], trajectory="t", turn=0)
                for way in runs
            }
            for metric in METRICS:
                # relative as well as absolute, as for logits and K/V above: the *_sum metrics add up many tokens
                expected = pytest.approx(getattr(records[False], metric), rel=TOLERANCE, abs=TOLERANCE)
                assert getattr(records[True], metric) == expected, (variant.label, metric)
            for layer, plain_layer in zip(records[True].layers or [], records[False].layers or []):
                for name, value in layer.to_json().items():
                    assert value == pytest.approx(plain_layer.to_json()[name], abs=TOLERANCE), (variant.label, name)


def test_tiny_lora_world(lora_trace, shared_a_agents):  # noqa: F811
    replay_both_ways(shared_a_agents, read_trace(lora_trace).trajectories[0], "lora")


def test_tiny_prompt_world(prompt_trace):
    agents = load_agents_for_trace(prompt_trace, device="cpu", dtype="float32")
    replay_both_ways(agents, read_trace(prompt_trace).trajectories[0], "prompt")


def test_demo_trace():
    """The shipped long trace's first five turns: contexts of 1.6K and 3.2K tokens, each appended to the buffers in
    one step past their capacity (its later turns repeat that at 4.9K); every policy, one ratio each (the tiny
    worlds above run every ratio)."""
    world = demo_world()
    trace = world.sample_traces["lora_long"]
    agents = load_agents_for_trace(trace, device="cpu", dtype="float32")
    replay_both_ways(agents, read_trace(trace).trajectories[0], "lora", turns=5, ratios=False)


def test_growing_tensor_keeps_its_contents_across_growth():
    grown = GrowingTensor.of(torch.arange(6.0).view(1, 6, 1), 1)
    start = grown.capacity
    grown.write(start, torch.ones(1, 3, 1))  # past the capacity: one growth, the first slots kept
    assert grown.capacity >= start + 3
    assert torch.equal(grown.view(6).flatten(), torch.arange(6.0))
    assert torch.equal(grown.view(start + 3)[0, start:, 0], torch.ones(3))


def test_make_room_holds_exactly_the_room_asked_for_and_keeps_the_contents():
    grown = GrowingTensor.of(torch.arange(6.0).view(1, 6, 1), 1)
    start = grown.capacity
    grown.make_room(start + 5)
    assert grown.capacity == start + 5  # exactly: no growth factor, no headroom
    assert torch.equal(grown.view(6).flatten(), torch.arange(6.0))
    assert torch.equal(grown.view(start + 5)[0, start:, 0], torch.zeros(5))  # written once, untimed
    storage = grown.storage
    grown.make_room(start)
    assert grown.storage is storage  # room enough: nothing moves


def test_no_store_grows_inside_a_timed_phase(lora_trace, prompt_trace, shared_a_agents, monkeypatch):  # noqa: F811
    """Before each call a policy makes room in the stores the call extends (`SharingPolicy.make_room`), and a buffer
    made during the call has room for the call's input and output (`SharingPolicy.with_output`), so prefill and
    decode (TTFT, TPOT) grow no buffer a store holds after the call (a copy of all it holds): every variant, one
    ratio each, both modes, with no headroom to hide a growth."""
    from kvprof.model import buffers
    from kvprof.policies.base import SharingPolicy

    monkeypatch.setattr(buffers, "HEADROOM", 0)
    timed = [""]  # the label of the run inside a timed phase, "" outside
    grown: list[tuple[str, GrowingTensor]] = []
    reserve, prefill, decode = GrowingTensor.reserve, SharingPolicy.prefill, SharingPolicy.decode

    def watched_reserve(self, end):
        if end > self.capacity and timed[0]:
            grown.append((timed[0], self))
        reserve(self, end)

    def timed_phase(phase):
        def watched(self, *args, **kwargs):
            timed[0] = self.label
            try:
                return phase(self, *args, **kwargs)
            finally:
                timed[0] = ""

        return watched

    monkeypatch.setattr(GrowingTensor, "reserve", watched_reserve)
    monkeypatch.setattr(SharingPolicy, "prefill", timed_phase(prefill))
    monkeypatch.setattr(SharingPolicy, "decode", timed_phase(decode))
    prompt_agents = load_agents_for_trace(prompt_trace, device="cpu", dtype="float32")
    served, stores_grown = 0, []
    for mode, trace, agents in (("lora", lora_trace, shared_a_agents), ("prompt", prompt_trace, prompt_agents)):
        runtime = Runtime(agents)
        variants, _ = runnable_variants([v for m, v in CASES if m == mode], runtime, skip=True)
        variants = one_ratio_each(variants)
        kept_views = [  # views=kept (kvprof's option) is no sweep's: added here
            PolicyVariant(v.name, v.options | {"views": "kept"}) for v in variants if "views" in v.policy.options
        ]
        trajectory = read_trace(trace).trajectories[0]
        for policy in [NonShared(runtime), *(v.build(runtime) for v in variants + kept_views)]:
            for turn in trajectory.turns:
                policy.run_turn(TurnRequest(turn.agent, trajectory.input_tokens(turn), trajectory.output_tokens(turn)))
                held = {t.untyped_storage().data_ptr() for group in policy.stored_tensors().values() for t in group}
                stores_grown += [
                    label for label, tensor in grown if tensor.storage.untyped_storage().data_ptr() in held
                ]
                grown.clear()
                served += 1
    assert served > 20
    assert stores_grown == []


def test_buffer_cache_appends_in_place_after_the_context():
    keys, values = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    buffer = KVBuffer.of(keys, values)
    storage = buffer.keys.storage
    cache = BufferCache([buffer], 3)  # the first 3 tokens are the context; 3.. are scratch
    new_keys, new_values = torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4)
    out_keys, out_values = cache.update(new_keys, new_values, 0)
    assert cache.get_seq_length() == 7 and buffer.keys.storage is storage
    assert torch.equal(out_keys[:, :, :3], keys[:, :, :3]) and torch.equal(out_keys[:, :, 3:], new_keys)
    assert torch.equal(out_values[:, :, 3:], new_values)


def test_workspace_reuses_its_storage_and_grows():
    """A workspace buffer is the same storage turn after turn while it fits, grows by GROWTH past it, and is
    reallocated for another shape; `copy` holds what `KVBuffer.of` does, `rows` the rows stacked."""
    workspace = Workspace()
    keys, values = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    first = workspace.copy("view", 0, keys, values, spare=5)
    storage = first.keys.storage.data_ptr()
    assert torch.equal(first.view(40)[0], keys) and torch.equal(first.view(40)[1], values)
    again = workspace.copy("view", 0, keys[:, :, :30], values[:, :, :30])
    assert again is first and again.keys.storage.data_ptr() == storage
    assert workspace.buffer("view", 1, keys, values, 10) is not first  # per layer
    assert workspace.buffer("other", 0, keys, values, 10) is not first  # per name
    capacity = first.keys.capacity
    grown = workspace.buffer("view", 0, keys, values, capacity + 1)
    assert grown.keys.capacity >= int(capacity * 1.5)
    halves = workspace.copy("view", 0, keys.half(), values.half())
    assert halves.keys.storage.dtype == torch.float16 and torch.equal(halves.view(40)[0], keys.half())
    other = (torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8))
    stacked = workspace.rows("rows", 0, [(keys, values), other], spare=3)
    assert torch.equal(stacked.view(40)[0], torch.cat([keys, other[0]]))
    assert torch.equal(stacked.view(40)[1], torch.cat([values, other[1]]))


RSS_RETURNED_ON_FREE = """
import sys, torch
from kvprof.profiling import keep_freed_memory
if sys.argv[1] == "kept" and not keep_freed_memory():
    sys.exit(3)
def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
held = rss_kib()
del block
print(held - rss_kib())
"""


def fresh_process_count(script: str, mode: str) -> int:
    """The number a fresh process running `script` with argument `mode` prints last; skips where the script exits
    3 (not glibc)."""
    done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=300)
    if done.returncode == 3:
        pytest.skip("not glibc")
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


def returned_on_free(mode: str) -> int:
    """KiB a fresh process hands back to the OS when it frees a 64 MiB tensor (`mode` "kept": after
    `keep_freed_memory`); skips where that cannot be measured."""
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc")
    return fresh_process_count(RSS_RETURNED_ON_FREE, mode)


def test_freed_memory_stays_in_the_process():
    """After `keep_freed_memory` a large freed block stays in the process's heap for later allocations, where glibc
    by default unmaps it (its pages faulted in afresh next time). Measured in fresh processes: a test worker's heap
    is whatever earlier tests left."""
    assert returned_on_free("kept") < 4 * 1024  # first: skips where keep_freed_memory has no effect (not glibc)
    assert returned_on_free("default") >= 60 * 1024


TOUCHED_HEAP_REPEAT = """
import contextlib, sys, torch
from kvprof.profiling import TouchedHeap, keep_freed_memory, minor_faults
if not keep_freed_memory():
    sys.exit(3)
heap, pins = TouchedHeap(), []
def section(extra):
    with heap.section() if sys.argv[1] == "reserve" else contextlib.nullcontext():
        start = minor_faults()
        block = torch.ones((64 * 2**20 + extra) // 4)  # touched
        pins.append(torch.ones(2**18))  # allocated after it: the block, freed, leaves a hole below
        del block
        return minor_faults() - start
section(0)
print(section(64 * 1024))  # does not fit the hole: the heap grows
"""


def repeat_faults(mode: str) -> int:
    """Pages a fresh process faults in a section whose 64 MiB tensor is a little larger than the hole the same
    section left the first time (`mode` "reserve": inside `TouchedHeap.section`)."""
    return fresh_process_count(TOUCHED_HEAP_REPEAT, mode)


def test_touched_heap_serves_a_grown_repeat_from_touched_pages():
    """Kept memory alone: a repeat that no freed block fits grows the heap onto fresh pages; after a `TouchedHeap`
    reserve it lands on touched ones."""
    assert repeat_faults("none") >= 60 * 2**20 // resource.getpagesize()
    assert repeat_faults("reserve") < 2**20 // resource.getpagesize()


def test_rope_tables_equal_the_rotation(shared_a_agents):  # noqa: F811
    runtime = Runtime(shared_a_agents)
    states = torch.randn(1, runtime.kv_heads, 300, runtime.head_dim)
    cos, sin = runtime.rope_tables(300, 0)

    expected = apply_rope(states, torch.arange(300), runtime.ropes[0])
    torch.testing.assert_close(states * cos + rotate_half(states) * sin, expected)
    torch.testing.assert_close(runtime.ropes[0].rotate(states, cos, sin), expected)
    assert runtime.rope_tables(10, 1)[0].shape == (10, runtime.head_dim)


def test_kept_views_equal_per_turn_expansion(lora_trace, shared_a_agents, monkeypatch):  # noqa: F811
    """views=kept expands each token once per agent and extends the view; it attends to exactly what the per-turn
    expansion builds, and stores one more cache per agent that has acted (counted, and equal to the live bytes).
    Views are expanded 7 tokens at a time, so a kept view's blocks start elsewhere than a per-turn view's."""
    monkeypatch.setattr(lowrank, "EXPANSION_BLOCK", 7)
    runtime = Runtime(shared_a_agents)
    trajectory = read_trace(lora_trace).trajectories[0]
    for name, extra in (("prelrshared", {}), ("baselrshared", {}), ("rebaseshared", {"schedule": "db"})):
        per_turn = PolicyVariant(name, extra).build(runtime)
        kept = PolicyVariant(name, extra | {"views": "kept"}).build(runtime)
        assert kept.label.endswith("-kept")
        expansion = {"per-turn": 0.0, "kept": 0.0}
        for turn in trajectory.turns:
            request = TurnRequest(turn.agent, trajectory.input_tokens(turn), trajectory.output_tokens(turn))
            expected, actual = per_turn.run_turn(request), kept.run_turn(request)
            torch.testing.assert_close(actual.logits, expected.logits, atol=TOLERANCE, rtol=TOLERANCE)
            for (keys, values), (expected_keys, expected_values) in zip(actual.input_kv, expected.input_kv):
                torch.testing.assert_close(keys, expected_keys, atol=TOLERANCE, rtol=TOLERANCE)
                torch.testing.assert_close(values, expected_values, atol=TOLERANCE, rtol=TOLERANCE)
            expansion["per-turn"] += expected.ttft_flops
            expansion["kept"] += actual.ttft_flops
            assert tensor_bytes(kept.live_tensors()) == kept.analytic_bytes()
            views = {key: size for key, size in actual.memory.items() if key.startswith("view:")}
            assert set(actual.memory) - set(views) == set(expected.memory)
            assert all(size > 0 for size in views.values()) and (bool(views) or not actual.reused)
        assert expansion["kept"] < expansion["per-turn"], name


def test_kept_views_refuse_flash_lora_attention(shared_a_agents):  # noqa: F811
    with pytest.raises(KvprofError, match="views=kept"):
        PolicyVariant("prelrshared", {"views": "kept"}).build(Runtime(shared_a_agents, lora_attention=KERNEL))


def test_a_model_loaded_with_another_attention_keeps_it(prompt_trace):
    """Only an sdpa model is switched to kvprof's attention (sdpa plus the unmasked chunk path) for its forwards."""
    seen = []
    for attn, expected in (("eager", "eager"), ("sdpa", "kvprof_lora")):
        agents = load_agents_for_trace(prompt_trace, device="cpu", dtype="float32", attn=attn)
        runtime = Runtime(agents)
        attention = decoder_layers(agents.base_model)[0].self_attn
        handle = attention.register_forward_pre_hook(
            lambda module, args: seen.append(module.config._attn_implementation)
        )
        runtime.forward("plan", [5, 6, 7], runtime.cache_from(runtime.empty_kv()), 0)
        handle.remove()
        assert seen.pop() == expected and agents.base_model.config._attn_implementation == attn
