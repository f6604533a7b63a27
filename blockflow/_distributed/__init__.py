"""The one module that touches distributed's internal objects.

Everything blockflow reads from or does to a running scheduler or worker beyond distributed's
public API goes through here: the scheduler plugin, the policies, the dashboard and the worker
plugins see only the plain data this module returns (:class:`WorkerView`, :class:`TaskView`,
:class:`HeldResult`) and act only through its functions (pause, resume, move, restrict,
handlers, periodic callbacks, AMM policies, dashboard pages, worker metrics). A change in
distributed therefore breaks one module, loudly: :func:`check_scheduler` verifies every
internal listed below on the scheduler and its classes (and again on the first live worker,
:func:`check_worker_state`), and ``tests/test_boundary.py`` fails if any other module of the
package touches them. Verified against distributed 2026.7.1.

Internals used
--------------
Scheduler
    ``workers``, ``tasks``, ``queued``, ``plugins``, ``handlers``, ``extensions``
    (``"stealing"``, ``"amm"``), ``periodic_callbacks``, ``http_application``,
    ``handle_worker_status_change(status, worker, stimulus_id)``, ``get_comm_cost``,
    ``valid_workers``, ``_get_prefix_duration``, ``register_worker_plugin``, ``unrunnable``,
    ``transition``, ``transitions``, ``coerce_address``, ``loop``.
WorkerState
    ``address``, ``name``, ``nthreads``, ``status``, ``metrics``, ``memory_limit``,
    ``processing``, ``executing``, ``occupancy``, ``has_what``, ``resources``.
TaskState
    ``key``, ``state``, ``priority``, ``prefix``, ``run_spec``, ``actor``, ``nbytes``,
    ``dependencies``, ``who_has``, ``processing_on``, ``worker_restrictions``,
    ``host_restrictions``, ``resource_restrictions``, ``loose_restrictions``, ``dependents``.
WorkStealing
    ``move_task_request(ts, victim, thief)``, ``in_flight``, ``in_flight_occupancy``.
ActiveMemoryManagerPolicy
    ``manager.scheduler``; ``Suggestion`` (``"replicate"`` / ``"drop"``).
Worker
    ``metrics``, ``data`` (its in-memory part), ``plugins``, ``handlers``, ``rpc``,
    ``heartbeat()``,
    ``set_resources()``, ``state.total_resources``.
Dashboard
    ``distributed.dashboard.scheduler.template_variables`` / ``applications``,
    ``distributed.dashboard.core.BokehApplication``.
"""

from __future__ import annotations

import inspect
import logging
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from dask.utils import key_split
from distributed.active_memory_manager import ActiveMemoryManagerPolicy, Suggestion
from distributed.core import Status
from distributed.diagnostics.plugin import WorkerPlugin

from blockflow._distributed.metrics import CAPACITY_METRIC, WorkerMetrics, clean_number, read_metrics

__all__ = [
    "AMMPolicy",
    "FeederView",
    "HOLD_ADDRESS",
    "HeldResult",
    "IncompatibleSchedulerError",
    "MemorySuggestion",
    "TaskView",
    "WorkerView",
    "add_amm_policy",
    "add_dashboard_page",
    "add_handler",
    "add_http_routes",
    "add_periodic_callback",
    "add_scheduler_plugin",
    "call_soon",
    "check_dashboard",
    "check_scheduler",
    "check_worker",
    "check_worker_state",
    "current_worker_resources",
    "declare_worker_resources",
    "fail_tasks",
    "feeder_states",
    "feeder_tasks",
    "held_results",
    "hold_tasks",
    "http_prefix",
    "move_task",
    "new_task_views",
    "own_utilization_estimate",
    "prefix_duration",
    "queued_count",
    "register_worker_plugin_on_scheduler",
    "release_tasks",
    "remove_periodic_callback",
    "remove_worker_metric",
    "restrict_task",
    "run_amm_policy",
    "scheduler_plugin",
    "set_task_placement",
    "set_worker_metric",
    "set_worker_status",
    "shared_devices",
    "style_dashboard_doc",
    "suspend_work_stealing",
    "task_placement",
    "task_states",
    "task_working_set",
    "unsatisfiable_tasks",
    "waiting_tasks",
    "worker_addresses",
    "worker_data_values",
    "worker_declared_resources",
    "worker_heartbeat",
    "worker_metric",
    "worker_names_and_metrics",
    "worker_plugins",
    "worker_views",
]

logger = logging.getLogger(__name__)

SUPPORTED = "2026.7.1"

_SCHEDULER_ATTRS = ("workers", "tasks", "queued", "plugins", "handlers", "extensions",
                    "periodic_callbacks", "unrunnable", "loop", "bandwidth", "rpc")
