"""Chunked array pipeline: xarray field -> blockwise anomaly -> tree reductions -> Parquet.

A gridded daily temperature field (``time x lat x lon``, float32, chunked along time) is
turned into per-grid-point statistics:

1. the field and its climatology come from :mod:`blockflow.workloads.array_stats` (a seeded
   synthetic field generated block by block on the workers; replace :func:`load_field` with
   ``xarray.open_zarr(...)`` or ``xarray.open_mfdataset(..., chunks=...)`` for real data);
2. ``blockflow.map_blocks`` subtracts the climatology from every block (xarray blocks, with
   their coordinates);
3. ``blockflow.tree_reduce(..., dim="time")`` reduces along time: the one-pass moments of
   ``array_stats.moments`` (count, mean, variance, min, max; Chan et al.'s pairwise merge) and
   this script's own reduction, the number of days above ``--threshold`` kelvin;
4. two tables are written atomically with :mod:`blockflow.io`: ``grid.parquet`` (one row per
   grid point) and ``zonal.parquet`` (means over longitude, one row per latitude), plus
   ``manifest.json``.

Examples::

    python examples/array_pipeline.py --output stats-out                  # embedded cluster
    python examples/array_pipeline.py --output stats-out --size medium --threshold 4
    python examples/array_pipeline.py --address tcp://scheduler:8786 --output stats-out
"""

from __future__ import annotations

import time
from functools import partial

import click
import dask
import numpy as np
import pandas as pd
import xarray as xr

import blockflow
from blockflow.io import check_output_dir, write_outputs
from blockflow.workloads import array_stats


def load_field(size: str, seed: int) -> tuple[xr.DataArray, xr.DataArray]:
    """The lazy field (dims ``time, lat, lon``) and its climatology (``dayofyear, lat``)."""
    return array_stats.generate_field(size, seed), array_stats.climatology(size)


def anomaly(block: xr.DataArray, clim: xr.DataArray) -> xr.DataArray:
    """Kernel: one block minus the climatology of its days of year and latitudes (float32)."""
    seasonal = clim.sel(dayofyear=block["time"].dt.dayofyear).drop_vars("dayofyear")
    return (block - seasonal).astype(np.float32).transpose(*block.dims).rename("anomaly")


def count_above(block, axis=None, keepdims=False, threshold=0.0):
    """Tree-reduction chunk: values above ``threshold`` along ``axis`` (int64 counts)."""
    return (block > threshold).sum(axis=axis, keepdims=keepdims, dtype=np.int64)


def build(field: xr.DataArray, clim: xr.DataArray, threshold: float,
          split_every: int | None) -> tuple[xr.Dataset, xr.DataArray]:
    """The lazy statistics per grid point: the moments, and the days above ``threshold``."""
    # Chunk the climatology along lat like the field, so each block gets its own rows.
    clim = clim.chunk({"dayofyear": -1, "lat": field.chunksizes["lat"]})
    template = field.rename("anomaly").assign_attrs(long_name="temperature anomaly")
    anom = blockflow.map_blocks(anomaly, field, clim, template=template)

    stats = array_stats.moments(anom, split_every=split_every)
    days_above = blockflow.tree_reduce(
        anom, partial(count_above, threshold=threshold), np.sum, dim="time",
        dtype=np.int64, split_every=split_every, name="days-above")
    return stats, days_above


@click.command(help=__doc__.split("\n\n")[0],
               context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--output", required=True, type=click.Path(file_okay=False),
              help="Folder to write grid.parquet, zonal.parquet and manifest.json to.")
@click.option("--overwrite", is_flag=True, help="Replace --output if it exists.")
@click.option("--address", default=None,
              help="Scheduler address (tcp://host:8786); default: start an embedded cluster.")
@click.option("--size", type=click.Choice(list(array_stats.SIZES)), default="small",
              show_default=True, help="Field size (small: 1 MB, medium: 249 MB, large: 3.8 GB).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--threshold", type=float, default=3.0, show_default=True,
              help="Count the days whose anomaly is above this many kelvin.")
@click.option("--split-every", type=click.IntRange(min=2), default=None,
              help="Fan-in of the tree reductions; default sized from worker memory.")
@click.option("--n-workers", type=click.IntRange(min=1), default=None,
              help="Embedded cluster: number of workers.")
@click.option("--threads-per-worker", type=click.IntRange(min=1), default=None,
              help="Embedded cluster: threads per worker.")
@click.option("--dashboard-address", default=None,
              help="Embedded cluster: dashboard address (default 127.0.0.1:8787; ':0' for "
                   "any free port).")
def main(output, overwrite, address, size, seed, threshold, split_every, n_workers,
         threads_per_worker, dashboard_address):
    try:
        target = check_output_dir(output, overwrite)  # fail before any work
    except FileExistsError as e:
        raise click.ClickException(str(e)) from None
    if address is not None:
        if n_workers is not None or threads_per_worker is not None or dashboard_address:
            raise click.UsageError("--n-workers, --threads-per-worker and --dashboard-address "
                                   "configure the embedded cluster; drop them with --address.")
        try:
            client = blockflow.connect(address)
        except OSError as e:  # unreachable scheduler: the message says what to check
            raise click.ClickException(str(e)) from None
    else:
        client = blockflow.connect(n_workers=n_workers, threads_per_worker=threads_per_worker,
                                   dashboard_address=dashboard_address)
    try:
        print(f"Dashboard: {client.dashboard_link}")
        field, clim = load_field(size, seed)
        start = time.perf_counter()
        # Computed together, they share the generator and anomaly tasks. (Kept as separate
        # collections: Dataset.compute() refuses a Dataset mixing tree-reduced and ordinary
        # dask arrays.)
        stats, days_above = dask.compute(*build(field, clim, threshold, split_every))
        wall = time.perf_counter() - start
    finally:
        if address is None:
            client.shutdown()  # our embedded cluster
        else:
            client.close()  # someone else's cluster: leave it running

    stats = stats.assign(std=np.sqrt(stats["var"]), days_above=days_above)  # in memory now
    columns = ["count", "mean", "std", "var", "min", "max", "days_above"]
    grid = stats[columns].to_dataframe().reset_index()
    zonal = (grid.groupby("lat", sort=True)[["mean", "std", "min", "max", "days_above"]]
             .mean().reset_index())
    manifest = {
        "workload": "examples/array_pipeline.py",
        "size": size, "seed": seed, "threshold_k": threshold,
        "shape": dict(field.sizes),
        "chunks": {d: max(c) for d, c in field.chunksizes.items()},
        "nbytes": int(field.nbytes),
        "wall_time_s": wall,
        "statistics": "per grid point over time: count, mean, std and var (ddof=0), min, max "
                      "(K, K^2) of the anomaly; days_above: days with anomaly > threshold_k",
        "versions": {"blockflow": blockflow.__version__, "dask": dask.__version__,
                     "xarray": xr.__version__, "numpy": np.__version__},
    }
    write_outputs(target, {"grid": grid, "zonal": zonal}, manifest, overwrite=overwrite)

    print(f"{field.nbytes / 1e6:.1f} MB field {dict(field.sizes)} in {wall:.2f} s")
    with pd.option_context("display.width", 120):
        print(zonal.round(2).to_string(index=False, max_rows=12))
    print(f"Wrote grid.parquet ({len(grid)} rows), zonal.parquet ({len(zonal)} rows) and "
          f"manifest.json to {target}")


if __name__ == "__main__":
    main()
