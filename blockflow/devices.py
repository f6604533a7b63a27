"""Devices: the NVIDIA GPU a process uses, read through distributed's NVML helpers.

Built on :mod:`distributed.diagnostics.nvml` (via :mod:`blockflow._distributed.nvml`). Every
function answers None (a count 0) when it cannot tell, never raising. :class:`DeviceMetrics`
adds the worker metrics ``blockflow-gpu-own-utilization``, ``blockflow-capacity``,
``blockflow-gpu-uuid`` and ``blockflow-device-bandwidth``. Guide: docs/guide/clusters.md.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict, dataclass
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from blockflow._distributed import check_worker, remove_worker_metric, set_worker_metric
from blockflow._distributed.nvml import (
    nvml_device_name,
    nvml_handle,
    nvml_memory_total,
    parse_visible_device,
)
from blockflow._distributed.metrics import (
    BANDWIDTH_METRIC,
    CAPACITY_METRIC,
    DEVICE_UUID_METRIC,
    OWN_UTILIZATION_METRIC,
)

__all__ = [
    "IDLE_UTILIZATION",
    "DeviceInfo",
    "DeviceMetrics",
    "OwnUtilization",
    "bandwidth",
    "capacity",
    "device_count",
    "device_handle",
    "device_info",
    "memory_total",
    "visible_device",
]

#: Device utilisation (percent) at or below which a device counts as idle; NVML reports
#: whole percents and an idle device reads 0.
IDLE_UTILIZATION = 1.0

_NVML_DEVICE_MIG_ENABLE = 1  # pynvml.NVML_DEVICE_MIG_ENABLE


def _nvml():
    """distributed's ``pynvml`` module, initialised in this process, or None."""
    try:
        from distributed.diagnostics import nvml

        nvml.init_once()
        return nvml.pynvml if nvml.is_initialized() else None
    except Exception:  # a driver error init_once does not expect
        return None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _visible_list() -> list[str] | None:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return None
    return [d.strip() for d in env.split(",") if d.strip()]


def device_count() -> int:
    """Number of NVIDIA GPUs visible to this process; 0 when none or when that cannot be told.

    NVML, clipped to ``CUDA_VISIBLE_DEVICES``; else the CUDA runtime through CuPy.
    """
    if _nvml() is not None:
        try:
            from distributed.diagnostics import nvml

            n = int(nvml.device_get_count())
            visible = _visible_list()
            return n if visible is None else min(n, len(visible))
        except Exception:
            pass
    try:
        if importlib.util.find_spec("cupy") is None:
            return 0
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def visible_device() -> int | str | None:
    """The device this process uses: the first entry of ``CUDA_VISIBLE_DEVICES``.

    Returns
    -------
    int, str or None
        An NVML index, or a ``GPU-``/``MIG-`` UUID string; 0 when the variable is unset;
        None when it is empty or unparsable.
    """
    visible = _visible_list()
    if visible is None:
        return 0
    if not visible:
        return None
    try:
        return parse_visible_device(visible[0])
    except Exception:  # ValueError: not an index nor a UUID
        return None


def device_handle(device: int | str | None = None):
    """NVML handle of ``device`` (default: :func:`visible_device`), or None.

    Parameters
    ----------
    device : int or str, optional
        NVML index, or a ``GPU-``/``MIG-`` UUID.
    """
    if _nvml() is None:
        return None
    device = visible_device() if device is None else device
    if device is None:
        return None
    try:
        return nvml_handle(device)
    except Exception:
        return None


@dataclass(frozen=True)
class DeviceInfo:
    """Identity of one NVIDIA device as NVML reports it; each field None when unknown.

    Attributes
    ----------
    index : int or None
        NVML index of the physical GPU (the parent GPU for a MIG instance).
    name : str or None
        Product name, e.g. ``"NVIDIA H100 80GB HBM3"``.
    uuid : str or None
        ``GPU-...`` or, for a MIG instance, ``MIG-...``.
    mig : bool or None
        Whether the device is a MIG instance or a GPU in MIG mode.
    memory_total : int or None
        Device memory in bytes.
    """

    index: int | None
    name: str | None
    uuid: str | None
    mig: bool | None
    memory_total: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def device_info(device: int | str | None = None) -> DeviceInfo | None:
    """Identity of ``device`` (default: the one this process uses), or None.

    Parameters
    ----------
    device : int or str, optional
        NVML index or ``GPU-``/``MIG-`` UUID; default :func:`visible_device`.

    Returns
    -------
    DeviceInfo or None
        None when NVML is unavailable or the device cannot be found.
    """
    device = visible_device() if device is None else device
    handle = device_handle(device)
    if handle is None:
        return None
    from distributed.diagnostics import nvml

    def ask(fn, *args):
        try:
            return fn(*args)
        except Exception:
            return None

    located = ask(nvml.get_device_index_and_uuid, device)  # None for some MIG UUIDs
    index = getattr(located, "device_index", None)
    uuid = _text(getattr(located, "uuid", None) or ask(nvml.pynvml.nvmlDeviceGetUUID, handle))
    if uuid is not None and uuid.startswith("MIG-"):
        mig = True
    else:
        mode = ask(nvml.get_device_mig_mode, device)
        mig = None if not mode else mode[0] == _NVML_DEVICE_MIG_ENABLE
    total = ask(nvml_memory_total, handle)
    return DeviceInfo(
        index=None if index is None else int(index),
        name=_text(ask(nvml_device_name, handle)),
        uuid=uuid,
        mig=mig,
        memory_total=None if total is None else int(total),
    )


