"""Device time against wall time: the union of busy intervals, the runs' device-time records
from heartbeat samples, simulated GPU workers end to end (decision log, plugin status and the
dashboard's JSON route), and the GPU workers' threads and memory pool settings.

The stream path itself needs CuPy and a GPU: tests/test_gpu_streams.py.
"""

from __future__ import annotations

import json
import logging
import math
import urllib.request

import dask
import dask.array as da
import numpy as np
import pytest
from loadaware import wait_until

import blockflow
from blockflow import _distributed
from blockflow.cluster.connection import _register_plugin
from blockflow.device_pool import CuPyPool, GPUPoolError, enlarge_cupy_pool, gpu_cluster_kwargs
from blockflow.device_streams import BusyIntervals, DeviceClock, holds_device_arrays
from blockflow.scheduling import Rebalancer
from blockflow.scheduling.actions import Recorded
from blockflow.scheduling.device_time import DeviceTime
from blockflow.scheduling.runs import Run, RunTracker
from blockflow.scheduling.wait import add_worker_plugin
from blockflow.testing import device_stats, simulated_cluster, simulated_kernel


# --- the union of busy intervals ---------------------------------------------------------


def test_overlapping_and_out_of_order_intervals_are_counted_once():
    busy = BusyIntervals()
    for start, end in [(5, 7), (0, 2), (1, 3), (6, 9), (2.5, 2.75), (10, 11), (3, 4)]:
        busy.add(start, end)
    # [0, 4] (touching at 3), [5, 9], [10, 11]
    assert busy.total() == pytest.approx(4 + 4 + 1)
    busy.add(-1, 12)  # covers everything: the span itself
    assert busy.total() == pytest.approx(13)


def test_empty_reversed_and_nested_intervals_add_nothing():
    busy = BusyIntervals()
    busy.add(1, 1)
    busy.add(3, 2)
    assert busy.total() == 0.0
    busy.add(0, 10)
    busy.add(2, 3)
    busy.add(9.5, 10)
    assert busy.total() == pytest.approx(10)
    with pytest.raises(ValueError, match="finite"):
        busy.add(0, math.inf)


def test_folded_intervals_are_never_counted_twice():
    busy = BusyIntervals(keep=2)
    for start in range(0, 50, 10):  # [0, 1], [10, 11], ... : three get folded
        busy.add(start, start + 1)
    assert busy.total() == pytest.approx(5)
    busy.add(0, 25)  # late: only from the end of what was folded (21) on
    assert busy.total() <= 25 + 1e-9  # never more than the union
    assert busy.total() == pytest.approx(5 + 4)  # [21, 25] beside the folded [20, 21]


class _Event:  # a completed CUDA event: when the device reached it, milliseconds
    def __init__(self, ms: float):
        self.ms = ms


class _CuPy:  # the one CuPy call DeviceClock makes, as CUDA answers it: float32 milliseconds
    class cuda:
        @staticmethod
        def get_elapsed_time(start, end):
            return float(np.float32(end.ms - start.ms))


def test_device_spans_hours_after_the_first_keep_their_microseconds():
    # cudaEventElapsedTime is a float32 of ms: 10 h after one fixed reference it steps by
    # 4 ms, so 0.1 ms tasks would count as 0 or 4 ms each
    clock = DeviceClock(_CuPy, _Event(0.0))
    hours = 10 * 3600e3
    for k in range(100):  # 100 tasks of 0.1 ms, 1 ms apart, from 10 h on
        t = hours + k * 1.0 + 0.001 * k
        assert clock.add(_Event(t), _Event(t + 0.1)) == pytest.approx(1e-4, abs=1e-6)
    assert clock.busy.total() == pytest.approx(100 * 1e-4, rel=0.01)
    # overlapping spans of two threads, minutes later, still counted once
    t = hours + 600e3
    clock.add(_Event(t), _Event(t + 2.0))
    clock.add(_Event(t + 1.0), _Event(t + 3.0))
    assert clock.busy.total() == pytest.approx(100 * 1e-4 + 3e-3, rel=0.01)


