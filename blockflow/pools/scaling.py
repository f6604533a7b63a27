"""The pool-scaling rule: how many workers each pool should have now, and which idle workers a
shrinking pool gives back.

Targets come from the LP of :func:`blockflow.pools.plan.plan` over the work left, within each
pool's bounds: the cheapest sizes meeting a deadline, the fastest a budget pays for, or
without an objective the cheapest finishing the backlog within ``target_duration``. Only
idle workers are retired, after ``wait_count`` idle checks, never while the plan still uses
the pool (dask-kubernetes#914). A blockflow heuristic on Gavel's LP (OSDI 2020). Guide:
:doc:`/guide/pools`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from blockflow.pools import plan as cost
from blockflow.scheduling.actions import Action, Decision, Record, Recorded
from blockflow.pools.pool import Pool, pools_of

__all__ = ["PoolScalingRule", "ScalingRequest"]


@dataclass
class ScalingRequest:
    """What the cluster asks the rule for (plain data, sent by ``PoolAdaptive``).

    Attributes
    ----------
    pools : dict of str to Pool
    bounds : dict of str to (int, int)
        Pool name -> (minimum, maximum) workers.
    starting, threads : dict of str to int
        Pool name -> workers started but not joined; threads per worker.
    target_duration, startup : float
        Seconds the backlog should take without an objective
        (``distributed.adaptive.target-duration``); seconds a new worker takes to join.
    wait_count : int
        Consecutive idle checks before a worker is retired.
    """

    pools: dict[str, Pool]
    bounds: dict[str, tuple[int, int]]
    starting: dict[str, int] = field(default_factory=dict)
    threads: dict[str, int] = field(default_factory=dict)
    target_duration: float = 5.0
    startup: float = 5.0
    wait_count: int = 3


def _fill_seconds(seconds: Mapping[str, Mapping[str, float]], work: Mapping[str, float],
                  reference: Mapping[str, float], pools: Mapping[str, Pool],
                  speeds: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Seconds per task of every pending group on every pool, gaps filled by typical speeds
    (unmeasured groups from ``reference``, distributed's estimate).
    """
    out = {}
    for g in work:
        row = dict(seconds.get(g, {}))
        measured = {p: t for p, t in row.items() if p in pools}
        for name in pools:
            if name in measured:
                continue
            if measured:
                row[name] = median(t * speeds.get(q, 1.0) / speeds.get(name, 1.0)
                                   for q, t in measured.items())
            else:
                row[name] = max(float(reference.get(g, 0.5)), 1e-6) / speeds.get(name, 1.0)
        out[g] = {p: row[p] for p in pools}
    return out


