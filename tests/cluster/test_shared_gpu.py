"""Two workers on one GPU (the same device UUID): flagged by ``blockflow.inventory`` (a column
naming the sharing workers, a ``BlockflowWarning``, the device counted once), by
``/blockflow/status.json``, and treated as one device by the dynamic policy."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import urllib.request

import pytest
from distributed import Client, LocalCluster
from distributed.utils_test import gen_cluster
from loadaware import wait_until

import blockflow
from blockflow.scheduling.view import workers_info
from blockflow.scheduling import Rebalancer
from blockflow.scheduling.actions import Action
from blockflow.scheduling.rules import RuleContext
from blockflow.testing import (
    SimulatedDevice,
    SimulatedGPU,
    Tenant,
    install_simulated_devices,
    simulated_kernel,
)

SHARED = "GPU-5f0c6f7e-0000-4000-8000-000000000001"


@pytest.fixture(scope="module")
def shared():
    """Three simulated GPU workers, the first two reporting the same device UUID, with
    blockflow's plugins registered as blockflow.connect does."""
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=False,
                      dashboard_address="127.0.0.1:0", silence_logs=logging.CRITICAL) as cluster:
        with Client(cluster, set_as_default=False) as client:
            client.register_plugin(SimulatedGPU({
                0: SimulatedDevice(uuid=SHARED), 1: SimulatedDevice(uuid=SHARED),
                2: SimulatedDevice()}))
            wait_until(lambda: all(w["metrics"].get("blockflow-gpu-uuid")
                                   for w in workers_info(client).values()),
                       timeout=30, message="the simulated GPU metrics of every worker")
            from blockflow.cluster.connection import _register_plugin

            _register_plugin(client, Rebalancer(policy="dynamic"))
            yield client


def _names(client) -> dict:
    return {str(w["name"]): a for a, w in workers_info(client).items()}


def test_inventory_flags_two_workers_on_one_gpu(shared):
    by_name = _names(shared)
    pair = sorted([by_name["0"], by_name["1"]])
    with pytest.warns(blockflow.BlockflowWarning, match=re.escape(
            f"blockflow.inventory: {pair[0]}, {pair[1]} all use GPU {SHARED}. Workers on one "
            f"GPU share its memory and compute, so the cluster has 2 GPUs for 3 GPU workers; "
            f"start one worker per GPU")):
        inv = blockflow.inventory(shared)
    assert inv.n_gpus == 2 and inv.n_gpu_workers == 3
    assert inv.shared_gpus == {SHARED: tuple(pair)}
    sharing = {w.address: w.shares_gpu_with for w in inv}
    assert sharing == {pair[0]: (pair[1],), pair[1]: (pair[0],), by_name["2"]: ()}
    df = inv.to_pandas()
    assert "shares_gpu_with" in df.columns
    assert df.set_index("address").loc[pair[0], "shares_gpu_with"] == (pair[1],)
    text = repr(inv)
    assert "2 GPUs for 3 GPU workers (some share a GPU)" in text and "shares GPU with" in text
    assert all(w.resources == {"GPU": 1} for w in inv)


def test_status_json_names_the_shared_gpu(shared):
    port = shared.cluster.scheduler.http_server.port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/blockflow/status.json",
                                timeout=20) as r:
        data = json.loads(r.read().decode())
    by_name = _names(shared)
    pair = sorted([by_name["0"], by_name["1"]])
    assert data["shared_gpus"] == [{"uuid": SHARED, "workers": pair}]
    rows = {w["address"]: w for w in data["workers"]}
    assert rows[pair[0]]["shares_gpu_with"] == [pair[1]]
    assert rows[by_name["2"]]["shares_gpu_with"] == []
    assert rows[by_name["2"]]["gpu_uuid"].startswith("SIM-")
    status = blockflow.plugin_status(shared)
    assert status["resources"]["shared_gpus"] == {SHARED: pair}


def test_one_worker_per_gpu_is_not_flagged(shared):
    import warnings

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0", silence_logs=logging.CRITICAL) as cluster:
        with Client(cluster) as client:
            client.register_plugin(SimulatedGPU(SimulatedDevice()))
            wait_until(lambda: all(w["metrics"].get("blockflow-gpu-uuid")
                                   for w in workers_info(client).values()),
                       timeout=30, message="the simulated GPU metrics of every worker")
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                inv = blockflow.inventory(client)
            assert inv.n_gpus == 2 and inv.shared_gpus == {}


@pytest.mark.parametrize("same_device", [True, False])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
@pytest.mark.slow
async def test_dynamic_policy_does_not_pause_a_worker_for_its_gpu_partners_work(
        c, s, a, b, same_device):
    # a runs a long kernel on the device; b is idle, and on one shared GPU NVML shows b the
    # device as busy (modelled by a tenant on b's simulated device). Alone on its GPU, b
    # would be right to call that other work and pause; sharing it with a, it must not.
    await install_simulated_devices(c, {
        a.address: SimulatedDevice(uuid=SHARED if same_device else None),
        b.address: SimulatedDevice(uuid=SHARED if same_device else None,
                                   tenant=Tenant(95, 0), tenant_contention=False)})
    await c.register_plugin(Rebalancer(policy="dynamic", interval=0))
    plugin = s.plugins["blockflow-rebalancer"]
    plugin.paused.clear()
    if b.address in s.workers and s.workers[b.address].status.name == "paused":
        from blockflow import _distributed

        _distributed.set_worker_status(s, b.address, False, "test-resume")
    running = c.submit(simulated_kernel, 1, work=5.0, workers=[a.address], pure=False)
    await asyncio.sleep(1.2)  # a's own utilisation is measured over the last second

    async def beat(dask_worker):
        await dask_worker.heartbeat()

    await c.run(beat)
    views = plugin._views()
    paused = [d.worker for d in plugin.policy.pause.run(plugin.take_snapshot(), RuleContext())
              if d.action == Action.PAUSE]
    if same_device:
        assert views[b.address].device_peers == (a.address,)
        assert views[b.address].peers_own_utilization >= 50
        assert views[b.address].others_utilization < 80
        assert b.address not in paused
    else:
        assert views[b.address].device_peers == ()
        assert views[b.address].others_utilization >= 80
        assert b.address in paused  # the test can fail: apart, b is right to pause
    await c.cancel(running)
