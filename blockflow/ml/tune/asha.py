"""Successive halving's rungs: which trials to promote, and which promotions are certain.

:meth:`Rungs.promotable` is ASHA's rule (Li et al. 2020, Algorithm 2); :meth:`Rungs.certain`
is the subset synchronous successive halving makes too (a blockflow heuristic).
"""

from __future__ import annotations

import math

__all__ = ["Rungs", "rung_budgets"]


def rung_budgets(min_budget: float, max_budget: float, eta: int) -> list[float]:
    """Budget units of each rung: ``min_budget * eta**k``, the last capped at ``max_budget``
    (ValueError unless ``0 < min_budget <= max_budget``)."""
    if not 0 < min_budget <= max_budget:
        raise ValueError(f"blockflow: tune needs 0 < min_budget <= max_budget, got "
                         f"{min_budget} and {max_budget}.")
    budgets = [min_budget]
    # within a relative 1e-9 a budget is max_budget (0.7 * 3 is 2.0999999999999996, not 2.1)
    while budgets[-1] * eta < max_budget * (1 - 1e-9):
        budgets.append(budgets[-1] * eta)
    if budgets[-1] < max_budget * (1 - 1e-9):
        budgets.append(max_budget)
    return [int(b) if float(b).is_integer() else b for b in budgets]


class Rungs:
    """The scores of ``n_trials`` trials at each rung, and the promotions made and due.

    Parameters
    ----------
    n_trials : int
    budgets : list of float
        Budget units of each rung (:func:`rung_budgets`).
    eta : int
        Reduction factor: the top ``1/eta`` of a rung go on.
    mode : {"max", "min"}
        Whether a higher or a lower score is better.
    """

    def __init__(self, n_trials: int, budgets: list[float], eta: int, mode: str):
        self.n_trials, self.budgets, self.eta, self.mode = n_trials, budgets, eta, mode
        self.top = len(budgets) - 1
        self.scores: list[dict[int, float]] = [{} for _ in budgets]  # rung: trial -> score
        self.promoted: list[set[int]] = [set() for _ in range(n_trials)]  # rungs left
        self.failed: set[int] = set()  # trials whose task raised

    def key(self, score: float) -> float:
        """Sort key, best first; a NaN score (a diverged trial) ranks below every number."""
        if math.isnan(score):
            return math.inf
        return -score if self.mode == "max" else score

    def ranked(self, rung: int, trials=None) -> list[int]:
        """``trials`` (default: all scored at ``rung``) best first, ties to the lower number."""
        done = self.scores[rung]
        return sorted(done if trials is None else trials,
                      key=lambda t: (self.key(done[t]), t))

    def promotable(self) -> list[tuple[int, int]]:
        """ASHA's promotions not yet made, as ``(trial, next rung)``: the top ``1/eta`` of
        each rung's results so far, highest rung first, best first."""
        out = []
        for k in range(self.top - 1, -1, -1):
            n_top = len(self.scores[k]) // self.eta
            out += [(t, k + 1) for t in self.ranked(k)[:n_top] if k not in self.promoted[t]]
        return out

    def certain_sets(self) -> list[set[int]]:
        """``sets[k]``: the trials sure to be in synchronous successive halving's rung ``k``
        whatever the results still to come (``sets[0]``: all).

        A blockflow heuristic on SH's quota ``q[k+1] = max(q[k] // eta, 1)``."""
        quota = [self.n_trials]
        for _ in range(self.top):
            quota.append(max(quota[-1] // self.eta, 1))
        sets = [set(range(self.n_trials))]
        for k in range(self.top):
            scored = [t for t in sets[k] if t in self.scores[k]]
            failed = sum(1 for t in sets[k] if t not in self.scores[k] and t in self.failed)
            outstanding = quota[k] - failed - len(scored)
            room = quota[k + 1] - max(outstanding, 0)
            sets.append(set(self.ranked(k, scored)[:max(room, 0)]))
        return sets

    def certain(self) -> list[tuple[int, int]]:
        """The certain promotions not yet made, as ``(trial, next rung)``, highest rung
        first, best first."""
        sets = self.certain_sets()
        return [(t, k + 1) for k in range(self.top - 1, -1, -1)
                for t in self.ranked(k, sets[k + 1]) if k not in self.promoted[t]]

    def survivors(self, rung: int) -> list[int]:
        """Synchronous successive halving's pick once ``rung`` is complete: its best
        ``max(n // eta, 1)``."""
        return self.ranked(rung)[:max(len(self.scores[rung]) // self.eta, 1)]

    def best(self) -> int | None:
        """The best trial at the highest rung any trial completed; None before any result."""
        for k in range(self.top, -1, -1):
            if self.scores[k]:
                return self.ranked(k)[0]
        return None
