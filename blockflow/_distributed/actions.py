"""Actions on the scheduler: what blockflow does to distributed's scheduler state.

Pause and resume workers, move a waiting task (the work-stealing protocol), restrict, hold,
release and fail tasks, suspend distributed's balancer, schedule callbacks and coroutines on
the scheduler's loop, ask a worker for a backup copy. Each takes keys and addresses (plain
data) and answers whether it acted; reading the scheduler is :mod:`blockflow._distributed.views`.
"""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import Callable, Iterable
from typing import Any

from distributed.core import Status

from blockflow._distributed.placement import HOLD_ADDRESS, _restricted

__all__ = [
    "call_soon",
    "fail_tasks",
    "hold_tasks",
    "move_task",
    "release_tasks",
    "request_backup",
    "restrict_task",
    "retire_idle_worker",
    "set_worker_status",
    "spawn",
    "suspend_work_stealing",
]



def set_worker_status(scheduler, address: str, paused: bool, stimulus_id: str) -> bool:
    """Pause (or resume) a worker on the scheduler side only; the worker keeps running the
    tasks it already has. False when the worker is gone."""
    ws = scheduler.workers.get(address)
    if ws is None:
        return False
    status = Status.paused if paused else Status.running
    scheduler.handle_worker_status_change(status, ws, stimulus_id=stimulus_id)
    return True


def retire_idle_worker(scheduler, address: str, stimulus_id: str) -> bool:
    """Retire ``address`` if it is idle: no task processing (running or queued) on it.

    The worker is paused on the scheduler first, in the same step as the check, so that no
    task lands on it between the check and the retirement; then distributed's
    ``Scheduler.retire_workers`` moves its results to other workers and closes it (and its
    nanny). False (nothing done) when the worker is gone, busy or already leaving.
    """
    ws = scheduler.workers.get(address)
    if ws is None or ws.processing or ws.status not in (Status.running, Status.paused):
        return False
    if ws.status == Status.running:
        scheduler.handle_worker_status_change(Status.paused, ws, stimulus_id=stimulus_id)
    spawn(scheduler, scheduler.retire_workers(workers=[address], close_workers=True,
                                              remove=True, stimulus_id=stimulus_id))
    return True


def move_task(scheduler, key, victim: str, thief: str) -> bool:
    """Ask ``victim`` to give up its queued task ``key`` for ``thief`` (work-stealing
    protocol).

    Returns False when no request was sent: the task or a worker is gone, the task is no
    longer waiting on ``victim`` or has started, stealing is disabled, or a move is already
    pending. The victim refuses if it started the task meanwhile, so a started task never
    moves.
    """
    stealing = scheduler.extensions.get("stealing")
    ts = scheduler.tasks.get(key)
    v, t = scheduler.workers.get(victim), scheduler.workers.get(thief)
    if stealing is None or ts is None or v is None or t is None:
        return False
    if ts.processing_on is not v or ts in v.executing or ts in stealing.in_flight:
        return False
    answer = stealing.move_task_request(ts, v, t)
    return answer not in ("in-flight", "comm-closed")


def restrict_task(scheduler, key, address: str | Iterable[str]) -> bool:
    """Pin a task that has not been assigned yet to one worker, or a set of workers (strict
    restriction).

    False when the task is gone, already assigned or finished, restricted by the user, or
    none of the workers is connected.
    """
    ts = scheduler.tasks.get(key)
    addresses = {address} if isinstance(address, str) else set(address)
    addresses &= set(scheduler.workers)
    if (ts is None or ts.state not in ("released", "waiting", "no-worker")
            or _restricted(ts) or not addresses):
        return False
    ts.worker_restrictions = addresses
    ts.loose_restrictions = False
    return True


class suspend_work_stealing:
    """Stop distributed's balancing loop (not the stealing protocol) until :meth:`restore`.

    distributed's balancer models all workers as equally fast and hands queued work to any
    idle worker, which undoes speed-aware placement (it gives a slow worker the last tasks).
    The stealing extension stays installed: blockflow's moves use its protocol.
    """

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.pc = scheduler.periodic_callbacks.get("stealing")
        if self.pc is not None:
            self.pc.stop()

    def restore(self) -> None:
        if self.pc is not None and self.scheduler.periodic_callbacks.get("stealing") is self.pc:
            self.pc.start()
        self.pc = None


