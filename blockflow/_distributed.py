"""The one place blockflow touches distributed's *internal* scheduler APIs.

Everything the rebalancer does to the scheduler goes through these functions, so a change in
distributed breaks one module, loudly: :func:`check_scheduler` verifies that every internal it
relies on exists with the expected shape, and an integration test calls it on a real
scheduler (tests/test_adapter.py). Verified against distributed 2026.7.1.

Internals used
--------------
- ``Scheduler.handle_worker_status_change(status, worker, stimulus_id)``: scheduler-side
  pause / resume; every placement path (queued root tasks, ``decide_worker``, stealing)
  skips paused workers.
- ``scheduler.extensions["stealing"].move_task_request(ts, victim, thief)`` and its
  ``in_flight`` dict: the work-stealing protocol, which moves a task only if the victim
  has not started it.
- ``scheduler.periodic_callbacks["stealing"]``: distributed's speed-blind balancing loop,
  suspended while blockflow's speed-aware balancer runs.
- ``Scheduler.get_comm_cost(ts, ws)``, ``Scheduler.valid_workers(ts)``,
  ``Scheduler._get_prefix_duration(prefix)``, ``WorkerState.processing / executing /
  nthreads / status / metrics / memory_limit``, ``TaskState.priority / prefix / group``.
- ``scheduler.extensions["amm"].add_policy(policy)``: the Active Memory Manager.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from distributed.core import Status

__all__ = [
    "IncompatibleSchedulerError",
    "add_amm_policy",
    "check_scheduler",
    "comm_cost",
    "expected_duration",
    "is_move_in_flight",
    "move_task",
    "set_worker_status",
    "suspend_work_stealing",
    "valid_workers",
]

logger = logging.getLogger(__name__)


class IncompatibleSchedulerError(RuntimeError):
    """distributed changed an internal API that blockflow's rebalancer relies on."""


def check_scheduler(scheduler) -> None:
    """Verify every distributed internal the rebalancer uses; raise if one changed.

    Raises
    ------
    IncompatibleSchedulerError
        Naming the missing or changed internal and the distributed version.
    """
    import distributed

    def fail(what: str):
        raise IncompatibleSchedulerError(
            f"blockflow's rebalancer needs distributed's internal {what}, which distributed "
            f"{distributed.__version__} does not provide as expected; blockflow supports "
            f"distributed 2026.7.1 (pin it, or set blockflow.cluster.policy to 'off')."
        )

    sig = _params(getattr(scheduler, "handle_worker_status_change", None))
    if sig[:3] != ["status", "worker", "stimulus_id"]:
        fail("Scheduler.handle_worker_status_change(status, worker, stimulus_id)")
    for name in ("get_comm_cost", "valid_workers", "_get_prefix_duration"):
        if not callable(getattr(scheduler, name, None)):
            fail(f"Scheduler.{name}")
    if not isinstance(getattr(scheduler, "periodic_callbacks", None), dict):
        fail("Scheduler.periodic_callbacks")
    stealing = scheduler.extensions.get("stealing")
    if stealing is not None:
        if _params(getattr(stealing, "move_task_request", None))[:3] != ["ts", "victim", "thief"]:
            fail("WorkStealing.move_task_request(ts, victim, thief)")
        if not isinstance(getattr(stealing, "in_flight", None), dict):
            fail("WorkStealing.in_flight")
    for ws in list(scheduler.workers.values())[:1]:
        for attr in ("processing", "executing", "nthreads", "status", "metrics", "memory_limit"):
            if not hasattr(ws, attr):
                fail(f"WorkerState.{attr}")


def _params(func) -> list[str]:
    if func is None:
        return []
    try:
        return list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return []


def set_worker_status(scheduler, ws, paused: bool, stimulus_id: str) -> None:
    """Pause (or resume) a worker on the scheduler side only; the worker keeps running
    the tasks it already has."""
    status = Status.paused if paused else Status.running
    scheduler.handle_worker_status_change(status, ws, stimulus_id=stimulus_id)


def move_task(scheduler, ts, victim, thief) -> bool:
    """Ask ``victim`` to give up queued task ``ts`` for ``thief`` (work-stealing protocol).

    Returns False when no request was sent (stealing disabled, or a move already pending).
    The victim refuses if it already started the task, so a started task never moves.
    """
    stealing = scheduler.extensions.get("stealing")
    if stealing is None or ts in stealing.in_flight:
        return False
    answer = stealing.move_task_request(ts, victim, thief)
    return answer not in ("in-flight", "comm-closed")


def is_move_in_flight(scheduler, ts) -> bool:
    stealing = scheduler.extensions.get("stealing")
    return stealing is not None and ts in stealing.in_flight


