"""Garbage worker metrics never crash blockflow's scheduler plugin or stop its control loop.

Workers of a real cluster report GPU metrics through metric functions (as distributed's NVML
monitor and blockflow's simulated devices do); here those functions return garbage — None,
negative, NaN, infinite, strings, lists, dicts, booleans — or the keys go missing, while the
dynamic policy's PeriodicCallback keeps ticking.
"""

from __future__ import annotations

import math
import time

import dask.array as da
import pytest
from distributed import Client, LocalCluster
from distributed.diagnostics.plugin import WorkerPlugin

import blockflow
from blockflow.scheduling.view import workers_info
from blockflow._distributed import remove_worker_metric, set_worker_metric, worker_heartbeat
from blockflow._distributed.metrics import (
    CAPACITY_METRIC,
    GPU_MEMORY_TOTAL,
    GPU_MEMORY_USED,
    GPU_UTILIZATION,
    OWN_UTILIZATION_METRIC,
)
from blockflow.scheduling import Rebalancer

from loadaware import wait_until

KEYS = (GPU_UTILIZATION, GPU_MEMORY_USED, GPU_MEMORY_TOTAL, OWN_UTILIZATION_METRIC,
        CAPACITY_METRIC)
GARBAGE = [None, -1, float("nan"), float("inf"), "hot", "16GB", [1, 2], {"a": 1}, True,
           1e300, -float("inf"), ""]
MISSING = "missing"


class GarbageMetrics(WorkerPlugin):
    """Worker metrics returning ``GARBAGE[(step + offset) % n]``; at a "missing" step the
    keys are taken away."""

    name = "test-garbage-metrics"

    def setup(self, worker):
        worker._garbage_step = 0
        install(worker)


def install(worker) -> None:
    for offset, key in enumerate(KEYS):
        set_worker_metric(worker, key,
                          lambda w, o=offset: GARBAGE[(w._garbage_step + o) % len(GARBAGE)])


async def set_step(step, dask_worker=None):
    dask_worker._garbage_step = step
    if step % 5 == 4:
        for key in KEYS:
            remove_worker_metric(dask_worker, key)
        seen = MISSING
    else:
        install(dask_worker)
        seen = GARBAGE[step % len(GARBAGE)]
    await worker_heartbeat(dask_worker)
    return seen


def reported(client) -> list:
    """What the scheduler holds for each worker's ``gpu_utilization`` (one snapshot)."""
    workers = workers_info(client)
    return [info["metrics"].get(GPU_UTILIZATION, MISSING) for info in workers.values()]


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float)
                      and math.isnan(a) and math.isnan(b))


@pytest.mark.slow
def test_garbage_metrics_never_stop_the_dynamic_policy():
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        client.register_plugin(Rebalancer(policy="dynamic"))  # ticks every 100 ms
        client.register_plugin(GarbageMetrics())
        start = blockflow.plugin_status(client)["ticks"]
        steps = 2 * len(GARBAGE)
        for step in range(steps):
            seen = client.run(set_step, step)
            sent = next(iter(seen.values()))
            assert all(_same(r, sent) for r in reported(client))
            ticks = blockflow.plugin_status(client)["ticks"]
            wait_until(lambda: blockflow.plugin_status(client)["ticks"] > ticks + 1,
                       timeout=10, message="two more ticks of the control loop")
        status = blockflow.plugin_status(client)
        assert status["ticks"] >= start + 2 * steps
        assert status["paused"] == {}
        assert not any(d["action"] in ("pause", "keep") for d in status["decisions"])
        for worker in status["workers"].values():  # what the plugin made of the garbage
            for k in ("gpu_utilization", "gpu_memory_used", "gpu_memory_total"):
                assert worker[k] is None or (math.isfinite(worker[k]) and worker[k] >= 0)
        x = blockflow.map_blocks(lambda b: b + 1, da.zeros(30, chunks=1))
        assert client.compute(x.sum()).result() == 30  # tasks still run everywhere
        time.sleep(0.3)
        assert blockflow.plugin_status(client)["ticks"] > status["ticks"]
