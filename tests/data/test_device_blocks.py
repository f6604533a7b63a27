"""GPU block sizes on real clusters of simulated GPUs: the target from device memory,
bandwidth and the measured per-task overhead, blocks grown to it, the advisory line, the
fan-in, NVML's bandwidth."""

from __future__ import annotations

import ast
import contextlib
import math
import re
import threading
import time
import warnings

import dask
import dask.array as da
import numpy as np
import pytest
from dask.utils import format_bytes
from distributed import Client, LocalCluster
from loadaware import scaled, wait_until

import blockflow
from blockflow import device_blocks, devices
from blockflow.device_blocks import device_block_target, worker_target
from blockflow.fan_in import _resolve_split_every
from blockflow.scheduling import view
from blockflow.scheduling.view import PROBE_PREFIX, plugin_status, task_overheads
from blockflow.testing import SimulatedDevice, install_simulated_devices

GiB, MiB = 2**30, 2**20


@contextlib.contextmanager
def gpus(*devices_, threads: int = 1, plugin: bool = False):
    """An in-process cluster with one worker per simulated device; a client as default."""
    with LocalCluster(n_workers=len(devices_), threads_per_worker=threads, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        if plugin:
            client.register_plugin(blockflow.scheduling.Rebalancer(policy="off"))
        addrs = sorted(client.scheduler_info(n_workers=-1)["workers"])
        client.sync(install_simulated_devices, client, dict(zip(addrs, devices_)))
        yield client


def _probe_keys(client) -> list:
    return client.run_on_scheduler(
        lambda dask_scheduler: [str(k) for k in dask_scheduler.tasks
                                if PROBE_PREFIX in str(k)])


def _bytes(x) -> int:
    return x.dtype.itemsize * math.prod(max(c) for c in x.chunks)


# -- the target ----------------------------------------------------------------------------

def test_a_fast_device_gets_the_overhead_rule_and_its_share():
    # device fractions wide open: the overhead rule alone decides
    with dask.config.set({"blockflow.blocks.device-min-fraction": 1e-9}), \
            gpus(SimulatedDevice(device_memory="1TiB", bandwidth="2GB")) as c:
        t = device_block_target(c)
        s = 0.05
        assert t.bandwidth == 2e9 and t.threads == 1 and t.device_memory == 2**40
        assert 0 < t.overhead < math.inf
        assert t.nbytes == pytest.approx(t.overhead * 2e9 * (1 - s) / (s * 2), rel=1e-6)
        assert t.share == pytest.approx(s, rel=1e-6)
        # reading the block once (a reduction): twice the bytes for the same share
        assert device_block_target(c, passes=1).nbytes == pytest.approx(2 * t.nbytes,
                                                                         rel=1e-6)


def test_small_devices_clamp_to_memory_and_the_smallest_worker_decides():
    small, large = SimulatedDevice(device_memory="64MiB"), SimulatedDevice(device_memory="1GiB")
    with gpus(small, large, threads=2) as c:
        addrs = sorted(c.scheduler_info(n_workers=-1)["workers"])
        t = device_block_target(c)  # 1 TB/s: the rule asks for far more than 1/8 of memory
        assert t.worker == addrs[0] and t.nbytes == 8 * MiB and t.threads == 2
        assert 0 < t.share < 1
        # a working set of 7 blocks: 2 threads x 8 blocks within 80 % of 64 MiB
        t = device_block_target(c, working_set=lambda n: 7 * n)
        assert 2 * 8 * t.nbytes <= 0.8 * 64 * MiB < 2 * 8 * (t.nbytes + 1)
        # a constant working set: 25.6 MiB per thread less 20 MiB
        t = device_block_target(c, working_set="20MiB")
        assert t.nbytes == pytest.approx(0.4 * 64 * MiB - 20 * MiB, abs=1)


def test_the_rule_is_clamped_to_the_device_fractions():
    assert worker_target(1e-9, 1e9, GiB, GiB, 1) == GiB // 32  # too little overhead
    assert worker_target(1.0, 1e12, GiB, GiB, 1) == GiB // 8  # too much
    assert worker_target(1e-2, 1e9, GiB, GiB, 1) == int(1e-2 * 1e9 * 0.95 / 0.1)  # between
    assert worker_target(1.0, 1e12, GiB, 100 * MiB, 4) == int(0.8 * 100 * MiB / 4 / 2)


def test_no_target_and_no_probe_without_gpu_workers(client):
    assert device_block_target(client) is None
    assert not device_blocks.has_gpu_workers(client)
    assert not [k for k in view._overheads if k[0] == client.scheduler.address]


# -- the probe -----------------------------------------------------------------------------

def test_the_probe_measures_a_cached_overhead_and_leaves_nothing_behind():
    with gpus(SimulatedDevice(), plugin=True) as c:
        (w,) = c.scheduler_info(n_workers=-1)["workers"]
        c.compute(da.ones(4, chunks=2).sum(), sync=True)
        before = plugin_status(c, for_client=c.id)
        got = task_overheads(c, [w])
        assert 0 < got[w] < math.inf
        when = view._overheads[(c.scheduler.address, w)][1]
        assert task_overheads(c, [w]) == got  # cached: not measured again
        assert view._overheads[(c.scheduler.address, w)][1] == when
        wait_until(lambda: not _probe_keys(c), message="the probe's keys to be released")
        after = plugin_status(c, for_client=c.id)
        # the user's client's latest run and the kernel counts are untouched
        assert after["client_run"]["id"] == before["client_run"]["id"]
        assert after["kernel_counts"] == before["kernel_counts"]


def test_the_probe_is_not_counted_in_the_users_runs_counts_or_decisions():
    # the probe's tasks are blockflow's, not the user's: no run, no task count, no record
    with gpus(SimulatedDevice(), plugin=True) as c:
        (w,) = c.scheduler_info(n_workers=-1)["workers"]
        c.compute(da.ones(4, chunks=2).sum(), sync=True)
        wait_until(lambda: plugin_status(c)["run"]["ended"] is not None,
                   message="the user's run to end")
        before = plugin_status(c)
        report = blockflow.run_report(c)
        assert 0 < task_overheads(c, [w])[w] < math.inf
        wait_until(lambda: not _probe_keys(c), message="the probe's keys to be released")
        after = plugin_status(c)
        assert after["run"]["id"] == before["run"]["id"]  # the user's run is still current
        assert after["task_counts"] == before["task_counts"]
        assert blockflow.task_counts(c) == before["task_counts"]
        assert blockflow.run_report(c).tasks_per_worker == report.tasks_per_worker
        assert not [d for d in after["decisions"] if view.PROBE_RUN in str(d)]


def test_a_worker_that_cannot_answer_is_left_out_within_the_bound():
    with gpus(SimulatedDevice()) as c:
        gone = "tcp://127.0.0.1:9"  # no such worker: its tasks could never run
        start = time.monotonic()
        assert task_overheads(c, [gone], timeout=scaled(2, at_most=20)) == {}
        assert time.monotonic() - start < scaled(2, at_most=20) + scaled(5)
        wait_until(lambda: not _probe_keys(c), message="the probe's keys to be released")
        # not asked again for a while: the next stage does not wait on it again
        missed = view._overheads[(c.scheduler.address, gone)]
        assert missed[0] is None
        assert task_overheads(c, [gone], timeout=scaled(2, at_most=20)) == {}
        assert view._overheads[(c.scheduler.address, gone)] == missed


def test_a_busy_gpu_worker_holds_up_one_stage_at_most():
    # its threads busy with the user's task, the probe cannot run there: the first stage
    # falls back on the default overhead, the next ones do not probe it again
    with dask.config.set({"blockflow.cluster.worker-call-timeout": scaled(1, at_most=5)}), \
            gpus(SimulatedDevice(device_memory="1GiB")) as c:
        (w,) = c.scheduler_info(n_workers=-1)["workers"]
        _release.clear()
        busy = c.submit(_wait_for, pure=False)  # in-process: it waits on _release
        wait_until(lambda: c.processing()[w], message="the user's task to start")
        lines = []
        for v in (11.0, 12.0):  # collections of their own (advised once per process)
            x = da.full((2**15, 1024), v, chunks=(256, 1024))
            lines += _advice(lambda: blockflow.map_blocks(np.negative, x, dtype=x.dtype,
                                                          working_set=_output_block))
            if v == 11.0:
                first = view._overheads[(c.scheduler.address, w)]
        assert len(lines) == 2 and all("per-task overhead, 1 ms," in s for s in lines)
        assert first[0] is None and view._overheads[(c.scheduler.address, w)] == first
        _release.set()
        assert busy.result() is True


_release = threading.Event()


def _wait_for() -> bool:
    return _release.wait(timeout=scaled(60))


# -- blocks grown to the target ------------------------------------------------------------

def test_fit_blocks_grows_small_blocks_and_splits_large_ones_on_gpus():
    with gpus(SimulatedDevice(device_memory="1GiB")) as c:
        target = device_block_target(c).nbytes  # 128 MiB: 1/8 of the device
        assert target == 128 * MiB
        x = da.ones((2**15, 1024), chunks=(256, 1024))  # 2 MiB blocks, 256 MiB in all
        y, change = blockflow.fit_blocks(x, client=c)
        assert change.reason == "device-target" and change.merged == 128
        assert y.chunks[0] == (2**14, 2**14) and _bytes(y) == target
        np.testing.assert_array_equal(y.sum().compute(), 2**25)
        # too large for the device: split as before, not merged back
        big = da.ones((2**17, 1024), chunks=(2**16, 1024))  # 512 MiB blocks
        z, change = blockflow.fit_blocks(big, lambda n: 2 * n, client=c)
        assert change.reason == "fit-device-memory" and _bytes(z) * 3 <= 0.8 * GiB
        # a chosen axis
        w, change = blockflow.fit_blocks(da.ones((64, 2**14), chunks=(64, 256)), axis=1,
                                         client=c)
        assert change.axis == 1 and len(w.chunks[1]) == 1


def test_blocks_cut_small_on_every_axis_grow_on_several_axes_and_get_the_line():
    with gpus(SimulatedDevice(device_memory="1GiB")) as c:
        target = device_block_target(c).nbytes  # 128 MiB
        x = da.ones((512, 512, 512), dtype="f4", chunks=32)  # 128 KiB blocks, 512 MiB
        y, change = blockflow.fit_blocks(x, client=c)
        assert change.reason == "device-target" and 0.25 * target <= _bytes(y) <= target
        assert sum(len(c) > 1 for c in y.chunks) < sum(len(c) > 1 for c in x.chunks)
        assert float(y.sum().compute()) == 512**3
        (line,) = _advice(lambda: blockflow.map_blocks(np.negative, x, dtype=x.dtype,
                                                       working_set=_output_block))
        fix = re.search(r"x = x\.rechunk\((\{.*?\})\) gives blocks of ([\d.]+ [KMG]iB)", line)
        advised = x.rechunk(ast.literal_eval(fix.group(1)))
        assert len(ast.literal_eval(fix.group(1))) >= 2  # one axis alone cannot reach it
        assert format_bytes(_bytes(advised)) == fix.group(2)
        assert _bytes(advised) >= 0.25 * target


def test_fit_blocks_leaves_empty_and_object_arrays_as_they_are_on_gpus():
    with gpus(SimulatedDevice(device_memory="1GiB")):
        for x in (da.ones((0, 1024), chunks=(10, 256)),  # nothing to grow
                  da.from_array(np.array([None] * 4096, dtype=object), chunks=16)):  # pointers
            y, change = blockflow.fit_blocks(x)
            assert y is x and change is None
            assert _advice(lambda: device_blocks.advise_blocks(
                x, "blockflow.map_blocks", working_set=_output_block)) == []


def test_fit_blocks_keeps_small_blocks_on_cpu_clusters(client):
    x = da.ones((2**15, 1024), chunks=(256, 1024))
    assert blockflow.fit_blocks(x, client=client) == (x, None)
    xr = pytest.importorskip("xarray")
    field = xr.DataArray(x, dims=("time", "x"))
    assert blockflow.fit_blocks(field, client=client) == (field, None)


def test_fit_blocks_grows_xarray_blocks_on_gpus_along_one_dimension():
    xr = pytest.importorskip("xarray")
    with gpus(SimulatedDevice(device_memory="1GiB")) as c:
        target = device_block_target(c).nbytes  # 128 MiB
        data = da.ones((2**15, 1024), chunks=(256, 1024))  # 2 MiB blocks
        field = xr.Dataset({"t": (("time", "x"), data), "u": (("time", "x"), data + 1)},
                           coords={"time": np.arange(2**15)})
        grown, change = blockflow.fit_blocks(field, client=c)
        assert change.reason == "device-target" and change.axis == "time"
        # both variables count: blocks of the two together reach the target, not each
        assert max(grown.chunksizes["time"]) * 1024 * 8 * 2 <= target
        assert max(grown.chunksizes["time"]) * 1024 * 8 * 2 >= 0.5 * target
        assert float(grown["u"].sum().compute()) == 2 * 2**25


# -- the advisory line ---------------------------------------------------------------------

def _advice(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, blockflow.BlockflowWarning)]


