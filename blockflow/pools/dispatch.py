"""Plan dispatch: a run's tasks wait at the scheduler and go to pools in the plan's shares.

Under a cost objective or a budget, the objective rule holds the run's tasks at the scheduler
(distributed's ``no-worker`` state, as admission control does) and :class:`PlanDispatch` hands
each ready one to a free thread of a worker the plan uses, of the group the plan gives that
worker's pool most of. Nothing waits on a worker before it can start there, so the plan, re-solved
every tick, decides where every task not yet started runs ("queued is not spent"). Guide:
:doc:`/guide/pools`, "How the plan runs".
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import Any

from dask.utils import key_split

from blockflow.pools.pool import Pool
from blockflow.scheduling.estimate import earliest_finish

__all__ = ["PlanDispatch", "RunDispatches"]


class PlanDispatch:
    """One run's held tasks and the plan's shares they are dispatched by.

    Attributes
    ----------
    run_id : str or None
    quota : dict
        Group -> pool name -> tasks the latest plan still gives the pool (fractional; each
        dispatch takes one).
    active : set of str
        Workers that take the run's tasks now: those that began it, and those the plan needs
        to begin now.
    greedy : bool
        The objective can no longer be met: every free thread takes work, each the group
        it is fastest at relative to the others.
    finish_by : float or None
        Epoch seconds the plan ends by: a worker the plan gives nothing takes a task only if
        it ends by then (it is billed to the run's end anyway).
    seconds : dict
        Group -> pool -> seconds per task (the plan's throughput matrix).
    egress : dict
        Group -> pool -> dollars of egress per task: off the plan, a worker takes no task
        whose inputs it would pay to receive.
    first : dict of str to str
        Group -> the pool an unmeasured group's tasks go to (cheapest per unit of work by the
        pools' priors), until it is measured.
    sent : dict
        Key -> worker of the tasks dispatched and not finished.
    ends : dict
        Key -> when (epoch seconds) a dispatched task is expected to end.
    due : float or None
        Epoch seconds its run is due (a deadline, or the plan's end): the order in which
        :class:`RunDispatches` gives runs the free threads.
    """

    def __init__(self, run_id: str | None = None):
        self.run_id = run_id
        self.waiting: dict[str, dict[Hashable, None]] = {}  # group -> held, inputs not done
        self.ready: dict[str, dict[Hashable, None]] = {}  # group -> held and ready
        self.quota: dict[str, dict[str, float]] = {}
        self.active: set[str] = set()
        self.greedy = False
        self.finish_by: float | None = None
        self.seconds: dict[str, dict[str, float]] = {}
        self.egress: dict[str, dict[str, float]] = {}
        self.first: dict[str, str] = {}
        self.sent: dict[Hashable, str] = {}
        self.ends: dict[Hashable, float] = {}
        self.dispatched = 0
        self.due: float | None = None  # epoch seconds its run is due (the order runs take)

    # --- the held tasks ------------------------------------------------------------------

    def hold(self, keys, ready: Mapping[Hashable, bool] | None = None) -> None:
        """Track ``keys`` as held (ready ones per ``ready``: key -> whether it could start)."""
        for key in keys:
            where = self.ready if ready and ready.get(key) else self.waiting
            where.setdefault(key_split(key), {})[key] = None

    def became_ready(self, key) -> bool:
        """A held task's inputs are done; False if it is not one of this run's held tasks."""
        group = key_split(key)
        waiting = self.waiting.get(group)
        if waiting is None or key not in waiting:
            return False
        del waiting[key]
        self.ready.setdefault(group, {})[key] = None
        return True

    def forget(self, key) -> None:
        """The task finished, was forgotten or is no longer held."""
        group = key_split(key)
        for where in (self.waiting, self.ready):
            d = where.get(group)
            if d is not None:
                d.pop(key, None)
        self.sent.pop(key, None)
        self.ends.pop(key, None)

    def lost(self, worker: str) -> list:
        """Keys dispatched to ``worker`` that did not finish (it left): to hold again."""
        keys = [k for k, w in self.sent.items() if w == worker]
        for k in keys:
            del self.sent[k]
            self.ends.pop(k, None)
        return keys

    def holds(self) -> int:
        """Tasks held now (waiting for inputs or ready)."""
        return sum(map(len, self.waiting.values())) + sum(map(len, self.ready.values()))

    def ready_count(self) -> dict[str, int]:
        """Group -> held tasks ready to start."""
        return {g: len(d) for g, d in self.ready.items() if d}

    # --- choosing ------------------------------------------------------------------------

    def choose(self, free: Mapping[str, tuple[int, int]], pools: Mapping[str, Pool],
               now: float) -> dict[Hashable, str]:
        """Key -> worker for as many ready tasks as the plan places on the free slots
        (``free``: address -> ``(slots, idle threads)``, as
        :func:`blockflow._distributed.free_slots` reads them; ``pools``: address -> its
        pool)."""
        out: dict[Hashable, str] = {}
        if not any(self.ready.values()):
            return out
        slots = {a: n for a, (n, _) in free.items()}
        free_threads = {a: t for a, (_, t) in free.items()}
        order = sorted(slots, key=lambda a: (a not in self.active, a))
        users = [a for a in order if a in pools and (self.greedy or a in self.active)]
        free_at = self._free_at(free, users, now)
        tail = sum(map(len, self.ready.values())) <= sum(max(slots.get(a, 0), 0) for a in users
                                                          ) + len(self.sent)
        for addr in order:
            free = slots[addr]
            pool = pools.get(addr)
            if free <= 0 or pool is None or not (self.greedy or addr in self.active):
                continue
            idle = free_threads.get(addr, 0)
            while free > 0:
                group = self._pick(pool.name, now, tail, probe=idle > 0)
                if group is None:
                    break
                if tail and self._finishes_sooner_elsewhere(group, addr, users, pools,
                                                            free_at):
                    break
                ready = self.ready[group]
                key = next(iter(ready))
                del ready[key]
                out[key] = addr
                self.sent[key] = addr
                took = self.seconds.get(group, {}).get(pool.name, 0.0)
                self.ends[key] = free_at.get(addr, now) + took
                free_at[addr] = self.ends[key]
                idle -= 1
                row = self.quota.setdefault(group, {})
                row[pool.name] = row.get(pool.name, 0.0) - 1.0
                free -= 1
        self.dispatched += len(out)
        return out

    def _free_at(self, free, users, now: float) -> dict[str, float]:
        """Worker -> when a thread of it can start another task: now with an idle thread,
        else when the last task sent to it is expected to end (one thread; a blockflow
        approximation for several)."""
        ends: dict[str, float] = {}
        for key, addr in self.sent.items():
            t = self.ends.get(key, now)
            ends[addr] = max(ends.get(addr, t), t)
        return {a: now if free.get(a, (0, 0))[1] > 0 else max(ends.get(a, now), now)
                for a in users}

    def _finishes_sooner_elsewhere(self, group, addr, users, pools, free_at) -> bool:
        """At the run's tail (no more ready tasks than threads to run them): whether another
        worker that may take ``group``'s next task ends it before ``addr`` would, each
        starting when it is free (:func:`~blockflow.scheduling.estimate.earliest_finish`;
        ties stay with ``addr``)."""
        row = self.seconds.get(group)
        if not row:
            return False
        ready = {addr: free_at.get(addr, 0.0)}
        ready.update({v: free_at[v] for v in users if v != addr and v in free_at
                      and self._may_take(group, pools[v].name)})
        best = earliest_finish(1, ready, lambda i, w: row.get(pools[w].name, math.inf))
        return bool(best) and best[0].worker != addr

    def _may_take(self, group: str, pool: str) -> bool:
        """Whether ``pool`` may take ``group``'s task at the run's tail: the plan gives it
        some, or it would pay no egress for its inputs."""
        return (self.greedy or pool in self._owners(group)
                or not self.egress.get(group, {}).get(pool, 0.0) > 0.0)

    def _owners(self, group: str) -> set[str]:
        """Pools the plan gives ``group``'s next task: those with half a task or more left,
        else the one with most."""
        row = self.quota.get(group) or {}
        owners = {p for p, q in row.items() if q >= 0.5}
        if not owners and row:
            best = max(row.values())
            if best > 1e-9:
                owners = {p for p, q in row.items() if q == best}
        return owners

    def _fit(self, group: str, pool: str) -> float:
        """Seconds per task of ``group`` on ``pool`` over its best pool's (1 = its best)."""
        row = self.seconds.get(group) or {}
        if pool not in row:
            return math.inf
        return row[pool] / max(min(row.values()), 1e-12)

    def _pick(self, pool: str, now: float, tail: bool = False,
              probe: bool = True) -> str | None:
        """The group whose next ready task ``pool`` takes, or None (``probe``: a thread of the
        worker is idle, so a task of an unmeasured group would start at once)."""
        groups = [g for g, d in self.ready.items() if d]
        if not groups:
            return None
        # an unmeasured group first, on an idle thread of the pool cheapest for it by the
        # priors, the group with fewest tasks out first: the plan needs their speeds soon
        new = [g for g in groups if g not in self.seconds
               and (self.greedy or self.first.get(g) in (None, pool))]
        if new and probe:
            out = {g: 0 for g in new}
            for key in self.sent:
                g = key_split(key)
                if g in out:
                    out[g] += 1
            return min(new, key=lambda g: (out[g], g))
        planned = [g for g in groups if g in self.seconds and pool in self._owners(g)]
        if planned:
            return max(planned, key=lambda g: (self.quota[g].get(pool, 0.0), g))
        if self.greedy or tail:  # at the tail the earliest finish decides (see choose)
            fits = [g for g in groups if g in self.seconds and self._may_take(g, pool)]
            return min(fits, key=lambda g: (self._fit(g, pool), g)) if fits else None
        if self.finish_by is None:
            return None
        # off the plan: only what ends before the plan does (this worker is billed to the
        # run's end anyway), the group it suits best first
        fits = [g for g in groups if g in self.seconds
                and not self.egress.get(g, {}).get(pool, 0.0) > 0.0
                and now + self.seconds[g].get(pool, math.inf) <= self.finish_by]
        return min(fits, key=lambda g: (self._fit(g, pool), g)) if fits else None

    def as_dict(self) -> dict[str, Any]:
        """Plain data (status)."""
        return {"run": self.run_id, "held": self.holds(), "ready": self.ready_count(),
                "quota": {g: {p: round(q, 3) for p, q in row.items()}
                          for g, row in self.quota.items()},
                "active": sorted(self.active), "greedy": self.greedy,
                "finish_by": self.finish_by, "dispatched": self.dispatched,
                "running": len(self.sent)}


class RunDispatches:
    """The held tasks of every run under an objective at once: one :class:`PlanDispatch` per
    run, behind the interface of one (the scheduler plugin's hooks call it by key).

    Free threads go to the runs in the order their plans end (earliest first, as
    earliest-deadline-first meets deadlines), each taking what its own plan places.

    Attributes
    ----------
    runs : dict of str to PlanDispatch
        Run id -> its held tasks and plan shares.
    """

    def __init__(self):
        self.runs: dict[str, PlanDispatch] = {}
        self._key_run: dict[Hashable, str] = {}  # held or sent key -> its run

    def of(self, run_id: str) -> PlanDispatch:
        """The run's dispatch, made on first use."""
        d = self.runs.get(run_id)
        if d is None:
            d = self.runs[run_id] = PlanDispatch(run_id)
        return d

    def drop(self, run_id: str) -> PlanDispatch | None:
        """Forget a run (ended); its dispatch, whose held tasks the caller releases."""
        d = self.runs.pop(run_id, None)
        if d is not None:
            self._key_run = {k: r for k, r in self._key_run.items() if r != run_id}
        return d

    @property
    def run_id(self) -> str | None:
        """The run whose plan ends first (the one status shows as the dispatch's)."""
        order = self._order()
        return order[0].run_id if order else None

    @property
    def waiting(self) -> dict[str, dict[Hashable, None]]:
        """Group -> held keys whose inputs are not done, over every run."""
        return self._merged("waiting")

    @property
    def ready(self) -> dict[str, dict[Hashable, None]]:
        """Group -> held keys ready to start, over every run."""
        return self._merged("ready")

    def _merged(self, what: str) -> dict[str, dict[Hashable, None]]:
        out: dict[str, dict[Hashable, None]] = {}
        for d in self.runs.values():
            for g, keys in getattr(d, what).items():
                if keys:
                    out.setdefault(g, {}).update(keys)
        return out

    def hold(self, keys, ready: Mapping[Hashable, bool] | None = None,
             run_id: str | None = None) -> None:
        """Track ``keys`` as held by ``run_id``'s plan (by default the run that held each
        before)."""
        by_run: dict[str, list] = {}
        for key in keys:
            r = run_id if run_id is not None else self._key_run.get(key)
            if r is None or (run_id is None and r not in self.runs):
                continue
            self._key_run[key] = r
            by_run.setdefault(r, []).append(key)
        for r, ks in by_run.items():
            self.of(r).hold(ks, ready)

    def became_ready(self, key) -> bool:
        d = self.runs.get(self._key_run.get(key))
        return d is not None and d.became_ready(key)

    def forget(self, key) -> None:
        d = self.runs.get(self._key_run.get(key))
        if d is not None:
            d.forget(key)

    def lost(self, worker: str) -> list:
        return [k for d in self.runs.values() for k in d.lost(worker)]

    def holds(self) -> int:
        return sum(d.holds() for d in self.runs.values())

    def _order(self) -> list[PlanDispatch]:
        return sorted(self.runs.values(), key=lambda d: (
            d.due if d.due is not None else d.finish_by if d.finish_by is not None
            else math.inf, d.run_id or ""))

    def choose(self, free: Mapping[str, tuple[int, int]], pools: Mapping[str, Pool],
               now: float) -> dict[Hashable, str]:
        """Key -> worker: each run's :meth:`PlanDispatch.choose` in turn, on the slots the
        runs before it left (the plan ending first first)."""
        left = dict(free)
        out: dict[Hashable, str] = {}
        for d in self._order():
            if not any(d.ready.values()):
                continue
            chosen = d.choose(left, pools, now)
            for addr in chosen.values():
                slots, idle = left[addr]
                left[addr] = (slots - 1, max(idle - 1, 0))
            out.update(chosen)
        return out

    def as_dict(self) -> dict[str, Any]:
        """Plain data (status): the first run's dispatch, and ``runs``: run id -> each."""
        order = self._order()
        first = order[0].as_dict() if order else {"run": None, "held": 0}
        return {**first, "runs": {d.run_id: d.as_dict() for d in order}}
