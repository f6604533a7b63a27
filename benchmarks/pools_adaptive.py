"""Pools benchmark, adaptive row: ``PoolCluster.adapt`` from zero workers under a cost deadline.

Two simulated pools on one scheduler (issue 29): ``fast`` (speed 4, $4 per worker-hour, at
most 2 workers) and ``slow`` (speed 1, $0.5 per worker-hour, at most 4), both starting
empty. ``--tasks`` simulated kernels of ``--work`` reference-seconds run under
``blockflow.objective("cost", deadline=D)``; the cluster grows each pool from the backlog,
the throughput matrix and the prices, and retires idle workers after the work. Reported:
makespan against D, the cost (each worker billed from its first task's start to its last
task's end, as :func:`blockflow.scheduling.cost.run_cost`), the LP bound over the nominal throughput matrix at D, workers
retired while busy (tasks that ran more than once: 0 expected) and the scaling decisions.

    python benchmarks/pools_adaptive.py --reps 1     # a check (~1-3 min on a loaded host)
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

from distributed import Client, wait

import blockflow
from blockflow.cluster.report import pool_costs
from blockflow.scheduling.cost import plan
from blockflow.scheduling.pools import Pool
from blockflow.testing.simulated import SimulatedDevice, SimulatedGPU, simulated_kernel

FAST = Pool("fast", provider="gcp", price=4.0, speed=4)
SLOW = Pool("slow", provider="aws", price=0.5, speed=1)
POOLS = {"fast": FAST, "slow": SLOW}
BOUNDS = {"fast": (0, 2), "slow": (0, 4)}


def one_rep(args, deadline: float) -> dict:
    devices = {f"{p}-{i}": SimulatedDevice(speed=POOLS[p].speed) for p in POOLS
               for i in range(64)}
    with blockflow.PoolCluster({FAST: 0, SLOW: 0}, processes=False,
                               silence_logs=logging.CRITICAL) as cluster, \
            Client(cluster) as client:
        client.register_plugin(SimulatedGPU(devices))
        adaptive = cluster.adapt(pools=BOUNDS, interval="500ms", wait_count=3)
        t0 = time.time()
        with blockflow.objective("cost", deadline=deadline):
            fs = client.map(simulated_kernel, range(args.tasks), work=args.work, pure=False)
            wait(fs)
        makespan = time.time() - t0
        time.sleep(0.5)
        run_cost = pool_costs(client)["total_cost"]
        status = blockflow.plugin_status(client)
        ran = sum(status["task_counts"].values())
        del fs
        until = time.monotonic() + 120
        while sum(cluster.pool_sizes.values()) > 1 and time.monotonic() < until:
            time.sleep(0.5)  # idle workers retired after the work
        status = blockflow.plugin_status(client)
        scale = [d for d in status["decisions"] if d["action"] == "scale"]
        retired = [d for d in status["decisions"] if d["action"] == "retire"]
        adaptive.stop()
        return {"makespan": makespan, "cost": run_cost,
                "reruns": ran - args.tasks, "retired": len(retired),
                "backups": sum(d["action"] == "speculate" for d in status["decisions"]),
                "scale": [(d["target"], d["seen_target"]) for d in scale]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=96)
    ap.add_argument("--work", type=float, default=0.5)
    ap.add_argument("--deadline", type=float, default=None)
    args = ap.parse_args(argv)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    slow_alone = args.tasks * args.work / BOUNDS["slow"][1]
    deadline = args.deadline or round(slow_alone * 2 / 3, 2)
    seconds = {"k": {p: args.work / POOLS[p].speed for p in POOLS}}
    bound = plan({"k": args.tasks}, seconds, POOLS, {p: b[1] for p, b in BOUNDS.items()},
                 deadline=deadline)
    rows = []
    for rep in range(args.reps):
        r = one_rep(args, deadline)
        print(f"rep {rep}: {r}", file=sys.stderr)
        rows.append(r)

    def med(key):
        return statistics.median(r[key] for r in rows)

    print(f"# blockflow pools benchmark, adaptive from zero ({time.strftime('%Y-%m-%d')}), "
          f"medians of {len(rows)}; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs: {args.tasks} tasks x {args.work} reference-s; fast 0..2 "
          f"workers speed 4 $4/h, slow 0..4 speed 1 $0.5/h; deadline {deadline:g} s")
    print(f"{'configuration':<16}{'makespan s':>11}{'deadline':>9}{'cost $':>11}"
          f"{'LP cost $':>11}{'cost/LP':>9}{'extra runs':>13}")
    print(f"{'adaptive-cost':<16}{med('makespan'):>11.2f}{deadline:>9.2f}{med('cost'):>11.6f}"
          f"{bound.cost:>11.6f}{med('cost') / bound.cost:>9.2f}"
          f"{max(r['reruns'] for r in rows):>13d}")
    print(f"# targets: deadline met in {sum(r['makespan'] <= deadline for r in rows)} of "
          f"{len(rows)}; cost / LP bound {med('cost') / bound.cost:.2f} (target <= 1.15); "
          f"extra task completions (0 expected; retire takes only workers with nothing processing): {max(r['reruns'] for r in rows)} (target 0)")
    print(f"# scaling decisions of the last repetition: {rows[-1]['scale']}; retired "
          f"{rows[-1]['retired']} idle workers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