def test_a_span_that_began_before_the_reference_moved_up_is_still_counted():
    class Strict(_CuPy):  # a CUDA that would refuse a negative time
        class cuda:
            @staticmethod
            def get_elapsed_time(start, end):
                if end.ms < start.ms:
                    raise RuntimeError("cudaErrorInvalidValue")
                return float(np.float32(end.ms - start.ms))

    clock = DeviceClock(Strict, _Event(0.0))
    early = _Event(59e3)  # another thread's span starts ...
    clock.add(_Event(60e3), _Event(60e3 + 1))  # ... the reference moves up to this one
    assert clock.add(early, _Event(60e3 + 2)) == pytest.approx(1.002)  # and it ends: counted
    assert 1.0 < clock.busy.total() <= 1.002 + 1e-9


def test_the_kernel_wrapper_looks_for_device_arrays_in_args_and_lists():
    class Device:  # stands for cupy.ndarray: the test is a type check
        pass

    d = Device()
    assert holds_device_arrays(Device, (np.ones(2), d), {})
    assert holds_device_arrays(Device, ([np.ones(2), d],), {})
    assert holds_device_arrays(Device, (), {"x": (d,)})
    assert not holds_device_arrays(Device, (np.ones(2), [1, 2]), {"y": 3})


# --- the runs' device-time records from heartbeat samples ---------------------------------


def _tracker(run: Run) -> RunTracker:
    runs = RunTracker()
    runs.runs[run.id] = run
    return runs


def _ended_run() -> Run:
    run = Run(id="r-1", name="job", client=None, started=100.0, graphs=1)
    run.spans = {"gpu-a": [101.0, 105.0], "cpu-b": [101.0, 104.0]}
    run.busy.update({"gpu-a": 7.0, "cpu-b": 3.0})  # two threads: compute over wall
    run.ended = 105.0
    return run


def test_a_run_gets_one_record_per_gpu_worker_once_a_heartbeat_after_its_end_came():
    dt = DeviceTime()
    run = _ended_run()
    runs = _tracker(run)
    dt.sample({"gpu-a": (99.0, 99.1, 10.0)})  # before the run
    dt.sample({"gpu-a": (103.0, 103.1, 11.5)})  # during it
    assert list(dt.records(runs, now=105.2)) == []  # waits for a heartbeat after the end
    dt.sample({"gpu-a": (105.5, 105.6, 12.5)})
    dt.sample({"gpu-a": (105.5, 105.6, 12.5)})  # the same heartbeat seen twice: once
    assert len(dt.samples["gpu-a"]) == 3
    (record,) = dt.records(runs, now=105.7)
    assert record.action is Recorded.DEVICE_TIME and record.worker == "gpu-a"
    assert record.seen == {"run": "r-1", "device_seconds": 2.5, "wall_seconds": 4.0,
                           "compute_seconds": 7.0, "device_busy": 0.625}
    assert "62%" in record.reason and "'job'" in record.reason
    assert list(dt.records(runs, now=106.0)) == []  # once
    # more work given to the run: recorded again when it ends again
    run.graphs, run.spans["gpu-a"][1], run.ended = 2, 108.0, 108.0
    dt.sample({"gpu-a": (108.5, 108.6, 13.0)})
    (again,) = dt.records(runs, now=109.0)
    assert again.seen["device_seconds"] == 3.0 and again.seen["wall_seconds"] == 7.0


def test_device_seconds_never_exceed_the_wall_time_and_late_heartbeats_are_left_out():
    dt = DeviceTime(patience=5.0)
    run = _ended_run()
    runs = _tracker(run)
    dt.sample({"gpu-a": (90.0, 90.1, 0.0), "gpu-c": (90.0, 90.1, 0.0)})
    run.spans["gpu-c"] = [101.0, 102.0]
    dt.sample({"gpu-a": (106.0, 106.1, 9.0)})  # other work in the gap: bounded by the wall
    assert list(dt.records(runs, now=106.2)) == []  # gpu-c's heartbeat is still to come
    (record,) = dt.records(runs, now=111.0)  # patience out: gpu-c left out
    assert record.worker == "gpu-a"
    assert record.seen["device_seconds"] == record.seen["wall_seconds"] == 4.0
    assert record.seen["device_busy"] == 1.0


