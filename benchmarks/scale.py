"""Scale benchmark: what blockflow's scheduler plugin costs as the cluster grows.

Two parts, one table each (stdout; per-run lines on stderr):

* ``cluster`` -- for each N in ``--workers`` (8, 32, 128; add 256 where the machine allows),
  N in-process single-thread workers (``LocalCluster(processes=False)``: scheduler, workers
  and client share one event loop, the worst case for a plugin's own cost) run
  ``--tasks`` (5,000) trivial tasks (``client.map`` of ``x + 1``), plain Dask and blockflow's
  ``dynamic`` policy side by side: a fresh cluster per run, the two alternating (order
  reversed on odd repetitions), ``--reps`` (3) each, every run in a fresh interpreter
  (``--same-process`` to run them all here: later runs then walk the earlier ones' garbage). Reported: the median wall time of each
  and the median of the paired ratios blockflow / plain; the same for the event loop's CPU
  time (``time.thread_time`` of the loop's thread: what the scheduler and workers spent,
  much less sensitive than wall time to other processes on a shared machine), and plain
  Dask's loop CPU per task for scale; the plugin's own cost as it measures it
  (``plugin_status(client)["cost"]``): hook time per finished task (microseconds, wall and
  CPU; CPU sampled on 1 ``transition`` call in 32), all-in (hooks and ticks) per task, and its
  ticks' median and max (wall milliseconds, over the cluster's life). A short warm-up of
  2N tasks runs first.
* ``replay`` -- ``--replay-workers`` (1,000) simulated workers, no cluster: snapshots of
  plain data (:class:`~blockflow.scheduling.policies.ClusterSnapshot`: GPU-style worker
  views, a queue of T tasks, every worker running one task, T tasks waiting on the
  workers, served lazily) replayed through the ``dynamic`` policy's rules, ``--ticks`` (60)
  ticks per row; on each tick k workers get new heartbeat metrics (other GPU work
  comes to 1 in 200 of them and leaves 1 in 5 of the hot ones: pauses, resumes and rescues
  of the paused workers' waiting tasks happen; decisions applied between ticks). Reported: the policy's
  median and max CPU time per tick (``time.thread_time``), and how many worker views it read, for k changed
  workers in {0, 10, 100, 1000} and T in {5,000, 50,000, 500,000}: the cost follows k, not T.

* ``start`` -- fresh embedded clusters, ``LocalCluster`` vs ``blockflow.connect()``: the
  first graph on fresh workers and ``--tasks`` tiny tasks (``benchmarks/startup.py``, issue 39).

Targets (issue 28): blockflow/plain <= 1.05x at every N; tick median <= 5 ms and max <= 50 ms
at the largest N and on the 1,000-worker replay; plugin cost per task <= 50 us.

    python benchmarks/scale.py > table.txt
    python benchmarks/scale.py --quick           # smoke test (~1 min)
    python benchmarks/scale.py --aa --workers 8 --reps 10 --parts cluster  # the harness's noise
    python benchmarks/scale.py --workers 8,32,128,256 --plot benchmarks/results/scale.png
    python benchmarks/scale.py --parts start --tasks 10000 --reps 5   # issue 39
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import statistics
import sys
import time
from typing import TYPE_CHECKING

from distributed import Client, LocalCluster

if TYPE_CHECKING:
    from blockflow._distributed import WorkerView

# blockflow is imported where used: the plain arms' processes (and their spawned workers,
# which import this file again) load none of it


def inc(x):
    return x + 1


# --- part 1: real in-process clusters -------------------------------------------------------


async def cluster_run(n_workers: int, n_tasks: int, mode: str) -> dict:
    """One run: a fresh in-process cluster, ``n_tasks`` trivial tasks; wall and loop CPU
    seconds (and the CPU seconds of garbage collections among them), and the plugin's own
    cost (blockflow)."""
    import gc

    gc_cpu = [0.0, 0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_cpu[1] = time.thread_time()
        else:
            gc_cpu[0] += time.thread_time() - gc_cpu[1]

    gc.callbacks.append(on_gc)
    try:
        out = await _cluster_run(n_workers, n_tasks, mode, gc_cpu)
    finally:
        gc.callbacks.remove(on_gc)
    return out


async def _cluster_run(n_workers: int, n_tasks: int, mode: str, gc_cpu: list) -> dict:
    # memory_limit=0: in-process workers all read the one process's memory as their own
    # (the default limit, the machine's memory / N, paused every worker at N=128 on 24 GB)
    async with LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=False,
                            memory_limit=0, dashboard_address=None,
                            asynchronous=True) as cluster, \
            Client(cluster, asynchronous=True) as client:
        if mode == "blockflow":
            from blockflow.scheduling.plugin import Rebalancer

            await client.register_plugin(Rebalancer(policy="dynamic"))
        warm = 2 * n_workers
        await client.gather(client.map(inc, range(warm), key=[f"warm-{i}" for i in range(warm)]))
        before = await client.scheduler.blockflow_status() if mode == "blockflow" else None
        gc_cpu[0] = 0.0
        t0, c0 = time.perf_counter(), time.thread_time()
        await client.gather(client.map(inc, range(n_tasks), key=[f"inc-{i}"
                                                                 for i in range(n_tasks)]))
        out = {"wall": time.perf_counter() - t0, "cpu": time.thread_time() - c0,
               "gc_cpu": gc_cpu[0]}
        if mode == "blockflow":
            after = await client.scheduler.blockflow_status()
            a, b = after["cost"], before["cost"]
            tasks = max(a["tasks"] - b["tasks"], 1)
            out.update(
                per_task_us=1e6 * (a["hook_seconds"] - b["hook_seconds"]) / tasks,
                all_in_us=1e6 * (a["hook_seconds"] - b["hook_seconds"]
                                 + a["tick_seconds"] - b["tick_seconds"]) / tasks,
                cpu_per_task_us=1e6 * (a["hook_cpu_seconds"] - b["hook_cpu_seconds"]) / tasks,
                cpu_all_in_us=1e6 * (a["hook_cpu_seconds"] - b["hook_cpu_seconds"]
                                     + a["tick_cpu_seconds"] - b["tick_cpu_seconds"]) / tasks,
                tick_median_ms=a["tick_ms_median"], tick_max_ms=a["tick_ms_max"],
                # the longest tick no full garbage collection of the process ran in
                tick_max_nogc_ms=a["tick_ms_max_without_full_gc"],
                ticks_full_gc=a["ticks_with_full_gc"],
                ticks=a["tick_count"],
                # what the policy did (expected on identical idle workers: nothing)
                decisions=len(after["decisions"]) - len(before["decisions"]),
                moves=after["moves_requested"] - before["moves_requested"],
                stealing_suspended=int(bool(after["balancing"])))
        return out


def isolated_run(n_workers: int, n_tasks: int, mode: str) -> dict:
    """:func:`cluster_run` in a fresh interpreter (``python scale.py --one N,T,MODE``): runs
    in one process inherit each other's heap (garbage the next run's collections walk, and
    a full collection's cost grows with it), which made later runs slower and the paired
    ratio depend on the order."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, __file__, "--one", f"{n_workers},{n_tasks},{mode}"],
                         capture_output=True, text=True, check=False)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"scale run N={n_workers} {mode} failed (exit {out.returncode}): "
                           f"{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def cluster_part(workers: list[int], n_tasks: int, reps: int, isolate: bool = True,
                 aa: bool = False) -> list[dict]:
    """The cluster part's rows; with ``aa`` the second arm is plain Dask again (an A/A check:
    how far from 1.00x the harness's median ratio lands with nothing changed)."""
    rows = []
    other = "plain-again" if aa else "blockflow"
    for n in workers:
        runs: dict[str, list[dict]] = {"plain": [], other: []}
        for r in range(reps):
            for mode in (("plain", other) if r % 2 == 0 else (other, "plain")):
                res = isolated_run(n, n_tasks, mode) if isolate \
                    else asyncio.run(cluster_run(n, n_tasks, mode))
                runs[mode].append(res)
                print(f"N={n} rep={r} {mode}: " + ", ".join(
                    f"{k}={v:.4g}" for k, v in res.items() if v is not None),
                    file=sys.stderr, flush=True)
        p, b = runs["plain"], runs[other]
        med = statistics.median
        nan = float("nan")
        rows.append({
            "N": n,
            "plain_s": med(x["wall"] for x in p), "blockflow_s": med(x["wall"] for x in b),
            "ratio": med(y["wall"] / x["wall"] for x, y in zip(p, b)),
            "ratio_min": min(y["wall"] / x["wall"] for x, y in zip(p, b)),
            "ratio_max": max(y["wall"] / x["wall"] for x, y in zip(p, b)),
            "ratio_ci": median_ci([y["wall"] / x["wall"] for x, y in zip(p, b)]),
            "cpu_ratio": med(y["cpu"] / x["cpu"] for x, y in zip(p, b)),
            "per_task_us": med(x.get("per_task_us", nan) for x in b),
            "all_in_us": med(x.get("all_in_us", nan) for x in b),
            "cpu_per_task_us": med(x.get("cpu_per_task_us", nan) for x in b),
            "cpu_all_in_us": med(x.get("cpu_all_in_us", nan) for x in b),
            "plain_cpu_us": med(1e6 * x["cpu"] / n_tasks for x in p),
            "gc_plain": med(x.get("gc_cpu", 0.0) for x in p),
            "gc_blockflow": med(x.get("gc_cpu", 0.0) for x in b),
            "tick_median_ms": med(x.get("tick_median_ms", nan) for x in b),
            "tick_max_ms": max(x.get("tick_max_ms", nan) for x in b),
            "tick_max_nogc_ms": max(x.get("tick_max_nogc_ms") or 0.0 for x in b),
        })
    return rows