def _output_block(nbytes):
    return nbytes  # the device working set of a kernel writing one output block


def test_small_blocks_on_gpus_get_one_line_with_a_rechunk_that_fits():
    with gpus(SimulatedDevice(device_memory="1GiB")) as c:
        x = da.ones((2**15, 1024), chunks=(256, 1024))  # 2 MiB blocks
        with pytest.warns(blockflow.BlockSizeWarning) as caught:
            blockflow.map_blocks(np.negative, x, dtype=x.dtype, working_set=_output_block)
        (line,) = [str(w.message) for w in caught]
        assert line.startswith("blockflow.map_blocks: blocks of 2.00 MiB are too small for "
                               "the GPU workers (worker ")
        assert "x, _ = blockflow.fit_blocks(x)" in line and "\n" not in line
        fix = re.search(r"x = x\.rechunk\((\{.*?\})\) gives blocks of .* \(~\d+% overhead\)",
                        line)
        assert fix and line.endswith("advise-below: false silences this.")
        # once per collection: a second stage on it says nothing
        assert _advice(lambda: blockflow.map_blocks(np.negative, x, dtype=x.dtype,
                                                    working_set=_output_block)) == []
        # following it: blocks of at least advise-below x the target, and silence
        y = x.rechunk(ast.literal_eval(fix.group(1)))
        assert _bytes(y) >= 0.25 * device_block_target(c).nbytes
        out = blockflow.map_blocks(np.negative, y, dtype=y.dtype, working_set=_output_block)
        assert float(out.sum().compute()) == -(2**25)  # (a warning would be an error here)
        # several aligned arguments: rechunked alike
        a, b = (da.full((2**15, 1024), v, chunks=(256, 1024)) for v in (2.0, 3.0))
        with pytest.warns(blockflow.BlockSizeWarning,
                          match="; rechunk every aligned argument alike, e.g. x = x.rechunk"):
            blockflow.map_blocks(np.add, a, b, dtype=float, working_set=_output_block)
        with dask.config.set({"blockflow.blocks.advise-below": False}):
            w = da.zeros((2**15, 1024), chunks=(128, 1024))
            assert _advice(lambda: blockflow.map_blocks(np.negative, w, dtype=w.dtype,
                                                        working_set=_output_block)) == []


