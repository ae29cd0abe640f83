"""Rank and similarity metrics (kvprof.replay.metrics) against independent numpy/scipy computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import scipy.stats
import torch

from kvprof.replay import metrics


def _numpy_ranks(matrix: np.ndarray) -> tuple[float, int, int]:
    sigma = scipy.linalg.svdvals(matrix)
    effective = float(np.exp(scipy.stats.entropy(sigma / sigma.sum())))
    cumulative = np.cumsum(sigma**2) / np.sum(sigma**2)
    return effective, int(np.argmax(cumulative >= 0.90)) + 1, int(np.argmax(cumulative >= 0.99)) + 1


@pytest.mark.parametrize("shape, decay", [((50, 32), 0.0), ((200, 64), 0.05), ((17, 128), 0.3), ((64, 64), 1.0)])
def test_ranks_match_numpy_scipy(shape, decay):
    rng = np.random.default_rng(sum(shape))
    matrix = rng.standard_normal(shape) * np.exp(-decay * np.arange(shape[1]))[None, :]
    sigma = metrics.singular_values(torch.from_numpy(matrix))
    effective, e90, e99 = _numpy_ranks(matrix)
    assert metrics.entropy_effective_rank(sigma) == pytest.approx(effective, abs=1e-6)
    assert metrics.energy_rank(sigma, 0.90) == e90
    assert metrics.energy_rank(sigma, 0.99) == e99
    np.testing.assert_allclose(
        metrics.energy_spectrum(sigma).numpy(), sigma.numpy() ** 2 / np.sum(sigma.numpy() ** 2), atol=1e-12
    )


@pytest.mark.parametrize("rank", [1, 5, 12])
def test_planted_rank_plus_noise_is_reported_as_that_rank(rank):
    generator = torch.Generator().manual_seed(rank)
    left, _ = torch.linalg.qr(torch.randn(300, rank, generator=generator, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(96, rank, generator=generator, dtype=torch.float64))
    planted = left @ right.T * 10.0  # rank `rank`, all singular values 10
    noisy = planted + 1e-3 * torch.randn(300, 96, generator=generator, dtype=torch.float64)
    sigma = metrics.singular_values(noisy)
    assert metrics.energy_rank(sigma, 0.99) == rank
    assert metrics.energy_rank(sigma, 0.90) == math.ceil(0.9 * rank)  # equal σ: 90 % needs ⌈0.9·k⌉ of them
    # the noise is really there: the full spectrum has 96 non-zero values
    assert int((sigma > 1e-4).sum()) == 96
    # the entropy rank weighs σ, not σ², so the 96 − k noise directions lift it above k; without noise it is k
    assert metrics.entropy_effective_rank(sigma) > rank
    assert metrics.entropy_effective_rank(metrics.singular_values(planted)) == pytest.approx(rank, abs=1e-6)


def test_zero_matrix_and_flat_spectrum():
    assert metrics.entropy_effective_rank(metrics.singular_values(torch.zeros(8, 4))) == 0.0
    assert metrics.energy_rank(metrics.singular_values(torch.zeros(8, 4)), 0.99) == 0
    assert metrics.entropy_effective_rank(torch.ones(7)) == pytest.approx(7.0, abs=1e-12)


def test_cosines_and_relative_norm_match_numpy():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((2, 30, 16)), rng.standard_normal((2, 30, 16))
    flat = float(a.ravel() @ b.ravel() / np.linalg.norm(a) / np.linalg.norm(b))
    assert metrics.flat_cosine(torch.from_numpy(a), torch.from_numpy(b)) == pytest.approx(flat, abs=1e-12)
    token = np.mean(np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1))
    assert metrics.mean_token_cosine(torch.from_numpy(a), torch.from_numpy(b)) == pytest.approx(token, abs=1e-12)
    assert metrics.relative_norm(torch.from_numpy(a), torch.from_numpy(b)) == pytest.approx(
        np.linalg.norm(a) / np.linalg.norm(b), abs=1e-12
    )
    assert metrics.flat_cosine(torch.zeros(3), torch.ones(3)) == 0.0
    assert metrics.relative_norm(torch.zeros(3), torch.zeros(3)) == 0.0
    zero_row = torch.tensor([[0.0, 0.0], [1.0, 2.0]])  # equal rows count 1, a zero one included; zero vs not: 0
    assert metrics.mean_token_cosine(zero_row, zero_row.clone()) == 1.0
    assert metrics.mean_token_cosine(zero_row, torch.tensor([[1.0, 0.0], [1.0, 2.0]])) == 0.5
    assert metrics.relative_norm(torch.ones(3), torch.zeros(3)) == float("inf")
