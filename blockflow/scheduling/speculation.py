"""Speculative backup copies of blockflow kernels: the worker side.

A copyable kernel task takes the first of two results, its own or that of a backup copy the
scheduler plugin (:class:`blockflow.scheduling.rules.BackupRule`) started elsewhere. Sources:
MapReduce backup tasks (Dean & Ghemawat 2004), LATE (Zaharia et al., OSDI 2008). Guide:
docs/guide/reliability.md.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from distributed.protocol import to_serialize

from blockflow import _distributed, config
from blockflow._distributed.worker import HandlerPlugin

__all__ = ["SpeculationHandlers", "cancelled", "in_backup_copy", "run_kernel"]

logger = logging.getLogger("blockflow.speculation")

_local = threading.local()
_lock = threading.Lock()
#: (worker address, key) -> _Slot of a kernel running on that worker that may be copied
_running: dict[tuple[str, Any], _Slot] = {}
#: (worker address, key) -> cancel event of a backup copy running on that worker
_backups: dict[tuple[str, Any], threading.Event] = {}


def cancelled() -> bool:
    """Whether the kernel in this thread was overtaken by its other copy (long kernels may
    poll this and stop early)."""
    ev = getattr(_local, "cancel", None)
    return ev is not None and ev.is_set()


def in_backup_copy() -> bool:
    """Whether this thread runs a backup copy of a kernel (not a task of its own)."""
    return bool(getattr(_local, "backup", False))


class _Slot:
    """A running kernel that may be copied: the call to repeat and the first result."""

    def __init__(self, kernel, args, kwargs):
        self.kernel, self.args, self.kwargs = kernel, args, kwargs
        self.done = threading.Event()
        self.cancel = threading.Event()  # set when the backup won: the original may stop
        self.value: Any = None
        self.error: BaseException | None = None
        self.winner: str | None = None  # "original" or "backup"
        self.backup_target: str | None = None
        self.started = time.monotonic()

    def finish(self, winner: str, value: Any = None, error: BaseException | None = None) -> bool:
        with _lock:
            if self.done.is_set():
                return False
            self.winner, self.value, self.error = winner, value, error
            self.done.set()
        return True


def _enabled() -> bool:
    return bool(config.get("speculation.enabled"))


def run_kernel(kernel, call: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
    """Run ``call()`` (one task's kernel attempts) so that a backup copy may overtake it.

    Just ``call()`` outside a worker, with speculation off (``blockflow.speculation.enabled``)
    or for a kernel marked ``speculative=False``; otherwise the kernel runs in a helper
    thread.

    Parameters
    ----------
    kernel : blockflow.core.kernel.Kernel
        Sent to the backup's worker when a copy is asked for.
    call : callable
        The kernel's attempts on this worker.
    args, kwargs
        The kernel's inputs (blocks), as ``call`` uses them.
    """
    if getattr(_local, "backup", False) or not getattr(kernel, "speculative", True):
        return call()
    worker = _distributed.current_worker()
    key = _distributed.current_task_key()
    if worker is None or key is None or not _enabled() \
            or SpeculationHandlers.name not in _distributed.worker_plugins(worker):
        # no scheduler plugin that copies tasks: run as plain Dask does
        return call()
    slot = _Slot(kernel, args, kwargs)
    ident = (worker.address, key)
    with _lock:
        _running[ident] = slot

    def original():
        _local.cancel = slot.cancel
        try:
            value = call()
        except BaseException as e:  # noqa: BLE001 - handed to the task's own thread
            slot.finish("original", error=e)
        else:
            if not slot.finish("original", value):
                logger.info("blockflow: backup copy of %r won; this copy's result dropped",
                            key)
                return
        if slot.backup_target is not None:  # the copy lost: stop it
            _distributed.call_worker_soon(worker, slot.backup_target, "blockflow_backup_cancel",
                                          key=key)

    try:
        _distributed.start_task_thread(original, name=f"blockflow-kernel-{key}")
        slot.done.wait()
    finally:
        with _lock:
            _running.pop(ident, None)
    if slot.winner == "backup":
        slot.cancel.set()
    if slot.error is not None:
        raise slot.error
    return slot.value


# --- RPC handlers on workers -----------------------------------------------------------------


async def _speculate(worker, key=None, target=None) -> dict:
    """On the worker running ``key``: copy it to ``target`` and report who won."""
    slot = _running.get((worker.address, key))
    if slot is None or slot.done.is_set():
        return {"outcome": "finished-first", "detail": "the task ended before the copy began"}
    if slot.backup_target is not None:
        return {"outcome": "declined", "detail": f"a copy already runs on {slot.backup_target}"}
    slot.backup_target = target
    t0 = time.monotonic()
    try:
        reply = await _distributed.call_worker(
            worker, target, "blockflow_backup_run", key=key, origin=worker.address,
            call=to_serialize((slot.kernel, slot.args, slot.kwargs)))
    except Exception as e:  # the target is gone or refused: the original runs on
        return {"outcome": "failed", "error": f"{type(e).__name__}: {e}",
                "backup_seconds": time.monotonic() - t0}
    seconds = time.monotonic() - t0
    if not isinstance(reply, dict):  # an old or foreign worker without the handler
        return {"outcome": "failed", "error": f"no blockflow backup handler on {target}",
                "backup_seconds": seconds}
    if reply.get("status") != "OK":
        return {"outcome": reply.get("status", "failed"), "error": reply.get("error"),
                "backup_seconds": seconds}
    if slot.finish("backup", reply["result"]):
        slot.cancel.set()
        return {"outcome": "backup-won", "backup_seconds": seconds,
                "original_seconds": time.monotonic() - slot.started}
    return {"outcome": "original-won", "backup_seconds": seconds}


async def _backup_run(worker, key=None, origin=None, call=None) -> dict:
    """On the backup's worker: run the kernel on the blocks sent and return its result."""
    kernel, args, kwargs = call
    cancel = threading.Event()
    ident = (worker.address, key)
    _backups[ident] = cancel

    def run():
        _local.backup, _local.cancel = True, cancel
        try:
            return kernel.run(lambda: f"a backup copy of task {key!r}", *args, **kwargs)
        finally:
            _local.backup, _local.cancel = False, None

    try:
        result = await _distributed.run_in_worker_executor(worker, run)
    except Exception as e:
        return {"status": "failed", "error": f"{type(e).__name__}: {e}"}
    finally:
        _backups.pop(ident, None)
    if cancel.is_set():
        return {"status": "original-won"}
    return {"status": "OK", "result": to_serialize(result)}


async def _backup_cancel(worker, key=None) -> dict:
    """On the backup's worker: the original finished first; stop the copy (if it can)."""
    ev = _backups.get((worker.address, key))
    if ev is not None:
        ev.set()
    return {"status": "OK", "cancelled": ev is not None}


#: RPC handlers installed on a worker when it first runs a kernel that may be copied:
#: ``fn(worker, **message)``
HANDLERS: dict[str, Callable] = {
    "blockflow_speculate": _speculate,
    "blockflow_backup_run": _backup_run,
    "blockflow_backup_cancel": _backup_cancel,
}


class SpeculationHandlers(HandlerPlugin):
    """Worker plugin serving the backup-copy RPC handlers (:data:`HANDLERS`) on every
    worker; installed by a policy that starts backup copies."""

    name = "blockflow-speculation"
    idempotent = True

    def handlers(self):
        return HANDLERS