def median_ci(ratios: list[float], level: float = 0.9) -> tuple[float, float]:
    """A ``level`` bootstrap confidence interval of the median of the paired ratios
    (:func:`scipy.stats.bootstrap`, percentile method): single pairs move by +-15 % on a
    shared machine, so a median of a few says little without it. ``(nan, nan)`` under 3
    pairs."""
    import numpy as np
    from scipy.stats import bootstrap

    if len(ratios) < 3:
        return (float("nan"), float("nan"))
    res = bootstrap((np.asarray(ratios),), np.median, confidence_level=level,
                    method="percentile", n_resamples=5000, random_state=28)
    return (float(res.confidence_interval.low), float(res.confidence_interval.high))


# --- part 2: replayed snapshots through the policy ---------------------------------------


class ReplayWaiting:
    """``snapshot.waiting`` for the replay: address -> the tasks waiting there (those past its
    threads), made when read, as the plugin's lazy mapping does."""

    def __init__(self, processing: dict[str, int], group: str = "inc"):
        self.processing = processing
        self.group = group

    def get(self, address, default=()):
        from blockflow._distributed import TaskView

        if address not in self.processing:
            return default
        n = max(self.processing[address] - 1, 0)
        return (TaskView(key=f"{self.group}-{address}-{i}", group=self.group, duration=1e-4)
                for i in range(n))

    def __getitem__(self, address):
        return self.get(address)

    def __iter__(self):
        return iter(self.processing)

    def __len__(self):
        return len(self.processing)


