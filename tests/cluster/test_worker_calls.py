"""Calls blockflow makes on every worker are bounded per worker: one that does not answer
(its event loop stuck, unreachable) is named in one warning and the call goes on."""

from __future__ import annotations

import os
import threading
import time

import dask
import pytest
from distributed import Client, LocalCluster

import blockflow
from loadaware import scaled, wait_until
from blockflow.errors import BlockflowWarning
from blockflow.scheduling.wait import run_each


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
