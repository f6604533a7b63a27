"""The actuator: the one table of handlers that acts on the scheduler, and the decision log.

:meth:`Actuator.apply` runs a command through its handler (:attr:`Actuator.HANDLERS`, one
per :class:`~blockflow.scheduling.actions.Action`) and logs it; :meth:`Actuator.record`
only logs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from blockflow import _distributed
from blockflow.errors import ResourceError
from blockflow.pools.objective import WARN_TOPIC
from blockflow.scheduling import resources
from blockflow.scheduling.actions import Action, Decision, Record, Recorded

__all__ = ["Actuator"]

objective_logger = logging.getLogger("blockflow.pools.objective")


class Actuator:
    """Handlers of the plugin's commands and its decision log (a base of
    :class:`~blockflow.scheduling.plugin.Rebalancer`).
    """

    def apply(self, d: Decision, snap=None, *, log: bool = True) -> bool:
        """Apply one command and log what it did; True if it was applied.

        Commands about one worker apply only while their snapshot shows it.

        Raises
        ------
        TypeError
            If ``d`` is not a :class:`~blockflow.scheduling.actions.Decision`.
        """
        if type(d) is not Decision:
            raise TypeError(f"blockflow: only a Decision is applied, not {d!r}")
        if d.action in self.ON_WORKER and not _on_tasks(d) and (
                snap is None or d.worker not in snap.workers):
            return False
        done = self.HANDLERS[d.action](self, d, snap)
        if done is None:
            return False
        if log:
            self._log(done)
        return True

    def record(self, r: Record, snap=None) -> bool:
        """Log a record; True if logged (a ``keep`` on an unseen worker, or repeated, is not)."""
        if type(r) is not Record:
            raise TypeError(f"blockflow: only a Record is logged as one, not {r!r}")
        if r.action is Recorded.KEEP:
            if snap is not None and r.worker not in snap.workers:
                return False
            last = self.decisions[-1] if self.decisions else None
            if last and last["action"] == Recorded.KEEP and last["worker"] == r.worker:
                return False  # do not flood the log with the same non-decision
        elif r.action is Recorded.WAIT:
            resources.logger.warning(r.reason)
        elif r.action is Recorded.OBJECTIVE and (r.detail or {}).get("warning"):
            objective_logger.warning("blockflow: %s", r.reason)
            if self.scheduler is not None:  # and on the client whose run it is
                _distributed.warn_client(self.scheduler, r.detail.get("client"), WARN_TOPIC,
                                         {"message": f"blockflow: {r.reason}",
                                          "scope": r.detail.get("scope")})
        self._log(r)
        return True

    def log_decision(self, action: str | Recorded, worker: str, reason: str, seen: dict,
                     key: str | None = None, target: str | None = None) -> bool:
        """Record what an Active Memory Manager policy did (``memory-move``).

        Raises
        ------
        ValueError
            If ``action`` names no :class:`~blockflow.scheduling.actions.Recorded`.
        """
        return self.record(Record(action, worker, reason, seen, key=key, target=target))

    def _log(self, d: Decision | Record) -> None:
        """Append to the bounded log (time in seconds since the epoch; plain strings)."""
        self.decisions.append({
            "time": time.time(), "policy": self.policy_name, "action": d.action.value,
            "worker": d.worker, "target": d.target,
            "key": None if d.key is None else str(d.key), "reason": d.reason,
            **{f"seen_{k}": v for k, v in d.seen.items()},
        })

    def _stimulus(self, d: Decision) -> str:
        return f"blockflow-{d.action.value}-{time.time()}"

    # --- handlers: (plugin, decision, snapshot) -> what to log, or None ----------------

    def _on_pause(self, d, snap):
        _distributed.set_worker_status(self.scheduler, d.worker, True, self._stimulus(d))
        self.paused[d.worker] = d.reason
        return d

    def _on_resume(self, d, snap):
        self.paused.pop(d.worker, None)
        # judged on what it does from now on: not on a task that ran through the pause
        self.speeds.reset(d.worker, since=time.time())
        hm = snap.workers[d.worker].host_memory_fraction
        if hm is not None and hm >= (self._host_pause_fraction or math.inf):
            # over its own host-memory pause threshold: the worker resumes itself
            return Record(Recorded.HANDOVER, d.worker, f"{d.reason}; stays paused: host "
                          f"memory {hm:.0%} is over the worker's own pause threshold", d.seen)
        _distributed.set_worker_status(self.scheduler, d.worker, False, self._stimulus(d))
        return d

    def _on_reapply(self, d, snap):
        _distributed.set_worker_status(self.scheduler, d.worker, True,
                                       f"blockflow-{d.detail}-{time.time()}")
        return None

    def _on_hold(self, d, snap):
        if _on_tasks(d):  # producers held back: they wait in no-worker
            if d.detail:  # admission over its budget: some sent to workers come back
                _distributed.take_back_tasks(self.scheduler, list(d.keys),
                                             d.detail["take_back"], self._stimulus(d))
            else:
                _distributed.hold_tasks(self.scheduler, list(d.keys), self._stimulus(d))
            return None
        _distributed.set_worker_status(self.scheduler, d.worker, True, self._stimulus(d))
        self.held[d.worker] = d.reason
        return d

    def _on_release(self, d, snap):
        if _on_tasks(d):
            released = _distributed.release_tasks(self.scheduler, list(d.keys),
                                                  d.detail["stimulus"])
            if d.detail["count"]:
                self.admission.released += len(released)
            return None
        if self.held.pop(d.worker, None) is None:
            return None
        if d.worker not in self.paused:
            _distributed.set_worker_status(self.scheduler, d.worker, False, self._stimulus(d))
        return d

    def _on_move(self, d, snap):
        if d.target not in snap.workers or not _distributed.move_task(
                self.scheduler, d.key, d.worker, d.target):
            return None
        self.moves_requested += 1
        return d

    def _on_restrict_to_workers(self, d, snap):  # assign, place
        where = d.workers or d.worker
        pinned = sum(_distributed.restrict_task(self.scheduler, k, where) for k in d.keys)
        return d if pinned else None

    def _on_speculate(self, d, snap):
        if d.target not in snap.workers or d.key in self.backups:
            return None
        self._start_backup(d)
        return d

    def _on_restrict(self, d, snap):
        placed = [k for k, placement in d.detail.items()
                  if _distributed.set_task_placement(self.scheduler, k, placement)]
        self._placed_now = set(placed)
        if not placed:
            return None
        if len(placed) != len(d.keys):
            d = replace(d, reason=f"{len(placed)} tasks restricted as their kernels asked "
                        f"(resources=, workers=)", seen={"tasks": len(placed)},
                        keys=tuple(placed))
        return d

    def _on_fail(self, d, snap):
        if isinstance(d.detail, BaseException):  # refused before anything runs
            held = _distributed.hold_tasks(self.scheduler, list(d.keys))
            objective_logger.error("%s", d.detail)
            keys = list(d.keys)  # held ones, and restricted ones waiting in no-worker
            _distributed.call_soon(self.scheduler, lambda: _distributed.fail_tasks(
                self.scheduler, keys, d.detail, f"blockflow-refused-{time.time()}"))
            return replace(d, seen={**d.seen, "held": len(held)})
        need = d.seen["resources"]
        failed = _distributed.fail_tasks(self.scheduler, list(d.keys), ResourceError(d.detail),
                                         f"blockflow-unsatisfiable-{time.time()}")
        if not failed:
            return None
        self.unsatisfiable.failed += failed
        resources.logger.error("blockflow: failed %d tasks needing resources %s after %g s: "
                               "no worker declares them", failed, need,
                               self.unsatisfiable.timeout)
        return replace(d, reason=self.unsatisfiable.fail_reason(failed, need),
                       seen={**d.seen, "tasks": failed})

    def _on_suspend_stealing(self, d, snap):
        if self._stealing is None:
            self._stealing = _distributed.suspend_work_stealing(self.scheduler)
        return d

    def _on_restore_stealing(self, d, snap):
        if self._stealing is not None:
            self._stealing.restore()
            self._stealing = None
        return d

    def _on_retire(self, d, snap):
        if d.worker in self.retiring or not _distributed.retire_idle_worker(
                self.scheduler, d.worker, self._stimulus(d)):
            return None
        self.retiring[d.worker] = str(snap.workers[d.worker].name)
        return d

    def _on_dispatch(self, d, snap):
        sent = _distributed.dispatch_tasks(self.scheduler, d.detail, self._stimulus(d))
        rule = self.policy.objective if self.policy is not None else None
        if rule is not None and rule.dispatch is not None and len(sent) != len(d.detail):
            unsent = set(d.detail) - set(sent)
            for k in unsent:
                rule.dispatch.forget(k)
            rule.dispatch.hold([k for k in unsent
                                if _distributed.held_state(self.scheduler, k) is not None])
        return None

    ON_WORKER = frozenset({Action.PAUSE, Action.RESUME, Action.HOLD, Action.RELEASE,
                           Action.MOVE, Action.ASSIGN, Action.PLACE, Action.SPECULATE,
                           Action.RETIRE, Action.REAPPLY})
    #: The one table of handlers: command -> ``handler(plugin, decision, snapshot)``.
    HANDLERS: dict[Action, Callable] = {
        Action.PAUSE: _on_pause,
        Action.RESUME: _on_resume,
        Action.HOLD: _on_hold,
        Action.RELEASE: _on_release,
        Action.MOVE: _on_move,
        Action.ASSIGN: _on_restrict_to_workers,
        Action.PLACE: _on_restrict_to_workers,
        Action.SPECULATE: _on_speculate,
        Action.RESTRICT: _on_restrict,
        Action.FAIL: _on_fail,
        Action.SUSPEND_STEALING: _on_suspend_stealing,
        Action.RESTORE_STEALING: _on_restore_stealing,
        Action.DISPATCH: _on_dispatch,
        Action.RETIRE: _on_retire,
        Action.REAPPLY: _on_reapply,
    }

    def _start_backup(self, d: Decision) -> None:
        """Ask the straggler's worker to copy the task to ``d.target``; record the outcome."""
        started = time.time()
        self.backups[d.key] = {"worker": d.worker, "target": d.target, "started": started}
        self.speculation["launched"] += 1
        expected = float(d.seen.get("time_to_end") or 0.0) + float(
            d.seen.get("backup_time") or 0.0)
        timeout = max(60.0, 10 * expected)

        async def backup():
            reply = await _distributed.request_backup(self.scheduler, d.key, d.worker,
                                                      d.target, timeout)
            self.backups.pop(d.key, None)
            self.record(self._backup_outcome(d, reply, started))

        _distributed.spawn(self.scheduler, backup())

    def _backup_outcome(self, d: Decision, reply: dict[str, Any], started: float) -> Record:
        outcome = reply.get("outcome", "failed")
        stats = self.speculation
        stats[outcome] = stats.get(outcome, 0) + 1
        copy_s = float(reply.get("backup_seconds") or 0.0)
        if outcome == "backup-won":
            # the original's time since the copy began was spent for nothing
            stats["duplicated_seconds"] += copy_s
            stats["saved_seconds"] += max(float(d.seen.get("time_to_end") or 0.0) - copy_s,
                                          0.0)
        elif outcome == "original-won":
            stats["duplicated_seconds"] += copy_s
        detail = reply.get("error") or reply.get("detail") or ""
        return Record(
            Recorded.BACKUP, d.worker, f"{outcome}: copy on the target took {copy_s:.3f}s"
            + (f" ({detail})" if detail else ""),
            {"outcome": outcome, "backup_seconds": round(copy_s, 4),
             "since_start": round(time.time() - started, 4)},
            key=str(d.key), target=d.target)


def _on_tasks(d: Decision) -> bool:
    """Whether ``d`` holds or releases tasks (admission control), not a worker."""
    return d.action in (Action.HOLD, Action.RELEASE) and not d.worker and bool(d.keys)
