"""Per-worker speed learned from observed task durations, with a confidence.

A blockflow heuristic from robust and shrinkage estimation (guide: :doc:`/guide/scheduling`,
"Learned speeds"). Per (worker, group): cold starts (``warmup``) dropped, location the
median of the last ``window`` log durations, a level shift (change-point rule, 1.4826 x MAD)
or a recovery to the others' level drops older ones. Evidence is the group reference
(median of medians) minus the worker's median, variance ``(1.2533 s)^2 / n`` with ``s``
shrunk towards the pooled spread (Smyth 2004) and aged by ``group_half_life``; the raw log
speed is the inverse-variance mean, clipped to ``±log(max_ratio)``. Confidence is
``precision / (precision + prior precision) x n / (n + prior_strength)`` and the speed
``exp(confidence x raw)`` (James-Stein-style), capped at ``max_optimism`` times the best
confident worker. :meth:`SpeedModel.heterogeneous` is a two-sided test with Student-t
widening. :meth:`SpeedModel.observe` is O(1); :meth:`SpeedModel.update` does the work.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from statistics import median

__all__ = ["SpeedModel"]


class SpeedModel:
    """Learned relative speeds of workers, each with a confidence (method: the module doc).

    Parameters
    ----------
    window, warmup : int, default 32 and 1
        Recent durations kept, and first ones dropped as cold starts, per (worker, group).
    prior_strength, prior_sd : float, default 1.0 and 0.5
        Weight in samples of the prior speed 1.0, and the sd of the prior log speed.
    min_spread, prior_spread, prior_dof : float, default 0.05, 0.2 and 2.0
        Smallest spread of log durations; prior spread and its degrees of freedom.
    change_run, change_ratio, change_sds : default 2, 2.0 and 3.0
        A level shift: the last ``change_run`` durations all ``change_ratio`` times and
        ``change_sds`` robust sds off the earlier median.
    min_duration : float, default 0.005
        Shorter durations, seconds, are ignored.
    max_ratio, max_optimism : float, default 64.0 and 1.5
        Largest speed ratio to a group's reference; to the best well-observed worker.
    group_half_life : float, default 16.0
        Durations per observed worker after which an unseen group's evidence weighs half.
    recover_ratio : float, default 1.25
        Within it of the others' level a worker has recovered; beyond it a task is slow.
    max_groups, max_pending : int, default 256 and 100_000
        Task groups remembered, observations buffered between ticks.
    cold_allowance : float, default 2.0
        A cold start of ``d`` seconds counts in :meth:`recent_speed` as ``d / cold_allowance``.
    """

    def __init__(self, window: int = 32, warmup: int = 1, prior_strength: float = 1.0,
                 prior_sd: float = 0.5, min_spread: float = 0.05, prior_spread: float = 0.2,
                 prior_dof: float = 2.0, change_run: int = 2, change_ratio: float = 2.0,
                 change_sds: float = 3.0,
                 max_ratio: float = 64.0, min_duration: float = 0.005,
                 max_optimism: float = 1.5, group_half_life: float = 16.0,
                 recover_ratio: float = 1.25, max_groups: int = 256,
                 max_pending: int = 100_000, cold_allowance: float = 2.0):
        self.window = window
        self.warmup = warmup
        self.prior_strength = prior_strength
        self.prior_sd = prior_sd
        self.min_spread = min_spread
        self.prior_spread = prior_spread
        self.prior_dof = prior_dof
        self.change_run = change_run
        self.change_ratio = change_ratio
        self.change_sds = change_sds
        self.min_duration = min_duration
        self.max_log_ratio = math.log(max_ratio)
        self.max_optimism = max_optimism
        self.recover_log = math.log(recover_ratio)
        # worker -> seconds of its current streak of slow tasks: see slow_for
        self.streak: dict[str, float] = {}
        self.since: dict[str, float] = {}  # worker -> when it was last reset (epoch seconds)
        self.max_groups = max_groups
        self.cold_allowance = cold_allowance
        self.group_half_life = group_half_life
        self.folded = 0  # durations folded in so far (all groups), the clock of group ages
        self.last_seen: dict[str, int] = {}  # group -> value of ``folded`` at its last one
        self.pending: deque[tuple[str, str, float, float | None]] = deque(maxlen=max_pending)
        # group -> worker -> recent log durations
        self.groups: OrderedDict[str, dict[str, deque[float]]] = OrderedDict()
        # group -> worker -> log seconds of its cold start (until a warm task is seen)
        self.cold: dict[str, dict[str, float]] = {}
        self.seen: dict[tuple[str, str], int] = {}  # (worker, group) -> durations seen
        self.count: dict[str, int] = {}  # worker -> durations seen (all)
        self.log_speed: dict[str, float] = {}
        self.conf: dict[str, float] = {}
        self.var: dict[str, float] = {}  # posterior variance of the log speed
        self.raw: dict[str, float] = {}  # log speed before shrinkage
        self.dof: dict[str, int] = {}  # degrees of freedom of the spreads behind it
        self.comparable: dict[str, int] = {}
        self.last: dict[str, tuple[str, float]] = {}  # worker -> (group, log duration), warm
        self.reference: dict[str, float] = {}  # group -> median of its workers' medians
        self.sizes: dict[str, deque[float]] = {}  # group -> sizes of its last tasks

    def observe(self, worker: str, group: str, duration: float, work: float = 1.0,
                size: float | None = None, start: float | None = None) -> None:
        """Record that ``worker`` ran a task of ``group`` in ``duration`` seconds. O(1).

        ``work`` (> 0): the task's size in units its group shares, so the model compares seconds
        per unit. ``size`` (declared work, else input bytes; None: unknown) feeds
        :meth:`size_factor`. ``start`` (epoch seconds): a task started before the worker was
        last :meth:`reset` is no evidence of what it does now, and is ignored.
        """
        if start is not None and start < self.since.get(worker, -math.inf):
            return
        if size is not None and size > 0 and math.isfinite(size):
            sizes = self.sizes.get(group)
            if sizes is None:
                sizes = self.sizes[group] = deque(maxlen=self.window)
                while len(self.sizes) > self.max_groups:
                    self.sizes.pop(next(iter(self.sizes)))
            sizes.append(float(size))
        if isinstance(duration, (int, float)) and math.isfinite(duration) \
                and duration >= self.min_duration and work > 0:
            self.pending.append((worker, group, float(duration) / work, size))

    def size_factor(self, group: str, size: float | None) -> float:
        """``size`` over the median size of the group's last ``window`` tasks, at least 1; 1.0 when
        either is unknown. A blockflow heuristic.
        """
        sizes = self.sizes.get(group)
        if size is None or not sizes or not size > 0:
            return 1.0
        return max(1.0, float(size) / median(sizes))

    def update(self) -> int:
        """Fold the buffered observations in and re-estimate; returns how many were folded."""
        n = len(self.pending)
        while self.pending:
            worker, group, duration, size = self.pending.popleft()
            # the latest task's duration as for a task of the group's typical size (one
            # 8x the typical block is no sign of a slowed worker)
            typical = duration / self.size_factor(group, size)
            self.count[worker] = self.count.get(worker, 0) + 1
            self.folded += 1
            self.last_seen[group] = self.folded
            k = self.seen.get((worker, group), 0)
            self.seen[(worker, group)] = k + 1
            if k < self.warmup:
                # a cold start: not the worker's speed, but until a warm task replaces it,
                # the evidence recent_speed gives, allowing it cold_allowance times a warm
                # task's duration (a device slow from the start is otherwise not known slow
                # until its second task of the group ends)
                self.last[worker] = (group, math.log(typical / self.cold_allowance))
                if group in self.cold or len(self.cold) < self.max_groups:
                    self.cold.setdefault(group, {})[worker] = math.log(typical)
                continue
            per_worker = self.groups.get(group)
            if per_worker is None:
                per_worker = self.groups[group] = {}
                while len(self.groups) > self.max_groups:
                    old, _ = self.groups.popitem(last=False)
                    self.last_seen.pop(old, None)
                    for w in list(self.count):
                        self.seen.pop((w, old), None)
            else:
                self.groups.move_to_end(group)
            window = per_worker.get(worker)
            if window is None:
                window = per_worker[worker] = deque(maxlen=self.window)
            window.append(math.log(duration))
            self.last[worker] = (group, math.log(typical))
            self._track_streak(worker, group, typical)
            if self._changed(window) or self._recovered(worker, per_worker, window):
                # the worker changed speed (throttled, a new tenant, freed): judge it on
                # its recent durations only
                per_worker[worker] = deque(list(window)[-self.change_run:],
                                           maxlen=self.window)
        if n:
            self._estimate()
        return n

    def _changed(self, window: deque) -> bool:
        """Whether the last ``change_run`` durations are a level shift (change-point rule)."""
        k = self.change_run
        if len(window) < 2 * k:
            return False
        values = list(window)
        earlier, recent = values[:-k], values[-k:]
        before = median(earlier)
        # robust sd of the earlier log durations (MAD x 1.4826), at least the timing noise
        sd = max(1.4826 * median(abs(x - before) for x in earlier), self.min_spread)
        step = max(math.log(self.change_ratio), self.change_sds * sd)
        return all(x - before > step for x in recent) or all(before - x > step for x in recent)

    def _track_streak(self, worker: str, group: str, duration: float) -> None:
        """Extend or end the worker's streak of tasks slower than ``recover_ratio`` (O(1))."""
        ref = self.reference.get(group)
        if ref is None:
            return
        gap = math.log(duration) - ref  # > 0: slower than the reference
        if gap > self.recover_log:
            self.streak[worker] = self.streak.get(worker, 0.0) + duration
        else:
            self.streak[worker] = 0.0

    def _recovered(self, worker: str, per_worker: dict, window: deque) -> bool:
        """Whether the recent durations are back at the others' level, the earlier ones off it."""
        k = self.change_run
        if len(window) <= k:
            return False
        values = list(window)
        before, recent = values[:-k], values[-k:]
        earlier = median(before)
        ref = self.reference.get(self.last[worker][0])
        if ref is None or abs(earlier - ref) <= 2 * self.recover_log:
            return False  # (the reference includes this worker: a cheap first look)
        others = [median(d) for w, d in per_worker.items() if w != worker and d]
        if not others:
            return False
        level = median(others)
        # as for a change of speed: beyond the noise of the earlier durations too (two
        # draws of a noisy group near the others' level are no recovery)
        sd = max(1.4826 * median(abs(x - earlier) for x in before), self.min_spread)
        return abs(earlier - level) > max(2 * self.recover_log, self.change_sds * sd) \
            and all(abs(x - level) <= self.recover_log for x in recent)

    def slow_for(self, worker: str) -> float | None:
        """Seconds ``worker`` is expected to stay slow: its current slow streak's length; None when
        it is not slow now. A blockflow heuristic (Lindy-style prior).
        """
        streak = self.streak.get(worker, 0.0)
        return streak if streak > 0.0 else None

    def _estimate(self) -> None:
        self.dof = {}
        self.reference = {}
        num: dict[str, float] = {}
        den: dict[str, float] = {}
        count: dict[str, int] = {}
        comparable = []  # (per_worker, medians, ss, dof, weight) of groups two workers ran
        ss_total, dof_total = 0.0, 0
        half_life = self.group_half_life * max(len(self.count), 1)
        for group, per_worker in self.groups.items():
            loc = {w: median(d) for w, d in per_worker.items() if d}
            dof = sum(len(per_worker[w]) for w in loc) - len(loc)
            if len(loc) < 2 or dof < 1:
                continue
            self.reference[group] = median(loc.values())
            ss = 0.0
            for w in loc:
                d = per_worker[w]
                mean = sum(d) / len(d)
                ss += sum((x - mean) ** 2 for x in d)
            ss_total += ss
            dof_total += dof
            age = self.folded - self.last_seen.get(group, self.folded)
            comparable.append((per_worker, loc, ss, dof, 0.5 ** (age / half_life)))
        # Within-worker spread of log durations: each group's own, shrunk towards the spread
        # pooled over groups (itself shrunk towards prior_spread), as in empirical-Bayes
        # variance moderation (Smyth 2004): a group of many tasks speaks for itself, two or
        # three similar durations never pass for a precise measurement, and a noisy group
        # (tiny tasks, contention) weighs little.
        pooled = (ss_total + self.prior_dof * self.prior_spread ** 2) / (
            dof_total + self.prior_dof)
        for per_worker, loc, ss, dof, weight in comparable:
            spread = max(math.sqrt((ss + self.prior_dof * pooled) / (dof + self.prior_dof)),
                         self.min_spread)
            ref = median(loc.values())
            for w, m in loc.items():
                n = len(per_worker[w])
                # variance of a median of n samples, widened as the group ages
                var = (1.2533 * spread) ** 2 / n / weight
                num[w] = num.get(w, 0.0) + (ref - m) / var
                den[w] = den.get(w, 0.0) + 1.0 / var
                count[w] = count.get(w, 0) + n * weight
                self.dof[w] = dof_total
        self.log_speed, self.conf, self.var, self.raw = {}, {}, {}, {}
        prior = 1.0 / self.prior_sd ** 2
        for w, d in den.items():
            raw = max(min(num[w] / d, self.max_log_ratio), -self.max_log_ratio)
            n = count[w]
            c = d / (d + prior) * n / (n + self.prior_strength)
            self.conf[w] = c
            self.raw[w] = raw
            self.log_speed[w] = c * raw
            self.var[w] = 1.0 / (d + prior)
            self.comparable[w] = round(n)
        known = [ls for w, ls in self.log_speed.items() if self.conf[w] >= 0.5]
        cap = max(max(known, default=0.0), 0.0) + math.log(self.max_optimism)
        for w, ls in self.log_speed.items():
            self.log_speed[w] = min(ls, cap)

    def group_durations(self) -> dict[str, dict[str, float]]:
        """Group -> worker -> typical warm seconds per task (per unit), after :meth:`update`;
        a worker's cold start where it ran no warm task of the group yet (a first estimate
        beats none for a plan).

        The raw material of :func:`blockflow.pools.plan.throughput_matrix`.
        """
        self.update()
        out = {g: {w: math.exp(median(d)) for w, d in per_worker.items() if d}
               for g, per_worker in self.groups.items()}
        for g, per_worker in self.cold.items():
            row = out.setdefault(g, {})
            for w, log_d in per_worker.items():
                row.setdefault(w, math.exp(log_d))
        return {g: row for g, row in out.items() if row}

    def speed(self, worker: str) -> float:
        """Relative speed of ``worker`` (1.0 = the typical worker, and when nothing is known)."""
        return math.exp(self.log_speed.get(worker, 0.0))

    def recent_speed(self, worker: str) -> float | None:
        """The speed ``worker`` showed on its latest warm task (or cold start, see
        ``cold_allowance``): group reference over its duration, within ``max_ratio``; None until
        the group is comparable. One duration, no confidence: a pessimistic guess only. O(1).
        """
        last = self.last.get(worker)
        if last is None:
            return None
        group, log_d = last
        ref = self.reference.get(group)
        if ref is None:
            return None
        log_r = max(min(ref - log_d, self.max_log_ratio), -self.max_log_ratio)
        return math.exp(log_r)

    def confidence(self, worker: str) -> float:
        """How much the speed of ``worker`` rests on comparable observations, 0-1."""
        return self.conf.get(worker, 0.0)

    def observations(self, worker: str) -> int:
        """Number of tasks seen from ``worker`` (cold starts included)."""
        return self.count.get(worker, 0)

    def heterogeneous(self, workers=None, *, min_ratio: float = 1.3,
                      min_confidence: float = 0.5, z: float = 3.29) -> bool:
        """Whether two confident workers (of ``workers``, default all) differ in speed by
        ``min_ratio`` and significantly: a two-sided test at critical value ``z`` (3.29: 0.1 %),
        widened for few degrees of freedom.
        """
        pool = self.log_speed if workers is None else [w for w in workers if w in self.log_speed]
        known = [w for w in pool if self.conf.get(w, 0.0) >= min_confidence]
        if len(known) < 2:
            return False
        fast = max(known, key=self.raw.__getitem__)
        slow = min(known, key=self.raw.__getitem__)
        gap = self.raw[fast] - self.raw[slow]
        # as large as asked, and beyond the noise of the two estimates: a two-sided test at
        # critical value z (3.29: 0.1 %; 1.64: 10 %), widened for few degrees of freedom
        # (Student's t by the Cornish-Fisher expansion, z + (z^3 + z) / 4 dof)
        dof = max(min(self.dof.get(fast, 0), self.dof.get(slow, 0)), 1)
        crit = z + (z ** 3 + z) / (4 * dof)
        return gap >= math.log(min_ratio) and gap >= crit * math.sqrt(
            self.var[fast] + self.var[slow])

    def reset(self, worker: str, since: float | None = None) -> None:
        """Forget the durations of ``worker`` but not that it is warm (judge it afresh); with
        ``since`` (epoch seconds), tasks it started before are ignored when they end (a task
        that ran through a pause shows the pause, not the worker).
        """
        if since is not None:
            self.since[worker] = since
        for per_worker in self.groups.values():
            per_worker.pop(worker, None)
        self.log_speed.pop(worker, None)
        self.conf.pop(worker, None)
        self.var.pop(worker, None)
        self.comparable.pop(worker, None)
        self.last.pop(worker, None)
        self.streak.pop(worker, None)
        self.pending = deque((o for o in self.pending if o[0] != worker),
                             maxlen=self.pending.maxlen)
        self._estimate()

    def forget(self, worker: str) -> None:
        """Drop everything known about ``worker`` (it left the cluster)."""
        self.reset(worker)
        self.count.pop(worker, None)
        self.since.pop(worker, None)
        for key in [k for k in self.seen if k[0] == worker]:
            del self.seen[key]
        for per_worker in self.cold.values():
            per_worker.pop(worker, None)
