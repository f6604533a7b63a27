"""The router's tail and fairness on uneven simulated devices (issue 39), beside simulations.

One cluster of simulated devices (speeds 2, 1, 1, 0.5 by default, worker processes, 1 thread
each), single-row-like requests of ``--request-seconds`` at speed 1:

1. **Tail** at each ``--load`` (fraction of capacity, sum of speeds / request seconds) under
   Poisson arrivals, the same arrivals for every run: :class:`blockflow.Router`, then with
   ``--plain`` plain Dask (``client.submit`` per request, Dask's placement); beside them,
   on the same arrivals with exact speeds and no overhead, the shortest-expected-finish
   simulation (each request joins the device queue where it ends first) and the Router's own
   policy simulated (:func:`blockflow.ml._fair_queue.simulate`). Reported: p50, p99,
   p99/p50, served/s, each device's share of requests against its speed share, and the
   idle-while-queued share of events (``benchmarks/inference.py``'s measure).
2. **Fairness**: a light caller (one request at a time, ``--think`` seconds between) alone,
   then beside a flooding caller (Poisson at ``--flood`` x capacity), ``--window`` seconds
   each: the light caller's answered requests per second in each, and their ratio.

    python benchmarks/routing.py --requests 400 --window 3            # smoke, ~1 min
    python benchmarks/routing.py --requests 3000 --window 10 --plain  # full

The Router before issue 39 is measured with the same script from an export of the earlier
commit (``PYTHONPATH=<export>``; callers are then one FIFO).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import threading
import time

import numpy as np
from dask.utils import parse_timedelta

import blockflow
from blockflow import config
from blockflow.ml._fair_queue import simulate
from blockflow.scheduling.view import workers_info
from blockflow.testing import simulated_cluster

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from inference import TimedModel, idle_while_queued, poisson_run  # noqa: E402


def _task(model, batch):
    return model(batch)


def _stats(kind, lat, run, speeds, speed_of_pid) -> dict:
    pids = [s[3] for s in run["stamps"] if s is not None]
    counts = np.bincount([speed_of_pid[p] for p in pids], minlength=len(speeds))
    return {"run": kind, "p50": float(np.percentile(lat, 50)),
            "p99": float(np.percentile(lat, 99)), "answered": len(lat),
            "served": len(lat) / run["ended"], "shares": counts / max(counts.sum(), 1),
            "idle": idle_while_queued(run["stamps"])}


def _sim(kind, arrivals, speeds, seconds, policy, batch_seconds) -> dict:
    r = simulate(list(arrivals), speeds, seconds=seconds, policy=policy,
                 batch_seconds=batch_seconds)
    lat = np.array(r["latency"])
    counts = np.bincount(r["device"], minlength=len(speeds))
    return {"run": kind, "p50": float(np.percentile(lat, 50)),
            "p99": float(np.percentile(lat, 99)), "answered": len(lat), "served": None,
            "shares": counts / counts.sum(), "idle": None}


def tail(client, args, speeds, speed_of_pid, load) -> list[dict]:
    rows = 1
    model = TimedModel(16, 0.01, args.request_seconds / rows)
    batch = np.ones((rows, 16))
    rate = load * sum(speeds) / args.request_seconds
    out = []
    router = blockflow.Router(client, model, batch_seconds=args.batch_seconds)
    for f in router.map([batch] * 8):  # warm: every worker loads the model, speeds measured
        f.result()
    lat, _, run = poisson_run(lambda b, done: router.submit(b).add_done_callback(done),
                              args.requests, rate, batch, seed=int(load * 100))
    router.close()
    out.append(_stats("blockflow.Router", lat, run, speeds, speed_of_pid))
    if args.plain:
        ref = client.scatter(model, broadcast=True)
        lat, _, run = poisson_run(
            lambda b, done: client.submit(_task, ref, b, pure=False).add_done_callback(done),
            args.requests, rate, batch, seed=int(load * 100))
        out.append(_stats("plain Dask", lat, run, speeds, speed_of_pid))
    arrivals = np.cumsum(np.random.default_rng(int(load * 100)).exponential(1 / rate,
                                                                           args.requests))
    bs = parse_timedelta(config.get("routing.batch-seconds", args.batch_seconds))
    out.append(_sim("SEF simulation", arrivals, speeds, args.request_seconds, "sef", bs))
    out.append(_sim("Router policy sim.", arrivals, speeds, args.request_seconds, "router", bs))
    for r in out:
        print(load, r, file=sys.stderr)
    return out


def fairness(client, args, speeds) -> dict:
    model = TimedModel(16, 0.01, args.request_seconds)
    batch = np.ones((1, 16))
    router = blockflow.Router(client, model, batch_seconds=args.batch_seconds)
    takes_caller = "caller" in inspect.signature(router.submit).parameters
    for f in router.map([batch] * 8):
        f.result()

    def light(stop, served):
        while not stop.is_set():
            kw = {"caller": "light"} if takes_caller else {}
            try:
                router.submit(batch, **kw).result(timeout=60)
            except Exception:
                return
            if not stop.is_set():
                served.append(time.perf_counter())
            time.sleep(args.think)

    def flood(stop, rate):
        rng = np.random.default_rng(1)
        t0, t, kw = time.perf_counter(), 0.0, {"caller": "flood"} if takes_caller else {}
        while not stop.is_set():
            t += rng.exponential(1 / rate)
            delay = t0 + t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            router.submit(batch, **kw)

    rates = {}
    for name, flooding in (("alone", False), ("beside a flood", True)):
        stop, served = threading.Event(), []
        threads = [threading.Thread(target=light, args=(stop, served))]
        if flooding:
            threads.append(threading.Thread(target=flood, args=(
                stop, args.flood * sum(speeds) / args.request_seconds)))
        for t in threads:
            t.start()
        time.sleep(args.window)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        rates[name] = len(served) / args.window
        print(name, rates[name], router.stats()["counts"], file=sys.stderr)
    router.close()
    return rates


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--speeds", default="2,1,1,0.5")
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--request-seconds", type=float, default=0.01)
    p.add_argument("--load", default="0.4,0.6,0.8")
    p.add_argument("--flood", type=float, default=2.0, help="flood rate, x capacity")
    p.add_argument("--think", type=float, default=0.1, help="light caller's pause, s")
    p.add_argument("--window", type=float, default=5.0, help="fairness window, s")
    p.add_argument("--parts", default="tail,fairness")
    p.add_argument("--plain", action="store_true", help="also plain Dask, one task per "
                   "request (a host that cannot run ~400 tasks/s queues for minutes)")
    p.add_argument("--batch-seconds", default=None, help="Router batch_seconds (default: "
                   "config blockflow.routing.batch-seconds)")
    args = p.parse_args(argv)
    speeds = [float(s) for s in args.speeds.split(",")]
    loads = [float(x) for x in args.load.split(",")]
    parts = set(args.parts.split(","))
    tails, fair = [], None
    cluster = simulated_cluster(speeds=speeds, processes=True)
    client = cluster.__enter__()
    try:
        workers = workers_info(client)
        pids = client.run(os.getpid)
        speed_of_pid = {pids[a]: int(w["name"]) for a, w in workers.items()}
        if "tail" in parts:
            tails = [(load, tail(client, args, speeds, speed_of_pid, load)) for load in loads]
        if "fairness" in parts:
            fair = fairness(client, args, speeds)
    finally:
        try:
            cluster.__exit__(None, None, None)
        except Exception as e:  # a loaded host's nannies may time out on close
            print(f"closing the cluster: {e!r}", file=sys.stderr)
    share = np.array(speeds) / sum(speeds)
    print(f"# blockflow router: speeds {speeds}, requests of {args.request_seconds} s at "
          f"speed 1, load average {os.getloadavg()[0]:.1f} at the end")
    for load, rows in tails:
        rate = load * sum(speeds) / args.request_seconds
        print(f"\n## {args.requests} requests, Poisson at {load:.0%} of capacity "
              f"({rate:.0f}/s)")
        print(f"{'run':<20} {'p50 ms':>7} {'p99 ms':>7} {'p99/p50':>7} {'served/s':>8} "
              f"{'idle-while-queued':>17}  shares (speed shares "
              f"{' '.join(f'{s:.3f}' for s in share)})")
        for r in rows:
            served = "-" if r["served"] is None else f"{r['served']:.0f}"
            idle = "-" if r["idle"] is None else f"{r['idle']:.1%}"
            print(f"{r['run']:<20} {r['p50'] * 1e3:>7.1f} {r['p99'] * 1e3:>7.1f} "
                  f"{r['p99'] / r['p50']:>7.2f} {served:>8} {idle:>17}  "
                  f"{' '.join(f'{s:.3f}' for s in r['shares'])}")
    if fair:
        alone, flooded = fair["alone"], fair["beside a flood"]
        print(f"\n## Fairness: light caller (one request, then {args.think} s) beside a "
              f"caller flooding at {args.flood}x capacity, {args.window} s windows")
        print(f"light caller alone {alone:.1f}/s, beside the flood {flooded:.1f}/s: "
              f"{flooded / max(alone, 1e-9):.0%} of its rate alone")


if __name__ == "__main__":
    main()
