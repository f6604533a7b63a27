"""Actions on the scheduler: pause, move, restrict, hold, release, fail, backups."""

from __future__ import annotations

import asyncio
import math
import pickle
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from distributed.core import Status

from blockflow._distributed.placement import HOLD_ADDRESS, _restricted

__all__ = [
    "add_worker_plugin",
    "broadcast_each",
    "call_soon",
    "dispatch_tasks",
    "fail_tasks",
    "free_slots",
    "held_state",
    "hold_tasks",
    "move_task",
    "rehold_tasks",
    "release_tasks",
    "remove_worker_plugin",
    "request_backup",
    "restrict_task",
    "retire_idle_worker",
    "set_worker_status",
    "spawn",
    "suspend_work_stealing",
    "warn_client",
]



def set_worker_status(scheduler, address: str, paused: bool, stimulus_id: str) -> bool:
    """Pause (or resume) a worker on the scheduler side only; False when it is gone."""
    ws = scheduler.workers.get(address)
    if ws is None:
        return False
    status = Status.paused if paused else Status.running
    scheduler.handle_worker_status_change(status, ws, stimulus_id=stimulus_id)
    return True


def retire_idle_worker(scheduler, address: str, stimulus_id: str) -> bool:
    """Retire ``address`` if no task is processing on it (``Scheduler.retire_workers``).

    Paused in the same step as the check so nothing lands on it meanwhile. False when the worker is
    gone, busy or already leaving."""
    ws = scheduler.workers.get(address)
    if ws is None or ws.processing or ws.status not in (Status.running, Status.paused):
        return False
    if ws.status == Status.running:
        scheduler.handle_worker_status_change(Status.paused, ws, stimulus_id=stimulus_id)
    spawn(scheduler, scheduler.retire_workers(workers=[address], close_workers=True,
                                              remove=True, stimulus_id=stimulus_id))
    return True


def move_task(scheduler, key, victim: str, thief: str) -> bool:
    """Ask ``victim`` to give up its queued task ``key`` for ``thief`` (work-stealing protocol).

    False when no request was sent (task or worker gone, task started or no longer waiting on
    ``victim``, stealing disabled, a move pending); a started task never moves."""
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
    """Pin an unassigned task to one worker or a set of workers (strict restriction).

    False when the task is gone, assigned, finished, user-restricted, or no worker is connected."""
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

    Its balancer treats all workers as equally fast, which undoes speed-aware placement."""

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
    """Fail tasks waiting in ``no-worker`` with ``exception``, as ``no-workers-timeout`` does.

    Returns
    -------
    int
        Tasks failed (those gone or no longer in ``no-worker`` are skipped).
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
    """Hold unscheduled tasks in ``no-worker`` (restricted to :data:`HOLD_ADDRESS`) until
    :func:`release_tasks`; ``queued`` tasks of earlier graphs too. Returns the keys held."""
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
    """Lift :func:`hold_tasks`'s hold (ready ones run at once); returns the keys released."""
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
    """Run ``fn()`` on the scheduler's loop after the current handler."""
    scheduler.loop.add_callback(fn)


async def request_backup(scheduler, key, victim: str, target: str, timeout: float) -> dict:
    """Ask ``victim`` to start a backup copy of its running task ``key`` on ``target``; the reply
    of its ``blockflow_speculate`` handler, or ``{"outcome": "failed", "error": ...}``."""
    try:
        return await asyncio.wait_for(
            scheduler.rpc(victim).blockflow_speculate(key=key, target=target), timeout)
    except Exception as e:  # a worker gone, no handler there, a timeout: the original runs on
        return {"outcome": "failed", "error": f"{type(e).__name__}: {e}"}


async def broadcast_each(scheduler, msg: Mapping, workers: Iterable[str] | None = None,
                         timeout: float = 10.0) -> tuple[dict[str, Any], dict[str, str]]:
    """Send ``msg`` to each worker (``Scheduler.broadcast``), each bounded by ``timeout``
    seconds: ``(replies, failed)``.

    Parameters
    ----------
    scheduler : distributed.Scheduler
    msg : mapping
        The message (``op`` and its arguments), as ``Scheduler.broadcast`` takes it.
    workers : iterable of str, optional
        Default: every worker the scheduler lists now.
    timeout : float, default 10
        Seconds per worker (connecting and answering).

    Returns
    -------
    replies : dict
        Address -> reply, for the workers that answered.
    failed : dict
        Address -> why (``"no answer within 10 s"``, ``"CommClosedError"``) for the workers
        that did not: unreachable, dying, their event loop stuck. Workers that left the
        scheduler meanwhile are in neither.
    """
    workers = list(scheduler.workers) if workers is None else list(workers)

    async def one(address: str):
        try:
            got = await asyncio.wait_for(
                scheduler.broadcast(msg=dict(msg), workers=[address], on_error="return"),
                timeout)
            reply = got.get(address)
        except (asyncio.TimeoutError, TimeoutError):
            return address, None, f"no answer within {timeout:g} s"
        except (OSError, asyncio.CancelledError) as e:
            return address, None, type(e).__name__
        except KeyError:  # left between the listing and the call
            return address, None, None
        if isinstance(reply, Exception):  # on_error="return": the comm failed on the way
            return address, None, type(reply).__name__
        return address, reply, ""

    replies, failed = {}, {}
    for address, reply, why in await asyncio.gather(*(one(w) for w in workers)):
        if why == "":
            replies[address] = reply
        elif why is not None and address in scheduler.workers:
            failed[address] = why
    return replies, failed


