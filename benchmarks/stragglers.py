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

* ``shuffle-skew`` -- the skew comes out of a shuffle: ``--partitions`` partitions of rows
  whose key follows a Zipf law (exponent ``--exponent`` over 16 keys per partition),
  ``shuffle(on="key")`` and persisted, so the partition sizes are known only once the
  shuffle ran; then the same row kernel. Configurations: ``balanced`` (plain Dask on the
  same rows in even partitions: the reference), ``plain`` and ``blockflow`` on the shuffled
  partitions. Target (issue 39): blockflow <= 1.3x the balanced run.

* ``slowdown`` -- 4 simulated devices (speed 1, 1 thread each; ``--spec-blocks`` blocks of
  ``--spec-work`` reference-seconds); device 0 slows to a fifth of its speed half-way through
  the ideal makespan (a speed schedule). Configurations: ``blockflow-no-slowdown`` (the
  reference: the same run without the slowdown), ``plain`` (plain Dask), ``blockflow-no-
  backups`` (the dynamic policy, ``blockflow.speculation.enabled: false``), ``blockflow``
  (with backup copies). Target (issue 14): <= 1.15x the run without the slowdown, with <= 5 %
  of the work duplicated. The row ``whole-block floor`` is the best any scheduler can do
  with whole blocks (:func:`whole_block_floor`; the fluid bound, work over capacity, is
  1.125x): with 60 blocks of 0.2 s (the default) it is 1.13x; with 48 blocks of 0.25 s it
  is 1.16x, above the target, because device 0's last slowed block or one extra block on a
  fast device cannot be shared.
* ``slow-from-start`` -- device 0 runs at a tenth of the others' speed from the start, half
  as many blocks of twice the work; the bound is the fast devices alone (total work / 3).
  Target: <= 1.35x that bound.
* ``identical`` -- 4 identical devices, nothing straggles: backups must cost nothing
  (>= 5 paired repetitions; reference ``blockflow-no-backups``).
* ``brief-pause`` -- 4 identical devices, ``--pause-blocks`` (240) blocks of
  ``--pause-work`` (0.05) reference-seconds; another tenant holds device 0 for the first
  ``--pause-seconds`` (0.6) of the stage (a thread of that worker's process holds the device
  lock every kernel of it takes first: its first kernels really wait). Target (issue 27):
  blockflow <= 1.00x plain (median of >= 5 paired repetitions) and device 0's share of the
  blocks within 10 % of its fair share (the blocks it runs if the stage ends together on
  all devices: ``((blocks x work + lost) / 4 - lost) / work``, ``lost`` the device time the
  tenant took: half the pause with ``--pause-kind tenant``, the default, where the tenant
  time-slices the device and its kernels run at half speed; all of it with ``lock``, where
  the tenant holds the device and its kernels wait); moves per run are counted.
* ``coarse-slow`` -- coarse jobs: 32 blocks (~8 per device), device 0 10x slower from the
  start, cold (no warm-up stage) and warm; the worst of ``--worst-of`` (5) runs against
  the fast devices' bound. Target (issue 27): worst <= 1.25x.
* ``uneven`` -- 4 identical devices, 32 persisted blocks, the last with 8x the elements
  and work of the others: long for its size, not a straggler. Target (issue 27): work done
  twice <= 5 % in every run.
* ``large-inputs`` -- 4 devices, ``--spec-blocks`` blocks each reading a ``--large-mib``
  (32) MiB input persisted where Dask put it, device 0 slowed to half its speed half-way:
  a copy or a move costs more in sending the input than it gains. Target (issue 39):
  blockflow <= plain Dask, no backup copy.
* ``gpu-fanout`` -- dask/distributed#8177: two workers with ``GPU=1`` each, a tiny root, four
  1 s dependents needing ``GPU=1`` (threads of this process); the split of the dependents
  over the two workers per run. Target (issue 39): 2 + 2 in every run (2 s).

Each straggler run starts a fresh cluster and runs a short warm-up stage first (durations
measured, as in any pipeline past its first stage); "duplicated" is the seconds of work
done twice (both copies running) over the stage's total work.

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
import math
import statistics
import sys
import time
from collections import Counter

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
from distributed import Client, LocalCluster, wait

import blockflow

