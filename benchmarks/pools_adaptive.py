"""Pools benchmark, adaptive row: ``PoolCluster.adapt`` from zero workers under a cost deadline.

Two simulated pools on one scheduler (issue 29): ``fast`` (speed 4, $4 per worker-hour, at
most 2 workers) and ``slow`` (speed 1, $0.5 per worker-hour, at most 4), both starting
empty. ``--tasks`` simulated kernels of ``--work`` reference-seconds run under
``blockflow.objective("cost", deadline=D)``; the cluster grows each pool from the backlog,
the throughput matrix and the prices, and retires idle workers after the work (once they
have been there ``--hold``). Reported: makespan against D, the cost as the run report bills
it (each worker from its arrival to its retirement, idle included:
:func:`blockflow.pools.plan.run_cost`), two LP bounds over the nominal throughput matrix:
at D, and at D less the measured worker start-up time (no worker can run a task before it
has joined: the honest bound for a run from zero workers), task completions beyond the
tasks (a result computed twice: 0 expected), busy workers retired, workers retired within
the hold after they arrived, and the scaling decisions. Medians of ``--reps``.

    python benchmarks/pools_adaptive.py --reps 1     # a check (~1-3 min on a loaded host)
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import time

from distributed import Client, wait

import blockflow
from blockflow.cluster.report import pool_costs
from blockflow.pools.plan import plan
from blockflow.pools.pool import Pool
from blockflow.scheduling.runs import run_scope
from blockflow.testing.simulated import SimulatedGPU, simulated_kernel
from blockflow.testing.simulated_device import SimulatedDevice

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
        # local in-process workers join in well under a second: a first guess of 1 s (the
        # default 5 s suits batch queues); replaced by the measured time once one joins
        adaptive = cluster.adapt(pools=BOUNDS, interval="500ms", wait_count=3, startup="1s",
                                 hold=args.hold)
        t0 = time.time()
        with run_scope(f"adaptive-{t0}"), blockflow.objective("cost", deadline=deadline):
            fs = client.map(simulated_kernel, range(args.tasks), work=args.work, pure=False)
            wait(fs)
        r = {"makespan": time.time() - t0, "submitted": args.tasks}
        time.sleep(0.5)
        r["completions"] = sum(blockflow.plugin_status(client)["run_counts"].values())
        until = time.monotonic() + 120
        while sum(cluster.pool_sizes.values()) > 1 and time.monotonic() < until:
            time.sleep(0.5)  # idle workers retired after the work
        status = blockflow.plugin_status(client, task_log=True)
        scale = [d for d in status["decisions"] if d["action"] == "scale"]
        retired = [d for d in status["decisions"] if d["action"] == "retire"]
        # a retire decision is only taken for a worker with nothing processing; a busy
        # one retired would show as a retire of a worker that ran a task after it
        last_task = {}
        for w, _, stop in status.get("task_log") or []:
            last_task[w] = max(last_task.get(w, 0.0), stop)
        r["cost"] = pool_costs(client)["total_cost"]  # the retired workers' lives included
        adaptive.stop()
        r.update(reruns=r["completions"] - r["submitted"], retired=len(retired),
                 early=sum(1 for d in retired if d.get("seen_age", math.inf) < args.hold),
                 busy_retired=sum(1 for d in retired
                                  if last_task.get(d["worker"], 0.0) > d["time"]),
                 backups=sum(d["action"] == "speculate" for d in status["decisions"]),
                 startup=adaptive.startup, checks=adaptive.checks,
                 scale=[(d["target"], d["seen_target"]) for d in scale])
        return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=96)
    ap.add_argument("--work", type=float, default=0.5)
    ap.add_argument("--deadline", type=float, default=None)
    ap.add_argument("--hold", type=float, default=3.0, help="blockflow.scaling.hold, seconds")
    args = ap.parse_args(argv)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    slow_alone = args.tasks * args.work / BOUNDS["slow"][1]
    deadline = args.deadline or round(slow_alone * 2 / 3, 2)
    seconds = {"k": {p: args.work / POOLS[p].speed for p in POOLS}}
    most = {p: b[1] for p, b in BOUNDS.items()}
    bound = plan({"k": args.tasks}, seconds, POOLS, most, deadline=deadline)
    rows = []
    for rep in range(args.reps):
        r = one_rep(args, deadline)
        print(f"rep {rep}: {r}", file=sys.stderr)
        rows.append(r)

    def med(key):
        return statistics.median(r[key] for r in rows)

    startup = med("startup")
    bound_up = plan({"k": args.tasks}, seconds, POOLS, most, deadline=deadline - startup)

    print(f"# blockflow pools benchmark, adaptive from zero ({time.strftime('%Y-%m-%d')}), "
          f"medians of {len(rows)}; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs: {args.tasks} tasks x {args.work} reference-s; fast 0..2 "
          f"workers speed 4 $4/h, slow 0..4 speed 1 $0.5/h; deadline {deadline:g} s")
    print(f"# worker start-up measured: {startup:.2f} s (median); LP bound at D: "
          f"${bound.cost:.6f}; at D less the start-up ({deadline - startup:.2f} s): "
          f"${bound_up.cost:.6f}")
    print(f"{'configuration':<16}{'makespan s':>11}{'deadline':>9}{'cost $':>11}"
          f"{'LP@D-up $':>11}{'cost/LP':>9}{'LP@D $':>10}{'cost/LP@D':>10}"
          f"{'extra runs':>11}{'busy ret.':>10}{'in hold':>8}")
    print(f"{'adaptive-cost':<16}{med('makespan'):>11.2f}{deadline:>9.2f}{med('cost'):>11.6f}"
          f"{bound_up.cost:>11.6f}{med('cost') / bound_up.cost:>9.2f}{bound.cost:>10.6f}"
          f"{med('cost') / bound.cost:>10.2f}{max(r['reruns'] for r in rows):>11d}"
          f"{max(r['busy_retired'] for r in rows):>10d}{max(r['early'] for r in rows):>8d}")
    print(f"# targets: deadline met in {sum(r['makespan'] <= deadline for r in rows)} of "
          f"{len(rows)} (median makespan {med('makespan'):.2f} s); cost / LP bound with "
          f"start-up {med('cost') / bound_up.cost:.2f} (target <= 1.15; "
          f"{med('cost') / bound.cost:.2f} against the bound without start-up); busy workers "
          f"retired: {max(r['busy_retired'] for r in rows)} (target 0); retired within the "
          f"{args.hold:g} s hold: {max(r['early'] for r in rows)} (target 0); task completions "
          f"beyond the {args.tasks} tasks: {max(r['reruns'] for r in rows)} (results "
          f"computed twice; 0 expected)")
    print(f"# scaling decisions of the last repetition: {rows[-1]['scale']}; retired "
          f"{rows[-1]['retired']} idle workers; {rows[-1]['checks']} scaling checks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