def test_figures_of_a_run_going_on_and_since_the_first_heartbeat():
    dt = DeviceTime()
    run = Run(id="r-2", name="job", client=None, started=0.0, graphs=1, pending=3)
    run.spans = {"gpu-a": [1.0, 2.0]}
    dt.sample({"gpu-a": (0.5, 0.6, 0.0)})
    dt.sample({"gpu-a": (3.0, 3.1, 1.0)})
    assert dt.run_figures(run) == {"gpu-a": {
        "device_seconds": 1.0, "wall_seconds": 2.0, "compute_seconds": 0.0,
        "device_busy": 0.5}}
    assert dt.cumulative() == {"gpu-a": {"device_seconds": 1.0, "wall_seconds": 2.5,
                                         "device_busy": 0.4}}
    small = DeviceTime(keep=2)  # the first sample outlives the ones kept for runs
    for t, v in [(0.0, 0.0), (1.0, 0.5), (2.0, 1.0), (4.0, 1.0)]:
        small.sample({"gpu-a": (t, t + 0.1, v)})
    assert small.cumulative()["gpu-a"] == {"device_seconds": 1.0, "wall_seconds": 4.0,
                                           "device_busy": 0.25}
    assert list(dt.records(_tracker(run), now=10.0)) == []  # not ended: no record
    dt.forget("gpu-a")
    assert dt.run_figures(run) == {} and dt.cumulative() == {}


# --- simulated GPU workers end to end ------------------------------------------------------


def _kernel(block):
    return np.array([simulated_kernel(block, op=np.sum, work=0.04)], dtype=object)


def _device_records(client, n: int):
    df = blockflow.decisions(client)
    if df.empty:
        return None
    rows = df[df["action"] == "device-time"].to_dict("records")
    return rows if len(rows) >= n else None


def test_a_run_on_simulated_gpus_records_device_time_and_the_dashboard_shows_it():
    with simulated_cluster(speeds=[1, 1], threads_per_worker=2, processes=False,
                           silence_logs=logging.CRITICAL,
                           dashboard_address="127.0.0.1:0") as client:
        _register_plugin(client, Rebalancer(policy="dynamic"))
        x = da.ones((16, 50), chunks=(1, 50))
        y = blockflow.map_blocks(_kernel, x, dtype=object, chunks=((1,) * 16,), drop_axis=1,
                                 name="devtime")
        assert [b.payload for b in y.compute()] == [50.0] * 16
        stats = client.run(device_stats)
        ran = {a for a, s in stats.items() if s["kernels"] > 0}
        assert ran
        rows = wait_until(lambda: _device_records(client, len(ran)),
                          message="a device-time record per worker that ran kernels")
        assert {r["worker"] for r in rows} == ran
        for r in rows:
            assert 0 < r["seen_device_seconds"] <= r["seen_wall_seconds"]
            # the simulated device's own busy seconds: the cluster ran nothing else
            assert r["seen_device_seconds"] == pytest.approx(
                stats[r["worker"]]["busy_seconds"], abs=1e-3)
            assert r["seen_device_busy"] == pytest.approx(
                r["seen_device_seconds"] / r["seen_wall_seconds"], abs=1e-3)
            assert r["seen_compute_seconds"] > 0

        status = blockflow.plugin_status(client)["device_time"]
        assert set(status["workers"]) == ran and set(status["cumulative"]) >= ran
        port = client.cluster.scheduler.http_server.port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/blockflow/status.json",
                                    timeout=20) as reply:
            state = json.loads(reply.read().decode())
        for w in state["workers"]:
            if w["address"] in ran:
                assert 0 < w["device_busy"] <= 1 and 0 < w["device_busy_total"] <= 1
                assert w["device_seconds"] > 0
        from blockflow.dashboard.page import BlockflowPage

        page = BlockflowPage(client.cluster.scheduler)
        client.sync(_update, page)
        shown = dict(zip(page.workers.data["address"], page.workers.data["device_busy"]))
        assert all(shown[a].count("%") == 2 for a in ran), shown  # "42% / 37%"


async def _update(page):
    page.update()


# --- threads and memory pool of GPU workers -----------------------------------------------