async def add_worker_plugin(scheduler, plugin: bytes, name: str, idempotent: bool = False,
                            timeout: float = 10.0) -> tuple[dict[str, dict], dict[str, str]]:
    """Register a pickled worker plugin as ``name`` for the running and future workers
    (``Scheduler.register_worker_plugin``), each running worker bounded by ``timeout``
    seconds (:func:`broadcast_each`).

    Returns
    -------
    errors : dict
        Address -> distributed's error message, for workers whose plugin ``setup`` raised.
    failed : dict
        Address -> why, for workers that did not answer (they get the plugin if they
        register again).
    """
    if idempotent and name in scheduler.worker_plugins:
        return {}, {}
    scheduler.worker_plugins[name] = plugin
    replies, failed = await broadcast_each(
        scheduler, {"op": "plugin-add", "plugin": plugin, "name": name}, timeout=timeout)
    return _errors(replies), failed


async def remove_worker_plugin(scheduler, name: str, timeout: float = 10.0
                               ) -> tuple[dict[str, dict], dict[str, str]]:
    """Unregister worker plugin ``name`` (``Scheduler.unregister_worker_plugin``), each worker
    bounded by ``timeout`` seconds; as :func:`add_worker_plugin`. KeyError if none is."""
    scheduler.worker_plugins.pop(name)
    replies, failed = await broadcast_each(scheduler, {"op": "plugin-remove", "name": name},
                                           timeout=timeout)
    return _errors(replies), failed


def _errors(replies: Mapping[str, Any]) -> dict[str, dict]:
    return {a: r for a, r in replies.items()
            if isinstance(r, Mapping) and r.get("status") == "error"}


def spawn(scheduler, coro) -> None:
    """Run a coroutine on the scheduler's event loop without waiting for it."""
    scheduler.loop.add_callback(lambda: asyncio.ensure_future(coro))


def dispatch_tasks(scheduler, assignments: Mapping[Any, str], stimulus_id: str) -> list:
    """Send held tasks (:func:`hold_tasks`) that are ready to the workers ``assignments`` names
    (key -> address): each is restricted to its worker and starts there. Returns the keys sent;
    those gone, not held, not ready or whose worker left are skipped (they stay held)."""
    sent = []
    for key, address in assignments.items():
        ts = scheduler.tasks.get(key)
        if (ts is None or ts.state != "no-worker" or ts.worker_restrictions != {HOLD_ADDRESS}
                or address not in scheduler.workers):
            continue
        ts.worker_restrictions = {address}
        sent.append(key)
    if sent:
        scheduler.transitions({k: "processing" for k in sent}, stimulus_id)
    return sent


def free_slots(scheduler) -> dict[str, tuple[int, int]]:
    """Address -> ``(slots, idle threads)`` of each running worker: tasks it may still be
    sent, as distributed's queuing counts them (``ceil(worker-saturation x nthreads)``, one
    task beyond its threads when saturation is off), and threads running nothing.
    Long-running (seceded) tasks take no thread."""
    saturation = scheduler.WORKER_SATURATION
    out = {}
    for a, ws in scheduler.workers.items():
        if ws.status != Status.running:
            continue
        busy = len(ws.processing) - len(ws.long_running)
        limit = (max(math.ceil(saturation * ws.nthreads), ws.nthreads)
                 if math.isfinite(saturation) else ws.nthreads + 1)
        out[a] = (limit - busy, ws.nthreads - busy)
    return out


def held_state(scheduler, key) -> str | None:
    """``"ready"`` for a held task that could start, ``"waiting"`` for one whose inputs are not
    done, None when it is gone or no longer held."""
    ts = scheduler.tasks.get(key)
    if ts is None or ts.worker_restrictions != {HOLD_ADDRESS}:
        return None
    return "ready" if ts.state == "no-worker" else "waiting"


def rehold_tasks(scheduler, keys) -> dict:
    """Hold again tasks sent to a worker that left (restricted to it, they could start
    nowhere). Returns key -> whether it is ready to start, for those held."""
    out = {}
    for key in keys:
        ts = scheduler.tasks.get(key)
        if ts is None or ts.state not in ("released", "waiting", "no-worker") \
                or not ts.worker_restrictions or ts.worker_restrictions & set(scheduler.workers):
            continue
        ts.worker_restrictions = {HOLD_ADDRESS}
        out[key] = ts.state == "no-worker"
    return out


def warn_client(scheduler, client: str | None, topic: str, message: dict) -> bool:
    """Send ``message`` (plain data) to one client on event ``topic``, where a handler the
    client subscribed (``Client.subscribe_topic``) shows it; a client without one ignores
    it. False when the client is gone (or ``client`` is None)."""
    if client is None or client not in scheduler.client_comms:
        return False
    scheduler.report({"op": "event", "topic": topic, "event": (time.time(), message)},
                     client=client)
    return True
