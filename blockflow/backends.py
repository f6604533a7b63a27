"""Backends: NumPy/CuPy and pandas/cuDF dispatch, and moving collections to and from the device.

GPU packages are never imported at module import time: :class:`dask.utils.Dispatch` with
lazily registered CuPy / cuDF handlers. Guide: docs/guide/clusters.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from typing import Any

import numpy as np
from dask.utils import Dispatch

from blockflow.devices import device_count
from blockflow.errors import describe

__all__ = [
    "GPUUnavailableError",
    "array_module",
    "dataframe_module",
    "gpu_device_count",
    "has_package",
    "is_device_block",
        "to_host",
]

GPU_INSTALL_HINT = 'pip install "blockflow[gpu]"'


class GPUUnavailableError(RuntimeError):
    """Raised when GPU work is asked for and a piece it needs is missing."""


def has_package(name: str) -> bool:
    """Whether package ``name`` is importable, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require(package: str, why: str) -> types.ModuleType:
    """Import ``package`` or raise :class:`GPUUnavailableError` naming it and the fix."""
    if not has_package(package):
        raise GPUUnavailableError(
            f"{why} needs the package {package!r}, which is not installed. "
            f"Install blockflow's GPU extra: {GPU_INSTALL_HINT}"
        )
    return importlib.import_module(package)


def gpu_device_count() -> int:
    """Number of NVIDIA GPUs visible to this process; 0 when none or when that cannot be told.

    Never raises (:func:`blockflow.devices.device_count`).
    """
    return device_count()


# --- which module handles a block -------------------------------------------------------

_array_module = Dispatch("array_module")
_dataframe_module = Dispatch("dataframe_module")


@_array_module.register(np.ndarray)
@_array_module.register(np.generic)
def _array_module_numpy(x):
    return np


@_array_module.register_lazy("cupy")
def _register_cupy():
    import cupy

    @_array_module.register(cupy.ndarray)
    def _array_module_cupy(x):
        return cupy


@_dataframe_module.register_lazy("pandas")  # pandas is imported with its first block:
def _register_pandas():  # a scheduler that imports this module never loads it
    import pandas as pd

    @_dataframe_module.register((pd.DataFrame, pd.Series, pd.Index))
    def _dataframe_module_pandas(x):
        return pd


@_dataframe_module.register_lazy("cudf")
def _register_cudf():
    import cudf

    @_dataframe_module.register((cudf.DataFrame, cudf.Series, cudf.Index))
    def _dataframe_module_cudf(x):
        return cudf


def array_module(block: Any) -> types.ModuleType:
    """The array module (``numpy`` or ``cupy``) that handles ``block``."""
    if isinstance(block, (int, float, complex, bool, list, tuple)):
        return np
    return _array_module(block)


def dataframe_module(block: Any) -> types.ModuleType:
    """The dataframe module (``pandas`` or ``cudf``) that handles ``block``."""
    return _dataframe_module(block)


def is_device_block(block: Any) -> bool:
    """Whether ``block`` lives in GPU memory (a CuPy array or a cuDF object)."""
    mod = type(block).__module__.split(".")[0]
    return mod in ("cupy", "cudf")


# --- moving collections ---------------------------------------------------------------


def _collection_kind(obj: Any) -> str:
    import dask.array as da
    import dask.dataframe as dd

    if isinstance(obj, da.Array):
        return "array"
    if isinstance(obj, (dd.DataFrame, dd.Series)):
        return "dataframe"
    if has_package("xarray"):
        import xarray as xr

        if isinstance(obj, (xr.DataArray, xr.Dataset)):
            return "xarray"
    raise TypeError(
        f"Expected a dask.array.Array, dask.dataframe.DataFrame/Series or an xarray object "
        f"backed by dask, got {type(obj).__module__}.{type(obj).__name__}. "
        f"Wrap in-memory data first, e.g. dask.array.from_array(x, chunks=...) or "
        f"dask.dataframe.from_pandas(df, npartitions=...)."
    )


def _on_host(meta: Any) -> bool:
    return type(meta).__module__.split(".")[0] in ("numpy", "pandas")


def _move_array(x, target: str):
    if target == "device":
        cupy = require("cupy", "blockflow.to_device")
        return x.map_blocks(cupy.asarray, dtype=x.dtype, meta=cupy.empty((0,) * x.ndim, x.dtype))
    if _on_host(x._meta):  # already NumPy blocks: nothing to do, no extra tasks
        return x
    return x.map_blocks(_block_to_host, dtype=x.dtype, meta=np.empty((0,) * x.ndim, x.dtype))


def _block_to_host(b):
    return b.get() if hasattr(b, "get") and not isinstance(b, np.ndarray) else np.asarray(b)


def _move(obj: Any, target: str):
    import dask.array as da

    kind = _collection_kind(obj)
    if kind == "array":
        return _move_array(obj, target)
    if kind == "dataframe":
        if target == "device":
            require("cudf", "blockflow.to_device")
            require("dask_cudf", "blockflow.to_device")  # registers dask's "cudf" backend
            return obj.to_backend("cudf")
        return obj if _on_host(obj._meta) else obj.to_backend("pandas")
    # xarray: move every dask-backed variable (data and coordinates), keep the rest
    variables = list(obj.variables.values()) if hasattr(obj, "data_vars") else (
        [obj.variable, *(c.variable for c in obj.coords.values())])
    if not any(isinstance(v.data, da.Array) for v in variables):
        raise TypeError(
            f"Expected an xarray object backed by dask, got an in-memory "
            f"{describe(obj)}; chunk it first with obj.chunk(...)."
        )

    def move_var(v):
        if isinstance(v.data, da.Array):
            return v.copy(data=_move_array(v.data, target), deep=False)
        return v

    coords = {name: move_var(c.variable) for name, c in obj.coords.items()}
    if hasattr(obj, "data_vars"):  # Dataset
        data_vars = {name: move_var(v.variable) for name, v in obj.data_vars.items()}
        return type(obj)(data_vars, coords=coords, attrs=obj.attrs)
    return obj.copy(data=move_var(obj.variable).data, deep=False).assign_coords(coords)


def to_host(collection):
    """Move a Dask collection's blocks to host memory, lazily; the inverse of
    :func:`blockflow.to_device`. Raises ``TypeError`` for a non-Dask collection."""
    return _move(collection, "host")
