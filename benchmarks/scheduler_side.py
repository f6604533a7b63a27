"""Never slower than plain, on the scheduler side (issue 39): blockflow beside plain Dask,
alternated in one run so that the machine's load hits both.

Three rows, each a blockflow run and its plain-Dask anchor per repetition, on in-process
clusters (1 thread per worker):

* ``admission``: 4 CPU workers + 1 declaring ``GPU=1``; two pipelines submitted one after
  the other, each a ``client.map`` of ``--blocks`` producers (``--block-mib`` MiB, 50 ms)
  then a ``client.map`` of their consumers needing ``GPU=1`` (``--consumer-seconds``): the
  most producer outputs in memory at once (polled every 10 ms on the scheduler) against the
  admission budget, and the makespan.
* ``rebalance``: 3 workers (simulated devices of 8, 4 and 2 GiB); 14 blocks of 256 MiB on
  the first; work on the other two fetching 200 inputs of 8 MiB from it, one at a time;
  once 40 are queued, seconds ``blockflow.rebalance`` takes against ``client.rebalance``
  called at the same point (each on its own cluster), and the inputs still to fetch then.
* ``adaptive``: ``adapt(minimum=1, maximum=3, interval=100ms, wait_count=2)`` on a
  ``LocalCluster`` (plain) and a one-pool ``PoolCluster`` (blockflow, no objective, the
  default hold): 60 tasks of 0.2 s grow the cluster to 3; seconds from the last result until
  the cluster is back at 1 worker.

    python benchmarks/scheduler_side.py --reps 2      # ~3-5 min on a loaded 2-core host
    python benchmarks/scheduler_side.py --reps 5 --blocks 100    # the full run

Per-repetition lines go to stderr, the table (medians) to stdout.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import numpy as np
import dask
from distributed import Client, LocalCluster, Scheduler, SpecCluster, Worker, wait

import blockflow
from blockflow import _distributed
from blockflow.pools.cluster import PoolCluster
from blockflow.pools.pool import Pool
from blockflow.scheduling import Rebalancer
from blockflow.testing import SimulatedDevice, install_simulated_devices, simulated_kernel

MiB, GiB = 2**20, 2**30
QUIET = logging.CRITICAL


def produce(i: int, nbytes: int) -> np.ndarray:
    time.sleep(0.05)
    return np.full(nbytes // 8, float(i))


def consume(block: np.ndarray, seconds: float) -> float:
    time.sleep(seconds)
    return float(block[0])


def _memory_keys(keys, dask_scheduler=None) -> int:
    states = _distributed.task_states(dask_scheduler, keys)
    return sum(1 for state in states.values() if state == "memory")


def admission(args, with_blockflow: bool) -> dict:
    workers = {f"cpu-{i}": {"cls": Worker, "options": {"nthreads": 1}} for i in range(4)}
    workers["gpu"] = {"cls": Worker, "options": {"nthreads": 1, "resources": {"GPU": 1}}}
    with SpecCluster(workers=workers, silence_logs=QUIET, scheduler={
            "cls": Scheduler, "options": {"dashboard_address": ":0"}}) as cluster:
        with Client(cluster) as client:
            client.wait_for_workers(5)
            if with_blockflow:
                client.register_plugin(Rebalancer(policy="dynamic", interval="100ms"))
            nbytes = int(args.block_mib * MiB)
            keys, consumers = [], []
            start = time.perf_counter()
            for tag in ("produce", "load"):
                tag_keys = [f"{tag}-{i}" for i in range(args.blocks)]
                producers = client.map(produce, range(args.blocks), nbytes=nbytes,
                                       key=tag_keys)
                consumers += client.map(consume, producers, seconds=args.consumer_seconds,
                                        resources={"GPU": 1},
                                        key=[f"consume-{k}" for k in tag_keys])
                keys += tag_keys
                del producers
            peak = 0
            while not all(f.done() for f in consumers):
                peak = max(peak, client.run_on_scheduler(_memory_keys, keys))
                time.sleep(0.01)
            makespan = time.perf_counter() - start
            results = client.gather(consumers)
            assert results == [float(i) for i in range(args.blocks)] * 2, "wrong results"
            budget = (blockflow.plugin_status(client)["resources"]["admission"]["budget"]
                      if with_blockflow else None)
    return {"peak": peak, "makespan": makespan, "budget": budget}


def _use(x) -> int:
    return int(x[0])


def rebalance(args, with_blockflow: bool) -> dict:
    # a receiver fetches one input at a time: the work's fetches stay queued for seconds
    with dask.config.set({"distributed.worker.connections.outgoing": 1}), \
            LocalCluster(n_workers=3, threads_per_worker=1, processes=False,
                         dashboard_address=":0", silence_logs=QUIET) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(3)
        a, b, c = sorted(client.scheduler_info()["workers"])
        if with_blockflow:
            client.register_plugin(Rebalancer(policy="off", interval=0))
            client.sync(install_simulated_devices, client, {
                a: SimulatedDevice(device_memory=8 * GiB),
                b: SimulatedDevice(device_memory=4 * GiB),
                c: SimulatedDevice(device_memory=2 * GiB)})
            blocks = [client.submit(simulated_kernel, np.full(4, i), op=np.sum, work=0.0,
                                    output_bytes=256 * MiB, workers=[a],
                                    allow_other_workers=False, key=f"block-{i}")
                      for i in range(14)]
        else:
            blocks = [client.submit(np.full, 2**22, i, workers=[a], allow_other_workers=False,
                                    key=f"block-{i}") for i in range(14)]  # 32 MiB each
        wait(blocks)
        inputs = [client.submit(np.ones, 2**20, workers=[a], pure=False) for _ in range(200)]
        wait(inputs)
        work = client.map(_use, inputs, workers=[b, c], pure=False)
        until = time.monotonic() + 30
        while _unfetched(client, work, inputs, (b, c)) < 40 and time.monotonic() < until:
            time.sleep(0.05)  # the receivers' fetch queues fill
        t0 = time.perf_counter()
        if with_blockflow:
            summary = blockflow.rebalance(client, blocks)
            moved = len(summary["moves"])
        else:
            client.rebalance(blocks)
            moved = None
        seconds = time.perf_counter() - t0
        left = _unfetched(client, work, inputs, (b, c))
        assert client.gather(work) == [1] * 200, "wrong results"
    return {"seconds": seconds, "moved": moved, "unfetched_after": left}


def _unfetched(client, work, inputs, receivers) -> int:
    """Work tasks on the receivers whose input is not there yet (public API only)."""
    processing = client.processing(list(receivers))
    holders = client.who_has(inputs)
    where = {str(k): w for w, keys in processing.items() for k in keys}
    return sum(1 for f, x in zip(work, inputs) if str(f.key) in where
               and where[str(f.key)] not in holders.get(x.key, ()))


def _sleep(i):
    time.sleep(0.2)
    return i


def adaptive(args, with_blockflow: bool) -> dict:
    if with_blockflow:
        cluster = PoolCluster({Pool("cpu"): 1}, processes=False, silence_logs=QUIET)
    else:
        cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                               dashboard_address=":0", silence_logs=QUIET)
    with cluster, Client(cluster) as client:
        client.wait_for_workers(1)
        cluster.adapt(minimum=1, maximum=3, interval="100ms", wait_count=2)
        futures = client.map(_sleep, range(60), pure=False)
        grew = 0
        while not all(f.done() for f in futures):
            grew = max(grew, len(client.scheduler_info()["workers"]))
            time.sleep(0.05)
        assert sorted(client.gather(futures)) == list(range(60)), "wrong results"
        ended = time.perf_counter()
        del futures
        until = time.monotonic() + 120
        while len(client.scheduler_info()["workers"]) > 1 and time.monotonic() < until:
            time.sleep(0.05)
        down = time.perf_counter() - ended
        cluster.adapt(minimum=1, maximum=1)  # stop scaling before the cluster closes
    return {"grew_to": grew, "down": down}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=30)
    ap.add_argument("--block-mib", type=float, default=1.0)
    ap.add_argument("--consumer-seconds", type=float, default=0.02)
    ap.add_argument("--rows", default="admission,rebalance,adaptive")
    args = ap.parse_args(argv)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    rows = {"admission": admission, "rebalance": rebalance, "adaptive": adaptive}
    out: dict[str, dict[str, list]] = {}
    for rep in range(args.reps):
        for name in args.rows.split(","):
            for label, flag in (("plain", False), ("blockflow", True)) if rep % 2 == 0 \
                    else (("blockflow", True), ("plain", False)):
                r = rows[name](args, flag)
                print(f"rep {rep} {name} {label}: {r}", file=sys.stderr, flush=True)
                out.setdefault(name, {}).setdefault(label, []).append(r)

    def med(name, label, key):
        return statistics.median(r[key] for r in out[name][label])

    print(f"# scheduler side beside plain Dask ({time.strftime('%Y-%m-%d')}), medians of "
          f"{args.reps} alternated repetitions; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs; in-process clusters, 1 thread per worker")
    if "admission" in out:
        budget = out["admission"]["blockflow"][0]["budget"]
        print(f"admission: two client.map pipelines submitted separately, {args.blocks} "
              f"producers each ({args.block_mib:g} MiB, 50 ms) -> {args.consumer_seconds:g} s "
              f"GPU=1 consumer; 4 CPU + 1 GPU worker; budget {budget}")
        for label in ("plain", "blockflow"):
            peaks = [r["peak"] for r in out["admission"][label]]
            print(f"  {label:<10} peak producer outputs held {med('admission', label, 'peak'):>5g}"
                  f" of {2 * args.blocks} (runs {peaks})  makespan "
                  f"{med('admission', label, 'makespan'):6.2f} s")
    if "rebalance" in out:
        print("rebalance while work fetches 200 x 8 MiB inputs on the receivers, one at a time"
              " (plain: client.rebalance of 14 x 32 MiB host blocks; blockflow: "
              "blockflow.rebalance of 14 x 256 MiB simulated device blocks)")
        for label in ("plain", "blockflow"):
            print(f"  {label:<10} call returned after {med('rebalance', label, 'seconds'):6.2f} s"
                  f" (runs {[round(r['seconds'], 2) for r in out['rebalance'][label]]}); "
                  f"inputs still to fetch then {[r['unfetched_after'] for r in out['rebalance'][label]]}")
    if "adaptive" in out:
        print("adaptive: adapt(minimum=1, maximum=3, interval=100ms, wait_count=2), 60 x 0.2 s "
              "tasks, no objective (blockflow: one-pool PoolCluster, default hold 30 s)")
        for label in ("plain", "blockflow"):
            grew = [r["grew_to"] for r in out["adaptive"][label]]
            print(f"  {label:<10} back to 1 worker {med('adaptive', label, 'down'):6.2f} s after "
                  f"the last result (grew to {grew}; runs "
                  f"{[round(r['down'], 2) for r in out['adaptive'][label]]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
