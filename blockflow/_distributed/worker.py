"""The worker side: metrics, comm handlers (:class:`HandlerPlugin`), held data, resources, task
threads, and :class:`QuietClose`."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from distributed import get_worker
from distributed.core import Status
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol.pickle import dumps
from distributed.worker import _worker_cvar, thread_state

from blockflow._distributed.checks import check_worker

__all__ = [
    "HEARTBEAT_FAILED",
    "WAIT_METADATA",
    "HandlerPlugin",
    "QuietClose",
    "add_task_wait",
    "call_worker",
    "call_worker_soon",
    "digest_task_seconds",
    "current_task_key",
    "current_worker",
    "current_worker_resources",
    "declare_worker_resources",
    "quiet_closing_heartbeat",
    "quiet_task_failures",
    "registered_worker_plugin",
    "remove_worker_metric",
    "run_in_worker_executor",
    "set_worker_metric",
    "set_worker_metric_soon",
    "start_task_thread",
    "task_retries_given",
    "task_retries_left",
    "task_wait",
    "worker_data_values",
    "worker_declared_resources",
    "worker_heartbeat",
    "worker_metric",
    "worker_plugins",
    "worker_scheduler_clock",
]

logger = logging.getLogger(__name__)


#: Key of a task's metadata (``TaskState.metadata`` on its worker, sent to the scheduler with
#: the task's result): seconds the task spent waiting, seceded, not computing.
WAIT_METADATA = "blockflow_wait"


def add_task_wait(seconds: float) -> None:
    """From a task's thread: count ``seconds`` of the running task as waiting, not computing."""
    try:
        worker = get_worker()
        ts = worker.state.tasks.get(worker.get_current_task())
    except (ValueError, AttributeError, KeyError):
        return
    if ts is not None:
        ts.metadata[WAIT_METADATA] = ts.metadata.get(WAIT_METADATA, 0.0) + float(seconds)


def task_wait(metadata: dict | None) -> float:
    """Seconds a finished task reported waiting (:func:`add_task_wait`); 0 when none."""
    wait = (metadata or {}).get(WAIT_METADATA, 0.0)
    return float(wait) if isinstance(wait, (int, float)) and math.isfinite(wait) \
        and wait > 0 else 0.0


def set_worker_metric(worker, name: str, fn) -> None:
    """Report ``fn(worker)`` as heartbeat metric ``name`` (``WorkerState.metrics[name]``)."""
    worker.metrics[name] = fn


def set_worker_metric_soon(worker, name: str, fn) -> None:
    """From any thread (a task's): :func:`set_worker_metric` on the worker's event loop, which
    reads the metrics at each heartbeat."""
    worker.loop.add_callback(set_worker_metric, worker, name, fn)


def digest_task_seconds(label: str, seconds: float) -> None:
    """Inside a task: digest ``seconds`` as fine performance metric ``label``
    (``("execute", <span>, <task prefix>, label, "seconds")`` on Dask's "Fine Performance
    Metrics" page). distributed subtracts it from the task thread's CPU time first, then its
    non-CPU time, so that the task's figures still add up to its wall time; outside a task:
    nothing."""
    from distributed.metrics import context_meter

    context_meter.digest_metric(label, float(seconds), "seconds")


def remove_worker_metric(worker, name: str, fn=None) -> None:
    """Stop reporting metric ``name``; with ``fn``, only if ``fn`` is what reports it."""
    current = worker.metrics.get(name)
    if current is not None and (fn is None or current is fn):
        worker.metrics.pop(name, None)


def worker_metric(worker, name: str):
    """The callable reporting metric ``name`` on this worker, or None."""
    return worker.metrics.get(name)


class HandlerPlugin(WorkerPlugin):
    """Base of the worker plugins that serve blockflow's comm handlers (subclasses set ``name`` and
    :meth:`handlers`); ``setup`` runs :func:`~blockflow._distributed.checks.check_worker` first."""

    name: str

    def handlers(self) -> Mapping[str, Callable]:
        """Operation name -> ``fn(worker, **message)``; its (awaited) return value is the reply."""
        raise NotImplementedError

    def setup(self, worker) -> None:
        check_worker(worker)
        for op, fn in self.handlers().items():
            worker.handlers[op] = _bound_handler(worker, fn)

    def teardown(self, worker) -> None:
        for op in self.handlers():
            worker.handlers.pop(op, None)


def _bound_handler(worker, fn: Callable) -> Callable:
    def handler(**message):
        return fn(worker, **message)

    return handler


#: What a worker logs (at ERROR, with a traceback) when its heartbeat fails to reach the
#: scheduler, its own ``close`` included (dask/distributed#7192).
HEARTBEAT_FAILED = "Failed to communicate with scheduler during heartbeat."
#: distributed.worker_state_machine's warning (prefix, suffix) for a task its worker's
#: close cancelled.
CANCELLED_AT_CLOSE = ("Async instruction for ", "ended with CancelledError")


