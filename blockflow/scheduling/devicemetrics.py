"""Worker-side device metrics blockflow adds to distributed's NVML ones (real GPUs).

distributed reports a device's total utilisation; it cannot tell this worker's kernels from
another tenant's. :class:`DeviceMetrics` adds, on workers that see an NVIDIA GPU:

- ``blockflow-gpu-own-utilization``: percent of the device's SM time used by *this worker
  process* over the last sampling window (NVML ``nvmlDeviceGetProcessUtilization``), so the
  rebalancer can compute the utilisation taken by others exactly;
- ``blockflow-capacity``: the device's nominal throughput, SM cores x max SM clock (MHz), used
  by the ``static-capacity`` policy to weigh workers.

On workers without NVML or a GPU it adds nothing. NVML errors never reach the worker: a
metric that cannot be read is simply absent (None), which the scheduler treats as unknown.
"""

from __future__ import annotations

import os

from distributed.diagnostics.plugin import WorkerPlugin

from blockflow.metrics import CAPACITY_METRIC, OWN_UTILIZATION_METRIC

__all__ = ["DeviceMetrics"]


def _device_handle(pynvml):
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    if visible.startswith(("GPU-", "MIG-")):
        return pynvml.nvmlDeviceGetHandleByUUID(visible.encode())
    return pynvml.nvmlDeviceGetHandleByIndex(int(visible))


class DeviceMetrics(WorkerPlugin):
    """Report this worker's own GPU utilisation and its device's capacity (see module doc)."""

    name = "blockflow-device-metrics"
    idempotent = True

    def setup(self, worker) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = _device_handle(pynvml)
        except Exception:  # no NVML, no driver, no device: nothing to add
            return
        pid = os.getpid()
        state = {"last": 0}

        def own_utilization(w) -> float | None:
            try:
                samples = pynvml.nvmlDeviceGetProcessUtilization(handle, state["last"])
            except Exception:  # NVML_ERROR_NOT_FOUND when no sample is newer: idle
                return 0.0
            ours = [s for s in samples if s.pid == pid]
            if samples:
                state["last"] = max(s.timeStamp for s in samples)
            return float(min(max((s.smUtil for s in ours), default=0), 100))

        try:
            cores = pynvml.nvmlDeviceGetNumGpuCores(handle)
            clock = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
            capacity = float(cores * clock)
        except Exception:
            capacity = None
        worker.metrics[OWN_UTILIZATION_METRIC] = own_utilization
        if capacity:
            worker.metrics[CAPACITY_METRIC] = lambda w: capacity

    def teardown(self, worker) -> None:
        for key in (OWN_UTILIZATION_METRIC, CAPACITY_METRIC):
            if worker.metrics.get(key) is not None and not getattr(
                    worker.plugins.get("blockflow-simulated-gpu"), "device", None):
                worker.metrics.pop(key, None)
