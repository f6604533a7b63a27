"""The flights ETL on three hosts against the same processes on one host.

Issue 28's multi-host target: the job on a cluster spread over three hosts (network
namespaces joined by veth pairs and a bridge, :mod:`blockflow.testing.netns`: a
``dask scheduler --preload blockflow.scheduling.preload`` on one, a ``dask worker`` on each
of two others) takes at most 1.2x as long as on the same processes on one host (the
scheduler's namespace), with identical tables. The same CPUs serve both layouts, so the
ratio measures what crossing hosts costs (TCP over veth and the bridge instead of the
loopback), not a speed-up.

Each round runs the job once on each layout, in alternating order, so load from other
processes hits both alike; before timing each cluster runs it once at scale 1 (its workers
read the table file once). The table gives medians over ``--repeat`` rounds of the job time
(:attr:`~blockflow.workloads.flights.FlightsResult.wall_time`), and checks the two layouts'
tables are identical (``check_exact``) in every round.

Needs root (network namespaces); ``--partitions-per-copy`` fixes the partitioning so both
layouts build the same graph.

    python benchmarks/multihost.py                     # scale 4, 5 rounds
    python benchmarks/multihost.py --scale 1 --repeat 1 --no-save   # smoke

The table goes to stdout and (with ``--save``, default on) to
``benchmarks/results/multihost-cpu-<date>.txt`` with the date and commit.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys

import pandas as pd

import blockflow
from blockflow.testing.netns import NamespaceCluster, netns_unavailable
from blockflow.workloads import flights

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(cluster: NamespaceCluster, scale: int, ppc: int):
    with cluster.client(timeout=60) as client:
        return flights.run(client, scale=scale, partitions_per_copy=ppc, progress=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5, help="rounds (medians)")
    parser.add_argument("--partitions-per-copy", type=int, default=2)
    parser.add_argument("--no-save", dest="save", action="store_false")
    args = parser.parse_args(argv)
    reason = netns_unavailable()
    if reason:
        print(f"multihost benchmark: {reason}", file=sys.stderr)
        return 2
    workers = {"w1": [], "w2": []}
    started = datetime.datetime.now(datetime.timezone.utc)
    times: dict[str, list[float]] = {"3 hosts": [], "1 host": []}
    notes = []
    with NamespaceCluster(workers, timeout=180) as multi, \
            NamespaceCluster(workers, timeout=180, one_host=True) as single:
        layouts = {"3 hosts": multi, "1 host": single}
        for cluster in layouts.values():
            _run(cluster, 1, args.partitions_per_copy)  # warm: workers read the table
        for r in range(args.repeat):
            order = list(layouts) if r % 2 == 0 else list(layouts)[::-1]
            results = {name: _run(layouts[name], args.scale, args.partitions_per_copy)
                       for name in order}
            for name, res in results.items():
                times[name].append(res.wall_time)
            a, b = results["3 hosts"], results["1 host"]
            for table in a.tables:
                pd.testing.assert_frame_equal(a.tables[table], b.tables[table],
                                              check_exact=True)
            line = (f"round {r + 1}: " + ", ".join(
                f"{n} {results[n].wall_time:.2f} s" for n in order) + " (tables identical)")
            notes.append(line)
            print(line, file=sys.stderr)
    rows = []
    base = statistics.median(times["1 host"])
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"layout": name, "job_s": f"{med:.2f}", "min_s": f"{min(ts):.2f}",
                     "max_s": f"{max(ts):.2f}", "vs_1_host": f"{med / base:.2f}x"})
    table = pd.DataFrame(rows).to_string(index=False)
    ratio = statistics.median(times["3 hosts"]) / base
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    rows_in = args.scale * 336_776
    text = "\n".join([
        f"# python benchmarks/multihost.py --scale {args.scale} --repeat {args.repeat} "
        f"--partitions-per-copy {args.partitions_per_copy}, {started:%Y-%m-%d %H:%M} UTC, "
        f"commit {commit}",
        f"# flights ETL, {rows_in:,} rows; 2 dask worker processes x 1 thread + dask scheduler "
        f"(--preload blockflow.scheduling.preload); 3 hosts: scheduler and each worker in a "
        f"network namespace of its own (veth + bridge); 1 host: all in one namespace",
        f"# medians of {args.repeat} rounds, layouts alternating; {os.cpu_count()} CPUs, load "
        f"average {os.getloadavg()[0]:.1f} at the end; blockflow {blockflow.__version__}",
        table,
        f"# target (issue 28): 3 hosts <= 1.2x 1 host: {ratio:.2f}x "
        f"{'met' if ratio <= 1.2 else 'NOT met'}; tables identical in every round",
        "# per round", *[f"# {n}" for n in notes]])
    print(text)
    if args.save:
        path = os.path.join(HERE, "results", f"multihost-cpu-{started:%Y-%m-%d}.txt")
        with open(path, "w") as f:
            f.write(text + "\n")
        print(f"saved {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
