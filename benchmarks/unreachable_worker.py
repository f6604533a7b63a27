"""Calls on every worker when one worker does not answer: blockflow against plain distributed.

The scenario of issue 39 ("a worker that becomes unreachable as a job starts kills the
job"): a cluster of ``--workers`` worker processes (LocalCluster, 1 thread each) of which one
is stopped (SIGSTOP: its host still accepts connections, nothing answers, as a worker whose
event loop is stuck or whose link is cut after the connection was made). Timed, in turn in
every round so that load from other processes hits both alike:

* **dask**: ``client.run(fn)`` and ``client.register_plugin(worker_plugin)`` as distributed
  makes them (one scheduler broadcast each), waited on for at most ``--cap`` seconds;
* **blockflow**: :func:`blockflow.scheduling.wait.run_each` and
  :func:`~blockflow.scheduling.wait.add_worker_plugin` (each worker bounded by
  ``blockflow.cluster.worker-call-timeout``, ``--timeout``), what blockflow's inventory,
  pools' heartbeat, model cache and ``connect`` call.

Measured: seconds until the call returned (or ``>cap`` when it had not), and what it gave
(the workers that answered; the one-line warning naming the stopped worker).

    python benchmarks/unreachable_worker.py                     # 3 workers, 2 rounds, cap 60 s
    python benchmarks/unreachable_worker.py --repeat 1 --cap 30  # smoke
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import threading
import time
import warnings

import dask
from distributed import Client, LocalCluster

from blockflow import _distributed
from blockflow.scheduling.wait import add_worker_plugin, run_each


def _pid() -> int:
    return os.getpid()


def _timed(call, cap: float) -> tuple[float | None, str]:
    """Seconds ``call()`` took in a thread (None past ``cap``) and what it gave."""
    out: dict = {}

    def target():
        try:
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                value = call()
            out["what"] = f"{value!r}"[:60] + "".join(f" | warned: {w.message}"[:140]
                                                      for w in got)
        except BaseException as e:  # noqa: BLE001 - reported
            out["what"] = f"raised {type(e).__name__}: {e}"[:160]

    t0 = time.monotonic()
    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(cap)
    took = time.monotonic() - t0
    return (None, "still waiting") if th.is_alive() else (took, out.get("what", ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cap", type=float, default=60.0, help="seconds to wait for plain Dask")
    ap.add_argument("--timeout", type=float, default=10.0,
                    help="blockflow.cluster.worker-call-timeout")
    args = ap.parse_args()
    rows = []
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, dashboard_address=":0"
                      ) as cluster, Client(cluster) as client, dask.config.set(
            {"blockflow.cluster.worker-call-timeout": args.timeout}):
        workers = sorted(client.scheduler_info()["workers"])
        pid = client.run(_pid, workers=[workers[0]])[workers[0]]
        os.kill(pid, signal.SIGSTOP)
        try:
            for r in range(args.repeat):
                for name, call in [
                    ("dask client.run", lambda: client.run(_pid)),
                    ("blockflow run_each", lambda: run_each(client, _pid, what="a probe")),
                    ("dask register_plugin",
                     lambda: client.register_plugin(_distributed.QuietClose())),
                    ("blockflow add_worker_plugin",
                     lambda: add_worker_plugin(client, _distributed.QuietClose())),
                ]:
                    took, what = _timed(call, args.cap)
                    rows.append((name, took, what))
                    print(f"round {r + 1}  {name:<28} "
                          f"{'>%g' % args.cap if took is None else '%.1f' % took:>6} s  {what}",
                          flush=True)
        finally:
            os.kill(pid, signal.SIGCONT)
    print(f"\n{args.workers} workers, one stopped (SIGSTOP); timeout {args.timeout:g} s, "
          f"cap {args.cap:g} s; median seconds to return:")
    for name in dict.fromkeys(n for n, _, _ in rows):
        times = [t for n, t, _ in rows if n == name]
        done = [t for t in times if t is not None]
        med = f"{statistics.median(done):.1f}" if len(done) == len(times) else f">{args.cap:g}"
        print(f"  {name:<28} {med:>6} s  ({len(done)} of {len(times)} returned)")


if __name__ == "__main__":
    main()