def test_host_blocks_of_a_stage_declaring_no_device_memory_get_no_line():
    # NumPy blocks without working_set= run on the GPU workers' CPUs: no GPU-sized advice
    with gpus(SimulatedDevice(device_memory="1GiB")):
        before = dict(view._overheads)
        x = da.ones((2**15, 1024), chunks=(256, 1024))
        assert _advice(lambda: blockflow.map_blocks(np.negative, x, dtype=x.dtype)) == []
        assert _advice(lambda: blockflow.tree_reduce(x, np.sum)) == []
        assert view._overheads == before  # nothing measured


def test_no_line_for_blocks_large_enough_or_arrays_too_small_to_grow():
    with gpus(SimulatedDevice(device_memory="1GiB")) as c:
        before = dict(view._overheads)
        small = da.ones((1024, 16), chunks=(8, 16))  # 128 KiB in all: nothing to grow into
        assert _advice(lambda: blockflow.map_blocks(np.negative, small, dtype=float,
                                                    working_set=_output_block)) == []
        large = da.ones((2**15, 1024), chunks=(2**14, 1024))  # 128 MiB blocks: the target
        assert _advice(lambda: blockflow.map_blocks(np.negative, large, dtype=float,
                                                    working_set=_output_block)) == []
        assert view._overheads == before  # and nothing was measured for them
        assert c.status == "running"


