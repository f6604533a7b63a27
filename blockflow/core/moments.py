"""The moments merge of ``(n, mean, M2)`` partials: Chan, Golub & LeVeque, "Updating formulae
and a pairwise algorithm for computing sample variances", STAN-CS-79-773 (1979).
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
    """Merge partial moments of k parts at once; parts with ``n_i = 0`` carry no weight.

    Parameters
    ----------
    n, mean, m2 : array-like
        Per part: count (int64), mean and sum of squared deviations from it (float64).
    total : callable
        Sums a per-part array over the parts that merge together (``a.sum(axis=0)``).

    Returns
    -------
    (n, mean, m2)
        Merged count (int64), mean (NaN where ``n == 0``) and M2, in ``total``'s shape.
    """
    has_values = n > 0
    weighted = _where(has_values, n * mean, 0.0)
    count = total(n)
    with np.errstate(invalid="ignore", divide="ignore"):
        merged_mean = _where(count > 0, total(weighted) / count, np.nan)
    dev = mean - merged_mean
    spread = _where(has_values, n * dev * dev, 0.0)
    return count, merged_mean, total(m2) + total(spread)
