"""distributed's private NVML helpers (:mod:`distributed.diagnostics.nvml`) behind plain functions.

Each raises what the helper raises; :mod:`blockflow.devices` turns errors into "unknown"."""

from __future__ import annotations

from typing import Any

__all__ = ["nvml_device_name", "nvml_handle", "nvml_memory_total", "parse_visible_device"]


def parse_visible_device(entry: str) -> int | str:
    """One ``CUDA_VISIBLE_DEVICES`` entry as distributed reads it: an NVML index (int) or a
    ``GPU-``/``MIG-`` UUID (str). Raises ValueError for anything else."""
    from distributed.diagnostics import nvml

    return nvml._parse_cuda_visible_device(entry)


def nvml_handle(device: int | str) -> Any:
    """The NVML handle of ``device`` (an index, or a ``GPU-``/``MIG-`` UUID: a MIG UUID
    gives the MIG instance's handle). NVML must be initialised."""
    from distributed.diagnostics import nvml

    return nvml._get_handle(device)


def nvml_memory_total(handle) -> int:
    """Total memory of the device behind an NVML handle, bytes."""
    from distributed.diagnostics import nvml

    return nvml._get_memory_total(handle)


def nvml_device_name(handle) -> Any:
    """Product name of the device behind an NVML handle (bytes or str, as NVML gives it)."""
    from distributed.diagnostics import nvml

    return nvml._get_name(handle)
