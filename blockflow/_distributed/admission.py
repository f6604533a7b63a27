"""Admission control's read of feeder tasks: producers feeding resource-bound consumers.

:func:`feeder_tasks` finds them, :func:`feeder_states` (and the lazy snapshot
:class:`FeederStates`) says where each stands for
:class:`blockflow.scheduling.rules.AdmissionRule`; :func:`take_back_tasks` holds again those
sent to workers over its budget."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from itertools import groupby
from typing import Any


from blockflow._distributed.placement import HOLD_ADDRESS, _restricted

__all__ = ["FeederStates", "FeederView", "feeder_state_view", "feeder_states", "feeder_tasks",
           "take_back_tasks"]


class FeederStates:
    """key -> feeder state (:func:`blockflow._distributed.feeder_states`), read on first access; an
    unknown key reads ``"done"``."""

    def __init__(self, scheduler):
        self._scheduler = scheduler
        self._cache: dict[Any, str] = {}

    def __getitem__(self, key) -> str:
        try:
            return self._cache[key]
        except KeyError:
            state = self._cache[key] = feeder_states(self._scheduler, [key])[key]
            return state

    def read(self, keys) -> dict:
        """key -> state for each of ``keys`` (one pass over the scheduler's tasks)."""
        missing = [k for k in keys if k not in self._cache]
        if missing:
            self._cache.update(feeder_states(self._scheduler, missing))
        return {k: self._cache[k] for k in keys}


def feeder_state_view(scheduler) -> FeederStates:
    """A :class:`FeederStates` view of ``scheduler``'s tasks."""
    return FeederStates(scheduler)


@dataclass(frozen=True)
class FeederView:
    """A task whose every dependent needs a worker resource it does not (plain data).

    Attributes
    ----------
    key : str, tuple or int
    priority : tuple
    resources : dict
        The resources its consumers need (largest amount of each).
    consumers : tuple
        Its dependents' keys (empty for an expected feeder).
    group : str
        Its task prefix.
    earlier : bool
        Submitted by an earlier graph than its consumers.
    """

    key: Any
    priority: tuple
    resources: dict
    consumers: tuple = ()
    group: str = ""
    earlier: bool = False


#: States of an earlier graph's task that may still feed a new graph's consumers: not
#: started (queued on the scheduler, or assigned to a worker) or its output still in memory.
_EARLIER = frozenset({"waiting", "queued", "processing", "memory"})


_HELD = frozenset({HOLD_ADDRESS})


def feeder_tasks(scheduler, keys, expect: Collection[str] = ()) -> list[FeederView]:
    """The feeders among ``keys`` and the unfinished earlier tasks they depend on, in priority
    order: unrestricted tasks whose dependents all need worker resources (distributed#9164). With
    ``expect`` (task prefixes), also new tasks of those prefixes with no dependents yet."""
    candidates = []
    for key in keys:
        ts = scheduler.tasks.get(key)
        if ts is None:
            continue
        # (distributed lists an earlier graph's tasks the new one depends on among ``keys``)
        if ts.state == "released" or ts.state in _EARLIER:
            candidates.append(ts)
        if ts.resource_restrictions:
            candidates.extend(d for d in ts.dependencies if d.state in _EARLIER
                              or d.worker_restrictions == {HOLD_ADDRESS})
    out, seen = [], set()
    for ts in candidates:
        if ts.key in seen or ts.actor or not ts.run_spec:
            continue
        seen.add(ts.key)
        if not expect and not ts.dependents:
            continue  # feeds nothing and not expected: none of the cases below
        held = ts.worker_restrictions == _HELD
        if _restricted(ts) and not held:
            continue
        group = ts.prefix.name  # key_split(ts.key), as distributed names the prefix
        if not ts.dependents:
            if expect and group in expect and ts.state == "released" and not held:
                out.append(FeederView(ts.key, tuple(ts.priority or ()), {}, (), group))
            continue
        resources: dict[str, float] = {}
        for dts in ts.dependents:
            if not dts.resource_restrictions:
                break
            for r, q in dts.resource_restrictions.items():
                resources[r] = max(resources.get(r, 0), q)
        else:
            out.append(FeederView(ts.key, tuple(ts.priority or ()), resources,
                                  tuple(d.key for d in ts.dependents), group,
                                  earlier=ts.state != "released" or held))
    out.sort(key=lambda f: f.priority)
    return out


#: Dependent states in which a consumer has not run yet.
_PENDING = frozenset({"released", "waiting", "queued", "no-worker", "processing"})


#: Dependent states of a consumer that has all its inputs (ready, or running).
_READY = frozenset({"queued", "no-worker", "processing"})


def feeder_states(scheduler, keys) -> dict:
    """key -> feeder state: ``"held"``, ``"orphan"`` (held, no consumer left), ``"pending"``,
    ``"running"``, ``"feeding"`` (in memory, a ready consumer unfinished), ``"stored"`` (in memory,
    consumers wait for other inputs) or ``"done"``."""
    out = {}
    for key in keys:
        ts = scheduler.tasks.get(key)
        if ts is None or ts.state in ("erred", "forgotten"):
            out[key] = "done"
            continue
        deps = ts.dependents or ()
        pending = any(d.state in _PENDING for d in deps)
        if ts.worker_restrictions == {HOLD_ADDRESS}:
            out[key] = "held" if pending else "orphan"
        elif ts.state == "processing":
            out[key] = "running"
        elif ts.state == "memory":
            # (a consumer of a graph just arriving is still "released": ready if all its
            # inputs are in memory)
            if any(d.state in _READY or (d.state == "released" and all(
                    i.state == "memory" for i in d.dependencies)) for d in deps):
                out[key] = "feeding"
            else:
                out[key] = "stored" if pending else "done"
        elif ts.state in ("waiting", "queued", "no-worker"):
            out[key] = "pending"
        else:  # released with nothing left to feed
            out[key] = "pending" if pending else "done"
    return out


def take_back_tasks(scheduler, keys, count: int, stimulus_id: str) -> list:
    """Take up to ``count`` of the tasks ``keys`` sent to workers (``processing``) back to the
    scheduler and hold them as :func:`blockflow._distributed.hold_tasks` does.

    Those waiting behind their worker's threads go first (the ``nthreads`` of highest priority
    on a worker are taken to run), lowest priority first; a running one is cancelled there (a
    worker sent it again goes on with it, as with stolen tasks). Long-running (seceded),
    restricted and actor tasks stay. Returns the keys taken back.
    """
    tasks = []
    for key in keys:
        ts = scheduler.tasks.get(key)
        ws = None if ts is None else ts.processing_on
        if ws is None or ts.state != "processing" or ts.actor or _restricted(ts) \
                or ts in ws.long_running:
            continue
        tasks.append(ts)
    if count <= 0 or not tasks:
        return []
    started = set()
    tasks.sort(key=lambda ts: ts.processing_on.address)
    for ws, _ in groupby(tasks, key=lambda ts: ts.processing_on):
        first = sorted((t for t in ws.processing if t not in ws.long_running),
                       key=lambda t: t.priority or ())
        started.update(first[:max(int(ws.nthreads), 1)])
    tasks.sort(key=lambda ts: ts.priority or (), reverse=True)  # lowest priority first
    tasks.sort(key=lambda ts: ts in started)  # (stable) not started first
    chosen = tasks[:count]
    for ts in chosen:
        ts.worker_restrictions = {HOLD_ADDRESS}
        ts.loose_restrictions = False
    # processing -> released tells the worker to let it go; a restricted task is never
    # root-ish: from "waiting" it goes to "no-worker" (held)
    scheduler.transitions({ts.key: "released" for ts in chosen}, stimulus_id)
    return [ts.key for ts in chosen]
