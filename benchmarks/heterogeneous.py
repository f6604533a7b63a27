"""Heterogeneous-cluster benchmark: plain Dask vs blockflow's static and dynamic policies.

Four simulated GPU workers (1 thread each; speeds 1, 1, 0.5, 0.25 by default) run a
blockwise kernel over N blocks. Every cell starts a fresh cluster, so learned state never
carries over between cells. Prints one table: median makespan over the repetitions (min-max),
ratio to the ideal makespan (total work / total speed), ratio to plain Dask in the same run,
the heterogeneity penalty (ratio to ideal / the same configuration's ratio on the
homogeneous control), simulated out-of-memory errors, tasks per worker and moves made; then
the plugin's overhead on trivial tasks.

    python benchmarks/heterogeneous.py            # full run (~15-25 min on 2 cores)
    python benchmarks/heterogeneous.py --quick    # smoke test (~1 min)
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections import Counter

import dask
import dask.array as da
import numpy as np
from distributed import futures_of, wait

import blockflow
from blockflow.scheduling import Rebalancer
from blockflow.testing import (
    SimulatedDeviceBlock,
    device_stats,
    restart_clock,
    set_speed,
    simulated_cluster,
    simulated_kernel,
)

WORKLOADS = ("uniform", "skewed", "slowdown", "persisted", "persisted-skewed",
             "memory-pressure", "homogeneous")
CONFIGS = ("plain", "static-capacity", "dynamic")
DEVICE_MEMORY = 2**30  # 1 GiB simulated devices


def block_works(workload: str, n: int, block_s: float, seed: int = 0) -> np.ndarray:
    """Seconds of work per block at speed 1 (skewed: log-normal sigma=1, same mean)."""
    if workload in ("skewed", "persisted-skewed"):
        rng = np.random.default_rng(seed)
        w = rng.lognormal(mean=0.0, sigma=1.0, size=n)
        return w * (block_s / w.mean())
    return np.full(n, block_s)


def bench_kernel(block, block_id=None, works=None, working_set=None):
    """The benchmark's kernel: simulated device time ``works[i]``, a real sum as payload."""
    i = block_id[0]
    return np.array([simulated_kernel(block, op=np.sum, work=float(works[i]),
                                      working_set=working_set, output_bytes=2**20)],
                    dtype=object)


def ideal_makespan(workload: str, works: np.ndarray, speeds: list[float],
                   slow_at: float | None) -> float:
    total = float(works.sum())
    if workload == "memory-pressure":
        speeds = speeds[:1] + speeds[2:]  # worker 1's device cannot hold a block
    s = sum(speeds)
    if workload == "slowdown":
        s2 = s - speeds[0] + 0.2
        if total / s <= slow_at:
            return total / s
        return slow_at + (total - s * slow_at) / s2
    return total / s


def run_cell(workload: str, config: str, n: int, block_s: float, speeds_het: list[float],
             seed: int) -> dict:
    speeds = [1.0] * len(speeds_het) if workload == "homogeneous" else list(speeds_het)
    works = block_works(workload, n, block_s, seed)
    tenants = None
    working_set = None
    if workload == "memory-pressure":
        tenants = {1: (0.0, int(0.9 * DEVICE_MEMORY))}
        working_set = int(0.3 * DEVICE_MEMORY)
    slow_at = (works.sum() / sum(speeds)) / 3 if workload == "slowdown" else None
    with simulated_cluster(speeds=speeds, device_memory=DEVICE_MEMORY, tenants=tenants,
                           silence_logs=logging.CRITICAL) as client:
        if config != "plain":
            client.register_plugin(Rebalancer(policy=config))
        addrs = sorted(client.scheduler_info()["workers"],
                       key=lambda a: client.scheduler_info()["workers"][a]["name"])
        if workload.startswith("persisted"):
            with dask.annotate(workers=lambda k: [addrs[k[1] % len(addrs)]],
                               allow_other_workers=False):
                x = da.random.random((n, 2**17), chunks=(1, 2**17))  # 1 MiB blocks
            x = x.persist(optimize_graph=False)
            wait(x)
        else:
            x = da.zeros(n, chunks=1)
        y = blockflow.map_blocks(bench_kernel, x, works=works, working_set=working_set,
                                 dtype=object, chunks=((1,) * n,), drop_axis=list(range(1, x.ndim))
                                 if x.ndim > 1 else None, name="bench")
        client.run(restart_clock, time.time())
        timer = None
        if workload == "slowdown":
            import threading

            timer = threading.Timer(slow_at, lambda: client.run(set_speed, 0.2,
                                                                workers=[addrs[0]]))
        t0 = time.perf_counter()
        if timer:
            timer.start()
        z = y.persist(retries=20)
        wait(z)
        makespan = time.perf_counter() - t0
        if timer:
            timer.join()
        holders = Counter(ws[0] for ws in client.who_has(z).values() if ws)
        per_worker = [holders[a] for a in addrs]
        failed = sum(f.status == "error" for f in futures_of(z))
        if not failed:  # results must be right: real sums of the input blocks
            got = sum(b.payload for b in z.compute())
            expected = float(x.sum().compute()) if workload.startswith("persisted") else 0.0
            assert abs(got - expected) <= 1e-6 * max(abs(expected), 1), (got, expected)
        stats = client.run(device_stats)
        ooms = sum((s or {}).get("oom_errors", 0) for s in stats.values())
        moves = 0
        if config != "plain":
            st = blockflow.plugin_status(client)
            moves = sum(1 for d in st["decisions"] if d["action"] == "move")
    return {"makespan": makespan, "failed": failed, "ideal": ideal_makespan(workload, works, speeds, slow_at),
            "per_worker": per_worker, "ooms": ooms, "moves": moves}