class PoolScalingRule:
    """Per-pool worker targets and the idle workers a shrinking pool retires.

    Attributes
    ----------
    targets : dict of str to int
        Pool name -> the latest target (also the last one logged).
    reasons : dict of str to str
        Pool name -> why it has that target.
    """

    #: Under a deadline, a pool with no worker that is dearer per unit of work than the
    #: cheapest starts once its share needs this much of its maximum's time left (the
    #: objective rule's :attr:`~blockflow.pools.objective_rule.ObjectiveRule.late_start`).
    late_start = 0.8

    def __init__(self):
        self.targets: dict[str, int] = {}
        self.reasons: dict[str, str] = {}
        self._idle_streak: dict[str, int] = {}

    def size(self, snap, request: ScalingRequest, run, reference: Mapping[str, float],
             spent: float = 0.0) -> tuple[dict[str, int], dict[str, str], dict[str, Any]]:
        """Targets, reasons and the numbers behind them (no decisions)."""
        pools = request.pools
        lo = {p: int(request.bounds[p][0]) for p in pools}
        hi = {p: int(request.bounds[p][1]) for p in pools}
        work = dict(run.group_pending) if run is not None else {}
        work = {g: n for g, n in work.items() if n > 0}
        if not work:
            return (dict(lo), {p: f"no work left: pool {p!r} at its minimum ({lo[p]})"
                               for p in pools}, {"backlog": 0})
        by_addr = pools_of(snap.workers)
        speeds = {}
        for name, pool in pools.items():
            learned = [w.speed for a, w in snap.workers.items()
                       if by_addr[a].name == name and w.speed]
            speeds[name] = pool.speed or (median(learned) if learned else 1.0)
        seconds = _fill_seconds(snap.throughput or {}, work, reference, pools, speeds)
        threads = {p: max(int(request.threads.get(p, 1)), 1) for p in pools}
        objective = run.objective
        seen: dict[str, Any] = {"backlog": sum(work.values()),
                                "objective": objective.kind if objective else "makespan"}
        tail = max(max(row.values()) for row in seconds.values())
        if objective is not None and objective.kind == "cost" and run.deadline_at is not None:
            left = run.deadline_at - snap.time
            cold = any(self._current(snap, request, p, by_addr) == 0 for p in pools)
            horizon = left - tail - (request.startup if cold else 0.0)
            seen.update(deadline_in=round(left, 3), horizon=round(horizon, 3))
            plan = (cost.plan(work, seconds, pools, hi, threads=threads, deadline=horizon)
                    if horizon > 0 else None)
            if plan is None or not plan.feasible:
                why = (plan.shortfall if plan is not None else "no time left")
                return (dict(hi), {p: f"deadline in {left:.1f} s cannot be met by the "
                                   f"cheapest sizes ({why}): every pool at its maximum "
                                   f"({hi[p]})" for p in pools}, seen)
            what = (f"cheapest sizes finishing {seen['backlog']} tasks within the "
                    f"deadline (in {left:.1f} s, {horizon:.1f} s after start-up and one "
                    f"last task)")
        elif objective is not None and objective.budget is not None:
            left_budget = objective.budget - spent
            seen.update(budget_left=round(left_budget, 6))
            plan = (cost.plan(work, seconds, pools, hi, threads=threads, budget=left_budget)
                    if left_budget > 0 else None)
            if plan is None or not plan.feasible:
                cheapest = min(pools, key=lambda p: (pools[p].price or 0.0) / speeds[p])
                return ({p: (max(lo[p], 1) if p == cheapest else lo[p]) for p in pools},
                        {p: f"budget left ${left_budget:.4g} pays for no faster sizes: "
                            f"only the cheapest pool {cheapest!r} works" for p in pools}, seen)
            what = (f"fastest sizes within the budget left (${left_budget:.4g}), projected "
                    f"makespan {plan.makespan:.1f} s")
        else:
            plan = cost.plan(work, seconds, pools, hi, threads=threads,
                             deadline=request.target_duration)
            what = (f"cheapest sizes finishing {seen['backlog']} tasks within "
                    f"{request.target_duration:g} s (target duration)")
            if not plan.feasible:
                plan = cost.plan(work, seconds, pools, hi, threads=threads)
                what = (f"{seen['backlog']} tasks need more than {request.target_duration:g}"
                        f" s even with every pool at its maximum")
        needed = dict(plan.workers_needed)
        later: dict[str, str] = {}
        if objective is not None and objective.kind == "cost" and run.deadline_at is not None:
            # a pool with no worker yet, dearer per unit of work than the cheapest, starts
            # when its share needs :attr:`late_start` of what its maximum does by the
            # deadline: its workers then run their share in one stretch to the end (billed
            # from their first task to their last), as the objective rule has them do
            cheapest = min(pools, key=lambda p: ((pools[p].price or 0.0) / speeds[p], p))
            for p in pools:
                room = hi[p] * horizon
                if (p != cheapest and needed.get(p, 0) > 0 and room > 0
                        and self._current(snap, request, p, by_addr) == 0
                        and plan.busy.get(p, 0.0) < self.late_start * room):
                    later[p] = (f"; starts later: its share is {plan.busy[p]:.1f} of the "
                                f"{room:.1f} worker-seconds its maximum has by the deadline")
                    needed[p] = 0
        targets = {p: min(max(needed.get(p, 0), lo[p]), hi[p]) for p in pools}
        seen.update(plan_cost=round(plan.cost, 6), plan_makespan=round(plan.makespan, 3))
        reasons = {p: f"{what}: pool {p!r} needs {needed.get(p, 0)} "
                      f"(bounds {lo[p]}..{hi[p]}, ${pools[p].price or 0:g}/h, "
                      f"{speeds[p]:.2g}x speed){later.get(p, '')}" for p in pools}
        return targets, reasons, seen

    @staticmethod
    def _current(snap, request, pool: str, by_addr) -> int:
        joined = sum(1 for a, w in snap.workers.items() if by_addr[a].name == pool
                     and w.status in ("running", "paused"))
        return joined + int(request.starting.get(pool, 0))

    def run(self, snap, request: ScalingRequest, run, reference: Mapping[str, float],
            spent: float = 0.0, retiring: frozenset = frozenset(),
            holding: frozenset = frozenset()) -> list[Decision]:
        """``scale`` decisions for changed targets, ``retire`` for idle workers of pools above
        theirs; a worker holding results (``holding``) only while another running worker can
        take them (``retiring``: being retired already).
        """
        targets, reasons, seen = self.size(snap, request, run, reference, spent)
        by_addr = pools_of(snap.workers)
        out = []
        idle_now: set[str] = set()
        chosen: set[str] = set()
        for pool, target in sorted(targets.items()):
            current = self._current(snap, request, pool, by_addr)
            if seen.get("backlog", 0) > 0 and 0 < target < current:
                # the run still has work for this pool: it keeps the workers it has (idle
                # ones cost nothing, billed by their tasks; one retired now and started
                # again when the plan's rounding asks for it back costs its start-up)
                reasons[pool] += (f"; keeps its {current} workers while the run has work "
                                  f"for the pool")
                target = current
            if self.targets.get(pool) != target:
                out.append(Record(Recorded.SCALE, "", f"pool {pool!r}: {current} -> {target} "
                                    f"workers; {reasons[pool]}",
                                    {**seen, "pool": pool, "current": current,
                                     "target": target}, target=pool))
            self.targets[pool] = target
            self.reasons[pool] = reasons[pool]
            excess = current - target
            if excess <= 0:
                continue
            idle = sorted(a for a, w in snap.workers.items()
                          if by_addr[a].name == pool and w.processing == 0
                          and w.status in ("running", "paused") and a not in retiring)
            for a in idle[:excess]:
                staying = [b for b, w in snap.workers.items() if b != a and b not in retiring
                           and w.status == "running" and b not in chosen]
                if a in holding and not staying:
                    continue  # the last worker keeps the results
                idle_now.add(a)
                streak = self._idle_streak.get(a, 0) + 1
                self._idle_streak[a] = streak
                if streak >= request.wait_count:
                    chosen.add(a)
                    out.append(Decision(
                        Action.RETIRE, a, f"pool {pool!r} is above its target ({current} > "
                        f"{target}) and this worker was idle for {streak} checks",
                        {"pool": pool, "current": current, "target": target,
                         "idle_checks": streak}, target=pool))
        self._idle_streak = {a: n for a, n in self._idle_streak.items() if a in idle_now}
        return out
