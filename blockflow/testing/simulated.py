"""Simulated GPU workers: CPU workers that report measured, NVML-style GPU metrics.

Transfers, spilling and launch overheads are not simulated."""
from __future__ import annotations

import copy
import functools
import math
import os
import time
from typing import Any, Callable, Mapping, Sequence

from dask.sizeof import sizeof
from dask.utils import key_split
from distributed import get_worker
from distributed.diagnostics.plugin import WorkerPlugin

from blockflow import _distributed
from blockflow._distributed.metrics import (
    BANDWIDTH_METRIC,
    CAPACITY_METRIC,
    DEVICE_SECONDS_METRIC,
    DEVICE_UUID_METRIC,
    GPU_MEMORY_TOTAL,
    GPU_MEMORY_USED,
    GPU_UTILIZATION,
    OWN_UTILIZATION_METRIC,
)
from blockflow.testing.simulated_device import SimulatedDevice, SimulatedDeviceBlock, _parse_bytes

__all__ = [
    "PLUGIN_NAME", "SimulatedGPU", "device_scale", "device_stats", "get_device",
    "restart_clock", "set_speed", "set_tenant", "simulated_kernel", "slowed_to_device_speed",
]

#: Name of the worker plugin (for ``client.unregister_worker_plugin``). Production code never
#: looks it up: it finds the plugin by its ``describe_device()`` method.
PLUGIN_NAME = "blockflow-simulated-gpu"


# --- the worker plugin -------------------------------------------------------------------


class SimulatedGPU(WorkerPlugin):
    """Worker plugin giving CPU workers simulated devices that report NVML-style metrics.

    Parameters
    ----------
    devices : SimulatedDevice or mapping, optional
        Worker address or name -> :class:`SimulatedDevice`; one device for every worker.
    default : SimulatedDevice, optional
        For workers not in ``devices``.
    declare_gpu : bool, default True
        Whether a worker with a device declares one ``GPU`` resource.

    Notes
    -----
    Registering a second plugin under the same name is a no-op; use :func:`set_speed` /
    :func:`set_tenant`, or unregister :data:`PLUGIN_NAME` first.
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
            BANDWIDTH_METRIC: lambda w: d.bandwidth,
            DEVICE_SECONDS_METRIC: lambda w: round(d._busy_total(), 6),
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
    """Run a simulated GPU kernel on blocks, on this worker's simulated device (speed 1 and
    unlimited memory without one).

    Parameters
    ----------
    *blocks : SimulatedDeviceBlock or host data
    op : callable, optional
        ``op(*payloads)``; default the single input's payload.
    work : float, default 0.05
        Reference-seconds: the kernel sleeps ``work / speed`` seconds.
    working_set : int or str, optional
        Peak device bytes; default ``output_bytes`` plus the host inputs' bytes.
    output_bytes : int or str, optional
        Default the largest input's.

    Returns
    -------
    SimulatedDeviceBlock

    Raises
    ------
    SimulatedOutOfMemoryError
        If ``working_set`` exceeds free simulated memory.
    TypeError
        Several blocks without ``op``.
    ValueError
        Negative ``work``.
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
    if device.group_speeds:
        key = _distributed.current_task_key()
        work = device.work_of(work, key_split(key) if key is not None else None)
    token = device._begin(working_set)
    try:
        result = op(*payloads) if op is not None else payloads[0]
        device._run(work)
    finally:
        device._end(token)
    return SimulatedDeviceBlock(result, out_bytes)


def device_scale(speeds: Sequence[float], fraction: float = 0.7) -> float:
    """The smallest whole host-core seconds per device-second (>= 1) that keeps the devices' real
    compute within ``fraction`` (0, 1] of this host's cores.

    Raises
    ------
    ValueError
        If ``fraction`` is not in (0, 1].
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"blockflow: fraction must be in (0, 1], got {fraction!r}.")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count()
    return float(max(1, math.ceil(sum(speeds) / (fraction * (cores or 1)))))


def slowed_to_device_speed(fn: Callable, clock: str = "wall", scale: float = 1.0
                           ) -> Callable:
    """Wrap ``fn`` so that on a simulated device of speed ``s`` the call takes ``scale x t / s``
    seconds, ``t`` its measured time; unchanged elsewhere.

    Parameters
    ----------
    fn : callable
    clock : {"wall", "cpu", "thread"}, default "wall"
        How ``t`` is measured.
    scale : float, default 1.0
        Device seconds per measured second at speed 1 (> 0).

    Raises
    ------
    ValueError
        For another ``clock`` or a non-positive ``scale``.
    """
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