GPU_TOTAL = 16e9


def replay_view(address: str, rng: random.Random, processing: int, *,
                paused: bool = False, hot: bool = False) -> WorkerView:
    """A GPU worker as a heartbeat shows it: busy with its own task, or ``hot`` (other work
    above the pause threshold)."""
    from blockflow._distributed import WorkerView
    from blockflow._distributed.metrics import WorkerMetrics

    util = rng.uniform(85, 100) if hot else rng.uniform(20, 60)
    return WorkerView(
        address=address, nthreads=1, status="paused" if paused else "running",
        paused_by_blockflow=paused,
        metrics=WorkerMetrics(gpu_utilization=util, gpu_memory_used=rng.uniform(0.2, 0.6)
                              * GPU_TOTAL, gpu_memory_total=GPU_TOTAL,
                              host_memory=2e9, own_utilization=0.0 if hot else util),
        speed=1.0, processing=processing, executing=min(processing, 1),
        occupancy=1e-4 * processing, memory_limit=8_000_000_000)


def replay(n_workers: int, changed: int, n_tasks: int, ticks: int, *, count: bool = False,
           seed: int = 28) -> dict:
    """Replay ``ticks`` snapshots of ``n_workers`` through a fresh dynamic policy, ``changed``
    workers getting new metrics on each (other GPU work comes to 1 in 200 of them and leaves
    1 in 5 of the hot ones, so pauses, resumes and rescues off paused workers happen; the decisions applied between ticks, as the
    plugin would); the policy's time per tick, or (``count``) the worker views it read."""
    from blockflow._distributed import RunningTask
    from blockflow.scheduling.policies import ClusterSnapshot, DynamicPolicy

    rng = random.Random(seed)
    addresses = [f"tcp://10.{i // 250}.{i % 250}.1:40000" for i in range(n_workers)]
    queued = n_tasks
    # each worker holds two tasks (one running), distributed's queue holds the rest
    processing = dict.fromkeys(addresses, 2)
    views = {a: replay_view(a, rng, 2) for a in addresses}
    running = {a: [RunningTask(key=f"run-{a}", group="inc", elapsed=5e-5, duration=1e-4,
                               duration_measured=True, input_bytes=0, kernel=False)]
               for a in addresses}
    policy = DynamicPolicy()
    waiting = ReplayWaiting(processing)
    times, reads, decisions = [], [], 0
    paused: set[str] = set()
    hot: set[str] = set()
    dirty: set[str] = set()  # workers whose state this replay changed (decisions applied)
    for tick in range(ticks + 1):
        now = set(rng.sample(addresses, changed)) | dirty
        for a in sorted(now):
            # other work comes (1 heartbeat in 200) and goes (1 in 5)
            if rng.random() < (0.2 if a in hot else 0.005):
                hot ^= {a}
            views[a] = replay_view(a, rng, processing[a], paused=a in paused, hot=a in hot)
        dirty = set()
        snap = ClusterSnapshot(time=float(tick), workers=views, queued=queued,
                               waiting=waiting, running=running, balancing=False,
                               changed=None if tick == 0 else frozenset(now),
                               monotonic=float(tick))
        counter = Counting() if count else contextlib.nullcontext()
        with counter:
            t0 = time.thread_time()  # CPU time: other jobs on the machine do not count
            out = list(policy.run(snap))
            elapsed = time.thread_time() - t0
        for d in out:  # applied, as the plugin would: the views change by the next tick
            action = d.action.value
            if action == "pause":
                paused.add(d.worker)
            elif action == "resume":
                paused.discard(d.worker)
            elif action == "move":
                processing[d.worker] -= 1
                processing[d.target] += 1
                dirty.add(d.target)
            dirty.add(d.worker)
        if tick:  # the first is the cold start: every worker is new
            times.append(elapsed)
            reads.append(counter.views_read if count else 0)
            decisions += len(out)
    return {"workers": n_workers, "changed": changed, "tasks": n_tasks,
            "median_ms": 1e3 * statistics.median(times), "max_ms": 1e3 * max(times),
            "views_read": statistics.median(reads), "views_read_max": max(reads),
            "decisions": decisions}


