"""The objective rule: keep a run's work on the pools its objective pays for.

Under :func:`blockflow.objective` the LP of :func:`blockflow.pools.plan.plan` is re-solved
each tick for the work left; pools it gives no more work are *parked* (paused on the
scheduler), pools it needs are unparked. Without a cost objective or budget nothing is
parked. Guide: :doc:`/guide/pools`, "Objectives".
"""

from __future__ import annotations

import logging
import math
from statistics import median
from typing import Any

from blockflow.pools import plan as cost
from blockflow.errors import ObjectiveError
from blockflow.scheduling.actions import Action, Decision, Record, Recorded
from blockflow.pools import feasibility
from blockflow.pools.pool import pools_of, requested_pools
from blockflow.scheduling.rules.base import Rule, RuleContext, some_tasks

__all__ = ["ObjectiveRule"]

logger = logging.getLogger("blockflow.pools.objective")

_GB = 1e9

class ObjectiveRule(Rule):
    """Park and unpark pools for the current run's objective; refuse impossible ones.

    On ``"graph"``: tasks asking for an undeclared pool, and objectives that cannot be met, fail
    at once (one ``fail`` whose ``detail`` is the :class:`~blockflow.errors.ObjectiveError`).
    On ``"tick"``: plan the run's remaining work (time to the deadline less one slow task, or
    the budget left); unpark pools the plan needs more of, park those holding their plan
    (except the one with most work to take). When the objective can no longer be met, one
    ``objective`` record and a WARNING. A blockflow heuristic on Gavel's LP (OSDI 2020).

    Attributes
    ----------
    plans : dict
        Run id -> the latest plan (:meth:`blockflow.pools.plan.Plan.as_dict`) and its inputs.
    """

    #: Share of a task per thread kept free before the deadline (the last task a thread
    #: starts must end in time; re-planning every tick catches the rest).
    tail = 0.5

    #: Under a deadline, a pool that has not begun the run starts its share once the share
    #: needs this much of the pool's time left to the deadline (the rest is slack).
    late_start = 0.85

    #: Under a deadline, tasks per thread a working pool takes beyond its plan before it
    #: is parked (insurance against coming back, billed for the time parked, when the
    #: cheap pools fall behind their plan).
    park_margin = 1.0

    def __init__(self):
        self.plans: dict[str, dict[str, Any]] = {}
        self._warned: set[str] = set()

    # --- graph: refuse what cannot be met -------------------------------------------

    def _unknown_pools(self, snap) -> list[Decision]:
        """Fail tasks waiting for a ``pool:<name>`` resource no worker declares."""
        if not snap.unsatisfiable:
            return []
        return self._refuse_pools(snap, [(key, need, None)
                                         for key, need in snap.unsatisfiable])

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
                   f"declares (pools: "
                   f"{', '.join(sorted(known)) or 'none'}); use one of those names in "
                   f"resources={{'pool:<name>': 1}}")
            out.append(Decision(Action.FAIL, "", msg, {"pool": name, "tasks": len(keys)},
                                keys=tuple(keys), detail=ObjectiveError(msg)))
        return out

    def _on_graph(self, snap) -> list[Decision]:
        pools = pools_of(snap.workers)
        # only a kernel's placement (resources=, workers=) can name a pool at graph time
        out = self._refuse_pools(snap, [
            (t.key, t.placement.get("resources"), t.placement.get("workers"))
            for t in snap.new_tasks if t.placement])
        run = snap.run
        if run is None or run.objective is None or not snap.new_tasks:
            return out
        all_pools = dict(pools)
        for name, p in (snap.declared_pools or {}).items():
            all_pools.setdefault(f"declared:{name}", p)
        workers, threads = feasibility.capacity(snap, pools, snap.parked)
        for name, p in (snap.declared_pools or {}).items():
            workers.setdefault(name, 0)
        work = dict(run.group_pending)
        why = feasibility.check_objective(run.objective, all_pools, work,
                                          feasibility.seconds(snap, all_pools, work),
                                          workers, threads)
        if why:
            keys = tuple(t.key for t in snap.new_tasks)
            out.append(Decision(Action.FAIL, "", why, {"objective": run.objective.as_dict(),
                                                       "tasks": len(keys)},
                                keys=keys, detail=ObjectiveError(why)))
        return out

    # --- tick: park and unpark pools ------------------------------------------------

    def run(self, snap, context: RuleContext) -> list[Decision]:
        if snap.event == "graph":
            return self._on_graph(snap)
        if snap.event != "tick":
            return []
        out = self._unknown_pools(snap) + self._tick(snap)
        if context is not None:  # parked now: no moves onto them this tick
            context.paused_now |= {d.worker for d in out if d.action == Action.PARK}
            context.taken |= {d.target for d in out if d.action == Action.MOVE}
        return out

    def _tick(self, snap) -> list[Decision]:
        run = snap.run
        parked = snap.parked
        if run is None or run.objective is None or not run.objective.needs_prices \
                or run.pending <= 0:
            return self._unpark_all(snap, parked, "no run under a cost objective or a "
                                    "budget has work left")
        pools = pools_of(snap.workers)
        by_name = {p.name: p for p in pools.values()}
        if len(by_name) < 2 or any(p.price is None for p in by_name.values()):
            return self._unpark_all(snap, parked, "one pool, or pools without prices")
        work = dict(run.group_pending)
        seconds = feasibility.seconds(snap, pools, work)
        work = {g: n for g, n in work.items() if g in seconds}
        if not work:  # nothing measured yet
            return self._unmeasured(snap, parked, pools, run.objective)
        workers, threads = feasibility.capacity(snap, pools, parked)
        # tasks running now are no longer to place: their threads are busy for what is
        # left of them (the time per task on that pool less the time they ran)
        remaining: dict[str, float] = {}
        running_on: dict[str, int] = {}
        for a, tasks in snap.running.items():
            if a not in pools:
                continue
            name = pools[a].name
            for t in tasks:
                t_task = seconds.get(t.group, {}).get(name, t.duration)
                remaining[name] = remaining.get(name, 0.0) + max(t_task - t.elapsed, 0.0)
                running_on[a] = running_on.get(a, 0) + 1
                if t.group in work:
                    work[t.group] -= 1
        work = {g: n for g, n in work.items() if n > 0}
        egress = feasibility.egress(snap, pools, work)
        obj = run.objective
        typical = {name: median(row[name] for row in seconds.values() if name in row)
                   for name in workers}
        if obj.kind == "cost":
            left = (run.deadline_at - snap.time) if run.deadline_at is not None else 1e12
            if left <= 0:
                plan = None
            else:
                # thread-seconds each pool has until the deadline: less what its running
                # tasks still take, less :attr:`tail` of a task per thread (the last task
                # a thread starts must end in time), as a number of whole-deadline workers
                usable = {name: max(n * threads[name] * left - remaining.get(name, 0.0)
                                    - self.tail * typical[name] * n * threads[name], 0.0)
                          / (threads[name] * left) for name, n in workers.items()}
                plan = cost.plan(work, seconds, by_name, usable, threads=threads,
                                 deadline=left, egress=egress)
                capacity = {name: u * left for name, u in usable.items()}
            if plan is None or not plan.feasible:
                fastest = cost.plan(work, seconds, by_name, workers, threads=threads)
                finish = fastest.makespan + max(typical.values())
                return self._missed(
                    snap, parked, run.id,
                    f"deadline can no longer be met: projected finish in {finish:.1f} s "
                    f"with every pool, {max(left, 0.0):.1f} s left to the deadline; all "
                    f"pools take work",
                    {"deadline_in": round(left, 3), "projected_finish_in": round(finish, 3)})
        else:
            plan, spent, committed, fixed = self._budget_plan(
                snap, run, pools, by_name, work, seconds, workers, threads, remaining,
                running_on, typical, egress, parked)
            if plan is None or not plan.feasible:
                cheapest = cost.plan(work, seconds, by_name, workers, threads=threads,
                                     deadline=1e12, egress=egress)
                keep = max(cheapest.busy, key=cheapest.busy.get) if cheapest.busy else None
                return self._missed(
                    snap, parked, run.id,
                    f"budget can no longer be met: spent ${spent:.4g} of ${obj.budget:.4g}"
                    f" (${committed:.4g} more committed to tasks running or queued), the "
                    f"work left costs at least ${cheapest.cost:.4g} (projected "
                    f"${spent + committed + cheapest.cost:.4g}); only pool {keep!r} takes "
                    f"work",
                    {"budget": obj.budget, "spent": round(spent, 6),
                     "committed": round(committed, 6),
                     "projected_cost": round(spent + committed + cheapest.cost, 6)},
                    keep=keep)
            self.plans[run.id] = {"objective": obj.as_dict(), "plan": plan.as_dict(),
                                  "work": work, "seconds": seconds, "time": snap.time,
                                  "spent": round(spent, 6), "committed": round(committed, 6)}
            return self._apply_plan(snap, parked, pools, plan, seconds, egress, work,
                                    workers, threads, obj, running_on, fixed)
        self.plans[run.id] = {"objective": obj.as_dict(), "plan": plan.as_dict(),
                              "work": work, "seconds": seconds, "time": snap.time}
        return self._apply_plan(snap, parked, pools, plan, seconds, egress, work, workers,
                                threads, obj, running_on, capacity=capacity)

    @staticmethod
    def spent(run, pools, now, workers=None) -> float:
        """Dollars ``run``'s workers (``pools``: address -> pool) cost by ``now`` (epoch
        seconds), billed as :func:`blockflow.pools.plan.run_cost` bills, to ``now`` for workers
        with tasks assigned in ``workers``.
        """
        total = 0.0
        for a, (start, stop) in run.spans.items():
            p = pools.get(a)
            if p is None:
                continue
            w = workers.get(a) if workers is not None else None
            end = now if w is not None and w.processing else stop
            total += max(end - start, 0.0) * p.price_per_second
        return total

    @staticmethod
    def overhead(run, pools) -> dict[str, float]:
        """Pool name -> billed over busy seconds of ``run``'s workers so far (1 to 2)."""
        billed: dict[str, float] = {}
        busy: dict[str, float] = {}
        for a, (start, stop) in run.spans.items():
            p = pools.get(a)
            if p is None or not run.busy.get(a):
                continue
            billed[p.name] = billed.get(p.name, 0.0) + max(stop - start, 0.0)
            busy[p.name] = busy.get(p.name, 0.0) + run.busy[a]
        return {name: min(max(billed[name] / busy[name], 1.0), 2.0)
                for name in busy if busy[name] > 0}

    def _budget_plan(self, snap, run, pools, by_name, work, seconds, workers, threads,
                     remaining, running_on, typical, egress, parked):
        """The fastest plan for the work left within the budget left (less spent and committed,
        prices scaled by :meth:`overhead`). Returns ``(plan or None, spent, committed, fixed)``.
        """
        now = snap.time
        over = self.overhead(run, pools)
        eff = {g: {p: t * over.get(p, 1.0) for p, t in row.items()}
               for g, row in seconds.items()}
        price = {name: p.price_per_second for name, p in by_name.items()}
        spent = self.spent(run, pools, now, snap.workers)
        committed = sum(price[name] * r * over.get(name, 1.0) / threads.get(name, 1)
                        for name, r in remaining.items())
        # tasks queued on workers, not started: they run on that worker's pool
        fixed: dict[str, int] = {}
        work = dict(work)
        for a, w in snap.workers.items():
            n = max(w.processing - running_on.get(a, 0), 0)
            if n <= 0 or a not in pools:
                continue
            name = pools[a].name
            queued = [t.group for t in snap.waiting.get(a, ())][:n]
            queued += [max(work, key=work.get)] * (n - len(queued)) if work else []
            for g in queued:
                if work.get(g, 0) <= 0:
                    continue
                work[g] -= 1
                fixed[name] = fixed.get(name, 0) + 1
                t = eff.get(g, {}).get(name, typical.get(name, 0.0))
                committed += price[name] * t / threads.get(name, 1)
        work = {g: n for g, n in work.items() if n > 0}
        # half a task of the dearest pool kept back: the plan is fractional and a pool
        # takes work for more than half a planned task (the rounding may buy that half)
        reserve = 0.5 * max((price[name] * t / threads.get(name, 1)
                             for row in eff.values() for name, t in row.items()
                             if name in workers), default=0.0)
        left = run.objective.budget - spent - committed - reserve
        if left <= 0:
            return None, spent, committed, fixed
        # a parked pool taking work again is billed for the time it was parked
        gap = {}
        for a in parked:
            if a in pools and a in run.spans:
                name = pools[a].name
                gap[name] = gap.get(name, 0.0) + max(now - run.spans[a][1], 0.0) * price[name]
        plans = [cost.plan(work, eff, by_name, workers, threads=threads,
                           budget=left - sum(gap.values()), egress=egress)
                 if left > sum(gap.values()) else None]
        if gap:
            active = {name: (0 if name in gap else n) for name, n in workers.items()}
            plans.append(cost.plan(work, eff, by_name, active, threads=threads,
                                   budget=left, egress=egress))
        ok = [p for p in plans if p is not None and p.feasible]
        if not ok:
            return None, spent, committed, fixed
        return min(ok, key=lambda p: p.makespan), spent, committed, fixed

    def _apply_plan(self, snap, parked, pools, plan, seconds, egress, work, workers,
                    threads, obj, running_on, fixed=None, capacity=None) -> list[Decision]:
        holds: dict[str, int] = {}  # tasks waiting on the pool's workers, not started
        for a, w in snap.workers.items():
            holds[pools[a].name] = holds.get(pools[a].name, 0) + max(
                w.processing - running_on.get(a, 0), 0)
        fixed = fixed or {}  # queued tasks the plan left out: fixed to their pool
        more = {name: plan.pool_tasks(name) + fixed.get(name, 0) - holds.get(name, 0)
                for name in workers}
        # the pool with the cheapest work is never parked: someone always takes the queue
        by_name = {p.name: p for p in pools.values()}
        keep = min(workers, key=lambda name: (sum(
            by_name[name].price_per_second * row.get(name, math.inf) / threads.get(name, 1)
            for row in seconds.values()), -workers[name]))
        out: list[Decision] = []
        for name in sorted(workers):
            members = sorted(a for a, p in pools.items() if p.name == name
                             and a in snap.workers and (snap.workers[a].status == "running"
                                                        or a in parked))
            if name == keep:
                want = True
            elif capacity is not None and not self._begun(snap, members):
                # a pool that ran nothing of this run yet starts its share as late as it
                # can: once the share needs :attr:`late_start` of the pool's time left.
                # It then works through to the end in one stretch (billed from its first
                # task to its last: a pool that took its share first and came back for
                # what the cheap pools fell behind on is billed for the time between)
                want = (more[name] > 0.5 and plan.busy.get(name, 0.0)
                        >= self.late_start * capacity.get(name, 0.0))
            elif any(a in parked for a in members):
                # hysteresis: a parked pool comes back for half a task per thread at least
                want = more[name] >= max(1.0, 0.5 * threads.get(name, 1) * len(members))
            elif capacity is not None:
                # a pool working under a deadline takes :attr:`park_margin` task per thread
                # beyond its plan before it is parked: coming back later for what the
                # cheap pools fell behind on would bill it for the time it sat parked
                want = more[name] > 0.5 - self.park_margin * threads.get(name, 1) * len(
                    members)
            else:
                want = more[name] > 0.5
            seen = {"pool": name, "planned_tasks": round(plan.pool_tasks(name), 2),
                    "held_tasks": holds.get(name, 0), "plan_cost": round(plan.cost, 6),
                    "plan_makespan": round(plan.makespan, 3), "objective": obj.kind}
            wake = set(members)
            if want and name != keep and any(a in parked for a in members):
                wake = self._to_wake(snap, name, members, parked, plan)
            for a in members:
                if want and a in parked and a in wake:
                    reason = (f"pool {name!r} needed: the plan gives it "
                              f"{plan.pool_tasks(name):.1f} tasks, it holds "
                              f"{holds.get(name, 0)}")
                    seen_a = dict(seen)
                    cross = self._crossing(name, pools, egress, work, seconds, plan, workers,
                                           threads, snap)
                    if cross:
                        reason += "; " + cross.pop("reason")
                        seen_a.update(cross)
                    out.append(Decision(Action.UNPARK, a, reason, seen_a))
                elif not want and a not in parked:
                    out.append(Decision(
                        Action.PARK, a, f"pool {name!r} parked: the plan gives it "
                        f"{plan.pool_tasks(name):.1f} tasks, it holds {holds.get(name, 0)}; "
                        f"cheaper pools meet the {obj.kind} objective", seen))
            if want and name != keep and more[name] >= 1:
                out += self._hand_over(snap, pools, name, int(more[name]), seen, egress,
                                       seconds, plan, workers, threads, work)
        return out

    @staticmethod
    def _begun(snap, members) -> bool:
        """Whether any of ``members`` ran or holds a task of the current run."""
        spans = snap.run.spans if snap.run is not None else {}
        return any(a in spans or snap.workers[a].processing > 0 for a in members)

    @staticmethod
    def _to_wake(snap, name, members, parked, plan) -> set[str]:
        """The parked workers of pool ``name`` to unpark, as many as the plan needs,
        cheapest to take back first (a worker is billed from its first task to its last).
        """
        active = [a for a in members if a not in parked]
        need = max(int(plan.workers_needed.get(name, len(members))), 1)
        n = need - len(active)
        if n <= 0:
            return set()
        spans = snap.run.spans if snap.run is not None else {}
        idle = sorted((a for a in members if a in parked),
                      key=lambda a: (a in spans, -spans[a][1] if a in spans else 0.0, a))
        return set(idle[:n])

    def _hand_over(self, snap, pools, name, n, seen, egress, seconds, plan, workers,
                   threads, work) -> list[Decision]:
        """Move up to ``n`` tasks waiting on other pools' workers to free threads of ``name``."""
        free = [(a, w.nthreads - w.processing) for a, w in sorted(snap.workers.items())
                if pools[a].name == name and w.status == "running"
                and w.processing < w.nthreads]
        slots = [a for a, k in free for _ in range(k)][:n]
        if not slots:
            return []
        cross = None
        out = []
        donors = sorted((a for a, p in pools.items() if p.name != name and a in snap.workers),
                        key=lambda a: -snap.workers[a].processing)
        for src in donors:
            if not slots:
                break
            w = snap.workers[src]
            if w.processing <= w.nthreads:
                continue  # nothing waits there beyond what starts next
            for task in snap.waiting.get(src, ()):
                if not slots:
                    break
                if task.allowed_workers is not None and slots[0] not in task.allowed_workers:
                    continue
                dst = slots.pop(0)
                moved = dict(seen, input_bytes=task.input_bytes)
                reason = (f"pool {name!r} takes a task the plan gives it "
                          f"({plan.pool_tasks(name):.1f} planned, {seen['held_tasks']} held)")
                if pools[src].provider != pools[dst].provider and task.input_bytes:
                    if cross is None:
                        cross = self._crossing(name, pools, egress, work, seconds, plan,
                                               workers, threads, snap) or {}
                    price = max(p.egress for p in pools.values()
                                if p.provider == pools[src].provider)
                    dollars = task.input_bytes / _GB * price
                    moved.update(egress_bytes=task.input_bytes,
                                 egress_cost=round(dollars, 6),
                                 time_saved=cross.get("time_saved"))
                    reason += (f"; its inputs cross from {pools[src].provider} to "
                               f"{pools[dst].provider}: {task.input_bytes / _GB:.3g} GB for "
                               f"${dollars:.4g}, the plan's pool saves "
                               f"{cross.get('time_saved')} s")
                out.append(Decision(Action.MOVE, src, reason, moved, target=dst,
                                    key=task.key))
        return out

    def _crossing(self, name, pools, egress, work, seconds, plan, workers, threads,
                  snap) -> dict[str, Any] | None:
        """The numbers of a choice to send data across providers to pool ``name``."""
        dollars = sum(egress.get(g, {}).get(name, 0.0) * plan.tasks.get(g, {}).get(name, 0.0)
                      for g in work)
        if dollars <= 0:
            return None
        nbytes = sum(sum(b for src, b in (snap.inputs or {}).get(g, {}).items()
                         if src != next(p.provider for p in pools.values() if p.name == name))
                     * plan.tasks.get(g, {}).get(name, 0.0) for g in work)
        by_name = {p.name: p for p in pools.values()}
        without = {p: n for p, n in workers.items() if p != name}
        alone = cost.plan(work, {g: {p: t for p, t in row.items() if p != name}
                                 for g, row in seconds.items()}, by_name, without,
                          threads=threads) if without else None
        fastest = cost.plan(work, seconds, by_name, workers, threads=threads)
        saves = (alone.makespan - fastest.makespan) if alone is not None and alone.feasible \
            else math.inf
        return {"reason": f"its inputs cross providers: {nbytes / _GB:.3g} GB for "
                          f"${dollars:.4g} of egress, saving {saves:.1f} s",
                "egress_bytes": int(nbytes), "egress_cost": round(dollars, 6),
                "time_saved": round(saves, 3) if math.isfinite(saves) else None}

    def _missed(self, snap, parked, run_id, reason, seen, keep=None) -> list[Decision]:
        out = []
        if run_id not in self._warned:
            self._warned.add(run_id)
            out.append(Record(Recorded.OBJECTIVE, "", reason, seen,
                                detail={"warning": True}))
        pools = pools_of(snap.workers)
        for a in sorted(snap.workers):
            if keep is None or pools[a].name == keep:
                if a in parked:
                    out.append(Decision(Action.UNPARK, a, "objective missed: " + reason, seen))
            elif a not in parked and snap.workers[a].status == "running":
                out.append(Decision(Action.PARK, a, "objective missed: " + reason, seen))
        return out

    def _unmeasured(self, snap, parked, pools, obj) -> list[Decision]:
        """Before any group is measured: under a cost objective only the pool cheapest per unit of
        work by its hints takes tasks; otherwise distributed's placement.
        """
        why = "no task group of the run measured yet"
        by_name = {p.name: p for p in pools.values()}
        if obj.kind != "cost" or len(by_name) < 2:
            return self._unpark_all(snap, parked, why)
        cheapest = min(by_name.values(), key=lambda p: ((p.price or 0.0) / (p.speed or 1.0),
                                                        p.name))
        if not any(pools[a].name == cheapest.name and w.status == "running"
                   for a, w in snap.workers.items()):
            return self._unpark_all(snap, parked, why)
        out = []
        for a, w in sorted(snap.workers.items()):
            if pools[a].name == cheapest.name:
                if a in parked:
                    out.append(Decision(Action.UNPARK, a, f"unparked: {why}", {}))
            elif a not in parked and w.status == "running":
                out.append(Decision(
                    Action.PARK, a, f"pool {pools[a].name!r} parked: {why}; pool "
                    f"{cheapest.name!r} is the cheapest per unit of work by the pools' "
                    f"prices and speeds and measures it", {"pool": pools[a].name,
                                                          "objective": obj.kind}))
        return out

    def _unpark_all(self, snap, parked, why: str) -> list[Decision]:
        return [Decision(Action.UNPARK, a, f"unparked: {why}", {})
                for a in sorted(parked) if a in snap.workers]
