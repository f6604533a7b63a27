"""The pool-scaling rule: how many workers each pool should have now, and which idle workers a
shrinking pool gives back.

Targets come from the LP of :func:`blockflow.pools.plan.plan` over the work left, within each
pool's bounds: the cheapest sizes meeting a deadline, the fastest a budget pays for, or
without an objective the cheapest finishing the backlog within ``target_duration``. Under a
deadline a worker not joined yet has the time left less its pool's start-up. Targets have
hysteresis: a pool's target is the most the LP asked of it over the last ``hold`` seconds
(as distributed's ``Adaptive`` keeps its recommendations for ``wait_count`` checks), so it
never goes down and straight back up, and a worker is kept at least ``hold`` seconds after
it arrives; only a budget that can no longer pay for a pool overrides both. The hold keeps
what an objective's plan asked for: a run without an objective scales as distributed's
``Adaptive`` does (targets from the backlog, no hold). Only idle workers are retired, after
``wait_count`` idle checks (dask-kubernetes#914). A blockflow heuristic on Gavel's LP (OSDI
2020). Guide: :doc:`/guide/pools`.
"""

from __future__ import annotations

import math
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
    target_duration : float
        Seconds the backlog should take without an objective
        (``distributed.adaptive.target-duration``).
    startup : float or dict of str to float
        Seconds a new worker takes to join: one for every pool, or pool name -> seconds
        (pools not named take the median of those given).
    wait_count : int
        Consecutive idle checks before a worker is retired.
    hold : float
        Seconds a worker is kept after it arrives, and a pool's target kept after the LP
        asked for it, while the run has an objective (``blockflow.scaling.hold``; 0 turns
        the hysteresis off).
    interval : float
        Seconds between two checks.
    """

    pools: dict[str, Pool]
    bounds: dict[str, tuple[int, int]]
    starting: dict[str, int] = field(default_factory=dict)
    threads: dict[str, int] = field(default_factory=dict)
    target_duration: float = 5.0
    startup: float | dict[str, float] = 5.0
    wait_count: int = 3
    hold: float = 0.0
    interval: float = 1.0

    def startup_of(self, pool: str) -> float:
        """Seconds a new worker of ``pool`` takes to join."""
        if not isinstance(self.startup, Mapping):
            return float(self.startup)
        if pool in self.startup:
            return float(self.startup[pool])
        return float(median(self.startup.values())) if self.startup else 5.0


def _speed_hint(pool: Pool) -> float | None:
    """The declared relative speed of ``pool``: its ``speed``, the median of a per-group
    mapping's values, or None when it declares none."""
    speed = pool.speed
    if isinstance(speed, Mapping):
        values = [float(v) for v in speed.values() if v]
        return median(values) if values else None
    return float(speed) if speed else None


def _pool_speeds(snap, pools: Mapping[str, Pool], by_addr) -> tuple[dict, dict]:
    """Pool name -> typical relative speed, and pool name -> where it comes from.

    The median learned speed of the pool's workers once the speed model compared workers of
    two pools or more (``"learned"``), else the pool's hint (``"declared"``), else 1.0
    (``"assumed"``).
    """
    learned: dict[str, list[float]] = {}
    for a, w in snap.workers.items():
        if w.speed and getattr(w, "speed_confidence", 0.0) > 0:
            learned.setdefault(by_addr[a].name, []).append(w.speed)
    compared = len(learned) >= 2
    speeds, source = {}, {}
    for name, pool in pools.items():
        hint = _speed_hint(pool)
        if compared and learned.get(name):
            speeds[name], source[name] = median(learned[name]), "learned"
        elif hint is not None:
            speeds[name], source[name] = hint, "declared"
        else:
            speeds[name], source[name] = 1.0, "assumed"
    return speeds, source


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