def test_no_line_and_no_probe_on_cpu_clusters(client):
    x = da.full((2**15, 1024), 5.0, chunks=(256, 1024))  # a collection never advised
    said = _advice(lambda: blockflow.map_blocks(np.negative, x, dtype=x.dtype,
                                                working_set=_output_block))
    assert len(said) == 1 and "working_set= is the device (GPU) memory" in said[0]
    assert _advice(lambda: blockflow.tree_reduce(x, np.sum)) == []
    assert not [k for k in view._overheads if k[0] == client.scheduler.address]


def test_the_advice_adds_no_scheduler_call_to_a_cpu_stage(client, monkeypatch):
    asked = []
    identity = view.scheduler_identity
    monkeypatch.setattr(view, "scheduler_identity", lambda c: asked.append(1) or identity(c))

    def calls(advise_below) -> int:
        device_blocks._seen_gpu.pop(client.id, None)  # nothing remembered from before
        asked.clear()
        x = da.full((2**12, 64), advise_below or 0.5, chunks=(64, 64))
        with dask.config.set({"blockflow.blocks.advise-below": advise_below}):
            _advice(lambda: blockflow.map_blocks(np.negative, x, dtype=x.dtype,
                                                 working_set=_output_block))
        return len(asked)

    assert calls(0.25) == calls(False) > 0  # as many as without the advice