def overhead(n_tasks: int, reps: int) -> tuple[float, float, float]:
    """Median seconds for n trivial tasks without and with the plugin, and their ratio."""
    times = {"plain": [], "dynamic": []}
    for config in ("plain", "dynamic") * reps:
        with simulated_cluster(speeds=[1, 1, 1, 1], silence_logs=logging.CRITICAL) as client:
            if config == "dynamic":
                client.register_plugin(Rebalancer(policy="dynamic"))
            x = da.ones(n_tasks, chunks=1)
            y = x.map_blocks(lambda b: b + 1, dtype=float)
            client.compute(da.ones(4, chunks=1).sum()).result()  # warm up
            t0 = time.perf_counter()
            wait(y.persist())
            times[config].append(time.perf_counter() - t0)
    p, d = statistics.median(times["plain"]), statistics.median(times["dynamic"])
    return p, d, d / p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 32 blocks, 1 repetition")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-ms", type=float, default=50.0, help="work per block at speed 1")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--speeds", default="1,1,0.5,0.25")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--overhead-tasks", type=int, default=10_000)
    args = ap.parse_args(argv)
    if args.quick:
        args.blocks, args.reps, args.block_ms, args.overhead_tasks = 32, 1, 20.0, 500
    speeds = [float(s) for s in args.speeds.split(",")]
    workloads = args.workloads.split(",")
    configs = args.configs.split(",")
    results: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.reps):
        for workload in workloads:
            for config in configs:
                r = run_cell(workload, config, args.blocks, args.block_ms / 1000, speeds, rep)
                results.setdefault((workload, config), []).append(r)
                print(f"# rep {rep} {workload:17s} {config:16s} {r['makespan']:.2f}s "
                      f"{'FAILED ' + str(r['failed']) + ' blocks ' if r['failed'] else ''}"
                      f"ideal {r['ideal']:.2f}s tasks {r['per_worker']} oom {r['ooms']} "
                      f"moves {r['moves']}", file=sys.stderr, flush=True)
    print_table(results, workloads, configs, args)
    if args.overhead_tasks:
        p, d, ratio = overhead(args.overhead_tasks, 1 if args.quick else 3)
        print(f"\nPlugin overhead, {args.overhead_tasks} trivial tasks on 4 workers (median): "
              f"plain {p:.2f}s, with blockflow dynamic {d:.2f}s, ratio {ratio:.3f}")
    return 0


def print_table(results, workloads, configs, args) -> None:
    def med(ws, c):
        return statistics.median(r["makespan"] for r in results[(ws, c)])

    def ratio_ideal(ws, c):
        return statistics.median(r["makespan"] / r["ideal"] for r in results[(ws, c)])

    print("\nfailed: blocks that still erred after 20 retries (makespan then = time to give up)")
    print(f"{args.blocks} blocks x {args.block_ms:g} ms at speed 1, speeds {args.speeds}, "
          f"{args.reps} repetitions, fresh cluster per cell")
    head = (f"{'workload':17s} {'config':16s} {'makespan s (min-max)':22s} {'/ideal':>7s} "
            f"{'/plain':>7s} {'penalty':>8s} {'OOM':>4s} {'failed':>6s} {'moves':>6s}  "
            f"tasks per worker")
    print(head)
    print("-" * len(head))
    for ws in workloads:
        for c in configs:
            rs = results[(ws, c)]
            mk = [r["makespan"] for r in rs]
            vs_plain = (f"{med(ws, c) / med(ws, 'plain'):7.2f}"
                        if (ws, "plain") in results else "      -")
            pen = (f"{ratio_ideal(ws, c) / ratio_ideal('homogeneous', c):8.2f}"
                   if ("homogeneous", c) in results and ws != "homogeneous" else "       -")
            tasks = [int(statistics.median(r["per_worker"][i] for r in rs))
                     for i in range(len(rs[0]["per_worker"]))]
            print(f"{ws:17s} {c:16s} {statistics.median(mk):6.2f} ({min(mk):.2f}-{max(mk):.2f})"
                  f"{'':4s} {ratio_ideal(ws, c):7.2f} {vs_plain} {pen} "
                  f"{statistics.median(r['ooms'] for r in rs):4.0f} "
                  f"{statistics.median(r['failed'] for r in rs):6.0f} "
                  f"{statistics.median(r['moves'] for r in rs):6.0f}  {tasks}")


if __name__ == "__main__":
    sys.exit(main())
