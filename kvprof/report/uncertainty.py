"""Bootstrap percentile intervals over tasks (Efron & Tibshirani, "An Introduction to the Bootstrap", 1993):
statistics are ratios of per-task sums, `RESAMPLES` seeded resamples. Approximate: too narrow with few tasks, blind
to timing noise within a task (docs/commands/report.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95
SEED = 0


@dataclass(frozen=True)
class Interval:
    """A statistic over `n` tasks, with its bootstrap interval [low, high] (equal to the value when n < 2)."""

    value: float
    low: float
    high: float
    n: int

    def overlaps(self, other: Interval) -> bool:
        return self.low <= other.high and other.low <= self.high

    def text(self, fmt: str = ".2f", unit: str = "") -> str:
        """`value [low, high]unit`, e.g. `1.84 [1.62, 2.05]×`."""
        return f"{self.value:{fmt}}{unit} [{self.low:{fmt}}, {self.high:{fmt}}]"


def bootstrap(per_task: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray]) -> Interval:
    """Interval of `statistic(column sums)` over tasks resampled with replacement. per_task: (n_tasks, k);
    statistic: (..., k) → (...), vectorised."""
    per_task = np.asarray(per_task, dtype=float)
    n = per_task.shape[0]
    value = float(statistic(per_task.sum(axis=0)))
    if n < 2:
        return Interval(value, value, value, n)
    rng = np.random.default_rng(SEED)
    sums = per_task[rng.integers(0, n, size=(RESAMPLES, n))].sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        values = statistic(sums)
    values = values[np.isfinite(values)]
    tail = (1 - LEVEL) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail]) if len(values) else (value, value)
    return Interval(value, float(low), float(high), n)


def ratio_of_sums(per_task: np.ndarray) -> Interval:
    """Σ column 0 ÷ Σ column 1 over tasks (e.g. dense ÷ policy TTFT: a speed-up), with its interval."""
    return bootstrap(per_task, lambda sums: sums[..., 0] / sums[..., 1])


def proportion(successes: int, trials: int) -> Interval:
    """successes ÷ trials (accuracy over tasks) with its interval (resampling needs only the success count)."""
    if trials == 0:
        raise ValueError("a proportion needs at least one trial")
    outcomes = np.array([[1.0]] * successes + [[0.0]] * (trials - successes))
    return bootstrap(outcomes, lambda sums: sums[..., 0] / trials)


def paired_difference(pairs: np.ndarray) -> Interval:
    """Mean of column 0 − column 1 over tasks (e.g. the dense run's exact match − a policy's: an accuracy drop),
    with its interval; pairs: (n_tasks, 2), resampled together so that a task both runs get right or wrong adds no
    uncertainty."""
    pairs = np.asarray(pairs, dtype=float)
    n = max(len(pairs), 1)
    return bootstrap(pairs, lambda sums: (sums[..., 0] - sums[..., 1]) / n)
