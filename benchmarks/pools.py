"""Pools benchmark: the cost and budget objectives beside an independent LP and the baselines.

Two scenarios on simulated pools, each in its own cluster, every configuration side by side:

* ``matrix`` (issue 37): three pools on two providers - ``cpu`` (aws, $0.5/h, 3 workers,
  egress $0.09/GB), ``mid`` (aws, $1.5/h, 1 worker), ``gpu`` (gcp, $4/h, 1 worker); two task
  groups whose speed-ups differ per pool (``etl`` 1/1.5/2x, ``train`` 1/3/8x: a throughput
  matrix as in Gavel); every task reads a 20 MB input made on ``cpu`` (aws) by an earlier
  step (before the run's clock starts), so a task on ``gpu`` pays egress.
* ``single`` (issue 29): ``fast`` (gcp, speed 4, $4/h, 2 workers) and ``slow`` (aws,
  speed 1, $0.5/h, 4 workers), one group, no inputs.

Configurations (each a fresh run on the scenario's cluster):

* ``cost``: ``blockflow.objective("cost", deadline=D)``, D = ``--slack`` (1.15) x the LP's
  shortest makespan;
* ``budget``: ``blockflow.objective("makespan", budget=B)``, B = ``--budget-x`` (1.2) x the
  LP's cheapest cost;
* ``plain``: no objective, no blockflow plugin placement beyond the default policy's;
* ``static``: one cluster per pool, each group split across pools by the pools' declared
  speeds x workers (``resources={"pool:<name>": 1}``);
* ``fastest``: all work on the fastest pool;
* ``lp@D``: the LP's own plan at the deadline D, its tasks per (group, pool) rounded and
  pinned by hand (``resources=``): what the machine allows the plan, with no policy.

Cost is computed here, independently of the plugin: a worker (present before the run) is
billed from its first task of the run to the run's end, idle included (the plugin's
:func:`blockflow.pools.plan.run_cost` model); egress = the input bytes of every task that ran
on another provider than its input (counted from the tasks' own records) x the sending pool's
price. The LP bound: ``scipy.optimize.linprog`` over the nominal throughput matrix written out
here (not :func:`blockflow.pools.plan.plan`), egress included. ``egress counted`` is the
plugin's report over this count. Medians over ``--reps``.

* ``concurrent`` (issue 39): the ``single`` pools, two clients at once, run ``A``
  (``--concurrent-tasks`` tasks, ``blockflow.objective("cost", deadline=D)``, D =
  ``--concurrent-slack`` (1.3) x the shortest makespan of both runs' work together) and run
  ``B`` (as many tasks, ``objective("makespan", budget=B)``, B = ``--budget-x`` x B's
  cheapest cost alone), submitted together; beside ``plain`` (the same two runs, no
  objective). Bound: an LP over both runs written out here (time cut at D; B's end T
  before or after it, both tried; min T, then A's dollars), not
  :func:`blockflow.pools.plan.plan_runs`. ``told``: the runs whose miss was one line.

    python benchmarks/pools.py              # 3 repetitions (~15 min on a loaded 2-core host)
    python benchmarks/pools.py --reps 1     # a check
    python benchmarks/pools.py --scenarios concurrent --reps 1 --concurrent-tasks 40  # smoke
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
from distributed import get_worker, wait
from scipy.optimize import linprog

import blockflow
from blockflow.cluster.report import pool_costs
from blockflow.pools.pool import Pool
from blockflow.scheduling import Rebalancer
from blockflow.scheduling.runs import run_scope
from blockflow.testing.cluster import simulated_cluster
from blockflow.testing.simulated import simulated_kernel
from blockflow.testing.simulated_device import SimulatedDeviceBlock

INPUT = 20_000_000
SCENARIOS = {
    "matrix": {
        "pools": {Pool("cpu", provider="aws", price=0.5, egress=0.09,
                       speed={"etl": 1, "train": 1}): 3,
                  Pool("mid", provider="aws", price=1.5, speed={"etl": 1.5, "train": 3}): 1,
                  Pool("gpu", provider="gcp", price=4.0, speed={"etl": 2, "train": 8}): 1},
        "work": {"etl": 0.4, "train": 0.8}, "tasks": {"etl": 80, "train": 80},
        "inputs": "cpu"},
    "single": {
        "pools": {Pool("fast", provider="gcp", price=4.0, speed=4): 2,
                  Pool("slow", provider="aws", price=0.5, speed=1, egress=0.09): 4},
        "work": {"k": 0.5}, "tasks": {"k": 160}, "inputs": None},
}


def make_input(i: int) -> SimulatedDeviceBlock:
    return SimulatedDeviceBlock(np.int64(i), INPUT)


def _kernel(x, work):
    t0 = time.time()
    simulated_kernel(x, work=work)
    nbytes = x.nbytes if isinstance(x, SimulatedDeviceBlock) else 0
    return get_worker().address, t0, time.time(), nbytes


def etl(x, work):
    return _kernel(x, work)


def train(x, work):
    return _kernel(x, work)


def k(x, work):
    return _kernel(x, work)


KERNELS = {"etl": etl, "train": train, "k": k}


# --- the independent LP --------------------------------------------------------------------

def lp(sc, *, deadline=None, budget=None):
    """(cost $, makespan s, tasks per (group, pool)) of the LP over the nominal matrix."""
    pools = {p.name: (p, n) for p, n in sc["pools"].items()}
    groups = list(sc["tasks"])
    src = next((p for p, _ in pools.values() if p.name == sc["inputs"]), None)
    var = [(g, q) for g in groups for q in pools]
    sec = {(g, q): sc["work"][g] / pools[q][0].speed_of(g) for g, q in var}
    egress = {(g, q): (INPUT / 1e9 * src.egress if src is not None
                       and pools[q][0].provider != src.provider else 0.0) for g, q in var}
    usd = np.array([sec[v] * pools[v[1]][0].price / 3600 + egress[v] for v in var])
    load = np.array([[sec[v] if v[1] == q else 0.0 for v in var] for q in pools])
    cap = np.array([float(pools[q][1]) for q in pools])
    a_eq = np.array([[1.0 if v[0] == g else 0.0 for v in var] for g in groups])
    b_eq = np.array([float(sc["tasks"][g]) for g in groups])
    if deadline is not None:
        r = linprog(usd, A_ub=load, b_ub=cap * deadline, A_eq=a_eq, b_eq=b_eq,
                    method="highs")
        return float(r.fun), deadline, dict(zip(var, r.x))
    n = len(var)
    c = np.zeros(n + 1)
    c[-1] = 1.0
    a_ub = np.hstack([load, -cap[:, None]])
    b_ub = np.zeros(len(pools))
    if budget is not None:
        a_ub = np.vstack([a_ub, np.append(usd, 0.0)])
        b_ub = np.append(b_ub, budget)
    r = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=np.hstack([a_eq, np.zeros((len(groups), 1))]),
                b_eq=b_eq, method="highs")
    return float(usd @ r.x[:n]), float(r.x[-1]), dict(zip(var, r.x[:n]))


# --- running one configuration --------------------------------------------------------------

def run_config(client, sc, name, *, deadline=None, budget=None, placement=None) -> dict:
    """One run: returns makespan, cost (independent), egress bytes (independent and plugin's)."""
    pools = {p.name: p for p in sc["pools"]}
    addr_pool = {a: p for p, info in blockflow.plugin_status(client)["pools"].items()
                 for a in info["workers"]}
    inputs = {}
    for g, n in sc["tasks"].items():  # made on the cheap provider by an earlier step
        inputs[g] = (client.map(make_input, range(n), pure=False,
                                resources={f"pool:{sc['inputs']}": 1},
                                key=[f"input-{g}-{time.time()}-{i}" for i in range(n)])
                     if sc["inputs"] else list(range(n)))
    if sc["inputs"]:
        wait([x for xs in inputs.values() for x in xs])
    t0 = time.time()
    with run_scope(f"pools-{name}-{t0}"):
        ctx = (blockflow.objective("cost", deadline=deadline) if deadline is not None
               else blockflow.objective("makespan", budget=budget) if budget is not None
               else blockflow.objective())
        futures = []
        with ctx:
            for g, n in sc["tasks"].items():
                xs = inputs[g]
                where = (placement or {}).get(g)
                for i, x in enumerate(xs):
                    res = {f"pool:{where[i]}": 1} if where else None
                    futures.append(client.submit(KERNELS[g], x, sc["work"][g], pure=False,
                                                 resources=res, key=f"{g}-{t0}-{i}"))
            wait(futures)
    end = time.time()
    makespan = end - t0
    records = client.gather(futures)
    time.sleep(0.3)
    first, crossed, egress_usd = {}, 0, 0.0
    src = pools.get(sc["inputs"]) if sc["inputs"] else None
    for addr, s0, s1, nbytes in records:
        first[addr] = min(first.get(addr, s0), s0)
        p = pools[addr_pool[addr]]
        if src is not None and p.provider != src.provider:
            crossed += nbytes
            egress_usd += nbytes / 1e9 * src.egress
    compute = sum((end - s0) * pools[addr_pool[a]].price / 3600 for a, s0 in first.items())
    report = pool_costs(client) or {}
    counted = (report.get("egress") or {}).get("bytes", 0)
    del futures
    return {"makespan": makespan, "cost": compute + egress_usd, "crossed": crossed,
            "counted": counted, "report_cost": report.get("total_cost", math.nan),
            "per_pool": {q: sum(1 for a, *_ in records if addr_pool[a] == q) for q in pools}}


def lp_split(sc, deadline):
    """Group -> pool per task: the LP's plan at ``deadline``, rounded (largest remainders)."""
    _, _, x = lp(sc, deadline=deadline)
    out = {}
    for g, n in sc["tasks"].items():
        shares = {q: x[(g, q)] for (h, q) in x if h == g}
        counts = {q: int(v) for q, v in shares.items()}
        for q in sorted(shares, key=lambda q: shares[q] - counts[q], reverse=True):
            if sum(counts.values()) < n:
                counts[q] += 1
        out[g] = [q for q, c in counts.items() for _ in range(c)]
    return out


def static_split(sc, only=None):
    """Group -> pool per task: ``only``, or split by declared speed x workers."""
    out = {}
    for g, n in sc["tasks"].items():
        if only:
            out[g] = [only] * n
            continue
        weight = {p.name: p.speed_of(g) * w for p, w in sc["pools"].items()}
        total = sum(weight.values())
        shares, seq = {}, []
        for q, wgt in weight.items():
            shares[q] = wgt / total * n
        counts = {q: int(s) for q, s in shares.items()}
        for q in sorted(shares, key=lambda q: shares[q] - counts[q], reverse=True):
            if sum(counts.values()) < n:
                counts[q] += 1
        for q, c in counts.items():
            seq += [q] * c
        out[g] = seq
    return out


def one_rep(rep, scenario, sc, args, results):
    with simulated_cluster(pools=sc["pools"]) as c:
        c.register_plugin(Rebalancer(policy="dynamic"))
        # each group measured once, as a user's second run finds it (two tasks per worker)
        n = 2 * sum(sc["pools"].values())
        for g in sc["tasks"]:
            c.gather(c.map(KERNELS[g], range(n), work=sc["work"][g], pure=False,
                           key=[f"{g}-{i}" for i in range(n)]))
        tmin = lp(sc)[1]
        deadline = round(args.slack * tmin, 2)
        budget = args.budget_x * lp(sc, deadline=1e9)[0]
        fastest = max(sc["pools"], key=lambda p: p.speed_of(None)).name
        cells = [("cost", dict(deadline=deadline)), ("budget", dict(budget=budget)),
                 ("plain", {}), ("static", dict(placement=static_split(sc))),
                 ("fastest", dict(placement=static_split(sc, fastest))),
                 ("lp@D", dict(placement=lp_split(sc, deadline)))]
        if rep % 2:
            cells.reverse()
        for name, kw in cells:
            r = run_config(c, sc, name, **kw)
            r.update(deadline=deadline, budget=budget)
            results.setdefault((scenario, name), []).append(r)
            print(f"rep {rep} {scenario} {name}: " + ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
                file=sys.stderr)


# --- two runs at once -------------------------------------------------------------------

def joint_lp(sc, n_a, n_b, deadline, budget):
    """(A's cost $, B's end T s) of the LP over both runs: A's tasks within ``deadline``, B's
    within T and ``budget``, each pool's load within its workers' time in [0, D] and
    [D, T] (or [0, T], [T, D]); min T, then A's dollars. Independent of blockflow's."""
    pools = [(p, n) for p, n in sc["pools"].items()]
    work = sc["work"]["k"]
    sec = [work / p.speed_of("k") for p, _ in pools]
    usd = [t * p.price / 3600 for t, (p, _) in zip(sec, pools)]
    cap = [float(n) for _, n in pools]
    m = len(pools)
    best = None
    for b_first in (True, False):
        # variables: a[p, s], b[p, s] for slices s = 0, 1; T
        idx = {}
        for who in "ab":
            for q in range(m):
                for sl in (0, 1):
                    idx[(who, q, sl)] = len(idx)
        t = len(idx)
        n = t + 1
        a_ub, b_ub, a_eq, b_eq, bounds = [], [], [], [], [(0, None)] * t
        for q in range(m):
            for sl in (0, 1):
                row = np.zeros(n)
                row[idx[("a", q, sl)]] = row[idx[("b", q, sl)]] = sec[q]
                if b_first:  # slices [0, T], [T, D]
                    row[t] = -cap[q] if sl == 0 else cap[q]
                    rhs = 0.0 if sl == 0 else cap[q] * deadline
                else:  # slices [0, D], [D, T]
                    row[t] = 0.0 if sl == 0 else -cap[q]
                    rhs = cap[q] * deadline if sl == 0 else -cap[q] * deadline
                a_ub.append(row)
                b_ub.append(rhs)
        for who, count in (("a", n_a), ("b", n_b)):
            row = np.zeros(n)
            for q in range(m):
                for sl in (0, 1):
                    row[idx[(who, q, sl)]] = 1.0
            a_eq.append(row)
            b_eq.append(float(count))
        row = np.zeros(n)
        for q in range(m):
            for sl in (0, 1):
                row[idx[("b", q, sl)]] = usd[q]
        a_ub.append(row)
        b_ub.append(budget)
        # A only before D; B only before T
        for q in range(m):
            if b_first:  # B in slice 0 only
                bounds[idx[("b", q, 1)]] = (0, 0)
            else:  # A in slice 0 only
                bounds[idx[("a", q, 1)]] = (0, 0)
        bounds = bounds + [(0, deadline) if b_first else (deadline, None)]
        c = np.zeros(n)
        c[t] = 1.0
        r = linprog(c, A_ub=np.array(a_ub), b_ub=b_ub, A_eq=np.array(a_eq), b_eq=b_eq,
                    bounds=bounds, method="highs")
        if r.status != 0:
            continue
        big_t = float(r.x[t])
        bounds[-1] = (bounds[-1][0], big_t * (1 + 1e-6) + 1e-9)
        c = np.zeros(n)
        for q in range(m):
            for sl in (0, 1):
                c[idx[("a", q, sl)]] = usd[q]
        r = linprog(c, A_ub=np.array(a_ub), b_ub=b_ub, A_eq=np.array(a_eq), b_eq=b_eq,
                    bounds=bounds, method="highs")
        if r.status == 0 and (best is None or big_t < best[1]):
            best = (float(r.fun), big_t)
    return best if best is not None else (math.nan, math.nan)


def run_two(c, other, sc, name, n_a, n_b, deadline, budget) -> dict:
    """Runs A (``c``, a deadline) and B (``other``, a budget) at once; with ``name``
    "plain" no objective. Each run's makespan, and its cost billed here (a worker from its
    first task of the run to the run's end), and the objective lines told per run."""
    pools = {p.name: p for p in sc["pools"]}
    addr_pool = {a: p for p, info in blockflow.plugin_status(c)["pools"].items()
                 for a in info["workers"]}
    t0 = time.time()
    work = sc["work"]["k"]
    runs, futures = {}, {}
    for who, client, n, ctx in (
            ("A", c, n_a, blockflow.objective("cost", deadline=deadline)),
            ("B", other, n_b, blockflow.objective("makespan", budget=budget))):
        with run_scope(f"pools-{name}-{who}-{t0}") as run_id, (
                ctx if name != "plain" else blockflow.objective()):
            futures[who] = [client.submit(k, i, work, pure=False, key=f"k-{t0}-{who}{i}")
                            for i in range(n)]
        runs[who] = run_id
    out = {}
    for who, client in (("A", c), ("B", other)):
        records = client.gather(futures[who])
        end = max(s1 for _, _, s1, _ in records)
        first: dict = {}
        for addr, s0, _, _ in records:
            first[addr] = min(first.get(addr, s0), s0)
        out[f"{who}_makespan"] = end - t0
        out[f"{who}_cost"] = sum((end - s0) * pools[addr_pool[a]].price / 3600
                                 for a, s0 in first.items())
    time.sleep(0.3)
    decisions = blockflow.plugin_status(c)["decisions"]
    out["told"] = "".join(who for who, rid in runs.items() if any(
        d["action"] == "objective" and d.get("seen_run") == rid for d in decisions))
    return out


def concurrent_rep(rep, sc, args, results):
    from distributed import Client

    n = args.concurrent_tasks
    try:
        _concurrent_rep(rep, sc, args, results, n, Client)
    except TimeoutError:  # closing the cluster on a loaded host; the results are in
        print(f"rep {rep} concurrent: the cluster closed late", file=sys.stderr)


def _concurrent_rep(rep, sc, args, results, n, Client):
    with simulated_cluster(pools=sc["pools"]) as c:
        c.register_plugin(Rebalancer(policy="dynamic"))
        other = Client(c.scheduler.address, set_as_default=False)
        try:
            m = 2 * sum(sc["pools"].values())
            c.gather(c.map(k, range(m), work=sc["work"]["k"], pure=False,
                           key=[f"k-{i}" for i in range(m)]))
            both = {**sc, "tasks": {"k": 2 * n}}
            deadline = round(args.concurrent_slack * lp(both)[1], 2)
            budget = args.budget_x * lp({**sc, "tasks": {"k": n}}, deadline=1e9)[0]
            cells = ["joint", "plain"] if rep % 2 == 0 else ["plain", "joint"]
            for name in cells:
                r = run_two(c, other, sc, name, n, n, deadline, budget)
                r.update(deadline=deadline, budget=budget)
                results.setdefault(("concurrent", name), []).append(r)
                print(f"rep {rep} concurrent {name}: " + ", ".join(
                    f"{key}={v:.4g}" if isinstance(v, float) else f"{key}={v}"
                    for key, v in r.items()), file=sys.stderr)
        finally:
            other.close()


def concurrent_table(results, args):
    sc = SCENARIOS["single"]
    n = args.concurrent_tasks
    rs = results[("concurrent", "joint")]
    deadline, budget = rs[0]["deadline"], rs[0]["budget"]
    a_cost, t_b = joint_lp(sc, n, n, deadline, budget)
    print(f"\n# concurrent: A {n} tasks, deadline {deadline:g} s; B {n} tasks, budget "
          f"${budget:.5f}; joint LP bound: A ${a_cost:.6f} by {deadline:g} s, B ends "
          f"{t_b:.2f} s")
    print(f"{'config':<8}{'A mk':>7}{'A met':>6}{'A $':>10}{'A $/LP':>7}{'B mk':>7}"
          f"{'B mk/LP':>8}{'B $':>10}{'B over':>9}{'missed':>7}{'told':>6}")
    for name in ("joint", "plain"):
        rs = results[("concurrent", name)]

        def med(f):
            return statistics.median(r[f] for r in rs)

        met = sum(r["A_makespan"] <= r["deadline"] for r in rs)
        over = max(r["B_cost"] - r["budget"] for r in rs)
        missed = sum((r["A_makespan"] > r["deadline"]) + (r["B_cost"] > r["budget"])
                     for r in rs)
        told = sum(len(r["told"]) for r in rs)
        print(f"{name:<8}{med('A_makespan'):>7.2f}{met:>6}{med('A_cost'):>10.6f}"
              f"{med('A_cost') / a_cost:>7.2f}{med('B_makespan'):>7.2f}"
              f"{med('B_makespan') / t_b:>8.2f}{med('B_cost'):>10.6f}{over:>+9.5f}"
              f"{missed:>7}{told:>6}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slack", type=float, default=1.15)
    ap.add_argument("--budget-x", type=float, default=1.2)
    ap.add_argument("--scenarios", default="matrix,single,concurrent")
    ap.add_argument("--concurrent-tasks", type=int, default=80)
    ap.add_argument("--concurrent-slack", type=float, default=1.3)
    args = ap.parse_args(argv)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    results: dict = {}
    names = args.scenarios.split(",")
    concurrent = "concurrent" in names
    names = [s for s in names if s != "concurrent"]
    for rep in range(args.reps):
        for scenario in names:
            one_rep(rep, scenario, SCENARIOS[scenario], args, results)
        if concurrent:
            concurrent_rep(rep, SCENARIOS["single"], args, results)

    def med(key, field):
        return statistics.median(r[field] for r in results[key])

    print(f"# blockflow pools benchmark ({time.strftime('%Y-%m-%d')}), medians of "
          f"{args.reps}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
          f"deadline {args.slack}x the LP's shortest makespan, budget {args.budget_x}x the "
          f"LP's cheapest cost")
    print(f"{'scenario':<8}{'config':<9}{'makespan':>9}{'LP mk':>7}{'mk/LP':>7}{'cost $':>10}"
          f"{'LP $':>10}{'cost/LP':>8}{'met':>5}{'over B':>8}{'egress':>8}  tasks per pool")
    for scenario in names:
        sc = SCENARIOS[scenario]
        tmin = lp(sc)[1]
        deadline = round(args.slack * tmin, 2)
        budget = args.budget_x * lp(sc, deadline=1e9)[0]
        bound = {"cost": lp(sc, deadline=deadline), "budget": lp(sc, budget=budget),
                 "lp@D": lp(sc, deadline=deadline)}
        for name in ("cost", "budget", "plain", "static", "fastest", "lp@D"):
            rs = results[(scenario, name)]
            b = bound.get(name, lp(sc))
            mk, cst = med((scenario, name), "makespan"), med((scenario, name), "cost")
            met = (sum(r["makespan"] <= r["deadline"] for r in rs)
                   if name in ("cost", "lp@D") else "")
            over = (f"{max(r['cost'] - r['budget'] for r in rs):+.5f}" if name == "budget"
                    else "")
            crossed = sum(r["crossed"] for r in rs)
            eg = (f"{sum(r['counted'] for r in rs) / crossed:.0%}" if crossed else "-")
            per = {q: statistics.median(r["per_pool"][q] for r in rs) for q in rs[0]["per_pool"]}
            print(f"{scenario:<8}{name:<9}{mk:>9.2f}{b[1]:>7.2f}{mk / b[1]:>7.2f}{cst:>10.6f}"
                  f"{b[0]:>10.6f}{cst / b[0]:>8.2f}{met!s:>5}{over:>8}{eg:>8}  {per}")
    if concurrent:
        concurrent_table(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
