"""Array statistics workload: per-grid-point moments of a generated temperature field.

Partials are merged with the pairwise update of Chan, Golub & LeVeque (1979, STAN-CS-79-773)
(:func:`blockflow.core.moments.merge_moments`), as dask's ``moment_*`` functions do."""

from __future__ import annotations

import functools
import logging
import math
import os
import platform
from dataclasses import dataclass
from typing import Any

import dask
import dask.array as da
import numpy as np
import pandas as pd
import xarray as xr
from dask.utils import format_bytes

import blockflow
from blockflow.core.moments import merge_moments
from blockflow.blockwise import map_blocks
from blockflow.io import write_parquet
from blockflow.reduction import tree_reduce
from blockflow.workloads._runner import Job, run_workload
from blockflow.workloads.field import (
    _STAT_ATTRS,
    SIZES,
    START_DATE,
    FieldSpec,
    _check_seed,
    _generate_block,
    _lat,
    _lon,
    _normalise_chunks,
    _spec,
    climatology,
)

__all__ = [
    "ArrayStatsResult",
    "FieldSpec",
    "SIZES",
    "STATS_DTYPE",
    "anomalies",
    "climatology",
    "generate_field",
    "moment_aggregate",
    "moment_chunk",
    "moment_combine",
    "moments",
    "run",
]

logger = logging.getLogger(__name__)

#: Record layout of the reduced result, one record per grid point (min/max in the data's dtype).
STATS_DTYPE = np.dtype(
    [("count", "i8"), ("mean", "f8"), ("var", "f8"), ("min", "f4"), ("max", "f4")]
)

def _generate_dask_block(*, seed, shape, block_id=None, block_info=None):
    location = block_info[None]["array-location"]
    return _generate_block(seed=seed, shape=shape, block_id=block_id, location=location)



def generate_field(size: str = "small", seed: int = 0) -> xr.DataArray:
    """The synthetic temperature field (float32, kelvin, ``(time, lat, lon)``), lazy; block ``(i,
    j, k)`` seeded ``[seed, i, j, k]``."""
    spec = _spec(size)
    seed = _check_seed(seed)
    # Full per-axis chunk tuples: with no input arrays, dask takes the shape from chunks=.
    data = da.map_blocks(
        _generate_dask_block,
        chunks=tuple(_normalise_chunks(spec)),
        dtype=np.float32,
        meta=np.empty((0, 0, 0), dtype=np.float32),
        token="blockflow-generate-field",
        seed=int(seed),
        shape=spec.shape,
    )
    nt, ny, nx = spec.shape
    coords = {
        "time": ("time", START_DATE + np.arange(nt).astype("timedelta64[D]"),
                 {"long_name": "time"}),
        "lat": ("lat", _lat(ny), {"units": "degrees_north", "standard_name": "latitude"}),
        "lon": ("lon", _lon(nx), {"units": "degrees_east", "standard_name": "longitude"}),
    }
    return xr.DataArray(
        data, dims=("time", "lat", "lon"), coords=coords, name="temperature",
        attrs={"units": "K", "long_name": "synthetic near-surface air temperature",
               "seed": int(seed)},
    )


def _anomaly_kernel(block: xr.DataArray, clim: xr.DataArray) -> xr.DataArray:
    """One block's anomaly: ``block - clim[dayofyear(time), lat]``, computed in float64 and
    stored as float32 (the data's dtype)."""
    doy = block["time"].dt.dayofyear
    seasonal = clim.sel(dayofyear=doy).drop_vars("dayofyear")
    diff = block.astype(np.float64) - seasonal
    out = diff.astype(np.float32).transpose(*block.dims)
    out.attrs = dict(block.attrs, long_name="temperature anomaly from the climatology")
    return out.rename("anomaly")



def anomalies(field: xr.DataArray, clim: xr.DataArray) -> xr.DataArray:
    """``field`` (dims ``(time, lat, lon)``) minus ``clim`` (dims ``(dayofyear, lat)``, from
    :func:`climatology`), lazy: ``anomaly``, float32, one ``blockflow-anomaly`` task per block."""
    clim = clim.chunk({"dayofyear": -1, "lat": field.chunksizes["lat"]})
    template = field.copy(data=field.data).rename("anomaly")
    return map_blocks(_anomaly_kernel, field, clim, template=template, name="anomaly")


# --- moments, with Chan et al.'s pairwise merge ------------------------------------------


