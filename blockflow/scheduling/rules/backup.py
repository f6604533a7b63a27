"""The backup rule: speculative copies of straggling kernel tasks on idle fast workers."""

from __future__ import annotations

import math

from blockflow.scheduling.actions import Action, Decision
from blockflow.scheduling.rules.base import Rule, RuleContext, fmt_seconds

__all__ = ["BackupRule"]


class BackupRule(Rule):
    """Backup copies of straggling kernel tasks on idle fast workers (LATE-style).

    A running kernel task's time to end is what remains of ``duration / speed`` (pessimistic
    speed), or as long again as it has run once overrun; longest first. Once nothing is queued,
    a task gets one copy on the idle worker that would finish it soonest (compute plus
    transfers), when its time to end exceeds :attr:`backup_ratio` times that, it has run
    :attr:`backup_min_elapsed` of its duration, and fewer than :attr:`backup_slots` of all
    threads run copies. Workers in ``context.taken`` or ``context.paused_now`` take none. A
    blockflow heuristic after LATE (Zaharia et al., OSDI 2008) and MapReduce's backup tasks
    (Dean & Ghemawat, OSDI 2004). Runs on ``"tick"``.

    Parameters
    ----------
    enabled : bool
    backup_slots, backup_ratio, backup_min_elapsed : float
        See :class:`~blockflow.scheduling.policies.DynamicPolicy`.
    """

    def __init__(self, enabled: bool, backup_slots: float, backup_ratio: float,
                 backup_min_elapsed: float):
        self.enabled = enabled
        self.backup_slots = backup_slots
        self.backup_ratio = backup_ratio
        self.backup_min_elapsed = backup_min_elapsed

    def run(self, snap, context: RuleContext) -> list[Decision]:
        if snap.event != "tick":
            return []
        return self.backups(snap, context.paused_now, frozenset(context.taken))

    def backups(self, snap, paused_now=frozenset(), taken=frozenset()) -> list[Decision]:
        if not self.enabled or not snap.running or snap.queued or not any(
                t.kernel for tasks in snap.running.values() for t in tasks):
            return []  # only kernels are copied: with none running, no worker is looked at
        views = snap.workers
        usable = {a: w for a, w in views.items()
                  if w.status == "running" and a not in paused_now}
        threads = sum(max(w.nthreads, 1) for w in usable.values())
        budget = max(1, int(self.backup_slots * threads)) - len(snap.backups)
        busy = set(snap.backups.values())  # running a copy, outside the scheduler's count
        idle = {a: w for a, w in usable.items()
                if w.processing < max(w.nthreads, 1) and a not in busy and a not in taken}
        if budget <= 0 or not idle:
            return []
        candidates = []
        for addr, tasks in snap.running.items():
            w = views.get(addr)
            if w is None:
                continue
            speed = w.speed if w.recent_speed is None else min(w.speed, w.recent_speed)
            for t in tasks:
                if not t.kernel or t.key in snap.backups or not t.duration_measured \
                        or t.duration <= 0 or t.elapsed < self.backup_min_elapsed * t.duration:
                    continue
                expected = t.duration / max(speed, 1e-6)
                left = expected - t.elapsed if t.elapsed < expected else t.elapsed
                candidates.append((left, expected, addr, t))
        out: list[Decision] = []
        for left, expected, addr, t in sorted(candidates, key=lambda c: -c[0]):
            if budget <= 0 or not idle:
                break
            peers = set(views[addr].device_peers) | {addr}
            best, best_time = None, math.inf
            for a, f in idle.items():
                if a in peers:
                    continue
                took = t.duration / max(f.speed, 1e-6) + 2 * t.input_bytes / max(
                    snap.bandwidth, 1.0)
                if took < best_time:
                    best, best_time = a, took
            if best is None or not left > self.backup_ratio * best_time:
                continue
            seen = views[addr].seen()
            seen.update({"elapsed": round(t.elapsed, 4), "expected": round(expected, 4),
                         "time_to_end": round(left, 4), "backup_time": round(best_time, 4),
                         "input_bytes": t.input_bytes})
            out.append(Decision(
                Action.SPECULATE, addr, f"running {t.elapsed:.3f}s, estimated "
                f"{fmt_seconds(left)} to end here vs {fmt_seconds(best_time)} for a copy on "
                f"the idle target", seen, target=best, key=t.key))
            del idle[best]
            budget -= 1
        return out
