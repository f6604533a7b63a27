"""The admission rule: CPU producers feeding consumers that need a worker resource (a GPU).

distributed never queues resource-restricted tasks, so unrestricted producers race ahead of
their GPU consumers. :class:`AdmissionRule` holds the *feeders* (unrestricted tasks whose
every dependent needs a resource) in ``no-worker`` and releases them while ``feeders running
or released + outputs waiting for a ready consumer <= budget``; a blockflow heuristic in the
spirit of root-task queuing (guide: :doc:`/guide/scheduling`, "Admission"). The budget is the
scheduler's, across graphs and clients: producers of an earlier graph already sent to workers
when their consumers arrive count against it, and those over it are taken back (the ones
waiting behind a worker's threads first) and held with the rest.
``distributed.scheduler.no-workers-timeout`` would fail held tasks: leave it unset, or set
``blockflow.resources.admission-budget: 0``.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

from dask.utils import parse_timedelta

from blockflow import config
from blockflow.scheduling.actions import Action, Decision, Record, Recorded
from blockflow.scheduling.rules.base import Rule, RuleContext

__all__ = ["AdmissionRule", "default_budget"]

#: Feeder states that count against the budget (see _distributed.feeder_states).
_ACTIVE = frozenset({"pending", "running", "feeding"})
#: Feeder states of a task still held back (the hold took).
_HELD = frozenset({"held", "orphan"})
#: Ticks between sweeps for held feeders no consumer needs any more (O(held) each).
_ORPHAN_SWEEP_TICKS = 10
#: (client, task prefix) pairs remembered as feeding consumers submitted later.
_MAX_PATTERNS = 256


def default_budget(workers: Mapping[str, Any], resources: Mapping[str, float]) -> int:
    """Twice the threads of the workers that declare ``resources``, plus one per other worker;
    at least 1. A blockflow heuristic.

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