# -- the fan-in ----------------------------------------------------------------------------

def test_the_fan_in_on_gpus_is_sized_from_device_memory_past_max_split_every(client):
    # CPU workers: clamped to max-split-every (32), device blocks or not
    assert _resolve_split_every(None, 1024, "x") == 32
    assert _resolve_split_every(None, 1024, "x", device=True) == 32
    with gpus(SimulatedDevice(device_memory="1GiB")) as c:
        assert _resolve_split_every(None, 1024, "x", device=True) == GiB // 4 // 1024
        assert _resolve_split_every(None, 256 * MiB, "x", device=True) == 2  # within memory
        # host (NumPy) blocks reduce on the GPU workers' CPUs: the clamp, as on CPU workers
        assert _resolve_split_every(None, 1024, "x") == 32
        x = da.ones(256, chunks=1)
        total = blockflow.tree_reduce(x, np.sum)
        partials = {k for k in total.__dask_graph__() if "-partial" in str(k)}
        assert len(partials) == 256 // 32 and float(total.compute()) == 256.0
        assert c.status == "running"


# -- NVML's bandwidth ----------------------------------------------------------------------

class _NVML:
    NVML_CLOCK_MEM = 2

    def nvmlDeviceGetMemoryBusWidth(self, handle):
        return 5120

    def nvmlDeviceGetMaxClockInfo(self, handle, clock):
        assert clock == self.NVML_CLOCK_MEM
        return 2619