def _workers_for(busy: float, joined: int, hi: int, warm: float, cold: float) -> int:
    """Workers that run ``busy`` worker-seconds: ``joined`` ones have ``warm`` seconds, new
    ones ``cold`` (the time left less the start-up); at most ``hi``."""
    if busy <= 1e-9:
        return 0
    if busy <= joined * warm + 1e-9:
        return math.ceil(busy / warm - 1e-6)
    if cold <= 0:
        return hi
    return min(joined + math.ceil((busy - joined * warm) / cold - 1e-6), hi)


class PoolScalingRule:
    """Per-pool worker targets and the idle workers a shrinking pool retires.

    Attributes
    ----------
    targets : dict of str to int
        Pool name -> the latest target (after the hysteresis).
    reasons : dict of str to str
        Pool name -> why it has that target.
    arrived : dict of str to float
        Worker address -> when it joined, seconds since the epoch (the scheduler plugin
        notes it; a worker it did not is taken as arrived when first seen).
    """

    #: Under a deadline, a pool with no worker that is dearer per unit of work than the
    #: cheapest starts once its share needs this much of what its maximum could do by the
    #: deadline if asked one check later and twice as slow to join as measured: started
    #: later, its workers are billed less idle time; started then, the share still fits
    #: with its speed up to 1/late_start times slower than planned.
    late_start = 0.8

    def __init__(self):
        self.targets: dict[str, int] = {}
        self.reasons: dict[str, str] = {}
        self.arrived: dict[str, float] = {}
        self._idle_streak: dict[str, int] = {}
        self._asked: dict[str, list[tuple[float, int]]] = {}  # pool -> (time, LP's target)

    def size(self, snap, request: ScalingRequest, run, reference: Mapping[str, float],
             spent: float = 0.0) -> tuple[dict[str, int], dict[str, str], dict[str, Any]]:
        """What the LP asks of each pool now, before the hysteresis: targets, reasons and the
        numbers behind them (``seen``; ``seen["urgent"]``: pools a budget can no longer pay
        for, whose drop is acted on at once). No decisions.
        """
        pools = request.pools
        lo = {p: int(request.bounds[p][0]) for p in pools}
        hi = {p: int(request.bounds[p][1]) for p in pools}
        work = dict(run.group_pending) if run is not None else {}
        work = {g: n for g, n in work.items() if n > 0}
        if not work:
            return (dict(lo), {p: f"no work left: pool {p!r} at its minimum ({lo[p]})"
                               for p in pools}, {"backlog": 0})
        by_addr = pools_of(snap.workers)
        speeds, source = _pool_speeds(snap, pools, by_addr)
        seconds = _fill_seconds(snap.throughput or {}, work, reference, pools, speeds)
        threads = {p: max(int(request.threads.get(p, 1)), 1) for p in pools}
        joined = {p: self._joined(snap, p, by_addr) for p in pools}
        objective = run.objective
        seen: dict[str, Any] = {"backlog": sum(work.values()),
                                "objective": objective.kind if objective else "makespan"}
        cheapest = min(pools, key=lambda p: ((pools[p].price or 0.0) / speeds[p], p))
        later: dict[str, str] = {}
        if objective is not None and objective.kind == "cost" and run.deadline_at is not None:
            left = run.deadline_at - snap.time
            tail = max(max(row.values()) for row in seconds.values())
            warm = left - tail  # a joined worker's time to the deadline, one last task spared
            cold = {p: warm - request.startup_of(p) for p in pools}
            seen.update(deadline_in=round(left, 3), horizon=round(warm, 3))
            # a worker not joined yet runs from its start-up on: the LP sees each pool's
            # joined workers at the full horizon, the rest at the horizon less its start-up
            avail = {p: (min(joined[p], hi[p]) + max(hi[p] - joined[p], 0)
                         * max(cold[p], 0.0) / warm) if warm > 0 else 0.0 for p in pools}
            plan = (cost.plan(work, seconds, pools, avail, threads=threads, deadline=warm)
                    if warm > 0 else None)
            if plan is None or not plan.feasible:
                why = (plan.shortfall if plan is not None else "no time left")
                return self._late(work, seconds, pools, request, joined, lo, hi, threads,
                                  f"deadline in {left:.1f} s cannot be met by the cheapest "
                                  f"sizes ({why})", seen)
            needed = {p: _workers_for(plan.busy.get(p, 0.0), joined[p], hi[p], warm, cold[p])
                      for p in pools}
            what = (f"cheapest sizes finishing {seen['backlog']} tasks within the "
                    f"deadline (in {left:.1f} s, {warm:.1f} s before one last task, less "
                    f"start-up for workers not joined)")
            for p in pools:
                # a dearer pool with no worker yet starts once its share needs late_start of
                # what its maximum could still do if asked at the next check and slow to
                # start (twice its start-up): its workers are billed little idle, and the
                # share still fits
                room = hi[p] * (cold[p] - request.startup_of(p) - request.interval)
                if (p != cheapest and needed[p] > 0 and room > 0
                        and joined[p] + int(request.starting.get(p, 0)) == 0
                        and plan.busy.get(p, 0.0) < self.late_start * room):
                    later[p] = (f"; starts later: its share is {plan.busy[p]:.1f} of the "
                                f"{room:.1f} worker-seconds its maximum would still have "
                                f"if started at the next check, slowly")
                    needed[p] = 0
        elif objective is not None and objective.budget is not None:
            left_budget = objective.budget - spent
            seen.update(budget_left=round(left_budget, 6))
            plan = (cost.plan(work, seconds, pools, hi, threads=threads, budget=left_budget)
                    if left_budget > 0 else None)
            if plan is None or not plan.feasible:
                seen["urgent"] = sorted(p for p in pools if p != cheapest)
                return ({p: (max(lo[p], 1) if p == cheapest else lo[p]) for p in pools},
                        {p: f"budget left ${left_budget:.4g} pays for no faster sizes: "
                            f"only the cheapest pool {cheapest!r} works" for p in pools}, seen)
            needed = dict(plan.workers_needed)
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
        targets = {p: min(max(needed.get(p, 0), lo[p]), hi[p]) for p in pools}
        seen.update(plan_cost=round(plan.cost, 6), plan_makespan=round(plan.makespan, 3),
                    speeds={p: round(s, 3) for p, s in speeds.items()})
        reasons = {p: f"{what}: pool {p!r} needs {needed.get(p, 0)} "
                      f"(bounds {lo[p]}..{hi[p]}, ${pools[p].price or 0:g}/h, "
                      f"speed {speeds[p]:.2g}x {source[p]}){later.get(p, '')}" for p in pools}
        return targets, reasons, seen

    @staticmethod
    def _late(work, seconds, pools, request, joined, lo, hi, threads, why: str,
              seen: dict) -> tuple[dict[str, int], dict[str, str], dict[str, Any]]:
        """Targets once a deadline will be missed: every pool at its maximum, but for a pool
        whose new workers would join after the workers there have finished the work left."""
        have = {p: joined[p] + int(request.starting.get(p, 0)) for p in pools}
        done = (cost.plan(work, seconds, pools, have, threads=threads)
                if any(have.values()) else None)
        left = done.makespan if done is not None and done.feasible else math.inf
        seen.update(done_in=round(left, 3) if math.isfinite(left) else None)
        targets, reasons = {}, {}
        for p in pools:
            if left > request.startup_of(p) + request.interval:
                targets[p] = hi[p]
                reasons[p] = f"{why}: every pool at its maximum ({hi[p]})"
            else:
                targets[p] = min(max(have[p], lo[p]), hi[p])
                reasons[p] = (f"{why}: the workers there finish the work left in "
                              f"{left:.1f} s, before a new worker of pool {p!r} would join: "
                              f"it keeps {targets[p]}")
        return targets, reasons, seen

    @staticmethod
    def _joined(snap, pool: str, by_addr) -> int:
        return sum(1 for a, w in snap.workers.items() if by_addr[a].name == pool
                   and w.status in ("running", "paused"))

    def _current(self, snap, request, pool: str, by_addr) -> int:
        return self._joined(snap, pool, by_addr) + int(request.starting.get(pool, 0))

    def _smooth(self, pool: str, asked: int, now: float, hold: float,
                urgent: bool) -> int:
        """The most the LP asked of ``pool`` over the last ``hold`` seconds (``asked`` now)."""
        if urgent:
            self._asked[pool] = [(now, asked)]
            return asked
        recent = [(t, n) for t, n in self._asked.get(pool, ()) if t >= now - hold]
        recent.append((now, asked))
        self._asked[pool] = recent
        return max(n for _, n in recent)

    def run(self, snap, request: ScalingRequest, run, reference: Mapping[str, float],
            spent: float = 0.0, retiring: frozenset = frozenset(),
            holding: frozenset = frozenset()) -> list[Decision]:
        """``scale`` records for targets that change what the pool has, ``retire`` for idle
        workers of pools above theirs, past their hold (under an objective; none without:
        as distributed's ``Adaptive``); a worker holding results (``holding``) only while
        another running worker can take them (``retiring``: being retired already).
        """
        asked, reasons, seen = self.size(snap, request, run, reference, spent)
        urgent = set(seen.pop("urgent", ()))
        by_addr = pools_of(snap.workers)
        # the hold keeps what an objective's plan asked for; without an objective nothing
        # asked for these workers but the backlog, and idle ones go after wait_count checks
        # as distributed's Adaptive lets them (issue 39: kept 12.9 s where plain took 0.8 s)
        objective = run is not None and run.objective is not None
        now, hold = snap.time, max(float(request.hold), 0.0) if objective else 0.0
        # when each worker arrived: the plugin's billing record (a worker it did not see
        # arrive is taken as arrived when first seen)
        lifetimes = snap.lifetimes or {}
        for a in snap.workers:
            life = lifetimes.get(a)
            self.arrived[a] = life[1] if life is not None else self.arrived.get(a, now)
        out = []
        idle_now: set[str] = set()
        chosen: set[str] = set()
        for pool, want in sorted(asked.items()):
            current = self._current(snap, request, pool, by_addr)
            target = self._smooth(pool, want, now, hold, pool in urgent)
            if target > want:
                reasons[pool] += (f"; keeps a target of {target}: the most it needed in the "
                                  f"last {hold:g} s (hold)")
            if self.targets.get(pool, current) != target and target != current:
                out.append(Record(Recorded.SCALE, "", f"pool {pool!r}: {current} -> {target} "
                                    f"workers; {reasons[pool]}",
                                    {**seen, "pool": pool, "current": current,
                                     "target": target}, target=pool))
            self.targets[pool] = target
            self.reasons[pool] = reasons[pool]
            excess = current - target
            if excess <= 0:
                continue
            # idle workers past their hold (all idle ones where a budget cannot pay), those
            # that arrived first first
            idle = sorted((a for a, w in snap.workers.items()
                           if by_addr[a].name == pool and w.processing == 0
                           and w.status in ("running", "paused") and a not in retiring
                           and (pool in urgent or now - self.arrived[a] >= hold)),
                          key=lambda a: (self.arrived[a], a))
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
                    age = now - self.arrived[a]
                    out.append(Decision(
                        Action.RETIRE, a, f"pool {pool!r} is above its target ({current} > "
                        f"{target}) and this worker was idle for {streak} checks, "
                        f"{age:.1f} s after it arrived"
                        + ("; the budget cannot pay for it" if pool in urgent else ""),
                        {"pool": pool, "current": current, "target": target,
                         "idle_checks": streak, "age": round(age, 3)}, target=pool))
        self._idle_streak = {a: n for a, n in self._idle_streak.items() if a in idle_now}
        return out

    def forget(self, worker: str) -> None:
        """Drop what the rule knows of a worker that left."""
        self.arrived.pop(worker, None)
        self._idle_streak.pop(worker, None)
