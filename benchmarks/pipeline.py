"""CPU producers feeding GPU consumers: plain Dask vs blockflow's admission control.

The scenario of issue 11: 4 CPU workers plus one worker declaring ``GPU=1`` (worker
processes, 1 thread each); ``--blocks`` producer blocks of ``--block-mib`` MiB each feed one
consumer of ``--consumer-seconds`` that needs ``resources={"GPU": 1}`` (a delayed graph, whose
annotations reach the scheduler). Without admission control the producers race ahead of the
GPU: resource-restricted tasks are never queued, so as soon as a producer finishes its
consumer is assigned to the GPU worker and the CPU worker takes the next producer.

Both runs share one cluster: plain Dask first, then the same graph after
:func:`blockflow.connect` registered blockflow's scheduler plugin (policy ``dynamic``,
default admission budget: 2 x the GPU worker's threads + 1 per CPU worker = 6). Measured:

* peak held outputs: the most producer outputs in memory at once, polled on the scheduler
  every 20 ms;
* peak memory: the most process memory of all workers together
  (:class:`distributed.diagnostics.MemorySampler`, every 100 ms), and its rise over the
  idle cluster's;
* makespan: from submitting the graph to the last result.

    python benchmarks/pipeline.py                  # 120 blocks, ~1.5 min here
    python benchmarks/pipeline.py --blocks 200     # the issue's scenario, ~2.5 min here
    python benchmarks/pipeline.py --blocks 40 --block-mib 2 --consumer-seconds 0.05  # smoke

Run time is about ``2 x blocks x consumer-seconds`` (plain Dask's run takes longer: its GPU
worker also fetches the piled-up outputs) plus 20-30 s of cluster start on a loaded 2-core
machine. Per-run lines go to stderr, the table to stdout. A run of the issue's scenario is
in ``benchmarks/results/pipeline-cpu-2026-12-01.txt``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time

import dask
import numpy as np
from distributed import Client, Nanny, Scheduler, SpecCluster
from distributed.diagnostics import MemorySampler

import blockflow
from blockflow import _distributed

MiB = 2**20


def produce(i: int, nbytes: int) -> np.ndarray:
    """A producer block (CPU work): ``nbytes`` of float64."""
    return np.full(nbytes // 8, float(i))


def consume(block: np.ndarray, seconds: float) -> float:
    """A GPU consumer, modelled by its duration."""
    time.sleep(seconds)
    return float(block[0])


def pipeline(n: int, nbytes: int, seconds: float, tag: str):
    producers = [dask.delayed(produce)(i, nbytes, dask_key_name=(f"produce-{tag}", i))
                 for i in range(n)]
    with dask.annotate(resources={"GPU": 1}):
        consumers = [dask.delayed(consume)(p, seconds, dask_key_name=(f"consume-{tag}", i))
                     for i, p in enumerate(producers)]
    return [p.key for p in producers], consumers


def _states(keys, dask_scheduler=None):
    return _distributed.task_states(dask_scheduler, keys)


def two_submissions(client: Client, n: int, nbytes: int, seconds: float, tag: str):
    """distributed#9164's form: ``client.map`` of the producers, then a second
    ``client.map`` of the consumers needing ``GPU=1`` (two graphs)."""
    keys = [f"produce-{tag}-{i}" for i in range(n)]
    producers = client.map(produce, range(n), nbytes=nbytes, key=keys)
    consumers = client.map(consume, producers, seconds=seconds, resources={"GPU": 1},
                           key=[f"consume-{k}" for k in keys])
    return keys, consumers


def run(client: Client, sampler: MemorySampler, label: str, args, form: str = "one graph"
        ) -> dict:
    nbytes = int(args.block_mib * MiB)
    if form == "one graph":
        keys, consumers = pipeline(args.blocks, nbytes, args.consumer_seconds, label)
    else:
        keys, consumers = None, None
    peak = 0
    done = threading.Event()

    def poll():
        nonlocal peak
        while not done.is_set():
            states = client.run_on_scheduler(_states, keys)
            peak = max(peak, sum(1 for s in states.values() if s == "memory"))
            time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    with sampler.sample(label, interval=0.1):
        start = time.perf_counter()
        if consumers is not None:
            futures = client.compute(consumers)
        else:
            keys, futures = two_submissions(client, args.blocks, nbytes,
                                            args.consumer_seconds, label)
        poller.start()
        results = client.gather(futures)
        makespan = time.perf_counter() - start
        done.set()
        poller.join()
    assert results == [float(i) for i in range(args.blocks)], "wrong results"
    del futures
    print(f"{label} ({form}): peak held {peak} of {args.blocks}, makespan {makespan:.1f} s",
          file=sys.stderr)
    return {"peak_held": peak, "makespan": makespan}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=120)
    parser.add_argument("--block-mib", type=float, default=10.0)
    parser.add_argument("--consumer-seconds", type=float, default=0.2)
    parser.add_argument("--cpu-workers", type=int, default=4)
    args = parser.parse_args(argv)
    for name in ("blocks", "cpu_workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.block_mib <= 0 or args.consumer_seconds < 0:
        parser.error("--block-mib must be > 0 and --consumer-seconds >= 0")

    workers = {f"cpu-{i}": {"cls": Nanny, "options": {"nthreads": 1}}
               for i in range(args.cpu_workers)}
    workers["gpu"] = {"cls": Nanny, "options": {"nthreads": 1, "resources": {"GPU": 1}}}
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    out = {}
    with SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.ERROR) as cluster:
        with Client(cluster) as client:
            client.wait_for_workers(len(workers))
            sampler = MemorySampler()
            with sampler.sample("idle", interval=0.1):
                time.sleep(1.0)
            out["plain Dask"] = run(client, sampler, "plain", args)
            out["plain Dask, 2 submissions"] = run(client, sampler, "plain2", args,
                                                   form="two submissions")
            client.close()
        with blockflow.connect(cluster.scheduler_address) as client:
            out["blockflow"] = run(client, sampler, "blockflow", args)
            # the same client again: the first run of the two-submission form holds the
            # producers once the consumers arrive; the second also finds the learned pattern
            out["blockflow, 2 submissions"] = run(client, sampler, "blockflow2", args,
                                                  form="two submissions")
            out["blockflow, 2 submissions again"] = run(client, sampler, "blockflow3", args,
                                                        form="two submissions")
            budget = blockflow.plugin_status(client)["resources"]["admission"]["budget"]
        memory = sampler.to_pandas()
    idle = float(memory["idle"].dropna().max())
    labels = {"plain Dask": "plain", "plain Dask, 2 submissions": "plain2",
              "blockflow": "blockflow", "blockflow, 2 submissions": "blockflow2",
              "blockflow, 2 submissions again": "blockflow3"}
    for label, key in labels.items():
        out[label]["peak_memory"] = float(memory[key].dropna().max())
        out[label]["rise"] = out[label]["peak_memory"] - idle

    print(f"pipeline: {args.cpu_workers} CPU workers + 1 GPU=1 worker (processes, 1 thread "
          f"each); {args.blocks} producers x {args.block_mib:g} MiB -> "
          f"{args.consumer_seconds:g} s consumer (GPU=1); blockflow admission budget {budget}")
    print("one graph: a delayed graph of producers and consumers; 2 submissions: "
          "client.map(produce), then client.map(consume, resources={'GPU': 1}) "
          "(distributed#9164); 'again': the same client's second such pipeline")
    rows = [("peak producer outputs held", lambda r: f"{r['peak_held']} of {args.blocks}"),
            ("  / blockflow's one-graph peak",
             lambda r: f"{r['peak_held'] / max(out['blockflow']['peak_held'], 1):.1f}x"),
            ("peak worker memory (MiB)", lambda r: f"{r['peak_memory'] / MiB:,.0f}"),
            ("  over the idle cluster (MiB)", lambda r: f"{r['rise'] / MiB:,.0f}"),
            ("makespan (s)", lambda r: f"{r['makespan']:.1f}")]
    for group in (("plain Dask", "blockflow"),
                  ("plain Dask, 2 submissions", "blockflow, 2 submissions",
                   "blockflow, 2 submissions again")):
        print()
        print(f"{'':32}" + "".join(f"{g:>32}" for g in group))
        for name, fmt in rows:
            print(f"{name:32}" + "".join(f"{fmt(out[g]):>32}" for g in group))
    return 0


if __name__ == "__main__":
    sys.exit(main())