def memory_total(device: int | str | None = None) -> int | None:
    """Total memory of ``device`` (default: the one this process uses) in bytes, or None."""
    info = device_info(device)
    return None if info is None else info.memory_total


def _datasheet(handle, pynvml, read) -> float | None:
    """``read(nvml)`` as a finite figure > 0, or None (no NVML, no device, no answer)."""
    nv = pynvml if pynvml is not None else _nvml()
    if nv is None or handle is None:
        return None
    try:
        value = float(read(nv))
    except Exception:  # an old driver, a MIG instance, a fake without the call
        return None
    return value if 0 < value < float("inf") else None


def capacity(handle, *, pynvml=None) -> float | None:
    """Nominal throughput of a device: SM cores x max SM clock (MHz), or None.

    A datasheet figure (blockflow heuristic), not a live speed.

    Parameters
    ----------
    handle : NVML device handle
        From :func:`device_handle`.
    pynvml : module, optional
        The NVML bindings (default distributed's); a test may pass a fake.
    """
    return _datasheet(handle, pynvml, lambda nv: nv.nvmlDeviceGetNumGpuCores(handle)
                      * nv.nvmlDeviceGetMaxClockInfo(handle, nv.NVML_CLOCK_SM))


def bandwidth(handle, *, pynvml=None) -> float | None:
    """Nominal device memory bandwidth in bytes per second, or None.

    ``bus width (bits) / 8 x max memory clock (MHz) x 1e6 x 2`` (double data rate), from
    NVML's ``nvmlDeviceGetMemoryBusWidth`` and ``nvmlDeviceGetMaxClockInfo(NVML_CLOCK_MEM)``:
    the datasheet figure (3.35 TB/s on an H100 SXM), not a measured speed.

    Parameters
    ----------
    handle : NVML device handle
        From :func:`device_handle`.
    pynvml : module, optional
        The NVML bindings (default distributed's); a test may pass a fake.
    """
    return _datasheet(handle, pynvml, lambda nv: nv.nvmlDeviceGetMemoryBusWidth(handle) / 8
                      * nv.nvmlDeviceGetMaxClockInfo(handle, nv.NVML_CLOCK_MEM) * 1e6 * 2)


class OwnUtilization:
    """This process's share of a device's SM time, from NVML's per-process samples.

    Each call returns a percent 0-100: the highest ``smUtil`` of this PID's samples since
    the last call; 0.0 on an idle device; None when the load cannot be attributed.

    Parameters
    ----------
    handle : NVML device handle
        From :func:`device_handle`.
    pynvml : module, optional
        The NVML bindings (default distributed's ``pynvml``; tests pass a fake).
    pid : int, optional
        Default: this process's.
    """

    def __init__(self, handle, pynvml=None, pid: int | None = None):
        self.handle = handle
        self.pynvml = pynvml
        self.pid = os.getpid() if pid is None else pid
        self.last = 0  # NVML timestamp (microseconds) of the newest sample seen

    def _bindings(self):
        return self.pynvml if self.pynvml is not None else _nvml()

    def _device_idle(self, nv) -> bool:
        try:
            util = float(nv.nvmlDeviceGetUtilizationRates(self.handle).gpu)
        except Exception:  # cannot tell: not idle
            return False
        return 0 <= util <= IDLE_UTILIZATION

    def __call__(self, worker=None) -> float | None:
        """Percent 0-100 of the device used by this process since the last call, or None."""
        nv = self._bindings()
        if nv is None:
            return None
        try:
            samples = list(nv.nvmlDeviceGetProcessUtilization(self.handle, self.last))
        except Exception as e:
            not_found = getattr(nv, "NVMLError_NotFound", None)
            if isinstance(not_found, type) and isinstance(e, not_found):
                return 0.0 if self._device_idle(nv) else None
            return None
        try:
            if samples:
                self.last = max(self.last, *(int(s.timeStamp) for s in samples))
            ours = [float(s.smUtil) for s in samples if s.pid == self.pid]
            if ours:
                return min(max(max(ours), 0.0), 100.0)
            others = max((float(s.smUtil) for s in samples), default=0.0)
        except Exception:  # a malformed sample
            return None
        if others <= IDLE_UTILIZATION and self._device_idle(nv):
            return 0.0
        return None


class DeviceMetrics(WorkerPlugin):
    """Worker plugin reporting its own GPU utilisation, the device's capacity and memory
    bandwidth (see the module docstring); adds nothing without NVML or a GPU.
    """

    name = "blockflow-device-metrics"
    idempotent = True

    def __init__(self):
        self._installed: dict[int, dict[str, Any]] = {}

    def setup(self, worker) -> None:
        check_worker(worker)
        handle = device_handle()
        if handle is None:  # no NVML, no driver, no device: nothing to add
            return
        own = OwnUtilization(handle)
        metrics: dict[str, Any] = {OWN_UTILIZATION_METRIC: own}
        nominal = capacity(handle)
        if nominal:
            metrics[CAPACITY_METRIC] = lambda w: nominal
        bw = bandwidth(handle)
        if bw:
            metrics[BANDWIDTH_METRIC] = lambda w, b=bw: b
        info = device_info()
        if info is not None and info.uuid:
            metrics[DEVICE_UUID_METRIC] = lambda w, u=info.uuid: u
        for key, fn in metrics.items():
            set_worker_metric(worker, key, fn)
        self._installed[id(worker)] = metrics

    def teardown(self, worker) -> None:
        installed = getattr(self, "_installed", {})
        for key, fn in installed.pop(id(worker), {}).items():
            remove_worker_metric(worker, key, fn)
