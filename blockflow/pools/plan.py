"""Cost: the throughput matrix, the LP over it, and what a run cost per pool.

The throughput matrix follows Gavel (Narayanan et al. OSDI 2020); the LP is solved with
``scipy.optimize.linprog`` (HiGHS). Guide: :doc:`/guide/pools`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import numpy as np

from blockflow.pools.pool import Pool

__all__ = ["Plan", "plan", "prior_speeds", "run_cost", "throughput_matrix"]

_GB = 1e9


def prior_speeds(pools: Mapping[str, Pool], group: str | None = None,
                 speeds: Mapping[str, float] | None = None) -> dict[str, float]:
    """Pool name -> relative speed of ``group``'s tasks there before they are measured: the
    pool's declared prior (:meth:`~blockflow.pools.pool.Pool.speed_of`), else its workers'
    median learned speed (``speeds``: address -> speed), else 1.0. ``pools``: address -> its
    pool."""
    members: dict[str, list[str]] = {}
    by_name: dict[str, Pool] = {}
    for addr, p in pools.items():
        members.setdefault(p.name, []).append(addr)
        by_name[p.name] = p
    out = {}
    for name, addrs in members.items():
        learned = [speeds[a] for a in addrs if speeds and a in speeds]
        out[name] = by_name[name].speed_of(group) or (median(learned) if learned else 1.0)
    return out


def throughput_matrix(durations: Mapping[str, Mapping[str, float]],
                      pools: Mapping[str, Pool],
                      speeds: Mapping[str, float] | None = None) -> dict[str, dict[str, float]]:
    """Seconds per task of each task group on each pool (Gavel's throughput matrix, inverted).

    Parameters
    ----------
    durations : mapping
        Group -> worker address -> typical warm seconds per task
        (:meth:`~blockflow.scheduling.speed.SpeedModel.group_durations`).
    pools : mapping of str to Pool
        Worker address -> its pool (other workers ignored).
    speeds : mapping of str to float, optional
        Worker address -> learned relative speed.

    Returns
    -------
    dict
        Group -> pool name -> seconds per task for every pool: its workers' median where the
        group ran there, else scaled from the pools where it ran by the group's
        :func:`prior_speeds` (a per-group prior where the pool declares one).
    """
    out: dict[str, dict[str, float]] = {}
    for group, per_worker in durations.items():
        by_pool: dict[str, list[float]] = {}
        for addr, seconds in per_worker.items():
            p = pools.get(addr)
            if p is not None and seconds > 0:
                by_pool.setdefault(p.name, []).append(seconds)
        measured = {name: median(v) for name, v in by_pool.items()}
        if not measured:
            continue
        prior = prior_speeds(pools, group, speeds)
        row = dict(measured)
        for name in prior:
            if name not in row:
                row[name] = median(t * prior[q] / prior[name] for q, t in measured.items())
        out[group] = row
    return out


@dataclass
class Plan:
    """The LP's answer for some work (see :func:`plan`).

    Attributes
    ----------
    feasible : bool
    tasks : dict
        Group -> pool name -> tasks (fractional).
    busy : dict of str to float
        Pool name -> worker-seconds of work.
    cost, makespan : float
        Dollars (egress included) and seconds: lower bounds of the run's.
    workers_needed : dict of str to int
        Pool name -> workers needed to finish its share in time.
    shortfall : str
        Why it is infeasible, naming the fix; "" when feasible.
    """

    feasible: bool
    tasks: dict[str, dict[str, float]] = field(default_factory=dict)
    busy: dict[str, float] = field(default_factory=dict)
    cost: float = 0.0
    makespan: float = 0.0
    workers_needed: dict[str, int] = field(default_factory=dict)
    shortfall: str = ""

    def pool_tasks(self, pool: str) -> float:
        """Tasks (all groups) the plan gives ``pool``."""
        return sum(row.get(pool, 0.0) for row in self.tasks.values())

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON)."""
        return {"feasible": self.feasible, "tasks": self.tasks, "busy": self.busy,
                "cost": self.cost, "makespan": self.makespan,
                "workers_needed": self.workers_needed, "shortfall": self.shortfall}


def plan(work: Mapping[str, float], seconds: Mapping[str, Mapping[str, float]],
         pools: Mapping[str, Pool], workers: Mapping[str, int], *,
         threads: Mapping[str, int] | None = None, deadline: float | None = None,
         budget: float | None = None,
         egress: Mapping[str, Mapping[str, float]] | None = None,
         sunk: Mapping[str, float] | None = None) -> Plan:
    """The LP over the throughput matrix: tasks per (group, pool), cost and makespan.

    Variables ``x[g, p]`` (and the makespan ``T`` without a deadline); pool load
    ``L_p = sum_g t[g, p] x[g, p] / threads_p``, cost ``price_p L_p / 3600``; constraints
    ``sum_p x[g, p] = n_g`` and ``L_p <= workers_p * D`` (or ``* T``). A relaxation (divisible
    tasks, no dependencies), so its optimum is a lower bound.

    Parameters
    ----------
    work : mapping of str to float
        Group -> tasks to run.
    seconds : mapping
        Group -> pool name -> seconds per task (:func:`throughput_matrix`); a missing pool
        cannot run the group.
    pools : mapping of str to Pool
        Pool name -> :class:`Pool` (``price`` None counts as 0).
    workers, threads : mapping of str to int
        Pool name -> workers available; threads per worker (default 1).
    deadline, budget : float, optional
        Seconds to finish within, minimising cost; or dollars to stay within, minimising the
        makespan.
    egress : mapping, optional
        Group -> pool name -> dollars per task for inputs leaving their provider.
    sunk : mapping of str to float, optional
        Pool name -> workers billed to the run's end whatever they run (they began it):
        the pool costs ``price x max(load, sunk x horizon)``, so their time is free to use.

    Returns
    -------
    Plan
        Infeasible plans carry ``shortfall``.
    """
    from scipy.optimize import linprog

    threads = threads or {}
    groups = [g for g, n in work.items() if n > 0]
    names = sorted(workers)
    if not groups:
        return Plan(True, {}, {p: 0.0 for p in names}, 0.0, 0.0, {p: 0 for p in names})
    var = [(g, p) for g in groups for p in names if p in seconds.get(g, {})]
    missing = [g for g in groups if not any(v[0] == g for v in var)]
    if missing:
        return Plan(False, shortfall=f"no pool can run tasks of {missing[0]!r} (no "
                    f"throughput known for it on pools {', '.join(names)})")
    price = {p: (pools[p].price or 0.0) / 3600.0 for p in names}
    k = {p: max(int(threads.get(p, 1)), 1) for p in names}
    load = np.array([[seconds[g][p] / k[p] if q == p else 0.0 for (g, p) in var]
                     for q in names])  # worker-seconds per task, by pool
    eg = np.array([(egress or {}).get(g, {}).get(p, 0.0) for (g, p) in var])
    dollars = np.array([price[p] * seconds[g][p] / k[p] for (g, p) in var]) + eg
    a_eq = np.array([[1.0 if v[0] == g else 0.0 for v in var] for g in groups])
    b_eq = np.array([float(work[g]) for g in groups])
    cap = np.array([float(workers.get(p, 0)) for p in names])
    n, m = len(var), len(names)
    owed = np.array([min(float((sunk or {}).get(p, 0.0)), cap[i]) for i, p in enumerate(names)])
    prices = np.array([price[p] for p in names])

    def result(x: np.ndarray, feasible: bool, horizon: float | None) -> Plan:
        tasks: dict[str, dict[str, float]] = {g: {} for g in groups}
        for (g, p), xi in zip(var, x[:n]):
            if xi > 1e-9:
                tasks[g][p] = float(xi)
        busy = {p: float(load[i] @ x[:n]) for i, p in enumerate(names)}
        span = max((busy[p] / cap[i] for i, p in enumerate(names) if busy[p] > 1e-12),
                   default=0.0)
        h = horizon if horizon is not None else span
        needed = {p: (math.ceil(busy[p] / h - 1e-6) if h > 0 and busy[p] > 1e-12 else 0)
                  for p in names}
        billed = sum(price[p] * max(busy[p], owed[i] * h) for i, p in enumerate(names))
        return Plan(feasible, tasks, busy, float(billed + eg @ x[:n]), float(span), needed)

    eye = np.eye(m)
    if deadline is not None:
        # variables x, y: minimise egress + price . y, y_p >= load_p(x), y_p >= sunk_p D
        res = linprog(np.concatenate([eg, prices]),
                      A_ub=np.vstack([np.hstack([load, np.zeros((m, m))]),
                                      np.hstack([load, -eye])]),
                      b_ub=np.concatenate([cap * deadline, np.zeros(m)]),
                      A_eq=np.hstack([a_eq, np.zeros((len(groups), m))]), b_eq=b_eq,
                      bounds=[(0, None)] * n + [(o * deadline, None) for o in owed],
                      method="highs")
        if res.status == 0:
            return result(res.x, True, deadline)
        return Plan(False, shortfall=_deadline_shortfall(
            deadline, load, cap, a_eq, b_eq, names, groups, var, k))
    # minimise T: variables x, T, y; load_p(x) <= cap_p T; y_p >= load_p(x), y_p >= sunk_p T
    # (+ egress + price . y <= budget)
    c = np.zeros(n + 1 + m)
    c[n] = 1.0
    a_ub = np.vstack([np.hstack([load, -cap[:, None], np.zeros((m, m))]),
                      np.hstack([load, np.zeros((m, 1)), -eye]),
                      np.hstack([np.zeros((m, n)), owed[:, None], -eye])])
    b_ub = np.zeros(3 * m)
    if budget is not None:
        a_ub = np.vstack([a_ub, np.concatenate([eg, [0.0], prices])])
        b_ub = np.append(b_ub, budget)
    res = linprog(c, A_ub=a_ub, b_ub=b_ub,
                  A_eq=np.hstack([a_eq, np.zeros((len(groups), 1 + m))]),
                  b_eq=b_eq, bounds=(0, None), method="highs")
    if res.status == 0:
        return result(res.x, True, None)
    if budget is not None:
        cheapest = linprog(dollars, A_eq=a_eq, b_eq=b_eq, bounds=(0, None), method="highs")
        least = float(cheapest.fun) if cheapest.status == 0 else math.nan
        return Plan(False, shortfall=f"budget ${budget:.4g} is below the cheapest possible "
                    f"run (${least:.4g}); raise the budget to at least ${least:.4g}")
    return Plan(False, shortfall="no pool has workers; add workers")


def _deadline_shortfall(deadline, load, cap, a_eq, b_eq, names, groups, var, k) -> str:
    """One line: the fewest workers of one pool that meet the deadline, the others as they are."""
    from scipy.optimize import linprog

    best = None
    n = len(var)
    for i, p in enumerate(names):
        # minimise y (workers of p) with the others fixed
        c = np.zeros(n + 1)
        c[-1] = 1.0
        a_ub = np.hstack([load, np.zeros((len(names), 1))])
        a_ub[i, -1] = -deadline
        b_ub = cap * deadline
        b_ub[i] = 0.0
        res = linprog(c, A_ub=a_ub, b_ub=b_ub,
                      A_eq=np.hstack([a_eq, np.zeros((len(groups), 1))]), b_eq=b_eq,
                      bounds=(0, None), method="highs")
        if res.status == 0:
            need = math.ceil(res.x[-1] - 1e-6)
            extra = need - cap[i]
            if best is None or extra < best[0]:
                best = (extra, p, need, int(cap[i]))
    if best is None:
        return f"deadline {deadline:g}s cannot be met by any pool's workers"
    _, p, need, have = best
    return (f"deadline {deadline:g}s cannot be met: needs >= {need} workers of pool {p!r} "
            f"(has {have}); add workers or extend the deadline")


def run_cost(lifetimes: Mapping[str, tuple[Pool, float, float | None]],
             window: tuple[float, float], *, first_use: Mapping[str, float] | None = None,
             busy: Mapping[str, float] | None = None,
             crossings: Iterable[tuple[str, str, int]] = ()) -> dict[str, Any]:
    """What a run cost, per pool, billed as clouds bill: from a worker's arrival to its
    retirement, idle included, at least its pool's ``min_billed``.

    A worker that arrived during the run is billed to it from its arrival to its departure
    (to the run's end while it stays); one present before the run, from the run's first task
    on it to the run's end or its departure; one present that took no task of the run, not at
    all. Egress: bytes sent to another provider, priced by the sending pool's ``egress``.

    Parameters
    ----------
    lifetimes : mapping
        Worker address -> ``(pool, arrival, departure or None)``, seconds since the epoch.
    window : (float, float)
        The run's start and end (or now), seconds since the epoch.
    first_use : mapping of str to float, optional
        Worker -> start of its first task of the run.
    busy : mapping of str to float, optional
        Worker -> seconds its tasks of the run took.
    crossings : iterable of (sending pool, receiving provider, bytes)

    Returns
    -------
    dict
        ``pools``: pool -> ``workers``, ``billed_seconds``, ``busy_seconds``,
        ``idle_seconds``, ``price``, ``compute_cost`` (busy), ``idle_cost``, ``cost``;
        ``egress``: ``bytes``, ``cost``, ``by_pool`` (pool -> ``bytes``, ``cost``, ``to``:
        provider -> bytes); ``compute_cost``, ``idle_cost``, ``total_cost`` (dollars).
    """
    start, end = window
    first_use, busy = first_use or {}, busy or {}
    out: dict[str, dict[str, Any]] = {}
    by_name: dict[str, Pool] = {}
    for worker, (p, arrival, departure) in lifetimes.items():
        by_name[p.name] = p
        row = out.setdefault(p.name, {"workers": 0, "billed_seconds": 0.0,
                                      "busy_seconds": 0.0, "idle_seconds": 0.0,
                                      "price": p.price, "compute_cost": 0.0,
                                      "idle_cost": 0.0, "cost": 0.0})
        arrived_in_run = start <= arrival <= end
        if arrived_in_run:
            lo = arrival
            hi = departure if departure is not None else end
            hi = max(hi, arrival + p.min_billed)
        elif arrival < start and worker in first_use and (departure is None
                                                          or departure > start):
            lo = max(first_use[worker], start)
            hi = min(departure if departure is not None else end, end)
        else:
            continue
        billed = max(hi - lo, 0.0)
        used = min(float(busy.get(worker, 0.0)), billed)
        row["workers"] += 1
        row["billed_seconds"] += billed
        row["busy_seconds"] += used
        row["idle_seconds"] += billed - used
        row["compute_cost"] += used * p.price_per_second
        row["idle_cost"] += (billed - used) * p.price_per_second
        row["cost"] += billed * p.price_per_second
    by_pool: dict[str, dict[str, Any]] = {}
    for src, dst, nbytes in crossings:
        p = by_name.get(src)
        row = by_pool.setdefault(src, {"bytes": 0, "cost": 0.0, "to": {}})
        row["bytes"] += int(nbytes)
        row["to"][dst] = row["to"].get(dst, 0) + int(nbytes)
        row["cost"] += nbytes / _GB * (p.egress if p is not None else 0.0)
    egress = {"bytes": sum(r["bytes"] for r in by_pool.values()),
              "cost": sum(r["cost"] for r in by_pool.values()), "by_pool": by_pool}
    compute = sum(r["compute_cost"] for r in out.values())
    idle = sum(r["idle_cost"] for r in out.values())
    return {"pools": out, "egress": egress, "compute_cost": compute, "idle_cost": idle,
            "total_cost": compute + idle + egress["cost"]}
