"""Straggler benchmark: workloads where a few tasks dominate a stage, plain Dask vs blockflow.

One function per workload; each returns table rows, and ``main`` prints one table. Every
workload runs its configurations side by side on one cluster, paired repetition by
repetition (the order reversed on odd repetitions), and reports the median makespan
(min-max) and the paired ratio to its reference.

Workloads (``--workloads``, comma-separated):

* ``zipf-skew`` -- a dataframe of ``--partitions`` (64) partitions whose lengths follow a
  Zipf law (exponent ``--exponent``, 1.2; shuffled with a fixed seed), persisted on
  ``--workers`` (8) workers x 1 thread, then one blockwise kernel whose time is proportional
  to its partition's rows (``--seconds-per-row``; a sleep, so the 2-core machine is not the
  bottleneck). Configurations: ``balanced`` (plain Dask on 64 equal partitions with the same
  total rows: the reference), ``plain`` (``map_partitions`` on the skewed partitions),
  ``blockflow`` (``blockflow.map_blocks``: skewed partitions are split before the stage, sized
  by the bytes the scheduler holds for them, their pieces cut where they are and spread over
  the workers; all of that is inside the timed span) and ``blockflow-balanced``
  (``blockflow.map_blocks`` on the balanced partitions: nothing to split). The data is scaled
  down (tens of MB), so the skew floor (``blockflow.skew.floor``, 64 MiB by default) is set
  to 0 for this run: each row stands for a row of a far larger table, as its kernel time
  says. Target (issue 14): blockflow's makespan <= 1.2x the balanced run.

    python benchmarks/stragglers.py > table.txt
    python benchmarks/stragglers.py --quick      # smoke test (~30 s)

About 2 minutes on a loaded 2-core machine with the defaults (3 repetitions, 38 s of kernel
work per configuration on 8 workers: 4.8 s ideal).

Per-run lines go to stderr, the table to stdout. Workers are processes, as in production
(``--in-process``: threads of this process, whose scheduler, workers and client then share
one interpreter lock, which inflates the per-task overhead that splitting adds).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
from distributed import Client, LocalCluster, wait

import blockflow

WORKLOADS = ("zipf-skew",)


def zipf_lengths(partitions: int, exponent: float, total_rows: int, seed: int = 14
                 ) -> list[int]:
    """Partition lengths proportional to ``1 / k**exponent`` (k = 1..partitions), summing
    to ``total_rows`` (largest remainders), in a shuffled order."""
    weights = 1.0 / np.arange(1, partitions + 1) ** exponent
    exact = weights / weights.sum() * total_rows
    rows = np.floor(exact).astype(int)
    rows[np.argsort(exact - rows)[::-1][: total_rows - rows.sum()]] += 1
    np.random.default_rng(seed).shuffle(rows)
    return [int(r) for r in rows]


def _make_partition(start: int, rows: int) -> pd.DataFrame:
    idx = np.arange(start, start + rows)
    return pd.DataFrame({"key": idx % 97, "value": idx * 0.5}, index=idx)


def _frame(lengths: list[int]) -> dd.DataFrame:
    starts = np.cumsum([0] + lengths[:-1])
    parts = [dask.delayed(_make_partition)(int(s), n) for s, n in zip(starts, lengths)]
    meta = _make_partition(0, 0)
    return dd.from_delayed(parts, meta=meta, verify_meta=False)


def _row_kernel(part: pd.DataFrame, seconds_per_row: float = 0.0, run: int = 0
                ) -> pd.DataFrame:
    """A blockwise kernel whose time is proportional to the partition's rows (``run`` only
    makes each run's task keys new, so no run finds another's results in memory)."""
    time.sleep(len(part) * seconds_per_row)
    return part.assign(scaled=part["value"] * 2)


def _timed(build, run: int) -> float:
    t0 = time.perf_counter()
    out = build(run).persist()
    wait(out)
    elapsed = time.perf_counter() - t0
    del out
    time.sleep(1)  # let the scheduler release the results before the next run
    return elapsed


def zipf_skew(client: Client, args) -> list[dict]:
    """Zipf-skewed partitions vs balanced ones with the same rows (see the module doc)."""
    total = args.partitions * args.rows_per_partition
    skewed_lengths = zipf_lengths(args.partitions, args.exponent, total)
    balanced_lengths = [args.rows_per_partition] * args.partitions
    skewed = _frame(skewed_lengths).persist()
    balanced = _frame(balanced_lengths).persist()
    wait([skewed, balanced])
    spr = args.seconds_per_row
    med = statistics.median(skewed_lengths)
    print(f"zipf-skew: {args.partitions} partitions, exponent {args.exponent}, {total:,} rows; "
          f"largest {max(skewed_lengths):,} rows ({max(skewed_lengths) / med:.0f}x the median "
          f"{med:,.0f}); {spr * 1e6:g} us per row: {total * spr:.1f} s of work on "
          f"{args.workers} workers", file=sys.stderr)

    configs = {
        "balanced": lambda run: balanced.map_partitions(_row_kernel, seconds_per_row=spr,
                                                        run=run),
        "plain": lambda run: skewed.map_partitions(_row_kernel, seconds_per_row=spr, run=run),
        "blockflow": lambda run: blockflow.map_blocks(_row_kernel, skewed, seconds_per_row=spr,
                                                      run=run, name="row-kernel"),
        "blockflow-balanced": lambda run: blockflow.map_blocks(
            _row_kernel, balanced, seconds_per_row=spr, run=run, name="row-kernel"),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    with dask.config.set({"blockflow.skew.floor": 0}):
        for rep in range(args.repeat):
            order = list(configs) if rep % 2 == 0 else list(configs)[::-1]
            for name in order:
                before = len(blockflow.decompose.recorded_resizes())
                times[name].append(_timed(configs[name], run=rep))
                changes = blockflow.decompose.recorded_resizes()[before:]
                note = "; ".join(c.summary() for c in changes) or "blocks unchanged"
                print(f"  rep {rep} {name}: {times[name][-1]:.2f} s ({note})",
                      file=sys.stderr)
    ideal = total * spr / args.workers
    rows = []
    for name, ts in times.items():
        paired = [t / b for t, b in zip(ts, times["balanced"])]
        plain = [t / p for t, p in zip(ts, times["plain"])]
        rows.append({
            "workload": "zipf-skew", "config": name,
            "makespan": f"{statistics.median(ts):.2f} ({min(ts):.2f}-{max(ts):.2f})",
            "x ideal": f"{statistics.median(ts) / ideal:.2f}",
            "x balanced": f"{statistics.median(paired):.2f} ({min(paired):.2f}-"
                          f"{max(paired):.2f})",
            "x plain": f"{statistics.median(plain):.2f}",
        })
    ratio = statistics.median(t / b for t, b in zip(times["blockflow"], times["balanced"]))
    rows.append({"workload": "zipf-skew", "config": "target",
                 "makespan": f"blockflow <= 1.2x balanced: {'met' if ratio <= 1.2 else 'NOT met'}"
                             f" ({ratio:.2f}x)",
                 "x ideal": "", "x balanced": "", "x plain": ""})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="all",
                        help=f"comma-separated: {', '.join(WORKLOADS)} or all")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--partitions", type=int, default=64)
    parser.add_argument("--exponent", type=float, default=1.2)
    parser.add_argument("--rows-per-partition", type=int, default=10_000)
    parser.add_argument("--seconds-per-row", type=float, default=60e-6)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--in-process", action="store_true",
                        help="workers as threads of this process (starts faster; the "
                             "scheduler, workers and client then share one interpreter lock)")
    parser.add_argument("--quick", action="store_true",
                        help="one repetition, a quarter of the work per row")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeat, args.seconds_per_row = 1, args.seconds_per_row / 4
    chosen = WORKLOADS if args.workloads == "all" else tuple(args.workloads.split(","))
    unknown = [w for w in chosen if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    logging.getLogger("blockflow.decompose").setLevel(logging.WARNING)
    rows = []
    with LocalCluster(n_workers=args.workers, threads_per_worker=1,
                      processes=not args.in_process, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        for name in chosen:
            rows += {"zipf-skew": zipf_skew}[name](client, args)
    print(pd.DataFrame(rows).to_string(index=False))


if __name__ == "__main__":
    main()