_SCHEDULER_METHODS = ("get_comm_cost", "valid_workers", "_get_prefix_duration",
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
    import distributed

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
    """Verify every distributed internal this module uses; raise if one changed.

    Checks the scheduler's attributes and methods, the stealing extension, the
    ``WorkerState`` and ``TaskState`` classes (so it works before any worker joins) and every
    worker already connected (:func:`check_worker_state`).

    Raises
    ------
    IncompatibleSchedulerError
        Naming the missing or changed internal and the distributed version.
    """
    from distributed.scheduler import TaskPrefix, TaskState, WorkerState

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
    check_dashboard()


def check_dashboard() -> None:
    """Verify the dashboard internals :func:`add_dashboard_page` and
    :func:`style_dashboard_doc` use (skipped without Bokeh, where they are not used)."""
    import importlib.util

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
    """Verify the ``Worker`` internals the worker-side functions below use (``metrics``,
    ``data``, ``plugins``, ``heartbeat``)."""
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
    """Verify a live ``WorkerState`` has every attribute this module reads (run when the first
    worker joins: a scheduler started with ``--preload`` has none at start)."""
    for name in _WORKER_STATE_ATTRS:
        if not hasattr(ws, name):
            _fail(f"WorkerState.{name}")
    if not isinstance(ws.metrics, dict) or not hasattr(ws.status, "name"):
        _fail("WorkerState.metrics (a dict) / WorkerState.status (a Status)")


# --- plain data handed out ----------------------------------------------------------------


@dataclass
class WorkerView:
    """What blockflow knows about one worker at one moment (plain data).

    Attributes
    ----------
    address : str
    nthreads : int
    status : str
        Scheduler-side status name (``"running"``, ``"paused"``, ...).
    paused_by_blockflow : bool
        Paused by blockflow's scheduler plugin (it only ever resumes those).
    metrics : WorkerMetrics
        GPU utilisation (percent), device memory (bytes); None when unknown.
    speed : float
        Learned relative speed (1.0 = typical worker).
    processing : int
        Tasks assigned to the worker (running or waiting there).
    executing : int
        Tasks the worker reported running at its last heartbeat.
    occupancy : float
        Seconds of assigned work at the typical worker's speed (distributed's estimate,
        including moves in flight).
    host_memory_fraction : float or None
        Process memory / memory limit, 0-1.
    name : str
        The worker's name.
    capacity : float or None
        Nominal relative capacity the worker reports (``blockflow-capacity`` metric).
    memory_limit : int
        Host memory limit in bytes (0: none).
    speed_confidence : float
        Confidence of the learned speed, 0-1 (0: nothing comparable observed).
    resources : mapping of str to float
        Worker resources the worker declares (``{"GPU": 1}``; ``dask worker --resources``).
    device_uuid : str or None
        UUID of the GPU the worker uses, when it reports one (``blockflow-gpu-uuid``).
    device_peers : tuple of str
        Addresses of the other workers that report the same device UUID (they share one
        GPU), sorted; empty when the device is the worker's own.
    peers_own_utilization : float
        Percent 0-100 of the shared device taken by those peers' own tasks (measured or
        estimated as for this worker, see :attr:`others_utilization`); 0 without peers.
    recent_speed : float or None
        The speed shown on the worker's latest warm task
        (:meth:`blockflow.scheduling.speed.SpeedModel.recent_speed`); None if unknown.
    """

    address: str
    nthreads: int
    status: str
    paused_by_blockflow: bool
    metrics: WorkerMetrics
    speed: float
    processing: int
    executing: int
    occupancy: float
    host_memory_fraction: float | None = None
    name: str = ""
    capacity: float | None = None
    memory_limit: int = 0
    speed_confidence: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)
    device_uuid: str | None = None
    device_peers: tuple = ()
    peers_own_utilization: float = 0.0
    recent_speed: float | None = None

    @property
    def projected_finish(self) -> float:
        """Seconds until the worker finishes its assigned work at its learned speed."""
        return self.occupancy / (max(self.speed, 1e-6) * max(self.nthreads, 1))

    @property
    def others_utilization(self) -> float | None:
        """GPU utilisation (percent) taken by work other than this worker's own tasks.

        Utilisation minus the worker's own share: measured when the worker reports
        ``blockflow-gpu-own-utilization``; else, while it runs tasks, the share of its threads
        executing (a lower bound of others' load); exact when it is idle. Workers that share
        the device (:attr:`device_peers`) are not "other work": their own share
        (:attr:`peers_own_utilization`) is subtracted too. None when utilisation is unknown.
        """
        util = self.metrics.gpu_utilization
        if util is None:
            return None
        own = own_utilization_estimate(self)
        return max(util - min(own + self.peers_own_utilization, 100.0), 0.0)

    def seen(self) -> dict[str, Any]:
        """The metrics a decision about this worker was based on (for the decision log)."""
        m = self.metrics
        return {
            "gpu_utilization": m.gpu_utilization,
            "gpu_memory_fraction": m.gpu_memory_fraction,
            "speed": round(self.speed, 4),
            "speed_confidence": round(self.speed_confidence, 3),
            "processing": self.processing,
            "projected_finish": round(self.projected_finish, 4),
        }


def own_utilization_estimate(w: WorkerView) -> float:
    """Percent 0-100 of its device a worker's own tasks take: measured when it reports
    ``blockflow-gpu-own-utilization``, else the share of its threads executing (a lower bound
    of others' load while it runs tasks; exact when it is idle)."""
    own = w.metrics.own_utilization
    if own is None:
        busy = min(max(w.executing, 1 if w.processing else 0), w.nthreads)
        own = 100.0 * busy / max(w.nthreads, 1)
    return own


@dataclass(frozen=True)
class TaskView:
    """One task as policies see it (plain data).

    Attributes
    ----------
    key : str, tuple or int
        The task's key.
    group : str
        Its task group (``dask.utils.key_split`` of the key).
    state : str
        Scheduler state (``"released"``, ``"waiting"``, ``"processing"``, ...).
    priority : tuple
        Dask's priority (smaller runs first).
    duration : float
        distributed's estimate of its compute time at speed 1, seconds.
    duration_measured : bool
        Whether that estimate comes from finished tasks of its prefix (not the default
        ``distributed.scheduler.unknown-task-duration``).
    input_bytes : int
        Bytes of its inputs.
    restricted : bool
        Whether it carries worker, host or resource restrictions.
    runnable : bool
        Whether it has something to run (not a scattered or pure-data key).
    allowed_workers : frozenset of str or None
        Workers allowed to run it (restrictions, resources), None for any.
    comm_cost : mapping of str to float
        Seconds to move its missing inputs to each worker (bytes / measured bandwidth).
    working_set : int or None
        Device memory its kernel needs, bytes, when declared (``map_blocks(working_set=)``).
    placement : dict or None
        Where its kernel asked to run (``map_blocks(resources=, workers=,
        allow_other_workers=)``): ``{"resources": dict or None, "workers": tuple or None,
        "allow_other_workers": bool}``; None when it asked nothing.
    """

    key: Any
    group: str
    state: str = "processing"
    priority: tuple = ()
    duration: float = 0.0
    duration_measured: bool = True
    input_bytes: int = 0
    restricted: bool = False
    runnable: bool = True
    allowed_workers: frozenset | None = None
    comm_cost: Mapping[str, float] = field(default_factory=dict)
    working_set: int | None = None
    placement: dict | None = None


@dataclass(frozen=True)
class HeldResult:
    """A result held in a worker's memory: its key, size in bytes and the workers holding it."""

    key: Any
    nbytes: int
    holders: frozenset


class _LazyMapping(Mapping):
    """address -> value, computed on first access (policies rarely read every worker)."""

    def __init__(self, keys, compute: Callable[[str], Any]):
        self._keys = list(keys)
        self._compute = compute
        self._cache: dict[str, Any] = {}

    def __getitem__(self, key):
        if key not in self._keys:
            raise KeyError(key)
        if key not in self._cache:
            self._cache[key] = self._compute(key)
        return self._cache[key]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self):
        return len(self._keys)


def worker_addresses(scheduler) -> list[str]:
    """Addresses of the workers the scheduler knows, sorted."""
    return sorted(scheduler.workers)