def comm_cost(scheduler, ts, ws) -> float:
    """Seconds to move the inputs of ``ts`` that ``ws`` lacks (bytes / measured bandwidth)."""
    return float(scheduler.get_comm_cost(ts, ws))


def valid_workers(scheduler, ts) -> set | None:
    """Workers allowed to run ``ts`` (restrictions, resources), or None for any."""
    return scheduler.valid_workers(ts)


def expected_duration(scheduler, ts) -> float:
    """distributed's own estimate of a task's compute time in seconds (prefix average)."""
    return float(scheduler._get_prefix_duration(ts.prefix))


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


def add_amm_policy(scheduler, policy: Any) -> bool:
    """Install an Active Memory Manager policy; False if the AMM extension is absent."""
    amm = scheduler.extensions.get("amm")
    if amm is None:
        return False
    amm.add_policy(policy)
    return True


# --- dashboard (used by blockflow.dashboard) ------------------------------------------------


def http_prefix(scheduler) -> str:
    """The scheduler's HTTP prefix (``"/"`` or ``"/prefix/"``), read off its Bokeh app."""
    app = getattr(scheduler, "http_application", None)
    for sub in getattr(app, "applications", ()):
        prefix = getattr(sub, "prefix", None)
        if isinstance(prefix, str) and "bokeh" in type(sub).__module__ + type(sub).__name__.lower():
            return "/" + prefix.strip("/") + "/" if prefix.strip("/") else "/"
    return "/"


def add_http_routes(scheduler, routes) -> bool:
    """Serve ``routes`` (``[(path, handler, kwargs)]``) from the scheduler's HTTP server.

    Handlers get the scheduler as ``dask_server``, as distributed's own route modules do.
    False when the scheduler runs no HTTP server.
    """
    app = getattr(scheduler, "http_application", None)
    if app is None:
        return False
    prefix = http_prefix(scheduler)
    app.add_handlers(r".*", [(prefix + path.lstrip("/"), cls, {"dask_server": scheduler, **kw})
                             for path, cls, kw in routes])
    return True


def add_dashboard_page(scheduler, path: str, doc_fn, menu_name: str) -> bool:
    """Serve a Bokeh page ``doc_fn(scheduler, extra, doc)`` at ``path`` and list it in the
    dashboard's "More..." menu. False when the scheduler has no Bokeh dashboard.

    The dashboard builds its page table and menu once, when the scheduler starts, so a page
    added later gets a Bokeh application of its own on the scheduler's HTTP server, and its
    menu entry is appended to the (memoised) template variables every page renders from.
    """
    app = getattr(scheduler, "http_application", None)
    try:
        from distributed.dashboard import scheduler as dashboard
        from distributed.dashboard.core import BokehApplication
    except ImportError:  # no bokeh
        return False
    if app is None or not any("bokeh" in type(a).__name__.lower() for a in app.applications):
        return False
    prefix = http_prefix(scheduler)
    variables = dashboard.template_variables(scheduler)
    entry = {"url": path.strip("/"), "name": menu_name}
    if entry not in variables["plots"]:
        variables["plots"].append(entry)
    if path in dashboard.applications:  # served by the dashboard's own Bokeh app already
        return True
    from tornado.ioloop import IOLoop

    bokeh_app = BokehApplication({path: doc_fn}, scheduler, prefix=prefix,
                                 template_variables=variables)
    app.add_application(bokeh_app)
    bokeh_app.initialize(IOLoop.current())  # as distributed's own dashboard does
    return True


# --- worker side (worker plugins, probes run with Client.run) ------------------------------


def set_worker_metric(worker, name: str, fn) -> None:
    """Report ``fn(worker)`` under ``name`` in the worker's heartbeat metrics
    (``Worker.metrics``, read on the scheduler as ``WorkerState.metrics[name]``)."""
    worker.metrics[name] = fn


def remove_worker_metric(worker, name: str, fn=None) -> None:
    """Stop reporting metric ``name``; with ``fn``, only if ``fn`` is what reports it."""
    current = worker.metrics.get(name)
    if current is not None and (fn is None or current is fn):
        worker.metrics.pop(name, None)


def worker_metric(worker, name: str):
    """The callable reporting metric ``name`` on this worker, or None."""
    return worker.metrics.get(name)


def worker_plugins(worker) -> dict:
    """The worker plugins installed on ``worker`` (name -> plugin); a copy."""
    return dict(getattr(worker, "plugins", None) or {})


def worker_data_values(worker) -> list:
    """The results the worker holds in memory (``Worker.data``), spilled ones excluded.

    Safe to call from a thread beside the worker's event loop: a SpillBuffer's fast part
    (a ``zict.LRU``) is read through its dict without touching the LRU order, in one
    C-level pass, retried if a non-dict mapping changed size while being copied.
    """
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
