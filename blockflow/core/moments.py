"""The moments merge: Chan, Golub & LeVeque's pairwise update of ``(n, mean, M2)`` partials.

One implementation serves the grouped dataframe reductions (:mod:`blockflow.aggregations`,
per-group rows of pandas or cuDF frames) and the array statistics
(:mod:`blockflow.workloads.array_stats`, NumPy blocks): both hand it NumPy-style arrays (or
Series) of per-part counts, means and M2, and a function that sums a per-part array over the
parts that merge together.

Method: T. F. Chan, G. H. Golub, R. J. LeVeque, "Updating formulae and a pairwise algorithm
for computing sample variances", Stanford CS report STAN-CS-79-773 (1979). Each partial holds
``(n, mean, M2)`` with ``M2`` the sum of squared deviations from the partial's own mean, so no
step subtracts two large, nearly equal sums (the failure of ``E[x^2] - E[x]^2``). The same
scheme underlies dask's ``moment_chunk`` / ``moment_combine`` / ``moment_agg``.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["merge_moments"]


def _where(cond, x, other):
    """``x`` where ``cond``, else ``other``, keeping a pandas / cuDF Series' index."""
    if hasattr(x, "where"):  # pandas or cuDF Series
        return x.where(cond, other)
    return np.where(cond, x, other)


def merge_moments(n: Any, mean: Any, m2: Any, total: Callable[[Any], Any]
                  ) -> tuple[Any, Any, Any]:
    """Merge partial moments (Chan, Golub & LeVeque 1979, applied to k parts at once).

    For the parts ``i`` that merge into one result: ``n = sum n_i``,
    ``mean = sum n_i mean_i / n`` and ``M2 = sum M2_i + sum n_i (mean_i - mean)^2``; for two
    parts this is Chan et al.'s ``M2 = M2_a + M2_b + delta^2 n_a n_b / n``. Parts with
    ``n_i = 0`` carry no weight (their mean may be NaN).

    Parameters
    ----------
    n : array-like of int
        Count of each part (values that went into its mean; int64).
    mean : array-like of float
        Mean of each part (float64), broadcastable with ``n``.
    m2 : array-like of float
        Sum of squared deviations from the part's own mean (float64), like ``mean``.
    total : callable
        Sums a per-part array over the parts that merge together, returning something that
        broadcasts against the per-part arrays: ``lambda a: a.sum(axis=0)`` for parts stacked
        along axis 0, or a grouped ``transform("sum")`` for rows of a frame where each group
        of rows merges into one.

    Returns
    -------
    (n, mean, m2)
        The merged count (int64), mean (float64; NaN where ``n == 0``) and M2 (float64), in
        ``total``'s shape.
    """
    has_values = n > 0
    weighted = _where(has_values, n * mean, 0.0)
    count = total(n)
    with np.errstate(invalid="ignore", divide="ignore"):
        merged_mean = _where(count > 0, total(weighted) / count, np.nan)
    dev = mean - merged_mean
    spread = _where(has_values, n * dev * dev, 0.0)
    return count, merged_mean, total(m2) + total(spread)
