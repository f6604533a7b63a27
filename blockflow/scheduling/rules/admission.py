"""The admission rule: CPU producers feeding consumers that need a worker resource (a GPU).

In a pipeline of unrestricted producers (loading, decoding, on CPU workers) each feeding a
consumer that needs ``resources={"GPU": 1}``, distributed holds back nothing: tasks with
resource restrictions are never queued, so when a producer finishes its consumer is assigned
to the GPU worker at once, the CPU worker takes the next producer, and the producers race
ahead of the GPU, their outputs piling up in memory.

:class:`AdmissionRule` lets producers run only while the outputs held for consumers stay
within a budget. When a graph arrives, its *feeders* (tasks without restrictions whose every
dependent needs a worker resource) are held back by the scheduler (a restriction no worker
satisfies: they wait in ``no-worker``); the highest-priority ones are released as long as

    feeders running or released + outputs waiting for a consumer that has all its inputs
    <= budget

and each time one of them finishes feeding (its consumer done) the next is released, on the
next turn of the event loop and on every tick. Outputs whose consumers still wait for other
inputs do not count, so a consumer of more inputs than the budget still gets them all (no
deadlock); a held task no consumer needs any more is released. The default budget is twice
the threads of the workers that declare the consumers' resources plus one per other worker. A blockflow heuristic, in
the spirit of distributed's root-task queuing (``worker-saturation``), which does not apply
here.

Across submissions (``client.map(produce, ...)`` then ``client.map(consume, futures,
resources={"GPU": 1})``, distributed#9164's form): when the consumers arrive, an earlier
graph's feeders still in the scheduler's queue are taken out of it and held, and those
already on a worker or in memory count against the budget. The rule also learns the
(client, task prefix) of such feeders: that client's next tasks of that prefix that nothing
depends on yet are held as they arrive (*expected* feeders, released at the budget's rate,
their outputs counted against it) for at most ``blockflow.resources.admission-grace``; if
no consumer comes by then they all run and the pattern is forgotten. Nothing can be held
when root-task queuing is off (every producer is on a worker at once) or when the
consumers come after the producers ran (see the scheduling guide).

The rule reads plain data and yields commands and records; the actuator applies them
(:meth:`blockflow.scheduling.actuator.Actuator.apply`). On a graph it runs twice: on the
``"graph"`` snapshot taken after the kernels' own restrictions were applied, yielding one
``hold`` of the feeders' keys; then on an ``"admit"`` snapshot, yielding the ``release`` of
what the budget allows and one ``admit`` record, the only one logged.

Admission control runs in blockflow's scheduler plugin under every policy but ``off``
(observe only). Held tasks show as ``no-worker`` in distributed's dashboard. Setting
``distributed.scheduler.no-workers-timeout`` would fail them: leave it unset with admission
control on, or turn this off (``blockflow.resources.admission-budget: 0``).
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


class AdmissionRule(Rule):
    """Hold producers back until their outputs fit the budget (see the module docstring).

    Snapshots it reads (:class:`~blockflow.scheduling.policies.ClusterSnapshot`):

    ``"graph"``
        ``feeders`` (the new graph's feeders, :func:`blockflow._distributed.feeder_tasks`,
        taken after the kernels' restrictions were applied): one ``hold`` of their keys.
    ``"held"``
        Taken once that hold is applied: ``feeder_states``
        (:class:`blockflow._distributed.FeederStates`) and ``workers``. The feeders of the
        ``"graph"`` snapshot whose hold took are tracked; then the release step (below) and,
        if any feeder was held, an ``admit`` record (logged). Nothing when the graph had
        no feeders.
    ``"admit"``
        The release step: a ``release`` of the held feeders the budget has room for, highest
        priority first, and of those no consumer needs any more. The plugin takes one when
        a transition of a tracked task may have freed room (:meth:`watches`).
    ``"tick"``
        The release step; every tenth tick first a ``release`` of every held feeder no
        consumer needs any more.
    ``"close"``
        A ``release`` of every held feeder (the plugin is closing).

    ``hold`` and ``release`` decisions here are about tasks (``keys``, no ``worker``); their
    ``detail`` is ``{"stimulus": str, "count": bool}``: the stimulus id of the release and
    whether the plugin adds the tasks it released to :attr:`released` (the orphan sweep's
    and the closing release are not counted).

    Parameters
    ----------
    budget : int, optional
        Most feeder outputs (with feeders running) held at once; default
        ``blockflow.resources.admission-budget``; None there: :func:`default_budget`; 0 turns
        admission control off.
    grace : str or float, optional
        How long expected feeders (a learned pattern) wait for their consumers, seconds or
        ``"2s"``; default ``blockflow.resources.admission-grace``; 0: nothing is held before
        its consumers arrive.

    Attributes
    ----------
    enabled : bool
    released : int
        Feeders released so far (counted by the plugin as it applies ``release``).
    peak_active : int
        The most feeders active at once.
    last_budget : int or None
        The budget last applied.
    """

    def __init__(self, budget: int | None = None, grace: str | float | None = None):
        budget = config.get("resources.admission-budget", budget)
        self.budget = None if budget is None else int(budget)
        self.enabled = self.budget != 0
        self.grace = parse_timedelta(config.get("resources.admission-grace", grace))
        # (client, prefix) -> resources its consumers needed: producers whose consumers
        # came in a later graph of the same client (least recently seen first out)
        self.patterns: OrderedDict[tuple, dict] = OrderedDict()
        self._expected: dict[Any, tuple[float, tuple]] = {}  # key -> (deadline, pattern)
        self.expired = 0  # expected feeders released because no consumer came in time
        self._held: list[tuple[tuple, int, Any]] = []  # heap of (priority, seq, key)
        self._held_keys: set = set()
        self._admitted: set = set()
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

    def _release(self, keys: list, count: bool, stimulus: str | None = None) -> Decision:
        return Decision(Action.RELEASE, "", f"{len(keys)} producers released (admission "
                        f"control)", keys=tuple(keys),
                        detail={"stimulus": stimulus
                                or f"blockflow-admission-{next(self._seq)}",
                                "count": count})

    def expected(self, client) -> frozenset:
        """Task prefixes whose new tasks from ``client`` are held as expected feeders (their
        consumers came in a later graph of this client before); empty with no grace."""
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
        """Track the feeders of the last graph whose hold took, and an earlier graph's
        feeders already running or feeding (they count against the budget); learn the
        prefixes of earlier graphs' feeders; their number held (None when no graph's
        feeders were waiting)."""
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
                    continue
                heapq.heappush(self._held, (f.priority, next(self._seq), f.key))
                self._held_keys.add(f.key)
                self._expected[f.key] = (self._now + self.grace, (self._client, f.group))
                self._consumers[f.key] = ()
                self._watched[f.key] += 1
                held += 1
                continue
            elif state in _HELD:
                held += 1
                heapq.heappush(self._held, (f.priority, next(self._seq), f.key))
                self._held_keys.add(f.key)
                self._consumers[f.key] = f.consumers
                self._watched.update((f.key, *f.consumers))
            elif state in _ACTIVE:
                # an earlier graph's producer already on a worker or feeding: it counts
                # against the budget as if released here (its consumers arrived late)
                self._admitted.add(f.key)
                self._consumers[f.key] = f.consumers
                self._watched.update((f.key, *f.consumers))
            else:
                continue
            for r, q in f.resources.items():
                self.resources[r] = max(self.resources.get(r, 0), q)
        return held

    def _waits(self, key, state: str) -> bool:
        """Whether an expected feeder still waits for its consumers (within the grace):
        held, it is not an orphan; in memory, its output counts against the budget."""
        return key in self._expected and state in ("orphan", "done")

    def _expire(self, now: float) -> list[Decision]:
        """Expected feeders whose consumers did not come within the grace: release those
        still held, stop counting the others, and forget their patterns (a miss)."""
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
        """Release held feeders, highest priority first, while the active ones fit the
        budget; a held feeder no consumer needs any more is released without counting
        against it. After a graph that held feeders, the ``admit`` decision too."""
        out: list[Decision] = []
        chosen: list = []
        if self._held_keys or self._admitted:
            states = snap.feeder_states
            active = 0
            for key, state in states.read(list(self._admitted)).items():
                if state in _ACTIVE or self._waits(key, state):
                    active += 1
                elif state == "done":
                    self._forget(key)
            room = self._budget(snap.workers) - active
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
            self.peak_active = max(self.peak_active, active + len(chosen))
            if not self._held_keys:
                self._held.clear()
        if after_graph:
            out.append(Record(
                Recorded.ADMIT, "", f"{after_graph} producers feed tasks that need resources "
                f"{self.resources}: they run as their outputs fit the budget of "
                f"{self.last_budget} held at once ({len(chosen)} released now)",
                {"budget": self.last_budget, "held": len(self._held_keys)}))
        return out

    def _orphans(self, states) -> list[Decision]:
        """Release held feeders that no consumer needs any more (their consumers were
        cancelled or failed): O(held), on some ticks only."""
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
        self._held_keys.clear()
        self._held.clear()
        self._expected.clear()
        return [self._release(keys, count=False, stimulus="blockflow-admission-close")] \
            if keys else []

    def _forget(self, key) -> None:
        self._admitted.discard(key)
        self._expected.pop(key, None)
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
                "resources": dict(self.resources), "expected": len(self._expected),
                "expired": self.expired, "patterns": len(self.patterns)}
