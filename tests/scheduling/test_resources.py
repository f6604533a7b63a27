"""Worker resources through blockflow's API: ``map_blocks``/``tree_reduce`` ``resources=``,
``workers=``, ``allow_other_workers=`` survive Dask's graph optimisation (checked by where the
tasks ran, in the task stream and in the kernels' own results), GPU workers declare their
GPU, and a task needing a resource no worker has fails within a bounded time instead of
waiting forever.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from dask.utils import parse_timedelta
from distributed import Worker, get_task_stream, get_worker, wait
from distributed.utils_test import captured_logger, gen_cluster
from loadaware import async_wait_until, scaled, wait_until

import blockflow
from blockflow import ResourceError
from blockflow.scheduling.view import workers_info
from blockflow.scheduling import Rebalancer
from blockflow.testing import SimulatedDevice, SimulatedGPU, install_simulated_devices

CPU_AND_GPU = [("127.0.0.1", 1), ("127.0.0.1", 1), ("127.0.0.1", 1, {"resources": {"GPU": 1}})]


async def _plugin(c, s, **kwargs) -> Rebalancer:
    await c.register_plugin(Rebalancer(**{"policy": "off", "interval": 0, **kwargs}))
    return s.plugins["blockflow-rebalancer"]


def _on_gpu_worker(block):
    """A kernel whose result says where it ran: ones on the worker declaring a GPU."""
    declared = get_worker().state.total_resources
    return np.full_like(block, 1.0 if declared.get("GPU") else 0.0, dtype=float)


# --- resources= survive graph optimisation --------------------------------------------------


@gen_cluster(client=True, nthreads=CPU_AND_GPU)
async def test_map_blocks_resources_survive_fusion(c, s, a, b, g):
    await _plugin(c, s)
    x = da.ones(16, chunks=1)
    y = blockflow.map_blocks(_on_gpu_worker, x, resources={"GPU": 1}, dtype=float)
    # Dask fuses ones -> kernel -> sum's first step into one task per block: the restriction
    # must reach those fused tasks, which an annotation does not (layer annotations are lost)
    assert await c.compute(y.sum()) == 16  # every kernel call ran on the GPU worker
    async with get_task_stream(c) as ts:
        await wait(c.persist(y))
    ran = [e for e in ts.data if "on-gpu-worker" in str(e["key"])]
    assert len(ran) == 16 and {e["worker"] for e in ran} == {g.address}


@gen_cluster(client=True, nthreads=CPU_AND_GPU)
async def test_tree_reduce_resources_place_every_step(c, s, a, b, g):
    await _plugin(c, s)
    x = da.arange(64, chunks=4)
    async with get_task_stream(c) as ts:
        total = await c.compute(blockflow.tree_reduce(x, np.sum, split_every=2,
                                                      resources={"GPU": 1}))
    assert total == 64 * 63 // 2
    assert len(ts.data) >= 16 + 8  # the chunks (fused with arange) and the tree above them
    assert {e["worker"] for e in ts.data} == {g.address}


@gen_cluster(client=True, nthreads=CPU_AND_GPU)
async def test_dataframe_partitions_run_where_the_resources_are(c, s, a, b, g):
    await _plugin(c, s)
    df = dd.from_pandas(pd.DataFrame({"v": np.arange(80.0)}), npartitions=8)

    def where(part):
        return part.assign(gpu=float(bool(get_worker().state.total_resources.get("GPU"))))

    out = blockflow.map_blocks(where, df, resources={"GPU": 1},
                               meta=pd.DataFrame({"v": [0.0], "gpu": [0.0]}).iloc[:0])
    result = await c.compute(out)
    assert len(result) == 80 and (result["gpu"] == 1.0).all()


@gen_cluster(client=True, nthreads=CPU_AND_GPU)
async def test_dataframe_tree_reduce_steps_run_where_the_resources_are(c, s, a, b, g):
    await _plugin(c, s)
    df = dd.from_pandas(pd.DataFrame({"v": np.arange(80.0)}), npartitions=8)
    async with get_task_stream(c) as ts:
        total = await c.compute(blockflow.tree_reduce(df, lambda p: p.sum(), split_every=2,
                                                      resources={"GPU": 1}))
    assert total["v"] == 80 * 79 / 2
    steps = [e for e in ts.data if str(e["key"]).startswith(("('chunk-", "('customreduction"))]
    assert len(steps) >= 8 + 4 and {e["worker"] for e in steps} == {g.address}


@gen_cluster(client=True, nthreads=CPU_AND_GPU)
async def test_xarray_blocks_run_where_the_resources_are(c, s, a, b, g):
    xr = pytest.importorskip("xarray")
    await _plugin(c, s)
    arr = xr.DataArray(np.zeros(16), dims="t").chunk({"t": 2})
    def where(block):
        return block * 0 + float(bool(get_worker().state.total_resources.get("GPU")))

    out = blockflow.map_blocks(where, arr, resources={"GPU": 1}, template=arr)
    assert float((await c.compute(out)).sum()) == 16


@gen_cluster(client=True, nthreads=CPU_AND_GPU)
async def test_workers_restriction_survives_fusion(c, s, a, b, g):
    await _plugin(c, s)

    def where(block):
        return np.full_like(block, float(get_worker().name), dtype=float)

    x = da.ones(12, chunks=1)
    y = blockflow.map_blocks(where, x, workers=[b.address], dtype=float)
    assert (await c.compute(y)).tolist() == [float(b.name)] * 12
    # by worker name too, as distributed resolves workers=
    y = blockflow.map_blocks(where, x + 1, workers=a.name, dtype=float)
    assert (await c.compute(y)).tolist() == [float(a.name)] * 12


@gen_cluster(client=True, nthreads=CPU_AND_GPU)
async def test_allow_other_workers_lets_tasks_leave_a_missing_worker(c, s, a, b, g):
    await _plugin(c, s)
    x = da.ones(6, chunks=1)
    strict = blockflow.map_blocks(lambda v: v + 1, x, workers=["tcp://10.255.255.1:1"])
    loose = blockflow.map_blocks(lambda v: v + 2, x, workers=["tcp://10.255.255.1:1"],
                                 allow_other_workers=True)
    assert (await c.compute(loose)).tolist() == [3.0] * 6
    fut = c.compute(strict)
    await asyncio.sleep(0.5)
    assert not fut.done()  # nobody may run it: it waits (distributed's semantics)
    await c.cancel(fut)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_scheduler_without_the_plugin_cannot_run_a_gpu_kernel_on_a_cpu_worker(c, s, a):
    def needs_gpu(v):
        return v + 1

    y = blockflow.map_blocks(needs_gpu, da.ones(4, chunks=2), resources={"GPU": 1})
    with pytest.raises(ResourceError, match=re.escape(
            "blockflow: kernel 'needs_gpu' asked for resources {'GPU': 1} but the scheduler ran "
            f"it on {a.address}, which declares no resources: that scheduler does not run "
            "blockflow's plugin, which applies resources= to the tasks.")):
        await c.compute(y)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"resources": ["GPU"]}, TypeError,
     "blockflow.map_blocks: resources must be a mapping of resource name to amount, e.g. "
     "resources={'GPU': 1}, got ['GPU']."),
    ({"resources": {"GPU": 0}}, ValueError,
     "blockflow.map_blocks: resources must map resource names to amounts > 0, e.g. "
     "resources={'GPU': 1}, got 'GPU': 0."),
    ({"workers": []}, ValueError,
     "blockflow.map_blocks: workers is empty; name at least one worker, or leave "
     "workers=None to let any worker run the tasks."),
    ({"workers": 5.0}, TypeError,
     "blockflow.map_blocks: workers must be a worker address, name or host name, or a list of "
     "them, e.g. workers=['tcp://10.0.0.5:40000'], got 5.0."),
    ({"allow_other_workers": True}, ValueError,
     "blockflow.map_blocks: allow_other_workers=True only loosens workers=; name the workers "
     "too, or leave allow_other_workers unset."),
    ({"workers": "w", "allow_other_workers": "yes"}, TypeError,
     "blockflow.map_blocks: allow_other_workers must be True or False, got 'yes'."),
])
def test_placement_arguments_are_checked(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        blockflow.map_blocks(lambda b: b, da.ones(4, chunks=2), **kwargs)


def test_tree_reduce_checks_placement_arguments_too():
    with pytest.raises(ValueError, match=re.escape(
            "blockflow.tree_reduce: resources must map resource names to amounts > 0")):
        blockflow.tree_reduce(da.ones(4, chunks=2), np.sum, resources={"GPU": -1})


def test_resources_mean_nothing_without_a_distributed_cluster():
    x = da.ones(4, chunks=2)
    y = blockflow.map_blocks(lambda b: b + 1, x, resources={"GPU": 1})
    assert y.compute(scheduler="sync").tolist() == [2.0] * 4


# --- GPU workers declare their GPU ------------------------------------------------------------


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_simulated_gpu_workers_declare_a_gpu(c, s, a, b):
    await install_simulated_devices(c, {a.address: SimulatedDevice()})
    assert s.workers[a.address].resources == {"GPU": 1}
    assert s.workers[b.address].resources == {}  # no device, no GPU
    await _plugin(c, s)
    y = blockflow.map_blocks(_on_gpu_worker, da.ones(8, chunks=1), resources={"GPU": 1},
                             dtype=float)
    assert await c.compute(y.sum()) == 8


def test_connect_reports_gpu_workers_that_declare_no_gpu():
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0", silence_logs=logging.CRITICAL) as cluster:
        with blockflow.connect(cluster.scheduler_address, policy="off") as setup:
            names = sorted(workers_info(setup))
            setup.register_plugin(SimulatedGPU({names[0]: SimulatedDevice()},
                                               declare_gpu=False))
            setup.run(lambda dask_worker: asyncio.ensure_future(dask_worker.heartbeat()))
            wait_until(lambda: workers_info(setup)[names[0]]["metrics"].get(
                "gpu-memory-total"), timeout=30, message="the simulated GPU's memory metric")
        with pytest.warns(blockflow.BlockflowWarning, match=re.escape(
                f"blockflow.connect: 1 GPU worker of the cluster at {cluster.scheduler_address} "
                f"declares no GPU resource ({names[0]}), so tasks asking for "
                f"resources={{'GPU': 1}} never run there; start GPU workers with "
                f"`--resources GPU=1`")):
            client = blockflow.connect(cluster.scheduler_address)
        with client:
            inv = blockflow.inventory(client)
            assert inv.undeclared_gpu_workers == [names[0]]
            assert [w.resources for w in inv] == [{}, {}]


@pytest.mark.gpu
def test_gpu_workers_blockflow_starts_declare_one_gpu_each():
    from blockflow.backends import gpu_device_count, has_package

    if gpu_device_count() == 0 or not has_package("dask_cuda"):
        pytest.skip("needs an NVIDIA GPU and dask-cuda (pip install 'blockflow[gpu]')")
    with blockflow.connect(gpu=True, dashboard_address=":0") as client:
        workers = workers_info(client)
        assert len(workers) == gpu_device_count()
        assert all(w["resources"] == {"GPU": 1} for w in workers.values()), workers
        y = blockflow.map_blocks(lambda b: b + 1, da.ones(8, chunks=1), resources={"GPU": 1})
        assert y.sum().compute() == 16


# --- a resource nobody has ----------------------------------------------------------------------


def test_the_default_wait_for_a_missing_resource_is_bounded():
    assert 0 < parse_timedelta(dask.config.get("blockflow.resources.unsatisfiable-timeout")) <= 30


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2,
             config={"blockflow.resources.unsatisfiable-timeout": "1s"})
async def test_a_task_needing_a_resource_nobody_has_fails_in_bounded_time(c, s, a, b):
    await _plugin(c, s, interval="50ms")
    y = blockflow.map_blocks(lambda v: v + 1, da.ones(4, chunks=2), resources={"GPU": 1},
                             name="wants-gpu")
    start = time.monotonic()
    with captured_logger("blockflow.scheduling.resources", level=logging.WARNING) as log:
        with pytest.raises(ResourceError) as info:
            await c.compute(y)
    took = time.monotonic() - start
    # the setting (1 s), not forever; the bound stretches with the machine's load
    assert 1 <= took < scaled(20)
    message = str(info.value)
    assert message.startswith("blockflow: task ('blockflow-wants-gpu-")
    assert "needs resources {'GPU': 1}, which no worker of the cluster declares" in message
    assert "the workers declare: none (2 workers)" in message
    assert "--resources GPU=1" in message
    warned = log.getvalue()
    assert "need resources {'GPU': 1}, which no worker declares (workers declare: none " \
           "(2 workers)); they fail in 1 s unless such a worker joins" in warned
    assert warned.count("which no worker declares") == 1  # once, when they start waiting


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1, {"resources": {"FPGA": 2}})],
             config={"blockflow.resources.unsatisfiable-timeout": "1s"})
async def test_the_error_lists_the_resources_workers_do_have(c, s, a):
    await _plugin(c, s, interval="50ms")
    fut = c.submit(lambda: 1, resources={"GPU": 1}, key="plain-submit")
    with pytest.raises(ResourceError, match=re.escape(
            f"the workers declare: {{'FPGA': 2}} ({a.address})")):
        await fut


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)],
             config={"blockflow.resources.unsatisfiable-timeout": "20s"})
async def test_a_worker_with_the_resource_joining_in_time_runs_the_task(c, s, a):
    plugin = await _plugin(c, s, interval="50ms")
    y = blockflow.map_blocks(_on_gpu_worker, da.ones(4, chunks=1), resources={"GPU": 1},
                             dtype=float)
    fut = c.compute(y.sum())
    await async_wait_until(lambda: plugin.unsatisfiable.since, interval=0.05,
                           message="the plugin to see the GPU tasks waiting")
    async with Worker(s.address, nthreads=1, resources={"GPU": 1}):
        assert await fut == 4
    assert plugin.unsatisfiable.failed == 0


def test_connect_names_a_worker_that_declares_a_gpu_it_does_not_have():
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0", resources={"GPU": 1},
                      silence_logs=logging.CRITICAL) as cluster:
        [a] = cluster.scheduler.workers
        with pytest.warns(blockflow.BlockflowWarning) as caught:
            client = blockflow.connect(cluster.scheduler_address, policy="off")
        with client:
            assert [str(w.message) for w in caught] == [
                f"blockflow.connect: worker {a} of the cluster at {cluster.scheduler_address} "
                f"declares GPU=1 (resources) but reports no GPU (no device memory in its "
                f"metrics), so tasks asking for resources={{'GPU': 1}} are sent to a worker "
                f"without one; start it without `--resources GPU=...`, or on a machine whose "
                f"GPU it can see (CUDA_VISIBLE_DEVICES, the NVIDIA driver, "
                f"distributed.diagnostics.nvml: true)."]
            assert blockflow.inventory(client).gpu_resource_without_gpu == [a]
