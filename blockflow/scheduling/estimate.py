"""Throughput and earliest-finish placement: the plain arithmetic of "which worker, how long".

Plain Python on plain data (addresses, seconds, units of work), free of distributed, so that
client-side code and scheduler-side rules share one estimator. Guide: :doc:`/guide/scheduling`.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from statistics import median
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

__all__ = ["CONFIDENT", "LinkBandwidth", "Placement", "Throughput", "call_cost",
           "confident_speeds", "earliest_finish", "fixed_units", "move_pays",
           "prior_seconds_per_unit"]

#: A learned speed counts as known from this confidence (0-1) on: the threshold
#: :meth:`~blockflow.scheduling.speed.SpeedModel.heterogeneous` uses for "well observed".
#: Below it the plugin's speed is shrunk towards 1.0 by what it has not seen, and is a guess.
CONFIDENT = 0.5


def confident_speeds(speeds: Mapping[str, float] | None,
                     confidence: Mapping[str, float] | None,
                     threshold: float = CONFIDENT) -> dict[str, float]:
    """The learned ``speeds`` (worker -> relative speed, 1.0 typical) whose ``confidence`` (0-1,
    missing 0) is at least ``threshold``, positive and finite only.
    """
    conf = confidence or {}
    out = {}
    for a, s in (speeds or {}).items():
        try:
            s = float(s)
        except (TypeError, ValueError):
            continue
        if conf.get(a, 0.0) >= threshold and math.isfinite(s) and s > 0:
            out[a] = s
    return out


def move_pays(stay: float, there: float, transfer: float, margin: float) -> bool:
    """Whether moving a task pays: its finish ``stay`` seconds from now where it is, ``there``
    on the target (sending its inputs, ``transfer`` seconds, included).

    The gain ``stay - there`` must exceed ``margin`` (seconds) and twice the transfer again:
    the transfer's estimate (link bandwidth, input bytes) is the least certain term, and a
    move that only breaks even loses to plain Dask, which sends nothing. A blockflow
    heuristic (distributed's stealing weighs transfer against compute likewise).

    Examples
    --------
    >>> move_pays(4.0, 1.5, 0.5, 0.1), move_pays(4.0, 3.5, 0.5, 0.1)
    (True, False)
    """
    return stay - there > max(margin, 2 * transfer)


def call_cost(calls: list[tuple[int, float]]) -> float | None:
    """A worker's fixed seconds per call, from one pass's ``(units, seconds)``, largest first.

    With every call taking ``c + s x units``: ``c = (T n1 - t1 N) / (k n1 - N)`` (``n1, t1`` the
    first call; ``k`` calls of ``N`` units in ``T`` seconds the rest), clipped to ``[0, t1]``;
    None with one call. A blockflow heuristic.
    """
    if len(calls) < 2:
        return None
    (n1, t1), rest = calls[0], calls[1:]
    k, rows, secs = len(rest), sum(n for n, _ in rest), sum(t for _, t in rest)
    denom = k * n1 - rows
    if n1 <= 0 or denom <= 0:
        return None
    return min(max(0.0, (secs * n1 - t1 * rows) / denom), t1)


def fixed_units(calls: Mapping[str, Iterable[tuple[float, float]]]) -> float:
    """A call's fixed cost in units of work, shared by the workers (``calls``: worker address ->
    its calls' ``(units, seconds)``).

    Model: a call of ``u`` units takes ``k (u + u0)`` seconds; ``u0`` is the median over workers
    of intercept / slope of a least-squares line through their calls (where sizes differ by
    25 % or more; else 0), at most the median call size. A blockflow heuristic.
    """
    est, sizes = [], []
    for obs in calls.values():
        obs = list(obs)
        u = np.array([o[0] for o in obs], float)
        t = np.array([o[1] for o in obs], float)
        sizes.extend(u)
        if len(u) < 2 or u.max() < 1.25 * u.min():
            continue
        slope, icept = np.polyfit(u, t, 1)
        est.append(max(icept, 0.0) / slope if slope > 0 else math.inf)
    if not est:
        return 0.0
    return float(min(median(est), median(sizes)))


def prior_seconds_per_unit(workers: Iterable[str], measured: Mapping[str, float],
                           prior: Mapping[str, float] | None) -> dict[str, float]:
    """Seconds per unit for every worker: ``measured`` where given, else from its ``prior`` speed.

    An unmeasured worker gets the median of ``measured x speed`` over workers in both (else the
    measured median) over its prior speed; with nothing measured, ``1 / speed`` (1.0 without).
    ``prior``: worker -> relative speed (larger is faster), e.g. :func:`confident_speeds`.
    """
    prior = {a: s for a, s in (prior or {}).items() if s and s > 0}
    measured = {a: m for a, m in measured.items() if m is not None}
    if not measured:
        return {a: 1.0 / prior[a] if a in prior else 1.0 for a in workers}
    both = [a for a in measured if a in prior]
    unit = (median(measured[a] * prior[a] for a in both) if both
            else median(measured.values()))
    return {a: measured[a] if a in measured else (unit / prior[a] if a in prior else unit)
            for a in workers}


class Throughput:
    """Seconds per unit of work per worker, learned from timed calls.

    Model: a call of ``u`` units on worker ``a`` takes ``k_a (u + u0)`` seconds, ``u0`` a shared
    fixed cost (:func:`fixed_units`); ``k_a`` is the median over the worker's last ``window``
    warm calls, its first ``cold`` calls kept apart as cold starts; unmeasured workers get the
    prior (:func:`prior_seconds_per_unit`). A blockflow heuristic from robust estimation.

    Parameters
    ----------
    window : int, default 16
    cold : int, default 1
    fixed : bool, default True
        Fit ``u0``; False: ``u0 = 0``.
    """

    def __init__(self, window: int = 16, cold: int = 1, fixed: bool = True):
        self.window, self.cold_calls, self.fit_fixed = int(window), int(cold), bool(fixed)
        self._calls: dict[str, int] = defaultdict(int)
        self._cold: dict[str, deque] = defaultdict(lambda: deque(maxlen=max(self.cold_calls,
                                                                             1)))
        self._warm: dict[str, deque] = defaultdict(lambda: deque(maxlen=self.window))
        self._u0 = 0.0

    def observe(self, worker: str, units: float, seconds: float) -> bool:
        """Record one call of ``units`` units of work that took ``seconds``.

        Returns
        -------
        bool
            Whether the call counted as warm (False: a cold start, or no work).
        """
        if not units or units <= 0 or seconds is None or seconds < 0:
            return False
        self._calls[worker] += 1
        if self._calls[worker] <= self.cold_calls:
            self._cold[worker].append((float(units), float(seconds)))
            return False
        self._warm[worker].append((float(units), float(seconds)))
        if self.fit_fixed:
            self._u0 = fixed_units(self._warm)
        return True

    def forget(self, worker: str) -> None:
        """Drop what was measured of ``worker`` (it left; one coming back starts cold)."""
        for d in (self._calls, self._cold, self._warm):
            d.pop(worker, None)
        if self.fit_fixed:
            self._u0 = fixed_units(self._warm)

    @property
    def fixed(self) -> float:
        """The fixed cost per call, in units of work (0 unless fitted)."""
        return self._u0

    def measured(self, worker: str) -> bool:
        """Whether ``worker`` has a warm call."""
        return bool(self._warm.get(worker))

    def warm_calls(self, worker: str) -> list[tuple[float, float]]:
        """``worker``'s warm calls kept, ``(units, seconds)``, oldest first."""
        return list(self._warm.get(worker, ()))

    def _rate(self, calls) -> float:
        u0 = self._u0
        return median(t / (u + u0) for u, t in calls)

    def measured_seconds_per_unit(self, workers: Iterable[str] | None = None) -> dict[str, float]:
        """Seconds per unit of each worker with a warm call (of ``workers`` when given)."""
        pick = None if workers is None else set(workers)
        return {a: self._rate(v) for a, v in self._warm.items()
                if v and (pick is None or a in pick)}

    def cold_seconds_per_unit(self) -> dict[str, float]:
        """Seconds per unit of each worker's cold start(s): ``seconds / units``."""
        return {a: median(t / u for u, t in v) for a, v in self._cold.items() if v}

    def observed_seconds_per_unit(self) -> dict[str, float]:
        """Seconds per unit of every worker seen, warm or else cold (for reports)."""
        return {**self.cold_seconds_per_unit(), **self.measured_seconds_per_unit()}

    def seconds_per_unit(self, workers: Iterable[str],
                         prior: Mapping[str, float] | None = None) -> dict[str, float]:
        """Seconds per unit of work of each of ``workers``: measured (cold starts while none
        has a warm call), else from ``prior`` relative speeds (:func:`prior_seconds_per_unit`).
        """
        workers = list(workers)
        measured = self.measured_seconds_per_unit(workers)
        if not measured:
            cold = self.cold_seconds_per_unit()
            measured = {a: cold[a] for a in workers if a in cold}
        return prior_seconds_per_unit(workers, measured, prior)

    def seconds(self, worker: str, units: float, spu: Mapping[str, float]) -> float:
        """Seconds a call of ``units`` takes on ``worker``: ``spu[worker] x (units + u0)``."""
        return spu[worker] * (units + self._u0)


@dataclass(frozen=True)
class Placement:
    """Where :func:`earliest_finish` put item ``item`` (its index): ``worker``, ``slot`` (thread
    index), ``start`` and predicted ``finish``.
    """

    item: int
    worker: str
    slot: int
    start: float
    finish: float


def earliest_finish(
    items: int | Sequence[Any],
    ready: Mapping[str, float | Sequence[float]],
    seconds: Mapping[str, float] | Callable[[int, str], float] | None = None,
    *,
    units: Sequence[float] | None = None,
    speeds: Mapping[str, float] | None = None,
    fixed: float = 0.0,
    threads: Mapping[str, int] | None = None,
    sizes: Sequence[float] | None = None,
    capacity: Mapping[str, float] | None = None,
    held: Mapping[str, float] | None = None,
    tie: Callable[[str, int], Any] | None = None,
) -> list[Placement]:
    """Assign items, in the order given, each to the worker slot where it finishes first.

    List scheduling by earliest finish time (HEFT-style: Topcuoglu, Hariri and Wu, 2002), a
    blockflow heuristic; sort items largest first for the LPT variant. An item ends at
    ``ready + seconds`` (times in seconds), or with ``speeds`` at ``(ready + units + fixed) /
    speed`` (``ready`` in queued units).

    Parameters
    ----------
    items : int or sequence
        The items (or how many).
    ready : mapping of str to float or sequence of float
        Per worker (or per slot): when it is free, or its queued units with ``speeds``.
    seconds : mapping of str to float, or callable, optional
        Per worker seconds per unit, or ``seconds(item, worker)``. Not with ``speeds``.
    units : sequence of float, optional
        Units of work per item (default 1).
    speeds : mapping of str to float, optional
        Per worker units of work per second.
    fixed : float, default 0.0
        With ``speeds``: a call's fixed cost in units.
    threads : mapping of str to int, optional
        Slots per worker when ``ready`` gives one number (default 1).
    sizes, capacity, held : optional
        Bytes per item, per worker and held already: a worker is eligible while within its
        capacity (if none is, all are).
    tie : callable, optional
        ``tie(worker, slot)``: sort key for equal finishes (default ``ready``'s order).

    Returns
    -------
    list of Placement
        One per item, in order; with ``speeds``, in seconds from the snapshot.

    Raises
    ------
    ValueError
        If not exactly one of ``seconds`` and ``speeds`` is given.
    """
    if (seconds is None) == (speeds is None):
        raise ValueError("earliest_finish: give either seconds or speeds")
    n = items if isinstance(items, int) else len(items)
    if n == 1 and callable(seconds) and units is None and tie is None and sizes is None:
        # One item, per-item seconds (the move rule's question, once per move, over up to
        # every worker): the same answer without building slots; ties go to the first
        # worker in ``ready``'s order, slot 0, as below. Per-slot ready times: below.
        best, best_ready, best_end = None, 0.0, math.inf
        for w, r in ready.items():
            if not isinstance(r, (int, float)):
                break
            e = r + seconds(0, w)
            if best is None or e < best_end:
                best, best_ready, best_end = w, r, e
        else:
            return [] if best is None else [
                Placement(0, best, 0, float(best_ready), float(best_end))]
    slots: list[list] = []  # [ready, worker, slot index]
    for w, r in ready.items():
        if isinstance(r, (int, float)):
            k = max(int((threads or {}).get(w, 1) or 1), 1)
            slots += [[float(r), w, i] for i in range(k)]
        else:
            slots += [[float(t), w, i] for i, t in enumerate(r)]

    def size(i: int) -> float:
        return 1.0 if units is None else units[i]

    if speeds is not None:
        def end(i: int, s: list) -> float:
            return (s[0] + size(i) + fixed) / speeds[s[1]]
    else:
        if callable(seconds):
            cost = seconds
        else:
            def cost(i: int, w: str) -> float:
                return size(i) * seconds[w]

        def end(i: int, s: list) -> float:
            return s[0] + cost(i, s[1])
    used: dict[str, float] = defaultdict(float, held or {})
    out = []
    for i in range(n):
        pool = slots
        if capacity is not None and sizes is not None:
            pool = [s for s in slots if used[s[1]] + sizes[i] <= capacity.get(s[1], math.inf)]
            pool = pool or slots
        if not pool:
            break
        finish = [end(i, s) for s in pool]
        k = min(range(len(pool)), key=lambda k: (
            finish[k], () if tie is None else tie(pool[k][1], pool[k][2])))
        best = pool[k]
        if speeds is not None:
            start = best[0] / speeds[best[1]]
            best[0] += size(i)
        else:
            start = best[0]
            best[0] = finish[k]
        if sizes is not None:
            used[best[1]] += sizes[i]
        out.append(Placement(i, best[1], best[2], start, finish[k]))
    return out


def address_host(address: str) -> str:
    """The host part of a worker address: ``"tcp://10.0.0.5:4711"`` -> ``"10.0.0.5"``."""
    rest = address.split("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    return host if sep and port.isdigit() else rest


class LinkBandwidth:
    """The bandwidth between two workers, bytes per second, from distributed's measurements.

    Looked up in order: the pair either way (``Scheduler.bandwidth_workers``), the median
    between the two hosts, for one host the fastest link measured, else ``default``
    (``Scheduler.bandwidth``; 100e6 if not positive). ``measured``: ``(receiver, sender)`` ->
    bytes per second, read only; ``max_age``: seconds the per-host table is reused. A blockflow
    heuristic.

    Examples
    --------
    >>> links = LinkBandwidth({("tcp://b:1", "tcp://a:1"): 6e6}, default=100e6)
    >>> links("tcp://b:1", "tcp://a:1"), links("tcp://a:1", "tcp://b:1")
    (6000000.0, 6000000.0)
    >>> links("tcp://b:2", "tcp://a:9"), links("tcp://c:1", "tcp://a:1")
    (6000000.0, 100000000.0)
    """

    def __init__(self, measured: Mapping[tuple[str, str], float], default: float,
                 max_age: float = 5.0):
        self.measured = measured
        self.default = float(default) if default and default > 0 else 100e6
        self.max_age = float(max_age)
        self._hosts: dict[frozenset, float] | None = None
        self._fastest: float | None = None
        self._made = 0.0

    def _host_table(self) -> dict[frozenset, float]:
        now = time.monotonic()
        if self._hosts is None or now - self._made > self.max_age:
            # one pass over the measured pairs, reused for max_age seconds
            self._made = now
            seen: dict[frozenset, list[float]] = defaultdict(list)
            for (a, b), bw in list(self.measured.items()):
                if bw and bw > 0:
                    seen[frozenset((address_host(a), address_host(b)))].append(float(bw))
            self._hosts = {k: median(v) for k, v in seen.items()}
            self._fastest = max(self._hosts.values(), default=self.default)
        return self._hosts

    def __call__(self, receiver: str, sender: str) -> float:
        return self.lookup(receiver, sender)[0]

    def lookup(self, receiver: str, sender: str) -> tuple[float, str]:
        """``(bytes per second, source)``, source one of ``"measured"``, ``"hosts"``,
        ``"same host"``, ``"estimate"``.
        """
        for pair in ((receiver, sender), (sender, receiver)):
            bw = self.measured.get(pair)
            if bw and bw > 0:
                return float(bw), "measured"
        a, b = address_host(receiver), address_host(sender)
        table = self._host_table()
        bw = table.get(frozenset((a, b)))
        if bw:
            return bw, "hosts"
        if a == b:
            return max(self._fastest or 0.0, self.default), "same host"
        return self.default, "estimate"
