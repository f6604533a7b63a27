"""The objective rule: a run under a cost objective or a budget runs as its plan says.

The run's tasks are held at the scheduler as they arrive; every tick the LP of
:func:`blockflow.pools.plan.plan` is re-solved over the held work with the speeds learned so
far, and :class:`~blockflow.pools.dispatch.PlanDispatch` hands each ready task to a worker of
the pool the plan gives its group. Guide: :doc:`/guide/pools`, "Objectives".
"""

from __future__ import annotations

import logging
import math
from statistics import median
from typing import Any

from blockflow.errors import ObjectiveError
from blockflow.pools import feasibility
from blockflow.pools import plan as cost
from blockflow.pools.dispatch import PlanDispatch, RunDispatches
from blockflow.pools.pool import pools_of, requested_pools
from blockflow.scheduling.actions import Action, Decision, Record, Recorded
from blockflow.scheduling.rules.base import Rule, RuleContext, some_tasks

__all__ = ["ObjectiveRule"]

logger = logging.getLogger("blockflow.pools.objective")


class ObjectiveRule(Rule):
    """Hold a priced run's tasks and plan where each runs; refuse impossible objectives.

    On ``"graph"``: tasks asking for an undeclared pool, and objectives that cannot be met,
    fail at once (one ``fail`` whose ``detail`` is the :class:`~blockflow.errors.ObjectiveError`);
    under a cost objective or a budget with two priced pools or more, the run's new
    unrestricted tasks are held (one ``hold`` with ``keys``). On ``"tick"``: re-plan the held
    work (a cost objective: the cheapest plan finishing by the deadline, less :attr:`tail` of
    a task per thread; a budget: the fastest within the budget left) and set the dispatch's
    shares, and which workers take work: those that began the run, and those whose share
    needs :attr:`late_start` of the plan's horizon (a worker is billed from its first task of
    the run to the run's end). When the objective can no longer be met, one ``objective``
    record and a WARNING, then every free thread takes work (deadline), or only the cheapest
    pool (budget). Gavel's LP (Narayanan et al., OSDI 2020) driving placement is blockflow's.

    Attributes
    ----------
    plans : dict
        Run id -> the latest plan (:meth:`blockflow.pools.plan.Plan.as_dict`) and its inputs.
    dispatch : RunDispatches or None
        The held tasks of the priced runs, each run's apart.
    runs : dict
        Run id -> :class:`~blockflow.scheduling.runs.Run` of each run under an objective with
        tasks still to run. Several at once are planned by one LP
        (:func:`blockflow.pools.plan.plan_runs`); one alone as above. Each miss (a deadline
        or a budget) is one ``objective`` record and one warning on the run's client, when
        it becomes certain: the plan cannot meet it, the deadline passed with tasks left,
        or at the latest when the run ends.
    """

    #: Share of a task per thread kept free before the deadline (the last task a thread
    #: starts must end in time; re-planning every tick catches the rest).
    tail = 0.5

    #: Under a deadline, the share of the time left the fastest plan must leave free for
    #: workers to begin late (:attr:`late_start`); with less, every worker the plan uses
    #: begins now.
    slack = 0.25

    #: Share of a run's deadline the plan keeps free at its end (task times are estimates,
    #: the scheduler's round trips are not in them; a blockflow heuristic).
    margin = 0.03

    #: A worker that has not begun the run begins once its share of the plan needs this much
    #: of the plan's horizon (it is then billed to the run's end).
    late_start = 0.85

    #: Under a budget, seconds after a run's latest graph before a worker that has not begun
    #: it may begin (it is then billed to the run's end): work submitted task by task is
    #: planned whole, not by its first tasks. Until then the workers that began and the pool
    #: cheapest for the work take it.
    settle = 0.25

    #: Under a budget, the plan's makespan is taken this many times longer when checking
    #: that the workers it begins fit the money left (a margin on :meth:`_paced`; a
    #: blockflow heuristic).
    overrun = 1.1

    #: A run's objective is checked again on a new graph once its work left is this many
    #: times what it was at the last check.
    recheck = 1.25

    def __init__(self):
        self._checked: dict[str, float] = {}  # run -> its work left when last checked
        self.plans: dict[str, dict[str, Any]] = {}
        self.dispatch: RunDispatches | None = None
        self.runs: dict[str, Any] = {}
        self._warned: dict[str, None] = {}  # runs whose miss was told (bounded)

    # --- graph: refuse what cannot be met, hold the run's tasks ------------------------

    def _refuse_pools(self, snap, requests) -> list[Decision]:
        if not requests:
            return []
        pools = pools_of(snap.workers)
        known = {p.name for p in pools.values()} | set(snap.declared_pools or ())
        bad: dict[str, list] = {}
        for key, resources, workers in requests:
            for name in requested_pools(resources, workers):
                if name not in known:
                    bad.setdefault(name, []).append(key)
        out = []
        for name, keys in bad.items():
            msg = (f"blockflow: {some_tasks(keys)} ask for pool {name!r}, which no worker "
                   f"declares (pools: {', '.join(sorted(known)) or 'none'}); use one of those "
                   f"names in resources={{'pool:<name>': 1}}")
            out.append(Decision(Action.FAIL, "", msg, {"pool": name, "tasks": len(keys)},
                                keys=tuple(keys), detail=ObjectiveError(msg)))
        return out

    @staticmethod
    def _all_pools(snap) -> dict:
        """Address (or ``declared:<name>`` for a pool without workers) -> its pool."""
        pools = dict(pools_of(snap.workers))
        for name, p in (snap.declared_pools or {}).items():
            pools.setdefault(f"declared:{name}", p)
        return pools

    def _on_graph(self, snap) -> list[Decision]:
        out = self._refuse_pools(snap, [
            (t.key, t.placement.get("resources"), t.placement.get("workers"))
            for t in snap.new_tasks if t.placement])
        run = snap.run
        if run is None or run.objective is None or not snap.new_tasks:
            return out
        pools = pools_of(snap.workers)
        all_pools = self._all_pools(snap)
        workers, threads = feasibility.capacity(snap, pools)
        for name in (snap.declared_pools or {}):
            workers.setdefault(name, 0)
        work = dict(run.group_pending)
        # checked on the run's first graph, then each time its work left grew by a quarter:
        # a run submitted task by task pays the check's LPs O(log tasks) times, not per task
        size = sum(work.values())
        last = self._checked.get(run.id)
        why = ""
        if last is None or size >= self.recheck * last:
            self._checked[run.id] = size
            why = feasibility.check_objective(run.objective, all_pools, work,
                                              feasibility.seconds(snap, all_pools, work),
                                              workers, threads)
        if why:
            self._checked.pop(run.id, None)
            keys = tuple(t.key for t in snap.new_tasks)
            return out + [Decision(Action.FAIL, "", why, {"objective": run.objective.as_dict(),
                                                          "run": run.id, "tasks": len(keys)},
                                   keys=keys, detail=ObjectiveError(why))]
        self.runs[run.id] = run  # its misses are told; planned with the others open
        priced = {p.name for p in all_pools.values() if p.price is not None}
        if not run.objective.needs_prices or len(priced) < 2:
            return out
        if self.dispatch is None:
            self.dispatch = RunDispatches()
        keys = [t.key for t in snap.new_tasks
                if not t.restricted and t.state in ("released", "queued")]
        if keys:
            self.dispatch.hold(keys, run_id=run.id)
            out.append(Decision(Action.HOLD, "", f"{len(keys)} tasks held for the plan",
                                {"tasks": len(keys)}, keys=tuple(keys)))
        return out

    def _release(self, d: PlanDispatch | None, why: str) -> list[Decision]:
        """Hand ``d``'s held tasks back to distributed's placement."""
        if d is None or not d.holds():
            return []
        keys = tuple(k for where in (d.waiting, d.ready) for g in where.values() for k in g)
        return [Decision(Action.RELEASE, "", f"{len(keys)} held tasks released: {why}",
                         keys=keys, detail={"stimulus": f"blockflow-plan-release-{why}",
                                            "count": False})]

    # --- tick: re-plan --------------------------------------------------------------

    def run(self, snap, context: RuleContext) -> list[Decision]:
        if snap.event == "graph":
            return self._on_graph(snap)
        if snap.event != "tick":
            return []
        out = self._refuse_pools(snap, [(key, need, None) for key, need in
                                        (snap.unsatisfiable or ())])
        return out + self._tick(snap)

    def _tick(self, snap) -> list[Decision]:
        out: list = []
        disp = self.dispatch
        for run in [r for r in self.runs.values() if r.pending <= 0]:  # ended
            del self.runs[run.id]
            self._checked.pop(run.id, None)
            while len(self.plans) > 200:  # the latest runs' plans stay for status
                del self.plans[next(iter(self.plans))]
            out += self._ended(run, snap)
            d = disp.drop(run.id) if disp is not None else None
            out += self._release(d, "its run ended")
        planned = [r for r in self.runs.values() if disp is not None and r.id in disp.runs
                   and disp.runs[r.id].holds()]
        if len(planned) == 1:
            out += self._tick_run(snap, planned[0], disp.runs[planned[0].id])
        elif planned:
            out += self._tick_joint(snap, planned)
        for run in list(self.runs.values()):
            o = run.objective
            if o.deadline is not None and snap.time > run.deadline_at:
                out += self._missed(run, (
                    f"deadline missed: {o.deadline:g} s passed {snap.time - run.deadline_at:.1f}"
                    f" s ago with {run.pending} tasks of the run left; the run goes on"),
                    {"deadline": o.deadline, "pending": run.pending})
        return out

    def _ended(self, run, snap) -> list[Record]:
        """A miss not told before, told as the run ends (``run.ended``; a run whose tasks
        were all cancelled has none, and no miss)."""
        o, end = run.objective, run.ended
        if end is None:
            return []
        if o.deadline is not None and end > run.deadline_at:
            return self._missed(run, (
                f"deadline missed: the run took {end - run.started:.1f} s, its deadline was "
                f"{o.deadline:g} s"), {"deadline": o.deadline,
                                       "took": round(end - run.started, 3)})
        if o.budget is not None:
            lifetimes = snap.lifetimes or {}
            c = cost.run_cost(lifetimes, (run.started, end),
                              first_use={a: s[0] for a, s in run.spans.items()},
                              busy=run.busy, busy_cost=run.busy_cost, shared=run.shared,
                              crossings=[(a, b, n) for (a, b), n in run.crossings.items()])
            if c["total_cost"] > o.budget * (1 + 1e-9):
                return self._missed(run, (
                    f"budget missed: the run cost ${c['total_cost']:.4g}, its budget was "
                    f"${o.budget:.4g}"), {"budget": o.budget,
                                          "cost": round(c["total_cost"], 6)})
        return []

    def _tick_run(self, snap, run, d: PlanDispatch) -> list[Decision]:
        """Re-plan one run's held work alone (see the class docstring)."""
        pools = pools_of(snap.workers)
        by_name = {p.name: p for p in pools.values()}
        workers, threads = feasibility.capacity(snap, pools)
        held = {g: len(d.waiting.get(g, ())) + len(d.ready.get(g, ()))
                for g in set(d.waiting) | set(d.ready)}
        held = {g: n for g, n in held.items() if n > 0}
        seconds = self._paced(feasibility.seconds(snap, pools, held), run, pools, snap.time)
        d.first = {g: self._cheapest(by_name, g, workers) for g in held if g not in seconds}
        work = {g: n for g, n in held.items() if g in seconds}
        running = {a: tasks for a, tasks in snap.running.items() if a in pools}
        # workers billed to the run's end already: those that ran or hold its tasks, and
        # those that arrived during it (billed from their arrival)
        lifetimes = snap.lifetimes or {}
        begun = {a for a in snap.workers if a in run.spans or a in d.sent.values()
                 or (a in lifetimes and lifetimes[a][1] >= run.started)}
        sunk: dict[str, int] = {}  # pool -> workers billed to the run's end already
        for a in begun:
            if a in pools and snap.workers[a].status == "running":
                sunk[pools[a].name] = sunk.get(pools[a].name, 0) + 1
        if not work or not workers:
            d.quota, d.seconds, d.greedy, d.finish_by = {}, seconds, False, None
            d.active = begun | {a for a, p in pools.items() if p.name in d.first.values()}
            return []
        # what the running tasks still take, by pool (thread-seconds)
        remaining: dict[str, float] = {}
        for a, tasks in running.items():
            name = pools[a].name
            for t in tasks:
                t_task = seconds.get(t.group, {}).get(name, t.duration)
                remaining[name] = remaining.get(name, 0.0) + max(t_task - t.elapsed, 0.0)
        egress = feasibility.egress(snap, pools, work)
        obj = run.objective
        typical = {name: median(row[name] for row in seconds.values() if name in row)
                   for name in workers}
        if obj.kind == "cost":
            until = (run.deadline_at - snap.time) if run.deadline_at is not None else 1e12
            # :attr:`margin` of the run's deadline kept free: the plan's ends are estimates
            left = until - self.margin * (run.objective.deadline or 0.0)
            # worker-equivalents each pool has until the deadline: less what its running
            # tasks still take and :attr:`tail` of a task per thread
            usable = {name: max(n * threads[name] * left - remaining.get(name, 0.0)
                                - self.tail * typical[name] * n * threads[name], 0.0)
                      / (threads[name] * left) if left > 0 else 0.0
                      for name, n in workers.items()}
            plan = (cost.plan(work, seconds, by_name, usable, threads=threads, deadline=left,
                              egress=egress, sunk=sunk) if left > 0 else None)
            if plan is None or not plan.feasible:
                fastest = cost.plan(work, seconds, by_name, workers, threads=threads)
                finish = fastest.makespan + max(typical.values())
                d.quota, d.seconds, d.greedy = fastest.tasks, seconds, True
                d.active, d.finish_by = set(snap.workers), None
                when = (f"{until:.1f} s left to the deadline" if until > 0 else
                        f"the deadline passed {-until:.1f} s ago")
                return self._missed(run, (
                    f"deadline can no longer be met: projected finish in {finish:.1f} s with "
                    f"every pool, {when}; every free worker takes work"),
                    {"deadline_in": round(until, 3), "projected_finish_in": round(finish, 3)})
            horizon, finish_by = left, run.deadline_at
            extra, out = {}, []
            # a tight deadline (the fastest plan needs most of the time left) starts every
            # worker the plan uses now: a late start saves less than a slip costs
            fastest = cost.plan(work, seconds, by_name, usable, threads=threads)
            tight = fastest.feasible and fastest.makespan > (1 - self.slack) * left
        else:
            spent = self.spent(run, snap)
            committed = sum(by_name[n].price_per_second * r / threads.get(n, 1)
                            for n, r in remaining.items())
            # a task of the dearest pool kept back: the plan is fractional, tasks are not
            reserve = max((by_name[n].price_per_second * t / threads.get(n, 1)
                                 for row in seconds.values() for n, t in row.items()
                                 if n in workers), default=0.0)
            left = obj.budget - spent - committed - reserve
            plan, active = self._budget_plan(snap, pools, by_name, work, seconds, workers,
                                             threads, egress, begun, sunk, obj.budget - spent
                                             - committed - reserve, left)
            extra = {"spent": round(spent, 6), "committed": round(committed, 6)}
            out = []
            if plan is None:
                # no new worker fits the budget: those that began the run (billed to its end
                # whatever they do) finish it as soon as they can, which is also the cheapest
                caps = {n: sunk.get(n, 0) for n in workers}
                if not any(caps.values()):
                    keep = self._cheapest(by_name, next(iter(work)), workers)
                    caps[keep] = workers[keep]
                plan = cost.plan(work, seconds, by_name, caps, threads=threads,
                                 egress=egress, sunk=sunk)
                active = begun | {a for a, p in pools.items() if caps.get(p.name, 0) > 0
                                  and a not in begun and not sunk.get(p.name)}
                projected = spent + committed + plan.cost
                one_task = max((by_name[n].price_per_second * t for row in seconds.values()
                                for n, t in row.items() if caps.get(n)), default=0.0)
                if projected > obj.budget + one_task:
                    out = self._missed(run, (
                        f"budget can no longer be met: spent ${spent:.4g} of "
                        f"${obj.budget:.4g}, projected ${projected:.4g} with the workers "
                        f"that began the run finishing it; no other worker takes work"),
                        {"budget": obj.budget, **extra, "projected_cost": round(projected, 6)})
            horizon = plan.makespan
            finish_by = snap.time + horizon
        # shares only for groups with tasks ready now: where their inputs are is known (a
        # group whose inputs do not exist yet is placed once they do, priced by the tick)
        d.quota = {g: dict(row) for g, row in plan.tasks.items() if d.ready.get(g)}
        d.seconds, d.greedy, d.finish_by, d.egress = seconds, False, finish_by, egress
        d.due = run.deadline_at if obj.kind == "cost" else finish_by
        # with no worker begun, the pool with most of the plan's work begins now: begun
        # later it would only end the run later (a worker is billed from its first task to
        # the run's end); a late start saves money beside a worker billed to the end already
        now_pool = (None if any(sunk.values()) or not plan.busy
                    else max(sorted(plan.busy), key=lambda n: plan.busy[n]))
        d.active = (active if obj.kind != "cost"
                    else self._active(snap, pools, plan, horizon, begun, late=not tight,
                                      now_pool=now_pool))
        if obj.kind != "cost" and snap.time - run.last_graph < self.settle:
            # the run's graph is still arriving: a budget is not spent on its first tasks
            cheapest = self._cheapest(by_name, max(work, key=work.get), workers)
            d.active = begun | {a for a, p in pools.items() if p.name == cheapest}
        self.plans[run.id] = {"objective": obj.as_dict(), "plan": plan.as_dict(),
                              "work": work, "seconds": seconds, "time": snap.time,
                              "dispatch": d.as_dict(), **extra}
        return out

    def _tick_joint(self, snap, runs) -> list[Decision]:
        """Re-plan several runs' held work at once (:func:`blockflow.pools.plan.plan_runs`):
        each run's shares are what the one LP gives it beside the others. A run the LP
        cannot fit (the latest deadline first, then the budgets) is told missed: a deadline's
        run then takes every free thread, a budget's only the cheapest pool."""
        pools = pools_of(snap.workers)
        by_name = {p.name: p for p in pools.values()}
        workers, threads = feasibility.capacity(snap, pools)
        if not workers:
            return []
        disp, out = self.dispatch, []
        specs: dict[str, cost.RunWork] = {}
        missed: dict[str, str] = {}
        for run in runs:
            d = disp.runs[run.id]
            held = {g: n for g, n in {g: len(d.waiting.get(g, ())) + len(d.ready.get(g, ()))
                                      for g in set(d.waiting) | set(d.ready)}.items() if n}
            seconds = self._paced(feasibility.seconds(snap, pools, held), run, pools,
                                  snap.time)
            d.first = {g: self._cheapest(by_name, g, workers) for g in held
                       if g not in seconds}
            work = {g: n for g, n in held.items() if g in seconds}
            d.seconds, d.egress = seconds, feasibility.egress(snap, pools, work)
            if not work:
                d.quota, d.greedy, d.finish_by = {}, False, None
                d.active = set(snap.workers)
                continue
            o = run.objective
            if o.kind == "cost":
                typical = max(median(row[n] for row in seconds.values() if n in row)
                              for n in workers)
                left = (run.deadline_at - snap.time - self.margin * o.deadline
                        - self.tail * typical)
                d.due = run.deadline_at
                if left <= 0:
                    missed[run.id] = "deadline"
                    continue
                specs[run.id] = cost.RunWork(work, seconds, deadline=left, egress=d.egress)
            else:
                reserve = max((by_name[n].price_per_second * t / threads.get(n, 1)
                               for row in seconds.values() for n, t in row.items()
                               if n in workers), default=0.0)
                specs[run.id] = cost.RunWork(work, seconds, budget=max(
                    o.budget - self.spent(run, snap) - reserve, 0.0), egress=d.egress)
        plans = cost.plan_runs(specs, by_name, workers, threads=threads)
        # what cannot fit: the latest deadline first, then the budgets
        order = sorted((r for r in specs if specs[r].deadline is not None),
                       key=lambda r: -specs[r].deadline)
        order += [r for r in specs if specs[r].deadline is None]
        while plans is None and order:
            r = order.pop(0)
            missed[r] = "deadline" if specs[r].deadline is not None else "budget"
            spec = specs.pop(r)
            if missed[r] == "budget":  # only the cheapest pool, as fast as it can
                name = self._cheapest(by_name, max(spec.work, key=spec.work.get), workers)
                specs[r] = cost.RunWork(spec.work, {g: {name: row[name]} for g, row in
                                                    spec.seconds.items() if name in row})
            plans = cost.plan_runs(specs, by_name, workers, threads=threads)
        plans = plans or {}
        by_id = {r.id: r for r in runs}
        for rid, why in missed.items():
            run, d = by_id[rid], disp.runs[rid]
            if why == "deadline":
                d.greedy, d.finish_by, d.active = True, None, set(snap.workers)
                work = {g: n for g, n in d.ready_count().items() if g in d.seconds}
                fastest = cost.plan(work, d.seconds, by_name, workers, threads=threads)
                d.quota = fastest.tasks
                out += self._missed(run, (
                    f"deadline can no longer be met beside the other runs: "
                    f"{run.deadline_at - snap.time:.1f} s left; every free worker takes "
                    f"its work"), {"deadline_in": round(run.deadline_at - snap.time, 3)})
            else:
                out += self._missed(run, (
                    f"budget can no longer be met beside the other runs: spent "
                    f"${self.spent(run, snap):.4g} of ${run.objective.budget:.4g}; only the "
                    f"cheapest pool takes its work"), {"budget": run.objective.budget})
        for rid, plan in plans.items():
            run, d = by_id[rid], disp.runs[rid]
            if missed.get(rid) != "budget":
                d.greedy = False
            d.quota = {g: dict(row) for g, row in plan.tasks.items() if d.ready.get(g)}
            d.finish_by = snap.time + plan.makespan
            if run.objective.kind != "cost":
                d.due = d.finish_by
            begun = {a for a in snap.workers if a in run.spans or a in d.sent.values()}
            d.active = self._active(snap, pools, plan, plan.makespan, begun, late=False)
            self.plans[rid] = {"objective": run.objective.as_dict(), "plan": plan.as_dict(),
                               "work": specs[rid].work, "seconds": specs[rid].seconds,
                               "time": snap.time, "dispatch": d.as_dict(),
                               "joint": sorted(plans)}
        return out

    def _budget_plan(self, snap, pools, by_name, work, seconds, workers, threads, egress,
                     begun, sunk, future_budget, left):
        """The fastest plan within the budget left, and the workers it uses.

        The LP within the budget says how many workers of each pool to use (:meth:`_active`);
        as they are billed from their first task to the run's end, the plan they run is the
        fastest with them, and it must fit ``future_budget`` over its makespan (times
        :attr:`overrun`, plus the slowest pool's last task). Otherwise new workers are dropped,
        dearest first. ``(None, set())`` when none fits."""
        caps = dict(workers)
        for _ in range(sum(workers.values()) + 1):
            if left <= 0:
                return None, set()
            plan = cost.plan(work, seconds, by_name, caps, threads=threads, budget=left,
                             egress=egress, sunk=sunk)
            if not plan.feasible:
                return None, set()
            active = self._active(snap, pools, plan, plan.makespan, begun)
            using: dict[str, int] = {}
            for a in active:
                if a in pools:
                    using[pools[a].name] = using.get(pools[a].name, 0) + 1
            run = cost.plan(work, seconds, by_name, {n: using.get(n, 0) for n in workers},
                            threads=threads, egress=egress, sunk=sunk)
            if not run.feasible:
                return None, set()
            # billed to the run's end: the plan's makespan, and the last task of the
            # slowest pool working (the plan is fractional, tasks are not)
            last = max((seconds[g][p] for g in work for p in using if p in seconds[g]),
                       default=0.0)
            dollars = sum(by_name[pools[a].name].price_per_second for a in active
                          if a in pools) * (run.makespan * self.overrun + last)
            dollars += sum(n * egress.get(g, {}).get(p, 0.0)
                           for g, row in run.tasks.items() for p, n in row.items())
            newcomers = [a for a in active if a not in begun and a in pools]
            if dollars <= future_budget or not newcomers:
                return run, active
            dearest = max(newcomers, key=lambda a: (pools[a].price_per_second, a))
            name = pools[dearest].name
            caps[name] = max(using.get(name, 0) - 1, sunk.get(name, 0))
        return None, set()

    def _active(self, snap, pools, plan, horizon: float, begun: set,
                late: bool = True, now_pool: str | None = None) -> set[str]:
        """The workers that take the run's tasks: those that began it, and of each pool as
        many more as its planned busy time needs, the last one (all, with ``late``; but in
        pool ``now_pool``) only once its share needs :attr:`late_start` of ``horizon``."""
        active = set(begun)
        if horizon <= 0:
            return active | set(snap.workers)
        for name in sorted({p.name for p in pools.values()}):
            members = sorted(a for a, p in pools.items() if p.name == name
                             and snap.workers[a].status == "running")
            have = sum(1 for a in members if a in begun)
            extra = plan.busy.get(name, 0.0) - have * horizon
            if extra <= 0:
                continue
            whole = math.floor(extra / horizon + 1e-9)
            rest = extra - whole * horizon
            wait = self.late_start if late and name != now_pool else 0.0
            more = whole + (1 if rest >= wait * horizon and rest > 1e-9 else 0)
            active |= set([a for a in members if a not in begun][:more])
        return active

    @staticmethod
    def _paced(seconds, run, pools, now: float) -> dict:
        """``seconds`` (group -> pool -> seconds per task, as measured: compute only) at the
        pace the run's workers keep: divided by each pool's median share of a worker's time
        from its first task's start to its last's end spent running tasks (within 0.5-1; the
        gaps between tasks, the scheduler's round trips, count in the makespan and bill)."""
        shares: dict[str, list[float]] = {}
        for a, (first, last) in run.spans.items():
            if a in pools and last - first > 1.0 and run.busy.get(a):
                shares.setdefault(pools[a].name, []).append(run.busy[a] / (last - first))
        pace = {name: min(max(median(v), 0.5), 1.0) for name, v in shares.items()}
        return {g: {p: t / pace.get(p, 1.0) for p, t in row.items()}
                for g, row in seconds.items()}

    @staticmethod
    def _cheapest(by_name, group, workers) -> str:
        """The pool with workers cheapest per unit of ``group``'s work by the pools' priors."""
        names = [n for n in by_name if workers.get(n, 0) > 0] or list(by_name)
        return min(names, key=lambda n: ((by_name[n].price or 0.0)
                                         / (by_name[n].speed_of(group) or 1.0), n))

    @staticmethod
    def spent(run, snap) -> float:
        """Dollars ``run`` cost by now, billed as :func:`blockflow.pools.plan.run_cost` bills
        (compute and idle; egress aside)."""
        lifetimes = snap.lifetimes or {}
        billed = cost.run_cost(lifetimes, (run.started, snap.time),
                               first_use={a: s[0] for a, s in run.spans.items()},
                               busy=run.busy, busy_cost=run.busy_cost,
                               shared=run.shared)
        return billed["compute_cost"] + billed["idle_cost"]

    def _missed(self, run, reason: str, seen: dict) -> list[Record]:
        """One ``objective`` record (a WARNING, and a warning on the run's client) the first
        time ``run``'s objective is missed; nothing after."""
        if run.id in self._warned:
            return []
        self._warned[run.id] = None
        while len(self._warned) > 10_000:
            del self._warned[next(iter(self._warned))]
        return [Record(Recorded.OBJECTIVE, "", f"run {run.id}: {reason}",
                       {"run": run.id, "objective": run.objective.as_dict(), **seen},
                       target=run.id, detail={"warning": True, "client": run.client,
                                                     "scope": run.scope})]