ACCEPTS = {"threads_per_worker", "rmm_pool_size", "rmm_allocator_external_lib_list"}


def test_gpu_workers_get_two_threads_and_an_rmm_pool_when_rmm_is_there():
    kwargs, plugin = gpu_cluster_kwargs({"n_workers": None, "memory_limit": "4GiB"},
                                        has_rmm=True, accepts=ACCEPTS,
                                        device_memory=80 * 2**30 + 100)
    assert plugin is None
    assert kwargs == {"memory_limit": "4GiB", "threads_per_worker": 2,
                      "rmm_pool_size": 40 * 2**30,  # half, a multiple of 256 bytes
                      "rmm_allocator_external_lib_list": ["cupy"]}
    # memory unknown: the fraction, which dask-cuda reads as one
    kwargs, _ = gpu_cluster_kwargs({}, has_rmm=True, accepts=ACCEPTS, device_memory=0)
    assert kwargs["rmm_pool_size"] == 0.5
    # an older dask-cuda that cannot point CuPy at its RMM pool: CuPy's own pool instead
    # (an RMM pool CuPy does not use would only hold memory); "rmm" asked: RMM's pool
    kwargs, plugin = gpu_cluster_kwargs({}, has_rmm=True, accepts={"rmm_pool_size"})
    assert "rmm_pool_size" not in kwargs and isinstance(plugin, CuPyPool)
    kwargs, plugin = gpu_cluster_kwargs({}, pool="rmm", has_rmm=True,
                                        accepts={"rmm_pool_size"}, device_memory=2**30)
    assert kwargs["rmm_pool_size"] == 2**29 and plugin is None


def test_the_callers_threads_and_rmm_arguments_win():
    kwargs, plugin = gpu_cluster_kwargs({"threads_per_worker": 4, "rmm_pool_size": "8GB"},
                                        has_rmm=True, accepts=ACCEPTS)
    assert kwargs == {"threads_per_worker": 4, "rmm_pool_size": "8GB"} and plugin is None


def test_without_rmm_the_cupy_pool_plugin_and_the_settings_apply():
    with dask.config.set({"blockflow.cluster.gpu-threads-per-worker": 3,
                          "blockflow.cluster.gpu-pool-fraction": 0.25}):
        kwargs, plugin = gpu_cluster_kwargs({}, has_rmm=False, accepts=ACCEPTS)
    assert kwargs == {"threads_per_worker": 3}
    assert isinstance(plugin, CuPyPool) and plugin.fraction == 0.25
    _, plugin = gpu_cluster_kwargs({}, pool="cupy", has_rmm=True, accepts=ACCEPTS)
    assert isinstance(plugin, CuPyPool)
    kwargs, plugin = gpu_cluster_kwargs({}, pool=False, has_rmm=True, accepts=ACCEPTS)
    assert kwargs == {"threads_per_worker": 2} and plugin is None


def test_pool_setting_errors_are_one_line_naming_the_setting():
    with pytest.raises(GPUPoolError) as info:
        gpu_cluster_kwargs({}, pool="rmm", has_rmm=False, accepts=ACCEPTS)
    text = str(info.value)
    assert "\n" not in text and "gpu-memory-pool" in text and "pip install" in text
    with pytest.raises(GPUPoolError) as info:  # other processes hold most of the device
        gpu_cluster_kwargs({}, has_rmm=True, accepts=ACCEPTS, device_memory=2**34,
                           device_free=2**32)
    text = str(info.value)
    assert "\n" not in text and "gpu-pool-fraction" in text and "8.00 GiB" in text
    for bad in ({"pool": "big"}, {"fraction": 1.5}, {"fraction": 0}):
        with pytest.raises(ValueError) as info:
            gpu_cluster_kwargs({}, has_rmm=False, accepts=ACCEPTS, **bad)
        assert "\n" not in str(info.value) and "blockflow.cluster.gpu-" in str(info.value)
    with dask.config.set({"blockflow.cluster.gpu-threads-per-worker": 0}):
        with pytest.raises(ValueError, match="gpu-threads-per-worker"):
            gpu_cluster_kwargs({}, has_rmm=False, accepts=ACCEPTS)


