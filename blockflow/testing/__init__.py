"""Public helpers for tests: compare results across backends (:func:`assert_eq`), simulated GPU
workers and clusters, a local Slurm and network-namespace hosts. Production modules of blockflow
never import this package."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from blockflow.testing.cluster import install_simulated_devices, simulated_cluster
from blockflow.testing.netns import NamespaceCluster, NamespaceNetwork, netns_unavailable
from blockflow.testing.slurm import LocalSlurm, SlurmUnavailable, local_slurm
from blockflow.testing.simulated import (
    PLUGIN_NAME,
    SimulatedGPU,
    device_scale,
    device_stats,
    get_device,
    restart_clock,
    set_speed,
    set_tenant,
    simulated_kernel,
    slowed_to_device_speed,
)
from blockflow.testing.simulated_device import (
    SimulatedDevice,
    SimulatedDeviceBlock,
    SimulatedOutOfMemoryError,
    Tenant,
)

__all__ = [
    "NamespaceCluster",
    "NamespaceNetwork",
    "LocalSlurm",
    "PLUGIN_NAME",
    "SimulatedDevice",
    "SimulatedDeviceBlock",
    "SimulatedGPU",
    "SimulatedOutOfMemoryError",
    "SlurmUnavailable",
    "Tenant",
    "as_host",
    "assert_eq",
    "device_scale",
    "device_stats",
    "get_device",
    "install_simulated_devices",
    "netns_unavailable",
    "local_slurm",
    "restart_clock",
    "set_speed",
    "set_tenant",
    "simulated_cluster",
    "simulated_kernel",
    "slowed_to_device_speed",
]


def as_host(obj: Any) -> Any:
    """``obj`` as a host object (CuPy -> NumPy, cuDF -> pandas, Dask -> computed, device block ->
    payload), without importing GPU packages."""
    if hasattr(obj, "__dask_graph__") and obj.__dask_graph__() is not None:
        obj = obj.compute()
    if isinstance(obj, SimulatedDeviceBlock):
        return as_host(obj.payload)
    mod = type(obj).__module__.split(".")[0]
    if mod == "cupy":
        return obj.get()
    if mod == "cudf":
        return obj.to_pandas()
    return obj


def _lazy_array_meta(obj: Any) -> tuple | None:
    import dask.array as da

    if isinstance(obj, da.Array):
        return obj.shape, obj.dtype
    return None


def assert_eq(a: Any, b: Any, *, rtol: float = 1e-7, atol: float = 0.0,
              check_dtype: bool = True, check_index: bool = True) -> None:
    """Assert that two results are equal, whichever backend and device they are on.

    Parameters
    ----------
    a, b : array, frame, series, index, scalar, Dask collection or SimulatedDeviceBlock
        Dask collections are computed (a Dask array's shape and dtype checked against its meta).
    rtol, atol : float, default 1e-7 and 0
        As in :func:`numpy.testing.assert_allclose`.
    check_dtype : bool, default True
    check_index : bool, default True
        For frames and series (else the index is reset first).

    Raises
    ------
    AssertionError
        If values, shapes, dtypes or types differ.
    """
    metas = (_lazy_array_meta(a), _lazy_array_meta(b))
    a, b = as_host(a), as_host(b)
    for meta, value, side in zip(metas, (a, b), "ab"):
        if meta is not None:
            shape, dtype = meta
            if not any(s != s for s in shape) and np.shape(value) != shape:
                raise AssertionError(f"assert_eq: {side} computed to shape {np.shape(value)}, "
                                     f"but its Dask metadata says {shape}.")
            if check_dtype and getattr(value, "dtype", dtype) != dtype:
                raise AssertionError(f"assert_eq: {side} computed to dtype {value.dtype}, "
                                     f"but its Dask metadata says {dtype}.")

    frames = (pd.DataFrame, pd.Series, pd.Index)
    if isinstance(a, frames) or isinstance(b, frames):
        if type(a) is not type(b):
            raise AssertionError(f"assert_eq: {type(a).__name__} vs {type(b).__name__}.")
        if isinstance(a, pd.Index):
            pd.testing.assert_index_equal(a, b, exact=check_dtype, rtol=rtol, atol=atol)
            return
        if not check_index:
            a, b = a.reset_index(drop=True), b.reset_index(drop=True)
        check = (pd.testing.assert_frame_equal if isinstance(a, pd.DataFrame)
                 else pd.testing.assert_series_equal)
        check(a, b, check_dtype=check_dtype, rtol=rtol, atol=atol)
        return

    x, y = np.asarray(a), np.asarray(b)
    if x.shape != y.shape:
        raise AssertionError(f"assert_eq: shapes differ: {x.shape} vs {y.shape}.")
    if check_dtype and x.dtype != y.dtype:
        raise AssertionError(f"assert_eq: dtypes differ: {x.dtype} vs {y.dtype}.")
    if np.issubdtype(x.dtype, np.inexact) or np.issubdtype(y.dtype, np.inexact):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
    else:
        np.testing.assert_array_equal(x, y)
