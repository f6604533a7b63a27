"""The flights job cold, as every ``blockflow run flights`` runs it, beside the same job warm
(the workers have read the table and imported pandas: the clusters guide's table).

Issue 39 ("the docs' flights timing is a warm cluster's where every CLI run is cold"). Each
round runs, in turn so that load from other processes hits both alike:

* **cold**: ``python -m blockflow run flights --scale S --n-workers 2 --threads-per-worker 1``
  in a fresh process: the command's elapsed time (its imports, the embedded cluster's start
  and shutdown included) and the job's own reported ``Wall time``;
* **warm**: :func:`blockflow.workloads.flights.run` at scale S on one embedded cluster of the
  same shape that ran the job once at scale 1 before the first round.

Medians over ``--repeat`` rounds; per-run lines to stderr, the table to stdout and to
``benchmarks/results/flights_cold-cpu-<date>.txt``.

    python benchmarks/flights_cold.py                  # scale 4, 3 rounds
    python benchmarks/flights_cold.py --repeat 1       # smoke
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import blockflow
from blockflow.workloads import flights


def cold(scale: int, folder: str) -> tuple[float, float]:
    """(command seconds, the job's reported wall time) of one cold CLI run."""
    env = {**os.environ, "DASK_BLOCKFLOW__CLUSTER__DASHBOARD_ADDRESS": "127.0.0.1:0"}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "blockflow", "run", "flights", "--scale", str(scale),
         "--n-workers", "2", "--threads-per-worker", "1", "--no-progress", "--overwrite",
         "--output", os.path.join(folder, "out")], capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return elapsed, float(re.search(r"Wall time: ([\d.]+) s", proc.stdout)[1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    client = blockflow.connect(gpu=False, n_workers=2, threads_per_worker=1,
                               dashboard_address=":0")
    flights.run(client, scale=1, progress=False)  # warm: the table read, pandas imported
    rows = {"cold command": [], "cold job": [], "warm job": []}
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.repeat):
            command, job = cold(args.scale, folder)
            warm = flights.run(client, scale=args.scale, progress=False).wall_time
            for name, v in zip(rows, (command, job, warm)):
                rows[name].append(v)
            print(f"round {i}: cold command {command:.2f} s, cold job {job:.2f} s, warm job "
                  f"{warm:.2f} s, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    client.shutdown()
    command = " ".join(["python benchmarks/flights_cold.py", *(argv or sys.argv[1:])])
    lines = [f"# {command}", f"flights --scale {args.scale}, 2 workers x 1 thread, medians of {args.repeat} "
             f"rounds (cold and warm alternated), load average {os.getloadavg()[0]:.1f} at "
             f"the end, {datetime.date.today()}"]
    lines += [f"{name:>13}: {statistics.median(v):6.2f} s  (runs: "
              f"{', '.join(f'{x:.2f}' for x in v)})" for name, v in rows.items()]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    out = os.path.join(os.path.dirname(__file__), "results",
                       f"flights_cold-cpu-{datetime.date.today()}.txt")
    with open(out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
