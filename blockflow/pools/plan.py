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

__all__ = ["Plan", "RunWork", "dollars_between", "plan", "plan_runs", "prior_speeds", "run_cost", "throughput_matrix"]

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


@dataclass
class RunWork:
    """One run's share of a joint plan (see :func:`plan_runs`).

    Attributes
    ----------
    work : dict
        Group -> tasks to run.
    seconds : dict
        Group -> pool name -> seconds per task (a missing pool cannot run it).
    deadline : float or None
        Seconds from now it must end by (a cost objective: its dollars are minimised); None:
        a makespan objective, ending as soon as it can (within ``budget``).
    budget : float or None
        Dollars it may still spend (makespan objective).
    egress : dict
        Group -> pool name -> dollars per task for inputs leaving their provider.
    """

    work: dict[str, float]
    seconds: dict[str, dict[str, float]]
    deadline: float | None = None
    budget: float | None = None
    egress: dict[str, dict[str, float]] = field(default_factory=dict)


def plan_runs(runs: Mapping[str, RunWork], pools: Mapping[str, Pool],
              workers: Mapping[str, float], *,
              threads: Mapping[str, int] | None = None) -> dict[str, Plan] | None:
    """One LP over several runs' work on the same workers: each run's tasks per (group,
    pool), its cost and when it ends.

    Time is cut at the runs' deadlines and at ``T``, the end of the runs without one
    (makespan objectives, all ending by ``T``); a run's tasks run in the slices before its
    end, and in each slice every pool's load is within its workers' time there
    (``sum load <= workers_p x slice``: deadlines in order, as earliest-deadline-first meets
    them). The LP first minimises ``T`` (each makespan run within its budget), then, ``T``
    held, the dollars of the runs with a deadline. ``T`` sits between two deadlines, each
    place tried. A relaxation (divisible tasks, no dependencies, fluid slices) as
    :func:`plan` is, Gavel's LP (Narayanan et al., OSDI 2020) across jobs.

    Parameters
    ----------
    runs : mapping of str to RunWork
    pools : mapping of str to Pool
        Pool name -> :class:`Pool` (``price`` None counts as 0).
    workers, threads : mapping of str to int
        Pool name -> workers available (fractional allowed); threads per worker.

    Returns
    -------
    dict of str to Plan or None
        Run id -> its plan (``makespan``: seconds from now it ends by); None when the runs
        cannot all be met together.
    """
    from scipy.optimize import linprog

    threads = threads or {}
    names = sorted(workers)
    k = {p: max(int(threads.get(p, 1)), 1) for p in names}
    price = {p: (pools[p].price or 0.0) / 3600.0 for p in names}
    var = [(r, g, p) for r, w in runs.items() for g, n in w.work.items() if n > 0
           for p in names if p in w.seconds.get(g, {})]
    for r, w in runs.items():
        for g, n in w.work.items():
            if n > 0 and not any(v[0] == r and v[1] == g for v in var):
                return None
    if not var:
        return {r: Plan(True) for r in runs}
    deadlines = sorted({w.deadline for w in runs.values() if w.deadline is not None})
    flexible = [r for r, w in runs.items() if w.deadline is None]
    load = {v: runs[v[0]].seconds[v[1]][v[2]] / k[v[2]] for v in var}
    dollars = {v: price[v[2]] * runs[v[0]].seconds[v[1]][v[2]] / k[v[2]]
               + runs[v[0]].egress.get(v[1], {}).get(v[2], 0.0) for v in var}
    best = None
    for at in (range(len(deadlines) + 1) if flexible else [None]):
        got = _sliced(runs, var, names, workers, load, dollars, deadlines, at, linprog)
        if got is not None and (best is None or got[0] < best[0] - 1e-9):
            best = got
    if best is None:
        return None
    _, x, ends = best
    out = {}
    for r, w in runs.items():
        tasks: dict[str, dict[str, float]] = {}
        busy = {p: 0.0 for p in names}
        spent, end = 0.0, 0.0
        for (v, i), xi in x.items():
            if v[0] != r or xi <= 1e-9:
                continue
            tasks.setdefault(v[1], {})[v[2]] = tasks.get(v[1], {}).get(v[2], 0.0) + xi
            busy[v[2]] += load[v] * xi
            spent += dollars[v] * xi
            end = max(end, ends[i])
        needed = {p: (math.ceil(busy[p] / end - 1e-6) if end > 0 and busy[p] > 1e-12 else 0)
                  for p in names}
        out[r] = Plan(True, tasks, busy, float(spent), float(end), needed)
    return out


