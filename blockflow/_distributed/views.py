"""The scheduler seen as plain data: worker and task views, read off distributed's state.

Everything here reads the scheduler (``Scheduler.workers``, ``.tasks``, ``WorkerState``,
``TaskState``, the stealing extension) and hands out plain objects (:class:`WorkerView`,
:class:`TaskView`, :class:`HeldResult`, :class:`FeederView`, :class:`RunningTask`, dicts and
strings) that policies can read without touching a scheduler object. Nothing here changes
the scheduler: that is :mod:`blockflow._distributed.actions`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from dask.utils import key_split

from blockflow._distributed.metrics import CAPACITY_METRIC, POOL_METRIC, WorkerMetrics, clean_number, read_metrics
from blockflow._distributed.placement import (
    HOLD_ADDRESS,
    _declaring_objects,
    _placement,
    _restricted,
    _size_of,
    _working_set,
)

__all__ = [
    "FeederView",
    "HeldResult",
    "RunningTask",
    "TaskView",
    "WorkerView",
    "WorkerViewCache",
    "bandwidth",
    "feeder_states",
    "measured_bandwidth",
    "feeder_tasks",
    "group_duration",
    "held_results",
    "input_holders",
    "new_task_views",
    "own_utilization_estimate",
    "prefix_duration",
    "queued_count",
    "running_tasks",
    "scheduler_metadata",
    "shared_devices",
    "task_states",
    "unsatisfiable_tasks",
    "waiting_tasks",
    "worker_addresses",
    "worker_names_and_metrics",
    "worker_views",
    "workers_holding_data",
]



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
    slow_for : float or None
        Seconds the worker is expected to stay at its (lower) learned speed before it runs
        at the typical speed again (:meth:`blockflow.scheduling.speed.SpeedModel.slow_for`:
        a slow streak that began recently); None: at its learned speed throughout.
    pool : mapping or None
        The pool the worker reports (``blockflow-pool`` metric, plain data:
        :meth:`blockflow.pools.pool.Pool.to_dict`); None if it reports none.
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
    slow_for: float | None = None
    pool: Mapping[str, Any] | None = None

    @property
    def projected_finish(self) -> float:
        """Seconds until the worker finishes its assigned work at its learned speed (for
        :attr:`slow_for` seconds only, when set; at the typical speed after)."""
        return self.finish_at(self.occupancy)

    def finish_at(self, occupancy: float) -> float:
        """Seconds this worker needs for ``occupancy`` seconds of work at the typical
        speed: at its learned speed, or at it for :attr:`slow_for` seconds and at the
        typical speed after."""
        threads = max(self.nthreads, 1)
        speed = max(self.speed, 1e-6)
        work = occupancy / threads
        if self.slow_for is None or speed >= 1.0 or work <= speed * self.slow_for:
            return work / speed
        return self.slow_for + (work - speed * self.slow_for)

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
        Seconds to move its missing inputs to each worker: each input's bytes over the
        bandwidth of the fastest link from a worker holding it (``links``: measured per pair
        of workers, see :class:`blockflow.scheduling.estimate.LinkBandwidth`; else the
        scheduler's cluster-wide estimate).
    comm_bytes : mapping of str to int
        Bytes of its inputs each worker lacks (what ``comm_cost`` sends).
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
    comm_bytes: Mapping[str, int] = field(default_factory=dict)
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
                 recent_speed: Callable[[str], float | None] | None = None,
                 slow_for: Callable[[str], float | None] | None = None,
                 previous: "WorkerViewCache | None" = None
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
    slow_for : callable, optional
        ``slow_for(address) -> float or None`` (:attr:`WorkerView.slow_for`).
    previous : WorkerViewCache, optional
        The views of the last call: a worker whose heartbeat metrics, status, task counts,
        occupancy and speed are as they were keeps its view (its metrics are not parsed
        again), and the addresses whose view is new are added to ``previous.changed``.
    """
    stealing = scheduler.extensions.get("stealing")
    in_flight = getattr(stealing, "in_flight_occupancy", {}) if stealing else {}
    paused = paused or {}
    views = {}
    cache = previous.views if previous is not None else {}
    changed = set()
    for addr, ws in scheduler.workers.items():
        raw = ws.metrics if isinstance(ws.metrics, dict) else {}
        spd = float(speed(addr)) if speed is not None else 1.0
        conf = float(confidence(addr)) if confidence is not None else 0.0
        recent = recent_speed(addr) if recent_speed is not None else None
        slow = slow_for(addr) if slow_for is not None else None
        occupancy = max(ws.occupancy + in_flight.get(ws, 0.0), 0.0)
        state = (id(raw), ws.status, ws.nthreads, len(ws.processing), len(ws.executing),
                 occupancy, spd, conf, recent, slow, addr in paused)
        hit = cache.get(addr)
        if hit is not None and hit[0] == state and hit[2] is raw \
                and hit[1].status == ws.status.name:  # (a view's status may be set)
            views[addr] = hit[1]
            continue
        limit = ws.memory_limit or 0
        if hit is not None and hit[2] is raw:  # same heartbeat, new counts: parsed already
            m, cap = hit[1].metrics, hit[1].capacity
        else:
            m = read_metrics(raw)
            cap = clean_number(raw.get(CAPACITY_METRIC))
        views[addr] = view = WorkerView(
            address=addr,
            name=str(ws.name),
            nthreads=ws.nthreads,
            status=ws.status.name,
            paused_by_blockflow=addr in paused,
            metrics=m,
            speed=spd,
            processing=len(ws.processing),
            executing=len(ws.executing),
            occupancy=occupancy,
            host_memory_fraction=(m.host_memory / limit)
            if m.host_memory is not None and limit else None,
            capacity=cap if cap else None,
            memory_limit=int(limit),
            speed_confidence=conf,
            recent_speed=recent,
            slow_for=slow,
            resources=dict(ws.resources or {}),
            device_uuid=m.device_uuid,
            pool=raw.get(POOL_METRIC) if isinstance(raw.get(POOL_METRIC), dict) else None,
        )
        if previous is not None:
            previous.views[addr] = (state, view, raw)
        changed.add(addr)
    shared = shared_devices(views)
    for members in shared.values():
        for addr in members:
            w = views[addr]
            w.device_peers = tuple(a for a in members if a != addr)
            w.peers_own_utilization = min(
                sum(own_utilization_estimate(views[a]) for a in w.device_peers), 100.0)
        changed.update(members)  # a peer's load is part of each view: judge them again
    if previous is not None:
        for addr in [a for a in cache if a not in views]:
            del cache[addr]
        previous.changed = previous.changed | changed  # until the caller consumes them
    return views


