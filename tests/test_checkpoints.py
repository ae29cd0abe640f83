"""Checkpointed prefix reuse on hybrids (kvprof.traces.checkpoints): the vllm rule against a transcription of vLLM's
block manager written here (an oracle that tracks block tables and hashes, not positions), on the behaviours vLLM's
issues report and on random multi-turn sequences; vLLM's hybrid block size against a transcription of its page
arithmetic; the sglang and boundaries rules on hand-built sequences; `kvprof inspect` on a tiny Qwen 3.5 world."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import partial

import pytest

from kvprof.errors import KvprofError
from kvprof.traces.checkpoints import (
    CHECKPOINT_RULES,
    CheckpointedCache,
    CheckpointRule,
    EngineRequest,
    checkpoint_rule,
    checkpointed_hits,
    vllm_hybrid_block_size,
)

# --- An oracle: vLLM v1's prefix cache for a hybrid model in --mamba-cache-mode align, transcribed at block level ---
#
# Read at vllm-project/vllm:
# - vllm/v1/core/sched/scheduler.py @ 00024d314514900f361ad072af6931e403b7f589: Scheduler._mamba_block_aligned_split
# - vllm/v1/core/kv_cache_manager.py @ ace980e6de0540f49b0c63248437a1a7807590c1: get_computed_blocks (hits capped at
#   num_tokens - 1), allocate_slots (remove skipped blocks, allocate, then cache up to the tokens scheduled)
# - vllm/v1/core/kv_cache_coordinator.py @ 52b9a57da84e0b9e3ee807f1fcbe5f5a2aec853f: HybridKVCacheCoordinator
#   .find_longest_cache_hit (full attention first, then the mamba group within it; one pass for a simple hybrid)
# - vllm/v1/core/single_type_kv_cache_manager.py @ 129ab7c60cbb8eb11e875373e67f7e521b74aa30: FullAttentionManager and
#   MambaManager.find_longest_cache_hit, MambaManager.allocate_new_blocks (align mode, no speculative blocks),
#   SingleTypeKVCacheManager.cache_blocks / remove_skipped_blocks, MambaManager.get_num_skipped_tokens
# - vllm/v1/core/block_pool.py @ c59cb7941357443da7c5eef75cfa8697d683d228: cache_full_blocks skips null blocks
# Not transcribed: eviction (the pool is large enough), speculative decoding, KV connectors, preemption.

NULL = None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class OracleRequest:
    """A request's block tables per KV cache group and how many of their blocks are cached."""

    attention: list = field(default_factory=list)
    mamba: list = field(default_factory=list)
    cached: dict = field(default_factory=lambda: {"attention": 0, "mamba": 0})


