"""Metric definitions shared by every command (DESIGN.md, "Metrics"): one definition, used everywhere.

Cache error compares a policy's K or V with the dense (NonShared) one on the same span; output fidelity compares the
next-token distributions of the two runs, teacher-forced on the trace's outputs.
"""

from __future__ import annotations

import torch


def relative_frobenius(approx: torch.Tensor, dense: torch.Tensor) -> float:
    """‖approx − dense‖_F / ‖dense‖_F, in fp64 (0 when both are empty or identical)."""
    dense64 = dense.double()
    denominator = dense64.norm()
    if denominator == 0:
        return float((approx.double() - dense64).norm())
    return float((approx.double() - dense64).norm() / denominator)


def mean_token_cosine(approx: torch.Tensor, dense: torch.Tensor) -> float:
    """Mean cosine similarity of matching token vectors: inputs (..., L, D), cosine over D, mean over the rest."""
    cos = torch.nn.functional.cosine_similarity(approx.double(), dense.double(), dim=-1, eps=1e-12)
    return float(cos.mean())


def kl_divergence(dense_logits: torch.Tensor, policy_logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(dense ‖ policy) in nats. Logits: (T, vocab) → (T,)."""
    dense_logp = torch.log_softmax(dense_logits.double(), dim=-1)
    policy_logp = torch.log_softmax(policy_logits.double(), dim=-1)
    return (dense_logp.exp() * (dense_logp - policy_logp)).sum(-1)


def top1_agreement(dense_logits: torch.Tensor, policy_logits: torch.Tensor) -> torch.Tensor:
    """Per-position 1.0 where both runs' argmax tokens agree. Logits: (T, vocab) → (T,)."""
    return (dense_logits.argmax(-1) == policy_logits.argmax(-1)).double()