class Counting:
    """Counts the distinct worker views a policy reads an attribute of (while active)."""

    active: "Counting | None" = None

    def __enter__(self):
        global _get
        from blockflow._distributed import WorkerView

        self.seen: set[int] = set()
        Counting.active = self
        _get = _get or WorkerView.__getattribute__
        WorkerView.__getattribute__ = _counting_getattribute
        return self

    def __exit__(self, *exc):
        Counting.active = None
        _restore_getattribute()

    @property
    def views_read(self) -> int:
        return len(self.seen)


_get = None  # WorkerView's own __getattribute__, kept while a Counting is active


def _restore_getattribute() -> None:
    if _get is not None:
        from blockflow._distributed import WorkerView

        WorkerView.__getattribute__ = _get


def _counting_getattribute(self, name):  # installed while a Counting is active
    c = Counting.active
    if c is not None:
        c.seen.add(id(self))
    return _get(self, name)


def replay_part(n_workers: int, ticks: int, changed: list[int], tasks: list[int]) -> list[dict]:
    try:
        rows = []
        for t in tasks:
            for k in changed:
                row = replay(n_workers, min(k, n_workers), t, ticks)  # timed
                counted = replay(n_workers, min(k, n_workers), t, ticks, count=True)
                row["views_read"] = counted["views_read"]
                row["views_read_max"] = counted["views_read_max"]
                print(f"replay: {row}", file=sys.stderr, flush=True)
                rows.append(row)
        return rows
    finally:
        _restore_getattribute()


