"""The scheduler's workers as plain data (:class:`WorkerView`, dicts, strings); read-only."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


from blockflow._distributed.metrics import CAPACITY_METRIC, DEVICE_SECONDS_METRIC, POOL_METRIC, WorkerMetrics, clean_number, read_metrics

__all__ = ["WorkerView", "WorkerViewCache", "bandwidth", "device_seconds_samples",
           "measured_bandwidth",
           "own_utilization_estimate", "queued_count", "scheduler_metadata", "shared_devices",
           "worker_addresses", "worker_names_and_metrics", "worker_views",
           "workers_holding_data"]


@dataclass
class WorkerView:
    """What blockflow knows about one worker at one moment (plain data).

    Attributes
    ----------
    address, name : str
    nthreads : int
    status : str
        Scheduler-side status name (``"running"``, ``"paused"``, ...).
    paused_by_blockflow : bool
        Paused by blockflow's scheduler plugin (it only ever resumes those).
    metrics : WorkerMetrics
    speed : float
        Learned relative speed (1.0 = typical worker).
    processing : int
        Tasks assigned to the worker (running or waiting there).
    executing : int
        Tasks running at its last heartbeat.
    occupancy : float
        Seconds of assigned work at speed 1 (distributed's estimate, moves in flight included).
    host_memory_fraction : float or None
        Process memory / memory limit, 0-1.
    capacity : float or None
        Nominal relative capacity (``blockflow-capacity`` metric).
    memory_limit : int
        Host memory limit, bytes (0: none).
    speed_confidence : float
        Confidence of the learned speed, 0-1.
    resources : mapping of str to float
        Declared worker resources (``{"GPU": 1}``).
    device_uuid : str or None
        UUID of its GPU (``blockflow-gpu-uuid``).
    device_peers : tuple of str
        The other workers on the same device, sorted.
    peers_own_utilization : float
        Percent 0-100 of the shared device those peers' tasks take; 0 without peers.
    recent_speed : float or None
        Speed of its latest warm task
        (:meth:`blockflow.scheduling.speed.SpeedModel.recent_speed`).
    slow_for : float or None
        Seconds it is expected to stay slow
        (:meth:`blockflow.scheduling.speed.SpeedModel.slow_for`); None: throughout.
    pool : mapping or None
        Its pool (:meth:`blockflow.pools.pool.Pool.to_dict`).
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
        """Seconds until the worker finishes its assigned work (:meth:`finish_at`)."""
        return self.finish_at(self.occupancy)

    def finish_at(self, occupancy: float) -> float:
        """Seconds this worker needs for ``occupancy`` seconds of work at the typical speed: at its
        learned speed, or at it for :attr:`slow_for` seconds and at the typical speed after."""
        threads = max(self.nthreads, 1)
        speed = max(self.speed, 1e-6)
        work = occupancy / threads
        if self.slow_for is None or speed >= 1.0 or work <= speed * self.slow_for:
            return work / speed
        return self.slow_for + (work - speed * self.slow_for)

    @property
    def others_utilization(self) -> float | None:
        """GPU percent taken by work other than this worker's and its peers'; None if unknown."""
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
    """Percent 0-100 of its device a worker's own tasks take (reported, else busy-thread share)."""
    own = w.metrics.own_utilization
    if own is None:
        busy = min(max(w.executing, 1 if w.processing else 0), w.nthreads)
        own = 100.0 * busy / max(w.nthreads, 1)
    return own


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
    speed, confidence, recent_speed, slow_for : callable, optional
        ``f(address)``: learned speed (default 1.0), its confidence 0-1 (default 0), the latest
        task's speed and :attr:`WorkerView.slow_for` (default None).
    paused : mapping, optional
        Addresses blockflow paused.
    previous : WorkerViewCache, optional
        The last call's views: unchanged workers keep theirs; changed addresses are added to
        ``previous.changed``.
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
    """The last :func:`worker_views` call's views; ``changed``: addresses redone since emptied."""

    def __init__(self):
        self.views: dict[str, tuple] = {}  # address -> (state, view, raw metrics)
        self.changed: frozenset = frozenset()


def shared_devices(views: Mapping[str, WorkerView]) -> dict[str, tuple[str, ...]]:
    """Device UUID -> sorted addresses of the workers reporting it, for shared devices."""
    by_uuid: dict[str, list[str]] = {}
    for addr, w in views.items():
        if w.device_uuid:
            by_uuid.setdefault(w.device_uuid, []).append(addr)
    return {u: tuple(sorted(a)) for u, a in sorted(by_uuid.items()) if len(a) > 1}


def queued_count(scheduler) -> int:
    """Root tasks the scheduler holds back in its queue (not yet on any worker)."""
    return len(scheduler.queued)


def workers_holding_data(scheduler) -> frozenset:
    """Addresses of the workers that hold results in memory (``WorkerState.has_what``)."""
    return frozenset(a for a, ws in scheduler.workers.items() if ws.has_what)


def scheduler_metadata(scheduler, keys) -> Any:
    """What a client stored with ``Client.set_metadata(keys, ...)``, or None."""
    return scheduler.get_metadata(keys=list(keys), default=None)


def worker_names_and_metrics(scheduler) -> dict:
    """``{address: (name, metrics)}`` for every worker (a copy of its last heartbeat metrics)."""
    return {a: (ws.name, dict(ws.metrics or {})) for a, ws in scheduler.workers.items()}


def device_seconds_samples(scheduler) -> dict[str, tuple[float, float, float]]:
    """Per GPU worker reporting ``blockflow-device-seconds`` in its last heartbeat (read by
    the one metrics parser, :func:`read_metrics`): ``(after,
    before, seconds)``: the value was taken after ``after`` (the worker's monitor sample of
    that heartbeat, its clock) and before ``before`` (when the scheduler received it, the
    scheduler's clock), both seconds since the epoch. O(workers)."""
    out = {}
    for a, ws in scheduler.workers.items():
        raw = ws.metrics
        if not isinstance(raw, Mapping) or DEVICE_SECONDS_METRIC not in raw:
            continue
        value, seen = read_metrics(raw).device_seconds, clean_number(ws.last_seen)
        if value is not None and seen is not None:
            after = clean_number(raw.get("time"))
            out[a] = (seen if after is None else min(after, seen), seen, value)
    return out


def bandwidth(scheduler) -> float:
    """The scheduler's estimate of worker-to-worker bandwidth, bytes per second."""
    return float(scheduler.bandwidth)


def measured_bandwidth(scheduler) -> Mapping[tuple[str, str], float]:
    """``(receiver, sender)`` -> bytes per second distributed measured (live, read only)."""
    return scheduler.bandwidth_workers
