"""Array statistics workload: per-grid-point moments of a generated gridded field.

A seeded synthetic temperature field (dims ``time x lat x lon``, float32, kelvin) is
generated block by block on the workers, a known climatology (seasonal cycle per day of year
and latitude) is subtracted by a blockwise anomaly kernel (:func:`blockflow.map_blocks` on
xarray objects), and the anomalies are tree-reduced along ``time``
(:func:`blockflow.tree_reduce`) to their count, mean, variance, minimum and maximum at every
grid point, in one pass over the data.

The moments are merged with the pairwise update of Chan, Golub & LeVeque (1979), "Updating
formulae and a pairwise algorithm for computing sample variances" (Stanford CS report
STAN-CS-79-773): each partial result holds ``(n, mean, M2)`` where ``M2`` is the sum of
squared deviations from the partial's own mean, so no step subtracts two large, nearly equal
sums (the failure of the textbook ``E[x^2] - E[x]^2`` formula). The same scheme underlies
dask's ``moment_chunk`` / ``moment_combine`` / ``moment_agg``. The merge is
:func:`blockflow.core.moments.merge_moments`, shared with
:func:`blockflow.aggregations.grouped_moments`; the partials here are
``(n, mean, M2, min, max)``.
"""

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

#: Record layout of the reduced result: one record per grid point. float64 moments of
#: float32 data; min/max keep the data's dtype (they are exact).
STATS_DTYPE = np.dtype(
    [("count", "i8"), ("mean", "f8"), ("var", "f8"), ("min", "f4"), ("max", "f4")]
)

def _generate_dask_block(*, seed, shape, block_id=None, block_info=None):
    location = block_info[None]["array-location"]
    return _generate_block(seed=seed, shape=shape, block_id=block_id, location=location)



def generate_field(size: str = "small", seed: int = 0) -> xr.DataArray:
    """The synthetic temperature field as a lazy, dask-backed DataArray.

    Parameters
    ----------
    size : {"small", "medium", "large"}, default "small"
        See :data:`SIZES` for shapes and chunks.
    seed : int, default 0
        Seed of the noise; block ``(i, j, k)`` draws from
        ``numpy.random.default_rng([seed, i, j, k])``.

    Returns
    -------
    xarray.DataArray
        ``temperature``, float32, kelvin, dims ``(time, lat, lon)``, chunked as
        ``SIZES[size].chunks``. Coordinates: daily ``time`` from 2001-01-01, cell-centre
        ``lat`` (degrees north) and ``lon`` (degrees east). Blocks are generated on the
        workers (one ``blockflow-generate-field`` task each, no inputs); nothing large goes
        through the client.
    """
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
    """Subtract the climatology from every block of ``field`` (lazy, blockwise).

    Parameters
    ----------
    field : xarray.DataArray
        Dask-backed, dims ``(time, lat, lon)``, any chunking (see :func:`generate_field`).
    clim : xarray.DataArray
        Dims ``(dayofyear, lat)``, as from :func:`climatology`; chunked here along ``lat``
        like ``field`` so :func:`xarray.map_blocks` hands each block its rows.

    Returns
    -------
    xarray.DataArray
        ``anomaly``, float32, kelvin, same dims, coordinates and chunks as ``field``; one
        ``blockflow-anomaly`` task per block.
    """
    clim = clim.chunk({"dayofyear": -1, "lat": field.chunksizes["lat"]})
    template = field.copy(data=field.data).rename("anomaly")
    return map_blocks(_anomaly_kernel, field, clim, template=template, name="anomaly")


# --- moments, with Chan et al.'s pairwise merge ------------------------------------------


def moment_chunk(x, axis=None, keepdims=True, computing_meta=False, **kwargs):
    """Partial moments of one block along ``axis``: ``dict(n, mean, m2, min, max)``.

    Follows the ``chunk(x, axis=, keepdims=)`` convention of :func:`dask.array.reduction`.
    ``n`` is an int64 count (the block's extent along ``axis``); ``mean`` and ``m2`` (sum of
    squared deviations from ``mean``) are float64 with the reduced axes kept (length 1);
    ``min``/``max`` keep ``x``'s dtype. Two-pass within the block: mean first, then the
    squared deviations, which is exact to rounding for float32 data.
    """
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
    """Nested lists of partials (one nesting level per reduced axis, as
    :func:`dask.array.reduction` hands them over with ``concatenate=False``) -> flat list."""
    if isinstance(partials, dict):
        return [partials]
    out: list[dict] = []
    for p in partials:
        out.extend(_flatten(p))
    return out


def _merge(partials) -> dict:
    """Merge partial moments with :func:`blockflow.core.moments.merge_moments` (Chan, Golub &
    LeVeque 1979): the parts are stacked along a new first axis and summed along it; the
    count of a part is its block's extent, one number for all its points."""
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
    """Merge a nested list of partials from :func:`moment_chunk` into one partial.

    ``combine(partials, axis=, keepdims=)`` as in :func:`dask.array.reduction` with
    ``concatenate=False``; merged by :func:`_merge` (Chan et al. 1979).
    """
    if computing_meta:  # dask passes the chunk's meta (an empty array) through
        return partials
    return _merge(partials)


