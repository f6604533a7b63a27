"""Where blockflow's dynamic policy spends the event loop's time on trivial tasks: the scale
benchmark's run (N in-process single-thread workers, ``client.map`` of ``x + 1``) under
cProfile, plain Dask and blockflow each in a fresh interpreter, then the functions whose
time or call count differ most between the two.

    python benchmarks/profile_overhead.py --workers 32 --tasks 5000 [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import subprocess
import sys
import time


def one(n: int, tasks: int, mode: str, path: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from distributed import Client, LocalCluster

    from blockflow.scheduling.plugin import Rebalancer
    from scale import inc

    async def run():
        async with LocalCluster(n_workers=n, threads_per_worker=1, processes=False, memory_limit=0,
                                dashboard_address=None, asynchronous=True) as cluster, \
                Client(cluster, asynchronous=True) as client:
            if mode == "blockflow":
                await client.register_plugin(Rebalancer(policy="dynamic"))
            await client.gather(client.map(inc, range(2 * n), key=[f"w-{i}" for i in range(2 * n)]))
            pr = cProfile.Profile()
            t0 = time.thread_time()
            pr.enable()
            await client.gather(client.map(inc, range(tasks), key=[f"i-{i}" for i in range(tasks)]))
            pr.disable()
            print(f"{mode}: loop CPU {time.thread_time() - t0:.3f} s (profiled)", flush=True)
            pr.dump_stats(path)

    asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--tasks", type=int, default=5000)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--one", default=None)
    args = ap.parse_args()
    if args.one:
        mode, path = args.one.split(",")
        return one(args.workers, args.tasks, mode, path)
    paths = {}
    for mode in ("plain", "blockflow"):
        paths[mode] = os.path.join(args.out, f"profile-{mode}-{args.workers}.prof")
        subprocess.run([sys.executable, __file__, "--workers", str(args.workers), "--tasks",
                        str(args.tasks), "--one", f"{mode},{paths[mode]}"], check=True)
    a, b = (pstats.Stats(paths[m]).stats for m in ("plain", "blockflow"))
    print(f"total tottime: plain {sum(v[2] for v in a.values()):.3f} s, "
          f"blockflow {sum(v[2] for v in b.values()):.3f} s")
    rows = []
    for k in set(a) | set(b):
        pa, pb = a.get(k, (0, 0, 0, 0)), b.get(k, (0, 0, 0, 0))
        rows.append((pb[2] - pa[2], pb[1] - pa[1], pa[1], pb[1], pb[3] - pa[3], k))
    name = lambda k: f"{k[0].split('site-packages/')[-1][-60:]}:{k[1]} {k[2]}"  # noqa: E731
    print("\n# by own time (blockflow - plain, s), calls plain -> blockflow, cumulative diff")
    for r in sorted(rows, key=lambda r: -r[0])[:45]:
        print(f"{r[0]:+8.4f}  {r[2]:>8} -> {r[3]:<8} cum {r[4]:+8.4f}  {name(r[5])}")
    print("\n# by call count difference")
    for r in sorted(rows, key=lambda r: -abs(r[1]))[:45]:
        print(f"{r[1]:+8d}  {r[2]:>8} -> {r[3]:<8} own {r[0]:+8.4f}  {name(r[5])}")


if __name__ == "__main__":
    main()