# --- output --------------------------------------------------------------------------------


def print_header(args) -> None:
    import os
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = "?"
    print(f"# python benchmarks/scale.py {' '.join(sys.argv[1:])}")
    print(f"# blockflow scale benchmark, {time.strftime('%Y-%m-%d %H:%M')}, commit {commit}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start "
          f"(a machine shared with other jobs: wall times are noisy, CPU times less so)")
    if getattr(args, "aa", False):
        print("# A/A check (--aa): plain Dask in both arms; the 'bf' columns are plain again")
    print(f"# {args.tasks} trivial tasks per run, {args.reps} paired repetitions (median)",
          flush=True)


def print_replay(replay_rows, args) -> None:
    print(f"\n## Replay: {args.replay_workers} simulated workers, snapshots through the "
          f"dynamic policy ({args.ticks} ticks per row; no cluster)\n")
    print(f"{'tasks':>8} {'changed':>8} {'CPU med ms':>12} {'CPU max ms':>12} "
          f"{'views read med':>15} {'(max)':>6} {'decisions':>10}")
    for r in replay_rows:
        print(f"{r['tasks']:>8} {r['changed']:>8} {r['median_ms']:>12.3f} "
              f"{r['max_ms']:>12.3f} {r['views_read']:>15.0f} {r['views_read_max']:>6} "
              f"{r['decisions']:>10}")
    print(flush=True)


def print_cluster_header() -> None:
    print("\n## In-process clusters: N single-thread workers, plain Dask vs blockflow "
          "dynamic\n")
    print(f"{'N':>5} {'plain s':>8} {'bf s':>8} {'wall ratio':>11} {'(min-max)':>11} {'90% CI':>11} "
          f"{'CPU ratio':>10} {'plain CPU':>10} {'hooks us/task':>14} "
          f"{'all-in us/task':>15} {'tick med':>9} {'tick max':>9} {'no-GC max':>10} "
          f"{'GC CPU s':>12}")
    print(f"{'':>5} {'':>8} {'':>8} {'':>11} {'':>11} {'of median':>11} {'':>10} {'us/task':>10} "
          f"{'wall / CPU':>14} {'wall / CPU':>15} {'ms':>9} {'ms':>9} {'ms':>10} "
          f"{'plain / bf':>12}",
          flush=True)


def print_cluster_row(r) -> None:
    print(f"{r['N']:>5} {r['plain_s']:>8.2f} {r['blockflow_s']:>8.2f} "
          f"{r['ratio']:>10.3f}x {r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f} "
          f"{r['ratio_ci'][0]:>5.2f}-{r['ratio_ci'][1]:<5.2f} "
          f"{r['cpu_ratio']:>9.3f}x {r['plain_cpu_us']:>10.0f} "
          f"{r['per_task_us']:>6.1f} / {r['cpu_per_task_us']:<5.1f} "
          f"{r['all_in_us']:>7.1f} / {r['cpu_all_in_us']:<5.1f} "
          f"{r['tick_median_ms']:>9.2f} {r['tick_max_ms']:>9.2f} {r['tick_max_nogc_ms']:>10.2f} "
          f"{r['gc_plain']:>5.2f} / {r['gc_blockflow']:<4.2f}", flush=True)


