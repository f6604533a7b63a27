"""The synthetic temperature field of the array-stats workload, in plain NumPy: sizes, grid, block
generator and known climatology, shared by the workload and its oracle."""

from __future__ import annotations

from dataclasses import dataclass

import dask.array as da
import numpy as np
import xarray as xr

__all__ = ["FieldSpec", "SIZES", "START_DATE", "climatology"]

#: First day of the generated time axis (daily steps, proleptic Gregorian calendar).
START_DATE = np.datetime64("2001-01-01", "D")

_STAT_ATTRS = {
    "count": {"long_name": "number of time steps", "units": "1"},
    "mean": {"long_name": "time mean of the temperature anomaly", "units": "K"},
    "var": {
        "long_name": "population variance (ddof=0) of the temperature anomaly over time",
        "units": "K2",
        "ddof": 0,
    },
    "min": {"long_name": "minimum of the temperature anomaly over time", "units": "K"},
    "max": {"long_name": "maximum of the temperature anomaly over time", "units": "K"},
}


@dataclass(frozen=True)
class FieldSpec:
    """Shape and chunking ``(time, lat, lon)`` of one workload size."""

    shape: tuple[int, int, int]
    chunks: tuple[int, int, int]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole float32 field."""
        return int(np.prod(self.shape)) * 4

    @property
    def block_nbytes(self) -> int:
        """Bytes of one full float32 block."""
        return int(np.prod(self.chunks)) * 4


#: Workload sizes. ``small`` is for tests and NumPy checks (1 MB, 8 blocks chunked along
#: time and lat); ``medium`` is 249 MB in 8 blocks of 31 MB (120 days of a 1-degree grid);
#: ``large`` is 3.8 GB in 50 blocks of 76 MB (73 days of a 0.5-degree grid).
SIZES: dict[str, FieldSpec] = {
    "small": FieldSpec(shape=(120, 32, 64), chunks=(30, 16, 64)),
    "medium": FieldSpec(shape=(960, 180, 360), chunks=(120, 180, 360)),
    "large": FieldSpec(shape=(3650, 360, 720), chunks=(73, 360, 720)),
}


def _check_seed(seed) -> int:
    # numpy.random.SeedSequence takes non-negative ints only; fail here, not on the workers
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"array-stats: seed must be a non-negative int, got {seed!r}.")
    return int(seed)


def _spec(size: str) -> FieldSpec:
    try:
        return SIZES[size]
    except (KeyError, TypeError):
        raise ValueError(
            f"array-stats: unknown size {size!r}; choose one of {', '.join(SIZES)}."
        ) from None


# --- the synthetic field -----------------------------------------------------------------


def _lat(n: int) -> np.ndarray:
    """Cell-centre latitudes (degrees north) of a regular grid with ``n`` rows."""
    step = 180.0 / n
    return -90.0 + step * (np.arange(n) + 0.5)


def _lon(n: int) -> np.ndarray:
    """Cell-centre longitudes (degrees east, 0-360) of a regular grid with ``n`` columns."""
    step = 360.0 / n
    return step * (np.arange(n) + 0.5)


def _dayofyear(t: np.ndarray) -> np.ndarray:
    """Day of year (1-366) of time steps ``t`` (days since :data:`START_DATE`)."""
    dates = START_DATE + t.astype("timedelta64[D]")
    return (dates - dates.astype("datetime64[Y]")).astype(np.int64) + 1


def _seasonal_mean(dayofyear: np.ndarray, lat: np.ndarray) -> np.ndarray:
    """Climatological temperature (K): ``300 - 45 sin^2(lat)`` plus a seasonal cycle of amplitude
    ``15 sin(lat)``."""
    phi = np.deg2rad(lat)
    base = 300.0 - 45.0 * np.sin(phi) ** 2
    phase = 2.0 * np.pi * (np.asarray(dayofyear, dtype=np.float64) - 15.0) / 365.25
    return base - 15.0 * np.sin(phi) * np.cos(phase)[..., None]


def _zonal_wave(lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    """Stationary anomaly (K) ``2 cos(lat) cos(2 lon)``: the anomalies' expected time mean."""
    return 2.0 * np.cos(np.deg2rad(lat))[:, None] * np.cos(2 * np.deg2rad(lon))[None, :]


def _noise_std(lat: np.ndarray) -> np.ndarray:
    """Standard deviation (K) of the daily noise: ``1 + 2 |sin(lat)|`` (stormier poleward)."""
    return 1.0 + 2.0 * np.abs(np.sin(np.deg2rad(lat)))


def _generate_block(
    *, seed: int, shape: tuple[int, int, int], block_id: tuple[int, ...], location
) -> np.ndarray:
    """One float32 block, a pure function of ``(seed, block_id, location)`` (reproducible on any
    worker)."""
    (t0, t1), (y0, y1), (x0, x1) = location
    nt, ny, nx = shape
    lat = _lat(ny)[y0:y1]
    lon = _lon(nx)[x0:x1]
    doy = _dayofyear(np.arange(t0, t1))
    mean = _seasonal_mean(doy, lat)[:, :, None] + _zonal_wave(lat, lon)[None, :, :]
    rng = np.random.default_rng([seed, *block_id])
    noise = rng.standard_normal((t1 - t0, y1 - y0, x1 - x0), dtype=np.float32)
    noise *= _noise_std(lat).astype(np.float32)[None, :, None]
    out = mean.astype(np.float32)
    out += noise
    return out


def _normalise_chunks(spec: FieldSpec):
    return da.core.normalize_chunks(spec.chunks, spec.shape)


def climatology(size: str = "small") -> xr.DataArray:
    """The known climatology: mean temperature (float64, kelvin) per ``(dayofyear, lat)`` for
    ``size``, in memory."""
    spec = _spec(size)
    doy = np.arange(1, 367)
    lat = _lat(spec.shape[1])
    return xr.DataArray(
        _seasonal_mean(doy, lat), dims=("dayofyear", "lat"),
        coords={"dayofyear": doy,
                "lat": ("lat", lat, {"units": "degrees_north", "standard_name": "latitude"})},
        name="climatology",
        attrs={"units": "K", "long_name": "seasonal cycle per day of year and latitude"},
    )