class WorkerViewCache:
    """The views :func:`worker_views` made last time, to reuse those of workers that did not
    change; ``changed`` is the addresses whose view a call made anew since the caller last
    emptied it (the scheduler plugin, once a tick's rules have seen them)."""

    def __init__(self):
        self.views: dict[str, tuple] = {}  # address -> (state, view, raw metrics)
        self.changed: frozenset = frozenset()


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


def workers_holding_data(scheduler) -> frozenset:
    """Addresses of the workers that hold results in memory (``WorkerState.has_what``)."""
    return frozenset(a for a, ws in scheduler.workers.items() if ws.has_what)


def group_duration(scheduler, name: str) -> float | None:
    """Expected seconds of a task of the prefix named ``name`` (:func:`prefix_duration`:
    measured, else distributed's default for unknown tasks); None for an unknown prefix."""
    prefix = scheduler.task_prefixes.get(name)
    return None if prefix is None else prefix_duration(scheduler, prefix)[0]


def _comm(scheduler, ts, ws, links) -> tuple[float, int]:
    """``(seconds, bytes)`` to send ``ts``'s inputs that ``ws`` lacks to it: each over the
    fastest link from a worker holding it (``links(receiver, sender)``, bytes per second),
    or the scheduler's cluster-wide bandwidth without ``links``."""
    has = ws.has_what
    seconds, nbytes = 0.0, 0
    default = float(scheduler.bandwidth)
    for dts in ts.dependencies:
        if dts in has:
            continue
        n = dts.nbytes
        if n <= 0:
            continue
        bw = default
        if links is not None and dts.who_has:
            bw = max(links(ws.address, h.address) for h in dts.who_has)
        seconds += n / bw
        nbytes += n
    return seconds, nbytes


def _task_view(scheduler, ts, thieves=(), links=None) -> TaskView:
    valid = scheduler.valid_workers(ts)
    duration, measured = prefix_duration(scheduler, ts.prefix)
    comm = {ws.address: _comm(scheduler, ts, ws, links) for ws in thieves}
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
        comm_cost={a: c[0] for a, c in comm.items()},
        comm_bytes={a: c[1] for a, c in comm.items()},
    )


def task_states(scheduler, keys) -> dict:
    """key -> the scheduler's state of that task (``"released"``, ``"waiting"``,
    ``"processing"``, ``"memory"``, ...); keys the scheduler does not hold are left out."""
    out = {}
    for key in keys:
        ts = scheduler.tasks.get(key)
        if ts is not None:
            out[key] = ts.state
    return out


def input_holders(scheduler, key, worker: str) -> list[tuple[int, tuple[str, ...]]]:
    """``(nbytes, holders)`` of each input of a task that just finished on ``worker``:
    the input's size and the other workers that hold it (empty: only ``worker`` does, it
    was made there). O(inputs x their holders)."""
    ts = scheduler.tasks.get(key)
    if ts is None:
        return []
    return [(int(dep.nbytes or 0), tuple(sorted(w.address for w in dep.who_has or ()
                                                if w.address != worker)))
            for dep in ts.dependencies]