def _sliced(runs, var, names, workers, load, dollars, deadlines, at, linprog):
    """:func:`plan_runs` with ``T`` in slice ``at`` (between deadlines ``at - 1`` and ``at``;
    None: no makespan run): ``(T, {(var, slice): tasks}, slice ends)`` or None."""
    bounds = list(deadlines)
    if at is not None:
        bounds.insert(at, None)  # T
    nb = len(bounds)
    # the slices each run may use: those ending at or before its end
    end_of = {r: (bounds.index(None) if w.deadline is None else bounds.index(w.deadline))
              for r, w in runs.items()}
    cols = [(v, i) for v in var for i in range(end_of[v[0]] + 1)]
    n = len(cols) + 1  # + T
    t = n - 1
    a_ub, b_ub, a_eq, b_eq = [], [], [], []
    for p in names:
        for i in range(nb):
            row = np.zeros(n)
            for j, (v, s) in enumerate(cols):
                if s == i and v[2] == p:
                    row[j] = load[v]
            cap = float(workers.get(p, 0.0))
            lo = 0.0 if i == 0 else bounds[i - 1]
            hi = bounds[i]
            # load <= cap * (hi - lo), T moved to the left where it is an end
            rhs = 0.0
            if hi is None:
                row[t] -= cap
            else:
                rhs += cap * hi
            if lo is None:
                row[t] += cap
            else:
                rhs -= cap * lo
            a_ub.append(row)
            b_ub.append(rhs)
    for r, w in runs.items():
        for g, count in w.work.items():
            if count <= 0:
                continue
            row = np.zeros(n)
            for j, (v, _) in enumerate(cols):
                if v[0] == r and v[1] == g:
                    row[j] = 1.0
            a_eq.append(row)
            b_eq.append(float(count))
        if w.deadline is None and w.budget is not None:
            row = np.zeros(n)
            for j, (v, _) in enumerate(cols):
                if v[0] == r:
                    row[j] = dollars[v]
            a_ub.append(row)
            b_ub.append(float(w.budget))
    t_lo = 0.0 if at is None or at == 0 else deadlines[at - 1]
    t_hi = None if at is None or at >= len(deadlines) else deadlines[at]
    t_bounds = (0.0, 0.0) if at is None else (t_lo, t_hi)
    bnds = [(0, None)] * (n - 1) + [t_bounds]
    a_ub, b_ub = np.array(a_ub), np.array(b_ub)
    a_eq, b_eq = np.array(a_eq), np.array(b_eq)
    cost = np.array([dollars[v] if runs[v[0]].deadline is not None else 0.0
                     for v, _ in cols] + [0.0])
    if at is not None:  # the makespan runs' end first, then the deadline runs' dollars
        c = np.zeros(n)
        c[t] = 1.0
        res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=bnds,
                      method="highs")
        if res.status != 0:
            return None
        best_t = float(res.x[t])
        bnds[-1] = (t_lo, best_t + 1e-6 * (1.0 + best_t))
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=bnds,
                  method="highs")
    if res.status != 0:
        return None
    big_t = float(res.x[t]) if at is not None else 0.0
    ends = [big_t if b is None else b for b in bounds]
    return big_t, {col: float(res.x[j]) for j, col in enumerate(cols)}, ends


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


