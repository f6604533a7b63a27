"""Compatibility checks: does the running distributed still have the internals blockflow uses?

Each check raises :class:`IncompatibleSchedulerError` naming the internal and the version."""

from __future__ import annotations

import importlib.util
import inspect

import distributed
from distributed.scheduler import TaskPrefix, TaskState, WorkerState

__all__ = [
    "SUPPORTED",
    "IncompatibleSchedulerError",
    "check_dashboard",
    "check_scheduler",
    "check_worker",
    "check_worker_state",
    "serves_bokeh_dashboard",
]



SUPPORTED = "2026.7.1"

_SCHEDULER_ATTRS = ("workers", "tasks", "queued", "plugins", "handlers", "extensions",
                    "periodic_callbacks", "unrunnable", "loop", "bandwidth", "bandwidth_workers",
                    "rpc")
_SCHEDULER_METHODS = ("valid_workers", "_get_prefix_duration",
                      "register_worker_plugin", "transition", "transitions", "coerce_address",
                      "get_metadata")
_WORKER_STATE_ATTRS = ("address", "name", "nthreads", "status", "metrics", "memory_limit",
                       "processing", "executing", "occupancy", "has_what", "resources",
                       "last_seen")
_TASK_STATE_ATTRS = ("key", "state", "priority", "prefix", "run_spec", "actor", "nbytes",
                     "dependencies", "who_has", "processing_on", "worker_restrictions",
                     "host_restrictions", "resource_restrictions", "loose_restrictions",
                     "dependents")


class IncompatibleSchedulerError(RuntimeError):
    """distributed changed an internal API that blockflow relies on."""


def _fail(what: str):
    raise IncompatibleSchedulerError(
        f"blockflow needs distributed's internal {what}, which distributed "
        f"{distributed.__version__} does not provide as expected; blockflow supports "
        f"distributed {SUPPORTED} (pin it, or set blockflow.cluster.policy to 'off')."
    )


def _params(func) -> list[str]:
    if func is None:
        return []
    try:
        return list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return []


def _class_has(cls, attr: str) -> bool:
    slots = [s for klass in cls.__mro__ for s in getattr(klass, "__slots__", ())]
    return attr in slots or hasattr(cls, attr)


def check_scheduler(scheduler) -> None:
    """Verify the scheduler-side internals the boundary uses (scheduler, stealing extension, state
    classes, connected workers).

    Raises
    ------
    IncompatibleSchedulerError
        Naming the missing or changed internal.
    """
    if _params(getattr(scheduler, "handle_worker_status_change", None))[:3] != [
            "status", "worker", "stimulus_id"]:
        _fail("Scheduler.handle_worker_status_change(status, worker, stimulus_id)")
    for name in _SCHEDULER_ATTRS:
        if not hasattr(scheduler, name):
            _fail(f"Scheduler.{name}")
    for name in ("plugins", "handlers", "extensions", "periodic_callbacks", "unrunnable"):
        if not isinstance(getattr(scheduler, name), dict):
            _fail(f"Scheduler.{name} (a dict)")
    for name in _SCHEDULER_METHODS:
        if not callable(getattr(scheduler, name, None)):
            _fail(f"Scheduler.{name}()")
    stealing = scheduler.extensions.get("stealing")
    if stealing is not None:
        if _params(getattr(stealing, "move_task_request", None))[:3] != ["ts", "victim", "thief"]:
            _fail("WorkStealing.move_task_request(ts, victim, thief)")
        for name in ("in_flight", "in_flight_occupancy"):
            if not isinstance(getattr(stealing, name, None), dict):
                _fail(f"WorkStealing.{name}")
    amm = scheduler.extensions.get("amm")
    if amm is not None and not callable(getattr(amm, "add_policy", None)):
        _fail("ActiveMemoryManagerExtension.add_policy()")
    for name in _WORKER_STATE_ATTRS:
        if not _class_has(WorkerState, name):
            _fail(f"WorkerState.{name}")
    for name in _TASK_STATE_ATTRS:
        if not _class_has(TaskState, name):
            _fail(f"TaskState.{name}")
    if not _class_has(TaskPrefix, "duration_average"):
        _fail("TaskPrefix.duration_average")
    for ws in list(scheduler.workers.values()):
        check_worker_state(ws)
    if serves_bokeh_dashboard(scheduler):
        check_dashboard()


def serves_bokeh_dashboard(scheduler) -> bool:
    """Whether the scheduler serves distributed's Bokeh dashboard (Bokeh not imported)."""
    app = getattr(scheduler, "http_application", None)
    return app is not None and any("bokeh" in type(a).__name__.lower()
                                   for a in getattr(app, "applications", ()))


def check_dashboard() -> None:
    """Verify the dashboard internals :func:`add_dashboard_page` and
    :func:`style_dashboard_doc` use (skipped without Bokeh, where they are not used)."""
    if importlib.util.find_spec("bokeh") is None:
        return
    from distributed.dashboard import components, core, scheduler as dashboard

    for module, name in ((dashboard, "template_variables"), (dashboard, "applications"),
                         (core, "BokehApplication"), (components, "add_periodic_callback")):
        if not hasattr(module, name):
            _fail(f"{module.__name__}.{name}")
    from distributed.dashboard.components import scheduler as components_scheduler

    for name in ("BOKEH_THEME", "env"):
        if not hasattr(components_scheduler, name):
            _fail(f"distributed.dashboard.components.scheduler.{name}")


def check_worker(worker) -> None:
    """Verify the ``Worker`` internals :mod:`blockflow._distributed.worker` uses; run in every
    blockflow worker plugin's ``setup``.

    Raises
    ------
    IncompatibleSchedulerError
        Naming the missing or changed internal.
    """
    if not isinstance(getattr(worker, "metrics", None), dict):
        _fail("Worker.metrics (a dict)")
    if not hasattr(getattr(worker, "data", None), "values"):
        _fail("Worker.data (a mapping)")
    if not isinstance(getattr(worker, "plugins", None), dict):
        _fail("Worker.plugins (a dict)")
    if not callable(getattr(worker, "heartbeat", None)):
        _fail("Worker.heartbeat()")
    if not callable(getattr(worker, "rpc", None)):
        _fail("Worker.rpc (a connection pool)")
    if not isinstance(getattr(worker, "handlers", None), dict) or not isinstance(
            getattr(worker, "executors", None), dict):
        _fail("Worker.handlers / Worker.executors (dicts)")
    if not callable(getattr(worker, "set_resources", None)) or not isinstance(
            getattr(getattr(worker, "state", None), "total_resources", None), dict):
        _fail("Worker.set_resources() / Worker.state.total_resources (a dict)")


def check_worker_state(ws) -> None:
    """Verify a live ``WorkerState`` has every attribute this module reads."""
    for name in _WORKER_STATE_ATTRS:
        if not hasattr(ws, name):
            _fail(f"WorkerState.{name}")
    if not isinstance(ws.metrics, dict) or not hasattr(ws.status, "name"):
        _fail("WorkerState.metrics (a dict) / WorkerState.status (a Status)")


# --- plain data handed out ----------------------------------------------------------------
