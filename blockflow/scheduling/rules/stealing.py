"""The stealing hand-over: blockflow balances on known speeds, or distributed's work stealing does."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from blockflow.scheduling import estimate
from blockflow.scheduling.actions import Action, Decision
from blockflow.scheduling.rules.base import Rule, RuleContext

__all__ = ["StealingRule"]


class StealingRule(Rule):
    """Suspend distributed's stealing while blockflow balances on known speeds; hand it back when
    blockflow knows too little.

    Starts on the speed model's strict test (1.3x at 0.1 %), stops after :attr:`calm_ticks`
    snapshots without the weak one (1.15x at 10 %): hysteresis. Yields ``suspend-stealing`` /
    ``restore-stealing``; nothing with ``hands_over`` false. :attr:`active`: balancing now.

    Data-bound work (:meth:`data_bound`) stays with distributed's stealing whatever the
    speeds: blockflow's moves would not pay for sending its inputs, so with stealing paused
    nothing would balance (issue 39: 1.12x plain Dask with 32 MiB inputs of 0.25 s tasks).
    """

    #: Snapshots in a row without a speed difference before balancing goes back to
    #: distributed.
    calm_ticks = 10
    #: Waiting tasks looked at by :meth:`data_bound`, in all and per worker (its cost per
    #: tick: each view prices its inputs' transfer to every worker).
    sample = 64
    sample_per_worker = 8

    def __init__(self, hands_over: bool):
        self.hands_over = hands_over
        self.active = False
        self.calm = 0
        self.bound = False  # the last verdict of data_bound, kept while nothing waits
        self.handed = False  # the last judge handed data-bound work to distributed

    def data_bound(self, snap) -> bool:
        """Whether most tasks waiting on workers are data-bound: a balancing move gains about
        one task's compute, and sending its inputs to the cheapest other worker takes too long
        for that gain to pay (:func:`~blockflow.scheduling.estimate.move_pays`: more than
        twice the transfer). Up to :attr:`sample_per_worker` tasks of each worker, busiest
        first, :attr:`sample` in all, left for the moves; with none waiting (or
        none with known transfer costs) the last verdict stands. A blockflow heuristic, in
        the spirit of distributed's stealing, which weighs transfer against compute.
        """
        heavy = seen = 0
        waiting = snap.waiting
        if not waiting:
            return self.bound
        peeked = _Peeked(waiting)
        busiest = sorted((a for a in waiting if a in snap.workers),
                         key=lambda a: -snap.workers[a].processing)
        for address in busiest:
            if seen >= self.sample:
                break
            for task in peeked.head(address, self.sample_per_worker):
                others = [c for a, c in task.comm_cost.items() if a != address]
                if not others:
                    continue
                seen += 1
                heavy += not estimate.move_pays(task.duration, 0.0, min(others), 0.0)
        snap.waiting = peeked  # the tasks looked at are still there for the moves
        if seen:
            self.bound = 2 * heavy > seen
        return self.bound

    def judge(self, snap) -> bool:
        """The snapshot's ``balancing`` flag from its speed tests (counts calm snapshots);
        false for data-bound work (:meth:`data_bound`)."""
        self.handed = bool(snap.speeds_differ or (self.active and snap.speeds_differ_weakly)) \
            and self.data_bound(snap)
        if self.handed:
            self.calm = 0
            return False
        if not self.active:
            return bool(snap.speeds_differ)
        if snap.speeds_differ_weakly:
            self.calm = 0
            return True
        self.calm += 1
        return self.calm < self.calm_ticks

    def run(self, snap, context: RuleContext | None = None) -> list[Decision]:
        if not self.hands_over or snap.event != "tick" or bool(snap.balancing) == self.active:
            return []  # (no change: no worker is looked at)
        seen = {"speeds": {a: round(w.speed, 3) for a, w in snap.workers.items()},
                "confidence": {a: round(w.speed_confidence, 2)
                               for a, w in snap.workers.items()}}
        if snap.balancing:
            self.active, self.calm = True, 0
            return [Decision(Action.SUSPEND_STEALING, "", "worker speeds known to differ: blockflow "
                             "balances on them; distributed's work stealing paused", seen)]
        self.active = False
        if self.handed:
            return [Decision(Action.RESTORE_STEALING, "", "tasks' inputs take longer to send "
                             "than a move gains: balancing handed back to distributed's work "
                             "stealing", seen)]
        return [Decision(Action.RESTORE_STEALING, "", "worker speeds not known to differ: balancing "
                         "handed back to distributed's work stealing", seen)]


class _Peeked(Mapping):
    """``snapshot.waiting`` (address -> one-pass iterator of waiting tasks) whose first tasks
    can be looked at without being taken from the policy's iterators."""

    def __init__(self, waiting: Mapping):
        self._waiting = waiting
        self._heads: dict[str, list] = {}
        self._rest: dict[str, object] = {}

    def head(self, address: str, n: int) -> list:
        """The first ``n`` (or fewer) waiting tasks of ``address``."""
        tasks = self._waiting[address]
        if isinstance(tasks, (list, tuple)):  # read again at will
            return list(tasks[:n])
        rest = iter(tasks)
        self._heads[address] = list(itertools.islice(rest, n))
        self._rest[address] = itertools.chain(self._heads[address], rest)
        return self._heads[address]

    def __getitem__(self, address):
        if address in self._rest:
            return self._rest[address]
        return self._waiting[address]

    def __iter__(self):
        return iter(self._waiting)

    def __len__(self):
        return len(self._waiting)