def worker_views(scheduler, *, speed: Callable[[str], float] | None = None,
                 confidence: Callable[[str], float] | None = None,
                 paused: Mapping[str, Any] | None = None,
                 recent_speed: Callable[[str], float | None] | None = None
                 ) -> dict[str, WorkerView]:
    """:class:`WorkerView` of every worker.

    Parameters
    ----------
    speed : callable, optional
        ``speed(address) -> float``, learned speeds (default 1.0).
    confidence : callable, optional
        ``confidence(address) -> float``, 0-1 (default 0).
    paused : mapping, optional
        Addresses blockflow paused.
    recent_speed : callable, optional
        ``recent_speed(address) -> float or None``, the speed of the latest task.
    """
    stealing = scheduler.extensions.get("stealing")
    in_flight = getattr(stealing, "in_flight_occupancy", {}) if stealing else {}
    paused = paused or {}
    views = {}
    for addr, ws in scheduler.workers.items():
        limit = ws.memory_limit or 0
        raw = ws.metrics if isinstance(ws.metrics, dict) else {}
        m = read_metrics(raw)
        cap = clean_number(raw.get(CAPACITY_METRIC))
        views[addr] = WorkerView(
            address=addr,
            name=str(ws.name),
            nthreads=ws.nthreads,
            status=ws.status.name,
            paused_by_blockflow=addr in paused,
            metrics=m,
            speed=float(speed(addr)) if speed is not None else 1.0,
            processing=len(ws.processing),
            executing=len(ws.executing),
            occupancy=max(ws.occupancy + in_flight.get(ws, 0.0), 0.0),
            host_memory_fraction=(m.host_memory / limit)
            if m.host_memory is not None and limit else None,
            capacity=cap if cap else None,
            memory_limit=int(limit),
            speed_confidence=float(confidence(addr)) if confidence is not None else 0.0,
            recent_speed=recent_speed(addr) if recent_speed is not None else None,
            resources=dict(ws.resources or {}),
            device_uuid=m.device_uuid,
        )
    for members in shared_devices(views).values():
        for addr in members:
            w = views[addr]
            w.device_peers = tuple(a for a in members if a != addr)
            w.peers_own_utilization = min(
                sum(own_utilization_estimate(views[a]) for a in w.device_peers), 100.0)
    return views


def shared_devices(views: Mapping[str, WorkerView]) -> dict[str, tuple[str, ...]]:
    """Device UUID -> the addresses (sorted) of the workers that report it, for devices that
    two or more workers report (two workers on one GPU); plain data from worker views."""
    by_uuid: dict[str, list[str]] = {}
    for addr, w in views.items():
        if w.device_uuid:
            by_uuid.setdefault(w.device_uuid, []).append(addr)
    return {u: tuple(sorted(a)) for u, a in sorted(by_uuid.items()) if len(a) > 1}


def queued_count(scheduler) -> int:
    """Root tasks the scheduler holds back in its queue (not yet on any worker)."""
    return len(scheduler.queued)


#: Task annotation ``dask.annotate(blockflow_work=...)``: the work of a task, in units its
#: group shares (rows, say), for groups whose tasks differ in size on purpose.
WORK_ANNOTATION = "blockflow_work"
#: Key of a task's metadata (``TaskState.metadata`` on its worker, sent to the scheduler with
#: the task's result): seconds the task spent waiting, seceded, not computing.
WAIT_METADATA = "blockflow_wait"


def task_work(scheduler, key) -> float | None:
    """The work ``key`` declared with ``dask.annotate(blockflow_work=...)`` (a positive
    number), else None. O(1): called from the scheduler plugin's transition hook."""
    ts = scheduler.tasks.get(key)
    annotations = getattr(ts, "annotations", None)
    if not annotations:
        return None
    work = annotations.get(WORK_ANNOTATION)
    if isinstance(work, (int, float)) and math.isfinite(work) and work > 0:
        return float(work)
    return None


def add_task_wait(seconds: float) -> None:
    """From a task's thread on a worker: count ``seconds`` of the running task as waiting,
    not computing (the task's ``metadata``, :data:`WAIT_METADATA`), so that the scheduler
    plugin's speed model and busy time leave them out. No-op off a worker."""
    from distributed import get_worker
    try:
        worker = get_worker()
        ts = worker.state.tasks.get(worker.get_current_task())
    except (ValueError, AttributeError, KeyError):
        return
    if ts is not None:
        ts.metadata[WAIT_METADATA] = ts.metadata.get(WAIT_METADATA, 0.0) + float(seconds)


def task_wait(metadata: dict | None) -> float:
    """Seconds a finished task reported waiting (:func:`add_task_wait`), from the
    ``metadata`` its worker sent with the result; 0 when none."""
    wait = (metadata or {}).get(WAIT_METADATA, 0.0)
    return float(wait) if isinstance(wait, (int, float)) and math.isfinite(wait) \
        and wait > 0 else 0.0


def _restricted(ts) -> bool:
    return bool(ts.worker_restrictions or ts.host_restrictions or ts.resource_restrictions)


# scheduler -> prefix name -> the last measured average duration (seconds) of its tasks
_MEASURED: "weakref.WeakKeyDictionary[Any, dict[str, float]]" = weakref.WeakKeyDictionary()
_MEASURED_MAX = 10_000  # prefix names remembered per scheduler


def prefix_duration(scheduler, prefix) -> tuple[float, bool]:
    """``(seconds, measured)``: the expected compute time of a task of ``prefix`` and whether
    it comes from measured durations.

    distributed forgets a prefix's average (``duration_average = -1``) as soon as one of
    its tasks runs for more than twice that average, and estimates its tasks at twice the
    longest time any of them has run so far: the moment a straggler appears, its group's
    tasks look unmeasured and as long as the straggler. The last measured average is kept
    here for that case (it is what the straggler is judged against).
    """
    memory = _MEASURED.setdefault(scheduler, {})
    average = float(prefix.duration_average)
    if average >= 0:
        if len(memory) >= _MEASURED_MAX and prefix.name not in memory:
            memory.clear()
        memory[prefix.name] = average
        return average, True
    if prefix.name in memory:
        return memory[prefix.name], True
    return float(scheduler._get_prefix_duration(prefix)), False


def _task_view(scheduler, ts, thieves=()) -> TaskView:
    valid = scheduler.valid_workers(ts)
    duration, measured = prefix_duration(scheduler, ts.prefix)
    return TaskView(
        key=ts.key,
        group=key_split(ts.key),
        state=ts.state,
        priority=tuple(ts.priority or ()),
        duration=duration,
        duration_measured=measured,
        input_bytes=sum(dts.nbytes for dts in ts.dependencies if dts.nbytes > 0),
        restricted=_restricted(ts),
        runnable=bool(ts.run_spec),
        allowed_workers=None if valid is None else frozenset(w.address for w in valid),
        comm_cost={ws.address: float(scheduler.get_comm_cost(ts, ws)) for ws in thieves},
    )


