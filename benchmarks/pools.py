"""Pools benchmark: blockflow's objectives against "one cluster per queue", beside the LP bound.

Simulated pools on one scheduler (issue 29): ``fast`` (speed 4, $4 per worker-hour, 2
workers, provider gcp) and ``slow`` (speed 1, $0.5 per worker-hour, 4 workers, provider aws,
$0.09 per GB leaving aws). The work: ``--tasks`` simulated kernels of ``--work``
reference-seconds (speed 1), so the slow pool alone needs ``tasks x work / 4`` seconds.

Configurations, side by side in one run (each repetition starts one cluster, measures the
kernel group once, then runs every configuration, the order of the comparable ones
reversed on odd repetitions):

* ``cost``: ``blockflow.objective("cost", deadline=D)``, D a deadline the slow pool alone
  misses (``--deadline``, default 2/3 of the slow pool's time);
* ``all-fast``: the "one cluster per queue" workaround, all work on the fast pool
  (``resources={"pool:fast": 1}``): only the fast pool is billed;
* ``split``: the workaround with a fixed split, half the tasks on each pool;
* ``split@D``: the best fixed split for the deadline D: the LP's share of the fast pool at
  D (rounded up) there, the rest on the slow pool - what a user who knows the nominal
  speeds would choose. With one task group this split *is* the LP optimum, so no policy can
  be much cheaper than it; it shows what the objective costs against perfect knowledge;
* ``cost@all-fast``: the cost objective with the deadline the all-fast run took (the
  comparison at equal makespan);
* ``budget``: ``blockflow.objective("makespan", budget=B)``, B halfway between the cheapest
  run and the fastest one (LP);
* ``default``: no objective (today's behaviour);
* ``egress``: every task reads a 100 MB input made on the slow pool (aws); the cost
  objective at deadline D: bytes leaving aws, against what the deadline needs (the LP's
  tasks on the fast pool x 100 MB).

Cost: each worker billed from its first task's start to its last task's end in the run
(idle gaps included) at its pool's price, as a cluster that releases idle workers pays
(:func:`blockflow.pools.plan.run_cost`). The LP bound: :func:`blockflow.pools.plan.plan`
over the nominal throughput matrix (work / speed), under the configuration's deadline or
budget. Medians over ``--reps`` repetitions.

    python benchmarks/pools.py                 # 3 repetitions (~4-6 min on a loaded 2-core host)
    python benchmarks/pools.py --reps 1        # a check
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import time

import numpy as np
from distributed import wait

import blockflow
from blockflow.cluster.report import pool_costs
from blockflow.scheduling import Rebalancer
from blockflow.pools.plan import plan
from blockflow.pools.pool import Pool
from blockflow.scheduling.runs import run_scope
from blockflow.testing.cluster import simulated_cluster
from blockflow.testing.simulated import simulated_kernel
from blockflow.testing.simulated_device import SimulatedDeviceBlock

FAST = Pool("fast", provider="gcp", price=4.0, speed=4)
SLOW = Pool("slow", provider="aws", price=0.5, speed=1, egress=0.09)
POOLS = {"fast": FAST, "slow": SLOW}
WORKERS = {"fast": 2, "slow": 4}
INPUT_BYTES = 100_000_000


def make_input(i: int) -> SimulatedDeviceBlock:
    return SimulatedDeviceBlock(np.int64(i), INPUT_BYTES)


def run_config(client, name: str, args, *, deadline=None, budget=None, split=None,
               only=None, inputs=False) -> dict:
    n, w = args.tasks, args.work
    t0 = time.time()
    with run_scope(f"pools-{name}-{t0}"):
        ctx = (blockflow.objective("cost", deadline=deadline) if deadline is not None
               else blockflow.objective("makespan", budget=budget) if budget is not None
               else blockflow.objective())
        with ctx:
            if inputs:
                xs = client.map(make_input, range(n), pure=False,
                                resources={"pool:slow": 1})
                fs = client.map(simulated_kernel, xs, work=w, pure=False)
            elif split is not None:
                k = int(round(n * split)) if isinstance(split, float) else int(split)
                fs = client.map(simulated_kernel, range(k), work=w, pure=False,
                                resources={"pool:fast": 1})
                fs += client.map(simulated_kernel, range(k, n), work=w, pure=False,
                                 resources={"pool:slow": 1})
            else:
                fs = client.map(simulated_kernel, range(n), work=w, pure=False,
                                resources={f"pool:{only}": 1} if only else None)
            wait(fs)
    makespan = time.time() - t0
    time.sleep(0.3)  # the last task's transition reaches the plugin
    c = pool_costs(client)
    del fs
    status = blockflow.plugin_status(client)
    fast_tasks = sum(status["run_counts"].get(a, 0)
                     for a in status["pools"]["fast"]["workers"])
    return {"makespan": makespan, "cost": c["total_cost"], "egress_bytes": c["egress"]["bytes"],
            "fast_tasks": fast_tasks,
            "completions": sum(status["run_counts"].values()),
            "submitted": 2 * n if inputs else n,
            "missed": sum(1 for d in status["decisions"]
                          if d["action"] == "objective" and d["time"] >= t0)}


def one_rep(rep: int, args, deadline: float, budget: float, results: dict,
            split_d: int | None = None) -> None:
    """One repetition: a fresh cluster, the group measured once, every configuration."""
    with simulated_cluster(pools={FAST: WORKERS["fast"], SLOW: WORKERS["slow"]}) as c:
        c.register_plugin(Rebalancer(policy="dynamic"))
        c.gather(c.map(simulated_kernel, range(12), work=args.work, pure=False))
        order = [("cost", dict(deadline=deadline)), ("split", dict(split=0.5)),
                 ("split@D", dict(split=split_d)),
                 ("budget", dict(budget=budget)), ("default", {}),
                 ("egress", dict(deadline=deadline, inputs=True))]
        if rep % 2:
            order.reverse()
        cells = [("all-fast", dict(only="fast"))] + order
        for name, kw in cells:
            r = run_config(c, name, args, **kw)
            results.setdefault(name, []).append(r)
            print(f"rep {rep} {name}: {r}", file=sys.stderr)
            if name == "all-fast":
                eq = round(r["makespan"], 2)
                r2 = run_config(c, "cost@all-fast", args, deadline=eq)
                r2["deadline"] = eq
                results.setdefault("cost@all-fast", []).append(r2)
                print(f"rep {rep} cost@all-fast: {r2}", file=sys.stderr)


def lp(args, **kw):
    seconds = {"k": {p: args.work / POOLS[p].speed for p in POOLS}}
    egress = None
    if kw.pop("inputs", False):
        egress = {"k": {"fast": INPUT_BYTES / 1e9 * SLOW.egress, "slow": 0.0}}
    return plan({"k": args.tasks}, seconds, POOLS, WORKERS, egress=egress, **kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=96)
    ap.add_argument("--work", type=float, default=0.5)
    ap.add_argument("--deadline", type=float, default=None)
    args = ap.parse_args(argv)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    slow_alone = args.tasks * args.work / WORKERS["slow"]
    deadline = args.deadline or round(slow_alone * 2 / 3, 2)
    fastest, cheapest = lp(args), lp(args, deadline=1e9)
    # the fixed split a user who knows the nominal speeds picks for deadline D: the LP's
    # tasks on the fast pool at D, rounded up (the best any fixed split can do)
    split_d = math.ceil(lp(args, deadline=deadline).tasks["k"].get("fast", 0.0) - 1e-6)
    budget = round((fastest.cost + cheapest.cost) / 2, 6)
    task_cost = args.work / FAST.speed * FAST.price / 3600  # one task on the fast pool
    results: dict[str, list[dict]] = {}
    for rep in range(args.reps):
        try:
            one_rep(rep, args, deadline, budget, results, split_d)
        except TimeoutError as e:  # a cluster that does not close in time on a loaded host
            print(f"rep {rep}: cluster teardown timed out ({e!r}); its cells are kept",
                  file=sys.stderr)
    def med(name, key):
        return statistics.median(r[key] for r in results[name]) if results.get(name) \
            else float("nan")

    bound = {"cost": lp(args, deadline=deadline), "budget": lp(args, budget=budget),
             "egress": lp(args, deadline=deadline, inputs=True),
             "default": fastest, "all-fast": fastest, "split": fastest,
             "split@D": lp(args, deadline=deadline)}
    eq_deadline = med("cost@all-fast", "deadline")
    bound["cost@all-fast"] = lp(args, deadline=eq_deadline)
    counts = sorted({len(v) for v in results.values()})
    print(f"# blockflow pools benchmark ({time.strftime('%Y-%m-%d')}), medians of "
          f"{'/'.join(map(str, counts))} of {args.reps} repetitions; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end: {args.tasks} tasks x {args.work} reference-s; fast pool: 2 workers "
          f"speed 4 $4/h (gcp); slow pool: 4 workers speed 1 $0.5/h (aws, egress $0.09/GB)")
    print(f"# slow pool alone: {slow_alone:.2f} s; deadline D = {deadline:g} s; budget "
          f"B = ${budget:.6f}; one fast task costs ${task_cost:.6f}")
    print(f"{'configuration':<16}{'makespan s':>11}{'cost $':>11}{'LP cost $':>11}"
          f"{'cost/LP':>9}{'LP makesp':>10}{'mk/LP':>7}{'fast tasks':>11}{'egress MB':>10}")
    for name in ["cost", "all-fast", "split", "split@D", "cost@all-fast", "budget",
                 "default", "egress"]:
        b = bound[name]
        mk, cst = med(name, "makespan"), med(name, "cost")
        print(f"{name:<16}{mk:>11.2f}{cst:>11.6f}{b.cost:>11.6f}{cst / b.cost:>9.2f}"
              f"{b.makespan:>10.2f}{mk / b.makespan:>7.2f}{med(name, 'fast_tasks'):>11.0f}"
              f"{med(name, 'egress_bytes') / 1e6:>10.0f}")
    cost, allfast, split = (med(n, "cost") for n in ("cost", "all-fast", "split"))
    eqc = med("cost@all-fast", "cost")
    print("# targets")
    print(f"cost objective: cost / LP bound = {cost / bound['cost'].cost:.3f} (target <= "
          f"1.05); deadline met in {sum(r['makespan'] <= deadline for r in results.get('cost', []))}"
          f" of {len(results.get('cost', []))} (median {med('cost', 'makespan'):.2f} s <= {deadline:g} s)")
    print(f"vs all-fast: cost {allfast / cost:.2f}x lower at makespan "
          f"{med('cost', 'makespan'):.2f} vs {med('all-fast', 'makespan'):.2f} s; at equal "
          f"makespan (deadline {eq_deadline:g} s): {allfast / eqc:.2f}x lower, makespan "
          f"{med('cost@all-fast', 'makespan'):.2f} s (target >= 1.3x)")
    print(f"vs fixed split (half the tasks on each pool): cost {split / cost:.2f}x lower at "
          f"makespan {med('cost', 'makespan'):.2f} vs {med('split', 'makespan'):.2f} s; at "
          f"about equal makespan (cost@all-fast, {med('cost@all-fast', 'makespan'):.2f} s): "
          f"{split / eqc:.2f}x (target >= 1.3x)")
    print(f"vs the best fixed split for D ({split_d} of {args.tasks} tasks on the fast "
          f"pool, the LP's share: what a user who knows the nominal speeds picks): cost "
          f"{med('split@D', 'cost') / cost:.2f}x lower at makespan {med('cost', 'makespan'):.2f}"
          f" vs {med('split@D', 'makespan'):.2f} s (1.0x is the most any policy can reach "
          f"against it: with one task group that split is the LP optimum)")
    extra = max((r["completions"] - r["submitted"] for rs in results.values() for r in rs),
                default=0)
    print(f"extra task completions (results computed twice) in any cell: {extra}")
    over = max((r["cost"] - budget for r in results.get("budget", [])), default=math.nan)
    print(f"budget: makespan / LP bound = {med('budget', 'makespan') / bound['budget'].makespan:.3f}"
          f" (target <= 1.10); worst overspend ${over:.6f} = {over / task_cost:.2f} fast "
          f"tasks (target <= 1)")
    need = bound["egress"].tasks["k"].get("fast", 0.0) * INPUT_BYTES
    print(f"egress: bytes leaving aws {med('egress', 'egress_bytes') / 1e6:.0f} MB, the "
          f"deadline needs {need / 1e6:.0f} MB (LP)")
    print(f"default objective: makespan / LP {med('default', 'makespan') / fastest.makespan:.2f}"
          f" (no objective: nothing parked; see heterogeneous.py for the unchanged figures)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
