"""Simulated GPU workers: CPU workers that report honest, measured GPU metrics.

blockflow's GPU-metric-aware scheduling reads the keys distributed's NVML monitor reports
(``gpu_utilization`` in percent, ``gpu_memory_used`` and ``gpu-memory-total`` in bytes). To
test and benchmark it on CPU-only machines, :class:`SimulatedGPU` (a
``distributed.WorkerPlugin``) gives each CPU worker a :class:`SimulatedDevice` and reports the
same keys from it, and :func:`simulated_kernel` is the work that runs "on" the device:

* **time**: a kernel of ``work`` reference-seconds takes ``work / speed`` seconds (longer
  beside a busy tenant or concurrent kernels), spent in ``time.sleep`` so that many
  simulated workers fit on a 2-core machine;
* **utilisation** is *measured*: the fraction of the last ``window`` seconds during which at
  least one simulated kernel was running on the device, plus a background tenant's share;
* **device memory** is *accounted*: bytes of :class:`SimulatedDeviceBlock` results the worker
  holds in ``worker.data``, plus working sets of running kernels, plus the tenant's bytes; a
  kernel whose working set does not fit raises :class:`SimulatedOutOfMemoryError`, worded
  like CuPy's ``OutOfMemoryError``.

Nothing here registers blockflow's scheduler plugin, so a simulated cluster also serves as
the plain-Dask baseline; on a worker without a simulated device :func:`simulated_kernel` runs
at speed 1 with unlimited memory. Clusters of simulated workers are started or equipped by
:mod:`blockflow.testing.cluster`.

This is a test double: production modules never import it. They find the simulated device
the way they find any device-owning worker plugin, by its ``describe_device()`` method.

What is not simulated: transfers (only the small payload moves between workers, whatever
``nbytes`` says), device-to-host spilling, and kernel launch overheads.
"""

from __future__ import annotations

import copy
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from dask.sizeof import sizeof
from dask.utils import parse_bytes, parse_timedelta
from distributed.diagnostics.plugin import WorkerPlugin

from blockflow import _distributed
from blockflow._distributed.metrics import (
    CAPACITY_METRIC,
    DEVICE_UUID_METRIC,
    GPU_MEMORY_TOTAL,
    GPU_MEMORY_USED,
    GPU_UTILIZATION,
    OWN_UTILIZATION_METRIC,
)

__all__ = [
    "PLUGIN_NAME", "SimulatedDevice", "SimulatedDeviceBlock", "SimulatedGPU",
    "SimulatedOutOfMemoryError", "Tenant", "device_scale", "device_stats", "get_device",
    "restart_clock", "set_speed", "set_tenant", "simulated_kernel", "slowed_to_device_speed",
]

#: Name of the worker plugin (for ``client.unregister_worker_plugin``). Production code never
#: looks it up: it finds the plugin by its ``describe_device()`` method.
PLUGIN_NAME = "blockflow-simulated-gpu"

_UUID_NAMESPACE = uuid.UUID("5f0c6f7e-2b1d-4c4e-9a57-b10cf10e51a5")


# --- data and errors --------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SimulatedDeviceBlock:
    """A result living in simulated device memory.

    Parameters
    ----------
    payload : object
        The real, small value the block carries (usually a NumPy array or scalar), so that
        results can be checked against NumPy.
    nbytes : int or str, optional
        Simulated size in device memory, bytes (``"256MiB"`` accepted); default the payload's
        ``dask.sizeof``. ``dask.sizeof`` of the block reports this number.
    """

    payload: Any
    nbytes: int = None  # type: ignore[assignment]

    def __post_init__(self):
        nbytes = sizeof(self.payload) if self.nbytes is None else _parse_bytes(self.nbytes)
        if nbytes < 0:
            raise ValueError(f"SimulatedDeviceBlock: nbytes must be >= 0, got {nbytes}.")
        object.__setattr__(self, "nbytes", int(nbytes))

    def __repr__(self) -> str:
        return (f"<SimulatedDeviceBlock {self.nbytes:,} bytes, "
                f"payload {type(self.payload).__name__}>")