#: The comm costs of a view that has none (a new task's): one shared, read-only mapping.
_NO_COMM: Mapping = MappingProxyType({})
_NEW_VIEW_DEFAULTS = {"duration": 0.0, "duration_measured": True, "input_bytes": 0,
                      "allowed_workers": None, "comm_cost": _NO_COMM, "comm_bytes": _NO_COMM}


def new_task_views(scheduler, keys) -> list[TaskView]:
    """Views of the tasks of a graph that just arrived (``update_graph``), in key order of
    ``keys``; keys the scheduler no longer holds are skipped. No comm costs.

    Built without the frozen dataclass's ``__init__`` (one ``object.__setattr__`` per
    field: 2.7 us of the 5.5 us a view cost, for every task of every graph); the views
    are the same as ``TaskView(...)`` gives, and share one empty read-only comm mapping."""
    out = []
    tasks = scheduler.tasks
    new = object.__new__
    defaults = _NEW_VIEW_DEFAULTS
    for key in keys:
        ts = tasks.get(key)
        if ts is not None:
            run_spec = ts.run_spec
            declaring = _declaring_objects(run_spec) if run_spec else ()
            view = new(TaskView)
            d = view.__dict__
            d.update(defaults)
            # ts.prefix.name is key_split(ts.key): distributed names the prefix so
            d["key"], d["group"], d["state"] = ts.key, ts.prefix.name, ts.state
            d["priority"] = tuple(ts.priority or ())
            d["restricted"] = _restricted(ts)
            d["runnable"] = bool(run_spec)
            d["working_set"] = _working_set(declaring, ts.key) if declaring else None
            d["placement"] = _placement(declaring) if declaring else None
            out.append(view)
    return out


def waiting_tasks(scheduler, *, thieves: list[str] | None = None,
                  stopped: Collection[str] = (),
                  links: Callable[[str, str], float] | None = None
                  ) -> Mapping[str, Iterator]:
    """address -> iterator of :class:`TaskView` of the tasks waiting on that worker (assigned
    but not started), lowest priority (last to run) first, skipping tasks a move is already
    pending for and actors. Computed lazily, per worker, when read; each view carries the comm
    cost to each worker in ``thieves``.

    On a worker with a free thread, the first tasks are about to start and are left out;
    on a worker in ``stopped`` (paused by itself, for host memory: its threads start
    nothing) every task not started is waiting.
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
        free = 0 if addr in stopped else max(ws.nthreads - len(ws.executing), 0)
        for ts in reversed(pending[free:]):
            if ts.actor or ts in in_flight or ts.processing_on is not ws:
                continue
            yield _task_view(scheduler, ts, targets, links)

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


def scheduler_metadata(scheduler, keys) -> Any:
    """What a client stored with ``Client.set_metadata(keys, ...)``, or None (the
    scheduler-side reader, ``Scheduler.get_metadata``, is a handler method)."""
    return scheduler.get_metadata(keys=list(keys), default=None)


def worker_names_and_metrics(scheduler) -> dict:
    """``{address: (name, metrics)}`` for every worker the scheduler knows, where metrics
    is a copy of the heartbeat metrics the scheduler last received (``WorkerState.metrics``)."""
    return {a: (ws.name, dict(ws.metrics or {})) for a, ws in scheduler.workers.items()}


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
        The keys of its dependents (empty for an *expected* feeder: its consumers have not
        arrived yet).
    group : str
        Its task prefix (``dask.utils.key_split``).
    earlier : bool
        Whether an earlier graph submitted it (its consumers arrived after it).
    """

    key: Any
    priority: tuple
    resources: dict
    consumers: tuple = ()
    group: str = ""
    earlier: bool = False


#: States of an earlier graph's task that may still feed a new graph's consumers: not
#: started (queued on the scheduler, or assigned to a worker) or its output still in memory.
_EARLIER = frozenset({"waiting", "queued", "processing", "memory"})


_HELD = frozenset({HOLD_ADDRESS})