class _ClosingHeartbeatFilter(logging.Filter):
    """Drop heartbeat and cancellation records while a worker of this process closes."""

    def __init__(self):
        super().__init__()
        self.workers: weakref.WeakSet = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg != HEARTBEAT_FAILED and not (msg.startswith(CANCELLED_AT_CLOSE[0])
                                            and msg.endswith(CANCELLED_AT_CLOSE[1])):
            return True
        closing = (Status.closing, Status.closing_gracefully)
        return not any(getattr(w, "status", None) in closing for w in list(self.workers))


_closing_filter: _ClosingHeartbeatFilter | None = None


def quiet_closing_heartbeat(worker) -> None:
    """Keep ``worker``'s own shutdown from logging a failed heartbeat; idempotent."""
    global _closing_filter
    if _closing_filter is None:
        _closing_filter = _ClosingHeartbeatFilter()
        # a logger's filters see only its own records, not its children's
        for name in ("distributed.worker", "distributed.worker.state_machine"):
            logging.getLogger(name).addFilter(_closing_filter)
    _closing_filter.workers.add(worker)


class QuietClose(WorkerPlugin):
    """Worker plugin installing :func:`quiet_closing_heartbeat` on every worker."""

    name = "blockflow-quiet-close"

    def setup(self, worker) -> None:
        check_worker(worker)
        quiet_closing_heartbeat(worker)


#: distributed's log message (at ERROR, with a traceback) for a task that raised, and the
#: position of the exception's ``repr`` among its arguments (distributed 2026.7.1,
#: worker.py ``execute``).
COMPUTE_FAILED, COMPUTE_FAILED_EXCEPTION = "Compute Failed", 3


class _TaskFailureFilter(logging.Filter):
    """Drop :data:`COMPUTE_FAILED` records for the exception classes in :attr:`quiet`."""

    def __init__(self):
        super().__init__()
        self.quiet: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(COMPUTE_FAILED):
            return True
        try:
            text = str(record.args[COMPUTE_FAILED_EXCEPTION])
        except (TypeError, IndexError, KeyError):
            return True
        return not any(text.startswith(f"{name}(") for name in self.quiet)


_failure_filter: _TaskFailureFilter | None = None


def quiet_task_failures(exc_type: type[BaseException]) -> None:
    """Keep distributed from logging tasks raising ``exc_type`` (call from the task)."""
    global _failure_filter
    if _failure_filter is None:
        _failure_filter = _TaskFailureFilter()
        logging.getLogger("distributed.worker").addFilter(_failure_filter)
    _failure_filter.quiet.add(exc_type.__name__)


async def call_worker(worker, address: str, op: str, timeout: float | None = None,
                      **kwargs) -> Any:
    """Call handler ``op`` of the worker at ``address`` from ``worker``; return the reply.

    ``timeout`` (seconds) bounds the call (``asyncio.TimeoutError``); without it distributed's
    connect and TCP timeouts bound a worker that became unreachable."""
    call = getattr(worker.rpc(address), op)(**kwargs)
    return await (call if timeout is None else asyncio.wait_for(call, timeout))


def worker_plugins(worker) -> dict:
    """The worker plugins installed on ``worker`` (name -> plugin); a copy."""
    return dict(getattr(worker, "plugins", None) or {})


def registered_worker_plugin(worker, name: str, timeout: float = 60) -> bytes | None:
    """From a task thread: worker plugin ``name`` as the scheduler keeps it (serialised), or None;
    asked over the worker's own scheduler connection."""


    async def ask():
        return await worker.scheduler.run_function(
            function=dumps(_scheduler_worker_plugin), args=dumps((name,)),
            kwargs=dumps({}), wait=True)

    reply = asyncio.run_coroutine_threadsafe(ask(), worker.loop.asyncio_loop).result(timeout)
    if reply.get("status") != "OK":
        raise RuntimeError(f"blockflow: the scheduler could not hand out worker plugin "
                           f"{name}: {reply.get('exception_text') or reply}")
    return reply["result"]


def _scheduler_worker_plugin(name: str, dask_scheduler=None) -> bytes | None:
    return dask_scheduler.worker_plugins.get(name)


def task_retries_given() -> int:
    """From a task thread: the running task's ``retries`` annotation as submitted; 0 without one or
    off a worker."""
    worker, key = current_worker(), current_task_key()
    if worker is None or key is None:
        return 0
    ts = worker.state.tasks.get(key)
    given = ((getattr(ts, "annotations", None) or {}).get("retries") if ts is not None
             else None)
    return int(given) if isinstance(given, int) and not isinstance(given, bool) \
        and given > 0 else 0


