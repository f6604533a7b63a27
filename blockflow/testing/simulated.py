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
import functools
import math
import os
import time
from typing import Any, Callable, Mapping, Sequence

from dask.sizeof import sizeof
from distributed import get_worker
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
