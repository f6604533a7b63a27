"""Per-worker speed learned from observed task durations (a blockflow heuristic).

A worker's speed is how fast it runs tasks of a group compared with the group's typical
duration: each finished task contributes ``log(median_g) - log(duration)``, where
``median_g`` is the median of the group's recent durations *normalised by the speed of the
worker that ran them* (so a slow worker does not drag the reference down). The estimate is
an exponentially weighted mean in log space (robust to the log-normal spread of real block
durations), starting from a prior speed of 1 that fades after a few observations.

Recording an observation is O(1) (it runs in the scheduler's transition hook); the work is
done once per control-loop tick in :meth:`SpeedModel.update`.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median

__all__ = ["SpeedModel"]


class SpeedModel:
    """Learned relative speeds of workers.

    Parameters
    ----------
    window : int, default 64
        Recent normalised durations kept per task group for its median.
    alpha : float, default 0.15
        Smoothing weight (0-1) of a new observation once the prior has faded.
    prior_weight : float, default 1.0
        Weight, in observations, of the prior speed 1.0 for a new worker.
    max_pending : int, default 100_000
        Bound on observations buffered between ticks (oldest dropped).
    """

    def __init__(self, window: int = 64, alpha: float = 0.15, prior_weight: float = 1.0,
                 max_pending: int = 100_000):
        self.window = window
        self.alpha = alpha
        self.prior_weight = prior_weight
        self.pending: deque[tuple[str, str, float]] = deque(maxlen=max_pending)
        self.log_speed: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.groups: dict[str, deque[float]] = {}

    def observe(self, worker: str, group: str, duration: float) -> None:
        """Record that ``worker`` ran a task of ``group`` in ``duration`` seconds. O(1)."""
        if duration > 0 and math.isfinite(duration):
            self.pending.append((worker, group, duration))

    def update(self) -> int:
        """Fold the buffered observations into the speed estimates; returns how many."""
        n = len(self.pending)
        medians: dict[str, float] = {}
        while self.pending:
            worker, group, duration = self.pending.popleft()
            ls = self.log_speed.get(worker, 0.0)
            window = self.groups.get(group)
            if window is None:
                window = self.groups[group] = deque(maxlen=self.window)
            log_d = math.log(duration)
            window.append(log_d + ls)  # normalised: what the task would take at speed 1
            if group not in medians:
                medians[group] = median(window)
            k = self.count.get(worker, 0)
            a = max(self.alpha, 1.0 / (k + 1 + self.prior_weight))
            self.log_speed[worker] = ls + a * ((medians[group] - log_d) - ls)
            self.count[worker] = k + 1
        return n

    def speed(self, worker: str) -> float:
        """Relative speed of ``worker`` (1.0 = the typical worker; prior 1.0 when unseen)."""
        return math.exp(self.log_speed.get(worker, 0.0))

    def observations(self, worker: str) -> int:
        """Number of tasks seen from ``worker``."""
        return self.count.get(worker, 0)

    def forget(self, worker: str) -> None:
        """Drop everything known about ``worker`` (it left the cluster)."""
        self.log_speed.pop(worker, None)
        self.count.pop(worker, None)
        self.pending = deque((o for o in self.pending if o[0] != worker),
                             maxlen=self.pending.maxlen)