def task_working_set(run_spec, key, *, max_nodes: int = 256) -> int | None:
    """Device memory (bytes) a task's kernel declared, or None.

    Looks through the task's spec (``dask._task_spec`` nodes, fused subgraphs included, at
    most ``max_nodes`` of them) for an object with a ``blockflow_working_set(key)`` method,
    which blockflow's kernels have when ``map_blocks(working_set=)`` was given.
    """
    return _working_set(_declaring_objects(run_spec, max_nodes), key)


def _working_set(objects: list, key) -> int | None:
    found = None
    for obj in objects:
        method = getattr(obj, "blockflow_working_set", None)
        if not callable(method):
            continue
        try:
            ws = method(key)
        except Exception:  # a kernel's own bug must not break the scheduler
            ws = None
        if isinstance(ws, int) and ws > 0:
            found = max(found or 0, ws)
    return found


#: Attributes through which a task spec reaches the callables and arguments it holds:
#: ``dask._task_spec`` nodes (func, args, kwargs, value), functools.partial (keywords),
#: toolz's Compose (first, funcs).
_SPEC_ATTRS = ("func", "args", "kwargs", "keywords", "value", "first", "funcs")
_SPEC_LEAVES = (str, bytes, int, float, complex, type(None), type)
#: type -> how to look inside its objects (computed once per type: attribute look-ups that
#: miss are slow, and a graph of 50,000 tasks holds a few dozen types)
_spec_plans: dict[type, tuple] = {}


def _spec_plan(t: type) -> tuple:
    plan = _spec_plans.get(t)
    if plan is None:
        if issubclass(t, _SPEC_LEAVES):
            plan = ("leaf",)
        elif hasattr(t, "blockflow_working_set") or hasattr(t, "blockflow_placement"):
            plan = ("declares",)
        elif issubclass(t, dict):
            plan = ("dict",)
        elif issubclass(t, (list, tuple, set, frozenset)):
            plan = ("seq",)
        else:
            plan = ("obj", tuple(a for a in _SPEC_ATTRS if hasattr(t, a)),
                    bool(getattr(t, "__dictoffset__", 0)))
        if len(_spec_plans) < 10_000:
            _spec_plans[t] = plan
    return plan


def _declaring_objects(run_spec, max_nodes: int = 256) -> list:
    """The objects in a task's spec that declare something to blockflow (a
    ``blockflow_working_set`` or ``blockflow_placement`` method: blockflow's kernels), looked
    for through ``dask._task_spec`` nodes, fused subgraphs, partials and compositions, at
    most ``max_nodes`` nodes."""
    stack, seen, found = [run_spec], 0, []
    while stack and seen < max_nodes:
        node = stack.pop()
        seen += 1
        plan = _spec_plan(type(node))
        kind = plan[0]
        if kind == "leaf":
            continue
        if kind == "declares":
            found.append(node)
        elif kind == "dict":
            stack.extend(node.values())
        elif kind == "seq":
            stack.extend(node)
        else:
            for attr in plan[1]:
                child = getattr(node, attr, None)
                if child is not None:
                    stack.append(child)
            if plan[2]:
                d = node.__dict__
                for attr in _SPEC_ATTRS:
                    if attr in d and attr not in plan[1]:
                        stack.append(d[attr])
    return found


def task_states(scheduler, keys) -> dict:
    """key -> the scheduler's state of that task (``"released"``, ``"waiting"``,
    ``"processing"``, ``"memory"``, ...); keys the scheduler does not hold are left out."""
    out = {}
    for key in keys:
        ts = scheduler.tasks.get(key)
        if ts is not None:
            out[key] = ts.state
    return out


def new_task_views(scheduler, keys) -> list[TaskView]:
    """Views of the tasks of a graph that just arrived (``update_graph``), in key order of
    ``keys``; keys the scheduler no longer holds are skipped. No comm costs."""
    out = []
    for key in keys:
        ts = scheduler.tasks.get(key)
        if ts is not None:
            declaring = _declaring_objects(ts.run_spec) if ts.run_spec else []
            out.append(TaskView(key=ts.key, group=key_split(ts.key), state=ts.state,
                                priority=tuple(ts.priority or ()), restricted=_restricted(ts),
                                runnable=bool(ts.run_spec),
                                working_set=_working_set(declaring, ts.key),
                                placement=_placement(declaring)))
    return out


def waiting_tasks(scheduler, *, thieves: list[str] | None = None) -> Mapping[str, Iterator]:
    """address -> iterator of :class:`TaskView` of the tasks waiting on that worker (assigned
    but not started), lowest priority (last to run) first, skipping tasks a move is already
    pending for and actors. Computed lazily, per worker, when read; each view carries the comm
    cost to each worker in ``thieves``.
    """
    stealing = scheduler.extensions.get("stealing")
    in_flight = stealing.in_flight if stealing is not None else {}

    def waiting(addr: str) -> Iterator[TaskView]:
        ws = scheduler.workers.get(addr)
        if ws is None:
            return
        targets = [scheduler.workers[a] for a in (thieves or ()) if a in scheduler.workers]
        # not started, highest priority first; the first free threads take the first ones
        # (the executing tasks are not always those of the highest priority: a task that
        # became ready behind a long one waits although it ranks before it)
        pending = sorted((ts for ts in ws.processing if ts not in ws.executing),
                         key=lambda ts: ts.priority or ())
        free = max(ws.nthreads - len(ws.executing), 0)
        for ts in reversed(pending[free:]):
            if ts.actor or ts in in_flight or ts.processing_on is not ws:
                continue
            yield _task_view(scheduler, ts, targets)

    return _LazyMapping(scheduler.workers, lambda addr: waiting(addr))


def held_results(scheduler) -> Mapping[str, list[HeldResult]]:
    """address -> results held in the worker's memory, largest first (lazily per worker)."""

    def held(addr: str) -> list[HeldResult]:
        ws = scheduler.workers.get(addr)
        if ws is None:
            return []
        return [HeldResult(ts.key, int(ts.nbytes), frozenset(w.address for w in ts.who_has))
                for ts in sorted(ws.has_what, key=lambda t: t.nbytes, reverse=True)]

    return _LazyMapping(scheduler.workers, held)


