"""What a user of a fresh embedded cluster waits for: plain ``LocalCluster`` against
``blockflow.connect()`` (issue 39; run by ``benchmarks/scale.py --parts start``).

Each run is a fresh interpreter starting a fresh cluster of 2 single-thread worker processes;
the two arms alternate (order reversed on odd repetitions). This file imports no blockflow
at module level, so the plain arm's processes (and the workers they spawn, which import it
again) load none of it.

CPU seconds (of this process: scheduler and client; of the worker processes) are given
beside the wall times: on a machine shared with other jobs they move much less.

* ``first`` -- 32 trivial blocks on the fresh workers (``Array.map_blocks`` /
  ``blockflow.map_blocks``, dtype declared): seconds from ``persist()`` to the first and
  to the last block.
* ``tiny`` -- ``--tasks`` tiny tasks (``client.map``): seconds to the first and the last
  result, and the RSS of the process (scheduler and client: one process) before the first
  task and after the results are released and forgotten.

    python benchmarks/scale.py --parts start --tasks 10000 --reps 5
    python benchmarks/startup.py --tasks 10000 --reps 5        # the same table
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

from distributed import Client, LocalCluster, as_completed


def inc(x):
    return x + 1


def start_run(kind: str, mode: str, n_tasks: int) -> dict:
    """One run in this interpreter (a fresh one: ``--one KIND,MODE,TASKS``)."""
    import gc

    import psutil

    if mode == "plain":
        client = Client(LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0"))
    else:
        import blockflow

        client = blockflow.connect(n_workers=2, threads_per_worker=1, dashboard_address=":0")
    scheduler, proc, out = client.cluster.scheduler, psutil.Process(), {}

    def cpu() -> tuple[float, float]:  # CPU seconds of this process and of the workers'
        workers = 0.0
        for child in proc.children(recursive=True):
            try:
                t = child.cpu_times()
                workers += t.user + t.system
            except psutil.Error:
                continue
        t = proc.cpu_times()
        return t.user + t.system, workers

    try:
        if kind == "first":
            import dask.array as da
            from distributed import futures_of

            x = da.ones(32, chunks=1)
            y = x.map_blocks(inc, dtype=x.dtype) if mode == "plain" else \
                blockflow.map_blocks(inc, x, dtype=x.dtype)
            c0, t0 = cpu(), time.perf_counter()
            futures = futures_of(y.persist())
        else:
            gc.collect()
            out["rss_before_mib"] = proc.memory_info().rss / 2**20
            c0, t0 = cpu(), time.perf_counter()
            futures = client.map(inc, range(n_tasks), key=[f"inc-{i}" for i in range(n_tasks)])
        next(as_completed(futures))
        out["first_s"] = time.perf_counter() - t0
        client.gather(futures)
        out["wall_s"] = time.perf_counter() - t0
        c1 = cpu()
        out["cpu_main_s"], out["cpu_workers_s"] = c1[0] - c0[0], c1[1] - c0[1]
        if kind == "tiny":
            del futures
            while scheduler.tasks:  # released and forgotten on the scheduler
                time.sleep(0.05)
            gc.collect()
            out["rss_after_mib"] = proc.memory_info().rss / 2**20
    finally:
        client.close()
        client.cluster.close()
    return out


def start_part(reps: int, n_tasks: int) -> list[dict]:
    """The ``start`` part's rows: per kind, medians of each arm and of the paired ratios."""
    import json
    import subprocess

    rows = []
    for kind in ("first", "tiny"):
        runs: dict[str, list[dict]] = {"plain": [], "blockflow": []}
        for r in range(reps):
            for mode in (("plain", "blockflow") if r % 2 == 0 else ("blockflow", "plain")):
                done = subprocess.run([sys.executable, __file__, "--one",
                                       f"{kind},{mode},{n_tasks}"], capture_output=True,
                                      text=True, check=False)
                lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
                if done.returncode or not lines:
                    raise RuntimeError(f"start run {kind} {mode} failed: {done.stderr[-2000:]}")
                runs[mode].append(json.loads(lines[-1]))
                print(f"start {kind} rep={r} {mode}: {runs[mode][-1]}", file=sys.stderr,
                      flush=True)
        med = statistics.median
        for key in runs["plain"][0]:
            p, b = ([x[key] for x in runs[m]] for m in ("plain", "blockflow"))
            rows.append({"kind": kind, "what": key, "plain": med(p), "blockflow": med(b),
                         "ratio": med(y / x for x, y in zip(p, b)),
                         "range": (min(p), max(p), min(b), max(b))})
    return rows


def print_start(rows, args) -> None:
    print(f"\n## Fresh embedded clusters: 2 worker processes x 1 thread, LocalCluster vs "
          f"blockflow.connect(); first = 32 trivial blocks, tiny = {args.tasks} tasks; "
          f"{args.reps} paired runs, medians\n")
    print(f"{'part':>6} {'measure':>14} {'plain':>9} {'blockflow':>10} {'ratio':>7}   "
          f"{'plain min-max':>15} {'bf min-max':>15}")
    for r in rows:
        lo, hi, blo, bhi = r["range"]
        print(f"{r['kind']:>6} {r['what']:>14} {r['plain']:>9.3f} {r['blockflow']:>10.3f} "
              f"{r['ratio']:>6.3f}x   {lo:>7.3f}-{hi:<7.3f} {blo:>7.3f}-{bhi:<7.3f}",
              flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # KIND,MODE,TASKS
    args = ap.parse_args(argv)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    if args.one:
        import json

        kind, mode, tasks = args.one.split(",")
        print(json.dumps(start_run(kind, mode, int(tasks))), flush=True)
        return
    print(f"# python benchmarks/startup.py {' '.join(sys.argv[1:])}")
    print_start(start_part(args.reps, args.tasks), args)


if __name__ == "__main__":
    main()