def dollars_between(history: Iterable[tuple[float, Pool]], lo: float, hi: float) -> float:
    """Dollars one worker costs from ``lo`` to ``hi`` (seconds since the epoch) at the prices
    in force then: ``history`` is ``(since, pool)`` of each pool description it reported,
    oldest first (a price change is a new one)."""
    entries = list(history)
    total = 0.0
    for i, (since, p) in enumerate(entries):
        until = entries[i + 1][0] if i + 1 < len(entries) else math.inf
        a, b = max(lo, since if i else -math.inf), min(hi, until)
        if b > a:
            total += (b - a) * p.price_per_second
    return total


def run_cost(lifetimes: Mapping[str, tuple], window: tuple[float, float], *,
             first_use: Mapping[str, float] | None = None,
             busy: Mapping[str, float] | None = None,
             busy_cost: Mapping[str, float] | None = None,
             shared: Mapping[str, float] | None = None,
             crossings: Iterable[tuple[str, str, int]] = ()) -> dict[str, Any]:
    """What a run cost, per pool, billed as clouds bill: from a worker's arrival to its
    retirement, idle included, at least its pool's ``min_billed``, at the prices in force
    while it was billed.

    A worker that arrived during the run is billed to it from its arrival to its departure
    (to the run's end while it stays); one present before the run, from the run's first task
    on it to the run's end or its departure; one present that took no task of the run, not at
    all. Each second is priced at the pool's price of that second (a price changed mid-run
    bills the seconds before at the old price). Egress: bytes sent to another provider,
    priced by the sending pool's ``egress``.

    Parameters
    ----------
    lifetimes : mapping
        Worker address -> ``(pool, arrival, departure or None)``, seconds since the epoch,
        optionally with a fourth item, ``((since, pool), ...)``: the pools (prices) it
        reported, oldest first (the plugin's :attr:`~blockflow.scheduling.accounting.
        Accounting.lifetimes`); without it, ``pool`` throughout.
    window : (float, float)
        The run's start and end (or now), seconds since the epoch.
    first_use : mapping of str to float, optional
        Worker -> start of its first task of the run.
    busy : mapping of str to float, optional
        Worker -> seconds its tasks of the run took.
    busy_cost : mapping of str to float, optional
        Worker -> dollars of those seconds at the prices in force as they ran; default
        ``busy`` spread evenly over the billed time.
    shared : mapping of str to float, optional
        Worker -> seconds of its billed time other runs' tasks used (runs at once): billed to
        those runs, not this one (at most its idle time).
    crossings : iterable of (sending pool, receiving provider, bytes)

    Returns
    -------
    dict
        ``pools``: pool -> ``workers``, ``billed_seconds``, ``busy_seconds``,
        ``idle_seconds``, ``price`` (the latest), ``compute_cost`` (busy), ``idle_cost``,
        ``cost``; ``egress``: ``bytes``, ``cost``, ``by_pool`` (pool -> ``bytes``, ``cost``,
        ``to``: provider -> bytes); ``compute_cost``, ``idle_cost``, ``total_cost``
        (dollars).
    """
    start, end = window
    first_use, busy, busy_cost = first_use or {}, busy or {}, busy_cost or {}
    shared = shared or {}
    out: dict[str, dict[str, Any]] = {}
    by_name: dict[str, Pool] = {}
    for worker, life in lifetimes.items():
        p, arrival, departure = life[0], life[1], life[2]
        history = life[3] if len(life) > 3 and life[3] else ((arrival, p),)
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
        span = max(hi - lo, 0.0)
        used = min(float(busy.get(worker, 0.0)), span)
        billed = max(span - float(shared.get(worker, 0.0)), used)
        # the worker's dollars over its span, less the share other runs' tasks used
        dollars = dollars_between(history, lo, hi) * billed / span if span > 0 else 0.0
        spent = (min(float(busy_cost[worker]), dollars) if worker in busy_cost
                 else dollars * used / billed if billed > 0 else 0.0)
        row["workers"] += 1
        row["billed_seconds"] += billed
        row["busy_seconds"] += used
        row["idle_seconds"] += billed - used
        row["compute_cost"] += spent
        row["idle_cost"] += dollars - spent
        row["cost"] += dollars
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
