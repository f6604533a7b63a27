"""Admission control: CPU producers feeding consumers that need a worker resource (a GPU).

In a pipeline of unrestricted producers (loading, decoding, on CPU workers) each feeding a
consumer that needs ``resources={"GPU": 1}``, distributed holds back nothing: tasks with
resource restrictions are never queued, so when a producer finishes its consumer is assigned
to the GPU worker at once, the CPU worker takes the next producer, and the producers race
ahead of the GPU. With 4 CPU workers, one ``GPU=1`` worker and 200 producers of 10 MB each
feeding a 0.2 s consumer, 193 of the 200 outputs sat in memory at once.

:class:`AdmissionControl` lets producers run only while the outputs held for consumers stay
within a budget. When a graph arrives, its *feeders* (tasks without restrictions whose every
dependent needs a worker resource) are held back by the scheduler (a restriction no worker
satisfies: they wait in ``no-worker``); the highest-priority ones are released as long as

    feeders running or released + outputs waiting for a consumer that has all its inputs
    <= budget

and each time one of them finishes feeding (its consumer done) the next is released, at
once (from the plugin's ``transition`` hook, on the next turn of the event loop) and on every
tick of the plugin. Outputs whose consumers still wait for other inputs do not count, so a
consumer of more inputs than the budget still gets them all (no deadlock); a held task no
consumer needs any more is released. The default budget is twice the threads of the workers
that declare the consumers' resources plus one per other worker (6 for the example above):
enough to keep the GPU busy while the next outputs are produced. A blockflow heuristic, in
the spirit of distributed's root-task queuing (``worker-saturation``), which does not apply
here.

Admission control runs in blockflow's scheduler plugin under every policy but ``off``
(observe only). Held tasks show as ``no-worker`` in distributed's dashboard. Setting
``distributed.scheduler.no-workers-timeout`` would fail them: leave it unset with admission
control on, or turn this off (``blockflow.resources.admission-budget: 0``).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from blockflow import _distributed, config

__all__ = ["AdmissionControl", "default_budget"]

logger = logging.getLogger(__name__)

#: Feeder states that count against the budget (see _distributed.feeder_states).
_ACTIVE = frozenset({"pending", "running", "feeding"})


def default_budget(workers: Mapping[str, Any], resources: Mapping[str, float]) -> int:
    """Twice the threads of the workers that declare ``resources``, plus one per other
    worker; at least 1 (blockflow heuristic, see the module docstring).

    Parameters
    ----------
    workers : mapping of str to WorkerView
    resources : mapping of str to float
        What the consumers need.
    """
    holders = threads = 0
    for w in workers.values():
        declared = w.resources or {}
        if resources and all(declared.get(r, 0) >= q for r, q in resources.items()):
            holders += 1
            threads += max(int(w.nthreads), 1)
    return max(2 * threads + (len(workers) - holders), 1)


class AdmissionControl:
    """Hold producers back until their outputs fit the budget (see the module docstring).

    Parameters
    ----------
    budget : int, optional
        Most feeder outputs (with feeders running) held at once; default
        ``blockflow.resources.admission-budget``; None there: :func:`default_budget`; 0 turns
        admission control off.
    """

    def __init__(self, budget: int | None = None):
        budget = config.get("resources.admission-budget", budget)
        self.budget = None if budget is None else int(budget)
        self.enabled = self.budget != 0
        self._held: list[tuple[tuple, int, Any]] = []  # heap of (priority, seq, key)
        self._held_keys: set = set()
        self._admitted: set = set()
        self._consumers: dict[Any, tuple] = {}  # feeder -> its consumers
        self._watched: Counter = Counter()  # feeders and consumers tracked -> references
        self._seq = itertools.count()
        self._kick_pending = False
        self.resources: dict[str, float] = {}
        self.peak_active = 0
        self.released = 0
        self.last_budget: int | None = None

    # --- hooks ----------------------------------------------------------------------

    def on_graph(self, scheduler, keys, workers: Mapping[str, Any],
                 log_decision: Callable | None = None) -> int:
        """A graph arrived (before its tasks are scheduled): hold its feeders back, release
        what the budget allows. Returns the number held back."""
        if not self.enabled or not keys:
            return 0
        feeders = _distributed.feeder_tasks(scheduler, keys)
        if not feeders:
            return 0
        held = set(_distributed.hold_tasks(scheduler, [f.key for f in feeders]))
        for f in feeders:
            if f.key not in held:
                continue
            heapq.heappush(self._held, (f.priority, next(self._seq), f.key))
            self._held_keys.add(f.key)
            self._consumers[f.key] = f.consumers
            self._watched.update((f.key, *f.consumers))
            for r, q in f.resources.items():
                self.resources[r] = max(self.resources.get(r, 0), q)
        released = self.admit(scheduler, workers)
        if held and log_decision is not None:
            log_decision("admit", "", f"{len(held)} producers feed tasks that need resources "
                         f"{self.resources}: they run as their outputs fit the budget of "
                         f"{self.last_budget} held at once ({released} released now)",
                         {"budget": self.last_budget, "held": len(self._held_keys)})
        return len(held)

    def watches(self, key) -> bool:
        """Whether a transition of ``key`` may free room in the budget (O(1))."""
        return key in self._watched

    def kick(self, scheduler, workers_fn: Callable[[], Mapping[str, Any]]) -> None:
        """Run :meth:`admit` on the scheduler's event loop soon (coalesced): called from the
        plugin's ``transition`` hook, where scheduler state must not change."""
        if self._kick_pending or not self._held_keys:
            return
        self._kick_pending = True

        def run():
            self._kick_pending = False
            self.admit(scheduler, workers_fn())

        _distributed.call_soon(scheduler, run)

    # --- the budget -----------------------------------------------------------------

    def _budget(self, workers: Mapping[str, Any]) -> int:
        b = self.budget if self.budget is not None else default_budget(workers, self.resources)
        self.last_budget = b
        return b

    def admit(self, scheduler, workers: Mapping[str, Any]) -> int:
        """Release held feeders, highest priority first, while the active ones fit the budget;
        a held feeder no consumer needs any more is released without counting. Returns the
        number released."""
        if not self._held_keys and not self._admitted:
            return 0
        active = 0
        for key, state in _distributed.feeder_states(scheduler, list(self._admitted)).items():
            if state in _ACTIVE:
                active += 1
            elif state == "done":
                self._forget(key)
        room = self._budget(workers) - active
        chosen, orphans = [], []
        while self._held and room > 0:
            _, _, key = heapq.heappop(self._held)
            if key not in self._held_keys:
                continue
            self._held_keys.discard(key)
            state = _distributed.feeder_states(scheduler, [key])[key]
            if state in ("orphan", "done"):
                orphans.append(key)
                self._forget(key)
                continue
            chosen.append(key)
            self._admitted.add(key)
            room -= 1
        if chosen or orphans:
            released = _distributed.release_tasks(
                scheduler, chosen + orphans, f"blockflow-admission-{next(self._seq)}")
            self.released += len(released)
        self.peak_active = max(self.peak_active, active + len(chosen))
        if not self._held_keys:
            self._held.clear()
        return len(chosen)

    def release_orphans(self, scheduler) -> int:
        """Release held feeders that no consumer needs any more (their consumers were
        cancelled or failed): O(held), run on some ticks only."""
        if not self._held_keys:
            return 0
        states = _distributed.feeder_states(scheduler, list(self._held_keys))
        orphans = [k for k, s in states.items() if s in ("orphan", "done")]
        for k in orphans:
            self._held_keys.discard(k)
            self._forget(k)
        if orphans:
            _distributed.release_tasks(scheduler, orphans,
                                       f"blockflow-admission-{next(self._seq)}")
        return len(orphans)

    def release_all(self, scheduler) -> None:
        """Lift every hold (the plugin is closing)."""
        keys = list(self._held_keys)
        self._held_keys.clear()
        self._held.clear()
        if keys:
            _distributed.release_tasks(scheduler, keys, "blockflow-admission-close")

    def _forget(self, key) -> None:
        self._admitted.discard(key)
        for k in (key, *self._consumers.pop(key, ())):
            self._watched[k] -= 1
            if self._watched[k] <= 0:
                del self._watched[k]

    def status(self) -> dict[str, Any]:
        """Plain data for the plugin's status: the budget last applied, feeders held and
        admitted now, the most active at once, released so far."""
        return {"enabled": self.enabled, "budget": self.last_budget,
                "held": len(self._held_keys), "admitted": len(self._admitted),
                "peak_active": self.peak_active, "released": self.released,
                "resources": dict(self.resources)}