def moment_aggregate(partials, axis=None, keepdims=False, computing_meta=False, **kwargs):
    """Final step: merge the partials and return one :data:`STATS_DTYPE` record per point.

    The variance is the population variance, ``M2 / n`` (ddof=0). With ``keepdims=False``
    the reduced axes (length 1 in the partials) are dropped.
    """
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
    """Per-grid-point count, mean, variance (ddof=0), min and max along ``time`` (lazy).

    One tree reduction (:func:`blockflow.tree_reduce` with ``concatenate=False``) whose
    partials are ``(n, mean, M2, min, max)`` dicts merged by Chan et al. (1979); its result
    is one :data:`STATS_DTYPE` record per grid point, split into variables afterwards.

    Parameters
    ----------
    anomaly : xarray.DataArray
        Dask-backed, dims include ``time``; float32 (accumulated in float64).
    split_every : int, optional
        Fan-in of the tree; default: :func:`blockflow.choose_split_every`.

    Returns
    -------
    xarray.Dataset
        Variables ``count`` (int64), ``mean``, ``var`` (float64, K and K^2), ``min``,
        ``max`` (float32, K), dims = ``anomaly``'s other dims (``lat, lon``) with their
        coordinates, chunked like ``anomaly`` along them.
    """
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
        In memory: ``count``, ``mean``, ``var`` (ddof=0), ``min``, ``max`` of the anomaly over
        ``time``, dims ``(lat, lon)`` with coordinates.
    size : str
    seed : int
    shape, chunks : tuple of int
        Of the generated field (``time, lat, lon``), chunks as the block shape.
    nbytes : int
        Bytes of the float32 field processed (generated, anomalised and reduced).
    wall_time : float
        Seconds from submitting the graph to having the result on the client.
    bytes_per_second : float
        ``nbytes / wall_time``.
    n_tasks : int or None
        Tasks this run finished: the sum of ``task_counts`` (None without them).
    task_counts : dict of str to int, or None
        Tasks each worker finished for this run: everything it submitted, not other
        clients' work; the dashboard's "Tasks (this run)" shows the same counts (blockflow's
        scheduler plugin; None when the scheduler runs none).
    dashboard_link : str or None
    output : str or None
        Directory the results were written to, if any.
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
        """Global summary of each statistic: one row per statistic.

        Returns
        -------
        pandas.DataFrame
            Index ``stat`` (mean, var, min, max); columns ``units``, ``grid_mean``
            (unweighted mean over grid points), ``area_mean`` (weighted by cos(latitude),
            i.e. by cell area on a regular grid), ``grid_min``, ``grid_max``.
        """
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
    """The whole workload as one lazy Dataset (generate -> anomaly -> moments).

    Parameters
    ----------
    size : {"small", "medium", "large"}, default "small"
    seed : int, default 0
    split_every : int, optional
        Fan-in of the tree reduction; default chosen from worker memory.

    Returns
    -------
    xarray.Dataset
        Lazy statistics, as from :func:`moments`.
    """
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
        Connected client; the work runs on its cluster.
    size : {"small", "medium", "large"}, default "small"
        ``small``: 120 x 32 x 64 (1 MB); ``medium``: 960 x 180 x 360 (249 MB, blocks of
        120 days = 31 MB); ``large``: 3650 x 360 x 720 (3.8 GB, blocks of 73 days = 76 MB).
        All float32, chunked along time (see :data:`SIZES`).
    output : str or path, optional
        Directory to write ``stats.parquet`` (``stats.to_dataframe()``, index ``lat, lon``)
        and ``manifest.json`` to, atomically (:func:`blockflow.io.atomic_output_dir`).
    overwrite : bool, default False
        Replace ``output`` if it exists; otherwise an existing ``output`` is an error.
    seed : int, default 0
        Seed of the generated field.
    progress : bool, optional
        Show a labelled progress bar (``array-stats (small) generate, anomalies,
        moments``): a widget in Jupyter, a text bar on stderr in a terminal. Default: in
        Jupyter, or when stderr is a terminal.
    retries : int, optional
        Distributed task retries (default 0): a task of the run that raises is run again up
        to ``retries`` more times by the scheduler, possibly on another worker (passed to
        ``client.compute``). Not in-place kernel retries: see ``retries=`` of
        :func:`blockflow.map_blocks` for those.

    Returns
    -------
    ArrayStatsResult

    Raises
    ------
    ValueError
        For an unknown ``size``, or ``retries`` not an integer >= 0.
    FileExistsError
        If ``output`` exists and ``overwrite`` is False (raised by
        :func:`blockflow.io.atomic_output_dir`).
    WorkerLostError
        If every worker is lost for ``blockflow.cluster.worker-loss-timeout``, or workers
        die repeatedly under one task (``KilledWorker``). Nothing is written.
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