WORKLOADS = ("zipf-skew", "shuffle-skew", "slowdown", "slow-from-start", "identical", "brief-pause",
             "coarse-slow", "uneven", "large-inputs", "gpu-fanout")


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


def shuffle_skew(client: Client, args) -> list[dict]:
    """Partitions skewed by a shuffle on a Zipf-distributed key vs the same rows balanced."""
    total, keys = args.partitions * args.rows_per_partition, 16 * args.partitions
    weights = 1.0 / np.arange(1, keys + 1) ** args.exponent
    key = np.random.default_rng(14).choice(keys, size=total, p=weights / weights.sum())
    pdf = pd.DataFrame({"key": key, "value": np.arange(total) * 0.5})
    balanced = dd.from_pandas(pdf, npartitions=args.partitions, sort=False).persist()
    skewed = dd.from_pandas(pdf, npartitions=args.partitions, sort=False).shuffle(
        on="key", npartitions=args.partitions).persist()
    wait([skewed, balanced])
    lengths = skewed.map_partitions(len).compute().tolist()
    spr = args.seconds_per_row
    print(f"shuffle-skew: {args.partitions} partitions, exponent {args.exponent}, {total:,} "
          f"rows; after the shuffle the largest holds {max(lengths):,} rows (an even one "
          f"{total // args.partitions:,}); {total * spr:.1f} s of work on {args.workers} "
          f"workers", file=sys.stderr)
    configs = {
        "balanced": lambda run: balanced.map_partitions(_row_kernel, seconds_per_row=spr,
                                                        run=run),
        "plain": lambda run: skewed.map_partitions(_row_kernel, seconds_per_row=spr, run=run),
        "blockflow": lambda run: blockflow.map_blocks(_row_kernel, skewed, seconds_per_row=spr,
                                                      run=run, name="row-kernel"),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    with dask.config.set({"blockflow.skew.floor": 0}):  # scaled-down data (see zipf-skew)
        for rep in range(args.repeat):
            for name in (list(configs) if rep % 2 == 0 else list(configs)[::-1]):
                times[name].append(_timed(configs[name], run=rep))
                print(f"  rep {rep} {name}: {times[name][-1]:.2f} s", file=sys.stderr)
    rows = []
    for name, ts in times.items():
        paired = [t / b for t, b in zip(ts, times["balanced"])]
        rows.append({"workload": "shuffle-skew", "config": name,
                     "makespan": f"{statistics.median(ts):.2f} ({min(ts):.2f}-{max(ts):.2f})",
                     "x ideal": f"{statistics.median(ts) / (total * spr / args.workers):.2f}",
                     "x balanced": f"{statistics.median(paired):.2f} ({min(paired):.2f}-"
                                   f"{max(paired):.2f})",
                     "x plain": f"{statistics.median(t / p for t, p in zip(ts, times['plain'])):.2f}"})
    ratio = statistics.median(t / b for t, b in zip(times["blockflow"], times["balanced"]))
    rows.append({"workload": "shuffle-skew", "config": "target",
                 "makespan": f"blockflow <= 1.3x balanced: {'met' if ratio <= 1.3 else 'NOT met'}"
                             f" ({ratio:.2f}x)", "x ideal": "", "x balanced": "", "x plain": ""})
    return rows


# --- stragglers: speculative backup copies -------------------------------------------------

SPEC_CONFIGS = ("plain", "blockflow-no-backups", "blockflow")


def _spec_kernel(block, block_id=None, work=0.25):
    from blockflow.testing import simulated_kernel

    return np.array([simulated_kernel(block, op=np.sum, work=work)], dtype=object)


def _sized_kernel(block, block_id=None, work=0.25, unit=1000):
    """Work proportional to the block's length: ``work`` reference-seconds per ``unit``
    elements (a block of 8x the elements takes 8x as long)."""
    from blockflow.testing import simulated_kernel

    return np.array([simulated_kernel(block, op=np.sum, work=work * len(block) / unit)],
                    dtype=object)


def _spec_cell(config: str, args, *, blocks: int, work: float, speeds, schedules=None,
               run: int = 0, warm: bool = True, sizes=None, nbytes: int = 0) -> dict:
    """One fresh cluster of simulated devices (speeds, speed schedules), one configuration:
    a warm-up stage (so durations are measured, as in any pipeline past its first stage;
    ``warm=False``: none, the stage starts cold), then ``blocks`` kernels of ``work``
    reference-seconds; makespan and backup copies. ``sizes``: the blocks' lengths in
    thousands of elements, persisted on the workers first (real inputs, whose bytes the
    scheduler knows), each kernel's work proportional to its block's length. ``nbytes``: each
    block's input is ``nbytes`` bytes persisted on the workers first (the kernel's work fixed:
    inputs large next to their compute)."""
    from blockflow.scheduling import Rebalancer
    from blockflow.testing import restart_clock, simulated_cluster

    settings = {"blockflow.speculation.enabled": config == "blockflow"}
    with dask.config.set(settings), simulated_cluster(
            speeds=speeds, speed_schedules=schedules, processes=not args.in_process,
            silence_logs=logging.CRITICAL) as client:
        if config != "plain":
            client.register_plugin(Rebalancer(policy="dynamic"))
        if warm:
            blockflow.map_blocks(_spec_kernel, da.ones(2 * len(speeds), chunks=1),
                                 dtype=object, name=f"warm-{run}", work=work / 4).compute()
        if nbytes:
            n = nbytes // 8
            x = da.arange(blocks * n, chunks=n, dtype=float).persist()
            wait(x)
            y = blockflow.map_blocks(_spec_kernel, x, dtype=object, name=f"spec-{run}",
                                     chunks=((1,) * blocks,), work=work)
            expect = sorted(int(np.arange(i * n, (i + 1) * n, dtype=float).sum())
                            for i in range(blocks))
        elif sizes is None:
            x = da.arange(blocks, chunks=1)
            y = blockflow.map_blocks(_spec_kernel, x, dtype=object, name=f"spec-{run}",
                                     work=work)
            expect = list(range(blocks))
        else:
            # real bytes (da.ones' blocks are broadcast views of 8 bytes)
            x = da.arange(1000 * sum(sizes), chunks=(tuple(1000 * n for n in sizes),),
                          dtype=float)
            x = x.persist()
            wait(x)
            y = blockflow.map_blocks(_sized_kernel, x, dtype=object, name=f"spec-{run}",
                                     chunks=((1,) * len(sizes),), work=work)
            bounds = np.cumsum([0] + [1000 * n for n in sizes])
            expect = sorted(int(np.arange(a, b, dtype=float).sum())
                            for a, b in zip(bounds[:-1], bounds[1:]))
        client.run(restart_clock, time.time())  # speed schedules count from here
        since = time.time()
        t0 = time.perf_counter()
        out = y.compute()
        makespan = time.perf_counter() - t0
        assert sorted(int(b.payload) for b in out) == expect  # each block once
        spec = {}
        if config != "plain":
            deadline = time.time() + 10
            while True:  # outcomes are logged when the copies' replies arrive
                spec = blockflow.plugin_status(client, since=since)["speculation"]
                if not spec.get("running") or time.time() > deadline:
                    break
                time.sleep(0.1)
    return {"makespan": makespan, "launched": int(spec.get("launched", 0)),
            "won": int(spec.get("backup-won", 0)),
            "duplicated": float(spec.get("duplicated_seconds", 0.0))}


def _spec_rows(workload: str, results: dict, reference: str, work_s: float, bound=None,
               bound_name="", worst: bool = False) -> list[dict]:
    rows = []
    ref = results[reference]
    for config, runs in results.items():
        ms = [r["makespan"] for r in runs]
        ratios = [r["makespan"] / q["makespan"] for r, q in zip(runs, ref)]
        row = {"workload": workload, "config": config,
               "makespan s": f"{statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f})",
               f"/{reference}": f"{statistics.median(ratios):.2f} "
                                f"({min(ratios):.2f}-{max(ratios):.2f})",
               "backups (won)": f"{sum(r['launched'] for r in runs)} "
                                f"({sum(r['won'] for r in runs)})",
               "duplicated": f"{100 * statistics.median(r['duplicated'] for r in runs) / work_s:.1f}%"}
        if bound:
            row[f"/{bound_name}"] = f"{statistics.median(ms) / bound:.2f}"
            if worst:
                row[f"worst /{bound_name}"] = f"{max(ms) / bound:.2f}"
        if worst:
            row["worst duplicated"] = f"{100 * max(r['duplicated'] for r in runs) / work_s:.1f}%"
        rows.append(row)
    return rows


def _paired(configs, reps, cell) -> dict:
    results = {c: [] for c in configs}
    for rep in range(reps):
        order = configs if rep % 2 == 0 else configs[::-1]
        for c in order:
            for attempt in range(3):  # a loaded machine may not start a cluster in time
                try:
                    r = cell(c, rep)
                    break
                except (TimeoutError, OSError) as e:
                    print(f"  rep {rep} {c}: cluster failed ({type(e).__name__}), again",
                          file=sys.stderr)
            else:
                raise RuntimeError(f"{c}: no cluster started in 3 tries")
            print(f"  rep {rep} {c:24s} {r['makespan']:.2f}s backups {r['launched']} "
                  f"won {r['won']}", file=sys.stderr)
            results[c].append(r)
    return results


def whole_block_floor(blocks: int, work: float, task_seconds: float, *, devices: int = 4,
                      slow_at: float, factor: float) -> tuple[float, int]:
    """The shortest makespan any scheduler can reach when device 0 of ``devices`` identical
    ones slows to ``factor`` of its speed at ``slow_at`` seconds, with whole blocks.

    Each block takes ``task_seconds`` on a device at full speed (its ``work`` reference-seconds
    plus the per-task overhead measured in the run without slowdown); on device 0 its work
    runs at speed 1 until ``slow_at`` and at ``factor`` after. Whatever the placement (moves,
    holds, backup copies: a copy adds no capacity), device 0 completes some ``k`` blocks one
    after another and the others share the rest, at best evenly; the floor is the best ``k``.
    Returns ``(seconds, k)``. Unlike the fluid bound (work / capacity), it counts that a
    block cannot be shared: with few blocks per device it can lie well above the fluid bound.
    """
    overhead = task_seconds - work
    best = (math.inf, 0)
    t0 = 0.0
    for k in range(blocks + 1):
        if k:  # device 0's k-th block, started at t0
            pre = min(work, max(0.0, slow_at - t0))
            t0 += pre + (work - pre) / factor + overhead
        rest = -(-(blocks - k) // (devices - 1)) * task_seconds
        best = min(best, (max(t0, rest), k))
    return best


def slowdown(client, args) -> list[dict]:
    """One of 4 devices slowed 5x mid-run; against the same run without the slowdown, and
    the whole-block floor (:func:`whole_block_floor`)."""
    blocks, work = args.spec_blocks, args.spec_work
    at = blocks * work / 4 / 2  # half-way through the ideal makespan
    slow = {0: [(at, 0.2)]}

    def cell(config, rep):
        if config == "blockflow-no-slowdown":
            return _spec_cell("blockflow", args, blocks=blocks, work=work,
                              speeds=[1] * 4, run=rep)
        return _spec_cell(config, args, blocks=blocks, work=work, speeds=[1] * 4,
                          schedules=slow, run=rep)

    results = _paired(("blockflow-no-slowdown",) + SPEC_CONFIGS, args.repeat, cell)
    rows = _spec_rows("slowdown-5x", results, "blockflow-no-slowdown", blocks * work)
    # the per-block time at full speed, overhead included, from the run without slowdown
    reference = statistics.median(r["makespan"] for r in results["blockflow-no-slowdown"])
    floor, k = whole_block_floor(blocks, work, reference / (blocks / 4), slow_at=at,
                                 factor=0.2)
    for row in rows:
        ms = float(row["makespan s"].split()[0])
        row["/floor"] = f"{ms / floor:.2f}"
    rows.append({"workload": "slowdown-5x", "config": "whole-block floor",
                 "makespan s": f"{floor:.2f}",
                 "/blockflow-no-slowdown": f"{floor / reference:.2f}",
                 "backups (won)": f"device 0: {k} blocks", "duplicated": "", "/floor": "1.00"})
    return rows


def slow_from_start(client, args) -> list[dict]:
    """One device 10x slower from the start (nothing known about it); the bound is the
    fast devices alone: total work / 3."""
    blocks, work = args.spec_blocks // 2, args.spec_work * 2

    def cell(config, rep):
        return _spec_cell(config, args, blocks=blocks, work=work, speeds=[0.1, 1, 1, 1],
                          run=rep)

    results = _paired(SPEC_CONFIGS, args.repeat, cell)
    return _spec_rows("slow-10x-from-start", results, "plain", blocks * work,
                      bound=blocks * work / 3, bound_name="fast-only bound")


def coarse_slow(client, args) -> list[dict]:
    """Coarse jobs, ~8 blocks per device, device 0 10x slower from the start; cold (no
    warm-up stage: nothing measured) and warm; the worst of ``--worst-of`` runs against
    the fast devices' bound (total work / 3). Target (issue 27): worst <= 1.25x."""
    blocks, work = 32, args.spec_work
    rows = []
    for warm in (False, True):
        name = f"coarse-slow-10x-{'warm' if warm else 'cold'}"

        def cell(config, rep, warm=warm):
            return _spec_cell(config, args, blocks=blocks, work=work, speeds=[0.1, 1, 1, 1],
                              run=rep, warm=warm)

        results = _paired(("plain", "blockflow"), args.worst_of, cell)
        rows += _spec_rows(name, results, "plain", blocks * work, bound=blocks * work / 3,
                           bound_name="fast-only bound", worst=True)
    return rows


def uneven(client, args) -> list[dict]:
    """4 identical devices, 32 blocks of which the last holds 8x the others' elements
    (and work): a block long for its size, not a straggler. Wasted copies (work done
    twice) over ``--worst-of`` runs. Target (issue 27): <= 5 % of the work."""
    sizes = [1] * 31 + [8]
    work = args.spec_work

    def cell(config, rep):
        return _spec_cell(config, args, blocks=len(sizes), work=work, speeds=[1] * 4,
                          run=rep, sizes=sizes)

    results = _paired(("plain", "blockflow"), args.worst_of, cell)
    return _spec_rows("uneven-sizes-one-8x", results, "plain", sum(sizes) * work,
                      bound=sum(sizes) * work / 4, bound_name="fluid bound", worst=True)


def large_inputs(client, args) -> list[dict]:
    """4 devices, ``--spec-blocks`` blocks of ``--spec-work`` reference-seconds, each reading a
    ``--large-mib`` MiB input persisted where Dask put it; device 0 slows to half its speed
    half-way through the ideal makespan. A copy or a move costs more in sending the input
    than it gains. Target (issue 39): blockflow <= plain, no backup copy."""
    blocks, work = args.spec_blocks, args.spec_work
    at = blocks * work / 4 / 2
    slow = {0: [(at, 0.5)]}

    def cell(config, rep):
        return _spec_cell(config, args, blocks=blocks, work=work, speeds=[1] * 4,
                          schedules=slow, run=rep, nbytes=int(args.large_mib * 2**20))

    results = _paired(("plain", "blockflow"), args.repeat, cell)
    return _spec_rows("large-inputs", results, "plain", blocks * work,
                      bound=blocks * work / 4, bound_name="ideal", worst=True)


def _gpu_dependent(root, i, seconds=1.0):
    """A dependent of the tiny root that needs ``GPU=1``: the worker that ran it."""
    from distributed import get_worker

    time.sleep(seconds)
    return get_worker().address


def _fanout_cell(config: str, run: int) -> dict:
    """Two workers with ``GPU=1`` each, a tiny root, four 1 s dependents needing ``GPU=1``
    (dask/distributed#8177): makespan and the dependents per worker."""
    from blockflow.scheduling import Rebalancer

    with LocalCluster(n_workers=2, threads_per_worker=1, resources={"GPU": 1},
                      processes=False, dashboard_address=":0",
                      silence_logs=logging.CRITICAL) as cluster, Client(cluster) as client:
        if config != "plain":
            client.register_plugin(Rebalancer(policy="dynamic"))
        root = dask.delayed(lambda: 1)(dask_key_name=f"tiny-root-{run}")
        with dask.annotate(resources={"GPU": 1}):
            deps = [dask.delayed(_gpu_dependent)(root, i, dask_key_name=(f"gpu-dep-{run}", i))
                    for i in range(4)]
        t0 = time.perf_counter()
        ran = dask.compute(*deps)
        makespan = time.perf_counter() - t0
    split = "+".join(str(n) for n in sorted(Counter(ran).values(), reverse=True))
    return {"makespan": makespan, "split": split, "launched": 0, "won": 0}


def gpu_fanout(client, args) -> list[dict]:
    """dask/distributed#8177: restricted dependents of one tiny root on two one-GPU workers;
    2 s is possible (2 + 2). Target (issue 39): 2 + 2 in every run."""
    results = _paired(("plain", "blockflow"), args.repeat,
                      lambda c, rep: _fanout_cell(c, rep))
    rows = []
    for config, runs in results.items():
        ms = [r["makespan"] for r in runs]
        ratios = [r["makespan"] / q["makespan"] for r, q in zip(runs, results["plain"])]
        rows.append({
            "workload": "gpu-fanout", "config": config,
            "makespan s": f"{statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f})",
            "/plain": f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
            "splits": " ".join(r["split"] for r in runs)})
    return rows


def no_stragglers(client, args) -> list[dict]:
    """Identical devices: speculation must cost nothing (>= 5 paired repetitions)."""
    blocks, work = args.spec_blocks, args.spec_work

    def cell(config, rep):
        return _spec_cell(config, args, blocks=blocks, work=work, speeds=[1] * 4, run=rep)

    results = _paired(("blockflow-no-backups", "blockflow", "plain"),
                      max(args.repeat, 5), cell)
    return _spec_rows("identical", results, "blockflow-no-backups", blocks * work)


#: Name, in ``sys.modules`` of a worker process, of the lock another tenant holds
#: (``--pause-kind lock``): a process-wide place both the tenant and the kernels find.
_TENANT_LOCK = "blockflow-bench-tenant-lock"


def _hold_device(seconds: float) -> None:
    """``client.run``: another tenant takes this worker's device for ``seconds`` (a thread
    holds the lock each of :func:`_pause_kernel` takes before it runs)."""
    import threading

    lock = sys.modules.setdefault(_TENANT_LOCK, threading.Lock())
    held = threading.Event()

    def tenant():
        with lock:
            held.set()
            time.sleep(seconds)

    threading.Thread(target=tenant, daemon=True).start()
    held.wait()


def _pause_kernel(block, block_id=None, work=0.05):
    """A simulated kernel that first waits for its device (held by another tenant on the
    paused worker); returns ``[(sum, worker address)]``."""
    from distributed import get_worker

    from blockflow.testing import simulated_kernel

    worker = get_worker()
    lock = sys.modules.get(_TENANT_LOCK)
    if lock is not None:
        with lock:
            pass
    out = simulated_kernel(block, op=np.sum, work=work)
    result = np.empty(1, dtype=object)
    result[0] = (int(out.payload), worker.address)
    return result


def _pause_cell(config: str, args, run: int) -> dict:
    from blockflow.scheduling import Rebalancer
    from blockflow.testing import restart_clock, set_tenant, simulated_cluster

    blocks, work = args.pause_blocks, args.pause_work
    with dask.config.set({"blockflow.speculation.enabled": True}), simulated_cluster(
            speeds=[1] * 4, processes=not args.in_process,
            silence_logs=logging.CRITICAL) as client:
        if config != "plain":
            client.register_plugin(Rebalancer(policy="dynamic"))
        warm = blockflow.map_blocks(_pause_kernel, da.ones(8, chunks=1), dtype=object,
                                    name=f"warm-{run}", work=work)
        warm.compute()
        paused = sorted(client.scheduler_info()["workers"])[0]
        moves0 = (blockflow.plugin_status(client)["moves_requested"]
                  if config != "plain" else 0)
        y = blockflow.map_blocks(_pause_kernel, da.arange(blocks, chunks=1), dtype=object,
                                 name=f"pause-{run}", work=work)
        if args.pause_kind == "lock":
            client.run(_hold_device, args.pause_seconds, workers=[paused])
        else:  # a tenant time-slicing the device (kernels at half speed) for the pause
            client.run(set_tenant, [(0.0, 100.0, 0), (args.pause_seconds, 0.0, 0)],
                       workers=[paused])
            client.run(restart_clock, time.time(), workers=[paused])
        t0 = time.perf_counter()
        out = y.compute()
        makespan = time.perf_counter() - t0
        assert sorted(v for v, _ in out) == list(range(blocks))  # each block once
        moves = on_paused = 0
        if config != "plain":
            status = blockflow.plugin_status(client)
            moves = status["moves_requested"] - moves0
            on_paused = sum(1 for d in status["decisions"]
                            if d["action"] == "move" and d["worker"] == paused)
    share = sum(1 for _, w in out if w == paused)
    return {"makespan": makespan, "share": share, "moves": moves, "moves_off": on_paused,
            "launched": 0, "won": 0}


def brief_pause(client, args) -> list[dict]:
    """4 identical devices; another tenant holds device 0 for the stage's first
    ``--pause-seconds``: never slower than plain, and device 0 gets its fair share back."""
    blocks, work, pause = args.pause_blocks, args.pause_work, args.pause_seconds
    results = _paired(("plain", "blockflow"), args.pause_repeat,
                      lambda c, rep: _pause_cell(c, args, rep))
    # the device work lost to the tenant: all of the pause (lock) or half of it (a tenant
    # time-slicing the device); with the stage ending together, device 0 runs the rest
    lost = pause * (1.0 if args.pause_kind == "lock" else 0.5)
    fair = ((blocks * work + lost) / 4 - lost) / work
    rows = []
    for config, runs in results.items():
        ms = [r["makespan"] for r in runs]
        ratios = [r["makespan"] / q["makespan"] for r, q in zip(runs, results["plain"])]
        shares = [r["share"] for r in runs]
        rows.append({
            "workload": "brief-pause", "config": config,
            "makespan s": f"{statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f})",
            "/plain": f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
            "paused device's blocks": f"{statistics.median(shares):g} "
                                      f"({min(shares)}-{max(shares)}; fair {fair:.0f})",
            "moves (off it)": f"{statistics.median(r['moves'] for r in runs):g} "
                              f"({statistics.median(r['moves_off'] for r in runs):g})"})
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
    parser.add_argument("--spec-blocks", type=int, default=60,
                        help="blocks of the straggler workloads (4 simulated devices)")
    parser.add_argument("--spec-work", type=float, default=0.2,
                        help="reference-seconds per block of the straggler workloads")
    parser.add_argument("--pause-blocks", type=int, default=240,
                        help="blocks of the brief-pause workload")
    parser.add_argument("--pause-work", type=float, default=0.05,
                        help="reference-seconds per block of the brief-pause workload")
    parser.add_argument("--pause-seconds", type=float, default=0.6,
                        help="how long another tenant holds device 0 (brief-pause)")
    parser.add_argument("--pause-kind", choices=("tenant", "lock"), default="tenant",
                        help="brief-pause: a tenant time-slicing device 0 (its kernels at "
                             "half speed) or holding it (its kernels wait)")
    parser.add_argument("--pause-repeat", type=int, default=5,
                        help="paired repetitions of the brief-pause workload")
    parser.add_argument("--worst-of", type=int, default=5,
                        help="runs per configuration of coarse-slow and uneven (worst shown)")
    parser.add_argument("--large-mib", type=float, default=32,
                        help="MiB of input per block of the large-inputs workload")
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
    if "zipf-skew" in chosen:
        with LocalCluster(n_workers=args.workers, threads_per_worker=1,
                          processes=not args.in_process, dashboard_address=":0") as cluster, \
                Client(cluster) as client:
            rows += zipf_skew(client, args)
    if "shuffle-skew" in chosen:
        with LocalCluster(n_workers=args.workers, threads_per_worker=1,
                          processes=not args.in_process, dashboard_address=":0") as cluster, \
                Client(cluster) as client:
            rows += shuffle_skew(client, args)
    # the straggler workloads start a fresh cluster of simulated devices per run
    spec = {"slowdown": slowdown, "slow-from-start": slow_from_start,
            "identical": no_stragglers, "brief-pause": brief_pause,
            "coarse-slow": coarse_slow, "uneven": uneven, "large-inputs": large_inputs,
            "gpu-fanout": gpu_fanout}
    for name in chosen:
        if name in spec:
            rows += spec[name](None, args)
    print(pd.DataFrame(rows).to_string(index=False))


if __name__ == "__main__":
    main()