@sizeof.register(SimulatedDeviceBlock)
def _sizeof_device_block(block: SimulatedDeviceBlock) -> int:
    return block.nbytes


class OutOfMemoryError(MemoryError):
    """Base named like CuPy's ``cupy.cuda.memory.OutOfMemoryError``, so that production code
    (``blockflow.errors.is_device_oom``, which matches class names to avoid importing GPU
    libraries) recognises the simulated error as a device OOM without naming the test double."""


class SimulatedOutOfMemoryError(OutOfMemoryError):
    """A simulated kernel's working set does not fit in free simulated device memory.

    The message follows CuPy's ``cupy.cuda.memory.OutOfMemoryError`` ("Out of memory
    allocating N bytes (allocated so far: M bytes)") and names the worker.

    Attributes
    ----------
    size : int
        Bytes the kernel asked for.
    allocated : int
        Bytes this worker already had allocated on the device (held blocks and working sets
        of running kernels; the tenant's bytes are not included, as in CuPy).
    where : str
        Which device and why, appended to the message.
    """

    def __init__(self, size: int, allocated: int, where: str = ""):
        self.size, self.allocated, self.where = int(size), int(allocated), where
        super().__init__(f"Out of memory allocating {self.size:,} bytes (allocated so far: "
                         f"{self.allocated:,} bytes).{' ' + where if where else ''}")

    def __reduce__(self):  # keep attributes across pickling (worker -> client)
        return type(self), (self.size, self.allocated, self.where)


# --- configuration ----------------------------------------------------------------------


def _parse_bytes(value: int | float | str) -> int:
    return int(parse_bytes(value) if isinstance(value, str) else value)


@dataclass
class Tenant:
    """Another process sharing a simulated device: it takes utilisation and device memory.

    Parameters
    ----------
    utilization : float, default 0
        Percent 0-100 of the device's time the tenant keeps busy.
    memory : int or str, default 0
        Device memory the tenant holds, bytes (``"2GiB"`` accepted).
    schedule : list of (seconds, percent, bytes), optional
        Changes over time: from ``seconds`` after the device's clock started (see
        :func:`restart_clock`) the tenant takes ``percent`` and ``bytes``; before the first
        entry, ``utilization`` and ``memory`` apply. Entries must be sorted by time.

    Raises
    ------
    ValueError
        If a percentage is outside 0-100, a size is negative or the schedule is unsorted.
    """

    utilization: float = 0.0
    memory: int | str = 0
    schedule: Sequence[tuple[float, float, int | str]] | None = None

    def __post_init__(self):
        self.utilization, self.memory = _check_tenant_step(self.utilization, self.memory)
        steps = [(float(t), *_check_tenant_step(u, m)) for t, u, m in (self.schedule or ())]
        if any(b[0] < a[0] for a, b in zip(steps, steps[1:])):
            raise ValueError(f"Tenant schedule must be sorted by time, got {steps}.")
        self.schedule = steps

    def at(self, seconds: float) -> tuple[float, int]:
        """``(utilisation percent, memory bytes)`` at ``seconds`` since the clock started."""
        util, mem = self.utilization, self.memory
        for t, u, m in self.schedule:
            if t > seconds:
                break
            util, mem = u, m
        return util, mem

    @classmethod
    def coerce(cls, value: Any) -> Tenant | None:
        """A :class:`Tenant` from None, a Tenant, a dict of its fields, ``(percent, bytes)``
        or a schedule (list of ``(seconds, percent, bytes)``)."""
        if value is None or isinstance(value, Tenant):
            return value
        if isinstance(value, Mapping):
            return cls(**value)
        value = list(value)
        if len(value) == 2 and not isinstance(value[0], (tuple, list)):
            return cls(utilization=value[0], memory=value[1])
        return cls(schedule=value)


def _check_tenant_step(util, mem) -> tuple[float, int]:
    util, mem = float(util), _parse_bytes(mem)
    if not 0 <= util <= 100:
        raise ValueError(f"Tenant utilization must be a percentage 0-100, got {util:g}.")
    if mem < 0:
        raise ValueError(f"Tenant memory must be >= 0 bytes, got {mem}.")
    return util, mem