def fail_tasks(scheduler, keys, exception: BaseException, stimulus_id: str) -> int:
    """Fail tasks waiting in ``no-worker`` with ``exception``, as distributed's own
    ``no-workers-timeout`` fails them (their dependents fail too; clients get the error).

    Returns
    -------
    int
        Tasks failed (tasks gone or no longer in ``no-worker`` are skipped).
    """
    payload = pickle.dumps(exception)
    recs: dict = {}
    n = 0
    for key in keys:
        ts = scheduler.tasks.get(key)
        if ts is None or ts.state != "no-worker":
            continue
        recs.update(scheduler.transition(key, "erred", stimulus_id=stimulus_id,
                                         exception=payload, cause=key,
                                         exception_text=str(exception)))
        n += 1
    if recs:
        scheduler.transitions(recs, stimulus_id)
    return n


def hold_tasks(scheduler, keys, stimulus_id: str | None = None) -> list:
    """Hold tasks that have not been scheduled yet: restricted to :data:`HOLD_ADDRESS`, they
    wait in ``no-worker`` (never on a worker) until :func:`release_tasks`. A task of an
    earlier graph still in the scheduler's queue (``queued``: root-task queuing) is taken
    out of it and held the same way (``queued -> released -> waiting -> no-worker``, under
    ``stimulus_id``). Returns the keys held (tasks gone, already on a worker or in memory,
    or restricted otherwise are left alone)."""
    held, queued = [], []
    for key in keys:
        ts = scheduler.tasks.get(key)
        if ts is None or ts.state not in ("released", "queued") or _restricted(ts):
            continue
        ts.worker_restrictions = {HOLD_ADDRESS}
        ts.loose_restrictions = False
        held.append(key)
        if ts.state == "queued":
            queued.append(key)
    if queued:
        # a restricted task is never root-ish: from "waiting" it goes to "no-worker"
        scheduler.transitions({k: "released" for k in queued},
                              stimulus_id or f"blockflow-hold-{time.time()}")
    return held


def release_tasks(scheduler, keys, stimulus_id: str) -> list:
    """Lift :func:`hold_tasks`'s hold; tasks ready to run are scheduled at once (distributed
    picks the worker, as for any unrestricted task), the others when their inputs are done.
    Returns the keys released."""
    released, recs = [], []
    for key in keys:
        ts = scheduler.tasks.get(key)
        if ts is None or ts.worker_restrictions != {HOLD_ADDRESS}:
            continue
        ts.worker_restrictions = None
        released.append(key)
        if ts.state == "no-worker":
            recs.append(ts)
    if recs:
        # recommendations run last-in first-out: highest priority last
        recs.sort(key=lambda t: t.priority or (), reverse=True)
        scheduler.transitions({t.key: "processing" for t in recs}, stimulus_id)
    return released


def call_soon(scheduler, fn: Callable[[], Any]) -> None:
    """Run ``fn()`` on the scheduler's event loop, after the current handler (e.g. from a
    plugin's ``transition`` hook, where changing scheduler state is not safe)."""
    scheduler.loop.add_callback(fn)


async def request_backup(scheduler, key, victim: str, target: str, timeout: float) -> dict:
    """Ask worker ``victim`` to start a backup copy of its running task ``key`` on worker
    ``target`` and wait (at most ``timeout`` seconds) for the outcome: the reply of the
    victim's ``blockflow_speculate`` handler (:mod:`blockflow.core.speculation`), or
    ``{"outcome": "failed", "error": ...}``."""
    try:
        return await asyncio.wait_for(
            scheduler.rpc(victim).blockflow_speculate(key=key, target=target), timeout)
    except Exception as e:  # a worker gone, no handler there, a timeout: the original runs on
        return {"outcome": "failed", "error": f"{type(e).__name__}: {e}"}


def spawn(scheduler, coro) -> None:
    """Run a coroutine on the scheduler's event loop without waiting for it."""
    scheduler.loop.add_callback(lambda: asyncio.ensure_future(coro))