def feeder_tasks(scheduler, keys, expect: Collection[str] = ()) -> list[FeederView]:
    """The feeders of a graph that just arrived (``keys``), in priority order: tasks that
    carry no restriction and whose dependents (one or more) all need worker resources.

    Among ``keys``, those not yet scheduled; among the tasks of earlier graphs that
    ``keys`` depend on (producers submitted before their consumers, distributed#9164's
    ``client.map(produce)`` then ``client.map(consume, resources=...)``), those not done
    yet, whose output is still in memory (:data:`_EARLIER`) or held back by
    :func:`hold_tasks` (``earlier=True``). With ``expect`` (task prefixes), also the new
    tasks of those prefixes that nothing depends on yet (expected feeders:
    ``consumers=()``)."""
    candidates = []
    for key in keys:
        ts = scheduler.tasks.get(key)
        if ts is None:
            continue
        # (distributed lists an earlier graph's tasks the new one depends on among ``keys``)
        if ts.state == "released" or ts.state in _EARLIER:
            candidates.append(ts)
        if ts.resource_restrictions:
            candidates.extend(d for d in ts.dependencies if d.state in _EARLIER
                              or d.worker_restrictions == {HOLD_ADDRESS})
    out, seen = [], set()
    for ts in candidates:
        if ts.key in seen or ts.actor or not ts.run_spec:
            continue
        seen.add(ts.key)
        if not expect and not ts.dependents:
            continue  # feeds nothing and not expected: none of the cases below
        held = ts.worker_restrictions == _HELD
        if _restricted(ts) and not held:
            continue
        group = ts.prefix.name  # key_split(ts.key), as distributed names the prefix
        if not ts.dependents:
            if expect and group in expect and ts.state == "released" and not held:
                out.append(FeederView(ts.key, tuple(ts.priority or ()), {}, (), group))
            continue
        resources: dict[str, float] = {}
        for dts in ts.dependents:
            if not dts.resource_restrictions:
                break
            for r, q in dts.resource_restrictions.items():
                resources[r] = max(resources.get(r, 0), q)
        else:
            out.append(FeederView(ts.key, tuple(ts.priority or ()), resources,
                                  tuple(d.key for d in ts.dependents), group,
                                  earlier=ts.state != "released" or held))
    out.sort(key=lambda f: f.priority)
    return out


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
            # (a consumer of a graph just arriving is still "released": ready if all its
            # inputs are in memory)
            if any(d.state in _READY or (d.state == "released" and all(
                    i.state == "memory" for i in d.dependencies)) for d in deps):
                out[key] = "feeding"
            else:
                out[key] = "stored" if pending else "done"
        elif ts.state in ("waiting", "queued", "no-worker"):
            out[key] = "pending"
        else:  # released with nothing left to feed
            out[key] = "pending" if pending else "done"
    return out


# scheduler -> task key -> whether its spec runs a blockflow kernel that may be copied
_KERNEL: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_KERNEL_MAX = 100_000  # keys remembered per scheduler


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
    size : float or None
        Its size in units its group shares: declared work (``blockflow_work``), else its
        input bytes; None when unknown (see :func:`task_size`). The scheduler plugin scales
        ``duration`` by it against its group's typical size
        (:meth:`blockflow.scheduling.speed.SpeedModel.size_factor`).
    """

    key: Any
    group: str
    elapsed: float
    duration: float
    duration_measured: bool
    input_bytes: int
    kernel: bool
    size: float | None = None


def running_tasks(scheduler, now: float) -> dict[str, list[RunningTask]]:
    """address -> the tasks it reported running at its last heartbeat and still runs (the
    scheduler still has them processing there), with their elapsed time to ``now``
    (seconds since the epoch). ``kernel`` marks tasks running a blockflow kernel that may be
    copied (found in the task's spec, as for working sets)."""
    out: dict[str, list[RunningTask]] = {}
    known = _KERNEL.setdefault(scheduler, {})
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
            # another name (``arange-blockflow-f-<token>``); looked for once per task (a
            # task runs for many ticks, and a tick should not walk every running spec)
            kernel = known.get(ts.key)
            if kernel is None:
                kernel = any(getattr(o, "speculative", False)
                             for o in _declaring_objects(ts.run_spec)) if ts.run_spec else False
                if len(known) >= _KERNEL_MAX:
                    known.clear()
                known[ts.key] = kernel
            expected, measured = prefix_duration(scheduler, ts.prefix)
            tasks.append(RunningTask(
                key=ts.key, group=group, elapsed=float(duration) + since,
                duration=expected, duration_measured=measured,
                input_bytes=sum(dts.nbytes for dts in ts.dependencies if dts.nbytes > 0),
                kernel=kernel, size=_size_of(ts)))
        if tasks:
            out[addr] = tasks
    return out


def bandwidth(scheduler) -> float:
    """The scheduler's estimate of worker-to-worker bandwidth, bytes per second."""
    return float(scheduler.bandwidth)


def measured_bandwidth(scheduler) -> Mapping[tuple[str, str], float]:
    """``(receiver, sender)`` worker addresses -> bytes per second, as distributed measured
    transfers of over 1 MB between them (``Scheduler.bandwidth_workers``; the live mapping,
    read only; pairs of departed workers are dropped by distributed)."""
    return scheduler.bandwidth_workers