def task_retries_left(timeout: float = 10) -> int | None:
    """From a task thread: the retries the scheduler still holds for the running task
    (``TaskState.retries``); None off a worker, for an unknown task, or after ``timeout`` s."""


    worker, key = current_worker(), current_task_key()
    if worker is None or key is None:
        return None

    async def ask():
        return await worker.scheduler.run_function(
            function=dumps(_scheduler_task_retries), args=dumps((key,)),
            kwargs=dumps({}), wait=True)

    try:
        reply = asyncio.run_coroutine_threadsafe(
            ask(), worker.loop.asyncio_loop).result(timeout)
    except Exception as e:  # the scheduler is gone or slow: the caller assumes the worst
        logger.info("blockflow: could not ask the scheduler for the retries of %r: %r",
                    key, e)
        return None
    left = reply.get("result") if reply.get("status") == "OK" else None
    return left if isinstance(left, int) else None


def _scheduler_task_retries(key, dask_scheduler=None) -> int | None:
    ts = dask_scheduler.tasks.get(key)
    return None if ts is None else ts.retries


def worker_data_values(worker) -> list:
    """The results the worker holds in memory (``Worker.data``), spilled ones excluded; safe from a
    thread beside the worker's event loop."""
    data = worker.data
    fast = getattr(data, "fast", data)
    d = getattr(fast, "d", fast)
    for _ in range(5):
        try:
            return list(d.values())
        except RuntimeError:
            continue
    return []


async def worker_heartbeat(worker) -> None:
    """Send a heartbeat now, so the scheduler sees the worker's metrics at once."""
    await worker.heartbeat()


# --- resources on the worker side ------------------------------------------------------------


def worker_declared_resources(worker) -> dict:
    """The resources a worker declares (``Worker(resources=)``, ``--resources``): a copy."""
    return dict(worker.state.total_resources)


async def declare_worker_resources(worker, resources: Mapping[str, float]) -> None:
    """Declare more resources on a worker (``Worker.set_resources``); before it registers, only its
    own accounting changes."""

    if worker.status in (Status.init, Status.created, Status.starting) \
            or getattr(worker, "batched_stream", None) is None \
            or worker.batched_stream.comm is None:
        state = worker.state
        for r, quantity in dict(resources).items():
            state.available_resources[r] = (state.available_resources.get(r, 0)
                                            + quantity - state.total_resources.get(r, 0))
            state.total_resources[r] = quantity
        return
    await worker.set_resources(**dict(resources))


def current_worker_resources() -> tuple[str, dict] | None:
    """``(address, declared resources)`` of the current task's worker, or None."""
    try:
        worker = get_worker()
    except ValueError:
        return None
    return worker.address, dict(worker.state.total_resources)


def call_worker_soon(worker, address: str, op: str, timeout: float = 10.0, **kwargs) -> None:
    """From any thread: call handler ``op`` at ``address`` from ``worker`` without waiting;
    given up after ``timeout`` seconds (an unreachable worker)."""
    async def call():
        try:
            await call_worker(worker, address, op, timeout=timeout, **kwargs)
        except Exception as e:  # the other worker left or does not answer: nothing to tell it
            logger.debug("blockflow: %s on %s failed: %s", op, address, e)

    worker.loop.add_callback(call)


def worker_scheduler_clock(worker) -> float:
    """Seconds to add to ``time.time()`` on ``worker`` for the scheduler's clock (0 off one)."""
    return float(getattr(worker, "scheduler_delay", 0.0) or 0.0) if worker is not None else 0.0


def current_worker():
    """The worker running the current task, or None outside a worker's task."""
    try:
        return get_worker()
    except ValueError:
        return None


def current_task_key():
    """Key of the task the current thread runs for its worker, or None."""

    return getattr(thread_state, "key", None)


def start_task_thread(fn: Callable[[], Any], name: str):
    """Start ``fn()`` in a daemon thread that sees the current task's worker context."""


    ctx = contextvars.copy_context()
    state = {a: getattr(thread_state, a) for a in ("key", "execution_state", "start_time")
             if hasattr(thread_state, a)}

    def target():
        for a, v in state.items():
            setattr(thread_state, a, v)
        ctx.run(fn)

    t = threading.Thread(target=target, name=name, daemon=True)
    t.start()
    return t


async def run_in_worker_executor(worker, fn: Callable[[], Any]):
    """Run ``fn()`` in the worker's default thread pool and return its result."""

    def call():
        token = _worker_cvar.set(worker)
        try:
            return fn()
        finally:
            _worker_cvar.reset(token)

    return await worker.loop.run_in_executor(worker.executors["default"], call)
