"""Calls blockflow makes on every worker are bounded per worker: one that does not answer
(its event loop stuck, unreachable) is named in one warning and the call goes on."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import dask
import pytest
from distributed import Client, LocalCluster

import blockflow
from loadaware import scaled, wait_until
from blockflow import _distributed
from blockflow.errors import BlockflowWarning
from blockflow.scheduling.wait import add_worker_plugin, remove_worker_plugin, run_each


def _stuck_until(path: str, limit: float = 60.0) -> None:
    """Run on a worker's event loop: hold it until ``path`` exists (a hung worker)."""
    open(path + ".held", "w").close()
    end = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.05)


def _pid() -> int:
    return os.getpid()


@pytest.fixture
def stuck_worker(tmp_path):
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        workers = sorted(client.scheduler_info()["workers"])
        flag = str(tmp_path / "release")
        hold = threading.Thread(target=client.run, args=(_stuck_until, flag),
                                kwargs={"workers": [workers[0]]}, daemon=True)
        hold.start()
        wait_until(lambda: os.path.exists(flag + ".held"), message="the worker held")
        try:
            yield client, workers
        finally:
            open(flag, "w").close()
            hold.join()


def test_inventory_names_a_worker_that_does_not_answer_and_lists_every_worker(stuck_worker):
    client, workers = stuck_worker
    limit = scaled(3)  # the others answer within it on a loaded machine too
    with dask.config.set({"blockflow.cluster.worker-call-timeout": limit}):
        with pytest.warns(BlockflowWarning, match=f"inventory's probe: going on without "
                                                  f"worker {workers[0]} .no answer within"):
            inventory = blockflow.inventory(client)
    assert sorted(w.address for w in inventory.workers) == workers


def test_run_each_returns_the_workers_that_answered(stuck_worker):
    client, workers = stuck_worker
    with pytest.warns(BlockflowWarning, match=f"going on without worker {workers[0]}"):
        got = run_each(client, _pid, what="a test", timeout=scaled(3))
    assert sorted(got) == workers[1:] and all(isinstance(p, int) for p in got.values())


def _plugin_names(dask_worker=None) -> list:
    return sorted(dask_worker.plugins)


def test_a_worker_plugin_reaches_the_workers_that_answer_and_names_the_one_that_does_not(
        stopped_worker):
    # distributed's registration waits on every worker (a scheduler broadcast): a worker that
    # does not answer held it, and an unreachable one failed it with CommClosedError
    client, workers = stopped_worker
    plugin = _distributed.QuietClose()
    with pytest.warns(BlockflowWarning, match=f"a test: going on without worker "
                                              f"{workers[0]} .no answer within"):
        add_worker_plugin(client, plugin, what="a test", timeout=scaled(3))
    names = run_each(client, _plugin_names, workers=workers[1:])
    assert sorted(names) == workers[1:]
    assert all(plugin.name in got for got in names.values())
    with pytest.warns(BlockflowWarning, match=f"going on without worker {workers[0]}"):
        remove_worker_plugin(client, plugin.name, timeout=scaled(3))
    assert all(plugin.name not in got
               for got in run_each(client, _plugin_names, workers=workers[1:]).values())


async def _register_from_scheduler(timeout, dask_scheduler=None):
    await _distributed.register_worker_plugin_on_scheduler(
        dask_scheduler, _distributed.QuietClose(), "blockflow-test-plugin", timeout=timeout)


def test_a_scheduler_side_registration_names_the_worker_that_does_not_answer(stuck_worker,
                                                                              caplog):
    # the preload's and the plugin's own registrations: they raised CommClosedError
    # ("Scheduler Broadcast") for an unreachable worker and waited on a stuck one
    client, workers = stuck_worker
    with caplog.at_level(logging.WARNING, logger="blockflow"):
        client.run_on_scheduler(_register_from_scheduler, scaled(3))
    named = [r.getMessage() for r in caplog.records if workers[0] in r.getMessage()]
    assert len(named) == 1 and "going on without worker" in named[0], named
    names = run_each(client, _plugin_names, workers=workers[1:])
    assert all("blockflow-test-plugin" in got for got in names.values())


@pytest.fixture
def stopped_worker():
    """A LocalCluster whose first worker process is stopped (SIGSTOP: its host still accepts
    connections, nothing answers), continued at the end."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        workers = sorted(client.scheduler_info()["workers"])
        pid = client.run(_pid, workers=[workers[0]])[workers[0]]
        os.kill(pid, signal.SIGSTOP)
        try:
            yield client, workers
        finally:
            os.kill(pid, signal.SIGCONT)


def test_the_inventory_probe_goes_on_without_a_stopped_worker_process(stopped_worker):
    client, workers = stopped_worker
    with dask.config.set({"blockflow.cluster.worker-call-timeout": scaled(3)}):
        with pytest.warns(BlockflowWarning, match=f"inventory's probe: going on without "
                                                  f"worker {workers[0]} .no answer within"):
            inventory = blockflow.inventory(client)
        assert sorted(w.address for w in inventory.workers) == workers
