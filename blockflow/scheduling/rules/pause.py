"""The pause rule: keep new work off hot or nearly-full GPUs, with hysteresis."""

from __future__ import annotations

from blockflow.scheduling.actions import Action, Decision, Record, Recorded
from blockflow.scheduling.rules.base import Rule, RuleContext

__all__ = ["PauseRule"]


class PauseRule(Rule):
    """Pause and resume decisions (hysteresis; never the last usable worker).

    Pause at or above ``memory_high`` device memory or ``hot_high`` utilisation by other work;
    resume at or below both ``memory_low`` and ``hot_low``. The last usable worker is kept
    (``keep``). Paused workers join ``context.paused_now``. Runs on ``"tick"``, judging only
    changed and kept workers.

    Parameters
    ----------
    memory_high, memory_low : float
        Device-memory fractions 0-1.
    hot_high, hot_low : float
        GPU utilisation by other work, percent.
    """

    def __init__(self, memory_high: float, memory_low: float, hot_high: float,
                 hot_low: float):
        self.memory_high, self.memory_low = memory_high, memory_low
        self.hot_high, self.hot_low = hot_high, hot_low
        self._kept: set[str] = set()  # workers kept running as the last usable one
        self._running: set[str] = set()  # workers running (from the changed ones)

    def pause_reason(self, w) -> str | None:
        """Why ``w`` (a WorkerView) should be paused, or None."""
        mem = w.metrics.gpu_memory_fraction
        if mem is not None and mem >= self.memory_high:
            return f"device memory {mem:.0%} >= high-water {self.memory_high:.0%}"
        others = w.others_utilization
        if others is not None and others >= self.hot_high:
            return f"GPU {others:.0f}% busy with other work >= {self.hot_high:.0f}%"
        return None

    def still_hot(self, w) -> bool:
        """Whether ``w`` is above a resume threshold."""
        mem = w.metrics.gpu_memory_fraction
        others = w.others_utilization
        return (mem is not None and mem > self.memory_low) or (
            others is not None and others > self.hot_low)

    def run(self, snap, context: RuleContext) -> list[Decision]:
        if snap.event != "tick":
            return []
        out = []
        # the running workers, kept up to date from the changed ones (a tick reads the
        # workers that changed, not all of them to count those that run)
        if snap.changed is None:
            self._running = {a for a, v in snap.workers.items() if v.status == "running"}
        else:
            for a in snap.changed:
                v = snap.workers.get(a)
                if v is not None and v.status == "running":
                    self._running.add(a)
                else:
                    self._running.discard(a)
        usable = None

        workers = snap.workers
        judged = workers.values() if snap.changed is None else [
            workers[a] for a in sorted((snap.changed | self._kept) & workers.keys())]
        kept = set()
        for w in judged:
            if w.paused_by_blockflow:
                if not self.still_hot(w):
                    mem, others = w.metrics.gpu_memory_fraction, w.others_utilization
                    out.append(Decision(
                        Action.RESUME, w.address,
                        f"below resume thresholds (device memory "
                        f"{'n/a' if mem is None else f'{mem:.0%}'} <= {self.memory_low:.0%}, "
                        f"other GPU work {'n/a' if others is None else f'{others:.0f}%'} "
                        f"<= {self.hot_low:.0f}%)", w.seen()))
                continue
            if w.status != "running":
                continue  # paused by the worker itself or closing: not ours to touch
            reason = self.pause_reason(w)
            if reason is None:
                continue
            if usable is None:
                usable = len(self._running & workers.keys())
            if usable <= 1:
                kept.add(w.address)
                out.append(Record(Recorded.KEEP, w.address,
                                    f"{reason}, but it is the last usable worker", w.seen()))
                continue
            usable -= 1
            out.append(Decision(Action.PAUSE, w.address, reason, w.seen()))
        self._kept = (self._kept - {w.address for w in judged}) | kept
        context.paused_now |= {d.worker for d in out if d.action == Action.PAUSE}
        return out