def _check_speed(speed) -> float:
    speed = float(speed)
    if not 0 < speed < float("inf"):
        raise ValueError(f"Simulated device speed must be a finite number > 0, got {speed!r}.")
    return speed


class SimulatedDevice:
    """One simulated GPU: its speed, memory capacity, background tenant, and run-time state.

    A configuration object until :class:`SimulatedGPU` attaches it to a worker; from then on
    it measures utilisation and accounts device memory (see the module docstring). Speed,
    tenant and the schedules' clock can be changed while work runs (:meth:`set_speed`,
    :meth:`set_tenant`, :meth:`restart_clock`), e.g. for mid-run slowdown experiments.

    Parameters
    ----------
    speed : float, default 1.0
        Throughput relative to the reference device: a kernel of ``work`` seconds takes
        ``work / speed`` seconds.
    device_memory : int or str, default "16GiB"
        Capacity in bytes.
    tenant : Tenant, tuple, dict or list, optional
        Background tenant (see :class:`Tenant` and :meth:`Tenant.coerce`).
    speed_schedule : list of (seconds, speed), optional
        From ``seconds`` after the clock started the speed is ``speed``; before the first
        entry, ``speed`` applies. Sorted by time.
    tenant_contention : bool, default True
        Whether the tenant slows kernels down. Blockflow heuristic for time-sliced sharing
        between processes (no MPS): a tenant busy ``u`` percent of the time leaves kernels
        ``max(1 - u/100, 0.5)`` of the device. Set False to let the tenant show only in the
        metrics and memory.
    window : float or str, default 1.0
        Seconds over which utilisation is measured (NVML samples over 1/6-1 s).
    uuid : str, optional
        The device's UUID (reported as the ``blockflow-gpu-uuid`` metric and to
        ``blockflow.inventory``); give two workers the same one to simulate two workers on
        one GPU. Default: a stable ``SIM-`` UUID of the worker's host and name, one device
        per worker.

    Notes
    -----
    Concurrent kernels (a multi-threaded worker) share the device's throughput equally
    (processor sharing, blockflow heuristic) and count once in the utilisation.
    """

    def __init__(self, speed: float = 1.0, device_memory: int | str = "16GiB", tenant=None,
                 speed_schedule: Sequence[tuple[float, float]] | None = None,
                 tenant_contention: bool = True, window: float | str = 1.0,
                 uuid: str | None = None):
        self.base_speed = _check_speed(speed)
        self.uuid = uuid
        self.capacity = _parse_bytes(device_memory)
        if self.capacity <= 0:
            raise ValueError(f"device_memory must be > 0 bytes, got {self.capacity}.")
        self.tenant = Tenant.coerce(tenant)
        steps = [(float(t), _check_speed(s)) for t, s in (speed_schedule or ())]
        if any(b[0] < a[0] for a, b in zip(steps, steps[1:])):
            raise ValueError(f"speed_schedule must be sorted by time, got {steps}.")
        self.speed_schedule = steps
        self.tenant_contention = bool(tenant_contention)
        self.window = float(parse_timedelta(window))
        self.epoch = time.time()
        self.worker = None
        self._init_state()

    def _init_state(self) -> None:
        self._lock = threading.Lock()
        self._speed_override: float | None = None
        self._active: dict[int, int] = {}  # token -> working-set bytes
        self._next_token = 0
        self._busy_since: float | None = None  # monotonic; set while any kernel runs
        self._busy: deque[tuple[float, float]] = deque()  # disjoint busy intervals
        self.busy_seconds = 0.0
        self.kernels = 0
        self.oom_errors = 0

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "worker")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self.worker = None

    def __repr__(self) -> str:
        where = f" on {self.worker.address}" if self.worker is not None else ""
        return (f"<SimulatedDevice speed {self.speed():g}, {self.capacity:,} bytes"
                f"{', tenant' if self.tenant else ''}{where}>")

    # --- state at a time --------------------------------------------------------------

    def elapsed(self) -> float:
        """Seconds since the clock of the schedules started."""
        return time.time() - self.epoch

    def speed(self) -> float:
        """Current speed factor (set at run time, else from the schedule, else the base)."""
        if self._speed_override is not None:
            return self._speed_override
        speed, now = self.base_speed, self.elapsed()
        for t, s in self.speed_schedule:
            if t > now:
                break
            speed = s
        return speed

    def tenant_now(self) -> tuple[float, int]:
        """``(utilisation percent, memory bytes)`` the tenant takes now."""
        return (0.0, 0) if self.tenant is None else self.tenant.at(self.elapsed())

    def effective_speed(self) -> float:
        """Speed a single kernel gets now: :meth:`speed` times the share the tenant leaves."""
        share = 1.0
        if self.tenant_contention:
            share = max(1.0 - self.tenant_now()[0] / 100.0, 0.5)
        return self.speed() * share

    # --- run-time changes (call through client.run) ------------------------------------

    def set_speed(self, speed: float | None) -> None:
        """Fix the speed from now on; None returns to the base speed and schedule."""
        self._speed_override = None if speed is None else _check_speed(speed)

    def set_tenant(self, tenant) -> None:
        """Replace the background tenant (None removes it); see :meth:`Tenant.coerce`."""
        self.tenant = Tenant.coerce(tenant)

    def restart_clock(self, epoch: float | None = None) -> None:
        """Restart the schedules' clock at ``epoch`` (seconds since the Unix epoch, default
        now); pass one shared value to all workers to start their schedules together."""
        self.epoch = time.time() if epoch is None else float(epoch)

    # --- metrics -----------------------------------------------------------------------

    def held_bytes(self) -> int:
        """Device bytes of :class:`SimulatedDeviceBlock` results in the worker's memory."""
        if self.worker is None:
            return 0
        # Called from kernel threads beside the worker's event loop: worker_data_values reads
        # only in-memory values (a SpillBuffer's fast part), through the zict.LRU's dict without
        # touching the LRU order, in one C-level pass (retried if a mapping changed size).
        values = _distributed.worker_data_values(self.worker)
        return sum(v.nbytes for v in values if type(v) is SimulatedDeviceBlock)

    def memory_used(self) -> int:
        """Bytes in use, as NVML would report them: held blocks, working sets of running
        kernels and the tenant's bytes, at most the capacity."""
        with self._lock:
            in_flight = sum(self._active.values())
        return min(self.held_bytes() + in_flight + self.tenant_now()[1], self.capacity)

    def utilization(self) -> float:
        """Percent 0-100: measured busy fraction over the last ``window`` seconds plus the
        tenant's share, capped at 100."""
        return round(min(self.own_utilization() + self.tenant_now()[0], 100.0), 1)

    def own_utilization(self) -> float:
        """Percent 0-100 of the last ``window`` seconds the device spent on this worker's
        kernels (NVML's per-process utilisation on a real GPU)."""
        now = time.monotonic()
        start = now - self.window
        with self._lock:
            while self._busy and self._busy[0][1] <= start:
                self._busy.popleft()
            busy = sum(min(e, now) - max(s, start) for s, e in self._busy if e > start)
            if self._busy_since is not None:
                busy += now - max(self._busy_since, start)
        return min(100.0 * busy / self.window if self.window > 0 else 0.0, 100.0)

    def describe(self) -> dict[str, Any]:
        """Identity for ``blockflow.inventory``: name, a stable ``SIM-`` UUID, ``simulated``."""
        return {
            "gpu_name": f"Simulated GPU (speed {self.base_speed:g})",
            "gpu_uuid": self.device_uuid(),
            "simulated": True,
        }

    def device_uuid(self) -> str:
        """The UUID given, else a stable ``SIM-`` UUID of the worker's host and name."""
        if getattr(self, "uuid", None):
            return self.uuid
        if self.worker is None:
            ident = "unattached"
        else:
            try:
                host = self.worker.host
            except ValueError:  # in-process workers (inproc:// addresses) have no host
                host = self.worker.address
            ident = f"{host}/{self.worker.name}"
        return f"SIM-{uuid.uuid5(_UUID_NAMESPACE, ident)}"

    def stats(self) -> dict[str, Any]:
        """Counters and current metrics (plain data) for benchmark reports."""
        return {
            "speed": self.speed(), "effective_speed": self.effective_speed(),
            "utilization": self.utilization(), "memory_used": self.memory_used(),
            "memory_total": self.capacity, "held_bytes": self.held_bytes(),
            "tenant_utilization": self.tenant_now()[0], "tenant_memory": self.tenant_now()[1],
            "kernels": self.kernels, "busy_seconds": self._busy_total(),
            "oom_errors": self.oom_errors,
        }

    def _busy_total(self) -> float:
        with self._lock:
            extra = 0.0 if self._busy_since is None else time.monotonic() - self._busy_since
            return self.busy_seconds + extra

    # --- kernels -----------------------------------------------------------------------

    def _begin(self, working_set: int) -> int:
        """Reserve ``working_set`` bytes and mark the device busy; raise if they don't fit."""
        held = self.held_bytes()
        tenant_mem = self.tenant_now()[1]
        with self._lock:
            in_flight = sum(self._active.values())
            if working_set > self.capacity - held - tenant_mem - in_flight:
                self.oom_errors += 1
                w = self.worker
                where = "" if w is None else (
                    f"Simulated device of worker {w.name!r} ({w.address}): capacity "
                    f"{self.capacity:,} bytes, background tenant {tenant_mem:,} bytes."
                )
                raise SimulatedOutOfMemoryError(working_set, held + in_flight, where)
            token = self._next_token
            self._next_token += 1
            self._active[token] = working_set
            if self._busy_since is None:
                self._busy_since = time.monotonic()
            return token

    def _end(self, token: int) -> None:
        with self._lock:
            del self._active[token]
            self.kernels += 1
            if not self._active and self._busy_since is not None:
                now = time.monotonic()
                self._busy.append((self._busy_since, now))
                self.busy_seconds += now - self._busy_since
                self._busy_since = None
                while self._busy and self._busy[0][1] <= now - self.window:
                    self._busy.popleft()

    def _run(self, work: float) -> None:
        """Sleep until ``work`` reference-seconds are done, re-reading speed, tenant and the
        number of concurrent kernels at least every 50 ms; stop early when this copy of a
        speculated task lost (:func:`blockflow.core.speculation.cancelled`)."""
        from blockflow.core.speculation import cancelled

        remaining = work
        while remaining > 1e-9:
            if cancelled():  # the other copy of this task won: stop, as a real device would
                return
            rate = self.effective_speed() / max(len(self._active), 1)
            step = min(remaining / rate, 0.05)
            time.sleep(step)
            remaining -= step * rate


