"""Memory as the papers report it: weights' bytes, stored caches in KV blocks of a page size (vLLM's), the allocator's
peak per turn (`paper_memory`) and per policy (`allocator_peak`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from kvprof.model.recurrent import RECURRENT_STATES
from kvprof.policies import SharingPolicy, TurnResult
from kvprof.results.replay import TurnRecord, measured

PAGE_SIZE = 16  # tokens per KV block: vLLM's default block size, as PReCache's serving runs read memory
# stored structures that are not token-indexed caches, by name or name prefix: counted at their exact bytes
UNPAGED = ("anchor pool", RECURRENT_STATES)


class PaperMemory(NamedTuple):
    """One turn's memory as the papers report it (`paper_memory`): bytes in KV blocks, full K/V blocks, allocator
    peak with the weights."""

    kv_block_bytes: int
    kv_blocks: float
    allocator_peak_bytes: int


def paged_bytes(tensors: dict[str, list], page_size: int) -> int:
    """Bytes of `tensors` (a policy's `live_tensors`) in KV blocks of `page_size` tokens, as vLLM holds them: the
    token axis (−2: K/V (B, H_kv, T, D), LR caches (1, T, r), hidden states (1, T, d_model)) rounded up to whole
    blocks; `UNPAGED` structures at their exact bytes."""
    total = 0
    for name, group in tensors.items():
        for t in group:
            exact = t.numel() * t.element_size()
            tokens = t.shape[-2] if t.dim() >= 2 and not name.startswith(UNPAGED) else 0
            total += exact * math.ceil(tokens / page_size) * page_size // tokens if tokens else exact
    return total


def paper_memory(policy: SharingPolicy, result: TurnResult, weights: int, page_size: int) -> PaperMemory:
    """One turn's memory as the papers report it: `kv_block_bytes` (stored caches in `page_size` blocks,
    `paged_bytes`), `kv_blocks` (those bytes in full K/V blocks: vLLM's count for full-dimension caches, a fraction
    for rank-r ones), `allocator_peak_bytes` (CUDA: weights + the peak above the turn's start + stored bytes, as if
    the policy ran alone; else the analytic weights + working peak)."""
    paged = paged_bytes(policy.stored_tensors(), page_size)
    peak = result.cuda_peak_bytes if result.cuda_peak_bytes is not None else result.working_peak_bytes
    return PaperMemory(paged, paged / (page_size * policy.runtime.kv_bytes_per_token), weights + peak)


def allocator_peak(turns: list[TurnRecord]) -> tuple[float | None, str | None]:
    """A policy's allocator peak with the weights, and its source: with trajectory timing on CUDA,
    `max_memory_allocated` over each timed run, the policy alone (PReCache's reading); else per turn
    (`paper_memory`)."""
    if not turns or turns[0].allocator_peak_bytes is None:
        return None, None
    alone = [b for t in turns if t.runs for b in t.runs.cuda_allocated_bytes if b is not None]
    if alone:
        return max(alone), "cuda: max_memory_allocated over each timed trajectory run, the policy alone"
    source = (
        "cuda: weights + the allocator's peak above each turn's start + the policy's stored bytes"
        if turns[0].cuda_peak_bytes is not None
        else "analytic (no CUDA): weights + the peak of stored + working bytes"
    )
    return max(measured(t.allocator_peak_bytes) for t in turns), source