def moment_chunk(x, axis=None, keepdims=True, computing_meta=False, **kwargs):
    """Partial moments of one block along ``axis`` (:func:`dask.array.reduction`'s ``chunk``):
    ``dict(n, mean, m2, min, max)``, ``n`` int64, ``mean`` and ``m2`` (sum of squared
    deviations) float64 with the reduced axes kept, ``min``/``max`` in ``x``'s dtype."""
    if computing_meta:
        return x
    axis = _axis_tuple(axis, x.ndim)
    n = np.int64(math.prod(x.shape[a] for a in axis))
    mean = x.mean(axis=axis, dtype=np.float64, keepdims=True)
    dev = x.astype(np.float64) - mean
    m2 = (dev * dev).sum(axis=axis, keepdims=True)
    return {
        "n": n,
        "mean": mean,
        "m2": m2,
        "min": x.min(axis=axis, keepdims=True),
        "max": x.max(axis=axis, keepdims=True),
    }


def _axis_tuple(axis, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, (int, np.integer)):
        return (int(axis) % ndim,)
    return tuple(int(a) % ndim for a in axis)


def _flatten(partials) -> list[dict]:
    """Nested lists of partials (one level per reduced axis) -> flat list."""
    if isinstance(partials, dict):
        return [partials]
    out: list[dict] = []
    for p in partials:
        out.extend(_flatten(p))
    return out


def _merge(partials) -> dict:
    """Partial moments merged with :func:`blockflow.core.moments.merge_moments`."""
    parts = _flatten(partials)
    if len(parts) == 1:
        return parts[0]
    mean = np.stack([p["mean"] for p in parts])
    n = np.array([p["n"] for p in parts], dtype=np.int64).reshape((-1,) + (1,) * (mean.ndim - 1))
    count, mean, m2 = merge_moments(n, mean, np.stack([p["m2"] for p in parts]),
                                    lambda a: a.sum(axis=0))
    return {
        "n": np.int64(count.reshape(-1)[0]),
        "mean": mean,
        "m2": m2,
        "min": np.minimum.reduce([p["min"] for p in parts]),
        "max": np.maximum.reduce([p["max"] for p in parts]),
    }


def moment_combine(partials, axis=None, keepdims=True, computing_meta=False, **kwargs):
    """Nested partials of :func:`moment_chunk` merged into one."""
    if computing_meta:  # dask passes the chunk's meta (an empty array) through
        return partials
    return _merge(partials)


def moment_aggregate(partials, axis=None, keepdims=False, computing_meta=False, **kwargs):
    """The merged partials as one :data:`STATS_DTYPE` record per point (variance ddof=0)."""
    if computing_meta:  # an empty array of the result's ndim and dtype
        shape = np.sum(partials, axis=axis, keepdims=keepdims).shape
        return np.empty(shape, dtype=STATS_DTYPE)
    m = _merge(partials)
    shape = np.shape(m["mean"])
    out = np.empty(shape, dtype=STATS_DTYPE)
    out["count"] = m["n"]
    out["mean"] = m["mean"]
    with np.errstate(invalid="ignore", divide="ignore"):
        out["var"] = m["m2"] / m["n"]
    out["min"] = m["min"]
    out["max"] = m["max"]
    if not keepdims:
        ax = _axis_tuple(axis, len(shape)) if shape else ()
        out = out.squeeze(axis=ax) if ax else out
    return out


def moments(anomaly: xr.DataArray, *, split_every: int | None = None) -> xr.Dataset:
    """Per-grid-point ``count``, ``mean``, ``var`` (ddof=0), ``min``, ``max`` of ``anomaly``
    along ``time``: one lazy tree reduction (:func:`blockflow.tree_reduce`, fan-in
    ``split_every``, default :func:`blockflow.choose_split_every`)."""
    rec = tree_reduce(
        anomaly, moment_chunk, moment_combine, moment_aggregate, dim="time",
        concatenate=False, dtype=STATS_DTYPE, split_every=split_every, name="moments",
        meta=np.empty((0,) * (anomaly.ndim - 1), dtype=STATS_DTYPE),
    )
    stats = xr.Dataset(
        {k: (rec.dims, rec.data[k], _STAT_ATTRS[k]) for k in STATS_DTYPE.names},
        coords=rec.coords,
        attrs={"method": "tree reduction of (n, mean, M2, min, max) partials, "
                         "Chan, Golub & LeVeque (1979) pairwise merge; var has ddof=0"},
    )
    return stats


# --- result ------------------------------------------------------------------------------