class _NoRoom(CuPyPool):  # a device with less free memory than the pool asks
    def setup(self, worker):
        raise GPUPoolError("blockflow: the GPU memory pool of worker 'w' asks for 8 GiB "
                           "(blockflow.cluster.gpu-pool-fraction 0.5 of the device's 16 GiB) "
                           "but only 1 GiB are free; lower gpu-pool-fraction or set "
                           "blockflow.cluster.gpu-memory-pool to false.")


def test_a_pool_that_cannot_be_set_up_is_one_line_and_closes_the_cluster():
    from distributed import Client, LocalCluster

    from blockflow.cluster.connection import _set_up_pool

    cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                           dashboard_address=":0")
    client = Client(cluster)
    try:
        with pytest.raises(GPUPoolError) as info:
            _set_up_pool(client, _NoRoom(0.5))
        assert str(info.value).startswith("blockflow: the GPU memory pool of worker 'w'")
        assert client.status == "closed" and cluster.status.name == "closed"
    finally:
        client.close()
        cluster.close()


def test_a_workers_plugin_error_from_another_process_is_opened():
    # across processes the scheduler hands the worker's pickled error on as ``Serialized``
    from distributed.protocol import pickle, serialize
    from distributed.protocol.serialize import Serialized

    from blockflow._distributed.client import _raise_setup_error

    error = GPUPoolError("blockflow: no room for the pool.")
    reply = {"status": "error", "exception": Serialized(*serialize(pickle.dumps(error))),
             "traceback": Serialized(*serialize(pickle.dumps(None)))}
    with pytest.raises(GPUPoolError, match="^blockflow: no room for the pool.$"):
        _raise_setup_error({"tcp://w": reply})


def _pool_added(dask_worker):
    plugin = _distributed.worker_plugins(dask_worker).get(CuPyPool.name)
    return "missing" if plugin is None else plugin.added


def test_the_pool_plugin_does_nothing_and_says_nothing_without_cupy_or_a_gpu(caplog):
    from blockflow.backends import gpu_device_count, has_package

    if has_package("cupy") and gpu_device_count() > 0:
        pytest.skip("this machine has CuPy and a GPU: tests/test_gpu_streams.py sets a pool up")
    assert enlarge_cupy_pool(0.5) is None
    client = blockflow.connect(gpu=False, n_workers=1, threads_per_worker=1, processes=False,
                               dashboard_address="127.0.0.1:0")
    try:
        with caplog.at_level(logging.INFO, logger="blockflow"):
            add_worker_plugin(client, CuPyPool(0.5))
            assert list(client.run(_pool_added).values()) == [None]
        assert not [r for r in caplog.records if r.name.startswith("blockflow")
                    and "pool" in r.getMessage().lower()]
    finally:
        client.shutdown()
        client.close()


# --- device seconds on Dask's Fine Performance Metrics page -------------------------------


def _device_task(x, seconds):
    _distributed.digest_task_seconds("device", seconds)
    return x + 1


def _execute_metrics(prefix: str, dask_scheduler=None) -> dict:
    return {k[2]: v for k, v in dask_scheduler.cumulative_worker_metrics.items()
            if isinstance(k, tuple) and len(k) == 4 and k[:2] == ("execute", prefix)
            and k[3] == "seconds"}


def test_a_tasks_device_seconds_are_a_fine_performance_metric_within_its_thread_time():
    client = blockflow.connect(gpu=False, n_workers=1, threads_per_worker=1, processes=False,
                               dashboard_address="127.0.0.1:0", policy="off")
    try:
        # more device seconds than the task's wall time (a task that returns at once): the
        # thread's CPU and non-CPU time are what is left of its wall time, nothing
        assert client.submit(_device_task, 1, 60.0, key="devtask-0").result() == 2
        metrics = wait_until(
            lambda: (m := client.run_on_scheduler(_execute_metrics, "devtask"))
            and "device" in m and m,
            message="the task's fine performance metrics at the scheduler")
        assert metrics["device"] == pytest.approx(60.0)
        assert metrics["thread-cpu"] == 0 and metrics["thread-noncpu"] == 0
    finally:
        client.shutdown()
        client.close()
