"""Worker loss: SIGKILLed worker processes mid-run, repeated deaths, and no worker at all.

Every test kills real worker processes of a real cluster. A worker killed under its nanny
comes back (with a new address); results must be the same as an undisturbed run's, and
blockflow's scheduler plugin must forget the dead worker and use the new one.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import dask
import dask.array as da
import numpy as np
import pandas as pd
import pytest
from distributed import LocalCluster
from loadaware import scaled, wait_until

import blockflow
from blockflow.errors import BlockflowWarning, WorkerLostError
from blockflow.testing import SimulatedDevice, SimulatedGPU, set_tenant
from blockflow.workloads import flights

from .conftest import (
    _cluster_state,
    assert_forgotten,
    kill,
    ready_workers,
    running_workers,
    tasks_done_on,
    why_not_run,
    worker_pids,
)

pytestmark = pytest.mark.slow


def slow_double(block):
    time.sleep(0.05)
    return block * 2


def _new_worker_runs_tasks(client, old: list[str]) -> str:
    """Wait for the worker that replaced a killed one and check that it gets work."""
    # ready: a restarted worker is known (status "init") before its plugins have started,
    # and the scheduler gives it no task until it runs
    found: dict[str, str] = {}

    def one_new() -> bool:
        # (read once: reading the workers again after the wait raced with a worker that was
        # ready at the wait's last look and not at the next, CI 1 run in ~10)
        fresh = set(ready_workers(client)) - set(old)
        if len(fresh) == 1:
            found["new"] = next(iter(fresh))
        return len(fresh) == 1

    wait_until(one_new, timeout=60, message=lambda: "the restarted worker: "
               f"{_cluster_state(client)}")
    new = found["new"]
    before = tasks_done_on(client, new)
    # A fresh name each time: a graph with the keys of an earlier call's (whose results the
    # scheduler may not have released yet) would run nothing at all.
    x = blockflow.map_blocks(slow_double, da.arange(40, chunks=1),
                             name=f"after-restart-{uuid.uuid4().hex}")
    assert client.compute(x.sum()).result() == 2 * sum(range(40))
    # On a loaded machine the other worker may finish all 40 before the new one takes any:
    # a task only the new worker may run shows that it runs (a paused worker would not).
    pinned = client.submit(slow_double, np.ones(2), workers=[new], allow_other_workers=False,
                           pure=False)
    try:
        result = pinned.result(timeout=scaled(60, at_most=120))
    except TimeoutError:  # say why, as the scheduler and the worker itself see it
        pytest.fail(f"the restarted worker {new} did not run a task pinned to it: "
                    f"{why_not_run(client, pinned.key, new)}")
    assert result.tolist() == [2.0, 2.0]
    wait_until(lambda: tasks_done_on(client, new) > before, timeout=30,
               message="the new worker's task count")
    return new


def _snapshot(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_flights_run_survives_a_killed_worker(healthy, tmp_path):
    client = healthy
    kwargs = dict(scale=2, partitions_per_copy=4, split_every=4, progress=False)
    undisturbed = flights.run(client, **kwargs)
    old = running_workers(client)
    victim, pid = next(iter(worker_pids(client).items()))
    done_before = tasks_done_on(client, victim)
    # the run names the worker it lost, in one line
    with concurrent.futures.ThreadPoolExecutor(1) as pool, pytest.warns(
            BlockflowWarning, match=f"worker {victim} .host [^)]*. left during the run"):
        running = pool.submit(flights.run, client, output=tmp_path / "out", **kwargs)
        # Kill once the victim has finished some of this run's tasks (it holds results).
        wait_until(lambda: tasks_done_on(client, victim) > done_before + 1 or running.done(),
                   interval=0.01, message="the victim to finish a task")
        assert not running.done(), "the run ended before the worker could be killed"
        kill(pid)
        disturbed = running.result(timeout=180)
    for name, table in undisturbed.tables.items():
        pd.testing.assert_frame_equal(disturbed.tables[name], table, check_exact=True)
        on_disk = pd.read_parquet(tmp_path / "out" / f"{name}.parquet")
        pd.testing.assert_frame_equal(on_disk, table, check_exact=True)
    assert disturbed.input_rows == undisturbed.input_rows == 2 * 336_776
    assert_forgotten(client, victim)
    _new_worker_runs_tasks(client, old)


def test_tree_reduction_survives_a_killed_worker(healthy):
    client = healthy
    old = running_workers(client)
    victim, pid = next(iter(worker_pids(client).items()))
    done_before = tasks_done_on(client, victim)
    x = da.arange(4_000, chunks=50)  # 80 blocks of 50 ms each
    total = blockflow.tree_reduce(blockflow.map_blocks(slow_double, x), np.sum, split_every=4)
    future = client.compute(total)
    wait_until(lambda: tasks_done_on(client, victim) >= done_before + 10 or future.done(),
               interval=0.01, message="10 blocks on the victim")
    assert not future.done()
    kill(pid)
    assert future.result(timeout=120) == 2 * np.arange(4_000).sum()
    assert_forgotten(client, victim)
    _new_worker_runs_tasks(client, old)


def test_a_killed_paused_worker_leaves_no_ghost(healthy):
    """A worker the plugin paused (simulated GPU busy with another tenant) is SIGKILLed: the
    pause is forgotten with it, and its replacement, whose device is idle, runs tasks."""
    client = healthy
    client.register_plugin(SimulatedGPU(default=SimulatedDevice()))
    try:
        old = running_workers(client)
        victim, pid = next(iter(worker_pids(client).items()))
        client.run(set_tenant, (95, 0), workers=[victim])
        wait_until(lambda: victim in blockflow.plugin_status(client)["paused"], timeout=30,
                   message="the plugin to pause the hot worker")
        kill(pid)
        assert_forgotten(client, victim)
        forget = blockflow.decisions(client).query("action == 'forget' and worker == @victim")
        assert forget["reason"].tolist() == [
            "worker left the cluster (it was paused by blockflow)"]
        new = _new_worker_runs_tasks(client, old)
        assert blockflow.plugin_status(client)["paused"] == {}
        assert new not in blockflow.decisions(client).query("action == 'pause'")["worker"].values
    finally:
        client.unregister_worker_plugin(SimulatedGPU.name)


def _set_allowed_failures(n, dask_scheduler=None):
    old, dask_scheduler.allowed_failures = dask_scheduler.allowed_failures, n
    return old


def _processing(dask_scheduler=None) -> list[str]:
    """Workers with tasks processing."""
    return [a for a, ws in dask_scheduler.workers.items() if ws.processing]


def test_workers_dying_under_a_task_fail_clearly_and_keep_the_old_output(healthy, tmp_path):
    """A worker killed while it runs a task, with allowed-failures 0: distributed gives up on
    the task (KilledWorker); flights.run says so and the old output stays as it was."""
    client = healthy
    out = tmp_path / "out"
    flights.run(client, scale=1, output=out, progress=False)
    before = _snapshot(out)
    old = client.run_on_scheduler(_set_allowed_failures, 0)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(flights.run, client, scale=2, output=out, overwrite=True,
                                  progress=False)
            for _ in range(5):  # kill a worker while it runs a task (once is nearly always it)
                wait_until(lambda: client.run_on_scheduler(_processing) or running.done(),
                           timeout=60, interval=0.01, message="tasks processing")
                if running.done():
                    break
                pids = worker_pids(client)
                busy = [a for a in client.run_on_scheduler(_processing) if a in pids]
                if not busy:
                    continue
                kill(pids[busy[0]])
                # Never kill a worker that is still starting: wait for its replacement.
                wait_until(lambda: len(set(worker_pids(client)) - set(pids)) == 1,
                           timeout=60, message="the worker restarted")
            with pytest.raises(WorkerLostError) as info:
                running.result(timeout=120)
    finally:
        client.run_on_scheduler(_set_allowed_failures, old)
    message = str(info.value)
    assert message.startswith(
        "blockflow: the flights ETL (scale 2) failed because workers died while running "
        "block ("), message
    assert " of step '" in message  # the step by name, never its token
    assert not re.search(r"[0-9a-f]{32}", message), message
    assert ("the worker running it died 1 time (the last one was tcp://127.0.0.1:" in message
            and "so Dask gave up on it (KilledWorker)" in message
            and "raise distributed.scheduler.allowed-failures and run again." in message)
    assert type(info.value.__cause__).__name__ == "KilledWorker"
    assert _snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left


def test_losing_every_worker_fails_clearly_and_keeps_the_old_output(tmp_path):
    """Workers without nannies (``dask worker --no-nanny``), all SIGKILLed mid-run: nothing
    restarts them, so the run fails after blockflow.cluster.worker-loss-timeout."""
    dask_cli = shutil.which("dask", path=os.path.dirname(sys.executable)) or shutil.which("dask")
    with LocalCluster(n_workers=0, processes=True, dashboard_address=":0") as cluster:
        workers = [subprocess.Popen(
            [dask_cli, "worker", cluster.scheduler_address, "--no-nanny", "--nthreads", "1",
             "--no-dashboard"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(2)]
        try:
            client = blockflow.connect(cluster.scheduler_address, policy="dynamic")
            client.wait_for_workers(2, timeout=60)
            out = tmp_path / "out"
            flights.run(client, scale=1, output=out, progress=False)  # an earlier run's output
            before = _snapshot(out)
            done_before = sum(blockflow.task_counts(client).values())
            with dask.config.set({"blockflow.cluster.worker-loss-timeout": "2s"}), \
                    concurrent.futures.ThreadPoolExecutor(1) as pool:
                running = pool.submit(flights.run, client, scale=2, output=out, overwrite=True,
                                      progress=False)
                wait_until(lambda: sum(blockflow.task_counts(client).values()) > done_before
                           or running.done(), timeout=60, interval=0.01,
                           message="the first finished task")
                assert not running.done()
                start = time.monotonic()
                for w in workers:
                    kill(w.pid)
                with pytest.raises(WorkerLostError) as info:
                    running.result(timeout=60)
                took = time.monotonic() - start
            message = str(info.value)
            assert message.startswith(
                f"blockflow: every worker of the cluster at {cluster.scheduler_address} was "
                f"lost during the flights ETL (scale 2); with no worker for 2 s, ")
            assert message.endswith(
                "results could not be computed. Restart the workers (or the cluster) and run "
                "again. Workers that keep dying usually run out of memory or crash: their logs "
                "say which; give them more memory (memory_limit=) or use smaller blocks. "
                "(blockflow.cluster.worker-loss-timeout sets how long to wait.)")
            assert 2 <= took < scaled(20)
            assert _snapshot(out) == before  # the earlier output, byte for byte
            assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder
            assert blockflow.decisions(client).query("action == 'forget'")["worker"].nunique() == 2
            client.close()
        finally:
            for w in workers:
                w.kill()
                w.wait(timeout=30)
