"""Batch inference and request routing on uneven simulated devices (issue 13's targets).

One cluster of simulated GPU workers (speeds 1, 1, 0.5, 0.25 by default, worker processes,
1 thread each), one run, side by side:

1. **Batch inference** over ``--blocks`` row blocks of ``--block-seconds`` reference-seconds
   each, with a model of ``--model-mib`` MiB of weights:

   * plain Dask: ``dask.array.map_blocks`` with the model in the graph (no blockflow plugin);
   * blockflow: :func:`blockflow.predict` (model shipped once per worker) with blockflow's
     scheduler plugin (policy ``dynamic``: learned speeds).

   Reported: makespan, its ratio to the ideal (total work / total speed), and the model bytes
   each run ships (plain: the model's bytes in every task's pickled spec, measured by
   pickling the tasks; blockflow: the bytes the workers' model caches received).
2. **Routing** under Poisson arrivals at ``--load`` of total capacity, ``--requests``
   requests of ``--request-seconds`` each: :class:`blockflow.Router` against round-robin and
   power-of-two-choices (both implemented here with the same task submission), p50/p99
   latency from arrival to answer.
   Also reported: served requests/s against the offered rate and the nominal capacity
   (sum of speeds / ``--request-seconds``), the p50 of the last quarter of requests against
   the first (a queue that grows all run shows as a ratio well above 1), and the
   idle-while-queued fraction: of the events (an arrival, a start, an end of service), the
   share at which some worker serves nothing while another has a queue (a request that has
   arrived, and that the other worker serves later, waits unstarted); measured from the
   model's own start/end stamps on the workers, so the same for every router. ``--load`` takes several loads (``0.4,0.8``).
3. **Lost worker**: the router's run again, one worker process killed (SIGKILL) a third of
   the way through: requests lost and answered twice.

    python benchmarks/inference.py                    # defaults, ~3 min here
    python benchmarks/inference.py --blocks 40 --requests 60   # smoke
    # the router alone, short requests (per-task overhead shows), two loads:
    python benchmarks/inference.py --parts routing --routers router \
        --request-seconds 0.01 --requests 1500 --load 0.4,0.8

Simulated devices sleep (``work / speed``) rather than compute, so the run is light on CPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import os
import random
import sys
import threading
import time

import dask.array as da
import numpy as np

import blockflow
from blockflow.scheduling.view import workers_info
from blockflow.ml.inference import model_stats, ship_model
from blockflow.testing import simulated_cluster, simulated_kernel

MiB = 2**20


class SimulatedModel:
    """A linear model with ``mib`` MiB of weights whose batches take ``seconds_per_row x
    rows / speed`` on the worker's simulated device."""

    def __init__(self, n_features: int, mib: float, seconds_per_row: float, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.W = rng.standard_normal((n_features, max(int(mib * MiB / 8 / n_features), 1)))
        self.seconds_per_row = seconds_per_row

    def __call__(self, batch):
        return simulated_kernel(batch, op=lambda b: b @ self.W[:, :4],
                                work=len(batch) * self.seconds_per_row).payload


class TimedModel(SimulatedModel):
    """:class:`SimulatedModel` whose answer also carries when it started and ended (host
    clock, shared by the worker processes) and on which process: ``(out, start, end, pid)``."""

    def __call__(self, batch):
        start = time.time()
        out = super().__call__(batch)
        return out, start, time.time(), os.getpid()


def _task_bytes(collection) -> int:
    from distributed.protocol.pickle import dumps

    graph = dict(collection.__dask_graph__())
    return sum(len(dumps(t)) for t in graph.values())


def batch_inference(client, args, speeds) -> list[dict]:
    rows_per_block, n_features = 50, 16
    spr = args.block_seconds / rows_per_block
    model = SimulatedModel(n_features, args.model_mib, spr)
    X = np.random.default_rng(1).standard_normal((args.blocks * rows_per_block, n_features))
    x = da.from_array(X, chunks=(rows_per_block, n_features))
    client.persist(x)
    want = X @ model.W[:, :4]
    ideal = args.blocks * args.block_seconds / sum(speeds)
    out = []

    # plain Dask: the model in every task
    plain = x.map_blocks(lambda b, m: m(b), model, chunks=(rows_per_block, 4), dtype=float)
    shipped = _task_bytes(plain) - _task_bytes(x)
    t0 = time.perf_counter()
    got = client.compute(plain).result()
    wall = time.perf_counter() - t0
    assert np.allclose(got, want)
    out.append({"run": "plain map_blocks", "makespan_s": wall, "ratio_to_ideal": wall / ideal,
                "model_bytes_shipped": shipped})

    # blockflow: learned speeds, model shipped once per worker
    client.register_plugin(blockflow.scheduling.Rebalancer(policy="dynamic"))
    ref = ship_model(model, client=client)
    pred = blockflow.predict(model, x, client=client, batch_size=rows_per_block)
    t0 = time.perf_counter()
    got = client.compute(pred).result()
    wall = time.perf_counter() - t0
    assert np.allclose(got, want)
    stats = model_stats(client, ref)
    out.append({"run": "blockflow.predict", "makespan_s": wall, "ratio_to_ideal": wall / ideal,
                "model_bytes_shipped": sum(s["bytes_received"] for s in stats.values())})
    print(out, file=sys.stderr)
    return out, ideal


# --- routing ---------------------------------------------------------------------------


def _answer(model, batch):
    return model(batch)


class Baseline:
    """Round-robin or power-of-two-choices (fewest outstanding of two random workers)."""

    def __init__(self, client, model, kind: str, seed: int = 0):
        self.client, self.model, self.kind = client, client.scatter(model, broadcast=True), kind
        self.workers = sorted(workers_info(client))
        self.cycle = itertools.cycle(self.workers)
        self.outstanding = {w: 0 for w in self.workers}
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.fetcher = concurrent.futures.ThreadPoolExecutor(4)  # as many as the Router's

    def submit(self, batch, done):
        with self.lock:
            if self.kind == "round-robin":
                w = next(self.cycle)
            else:
                a, b = self.rng.sample(self.workers, 2)
                w = a if self.outstanding[a] <= self.outstanding[b] else b
            self.outstanding[w] += 1
        fut = self.client.submit(_answer, self.model, batch, workers=[w],
                                 allow_other_workers=False, pure=False)

        def fetch(f):  # the answer in hand, as the Router's futures give it
            done(f)

        def cb(f, w=w):
            with self.lock:
                self.outstanding[w] -= 1
            self.fetcher.submit(fetch, f)
        fut.add_done_callback(cb)
        return fut


def poisson_run(submit, n: int, rate: float, batch, seed: int = 0, on_progress=None):
    """Submit ``n`` requests at Poisson arrivals of ``rate``/s; latencies (seconds)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    latency = [None] * n
    finished = threading.Event()
    count = [0]
    lock = threading.Lock()
    start = time.perf_counter()

    stamps = [None] * n  # (arrival, start, end, pid) on the host clock
    wall0 = time.time() - time.perf_counter()

    def done_for(i):
        def done(f):
            latency[i] = time.perf_counter() - start - arrivals[i]
            try:
                out = f.result()
                if isinstance(out, tuple) and len(out) == 4:
                    stamps[i] = (wall0 + start + arrivals[i],) + tuple(out[1:])
            except Exception:
                pass
            with lock:
                count[0] += 1
                if count[0] == n:
                    finished.set()
        return done

    futures = []
    for i, t in enumerate(arrivals):
        delay = start + t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        futures.append(submit(batch, done_for(i)))
        if on_progress is not None:
            on_progress(i)
    finished.wait(timeout=600)
    ended = time.perf_counter() - start
    run = {"latency": latency, "stamps": stamps, "arrivals": arrivals, "ended": ended}
    return np.array([x for x in latency if x is not None]), futures, run


def idle_while_queued(stamps) -> float | None:
    """Share of events (arrival, start, end) at which a worker serves nothing while another
    has a queue: a request that has arrived and that the other worker serves later waits
    unstarted. Workers are those that served something."""
    stamps = [s for s in stamps if s is not None]
    if not stamps:
        return None
    workers = {s[3] for s in stamps}
    events = sorted({t for s in stamps for t in s[:3]})
    arr = np.array([s[0] for s in stamps])
    beg = np.array([s[1] for s in stamps])
    end = np.array([s[2] for s in stamps])
    pid = np.array([s[3] for s in stamps])
    eps = 1e-6
    bad = 0
    for t in events:
        queued = set(pid[(arr <= t) & (beg > t + eps)].tolist())
        if not queued:
            continue
        idle = workers - set(pid[(beg <= t + eps) & (end > t + eps)].tolist())
        if idle - queued or (idle and len(queued) > 1):
            bad += 1
    return bad / len(events)


def _summary(kind, lat, run, rate, capacity) -> dict:
    n = len(run["latency"])
    lat_all = [x for x in run["latency"] if x is not None]
    q = max(n // 4, 1)
    first = [x for x in run["latency"][:q] if x is not None]
    last = [x for x in run["latency"][-q:] if x is not None]
    return {"run": kind, "p50_s": float(np.percentile(lat, 50)),
            "p99_s": float(np.percentile(lat, 99)), "answered": len(lat_all),
            "served_per_s": len(lat_all) / run["ended"], "offered_per_s": rate,
            "capacity_per_s": capacity,
            "p50_last_over_first": float(np.median(last) / max(np.median(first), 1e-9)),
            "idle_while_queued": idle_while_queued(run["stamps"])}


ROUTERS = {"rr": "round-robin", "p2": "power-of-two", "router": "blockflow.Router"}


def routing(client, args, speeds, load) -> list[dict]:
    rows = 10
    model = TimedModel(16, 0.01, args.request_seconds / rows)
    batch = np.ones((rows, 16))
    capacity = sum(speeds) / args.request_seconds  # requests per second, all workers
    rate = load * capacity
    out = []
    for kind in (ROUTERS[k] for k in args.routers.split(",")):
        if kind == "blockflow.Router":
            router = blockflow.Router(client, model, depth=args.depth)
            submit = lambda b, done: router.submit(b).add_done_callback(done)  # noqa: E731
        else:
            base = Baseline(client, model, kind)
            submit = base.submit
        lat, _, run = poisson_run(submit, args.requests, rate, batch)
        if kind == "blockflow.Router":
            router.close()
        out.append(_summary(kind, lat, run, rate, capacity))
        print(out[-1], file=sys.stderr)
    return out, rate


def lost_worker(client, args, speeds) -> dict:
    rows = 10
    model = SimulatedModel(16, 0.01, args.request_seconds / rows)
    batch = np.ones((rows, 16))
    rate = args.load * sum(speeds) / args.request_seconds
    router = blockflow.Router(client, model, depth=args.depth)
    pids = client.run(os.getpid)
    victim = sorted(pids)[0]
    killed = []

    def progress(i):
        if i == args.requests // 3 and not killed:
            os.kill(pids[victim], 9)
            killed.append(time.perf_counter())

    lat, futures, _ = poisson_run(
        lambda b, done: router.submit(b).add_done_callback(done) or None,
        args.requests, rate, batch, on_progress=progress)
    stats = router.stats()
    router.close()
    return {"submitted": stats["counts"]["submitted"],
            "answered": stats["counts"].get("answered", 0),
            "lost": stats["counts"]["submitted"] - stats["counts"].get("answered", 0),
            "answered_twice": stats["counts"].get("duplicates", 0),
            "rerouted": stats["counts"].get("rerouted", 0),
            "p99_s": float(np.percentile(lat, 99)) if len(lat) else None}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--speeds", default="1,1,0.5,0.25")
    p.add_argument("--blocks", type=int, default=200)
    p.add_argument("--block-seconds", type=float, default=0.1)
    p.add_argument("--model-mib", type=float, default=2.0)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--request-seconds", type=float, default=0.2)
    p.add_argument("--load", default="0.8", help="fraction(s) of capacity, e.g. 0.4,0.8")
    p.add_argument("--parts", default="batch,routing,lost",
                   help="which parts to run, of batch,routing,lost")
    p.add_argument("--routers", default="rr,p2,router",
                   help="routing part: which routers, of rr,p2,router")
    p.add_argument("--depth", type=int, default=None, help="Router: most requests in flight "
                   "per worker thread (default: none, route on arrival)")
    args = p.parse_args(argv)
    speeds = [float(s) for s in args.speeds.split(",")]
    cluster = simulated_cluster(speeds=speeds, processes=True)
    parts = set(args.parts.split(","))
    loads = [float(x) for x in str(args.load).split(",")]
    args.load = loads[-1]  # the lost-worker part's
    client = cluster.__enter__()
    inf = route = lost = None
    try:
        if "batch" in parts:
            inf, ideal = batch_inference(client, args, speeds)
        if "routing" in parts:
            route = [(load, *routing(client, args, speeds, load)) for load in loads]
        if "lost" in parts:
            lost = lost_worker(client, args, speeds)
    finally:
        try:
            cluster.__exit__(None, None, None)
        except Exception as e:  # a killed worker's nanny may time out on close
            print(f"closing the cluster: {e!r}", file=sys.stderr)
    print(f"# blockflow inference benchmark: speeds {speeds}")
    if inf is not None:
        print(f"\n## Batch inference: {args.blocks} blocks x {args.block_seconds} s, model "
              f"{args.model_mib} MiB; ideal makespan {ideal:.2f} s")
        print(f"{'run':<20} {'makespan s':>10} {'x ideal':>8} {'model bytes shipped':>20}")
        for r in inf:
            print(f"{r['run']:<20} {r['makespan_s']:>10.2f} {r['ratio_to_ideal']:>8.2f} "
                  f"{r['model_bytes_shipped']:>20,}")
    for load, rows, rate in route or ():
        print(f"\n## Routing: {args.requests} requests x {args.request_seconds} s, Poisson "
              f"at {load:.0%} of capacity ({rate:.1f}/s offered, capacity "
              f"{rate / load:.1f}/s)")
        print(f"{'router':<20} {'p50 s':>8} {'p99 s':>8} {'p99/p50':>8} {'answered':>9} "
              f"{'served/s':>9} {'p50 last/first':>15} {'idle-while-queued':>18}")
        for r in rows:
            iwq = r["idle_while_queued"]
            print(f"{r['run']:<20} {r['p50_s']:>8.3f} {r['p99_s']:>8.3f} "
                  f"{r['p99_s'] / max(r['p50_s'], 1e-9):>8.1f} {r['answered']:>9} "
                  f"{r['served_per_s']:>9.1f} {r['p50_last_over_first']:>15.2f} "
                  f"{'-' if iwq is None else f'{iwq:.1%}':>18}")
        if len(rows) == 3:
            rr, p2, bf = (r["p99_s"] for r in rows)
            print(f"p99 blockflow / power-of-two = {bf / p2:.2f}; blockflow / round-robin = "
                  f"{bf / rr:.2f}")
    if lost is not None:
        print(f"\n## Lost worker (one worker SIGKILLed a third of the way): {lost}")


if __name__ == "__main__":
    main()