def test_nvml_bandwidth_is_bus_width_times_memory_clock_double_rate():
    assert devices.bandwidth(("gpu", 0), pynvml=_NVML()) == 5120 / 8 * 2619e6 * 2

    class Old(_NVML):
        def nvmlDeviceGetMemoryBusWidth(self, handle):
            raise RuntimeError("Not Supported")

    assert devices.bandwidth(("gpu", 0), pynvml=Old()) is None
    assert devices.bandwidth(None, pynvml=_NVML()) is None


# -- on a real GPU -------------------------------------------------------------------------

@pytest.mark.gpu
def test_to_device_grows_blocks_and_cupy_blocks_get_the_line_in_tree_reduce():
    cupy = pytest.importorskip("cupy", reason="blockflow.to_device needs CuPy and a GPU")
    with gpus(SimulatedDevice(device_memory="1GiB")):
        x = da.ones((2**15, 1024), chunks=(256, 1024))
        y = blockflow.to_device(x)
        assert len(y.chunks[0]) == 2 and isinstance(y._meta, cupy.ndarray)
        assert float(y.sum().compute()) == 2**25
        z = da.zeros((2**15, 1024), chunks=(512, 1024)).map_blocks(cupy.asarray)
        with pytest.warns(blockflow.BlockSizeWarning, match=r"^blockflow\.tree_reduce: "):
            total = blockflow.tree_reduce(z, cupy.sum)
        assert float(total.compute()) == 0.0


def test_to_device_without_cupy_refuses_before_sizing():
    if blockflow.backends.has_package("cupy"):
        pytest.skip("CuPy is installed here")
    with gpus(SimulatedDevice(device_memory="1GiB")):
        before = dict(view._overheads)
        with pytest.raises(blockflow.GPUUnavailableError, match="needs the package 'cupy'"):
            blockflow.to_device(da.ones((2**15, 1024), chunks=(256, 1024)))
        assert view._overheads == before


def test_an_asynchronous_client_stages_and_fits_blocks_without_sizing():
    """Inside an event loop nothing can be asked synchronously: no sizing, no advice, and
    no error (blocks as given)."""
    import asyncio

    async def main():
        async with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                dashboard_address=":0", asynchronous=True) as cluster, \
                Client(cluster, asynchronous=True) as client:
            x = da.ones((4096, 64), chunks=(256, 64))
            y, change = blockflow.fit_blocks(x, client=client)
            assert y is x and change is None
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                z = blockflow.map_blocks(np.negative, x, dtype=x.dtype, working_set=1024)
            assert float(await client.compute(z.sum())) == -4096 * 64

    asyncio.run(main())


def test_small_xarray_blocks_on_gpus_get_the_line_with_a_chunk_that_fits():
    xr = pytest.importorskip("xarray")
    with gpus(SimulatedDevice(device_memory="1GiB")) as c:
        field = xr.DataArray(da.ones((2**15, 1024), chunks=(256, 1024)), dims=("time", "x"),
                             name="t")
        (line,) = _advice(lambda: blockflow.map_blocks(np.negative, field,
                                                       working_set="2MiB"))
        assert line.startswith("blockflow.map_blocks: blocks of 2.00 MiB are too small")
        fix = re.search(r"x = x\.chunk\((\{.*?\})\) gives blocks of ([\d.]+ [KMG]iB)", line)
        advised = field.chunk(ast.literal_eval(fix.group(1)))
        assert format_bytes(_bytes(advised.data)) == fix.group(2)
        assert _bytes(advised.data) >= 0.25 * device_block_target(c).nbytes
        assert _advice(lambda: blockflow.map_blocks(np.negative, advised,
                                                    working_set="2MiB")) == []