# --- actions ------------------------------------------------------------------------------


def set_worker_status(scheduler, address: str, paused: bool, stimulus_id: str) -> bool:
    """Pause (or resume) a worker on the scheduler side only; the worker keeps running the
    tasks it already has. False when the worker is gone."""
    ws = scheduler.workers.get(address)
    if ws is None:
        return False
    status = Status.paused if paused else Status.running
    scheduler.handle_worker_status_change(status, ws, stimulus_id=stimulus_id)
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


def add_periodic_callback(scheduler, name: str, fn: Callable[[], Any], interval: float):
    """Run ``fn`` every ``interval`` seconds on the scheduler's event loop, registered under
    ``name`` in the scheduler's periodic callbacks (stopped with the scheduler)."""
    from tornado.ioloop import PeriodicCallback

    pc = PeriodicCallback(fn, interval * 1000)
    scheduler.periodic_callbacks[name] = pc
    pc.start()
    return pc


def remove_periodic_callback(scheduler, name: str) -> None:
    """Stop and remove the periodic callback ``name``, if any."""
    pc = scheduler.periodic_callbacks.pop(name, None)
    if pc is not None:
        pc.stop()


def add_handler(scheduler, name: str, fn: Callable) -> None:
    """Serve ``fn`` as the scheduler RPC handler ``name`` (read with ``client.scheduler.<name>``)."""
    scheduler.handlers[name] = fn


def scheduler_plugin(scheduler, name: str):
    """The scheduler plugin registered under ``name``, or None."""
    return scheduler.plugins.get(name)


def scheduler_metadata(scheduler, keys) -> Any:
    """What a client stored with ``Client.set_metadata(keys, ...)``, or None (the
    scheduler-side reader, ``Scheduler.get_metadata``, is a handler method)."""
    return scheduler.get_metadata(keys=list(keys), default=None)


def data_holders(client, futures) -> dict:
    """Key -> addresses of the workers holding it, for ``futures`` (``Client.who_has``: a
    public client call, here because its name is also a ``TaskState`` internal's)."""
    return {k: list(v) for k, v in client.who_has(list(futures)).items()}


def add_amm_policy(scheduler, policy: Any) -> bool:
    """Install an Active Memory Manager policy; False if the AMM extension is absent."""
    amm = scheduler.extensions.get("amm")
    if amm is None:
        return False
    amm.add_policy(policy)
    return True


@dataclass(frozen=True)
class MemorySuggestion:
    """A plain AMM suggestion: ``op`` ``"replicate"`` (to one of ``candidates``) or ``"drop"``
    (from one of ``candidates``) the result ``key``."""

    op: str
    key: Any
    candidates: frozenset


class AMMPolicy(ActiveMemoryManagerPolicy):
    """Base of blockflow's Active Memory Manager policies: plain data in, plain data out.

    Subclasses implement :meth:`plan`, a generator that reads the worker views and held
    results, yields :class:`MemorySuggestion` objects and is sent back the address the AMM
    chose (None when it declined). This class turns them into distributed's ``Suggestion`` s.
    """

    def plan(self, workers: dict[str, WorkerView],
             held: Mapping[str, list[HeldResult]]):  # pragma: no cover - abstract
        raise NotImplementedError
        yield

    def log(self, action: str, worker: str, reason: str, seen: dict, key=None,
            target=None) -> None:
        """Log a decision in the rebalancer's decision log when the rebalancer runs."""
        plugin = scheduler_plugin(self.manager.scheduler, "blockflow-rebalancer")
        if plugin is not None and hasattr(plugin, "log_decision"):
            plugin.log_decision(action, worker, reason, seen, key=key, target=target)

    def run(self):
        scheduler = self.manager.scheduler
        gen = self.plan(worker_views(scheduler), held_results(scheduler))
        try:
            s = next(gen)
            while True:
                ts = scheduler.tasks.get(s.key)
                wss = {scheduler.workers[a] for a in s.candidates if a in scheduler.workers}
                chosen = None
                if ts is not None and wss:
                    choice = yield Suggestion(s.op, ts, wss)
                    chosen = getattr(choice, "address", None)
                s = gen.send(chosen)
        except StopIteration:
            return


# --- dashboard ------------------------------------------------------------------------------


