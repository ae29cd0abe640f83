"""The papers kvprof's policies come from, and the settings their published figures were measured in.

Each policy module cites its paper with these constants and lists its figures as `Published` entries, so the
reports can print a published figure beside kvprof's measurement of the same quantity.
"""

from __future__ import annotations

LRAGENT = "LRAgent (Jeon, Ha, Kim, 2026; arXiv:2602.01053)"
LRAGENT_SETTING = (
    "LLaMA-3.1-8B-Instruct and Ministral-8B-Instruct, HotpotQA and ScienceQA multi-hop trajectories "
    "of plan / action / reflect LoRA agents"
)

PRECACHE = (
    "PReCache: Efficient KV Cache Sharing for Multi-LoRA Agents via Low-Rank Precomputation and Neutral Reconstruction"
)
PRECACHE_SETTING = (
    "LLaMA-3.1-8B-Instruct and Ministral-8B-Instruct, AutoAct plan / act / reflect agents on HotpotQA "
    "and ScienceQA, LoRA r=8 on q and v, trajectories of 1.9k–66.4k tokens, single stream on an A6000"
)

CACHEBLEND = (
    "CacheBlend: Fast Large Language Model Serving for RAG with Cached Knowledge Fusion "
    "(Yao et al., EuroSys 2025; arXiv:2405.16444)"
)
CACHEBLEND_SETTING = "RAG with precomputed chunk caches; Mistral-7B, Yi-34B, Llama-70B"

DROIDSPEAK = (
    "DroidSpeak: KV Cache Sharing for Cross-LLM Communication and Multi-LLM Serving (Liu et al., 2024; "
    "arXiv:2411.02820)"
)

RELAYCACHING = "RelayCaching (reuse of earlier agents' decode-phase KV with sparse rectification)"

KVCMAS_PAPER = "KVCMAS (low-rank anchor pools and chain correction for KV sharing among prompt-role agents)"
KVCMAS_SETTING = (
    "Llama-3.1-8B-Instruct on MMLU and GSM8K, Qwen2.5-Coder-7B-Instruct on HumanEval, three task agents and one "
    "reflect agent; serving on vLLM with a 4-agent schedule on an A100 80GB"
)

KVCOMM = (
    "KVCOMM: Online Cross-context KV-cache Communication for Efficient LLM-based Multi-agent Systems "
    "(Ye et al., NeurIPS 2025; arXiv:2510.12872)"
)
LLAMA_8B_KV_BYTES = 2 * 32 * 8 * 128 * 2  # Llama-3.1-8B's K and V per token: 32 layers, 8 KV heads of 128, bfloat16
KVCOMM_SETTING = "retrieval-augmented generation, math reasoning and collaborative coding multi-agent workloads"

GRAPHFLOW = "GraphFlow (delta correction learned from observed edges of the workflow graph; no public code)"

# The thresholds the rank analysis reads the papers' rank and similarity claims with (`kvprof.rank.analysis`).
LRAGENT_BASE_COSINE = 0.97  # LRAgent: base caches of different adapters nearly identical (cosine)
LRAGENT_ORTHOGONAL = 0.1  # LRAgent: adapter outputs of different agents near orthogonal (|cosine|)
KVCMAS_DELTA_RANK = 32.0  # KVCMAS: the cross-agent delta's effective rank stays below this