def plot(cluster_rows, replay_rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    if cluster_rows:
        ns = [r["N"] for r in cluster_rows]
        ax = axes[0]
        ax.plot(ns, [r["ratio"] for r in cluster_rows], "o-", label="wall time")
        ax.plot(ns, [r["cpu_ratio"] for r in cluster_rows], "s--", label="event-loop CPU")
        ax.axhline(1.05, color="grey", ls=":", label="target 1.05x")
        ax.axhline(1.0, color="black", lw=0.5)
        ax.set(xscale="log", xlabel="workers N", ylabel="blockflow / plain",
               title="Trivial tasks: blockflow dynamic vs plain")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.legend()
        ax = axes[1]
        ax.plot(ns, [r["per_task_us"] for r in cluster_rows], "o-",
                label="hooks, us/task (wall)")
        ax.plot(ns, [r["cpu_per_task_us"] for r in cluster_rows], "o:",
                label="hooks, us/task (CPU)")
        ax.plot(ns, [r["cpu_all_in_us"] for r in cluster_rows], "s-",
                label="hooks + ticks, us/task (CPU)")
        ax.plot(ns, [r["tick_median_ms"] for r in cluster_rows], "^-", label="tick median, ms")
        ax.plot(ns, [r["tick_max_ms"] for r in cluster_rows], "v--", label="tick max, ms")
        ax.set(xscale="log", yscale="log", xlabel="workers N",
               title="The plugin's own cost (as it measures it)")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.legend(fontsize=8)
    if replay_rows:
        ax = axes[2]
        for t in sorted({r["tasks"] for r in replay_rows}):
            rows = [r for r in replay_rows if r["tasks"] == t]
            ax.plot([max(r["changed"], 1) for r in rows], [r["median_ms"] for r in rows],
                    "o-", label=f"{t} tasks, median")
        ax.set(xscale="log", yscale="log", xlabel="workers changed per tick (0 shown at 1)",
               ylabel="ms per tick",
               title=f"Replay: {replay_rows[0]['workers']} simulated workers")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="8,32,128")
    ap.add_argument("--tasks", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--replay-workers", type=int, default=1000)
    ap.add_argument("--ticks", type=int, default=60)
    ap.add_argument("--parts", default="cluster,replay")
    ap.add_argument("--plot", default=None, help="write a PNG of both parts here")
    ap.add_argument("--quick", action="store_true", help="8 and 32 workers, 2 reps, 2,000 tasks")
    ap.add_argument("--same-process", action="store_true",
                    help="run every cluster run in this process (default: each in a fresh "
                         "interpreter)")
    ap.add_argument("--aa", action="store_true",
                    help="A/A check: plain Dask in both arms (the bf columns are plain again)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # N,TASKS,MODE: one run
    args = ap.parse_args(argv)
    if args.one:
        import json

        logging.getLogger("distributed").setLevel(logging.ERROR)
        n, t, mode = args.one.split(",")
        print(json.dumps(asyncio.run(cluster_run(int(n), int(t), mode))), flush=True)
        return
    if args.quick:
        args.workers, args.tasks, args.reps, args.ticks = "8,32", 2000, 2, 20
    logging.getLogger("distributed").setLevel(logging.ERROR)
    parts = args.parts.split(",")
    print_header(args)
    replay_rows = []
    if "replay" in parts:
        replay_rows = replay_part(args.replay_workers, args.ticks, [0, 10, 100, 1000],
                                  [5_000, 50_000, 500_000])
        print_replay(replay_rows, args)
    if "start" in parts:  # benchmarks/startup.py
        sys.path.insert(0, __import__("os").path.dirname(__file__))
        from startup import print_start, start_part

        print_start(start_part(args.reps, args.tasks), args)
    cluster_rows = []
    if "cluster" in parts:
        print_cluster_header()
        for n in (int(n) for n in args.workers.split(",")):
            row = cluster_part([n], args.tasks, args.reps, isolate=not args.same_process,
                               aa=args.aa)[0]
            print_cluster_row(row)
            cluster_rows.append(row)
            if args.plot:
                plot(sorted(cluster_rows, key=lambda r: r["N"]), replay_rows, args.plot)
        print(f"\n# load average {__import__('os').getloadavg()[0]:.1f} at the end")
    if args.plot:
        plot(sorted(cluster_rows, key=lambda r: r["N"]), replay_rows, args.plot)


if __name__ == "__main__":
    main()
