"""Worker heartbeat metrics read safely: missing, non-numeric, negative or non-finite is None."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

__all__ = ["BANDWIDTH_METRIC", "CAPACITY_METRIC", "DEVICE_SECONDS_METRIC", "POOL_FREE_METRIC", "DEVICE_UUID_METRIC", "OWN_UTILIZATION_METRIC", "POOL_METRIC", "GPU_MEMORY_TOTAL", "GPU_MEMORY_USED", "GPU_UTILIZATION", "WorkerMetrics",
           "clean_number", "read_metrics"]

GPU_UTILIZATION = "gpu_utilization"
GPU_MEMORY_USED = "gpu_memory_used"
GPU_MEMORY_TOTAL = "gpu-memory-total"
#: Optional worker metric: nominal relative capacity of the worker's device (static-capacity).
CAPACITY_METRIC = "blockflow-capacity"
#: Optional worker metric: percent of GPU time spent on this worker's own kernels (NVML's
#: per-process utilisation); lets the scheduler tell other tenants' load from its own.
OWN_UTILIZATION_METRIC = "blockflow-gpu-own-utilization"
#: Optional worker metric: UUID of the GPU the worker uses (``GPU-...``, ``MIG-...``; ``SIM-...``
#: for simulated devices), so that the scheduler can tell two workers sharing one device.
DEVICE_UUID_METRIC = "blockflow-gpu-uuid"
#: Optional worker metric: the device's memory bandwidth in bytes per second (NVML's bus
#: width x memory clock on a real GPU; a simulated device's ``bandwidth``).
BANDWIDTH_METRIC = "blockflow-device-bandwidth"
#: Optional worker metric: cumulative seconds the device was busy with this worker's tasks
#: (overlapping tasks counted once), for device time against wall time.
DEVICE_SECONDS_METRIC = "blockflow-device-seconds"
#: Optional worker metric: bytes the worker's device memory pool holds unused (CuPy's pool:
#: ``MemoryPool.free_bytes()``): NVML counts them as used, yet they are free to the worker's
#: blocks, so :func:`read_metrics` takes them off ``gpu_memory_used``.
POOL_FREE_METRIC = "blockflow-device-pool-free"
#: Optional worker metric: the worker's pool, a plain dict (:class:`blockflow.Pool`'s fields).
POOL_METRIC = "blockflow-pool"


def clean_number(value: Any, *, upper: float | None = None) -> float | None:
    """``value`` as a finite, non-negative float (at most ``upper``, when given), else None."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(f) or f < 0 or (upper is not None and f > upper):
        return None
    return f


@dataclass(frozen=True)
class WorkerMetrics:
    """GPU-style metrics of one worker, each None when unknown.

    Attributes
    ----------
    gpu_utilization, own_utilization : float or None
        Percent 0-100 (own: this worker's kernels, ``blockflow-gpu-own-utilization``).
    gpu_memory_used, gpu_memory_total, host_memory : float or None
        Bytes; ``gpu_memory_used`` leaves out what the worker's memory pool holds unused
        (``blockflow-device-pool-free``).
    device_uuid : str or None
    bandwidth : float or None
        Device memory bandwidth, bytes per second.
    device_seconds : float or None
        Cumulative seconds the device was busy with the worker's tasks.
    """

    gpu_utilization: float | None
    gpu_memory_used: float | None
    gpu_memory_total: float | None
    host_memory: float | None
    own_utilization: float | None = None
    device_uuid: str | None = None
    bandwidth: float | None = None
    device_seconds: float | None = None

    @property
    def has_gpu(self) -> bool:
        """Whether the worker reports a device (its total device memory is known)."""
        return self.gpu_memory_total is not None and self.gpu_memory_total > 0

    @property
    def gpu_memory_fraction(self) -> float | None:
        """Used / total device memory, 0-1, or None when either is unknown."""
        if not self.has_gpu or self.gpu_memory_used is None:
            return None
        return min(self.gpu_memory_used / self.gpu_memory_total, 1.0)

    @property
    def gpu_memory_free(self) -> float | None:
        """Free device memory in bytes, or None when unknown."""
        if not self.has_gpu or self.gpu_memory_used is None:
            return None
        return max(self.gpu_memory_total - self.gpu_memory_used, 0.0)

    def to_dict(self) -> dict[str, float | None]:
        return asdict(self)


def read_metrics(metrics: Mapping[str, Any] | None) -> WorkerMetrics:
    """Parse a worker's ``metrics`` dict into :class:`WorkerMetrics`; never raises."""
    if not isinstance(metrics, Mapping):
        metrics = {}
    total = clean_number(metrics.get(GPU_MEMORY_TOTAL))
    if total is None:
        # Fallback: the nested "gpu" dict some distributed versions send.
        gpu = metrics.get("gpu")
        if isinstance(gpu, Mapping):
            total = clean_number(gpu.get("memory-total"))
    total = total if total else None
    used = clean_number(metrics.get(GPU_MEMORY_USED))
    util = clean_number(metrics.get(GPU_UTILIZATION), upper=100.0)
    pooled = clean_number(metrics.get(POOL_FREE_METRIC))
    if used is not None and pooled:
        used = max(used - pooled, 0.0)  # held by the worker's pool, free to its blocks
    if total is None:
        used = util = None
    return WorkerMetrics(
        gpu_utilization=util,
        gpu_memory_used=used,
        gpu_memory_total=total,
        host_memory=clean_number(metrics.get("memory")),
        own_utilization=None if util is None else clean_number(
            metrics.get(OWN_UTILIZATION_METRIC), upper=100.0),
        device_uuid=_uuid(metrics.get(DEVICE_UUID_METRIC)) if total is not None else None,
        bandwidth=(clean_number(metrics.get(BANDWIDTH_METRIC)) or None) if total else None,
        device_seconds=clean_number(metrics.get(DEVICE_SECONDS_METRIC)) if total else None,
    )


def _uuid(value: Any) -> str | None:
    """A device UUID as reported: a non-empty string, else None."""
    return value.strip() if isinstance(value, str) and value.strip() else None
