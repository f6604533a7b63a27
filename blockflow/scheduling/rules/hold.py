"""The hold rule: keep a slowed worker from pulling the scheduler's queue's last tasks."""

from __future__ import annotations

from statistics import median

from blockflow.scheduling.actions import Action, Decision
from blockflow.scheduling.rules.base import Rule, RuleContext, fmt_seconds

__all__ = ["HoldRule", "pessimistic_speed"]


def pessimistic_speed(snap, addr: str) -> float:
    """The lowest of the confident learned speed, the latest task's speed and ``duration /
    elapsed`` of an overrunning kernel task.
    """
    w = snap.workers[addr]
    speed = w.speed if w.speed_confidence >= 0.5 else 1.0
    if w.recent_speed is not None:
        speed = min(speed, w.recent_speed)
    for t in snap.running.get(addr, ()):
        if t.kernel and t.duration_measured and t.elapsed > t.duration > 0:
            speed = min(speed, t.duration / t.elapsed)
    return speed


class HoldRule(Rule):
    """Hold a slow worker back from the scheduler's queue while the others empty it.

    A running worker whose :func:`pessimistic_speed` is below ``1 /`` :attr:`hold_slowdown` is
    held (paused on the scheduler) when its next task would end after the others finish the
    queue with it: ``busy + duration / speed > (queued + 1 + waiting) x duration / (their total
    speed)``; released when nothing is left to run or the condition fails, judged while it is
    still evidently slowed at the lowest speed seen since it was held (hysteresis). LATE's
    rule of not launching work on slow nodes (Zaharia et al., OSDI 2008) applied to Dask's
    queue; a blockflow heuristic. Held workers join ``context.paused_now``; a ``"graph"`` snapshot
    forgets the stage's kernel duration.

    Parameters
    ----------
    enabled : bool
        Backup copies on (``blockflow.speculation.enabled``); off, nothing is held.
    hold_slowdown : float
        How many times slower than typical (> 1) a worker must evidently be.
    """

    def __init__(self, enabled: bool, hold_slowdown: float):
        self.enabled = enabled
        self.hold_slowdown = hold_slowdown
        # median duration of the kernels running while root tasks are queued, since the
        # last graph arrived
        self.duration: float | None = None
        # held worker -> the lowest pessimistic speed seen while held and still slowed
        self.held_speed: dict[str, float] = {}

    def slowed_now(self, snap, addr: str) -> bool:
        """Whether ``addr`` is now :attr:`hold_slowdown` times slower than typical, at worst."""
        return pessimistic_speed(snap, addr) * self.hold_slowdown <= 1.0

    def run(self, snap, context: RuleContext) -> list[Decision]:
        if snap.event == "graph":
            self.duration = None  # a new stage's kernels are measured afresh
            return []
        out = self.holds(snap, context.paused_now)
        context.paused_now |= {d.worker for d in out if d.action == Action.HOLD}
        return out

    def holds(self, snap, paused_now=frozenset()) -> list[Decision]:
        if not self.enabled:
            return []
        views = snap.workers
        out: list[Decision] = []
        durations = [t.duration for tasks in snap.running.values() for t in tasks
                     if t.kernel and t.duration_measured and t.duration > 0]
        # Between two kernels no worker may run one at a tick (short kernels, or their
        # input tasks running): the stage's kernel duration is kept while the queue lasts,
        # or a held worker would be released with the queue still full.
        # (tasks waiting on workers count only once the queue is empty: read lazily, so a
        # tick with root tasks queued walks no worker here)
        def waiting() -> bool:
            return any(w.processing > w.executing for w in views.values())

        if durations:
            self.duration = median(durations)
        elif not snap.queued and not waiting():
            self.duration = None
        d = self.duration
        for addr in sorted(snap.held):
            w = views.get(addr)
            if w is None:
                continue
            keep, seen = self._condition(snap, addr, d, paused_now)
            if not keep:
                self.held_speed.pop(addr, None)
                out.append(Decision(Action.RELEASE, addr, "nothing is left to run (queue "
                                    "empty, no task waiting) or the others no longer finish it "
                                    "before this worker's next task would end", seen))
        if d is None or not (snap.queued or waiting()):
            return out
        for addr, w in views.items():
            if addr in snap.held or addr in paused_now or w.status != "running":
                continue
            hold, seen = self._condition(snap, addr, d, paused_now)
            if hold:
                self.held_speed[addr] = seen["pessimistic_speed"]
                out.append(Decision(
                    Action.HOLD, addr, f"its next task would take "
                    f"{fmt_seconds(seen['own_time'])} here; the other workers run the "
                    f"{snap.queued} queued and their waiting tasks with it in "
                    f"{fmt_seconds(seen['others_time'])}", seen))
        return out

    def _speed(self, snap, addr: str) -> float:
        """:func:`pessimistic_speed`, held workers at the lowest seen while held: the evidence
        of an overrunning task ends with the task, and a cold start's (halved) that follows
        must not release a worker still evidently slowed (it was released, took a queued
        block 10x slow and decided the stage: worst coarse run 1.44x the fast-only bound).
        """
        speed = pessimistic_speed(snap, addr)
        if addr not in snap.held:
            return speed
        if speed * self.hold_slowdown > 1.0:  # its latest evidence says it is not slow now
            self.held_speed.pop(addr, None)
            return speed
        speed = min(speed, self.held_speed.get(addr, speed))
        self.held_speed[addr] = speed
        return speed

    def _condition(self, snap, addr: str, d: float | None, paused_now) -> tuple[bool, dict]:
        w = snap.workers[addr]
        speed = self._speed(snap, addr)
        seen = w.seen()
        seen.update({"pessimistic_speed": round(speed, 4), "queued": snap.queued})
        if d is None or speed * self.hold_slowdown > 1.0:
            return False, seen
        pool = [f for a, f in snap.workers.items()
                if a != addr and f.status == "running" and a not in paused_now
                and a not in snap.held and a not in w.device_peers]
        others = sum(max(f.speed, 1e-6) * max(f.nthreads, 1) for f in pool)
        if others <= 0:
            return False, seen
        # it takes its next task once its running kernel ends (at its speed now) ...
        busy = max((max(t.duration / max(speed, 1e-6) - t.elapsed, 0.0)
                    for t in snap.running.get(addr, ()) if t.kernel and t.duration_measured),
                   default=0.0)
        own = busy + d / max(speed, 1e-6)
        # ... while the others also run the tasks they hold but have not started
        waiting = sum(max(f.processing - f.executing, 0) for f in pool)
        if not (snap.queued or waiting):
            return False, seen  # nothing left that it could take
        theirs = (snap.queued + 1 + waiting) * d / others
        seen.update({"own_time": round(own, 4), "others_time": round(theirs, 4)})
        return own > theirs, seen