def style_dashboard_doc(doc, component, extra: dict, *, title: str, interval_ms: int) -> None:
    """Make a Bokeh document look and update like distributed's own dashboard pages:
    ``component.update()`` every ``interval_ms`` (held weakly, so a closed tab leaves nothing
    behind), distributed's page template, menu variables and theme."""
    from distributed.dashboard.components import add_periodic_callback
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    add_periodic_callback(doc, component, interval_ms)
    doc.title = title
    doc.add_root(component.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


def add_scheduler_plugin(scheduler, plugin) -> None:
    """Install a scheduler plugin from the scheduler side (``dask scheduler --preload``)."""
    scheduler.add_plugin(plugin)


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


def add_worker_handler(worker, name: str, fn: Callable) -> None:
    """Serve comm requests ``{"op": name, ...}`` on ``worker`` with ``fn(**msg)``
    (``Worker.handlers``); its return value is the reply."""
    worker.handlers[name] = fn


class HandlerPlugin:
    """Base of a worker plugin that serves one comm handler on every worker, those that
    join later included: subclasses set ``name`` (the plugin's), ``op`` (the handler's)
    and ``make_handler(worker)``, which returns the handler for that worker."""

    name: str
    op: str

    def make_handler(self, worker) -> Callable:
        raise NotImplementedError

    def setup(self, worker) -> None:
        add_worker_handler(worker, self.op, self.make_handler(worker))

    def teardown(self, worker) -> None:
        remove_worker_handler(worker, self.op)


#: What a worker logs (at ERROR, with a traceback) when its heartbeat fails to reach the
#: scheduler: ``Worker.close`` stops the heartbeat's periodic callback, then closes its
#: pooled comms under a heartbeat still in flight, and the worker logs its own shutdown as a
#: failure (dask/distributed#7192, open; distributed 2026.7.1, worker.py ``heartbeat``).
HEARTBEAT_FAILED = "Failed to communicate with scheduler during heartbeat."


class _ClosingHeartbeatFilter(logging.Filter):
    """Drop :data:`HEARTBEAT_FAILED` while a worker of this process is closing: its own
    ``close`` cut the heartbeat. While every worker runs, the record passes, traceback and
    all (a real failure to reach the scheduler). One per process, on the
    ``distributed.worker`` logger; workers are held weakly."""

    def __init__(self):
        super().__init__()
        self.workers: weakref.WeakSet = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != HEARTBEAT_FAILED:
            return True
        closing = (Status.closing, Status.closing_gracefully)
        return not any(getattr(w, "status", None) in closing for w in list(self.workers))


_closing_filter: _ClosingHeartbeatFilter | None = None


def quiet_closing_heartbeat(worker) -> None:
    """Keep ``worker``'s own shutdown from logging a failed heartbeat with a traceback
    (:class:`_ClosingHeartbeatFilter`); idempotent."""
    global _closing_filter
    if _closing_filter is None:
        _closing_filter = _ClosingHeartbeatFilter()
        logging.getLogger("distributed.worker").addFilter(_closing_filter)
    _closing_filter.workers.add(worker)


class QuietClose(WorkerPlugin):
    """Worker plugin that installs :func:`quiet_closing_heartbeat` on every worker (blockflow
    registers it on the clusters it starts, whose shutdown it owns)."""

    name = "blockflow-quiet-close"

    def setup(self, worker) -> None:
        quiet_closing_heartbeat(worker)


def remove_worker_handler(worker, name: str) -> None:
    """Stop serving comm requests ``name`` on ``worker``."""
    worker.handlers.pop(name, None)


def has_worker_handler(worker, name: str) -> bool:
    """Whether ``worker`` serves comm requests ``name``."""
    return name in worker.handlers


async def call_worker(worker, address: str, name: str, **msg) -> Any:
    """Send ``{"op": name, **msg}`` from ``worker`` to the worker at ``address`` over the
    worker's pooled connections (``Worker.rpc``) and return the reply."""
    return await getattr(worker.rpc(address), name)(**msg)


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


async def register_worker_plugin_on_scheduler(scheduler, plugin, name: str,
                                              idempotent: bool = False) -> None:
    """Register the worker plugin ``plugin`` under ``name`` from the scheduler side
    (``Scheduler.register_worker_plugin``), for tests holding a Scheduler but no Client."""
    from distributed.protocol.pickle import dumps

    await scheduler.register_worker_plugin(None, dumps(plugin), name, idempotent=idempotent)


def worker_names_and_metrics(scheduler) -> dict:
    """``{address: (name, metrics)}`` for every worker the scheduler knows, where metrics
    is a copy of the heartbeat metrics the scheduler last received (``WorkerState.metrics``)."""
    return {a: (ws.name, dict(ws.metrics or {})) for a, ws in scheduler.workers.items()}


async def run_amm_policy(scheduler, policy, cycles: int = 10, timeout: float = 30.0) -> int:
    """Run one Active Memory Manager policy to completion, on its own, now.

    A dedicated manager (``ActiveMemoryManagerExtension(..., register=False, start=False)``,
    as distributed's ``retire_workers`` makes one) runs ``policy`` alone, so the scheduler's
    own AMM policies (``ReduceReplicas``) take no part in its cycles. Each cycle runs the
    policy once and enacts what the manager accepted; between cycles it waits until every
    accepted replica has landed (``TaskState.who_has``), so a policy that moves results
    (replicate, then drop) sees its copies in the next cycle.

    Parameters
    ----------
    scheduler : distributed.Scheduler
    policy : ActiveMemoryManagerPolicy
        E.g. an :class:`AMMPolicy`; its ``manager`` is set to the dedicated manager.
    cycles : int, default 10
        At most this many cycles.
    timeout : float, default 30.0
        Seconds to wait, per cycle, for accepted replicas to land (then the next cycle runs
        anyway; the policy sees which copies are missing).

    Returns
    -------
    int
        Cycles in which the manager accepted at least one suggestion; it stops at the first
        cycle in which it accepted none.
    """
    import asyncio
    import time

    from distributed.active_memory_manager import ActiveMemoryManagerExtension

    amm = ActiveMemoryManagerExtension(scheduler, policies=set(), register=False, start=False)
    accepted: list = []

    class _Recorder(ActiveMemoryManagerPolicy):
        """Passes ``policy``'s suggestions through, recording the ones accepted."""

        def run(self):
            gen = policy.run()
            ws = None
            while True:
                try:
                    suggestion = gen.send(ws)
                except StopIteration:
                    return
                ws = yield suggestion
                if ws is not None:
                    accepted.append((suggestion.op, suggestion.ts, ws))

    amm.add_policy(_Recorder())
    policy.manager = amm
    done = 0
    for _ in range(int(cycles)):
        accepted.clear()
        amm.run_once()
        if not accepted:
            break
        done += 1
        landing = [(ts, ws) for op, ts, ws in accepted if op == "replicate"]
        deadline = time.monotonic() + timeout
        while any(ts.state == "memory" and scheduler.workers.get(ws.address) is ws
                  and ws not in ts.who_has for ts, ws in landing):
            if time.monotonic() > deadline:
                logger.warning("run_amm_policy: replicas of %s not landed within %g s",
                               policy, timeout)
                break
            await asyncio.sleep(0.01)
    return done


# --- resources: kernels' placement, unsatisfiable restrictions, admission holds ------------

#: The worker restriction that holds a task back (admission control): no worker has this
#: address, so the scheduler keeps the task in "no-worker" until :func:`release_tasks`.
HOLD_ADDRESS = "blockflow-admission://held"


def task_placement(run_spec, *, max_nodes: int = 256) -> dict | None:
    """Where a task's kernels asked to run, or None.

    Looks through the task's spec (fused subgraphs included, at most ``max_nodes`` nodes,
    as :func:`task_working_set`) for objects with a ``blockflow_placement()`` method
    (blockflow's kernels given ``resources=``, ``workers=`` or ``allow_other_workers=``). A
    task that runs several such kernels (Dask fused them) needs each one's resources
    (the largest amount of each), the first kernel's workers, and may go elsewhere only if
    every kernel allows it.

    Returns
    -------
    dict or None
        ``{"resources": dict or None, "workers": tuple or None, "allow_other_workers":
        bool}``.
    """
    return _placement(_declaring_objects(run_spec, max_nodes))


def _placement(objects: list) -> dict | None:
    found = []
    for obj in objects:
        method = getattr(obj, "blockflow_placement", None)
        if not callable(method):
            continue
        try:
            p = method()
        except Exception:  # a kernel's own bug must not break the scheduler
            p = None
        if p:
            found.append(p)
    if not found:
        return None
    resources: dict[str, float] = {}
    for p in found:
        for r, q in (p.get("resources") or {}).items():
            resources[r] = max(resources.get(r, 0), q)
    workers = next((tuple(p["workers"]) for p in found if p.get("workers")), None)
    return {"resources": resources or None, "workers": workers,
            "allow_other_workers": all(bool(p.get("allow_other_workers")) for p in found)}


def set_task_placement(scheduler, key, placement: Mapping[str, Any]) -> bool:
    """Restrict a task that has not been scheduled yet as its kernel asked.

    ``placement`` as :func:`task_placement` returns it. Resources add to any the task
    carries; ``workers`` (addresses, worker names or host names, resolved as distributed
    resolves ``workers=`` annotations) replace its worker and host restrictions;
    ``allow_other_workers`` makes the restrictions loose. False when the task is gone or
    already past ``released``/``waiting``.
    """
    ts = scheduler.tasks.get(key)
    if ts is None or ts.state not in ("released", "waiting"):
        return False
    resources = placement.get("resources")
    if resources:
        ts.resource_restrictions = {**(ts.resource_restrictions or {}), **resources}
    workers = placement.get("workers")
    if workers:
        addresses, hosts = set(), set()
        for w in workers:
            try:
                addresses.add(scheduler.coerce_address(w))
            except (ValueError, OSError):  # not an address: perhaps a host name
                hosts.add(w)
        ts.worker_restrictions = addresses or None
        ts.host_restrictions = hosts or None
    ts.loose_restrictions = bool(placement.get("allow_other_workers"))
    return True


def unsatisfiable_tasks(scheduler) -> list[tuple[Any, dict]]:
    """``(key, resources)`` of the tasks ready to run but held in ``no-worker`` because no
    connected worker declares the resources they need (``resources={"GPU": 1}`` on a cluster
    without GPU workers). Empty when no worker is connected at all (then every task waits,
    a different problem). Tasks blockflow holds back (:func:`hold_tasks`) are not listed."""
    workers = list(scheduler.workers.values())
    if not workers:
        return []
    fits: dict[frozenset, bool] = {}
    out = []
    for ts in list(scheduler.unrunnable):
        need = ts.resource_restrictions
        if not need or ts.loose_restrictions:
            continue
        sig = frozenset(need.items())
        if sig not in fits:
            fits[sig] = any(all((ws.resources or {}).get(r, 0) >= q for r, q in need.items())
                            for ws in workers)
        if not fits[sig]:
            out.append((ts.key, dict(need)))
    return out


def fail_tasks(scheduler, keys, exception: BaseException, stimulus_id: str) -> int:
    """Fail tasks waiting in ``no-worker`` with ``exception``, as distributed's own
    ``no-workers-timeout`` fails them (their dependents fail too; clients get the error).

    Returns
    -------
    int
        Tasks failed (tasks gone or no longer in ``no-worker`` are skipped).
    """
    import pickle

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


@dataclass(frozen=True)
class FeederView:
    """A task whose every dependent needs a worker resource it does not (a CPU producer
    feeding GPU consumers), as admission control sees it (plain data).

    Attributes
    ----------
    key : str, tuple or int
    priority : tuple
        Dask's priority (smaller runs first).
    resources : dict
        The resources its consumers need (the largest amount of each).
    consumers : tuple
        The keys of its dependents.
    """

    key: Any
    priority: tuple
    resources: dict
    consumers: tuple = ()


def feeder_tasks(scheduler, keys) -> list[FeederView]:
    """Among ``keys`` (a graph that just arrived), the tasks not yet scheduled that carry no
    restriction and whose dependents (one or more) all need worker resources, in priority
    order."""
    out = []
    for key in keys:
        ts = scheduler.tasks.get(key)
        if (ts is None or ts.state != "released" or _restricted(ts) or ts.actor
                or not ts.run_spec or not ts.dependents):
            continue
        resources: dict[str, float] = {}
        for dts in ts.dependents:
            if not dts.resource_restrictions:
                break
            for r, q in dts.resource_restrictions.items():
                resources[r] = max(resources.get(r, 0), q)
        else:
            out.append(FeederView(ts.key, tuple(ts.priority or ()), resources,
                                  tuple(d.key for d in ts.dependents)))
    out.sort(key=lambda f: f.priority)
    return out


def hold_tasks(scheduler, keys) -> list:
    """Hold tasks that have not been scheduled yet: restricted to :data:`HOLD_ADDRESS`, they
    wait in ``no-worker`` (never on a worker) until :func:`release_tasks`. Returns the keys
    held (tasks gone, already scheduled or restricted otherwise are left alone)."""
    held = []
    for key in keys:
        ts = scheduler.tasks.get(key)
        if ts is None or ts.state != "released" or _restricted(ts):
            continue
        ts.worker_restrictions = {HOLD_ADDRESS}
        ts.loose_restrictions = False
        held.append(key)
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


#: Dependent states in which a consumer has not run yet.
_PENDING = frozenset({"released", "waiting", "queued", "no-worker", "processing"})
#: Dependent states of a consumer that has all its inputs (ready, or running).
_READY = frozenset({"queued", "no-worker", "processing"})


def feeder_states(scheduler, keys) -> dict:
    """key -> where a feeder task stands, for admission control (plain strings):

    ``"held"`` (held back, a consumer still needs it), ``"orphan"`` (held back, but no
    consumer needs it any more), ``"pending"`` (released, not yet run), ``"running"``
    (assigned to a worker), ``"feeding"`` (its output is in memory and a consumer that has
    all its inputs has not finished), ``"stored"`` (in memory, its consumers still wait for
    other inputs), ``"done"`` (no consumer needs it any more, failed, or gone).
    """
    out = {}
    for key in keys:
        ts = scheduler.tasks.get(key)
        if ts is None or ts.state in ("erred", "forgotten"):
            out[key] = "done"
            continue
        deps = ts.dependents or ()
        pending = any(d.state in _PENDING for d in deps)
        if ts.worker_restrictions == {HOLD_ADDRESS}:
            out[key] = "held" if pending else "orphan"
        elif ts.state == "processing":
            out[key] = "running"
        elif ts.state == "memory":
            if any(d.state in _READY for d in deps):
                out[key] = "feeding"
            else:
                out[key] = "stored" if pending else "done"
        elif ts.state in ("waiting", "queued", "no-worker"):
            out[key] = "pending"
        else:  # released with nothing left to feed
            out[key] = "pending" if pending else "done"
    return out


def call_soon(scheduler, fn: Callable[[], Any]) -> None:
    """Run ``fn()`` on the scheduler's event loop, after the current handler (e.g. from a
    plugin's ``transition`` hook, where changing scheduler state is not safe)."""
    scheduler.loop.add_callback(fn)


# --- resources on the worker side ------------------------------------------------------------


def worker_declared_resources(worker) -> dict:
    """The resources a worker declares (``Worker(resources=)``, ``--resources``): a copy."""
    return dict(worker.state.total_resources)


async def declare_worker_resources(worker, resources: Mapping[str, float]) -> None:
    """Declare more resources on a running worker (``Worker.set_resources``): the worker
    updates its own accounting and tells the scheduler."""
    await worker.set_resources(**dict(resources))


def current_worker_resources() -> tuple[str, dict] | None:
    """``(address, declared resources)`` of the worker running the current task, or None
    outside a worker's task."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:
        return None
    return worker.address, dict(worker.state.total_resources)


# --- speculative backup copies (blockflow.core.speculation, DynamicPolicy.backups) ------------


@dataclass
class RunningTask:
    """A task a worker is running now, as the speculation rule sees it (plain data).

    Attributes
    ----------
    key : str, tuple or int
    group : str
        Its task group (``dask.utils.key_split``).
    elapsed : float
        Seconds it has been running: the duration the worker reported at its last heartbeat
        plus the time since.
    duration : float
        distributed's estimate of its compute time at speed 1, seconds.
    duration_measured : bool
        Whether that estimate comes from finished tasks of its prefix.
    input_bytes : int
        Bytes of its inputs (a backup copy receives them from the worker running it).
    kernel : bool
        Whether it is a blockflow kernel task (only those can have backup copies).
    """

    key: Any
    group: str
    elapsed: float
    duration: float
    duration_measured: bool
    input_bytes: int
    kernel: bool


def running_tasks(scheduler, now: float) -> dict[str, list[RunningTask]]:
    """address -> the tasks it reported running at its last heartbeat and still runs (the
    scheduler still has them processing there), with their elapsed time to ``now``
    (seconds since the epoch). ``kernel`` marks tasks running a blockflow kernel that may be
    copied (found in the task's spec, as for working sets)."""
    out: dict[str, list[RunningTask]] = {}
    for addr, ws in scheduler.workers.items():
        if not ws.executing:
            continue
        since = max(now - float(getattr(ws, "last_seen", now) or now), 0.0)
        tasks = []
        for ts, duration in list(ws.executing.items()):
            if ts.processing_on is not ws or ts.state != "processing":
                continue
            group = key_split(ts.key)
            # a blockflow kernel that may be copied, also when Dask fused it into a task of
            # another name (``arange-blockflow-f-<token>``)
            kernel = any(getattr(o, "speculative", False)
                         for o in _declaring_objects(ts.run_spec)) if ts.run_spec else False
            expected, measured = prefix_duration(scheduler, ts.prefix)
            tasks.append(RunningTask(
                key=ts.key, group=group, elapsed=float(duration) + since,
                duration=expected, duration_measured=measured,
                input_bytes=sum(dts.nbytes for dts in ts.dependencies if dts.nbytes > 0),
                kernel=kernel))
        if tasks:
            out[addr] = tasks
    return out


def bandwidth(scheduler) -> float:
    """The scheduler's estimate of worker-to-worker bandwidth, bytes per second."""
    return float(scheduler.bandwidth)


async def request_backup(scheduler, key, victim: str, target: str, timeout: float) -> dict:
    """Ask worker ``victim`` to start a backup copy of its running task ``key`` on worker
    ``target`` and wait (at most ``timeout`` seconds) for the outcome: the reply of the
    victim's ``blockflow_speculate`` handler (:mod:`blockflow.core.speculation`), or
    ``{"outcome": "failed", "error": ...}``."""
    import asyncio

    try:
        return await asyncio.wait_for(
            scheduler.rpc(victim).blockflow_speculate(key=key, target=target), timeout)
    except Exception as e:  # a worker gone, no handler there, a timeout: the original runs on
        return {"outcome": "failed", "error": f"{type(e).__name__}: {e}"}


def spawn(scheduler, coro) -> None:
    """Run a coroutine on the scheduler's event loop without waiting for it."""
    import asyncio

    scheduler.loop.add_callback(lambda: asyncio.ensure_future(coro))


def install_worker_handlers(worker, handlers: Mapping[str, Callable]) -> None:
    """Add RPC handlers to a worker (``Worker.handlers``), once; existing ones are kept.
    Each ``fn(worker, **message)`` is called with the worker it was installed on."""
    for name, fn in handlers.items():
        if name not in worker.handlers:
            worker.handlers[name] = _bound_handler(worker, fn)


def _bound_handler(worker, fn: Callable) -> Callable:
    def handler(**message):
        return fn(worker, **message)

    return handler


def call_worker_soon(worker, address: str, op: str, **kwargs) -> None:
    """From any thread: call RPC handler ``op`` of the worker at ``address`` from ``worker``,
    on its event loop, without waiting (errors are logged at debug level)."""
    async def call():
        try:
            await getattr(worker.rpc(address), op)(**kwargs)
        except Exception as e:  # the other worker left: nothing to tell it
            logger.debug("blockflow: %s on %s failed: %s", op, address, e)

    worker.loop.add_callback(call)


def current_worker():
    """The worker running the current task, or None outside a worker's task."""
    try:
        from distributed import get_worker

        return get_worker()
    except ValueError:
        return None


def current_task_key():
    """Key of the task the current thread runs for its worker, or None."""
    from distributed.worker import thread_state

    return getattr(thread_state, "key", None)


def start_task_thread(fn: Callable[[], Any], name: str):
    """Start ``fn()`` in a new daemon thread that sees the current task's worker context
    (``get_worker()``, ``thread_state.key`` and ``execution_state``), as the worker's own
    executor thread does; returns the thread."""
    import contextvars
    import threading

    from distributed.worker import thread_state

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
    """Run ``fn()`` in the worker's default thread pool, with ``get_worker()`` working
    inside it (a backup copy's kernel); returns its result."""
    from distributed.worker import _worker_cvar

    def call():
        token = _worker_cvar.set(worker)
        try:
            return fn()
        finally:
            _worker_cvar.reset(token)

    return await worker.loop.run_in_executor(worker.executors["default"], call)


async def call_worker(worker, address: str, op: str, **kwargs) -> Any:
    """Call RPC handler ``op`` of the worker at ``address`` from ``worker``."""
    return await getattr(worker.rpc(address), op)(**kwargs)
from blockflow._distributed.speculation import SpeculationHandlers  # noqa: E402,F401
from blockflow._distributed.admission import FeederStates, feeder_state_view  # noqa: E402,F401
