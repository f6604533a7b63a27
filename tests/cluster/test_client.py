"""blockflow reads the scheduler's workers from its own reply, never from the client's
shared copy that the client's periodic refresh overwrites without workers."""

from __future__ import annotations

import dask
import pytest
from distributed import Client, LocalCluster

from blockflow.scheduling.view import scheduler_identity, workers_info


@pytest.fixture
def fast_refresh_client():
    # the client refreshes its copy every 5 ms with a reply that lists no workers
    with dask.config.set({"distributed.client.scheduler-info-interval": "5ms"}):
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                          dashboard_address=":0") as cluster, Client(cluster) as client:
            yield client


def test_workers_never_come_back_empty_while_the_client_refreshes(fast_refresh_client):
    client = fast_refresh_client
    seen = [len(workers_info(client)) for _ in range(300)]
    assert seen == [2] * 300
    identity = scheduler_identity(client)
    assert identity["address"] == client.scheduler.address and len(identity["workers"]) == 2


def test_in_a_task_the_worker_client_sees_every_worker(fast_refresh_client):
    from distributed import get_client

    def count():
        return len(workers_info(get_client()))

    assert fast_refresh_client.submit(count, pure=False).result() == 2
