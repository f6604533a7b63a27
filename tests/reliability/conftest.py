"""Fixtures and helpers of the reliability suite: real clusters, real worker processes.

Failures are injected for real: worker processes are killed with SIGKILL, kernels fail
through files shared by all processes, devices run out of simulated memory. Nothing of
Dask is mocked.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings

import pytest
from distributed import Client
from loadaware import wait_until

import blockflow
from blockflow.scheduling.view import workers_info


@pytest.fixture(scope="package")
def proc_client():
    """``blockflow.connect()``'s embedded cluster: 2 worker processes x 1 thread, each under
    its nanny (which restarts a killed worker), dynamic policy, dashboard on a free port."""
    client = blockflow.connect(gpu=False, n_workers=2, threads_per_worker=1,
                               dashboard_address=":0", policy="dynamic")
    yield client
    cluster, pids = client.cluster, worker_pids(client)
    client.close(timeout=30)
    # Rarely (3 times in about 15 runs of this suite on a 2-core machine) a nanny waits
    # forever for its worker process to exit on close, after the kill-and-restart tests.
    # Kill the workers then, and say so, rather than hang the suite.
    stuck = threading.Timer(30, _kill_stuck_workers, args=(list(pids.values()),))
    stuck.start()
    try:
        cluster.close(timeout=90)
    finally:
        stuck.cancel()
    if stuck.finished.is_set() and getattr(stuck, "fired", False):
        warnings.warn(f"closing the cluster hung; killed its worker processes {pids}")


def _kill_stuck_workers(pids: list[int]) -> None:
    threading.current_thread().fired = True
    for pid in pids:
        try:
            kill(pid)
        except ProcessLookupError:
            pass


@pytest.fixture
def healthy(proc_client):
    """``proc_client`` with both workers up and answering; waits for restarted workers after
    the test."""
    wait_until(lambda: _two_workers_answer(proc_client), timeout=60, message="2 running workers")
    yield proc_client
    try:
        wait_until(lambda: _two_workers_answer(proc_client), timeout=60,
                   message="2 running workers after the test")
    except pytest.fail.Exception:
        # Once in about 20 full runs of the suite (CI, after the allowed-failures-0 test) a
        # killed worker's replacement was not back 60 s later, with nothing in the log. The
        # test itself had passed: say what the cluster looked like, restart its workers so
        # the next test gets a healthy cluster, and fail only if that does not help.
        warnings.warn("2 workers were not back 60 s after the test: "
                      f"{_cluster_state(proc_client)}")
        _replace_lost_workers(proc_client)
        wait_until(lambda: _two_workers_answer(proc_client), timeout=120,
                   message="2 running workers after replacing the lost ones")


def _replace_lost_workers(client: Client) -> None:
    """Close the nannies whose worker the scheduler does not know and let the cluster start
    new ones in their place (SpecCluster opens a worker for every spec without one)."""
    cluster = client.cluster
    known = set(workers_info(client))
    for name, nanny in list(cluster.workers.items()):
        if getattr(nanny, "worker_address", None) not in known:
            try:
                cluster.sync(nanny.close, timeout=30)
            except Exception as e:  # a stuck nanny: its process goes with the test run
                warnings.warn(f"closing the nanny of lost worker {name!r} failed: {e!r}")
            del cluster.workers[name]
    cluster.scale(len(cluster.worker_spec))


def _two_workers_answer(client: Client) -> bool:
    return len(worker_pids(client)) == len(running_workers(client)) == 2


def _cluster_state(client: Client) -> str:
    workers = workers_info(client)
    return (f"scheduler: {({a: w.get('status') for a, w in workers.items()})}; answering: "
            f"{worker_pids(client)}; nannies: {sorted(client.cluster.workers)}")


def running_workers(client: Client) -> list[str]:
    """Addresses of the workers the scheduler has, sorted."""
    return sorted(workers_info(client))


def ready_workers(client: Client) -> list[str]:
    """Addresses of the workers the scheduler would give tasks to (status ``running``: a
    restarted worker is known in status ``init`` while its plugins start, and gets no task
    until then), sorted."""
    workers = workers_info(client)
    return sorted(a for a, w in workers.items() if w.get("status") == "running")


def worker_pids(client: Client) -> dict[str, int]:
    """Worker address -> process id of the worker process (not its nanny); workers that died
    a moment ago are left out."""
    return dict(sorted(client.run(os.getpid, on_error="ignore").items()))


def _task_and_worker(key, address: str, dask_scheduler=None) -> dict:
    ts, ws = dask_scheduler.tasks.get(key), dask_scheduler.workers.get(address)
    plugin = dask_scheduler.plugins.get("blockflow-rebalancer")
    return {
        "task": None if ts is None else {
            "state": ts.state,
            "processing_on": getattr(ts.processing_on, "address", None),
            "restrictions": sorted(ts.worker_restrictions or ())},
        "worker": None if ws is None else {
            "status": ws.status.name, "processing": len(ws.processing),
            "in running set": ws in dask_scheduler.running,
            "seconds since heartbeat": round(time.time() - ws.last_seen, 1)},
        "paused by blockflow": sorted(getattr(plugin, "paused", {}) or {}),
    }


def why_not_run(client: Client, key, address: str) -> str:
    """What the scheduler knows of task ``key`` and worker ``address``, and whether the
    worker's event loop answers (a hung worker stays listed until its heartbeat times out):
    the message of a test waiting in vain for a task on that worker."""
    import concurrent.futures

    state = client.run_on_scheduler(_task_and_worker, key, address)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    asked = pool.submit(client.run, lambda dask_worker: {
        "status": dask_worker.status.name,
        "executing": len(dask_worker.state.executing),
        "ready": len(dask_worker.state.ready)}, workers=[address], on_error="return")
    try:
        state["worker answers"] = asked.result(timeout=15).get(address)
    except Exception as e:  # no answer in 15 s: the worker's event loop is stuck
        state["worker answers"] = f"no: {e!r}"
    pool.shutdown(wait=False)
    return repr(state)


def kill(pid: int) -> None:
    """SIGKILL: the process gets no chance to say goodbye to the scheduler."""
    os.kill(pid, signal.SIGKILL)


def tasks_done_on(client: Client, worker: str) -> int:
    """Tasks ``worker`` finished, as counted by blockflow's scheduler plugin."""
    return blockflow.plugin_status(client)["task_counts"].get(worker, 0)


def speed_known(address: str, dask_scheduler=None) -> bool:
    """On the scheduler: whether the plugin's speed model still holds anything on ``address``."""
    speeds = dask_scheduler.plugins["blockflow-rebalancer"].speeds
    return (address in speeds.log_speed or address in speeds.count
            or any(o[0] == address for o in speeds.pending))


def assert_forgotten(client: Client, dead: str) -> None:
    """blockflow's plugin no longer knows the dead worker and logged that it forgot it."""
    wait_until(lambda: dead not in running_workers(client), message=f"{dead} to be removed")
    forgets = blockflow.decisions(client).query("action == 'forget' and worker == @dead")
    assert len(forgets) == 1, blockflow.decisions(client)
    status = blockflow.plugin_status(client)
    assert dead not in status["paused"]
    assert dead not in status["speeds"]
    assert dead not in status["workers"]
    assert not client.run_on_scheduler(speed_known, dead)
