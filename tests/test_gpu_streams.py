"""GPU tests of tasks overlapped on a GPU: each worker thread's own CUDA stream, device
seconds and CuPy's memory pool set up front (blockflow/device_streams.py, device_pool.py).

Skipped, with the reason, without CuPy or a visible GPU. Run on a GPU machine with
``pytest -m gpu tests/test_gpu_streams.py``.
"""

from __future__ import annotations

import threading

import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster
from loadaware import wait_until

import blockflow
from blockflow import device_streams
from blockflow._distributed.metrics import DEVICE_SECONDS_METRIC
from blockflow.backends import gpu_device_count
from blockflow.cluster.connection import _register_plugin
from blockflow.scheduling import Rebalancer
from blockflow.scheduling.view import workers_info

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip(
    "cupy", reason="GPU stream tests need CuPy (pip install 'blockflow[gpu]') and an NVIDIA GPU"
)
if gpu_device_count() == 0:
    pytest.skip("GPU stream tests need an NVIDIA GPU: NVML and the CUDA runtime report 0 "
                "devices", allow_module_level=True)

#: Spins one GPU thread for ``cycles`` clock cycles (about a second at 2e9).
SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def _scale(block):
    return block * 2 + 1


def test_a_device_task_runs_on_its_threads_stream_and_waits_for_that_stream_only():
    spin = cupy.RawKernel(SPIN, "spin")
    x = cupy.arange(1000, dtype=cupy.float32)
    (x * 2).get()  # kernels compiled before the clock starts
    spin((1,), (1,), (np.int64(1000),))
    cupy.cuda.Stream.null.synchronize()
    other = cupy.cuda.Stream(non_blocking=True)
    with other:  # another thread's long task (seconds), still running on the device
        spin((1,), (1,), (np.int64(6_000_000_000),))
    seen = {}

    def task(block):
        seen["stream"] = cupy.cuda.get_current_stream().ptr
        return block * 2

    before = device_streams.device_seconds()
    y = device_streams.call_on_stream(cupy, task, (x,), {})
    # done while the other stream still spins: no device synchronisation
    assert not other.done
    stream, _ = device_streams.thread_stream(cupy)
    assert seen["stream"] == stream.ptr != cupy.cuda.Stream.null.ptr
    assert stream.done  # its own stream was synchronised: the result is complete
    np.testing.assert_array_equal(cupy.asnumpy(y), np.arange(1000, dtype=np.float32) * 2)
    assert device_streams.device_seconds() > before
    other.synchronize()


def test_each_thread_gets_its_own_stream():
    ptrs = []

    def run():
        stream, _ = device_streams.thread_stream(cupy)
        ptrs.append(stream.ptr)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ptrs)) == 2


def _device_time_records(client):
    df = blockflow.decisions(client)
    rows = [] if df.empty else df[df["action"] == "device-time"].to_dict("records")
    return rows or None


def test_blocks_on_two_threads_per_gpu_equal_numpy_and_report_device_seconds():
    x_np = np.random.default_rng(0).normal(size=(2000, 400))
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        _register_plugin(client, Rebalancer(policy="dynamic"))
        x = blockflow.to_device(da.from_array(x_np, chunks=(250, 400)))
        y = blockflow.map_blocks(_scale, x)
        got = y.compute()
        assert isinstance(got, cupy.ndarray)
        np.testing.assert_allclose(cupy.asnumpy(got), x_np * 2 + 1)
        seconds = client.run(device_streams.device_seconds)
        assert all(s > 0 for s in seconds.values()), seconds
        # the worker reports them at its heartbeats; the run's record follows
        wait_until(lambda: all((w.get("metrics") or {}).get(DEVICE_SECONDS_METRIC)
                               for w in workers_info(client).values()),
                   message="blockflow-device-seconds in every worker's heartbeat")
        records = wait_until(lambda: _device_time_records(client),
                             message="the run's device-time record")
        assert all(0 < r["seen_device_seconds"] <= r["seen_wall_seconds"] for r in records)


def test_the_pool_plugin_grows_cupys_pool_up_front():
    from blockflow.device_pool import enlarge_cupy_pool

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    base = pool.total_bytes()
    free, total = cupy.cuda.runtime.memGetInfo()
    fraction = min(0.1, 0.5 * free / total)
    added = enlarge_cupy_pool(fraction, threads=1)
    assert added is not None and added > 0
    share = added // 2  # the default stream's and the one worker thread's
    # the default stream's share is in the pool now; the thread's stream takes its own
    assert pool.total_bytes() - base >= share
    _fresh_thread_stream()
    assert pool.total_bytes() - base >= 2 * share
    _fresh_thread_stream()  # a thread beyond the worker's (one replacing another): nothing
    assert pool.total_bytes() - base < 3 * share
    device_streams.reserve_per_stream(0, 0)
    pool.free_all_blocks()


def _fresh_thread_stream():
    out = []
    t = threading.Thread(target=lambda: out.append(device_streams.thread_stream(cupy)))
    t.start()
    t.join()
    return out[0]