class VllmAlignOracle:
    """One engine: a full-attention group and a mamba group, both with blocks of B tokens."""

    def __init__(self, block: int, budget: int = 0):
        self.block, self.budget = block, budget
        self.cached: dict[str, set] = {"attention": set(), "mamba": set()}  # block hashes cached per group

    def block_hashes(self, ids: list[int]) -> list[int]:
        """Chained hashes of the full blocks (each over its parent's hash and its own ids)."""
        hashes, parent, block = [], None, self.block
        for index in range(len(ids) // block):
            parent = hash((parent, tuple(ids[index * block : (index + 1) * block])))
            hashes.append(parent)
        return hashes

    def find_longest_cache_hit(self, hashes: list[int], num_tokens: int) -> int:
        block, max_length = self.block, num_tokens - 1
        attention = 0
        for block_hash in hashes[: max_length // block]:  # FullAttentionManager: left to right, stop at a miss
            if block_hash not in self.cached["attention"]:
                break
            attention += 1
        for index in range(attention - 1, -1, -1):  # MambaManager: right to left, the last cached state
            if hashes[index] in self.cached["mamba"]:
                return (index + 1) * block
        return 0

    def aligned_split(self, computed: int, new: int, num_prompt: int, num_tokens: int) -> int:
        """Scheduler._mamba_block_aligned_split (no eagle)."""
        if computed < max(num_prompt, num_tokens - 1):
            last_cache_position = num_tokens - num_tokens % self.block
            after = computed + new
            if after < last_cache_position:
                new = new // self.block * self.block
            elif computed < last_cache_position < after:
                new = last_cache_position - computed
        return new

    def allocate_and_cache(self, request: OracleRequest, computed: int, new: int, num_tokens: int, hashes) -> None:
        """KVCacheManager.allocate_slots for `new` tokens after `computed`."""
        block = self.block
        skipped = (computed - 1) // block if computed else 0  # remove_skipped_blocks, mamba: num_computed - 1
        for index in range(min(skipped, len(request.mamba)) - 1, -1, -1):
            if request.mamba[index] is NULL:
                break
            request.mamba[index] = NULL
        required = cdiv(computed + new, block)
        request.attention += ["block"] * (required - len(request.attention))
        if required > len(request.mamba):  # align mode: nulls, then one block for the running state
            request.mamba += [NULL] * (required - 1 - len(request.mamba))
            request.mamba.append("state")
        full = min(computed + new, num_tokens) // block  # cache_blocks
        for group, blocks in (("attention", request.attention), ("mamba", request.mamba)):
            for index in range(request.cached[group], full):
                if blocks[index] is not NULL:
                    self.cached[group].add(hashes[index])
            request.cached[group] = max(request.cached[group], full)

    def serve(self, ids: list[int], prompt: int) -> int:
        """Run one request (its prompt, then its generated ids: the last one sampled, never fed); its hit."""
        block = self.block
        hit = self.find_longest_cache_hit(self.block_hashes(ids[:prompt]), prompt)
        request = OracleRequest()
        if hit:  # allocate_new_computed_blocks: the hit's attention blocks; mamba: nulls, then the hit state
            request.attention = ["hit"] * (hit // block)
            request.mamba = [NULL] * (hit // block - 1) + ["hit"]
            request.cached = {"attention": hit // block, "mamba": hit // block}
        computed = hit
        hashes = self.block_hashes(ids)  # the request's block hashes grow as ids are appended
        while computed < prompt:
            new = prompt - computed if not self.budget else min(prompt - computed, self.budget)
            new = self.aligned_split(computed, new, prompt, prompt)
            assert new > 0
            self.allocate_and_cache(request, computed, new, prompt, hashes)
            computed += new
        for num_tokens in range(prompt + 1, len(ids)):  # decode: one id a step, the last generated never fed
            self.allocate_and_cache(request, computed, 1, num_tokens, hashes)
            computed += 1
        return hit


def oracle_hits(block: int, requests: list[tuple[list[int], int]], budget: int = 0) -> list[int]:
    oracle = VllmAlignOracle(block, budget)
    return [oracle.serve(ids, prompt) for ids, prompt in requests]


def module_hits(rule, requests: list[tuple[list[int], int]]) -> list[int]:
    return checkpointed_hits([EngineRequest(ids, prompt) for ids, prompt in requests], rule)


def fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10_000) for _ in range(n)]


# --- the vllm rule -----------------------------------------------------------------------------------------------


def test_a_prompt_shorter_than_a_block_is_never_served():
    """vllm-project/vllm#40696: B = 528 on Qwen3.5-4B; a repeated prompt under 528 ids gets no hit, one of 552
    gets 528 and one of 979 gets 528 (its only kept state is at the last block boundary). A prompt of whole blocks
    keeps its end only, which a repeat (capped one id short) cannot use."""
    rng = random.Random(0)
    rule = checkpoint_rule("vllm", 528)
    for length, served in ((480, 0), (527, 0), (528, 0), (552, 528), (979, 528), (1056, 0)):
        prompt = fresh(rng, length)
        requests = [(prompt + [7], length), (prompt + [8], length)]
        assert module_hits(rule, requests) == oracle_hits(528, requests) == [0, served]
    assert rule.kept(480, 481, 0) == ()
    assert rule.kept(1056, 1057, 0) == (1056,)


def test_a_request_sharing_2000_of_3000_ids_gets_what_the_kept_states_allow():
    """The first request keeps a state at 2640 only (one prefill step, then decode to 3099): a second request that
    shares its first 2000 ids resumes from nothing. With vLLM's step budget of 2048 ids the first keeps 1584 too,
    which the second resumes from (vllm-project/vllm#45238 and #42317: hits depend on where steps end)."""
    rng = random.Random(1)
    first = fresh(rng, 3000)
    second = first[:2000] + fresh(rng, 700)
    requests = [(first + fresh(rng, 100), 3000), (second + fresh(rng, 10), 2700)]
    assert checkpoint_rule("vllm", 528).kept(3000, 3100, 0) == (2640,)
    assert module_hits(checkpoint_rule("vllm", 528), requests) == oracle_hits(528, requests) == [0, 0]
    assert checkpoint_rule("vllm", 528, budget=2048).kept(3000, 3100, 0) == (1584, 2640)
    hits = module_hits(checkpoint_rule("vllm", 528, budget=2048), requests)
    assert hits == oracle_hits(528, requests, budget=2048) == [0, 1584]


def test_the_kept_state_in_request_unique_ids_loses_the_hit():
    """vllm-project/vllm#45238's table (Qwen3.5-4B, B = 528, ~2200-id prompts, 2048-id steps): a shared prefix of
    1600 keeps 1584 inside it and hits; one of 1500 keeps 1584 and 2112 in the unique part and never hits."""
    rng = random.Random(2)
    rule = checkpoint_rule("vllm", 528, budget=2048)
    assert rule.kept(2200, 2201, 0) == (1584, 2112)
    for shared, served in ((1600, 1584), (1500, 0)):
        prefix = fresh(rng, shared)
        requests = [(prefix + fresh(rng, 2200 - shared) + [1], 2200) for _ in range(4)]
        assert module_hits(rule, requests) == oracle_hits(528, requests, budget=2048) == [0] + [served] * 3


def test_decode_keeps_states_at_block_multiples_and_a_turn_resumes_from_the_last():
    """A multi-turn chat: each turn's input extends the previous turn's sequence; decode crosses block boundaries and
    keeps a state at each; the next turn resumes from the last one inside its input."""
    rng = random.Random(3)
    rule = checkpoint_rule("vllm", 64)
    assert rule.kept(100, 300, 64) == (128, 192, 256)
    sequence, requests = fresh(rng, 100), []
    for _ in range(5):
        output = fresh(rng, rng.randint(1, 150))
        requests.append((sequence + output, len(sequence)))
        sequence = sequence + output + fresh(rng, rng.randint(1, 80))
    assert module_hits(rule, requests) == oracle_hits(64, requests)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [0, 48])
def test_the_vllm_rule_equals_the_block_level_oracle_on_random_trajectories(seed, budget):
    rng = random.Random(seed)
    block = rng.choice([8, 16])
    rule = checkpoint_rule("vllm", block, budget=budget)
    sequences, requests = [], []
    for _ in range(40):
        if sequences and rng.random() < 0.8:  # extend, or branch from, an earlier sequence
            base = rng.choice(sequences)
            prompt_ids = base[: rng.randint(0, len(base))] + fresh(rng, rng.randint(1, 70))
        else:
            prompt_ids = fresh(rng, rng.randint(1, 120))
        ids = prompt_ids + fresh(rng, rng.randint(1, 60))
        sequences.append(ids)
        requests.append((ids, len(prompt_ids)))
    hits = module_hits(rule, requests)
    assert hits == oracle_hits(block, requests, budget)
    assert any(hits)


def test_hits_are_capped_below_the_prompt_and_on_block_multiples():
    rule = checkpoint_rule("vllm", 16)
    assert rule.hit(100, 64, (16, 32, 48, 64)) == 48
    assert rule.hit(40, 100, (16, 32, 48)) == 32
    assert rule.hit(40, 100, (20, 30)) == 0  # not a block boundary: vLLM never keeps one there


# --- vLLM's hybrid block size ------------------------------------------------------------------------------------


def gdn_state_bytes(
    tp: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, kernel: int, conv: int, ssm: int
) -> int:
    """vllm/model_executor/layers/mamba/mamba_utils.py @ 2afe1e8573cf51b73569ae1d35f59078a2032a91:
    MambaStateShapeCalculator.gated_delta_net_state_shape; MambaSpec.page_size_bytes sums shape × dtype size."""
    conv_dim = k_dim * k_heads * 2 + v_dim * v_heads
    return (kernel - 1) * conv_dim // tp * conv + v_heads // tp * k_dim * v_dim * ssm


def mamba2_state_bytes(
    tp: int, intermediate: int, groups: int, heads: int, head_dim: int, state: int, kernel: int, conv: int, ssm: int
) -> int:
    """The same file: mamba2_state_shape (groups replicated to divide among ranks)."""
    groups += 0 if groups % tp == 0 else tp - groups
    conv_dim = intermediate + 2 * groups * state
    return (kernel - 1) * (conv_dim // tp) * conv + heads // tp * head_dim * state * ssm


def oracle_block_size(state_bytes: int, kv_heads: int, head_size: int, dtype: int, kernel: int = 16) -> int:
    """vllm/model_executor/models/config.py @ 1936cf3841edb9781b06c50fc4daf4bac9d3b23e:
    HybridAttentionMambaModelConfig.verify_and_update_config, without the `all` mode's chunk alignment."""
    attn_page_size_1_token = 2 * 1 * kv_heads * head_size * dtype  # FullAttentionSpec(block_size=1).page_size_bytes
    attn_block_size = kernel * cdiv(state_bytes, kernel * attn_page_size_1_token)
    block_size = 16  # cache_config.block_size's default
    if block_size < attn_block_size:
        block_size = attn_block_size
    assert block_size * attn_page_size_1_token >= state_bytes
    return block_size


@pytest.mark.parametrize(
    "name, state, kv_heads, head_size, expected",
    [
        # Qwen3.5-4B: 16 key / 32 value heads of 128, conv 4, bf16 conv and an fp32 SSM state (mamba_ssm_dtype)
        ("qwen3.5-4b", gdn_state_bytes(1, 16, 32, 128, 128, 4, 2, 4), 4, 256, 528),
        # Qwen3.5-27B: 16 key / 48 value heads; 4 KV heads of 256 (784 logged in vllm-project/vllm#36010)
        ("qwen3.5-27b", gdn_state_bytes(1, 16, 48, 128, 128, 4, 2, 4), 4, 256, 784),
        ("qwen3.5-27b tp2", gdn_state_bytes(2, 16, 48, 128, 128, 4, 2, 4), 2, 256, 784),
        # Nemotron-H-8B: 128 heads × 64, state 128, 8 groups, conv 4; bf16 states
        ("nemotron-h-8b", mamba2_state_bytes(1, 8192, 8, 128, 64, 128, 4, 2, 2), 8, 128, 528),
        ("nemotron-h-8b fp32 ssm", mamba2_state_bytes(1, 8192, 8, 128, 64, 128, 4, 2, 4), 8, 128, 1040),
        ("tiny", 100, 2, 16, 16),
    ],
)
def test_hybrid_block_size_matches_vllms_page_arithmetic(name, state, kv_heads, head_size, expected):
    token = 2 * kv_heads * head_size * 2
    assert vllm_hybrid_block_size(state, token) == oracle_block_size(state, kv_heads, head_size, 2) == expected


def test_hybrid_block_size_without_a_state_keeps_the_kernel_block():
    assert vllm_hybrid_block_size(0, 4096) == 16
    assert vllm_hybrid_block_size(4096 * 32 + 1, 4096, kernel_block=32) == 2 * 32
    with pytest.raises(KvprofError):
        vllm_hybrid_block_size(100, 0)


# --- the sglang and boundaries rules -----------------------------------------------------------------------------


def test_sglang_keeps_one_state_per_prefill_step_and_the_last_decode_track():
    rule = checkpoint_rule("sglang")  # track interval 256, cache chunk 64
    assert rule.kept(1000, 1001, 0) == (960,)  # prefill: 1000 // 64 * 64
    assert rule.kept(1000, 1300, 0) == (960, 1280)  # decode reached 1280 (and no other multiple of 256)
    assert rule.kept(1000, 1600, 0) == (960, 1536)  # 1280 was tracked, then overwritten by 1536
    assert rule.kept(1000, 1001, 300) == (940,)  # from a hit at 300: 300 + 640
    assert rule.kept(40, 41, 0) == ()  # a prefill step under 64 ids tracks nothing
    assert rule.kept(1000, 1001, 0, matched=700) == (640,)  # the branch point, not the prefill's end
    assert rule.kept(1000, 1001, 300, matched=700) == (940,)  # 640 - 300 is off the step's 64-id grid
    assert checkpoint_rule("sglang", budget=400).kept(1000, 1001, 0) == (384, 784, 992)


def test_sglang_serves_the_deepest_state_on_the_path_and_keeps_branch_points():
    rng = random.Random(4)
    rule = checkpoint_rule("sglang", interval=128)
    base = fresh(rng, 1000)
    requests = [
        (base + fresh(rng, 300), 1000),  # keeps 960 (prefill) and 1280 (decode, at 1299 computed)
        (base + fresh(rng, 5), 1000),  # a repeat: matched 999, deepest state ≤ 999 is 960
        (base[:700] + fresh(rng, 305), 1000),  # leaves at 700: no state below it; keeps the branch point 640
        (base[:700] + fresh(rng, 305), 1000),  # now served from 640
        (base[:100] + fresh(rng, 30), 130),  # no state under 100
    ]
    assert module_hits(rule, requests) == [0, 960, 0, 640, 0]


def test_boundaries_keep_every_message_boundary_and_the_calls_end():
    rule = checkpoint_rule("boundaries")
    assert rule.kept(100, 130, 0, boundaries={10, 60, 100, 130}) == (10, 60, 100, 129)
    assert rule.kept(100, 130, 60, boundaries={10, 60, 100, 130}) == (100, 129)
    assert rule.hit(95, 100, (10, 60, 100, 129)) == 60
    rng = random.Random(5)
    system, question = fresh(rng, 50), fresh(rng, 20)
    first = system + question
    requests = [
        EngineRequest(first + fresh(rng, 10), 70, boundaries=frozenset({50, 70, 80})),
        EngineRequest(system + fresh(rng, 25) + [1], 75, boundaries=frozenset({50, 75, 76})),
        EngineRequest(first + fresh(rng, 10), 70, boundaries=frozenset({50, 70, 80})),
    ]
    assert checkpointed_hits(requests, rule) == [0, 50, 50]  # the third's input ends at 70: capped at 69


def test_lru_capacity_evicts_the_least_recently_used_state():
    rng = random.Random(6)
    rule = checkpoint_rule("boundaries")
    a, b = fresh(rng, 40), fresh(rng, 40)
    requests = [EngineRequest(a + [1], 40), EngineRequest(b + [2], 40), EngineRequest(a + fresh(rng, 5), 44)]
    assert checkpointed_hits(requests, rule) == [0, 0, 40]
    assert checkpointed_hits(requests, rule, capacity=1) == [0, 0, 0]  # a's state at 40 evicted by b's
    cache = CheckpointedCache(rule, capacity=2)
    for request in requests:
        cache.serve(request)
    assert len(cache.states) == 2


def test_bad_rule_names_and_settings_are_refused_in_one_sentence():
    assert CHECKPOINT_RULES == ("vllm", "sglang", "boundaries")
    with pytest.raises(KvprofError, match=r"--checkpoints 'mamba' is not one of vllm, sglang, boundaries"):
        checkpoint_rule("mamba")
    with pytest.raises(KvprofError, match="hybrid block size"):
        checkpoint_rule("vllm")
    with pytest.raises(KvprofError, match="below vLLM's hybrid block size"):
        checkpoint_rule("vllm", 528, budget=100)
    with pytest.raises(KvprofError, match="--track-interval 0"):
        checkpoint_rule("sglang", interval=0)
    assert checkpoint_rule("boundaries", 528).interval == 0
    with pytest.raises(KvprofError, match="needs an interval"):
        CheckpointRule("vllm", 0)


# --- kvprof inspect on a tiny Qwen 3.5 world -------------------------------------------------------------------------

DEVICE = ("--device", "cpu", "--dtype", "float32")


def capture(world, out) -> str:
    from typer.testing import CliRunner

    from kvprof.cli import app

    done = CliRunner().invoke(
        app,
        [
            "capture", "--model", str(world.model), "--workflow", str(world.lora_workflow), "--tasks",
            str(world.tasks), "--limit", "2", "--out", str(out), *DEVICE,
        ],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    return str(out / "trace.jsonl")


@pytest.fixture(scope="module")
def hybrid_world(tmp_path_factory):
    from kvprof.model.tiny import build_tiny_world, hybrid_config

    world = build_tiny_world(tmp_path_factory.mktemp("qwen3_5"), configure=partial(hybrid_config, "qwen3_5_text"))
    return world, capture(world, tmp_path_factory.mktemp("capture"))


def test_inspect_prints_and_writes_checkpointed_reuse_on_a_hybrid(hybrid_world, run_cli, tmp_path):
    import json

    world, trace = hybrid_world
    code, out, err = run_cli("inspect", trace, "--model", world.model, "--out", tmp_path, *DEVICE)
    assert code == 0, err
    text = " ".join(out.split())
    result = json.loads((tmp_path / "inspect.json").read_text())
    checkpoints = result["checkpoints"]
    block = checkpoints["block_size"]
    assert block == vllm_hybrid_block_size(checkpoints["state_bytes"], checkpoints["token_bytes"])
    assert f"vLLM's hybrid block B = {block} ids" in text and "checkpointed prefix reuse on this hybrid" in text
    assert list(checkpoints["rules"]) == list(CHECKPOINT_RULES)
    assert checkpoints["rules"]["vllm"]["interval"] == block and checkpoints["prefill_chunk"] == 8192
    for label in (f"vllm (B = {block})", "sglang (every 256)", "boundaries (kvprof)", "attention-only model"):
        assert label in text
    total = result["total"]
    for name, rule in checkpoints["rules"].items():
        turns = [turn for traj in result["trajectories"].values() for turn in traj["turns"]]
        assert sum(turn["checkpoints"][name][0] for turn in turns) == rule["engine_own"]
        assert sum(turn["checkpoints"][name][1] for turn in turns) == rule["engine_shared"]
        assert rule["engine_own"] <= rule["engine_shared"] <= total["shared_prefix"]
        assert f"{rule['engine_shared']} ({rule['engine_shared'] / total['input_tokens']:.1%})" in text
    assert checkpoints["rules"]["boundaries"]["engine_shared"] > 0  # each call resumes from the last one's end

    from kvprof.results.inspect import InspectResult

    read = InspectResult.read(tmp_path / "inspect.json")
    assert read.checkpoints is not None and read.checkpoints.rules["vllm"].interval == block
    assert read.to_json() == json.loads((tmp_path / "inspect.json").read_text())  # written back unchanged
    code, out, err = run_cli(
        "inspect", trace, "--model", world.model, "--checkpoints", "sglang", "--track-interval", "32",
        "--prefill-chunk", "0", "--state-capacity", "2", "--out", tmp_path / "one", *DEVICE,
    )  # fmt: skip
    assert code == 0, err
    one = json.loads((tmp_path / "one" / "inspect.json").read_text())["checkpoints"]
    assert list(one["rules"]) == ["sglang"] and one["rules"]["sglang"]["interval"] == 32
    assert "whole-prompt prefills; at most 2 states" in " ".join(out.split())
    code, _, err = run_cli("inspect", trace, "--model", world.model, "--checkpoints", "mamba", *DEVICE)
    assert code == 2 and "--checkpoints 'mamba' is not one of vllm, sglang, boundaries" in err


def test_inspect_on_a_model_without_recurrent_layers_is_unchanged(tiny_world, lora_trace, run_cli, tmp_path):
    import json

    code, out, err = run_cli("inspect", lora_trace, "--model", tiny_world.model, "--out", tmp_path, *DEVICE)
    assert code == 0, err
    assert "checkpoint" not in out and "hybrid block" not in out
    result = json.loads((tmp_path / "inspect.json").read_text())
    assert "checkpoints" not in result
    assert all(
        "checkpoints" not in traj and "checkpoints" not in traj["turns"][0] for traj in result["trajectories"].values()
    )
    code, _, err = run_cli("inspect", lora_trace, "--model", tiny_world.model, "--checkpoints", "vllm", *DEVICE)
    assert code == 2 and "applies to hybrid models" in " ".join(err.split())
    code, _, err = run_cli("inspect", lora_trace, "--checkpoints", "vllm")
    assert code == 2 and "--checkpoints needs --model" in " ".join(err.split())
