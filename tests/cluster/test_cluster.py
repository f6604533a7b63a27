"""connect(), inventory() and the scheduler plugin's registration, on real clusters."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster
from loadaware import scaled

import blockflow
from blockflow.scheduling.view import workers_info
from blockflow._distributed import worker_metric, worker_plugins
from blockflow.cluster.inventory import WorkerResources
from blockflow._distributed.metrics import CAPACITY_METRIC, OWN_UTILIZATION_METRIC


@pytest.fixture(scope="module")
def embedded():
    client = blockflow.connect(gpu=False, n_workers=2, threads_per_worker=1,
                               dashboard_address=":0", policy="off")
    yield client
    client.shutdown()
    client.close()


@pytest.mark.slow
def test_connect_starts_embedded_cpu_cluster_with_plugin(embedded):
    assert isinstance(embedded.cluster, LocalCluster)
    assert len(workers_info(embedded)) == 2
    status = blockflow.plugin_status(embedded)
    assert status["policy"] == "off"
    assert status["task_counts"] == {} or isinstance(status["task_counts"], dict)


def test_plugin_counts_blockflow_kernel_tasks_per_worker(embedded):
    before = blockflow.task_counts(embedded, kernels_only=True)
    x = da.ones(1000, chunks=100)
    y = blockflow.map_blocks(lambda b: b + 1, x, name="plus-one").persist()
    assert y.sum().compute() == 2000
    after = blockflow.task_counts(embedded, kernels_only=True)
    assert sum(after.values()) - sum(before.values()) == 10
    assert set(after) <= set(workers_info(embedded))
    # Dask fuses a kernel into the first step of a following reduction; blockflow's tree
    # reduction keeps the blockflow- name, so those tasks count as kernels too.
    z = blockflow.tree_reduce(blockflow.map_blocks(lambda b: b * 2, x), np.sum, split_every=4)
    assert z.compute() == 2000
    final = blockflow.task_counts(embedded, kernels_only=True)
    assert sum(final.values()) - sum(after.values()) >= 10


def test_inventory_of_cpu_workers(embedded):
    inv = blockflow.inventory(embedded)
    assert len(inv) == 2 and inv.n_gpus == 0 and inv.total_threads == 2
    for w in inv:
        assert isinstance(w, WorkerResources)
        assert w.device == "cpu"
        assert w.threads == 1
        assert w.memory_limit is None or w.memory_limit > 0
        # CPU-only workers: None for every GPU field, never zero
        assert w.gpu_name is None and w.gpu_uuid is None
        assert w.gpu_memory_total is None and w.gpu_memory_used is None
        assert w.gpu_utilization is None
    df = inv.to_pandas()
    assert list(df.columns) == [
        "address", "host", "name", "threads", "memory_limit", "device", "gpu_name",
        "gpu_uuid", "gpu_memory_total", "gpu_memory_used", "gpu_utilization", "simulated",
        "resources", "shares_gpu_with", "job_system", "job_id", "job_queue", "pool",
        "provider", "region", "price",
    ]
    assert set(df["pool"]) == {"default"}  # workers that report no pool
    assert df["gpu_memory_total"].isna().all() and df["gpu_utilization"].isna().all()
    text = repr(inv)
    assert text.startswith("<blockflow.Inventory: 2 workers, 2 threads, 0 GPUs>")
    assert "n/a" in text and "0%" not in text
    html = inv._repr_html_()
    assert "<table>" in html and html.count("<tr>") == 3


def test_inventory_rejects_non_client():
    with pytest.raises(TypeError, match="blockflow.inventory: expected a distributed.Client, "
                                        "got str; get one with blockflow.connect()."):
        blockflow.inventory("tcp://127.0.0.1:8786")


def test_connect_to_running_scheduler_registers_plugin():
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster:
        client = blockflow.connect(cluster.scheduler_address, policy="static-round-robin")
        try:
            assert blockflow.plugin_status(client)["policy"] == "static-round-robin"
            assert "blockflow-rebalancer" in cluster.scheduler.plugins
        finally:
            client.close()


def test_another_policy_than_the_running_plugins_warns():
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster:
        first = blockflow.connect(cluster.scheduler_address, policy="off")
        try:
            with pytest.warns(blockflow.BlockflowWarning) as record:
                second = blockflow.connect(cluster.scheduler_address, policy="dynamic")
            second.close()
            assert str(record[0].message) == (
                f"blockflow.connect: the scheduler at {cluster.scheduler_address} already runs "
                f"blockflow's plugin with policy 'off', which it keeps: policy='dynamic' is not "
                f"applied, as other clients of that cluster rely on it. To change it, restart "
                f"the scheduler with DASK_BLOCKFLOW__CLUSTER__POLICY=dynamic (or "
                f"blockflow.cluster.policy in its Dask config).")
            assert blockflow.plugin_status(first)["policy"] == "off"
            with blockflow.connect(cluster.scheduler_address, policy="off"):
                pass  # the same policy: nothing to say
            with blockflow.connect(cluster.scheduler_address):
                pass  # no policy asked for: the running one is fine
        finally:
            first.close()


def test_plugin_status_without_plugin_says_how_to_fix():
    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster:
        with Client(cluster) as client:
            with pytest.raises(RuntimeError, match="The scheduler runs no blockflow plugin"):
                blockflow.plugin_status(client)


# Addresses where no scheduler answers: tests/cluster/test_connect_address.py.


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(address=12), TypeError,
     "blockflow.connect: address must be a scheduler address such as 'tcp://host:8786' (or "
     "None for an embedded cluster), got builtins.int 12."),
    (dict(n_workers=0), ValueError,
     "blockflow.connect: n_workers must be an integer >= 1 (or None for the default), got 0."),
    (dict(threads_per_worker=1.5), ValueError,
     "blockflow.connect: threads_per_worker must be an integer >= 1 (or None for the "
     "default), got 1.5."),
])
def test_bad_connect_arguments_are_refused_before_anything_starts(kwargs, error, message):
    with pytest.raises(error) as info:
        blockflow.connect(**kwargs)
    assert str(info.value) == message


def _fail_now():
    raise ValueError("block 0 is corrupt")


def test_gather_results_stops_at_the_first_failure(embedded):
    """The failure is raised at once, not after the other tasks have run."""
    from blockflow.cluster.connection import gather_results

    slow = embedded.submit(time.sleep, 120, pure=False)
    bad = embedded.submit(_fail_now, pure=False)
    start = time.monotonic()
    with pytest.raises(ValueError, match="block 0 is corrupt"):
        gather_results(embedded, [slow, bad])
    assert time.monotonic() - start < scaled(10, at_most=100)
    slow.cancel()


def test_unknown_policy_is_rejected_before_starting_anything():
    with pytest.raises(ValueError, match="Unknown blockflow policy 'fastest'; choose one of "
                                         "dynamic, memory, static-round-robin, static-capacity, off."):
        blockflow.connect(policy="fastest")


def test_bad_gpu_argument():
    with pytest.raises(ValueError, match="gpu must be True, False or 'auto', got 'yes'"):
        blockflow.connect(gpu="yes")


@pytest.mark.slow
def test_dask_scheduler_preload_and_dask_worker_processes(tmp_path):
    """A real cluster started with the dask CLI: blockflow is loaded with --preload."""
    dask_cli = shutil.which("dask", path=os.path.dirname(sys.executable)) or shutil.which("dask")
    assert dask_cli, "the `dask` command should be installed with distributed"
    port = _free_port()
    env = dict(os.environ, DASK_BLOCKFLOW__CLUSTER__POLICY="static-capacity")
    sched = subprocess.Popen(
        [dask_cli, "scheduler", "--host", "127.0.0.1", "--port", str(port),
         "--dashboard-address", ":0", "--preload", "blockflow.scheduling.preload"],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    worker = subprocess.Popen(
        [dask_cli, "worker", f"tcp://127.0.0.1:{port}", "--nthreads", "1", "--no-dashboard"],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=30) as client:
            client.wait_for_workers(1, timeout=60)
            status = blockflow.plugin_status(client)
            assert status["policy"] == "static-capacity"
            x = blockflow.map_blocks(lambda b: b * 3, da.ones(100, chunks=10)).persist()
            assert x.sum().compute() == 300
            assert sum(blockflow.task_counts(client, kernels_only=True).values()) == 10
            # the GPU memory pool plugin reaches the workers (and does nothing on CPU ones)
            pools = client.run(lambda dask_worker: getattr(worker_plugins(dask_worker).get(
                "blockflow-gpu-memory-pool"), "added", "missing"))
            assert set(pools.values()) == {None}
    finally:
        for p in (worker, sched):
            p.terminate()
        for p in (worker, sched):
            p.wait(timeout=30)


@pytest.mark.slow
def test_dask_cli_entry_point_lists_blockflow():
    dask_cli = shutil.which("dask", path=os.path.dirname(sys.executable)) or shutil.which("dask")
    out = subprocess.run([dask_cli, "blockflow", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "run" in out.stdout


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_device_metrics_plugin_adds_nothing_on_cpu_workers(embedded):
    def probe(dask_worker):
        return ("blockflow-device-metrics" in worker_plugins(dask_worker),
                worker_metric(dask_worker, OWN_UTILIZATION_METRIC) is not None,
                worker_metric(dask_worker, CAPACITY_METRIC) is not None)

    assert set(embedded.run(probe).values()) == {(True, False, False)}
