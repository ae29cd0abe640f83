"""Metric definitions shared by every command (docs/metrics.md). Cache error: a policy's K or V against the dense
one on the same span; output fidelity: next-token distributions, teacher-forced on the trace's outputs.
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
    """Mean cosine of token vectors (..., L, D): over D, mean over the rest; equal vectors (zero too) count 1."""
    approx, dense = approx.double(), dense.double()
    cos = torch.nn.functional.cosine_similarity(approx, dense, dim=-1, eps=1e-12)
    return float(torch.where((approx == dense).all(dim=-1), 1.0, cos).mean())


def reused_from_others(producers: list[str], agent: str, reused: int) -> int:
    """Reuse, one definition for every policy: of the first `reused` timeline tokens served to `agent` from stored
    caches, those another agent processed first (`producers[i]`: first holder of token i). An agent's own tokens
    never count, whatever cache serves them."""
    return sum(producer != agent for producer in producers[:reused])


def kl_divergence(dense_logits: torch.Tensor, policy_logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(dense ‖ policy) in nats. Logits: (T, vocab) → (T,)."""
    dense_logp = torch.log_softmax(dense_logits.double(), dim=-1)
    policy_logp = torch.log_softmax(policy_logits.double(), dim=-1)
    return (dense_logp.exp() * (dense_logp - policy_logp)).sum(-1)


def top1_agreement(dense_logits: torch.Tensor, policy_logits: torch.Tensor) -> torch.Tensor:
    """Per-position 1.0 where both runs' argmax tokens agree. Logits: (T, vocab) → (T,)."""
    return (dense_logits.argmax(-1) == policy_logits.argmax(-1)).double()


# ----------------------------------------------------------------------------------------------- rank and similarity


def singular_values(matrix: torch.Tensor) -> torch.Tensor:
    """Singular values of a (M, N) matrix, or of each matrix of a (..., M, N) stack, in fp64, descending."""
    return torch.linalg.svdvals(matrix.double())


def entropy_effective_rank(sigma: torch.Tensor) -> float:
    """exp(H(p)) with p = σ/Σσ (Roy & Vetterli 2007): σ the singular values (k,) of one matrix; 0 for a zero matrix."""
    sigma = sigma.double().clamp_min(0)
    total = sigma.sum()
    if total == 0:
        return 0.0
    p = sigma[sigma > 0] / total
    return float(torch.exp(-(p * p.log()).sum()))


def energy_rank(sigma: torch.Tensor, fraction: float) -> int:
    """Smallest k with σ_1² + … + σ_k² ≥ fraction·Σσ²: σ the singular values (k,) of one matrix, descending."""
    energy = sigma.double() ** 2
    total = energy.sum()
    if total == 0:
        return 0
    cumulative = energy.cumsum(0) / total
    return int(torch.searchsorted(cumulative, torch.tensor(fraction, dtype=torch.float64) - 1e-12).item()) + 1


def energy_spectrum(sigma: torch.Tensor) -> torch.Tensor:
    """σ²/Σσ² (k,), the fraction of the matrix's energy in each singular direction (zeros for a zero matrix)."""
    energy = sigma.double() ** 2
    total = energy.sum()
    return energy / total if total > 0 else energy


def flat_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two same-shape tensors flattened to vectors, in fp64 (0 if either is zero)."""
    a64, b64 = a.double().flatten(), b.double().flatten()
    denominator = a64.norm() * b64.norm()
    return float(a64 @ b64 / denominator) if denominator > 0 else 0.0


def relative_norm(part: torch.Tensor, whole: torch.Tensor) -> float:
    """‖part‖_F / ‖whole‖_F in fp64 (e.g. ‖Δ‖/‖C‖); inf when only `whole` is zero, 0 when both are."""
    numerator, denominator = part.double().norm(), whole.double().norm()
    if denominator > 0:
        return float(numerator / denominator)
    return float("inf") if numerator > 0 else 0.0