@dataclass
class ArrayStatsResult:
    """Outcome of one array-stats run.

    Attributes
    ----------
    stats : xarray.Dataset
        ``count``, ``mean``, ``var`` (ddof=0), ``min``, ``max`` over ``time``.
    size : str
    seed : int
    shape, chunks : tuple of int
    nbytes : int
    wall_time : float
        Seconds.
    bytes_per_second : float
    n_tasks : int or None
    task_counts : dict of str to int, or None
    dashboard_link, output : str or None
    """

    stats: xr.Dataset
    size: str
    seed: int
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    nbytes: int
    wall_time: float
    bytes_per_second: float
    n_tasks: int | None
    task_counts: dict[str, int] | None = None
    dashboard_link: str | None = None
    output: str | None = None

    def summary(self) -> pd.DataFrame:
        """One row per statistic: ``units``, ``grid_mean``, ``area_mean`` (weighted by
        cos(latitude)), ``grid_min``, ``grid_max``."""
        weights = np.cos(np.deg2rad(self.stats["lat"]))
        rows = {}
        for k in ("mean", "var", "min", "max"):
            v = self.stats[k].astype(np.float64)
            rows[k] = {
                "units": self.stats[k].attrs.get("units", ""),
                "grid_mean": float(v.mean()),
                "area_mean": float(v.weighted(weights).mean()),
                "grid_min": float(v.min()),
                "grid_max": float(v.max()),
            }
        table = pd.DataFrame.from_dict(rows, orient="index")
        table.index.name = "stat"
        return table

    def manifest(self) -> dict[str, Any]:
        """JSON-serialisable description of the run (what ``manifest.json`` holds)."""
        return {
            "workload": "array-stats",
            "size": self.size,
            "seed": self.seed,
            "shape": {"time": self.shape[0], "lat": self.shape[1], "lon": self.shape[2]},
            "chunks": {"time": self.chunks[0], "lat": self.chunks[1], "lon": self.chunks[2]},
            "dtype": "float32",
            "nbytes": self.nbytes,
            "wall_time_s": self.wall_time,
            "bytes_per_second": self.bytes_per_second,
            "n_tasks": self.n_tasks,
            "task_counts": self.task_counts,
            "dashboard_link": self.dashboard_link,
            "statistics": {k: dict(v) for k, v in _STAT_ATTRS.items()},
            "method": self.stats.attrs.get("method"),
            "files": {"stats": "stats.parquet"},
            "versions": {
                "blockflow": blockflow.__version__,
                "dask": dask.__version__,
                "xarray": xr.__version__,
                "numpy": np.__version__,
                "python": platform.python_version(),
            },
        }

    def __repr__(self) -> str:
        return (
            f"<ArrayStatsResult size={self.size!r} shape={self.shape} "
            f"{format_bytes(self.nbytes)} in {self.wall_time:.2f} s "
            f"({format_bytes(self.bytes_per_second)}/s), "
            f"{'n/a' if self.n_tasks is None else self.n_tasks} tasks>"
        )


# --- entry points ------------------------------------------------------------------------


def build(size: str = "small", seed: int = 0, *, split_every: int | None = None) -> xr.Dataset:
    """The whole workload as one lazy Dataset."""
    field = generate_field(size, seed)
    anom = anomalies(field, climatology(size))
    return moments(anom, split_every=split_every)


def run(
    client,
    *,
    size: str = "small",
    output: str | None = None,
    overwrite: bool = False,
    seed: int = 0,
    progress: bool | None = None,
    retries: int | None = None,
) -> ArrayStatsResult:
    """Run the array-stats workload on a cluster and return its statistics and timings.

    Parameters
    ----------
    client : distributed.Client
    size : {"small", "medium", "large"}, default "small"
        See :data:`SIZES`.
    output : str or path, optional
        Folder for ``stats.parquet`` and ``manifest.json``.
    overwrite : bool, default False
    seed : int, default 0
    progress : bool, optional
    retries : int, optional

    Returns
    -------
    ArrayStatsResult

    Raises
    ------
    ValueError
        Unknown ``size`` or bad ``retries``.
    FileExistsError
        If ``output`` exists and ``overwrite`` is False.
    WorkerLostError
        If every worker is lost, or workers die repeatedly under one task.
    """
    spec = _spec(size)
    seed = _check_seed(seed)
    return run_workload(
        client, f"array-stats ({size})",
        functools.partial(_compute, spec=spec, size=size, seed=seed), _write,
        name="array-stats", output=output, overwrite=overwrite, progress=progress,
        retries=retries,
    )


def _compute(job: Job, *, spec: FieldSpec, size: str, seed: int) -> ArrayStatsResult:
    stats_lazy = build(size, seed)
    job.start()
    stats = job.compute(stats_lazy, label=f"array-stats ({size}) generate, anomalies, moments")
    wall = job.stop()
    result = ArrayStatsResult(
        stats=stats, size=size, seed=int(seed), shape=spec.shape, chunks=spec.chunks,
        nbytes=spec.nbytes, wall_time=wall, bytes_per_second=spec.nbytes / wall,
        n_tasks=job.n_tasks, task_counts=job.task_counts, dashboard_link=job.dashboard_link,
    )
    logger.info("array-stats %s: %r", size, result)
    return result


def _write(result: ArrayStatsResult, directory) -> None:
    """``stats.parquet`` (index ``lat, lon``) into ``directory`` (the manifest lists it)."""
    write_parquet(result.stats.to_dataframe(), os.path.join(directory, "stats.parquet"))