# --- the worker plugin -------------------------------------------------------------------


class SimulatedGPU(WorkerPlugin):
    """Worker plugin giving CPU workers simulated devices that report NVML-style metrics.

    One plugin object, registered cluster-wide with ``client.register_plugin``, carries the
    devices of all workers; each worker (thread or process) picks its own on ``setup`` and
    sets ``worker.metrics["gpu_utilization" | "gpu_memory_used" | "gpu-memory-total"]``, the
    keys of distributed's NVML monitor (whose own values win on a real GPU worker).

    Parameters
    ----------
    devices : SimulatedDevice or mapping, optional
        A mapping from worker address or worker name (``0``, ``"0"``, ...) to
        :class:`SimulatedDevice`; a single device is used for every worker.
    default : SimulatedDevice, optional
        For workers not named in ``devices`` (e.g. added later). Workers with neither get no
        device and report no GPU metrics.
    declare_gpu : bool, default True
        Whether a worker given a device declares a ``GPU`` worker resource (see Notes);
        False models GPU workers started without ``--resources GPU=1``.

    Notes
    -----
    A worker given a device declares one ``GPU`` worker resource (unless it declares
    ``GPU`` already), as the GPU workers :func:`blockflow.connect` starts do, so that
    ``resources={"GPU": 1}`` places tasks on simulated GPU workers too.

    ``idempotent = True``: registering a second plugin under the same name is a no-op. To
    change devices at run time use :func:`set_speed` / :func:`set_tenant`; to replace them,
    ``client.unregister_worker_plugin("blockflow-simulated-gpu")`` first.
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, devices: SimulatedDevice | Mapping[Any, SimulatedDevice] | None = None,
                 default: SimulatedDevice | None = None, declare_gpu: bool = True):
        self.declare_gpu = bool(declare_gpu)
        if isinstance(devices, SimulatedDevice):
            devices, default = {}, devices
        self.devices = {str(k): v for k, v in (devices or {}).items()}
        for k, v in [*self.devices.items(), ("default", default)]:
            if v is not None and not isinstance(v, SimulatedDevice):
                raise TypeError(f"SimulatedGPU: device for {k!r} must be a SimulatedDevice, "
                                f"got {type(v).__name__}.")
        self.default = default
        self.device: SimulatedDevice | None = None
        self._metrics: dict[str, Callable] = {}  # the metric callables this plugin set

    async def setup(self, worker) -> None:
        _distributed.check_worker(worker)
        spec = self.devices.get(str(worker.address), self.devices.get(str(worker.name),
                                                                       self.default))
        if spec is None:
            return
        self.device = copy.deepcopy(spec)
        self.device._init_state()  # a fresh device, whatever the spec went through
        self.device.worker = worker
        d = self.device
        self._metrics = {
            GPU_UTILIZATION: lambda w: d.utilization(),
            GPU_MEMORY_USED: lambda w: d.memory_used(),
            GPU_MEMORY_TOTAL: lambda w: d.capacity,
            # Nominal capacity, as a device model's datasheet would give it: what the static
            # policy "static-capacity" weighs workers by (never the live, learned speed).
            CAPACITY_METRIC: lambda w: d.base_speed,
            OWN_UTILIZATION_METRIC: lambda w: round(d.own_utilization(), 1),
            DEVICE_UUID_METRIC: lambda w: d.device_uuid(),
        }
        for name, fn in self._metrics.items():
            _distributed.set_worker_metric(worker, name, fn)
        if getattr(self, "declare_gpu", True) and \
                "GPU" not in _distributed.worker_declared_resources(worker):
            await _distributed.declare_worker_resources(worker, {"GPU": 1})

    def teardown(self, worker) -> None:
        # Only the metrics this plugin set: a real NVML monitor's own callables stay.
        for name, fn in self._metrics.items():
            _distributed.remove_worker_metric(worker, name, fn)
        self._metrics = {}
        if self.device is not None:
            self.device.worker = None
            self.device = None

    def describe_device(self) -> dict[str, Any]:
        """The device's identity (``gpu_name``, ``gpu_uuid``, ``simulated``), the protocol by
        which ``blockflow.inventory`` finds a device-owning worker plugin; ``{}`` on a worker
        without a simulated device."""
        return {} if self.device is None else self.device.describe()

    def describe(self) -> dict[str, Any]:
        """Alias of :meth:`describe_device`, kept for existing callers."""
        return self.describe_device()


# --- on the worker: the kernel and client.run helpers ------------------------------------


def get_device(dask_worker=None) -> SimulatedDevice | None:
    """The simulated device of ``dask_worker`` (default: the worker running this task), or
    None on a plain worker or outside any worker."""
    if dask_worker is None:
        from distributed import get_worker

        try:
            dask_worker = get_worker()
        except ValueError:
            return None
    plugin = _distributed.worker_plugins(dask_worker).get(PLUGIN_NAME)
    return getattr(plugin, "device", None)


def _require_device(dask_worker) -> SimulatedDevice:
    device = get_device(dask_worker)
    if device is None:
        raise RuntimeError(f"Worker {getattr(dask_worker, 'address', None)} has no simulated "
                           f"device; install one with simulated_cluster() or "
                           f"install_simulated_devices().")
    return device


def set_speed(speed: float | None, dask_worker=None) -> None:
    """``client.run(set_speed, 0.25, workers=[addr])``: change a device's speed now (None:
    back to its base speed and schedule)."""
    _require_device(dask_worker).set_speed(speed)


def set_tenant(tenant, dask_worker=None) -> None:
    """``client.run(set_tenant, (80, "4GiB"), workers=[addr])``: replace the tenant now."""
    _require_device(dask_worker).set_tenant(tenant)


def restart_clock(epoch: float | None = None, dask_worker=None) -> None:
    """``client.run(restart_clock, time.time())``: restart the speed and tenant schedules."""
    _require_device(dask_worker).restart_clock(epoch)


def device_stats(dask_worker=None) -> dict[str, Any] | None:
    """``client.run(device_stats)``: each device's counters (kernels, ``oom_errors``,
    ``busy_seconds``) and current metrics; None on a plain worker."""
    device = get_device(dask_worker)
    return None if device is None else device.stats()


def _input_bytes(block: Any) -> int:
    return block.nbytes if isinstance(block, SimulatedDeviceBlock) else int(sizeof(block))


def simulated_kernel(*blocks: Any, op: Callable | None = None, work: float = 0.05,
                     working_set: int | str | None = None,
                     output_bytes: int | str | None = None) -> SimulatedDeviceBlock:
    """Run a simulated GPU kernel on blocks, on the simulated device of this worker.

    Parameters
    ----------
    *blocks : SimulatedDeviceBlock or host data (NumPy array, scalar, ...)
        Inputs. Their payloads (the value itself for host data) are passed to ``op``.
    op : callable, optional
        ``op(*payloads)``: the real computation on the small payloads, e.g. ``np.sum``, so
        results can be checked against NumPy. Default: the single input's payload unchanged.
        (Not named ``func``, which would clash with ``client.submit(func, ...)``.)
    work : float, default 0.05
        Reference-seconds of device time; the kernel sleeps ``work / speed`` seconds (longer
        beside a busy tenant or concurrent kernels: see :class:`SimulatedDevice`).
    working_set : int or str, optional
        Peak device bytes the kernel needs while running. Default: ``output_bytes`` plus the
        bytes of inputs that are not yet on the device (host data is copied over).
    output_bytes : int or str, optional
        Simulated size of the result in bytes; default the largest input's nbytes.

    Returns
    -------
    SimulatedDeviceBlock
        ``output_bytes`` of device memory (while a worker holds it) carrying
        ``op(*payloads)``.

    Raises
    ------
    SimulatedOutOfMemoryError
        If ``working_set`` exceeds free simulated memory: capacity minus held blocks, the
        tenant's bytes and working sets of kernels running concurrently. Counted in
        ``device_stats()["oom_errors"]``.
    TypeError
        If several blocks are given without ``op``.
    ValueError
        If ``work`` is negative.

    Notes
    -----
    On a worker without a simulated device (or outside a worker) the kernel runs at speed 1
    with unlimited memory, so plain-Dask baselines can use the same kernel.
    """
    if work < 0:
        raise ValueError(f"simulated_kernel: work must be >= 0 seconds, got {work!r}.")
    if op is None and len(blocks) != 1:
        raise TypeError(f"simulated_kernel: pass op= to combine {len(blocks)} blocks "
                        f"(without op the kernel returns its single input's payload).")
    nbytes = [_input_bytes(b) for b in blocks]
    out_bytes = max(nbytes, default=0) if output_bytes is None else _parse_bytes(output_bytes)
    if working_set is None:
        working_set = out_bytes + sum(
            n for b, n in zip(blocks, nbytes) if not isinstance(b, SimulatedDeviceBlock))
    working_set = _parse_bytes(working_set)
    payloads = [b.payload if isinstance(b, SimulatedDeviceBlock) else b for b in blocks]

    device = get_device()
    if device is None:
        result = op(*payloads) if op is not None else payloads[0]
        time.sleep(work)
        return SimulatedDeviceBlock(result, out_bytes)
    token = device._begin(working_set)
    try:
        result = op(*payloads) if op is not None else payloads[0]
        device._run(work)
    finally:
        device._end(token)
    return SimulatedDeviceBlock(result, out_bytes)


def device_scale(speeds: Sequence[float], fraction: float = 0.7) -> float:
    """Host-core seconds per simulated device-second at speed 1, for
    ``slowed_to_device_speed(..., scale=device_scale(speeds))``.

    The smallest whole factor that keeps the simulated devices' real compute within
    ``fraction`` of this host's cores: four devices of total speed 2.75 on a 2-core host
    would otherwise fight over the cores whenever they compute at once, and each would run
    slower than its speed says (a limit of the host, not of the scheduling under test).

    Parameters
    ----------
    speeds : sequence of float
        The simulated devices' speeds (1.0 = one host core).
    fraction : float, default 0.7
        Share 0-1 of the host's cores (``os.sched_getaffinity``) the devices may use.

    Returns
    -------
    float
        A whole number, at least 1 (2 for speeds 1, 1, 0.5, 0.25 on 2 cores).

    Raises
    ------
    ValueError
        If ``fraction`` is not in (0, 1].
    """
    import math
    import os

    if not 0 < fraction <= 1:
        raise ValueError(f"blockflow: fraction must be in (0, 1], got {fraction!r}.")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count()
    return float(max(1, math.ceil(sum(speeds) / (fraction * (cores or 1)))))


def slowed_to_device_speed(fn: Callable, clock: str = "wall", scale: float = 1.0
                           ) -> Callable:
    """Wrap ``fn`` so that on a simulated device it takes its real compute time / speed.

    The call runs for real (on the CPU); then, on a worker with a simulated device of speed
    ``s``, the device is kept busy until the call has taken ``scale x t / s`` seconds in
    all, ``t`` the call's measured time, so a device at speed 0.25 takes four times the
    real compute time, and the device's utilisation counts the whole call. Elsewhere ``fn``
    runs unchanged. Used to give real workloads (training, tuning trials) honest uneven
    devices.

    Parameters
    ----------
    fn : callable
    clock : {"wall", "cpu", "thread"}, default "wall"
        How ``t`` is measured. ``"wall"``: elapsed seconds (for calls whose work includes
        sleeping or waiting). ``"cpu"``: the worker process's CPU seconds during the call
        (``time.process_time``, all its threads; use with one worker per process): on a
        host with fewer cores than simulated devices, the time a call waits for a shared
        core is not work, and is not multiplied by ``1/s``. ``"thread"``: the CPU seconds
        of the thread that ran the call (``time.thread_time``): as ``"cpu"``, without the
        worker's event loop (serving peers' transfers, heartbeats) meanwhile; for calls
        whose compute stays on their own thread (one BLAS or intra-op thread).
    scale : float, default 1.0
        Device seconds per measured second at speed 1 (> 0). With ``scale=2`` the devices
        are twice as slow as the host's cores, so that several simulated devices' real
        compute fits fewer host cores without contending.

    Returns
    -------
    callable
        Same signature and result as ``fn``.

    Raises
    ------
    ValueError
        If ``clock`` is not ``"wall"``, ``"cpu"`` or ``"thread"``, or ``scale`` is not
        positive.
    """
    import functools

    if clock not in ("cpu", "wall", "thread"):
        raise ValueError(f"blockflow: clock must be 'wall', 'cpu' or 'thread', got "
                         f"{clock!r}.")
    cpu_clock = time.thread_time if clock == "thread" else time.process_time
    if not scale > 0:
        raise ValueError(f"blockflow: scale must be positive, got {scale!r}.")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device = get_device()
        if device is None:
            return fn(*args, **kwargs)
        token = device._begin(0)
        try:
            start, cpu = time.perf_counter(), cpu_clock()
            result = fn(*args, **kwargs)
            elapsed = time.perf_counter() - start
            work = scale * (elapsed if clock == "wall" else cpu_clock() - cpu)
            speed = device.speed()
            # in all the call takes work / s: _run sleeps (its argument) / s
            remaining = work - elapsed * speed
            if remaining > 0:
                device._run(remaining)
        finally:
            device._end(token)
        return result

    return wrapper