class AdmissionRule(Rule):
    """Hold producers back until their outputs fit the budget (see the module docstring).

    Runs on ``"graph"`` (hold), ``"held"`` (track, release, ``admit`` record), ``"admit"`` and
    ``"tick"`` (release what fits) and ``"close"`` (release all).

    Parameters
    ----------
    budget : int, optional
        Most feeder outputs held at once; default ``blockflow.resources.admission-budget``,
        None there: :func:`default_budget`; 0 turns admission off.
    grace : str or float, optional
        Seconds expected feeders of a learned prefix wait for consumers; default
        ``blockflow.resources.admission-grace``.

    Attributes
    ----------
    enabled : bool
    released, peak_active : int
        Feeders released so far; the most active at once.
    last_budget : int or None
    """

    def __init__(self, budget: int | None = None, grace: str | float | None = None):
        budget = config.get("resources.admission-budget", budget)
        self.budget = None if budget is None else int(budget)
        self._enabled = True
        self.grace = parse_timedelta(config.get("resources.admission-grace", grace))
        # (client, prefix) -> resources its consumers needed: producers whose consumers
        # came in a later graph of the same client (least recently seen first out)
        self.patterns: OrderedDict[tuple, dict] = OrderedDict()
        self._expected: dict[Any, tuple[float, tuple]] = {}  # key -> (deadline, pattern)
        self.expired = 0  # expected feeders released because no consumer came in time
        self._held: list[tuple[tuple, int, Any]] = []  # heap of (priority, seq, key)
        self._held_keys: set = set()
        self._admitted: set = set()
        self._priority: dict[Any, tuple] = {}  # tracked feeder -> its priority
        self._asked: list = []  # feeders of the last graph: held once their hold took
        self._client = None  # the client that submitted the last graph
        self._now = 0.0
        self._consumers: dict[Any, tuple] = {}  # feeder -> its consumers
        self._watched: Counter = Counter()  # feeders and consumers tracked -> references
        self._seq = itertools.count()
        self._ticks = 0
        self.resources: dict[str, float] = {}
        self.peak_active = 0
        self.released = 0
        self.last_budget: int | None = None

    @property
    def enabled(self) -> bool:
        """Whether admission holds producers: on unless switched off or the budget is 0 (a
        policy that admits setting it true leaves a budget of 0 off: held producers would
        never run)."""
        return self._enabled and self.budget != 0

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = bool(value)

    # --- what the plugin asks ---------------------------------------------------------

    def watches(self, key) -> bool:
        """Whether a transition of ``key`` may free room in the budget (O(1))."""
        return key in self._watched

    @property
    def holding(self) -> bool:
        """Whether any feeder is held back now."""
        return bool(self._held_keys)

    def run(self, snap, context: RuleContext | None = None) -> list[Decision]:
        if snap.event == "graph":
            return self._hold(snap.feeders, snap.client, snap.time)
        if snap.event == "held":
            held = self._track(snap.feeder_states)
            return [] if held is None else self._admit(snap, after_graph=held)
        if snap.event == "admit":
            return self._admit(snap, after_graph=None)
        if snap.event == "tick":
            self._ticks += 1
            out = self._orphans(snap.feeder_states) \
                if self._ticks % _ORPHAN_SWEEP_TICKS == 0 else []
            return out + self._expire(snap.time) + self._admit(snap, after_graph=None)
        if snap.event == "close":
            return self._release_all()
        return []

    # --- the steps ----------------------------------------------------------------------

    def _hold_again(self, key) -> None:
        heapq.heappush(self._held, (self._priority.get(key, ()), next(self._seq), key))
        self._held_keys.add(key)

    def _release(self, keys: list, count: bool, stimulus: str | None = None) -> Decision:
        return Decision(Action.RELEASE, "", f"{len(keys)} producers released (admission "
                        f"control)", keys=tuple(keys),
                        detail={"stimulus": stimulus
                                or f"blockflow-admission-{next(self._seq)}",
                                "count": count})

    def expected(self, client) -> frozenset:
        """Task prefixes of ``client`` held as expected feeders; empty with no grace."""
        if not self.enabled or self.grace <= 0 or client is None:
            return frozenset()
        return frozenset(p for c, p in self.patterns if c == client)

    def _hold(self, feeders, client=None, now: float | None = None) -> list[Decision]:
        self._asked = list(feeders) if self.enabled else []
        self._client = client
        self._now = time.time() if now is None else now
        keys = [f.key for f in self._asked if f.key not in self._held_keys]
        if not keys:
            return []
        return [Decision(Action.HOLD, "", f"{len(keys)} producers feed tasks that "
                         f"need resources: held back (admission control)", keys=tuple(keys))]

    def _track(self, states) -> int | None:
        """Track the last graph's held feeders and an earlier graph's taken over."""
        asked, self._asked = self._asked, []
        if not asked:
            return None
        held = 0
        for f in asked:
            if f.earlier and self._client is not None:
                pattern = (self._client, f.group)
                self.patterns[pattern] = dict(f.resources)
                self.patterns.move_to_end(pattern)
                while len(self.patterns) > _MAX_PATTERNS:
                    self.patterns.popitem(last=False)
            state = states[f.key]
            if f.key in self._admitted and state in _HELD:
                # admitted before, held again: the same key submitted anew (its earlier
                # run forgotten); tracked afresh below
                self._forget(f.key)
            self._priority[f.key] = f.priority
            if f.key in self._held_keys or f.key in self._admitted:
                # tracked already (an expected feeder whose consumers came, or one feeding
                # consumers of two graphs): add the new consumers
                self._expected.pop(f.key, None)
                new = tuple(c for c in f.consumers if c not in self._consumers.get(f.key, ()))
                self._consumers[f.key] = self._consumers.get(f.key, ()) + new
                self._watched.update(new)
            elif not f.consumers:
                # expected: its consumers may come in a later graph, within the grace
                if state not in _HELD:
                    self._priority.pop(f.key, None)
                    continue
                self._hold_again(f.key)
                self._expected[f.key] = (self._now + self.grace, (self._client, f.group))
                self._consumers[f.key] = ()
                self._watched[f.key] += 1
                held += 1
                continue
            elif state in _HELD:
                held += 1
                self._hold_again(f.key)
                self._consumers[f.key] = f.consumers
                self._watched.update((f.key, *f.consumers))
            elif state in _ACTIVE:
                # an earlier graph's producer already on a worker or feeding: it counts
                # against the budget as if released here (its consumers arrived late)
                self._admitted.add(f.key)
                self._consumers[f.key] = f.consumers
                self._watched.update((f.key, *f.consumers))
            else:
                self._priority.pop(f.key, None)
                continue
            for r, q in f.resources.items():
                self.resources[r] = max(self.resources.get(r, 0), q)
        return held

    def _waits(self, key, state: str) -> bool:
        """Whether an expected feeder still waits for its consumers within the grace."""
        return key in self._expected and state in ("orphan", "done")

    def _expire(self, now: float) -> list[Decision]:
        """Give up on expected feeders whose consumers did not come within the grace."""
        late = [k for k, (deadline, _) in self._expected.items() if deadline <= now]
        if not late:
            return []
        keys = []
        for k in late:
            _, pattern = self._expected.pop(k)
            self.patterns.pop(pattern, None)
            if k in self._held_keys:
                self._held_keys.discard(k)
                keys.append(k)
            self._forget(k)
        self.expired += len(keys)
        return [self._release(keys, count=False)] if keys else []

    def _budget(self, workers: Mapping[str, Any]) -> int:
        b = self.budget if self.budget is not None else default_budget(workers, self.resources)
        self.last_budget = b
        return b

    def _admit(self, snap, after_graph: int | None) -> list[Decision]:
        """Release held feeders, highest priority first, while the active ones fit the budget;
        take back running ones over it."""
        out: list[Decision] = []
        chosen: list = []
        taken = 0
        if self._held_keys or self._admitted:
            states = snap.feeder_states
            active = 0
            running = []
            for key, state in states.read(list(self._admitted)).items():
                if state in _ACTIVE or self._waits(key, state):
                    active += 1
                    if state == "running":
                        running.append(key)
                elif state in _HELD:  # taken back over the budget: held with the others
                    self._admitted.discard(key)
                    self._hold_again(key)
                elif state == "done":
                    self._forget(key)
            budget = self._budget(snap.workers)
            room = budget - active
            if room < 0 and running:
                # sent to workers before their consumers came (an earlier graph): the ones
                # over the budget go back to the held ones, those not started first
                taken = min(-room, len(running))
                out.append(Decision(
                    Action.HOLD, "", f"{taken} producers taken back from the workers: "
                    f"{active} outputs would be held against the budget of {budget} "
                    f"(admission control)", keys=tuple(running), detail={"take_back": taken}))
            orphans: list = []
            while self._held and room > 0:
                _, _, key = heapq.heappop(self._held)
                if key not in self._held_keys:
                    continue
                self._held_keys.discard(key)
                if states[key] in ("orphan", "done") and not self._waits(key, states[key]):
                    orphans.append(key)
                    self._forget(key)
                    continue
                chosen.append(key)
                self._admitted.add(key)
                room -= 1
            if chosen or orphans:
                out.append(self._release(chosen + orphans, count=True))
            self.peak_active = max(self.peak_active, active - taken + len(chosen))
            if not self._held_keys:
                self._held.clear()
        if after_graph:
            out.append(Record(
                Recorded.ADMIT, "", f"{after_graph} producers feed tasks that need resources "
                f"{self.resources}: they run as their outputs fit the budget of "
                f"{self.last_budget} held at once ({len(chosen)} released now"
                + (f", {taken} taken back from the workers)" if taken else ")"),
                {"budget": self.last_budget, "held": len(self._held_keys)}))
        return out

    def _orphans(self, states) -> list[Decision]:
        """Release held feeders no consumer needs any more: O(held), on some ticks only."""
        if not self._held_keys:
            return []
        orphans = [k for k, s in states.read(list(self._held_keys)).items()
                   if s in ("orphan", "done") and not self._waits(k, s)]
        for k in orphans:
            self._held_keys.discard(k)
            self._forget(k)
        return [self._release(orphans, count=False)] if orphans else []

    def _release_all(self) -> list[Decision]:
        keys = list(self._held_keys)
        for k in keys:
            self._priority.pop(k, None)
        self._held_keys.clear()
        self._held.clear()
        self._expected.clear()
        return [self._release(keys, count=False, stimulus="blockflow-admission-close")] \
            if keys else []

    def _forget(self, key) -> None:
        self._admitted.discard(key)
        self._priority.pop(key, None)
        self._expected.pop(key, None)
        for k in (key, *self._consumers.pop(key, ())):
            self._watched[k] -= 1
            if self._watched[k] <= 0:
                del self._watched[k]

    def status(self) -> dict[str, Any]:
        """Plain data for the plugin's status: budget, held, admitted, peak, released."""
        return {"enabled": self.enabled, "budget": self.last_budget,
                "held": len(self._held_keys), "admitted": len(self._admitted),
                "peak_active": self.peak_active, "released": self.released,
                "resources": dict(self.resources), "expected": len(self._expected),
                "expired": self.expired, "patterns": len(self.patterns)}
