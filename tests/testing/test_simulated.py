"""Simulated GPU workers on real clusters: metrics on the scheduler, memory, speed, OOM."""

from __future__ import annotations

import re
import time

import dask
import dask.dataframe  # noqa: F401  (dask.dataframe.from_pandas below)
import numpy as np
import pandas as pd
import pytest
from dask.sizeof import sizeof
from distributed import wait
from distributed.utils_test import gen_cluster
from loadaware import scaled, wait_until

import blockflow
from blockflow.scheduling.view import workers_info
from blockflow.backends import gpu_device_count, has_package
from blockflow.testing import (
    SimulatedDevice,
    SimulatedDeviceBlock,
    SimulatedOutOfMemoryError,
    Tenant,
    as_host,
    assert_eq,
    device_stats,
    get_device,
    install_simulated_devices,
    restart_clock,
    set_speed,
    set_tenant,
    simulated_cluster,
    simulated_kernel,
)

requires_cupy = pytest.mark.skipif(
    gpu_device_count() == 0 or not has_package("cupy"), reason="needs an NVIDIA GPU and CuPy"
)

GiB, MiB = 2**30, 2**20
KEYS = ("gpu_utilization", "gpu_memory_used", "gpu-memory-total")


def addresses(client) -> dict[int, str]:
    return {int(w["name"]): a for a, w in workers_info(client).items()}


def metrics(client, i: int) -> dict:
    """Metrics of the worker named ``i``, from one snapshot of the scheduler's info (two
    snapshots may disagree on the workers' addresses, e.g. after a nanny restart)."""
    workers = workers_info(client).values()
    return next(w["metrics"] for w in workers if int(w["name"]) == i)


@pytest.fixture(scope="class")
def sim():
    """Worker processes: 0 fast 1 GiB, 1 slow (0.25) 2 GiB, 2 fast 1 GiB with a tenant."""
    tenant = Tenant(utilization=20, memory="100MiB", schedule=[(1.5, 70, "300MiB")])
    with simulated_cluster(speeds=(1, 0.25, 1), device_memory=["1GiB", "2GiB", "1GiB"],
                           tenants={2: tenant}) as client:
        yield client


@pytest.mark.slow  # its class fixture starts three worker processes
class TestSimulatedCluster:
    """On one cluster of worker processes (class-scoped: gen_cluster tests below kill
    leftover worker processes, so this cluster must be gone before they start)."""

    @pytest.mark.slow
    def test_metrics_reach_scheduler_under_nvml_keys(self, sim):
        for i, total in enumerate([GiB, 2 * GiB, GiB]):
            m = metrics(sim, i)
            assert all(k in m for k in KEYS), m
            assert m["gpu-memory-total"] == total
            parsed = blockflow.scheduling.read_metrics(m)
            assert parsed.has_gpu and parsed.gpu_utilization is not None
        assert metrics(sim, 0)["gpu_memory_used"] == 0
        assert metrics(sim, 0)["gpu_utilization"] == 0


    @pytest.mark.slow
    def test_busy_worker_utilisation_rises_and_falls_back(self, sim):
        a0 = addresses(sim)[0]
        fut = sim.submit(simulated_kernel, np.ones(4), work=1.5, workers=[a0], pure=False)
        wait_until(lambda: metrics(sim, 0)["gpu_utilization"] >= 50,
                   timeout=6, message="utilisation to rise")
        assert metrics(sim, 1)["gpu_utilization"] == 0  # an idle worker stays idle
        fut.result()
        del fut
        wait_until(lambda: metrics(sim, 0)["gpu_utilization"] == 0,
                   timeout=6, message="utilisation to fall")


    @pytest.mark.slow
    def test_tenant_share_and_memory_follow_schedule(self, sim):
        a2 = addresses(sim)[2]
        sim.run(restart_clock, workers=[a2])
        wait_until(lambda: (metrics(sim, 2)["gpu_utilization"], metrics(sim, 2)["gpu_memory_used"])
                   == (20, 100 * MiB), timeout=6, message="the tenant's first step")
        wait_until(lambda: (metrics(sim, 2)["gpu_utilization"], metrics(sim, 2)["gpu_memory_used"])
                   == (70, 300 * MiB), timeout=6, message="the tenant's second step")
        # Time slicing (blockflow heuristic): kernels get max(1 - tenant share, 1/2) of the device
        assert sim.run(device_stats, workers=[a2])[a2]["effective_speed"] == pytest.approx(0.5)
        sim.run(set_tenant, (30, "50MiB"), workers=[a2])
        wait_until(lambda: metrics(sim, 2)["gpu_memory_used"] == 50 * MiB,
                   timeout=6, message="set_tenant")
        assert sim.run(device_stats, workers=[a2])[a2]["effective_speed"] == pytest.approx(0.7)
        sim.run(set_tenant, None, workers=[a2])
        wait_until(lambda: (metrics(sim, 2)["gpu_utilization"], metrics(sim, 2)["gpu_memory_used"])
                   == (0, 0), timeout=6, message="the tenant to leave")


    def test_held_blocks_raise_device_memory_and_release_lowers_it(self, sim):
        a1 = addresses(sim)[1]
        fut = sim.submit(simulated_kernel, np.arange(3), work=0, output_bytes="512MiB",
                         workers=[a1], pure=False)
        wait([fut])
        assert sim.nbytes(summary=False)[fut.key] == 512 * MiB  # dask.sizeof reports nbytes
        wait_until(lambda: metrics(sim, 1)["gpu_memory_used"] == 512 * MiB,
                   timeout=6, message="held block")
        del fut
        wait_until(lambda: metrics(sim, 1)["gpu_memory_used"] == 0, timeout=6, message="release")


    @pytest.mark.slow
    def test_kernel_run_time_scales_with_one_over_speed(self, sim):
        a = addresses(sim)

        def run(i, work=0.3):
            before = sim.run(device_stats, workers=[a[i]])[a[i]]["busy_seconds"]
            t0 = time.perf_counter()
            sim.submit(simulated_kernel, 1.0, work=work, workers=[a[i]], pure=False).result()
            wall = time.perf_counter() - t0
            busy = sim.run(device_stats, workers=[a[i]])[a[i]]["busy_seconds"] - before
            return wall, busy

        fast_wall, fast_busy = run(0)
        slow_wall, slow_busy = run(1)
        assert 0.25 < fast_busy < 0.6 and fast_wall < scaled(1.0)
        assert 1.1 < slow_busy < 2.0 and slow_wall > 1.1  # 0.3 / 0.25 = 1.2 s
        assert slow_busy / fast_busy > 2.5
        sim.run(set_speed, 1.0, workers=[a[1]])  # mid-run speed change through client.run
        try:
            assert run(1)[1] < 0.6
        finally:
            sim.run(set_speed, None, workers=[a[1]])
        assert sim.run(device_stats, workers=[a[1]])[a[1]]["speed"] == 0.25


    def test_out_of_memory_raised_only_when_working_set_does_not_fit(self, sim):
        a0 = addresses(sim)[0]
        ooms = sim.run(device_stats, workers=[a0])[a0]["oom_errors"]
        with pytest.raises(SimulatedOutOfMemoryError) as e:
            sim.submit(simulated_kernel, 1, work=0, working_set="2GiB", workers=[a0],
                       pure=False).result()
        assert str(e.value) == (
            f"Out of memory allocating 2,147,483,648 bytes (allocated so far: 0 bytes). "
            f"Simulated device of worker 0 ({a0}): capacity 1,073,741,824 bytes, background "
            f"tenant 0 bytes."
        )
        assert isinstance(e.value, MemoryError) and e.value.size == 2 * GiB
        ok = sim.submit(simulated_kernel, 1, work=0, working_set="512MiB", output_bytes=0,
                        workers=[a0], pure=False)
        assert as_host(ok.result()) == 1
        held = sim.submit(simulated_kernel, 1, work=0, output_bytes="768MiB", workers=[a0],
                          pure=False)
        wait([held])
        with pytest.raises(SimulatedOutOfMemoryError,
                           match=re.escape("(allocated so far: 805,306,368 bytes)")):
            sim.submit(simulated_kernel, 1, work=0, working_set="512MiB", workers=[a0],
                       pure=False).result()
        assert sim.run(device_stats, workers=[a0])[a0]["oom_errors"] == ooms + 2
        del held, ok


    def test_inventory_shows_simulated_gpus(self, sim):
        inv = blockflow.inventory(sim)
        by_name = {w.name: w for w in inv}
        assert inv.n_gpus == 3
        assert by_name["1"].device == "gpu"
        assert by_name["1"].gpu_name == "Simulated GPU (speed 0.25)"
        assert by_name["0"].gpu_name == "Simulated GPU (speed 1)"
        assert all(w.simulated and w.gpu_uuid.startswith("SIM-") for w in inv)
        assert by_name["1"].gpu_memory_total == 2 * GiB
        assert len({w.gpu_uuid for w in inv}) == 3
        assert [w.gpu_uuid for w in blockflow.inventory(sim)] == [w.gpu_uuid for w in inv]


    @pytest.mark.slow
    def test_kernel_results_match_numpy(self, sim):
        x = np.random.default_rng(0).random((16, 50))
        parts = [sim.submit(simulated_kernel, row, op=np.sum, work=0.01, output_bytes="8MiB",
                            pure=False) for row in x]
        while len(parts) > 1:  # pairwise tree reduction of device blocks
            parts = [sim.submit(simulated_kernel, p, q, op=np.add, work=0.01, pure=False)
                     for p, q in zip(parts[::2], parts[1::2])] + parts[len(parts) // 2 * 2:]
        total = parts[0].result()
        assert isinstance(total, SimulatedDeviceBlock) and total.nbytes == 8 * MiB
        assert_eq(total, x.sum())
        blocks = sim.compute([dask.delayed(simulated_kernel)(r, op=np.cumsum, work=0) for r in x],
                             sync=True)
        assert_eq(np.stack([as_host(b) for b in blocks]), np.cumsum(x, axis=1))


# --- gen_cluster: devices installed into an in-process test cluster ----------------------


@gen_cluster(client=True, nthreads=[("127.0.0.1", 3), ("127.0.0.1", 1)])
@pytest.mark.slow
async def test_install_into_gen_cluster_and_concurrent_working_sets(c, s, a, b):
    await install_simulated_devices(c, {a.address: SimulatedDevice(speed=2, device_memory="1GiB")})
    assert s.workers[a.address].metrics["gpu-memory-total"] == GiB
    assert not any(k in s.workers[b.address].metrics for k in KEYS)  # b stays a plain worker
    assert a.plugins["blockflow-simulated-gpu"].describe()["gpu_name"] == "Simulated GPU (speed 2)"
    # the agreed protocol: production code finds a device-owning plugin by describe_device()
    plugin = a.plugins["blockflow-simulated-gpu"]
    assert plugin.describe_device() == plugin.describe()
    assert plugin.describe_device()["simulated"] is True
    assert b.plugins["blockflow-simulated-gpu"].describe_device() == {}
    assert get_device(b) is None and (await c.run(device_stats))[b.address] is None

    # Concurrent kernels: working sets add up, busy time counts once.
    dev = get_device(a)
    first = c.submit(simulated_kernel, 1, work=1.2, working_set="600MiB", workers=[a.address],
                     pure=False)
    second = c.submit(simulated_kernel, 2, work=1.2, working_set="300MiB", workers=[a.address],
                      pure=False)
    while len(dev._active) < 2:
        await c.run(device_stats)  # yields to the event loop
    with pytest.raises(SimulatedOutOfMemoryError, match="allocated so far: 943,718,400 bytes"):
        await c.submit(simulated_kernel, 3, work=0, working_set="200MiB", workers=[a.address],
                       pure=False)
    await wait([first, second])
    stats = dev.stats()
    assert stats["kernels"] == 2 and stats["oom_errors"] == 1
    # two kernels share speed 2: each takes ~1.2 s; together busy ~1.2 s, not 2.4 s
    assert 0.9 < stats["busy_seconds"] < 2.0

    # plain worker: speed 1, unlimited memory
    out = await c.submit(simulated_kernel, np.arange(4), op=np.sum, working_set="1PiB", work=0,
                         workers=[b.address])
    assert out.payload == 6


@gen_cluster(client=True)
async def test_install_through_the_scheduler_is_idempotent(c, s, a, b):
    await install_simulated_devices(s, {}, default=SimulatedDevice(device_memory="3GiB"))
    assert {ws.metrics["gpu-memory-total"] for ws in s.workers.values()} == {3 * GiB}
    await install_simulated_devices(c, SimulatedDevice(device_memory="5GiB"))  # no-op
    assert get_device(a).capacity == 3 * GiB


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_teardown_removes_only_the_metrics_the_plugin_set(c, s, a):
    from blockflow.testing import PLUGIN_NAME

    await install_simulated_devices(c, SimulatedDevice())
    assert all(k in a.metrics for k in KEYS)

    def foreign(worker):  # e.g. distributed's own NVML monitor, set after the plugin's
        return 42.0

    a.metrics["gpu_utilization"] = foreign
    await c.unregister_worker_plugin(PLUGIN_NAME)
    assert a.metrics.get("gpu_utilization") is foreign
    assert not any(k in a.metrics for k in ("gpu_memory_used", "gpu-memory-total"))
    assert get_device(a) is None


# --- without a cluster -------------------------------------------------------------------


def test_simulated_devices_live_in_blockflow_testing_only():
    import importlib

    import blockflow.testing
    from blockflow.testing import cluster, simulated_device

    assert SimulatedDeviceBlock.__module__ == "blockflow.testing.simulated_device"
    assert blockflow.testing.simulated_cluster is cluster.simulated_cluster
    assert blockflow.testing.Tenant is simulated_device.Tenant
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("blockflow.scheduling.simulated")


def test_kernel_outside_a_worker_and_sizeof():
    block = simulated_kernel(np.arange(5), op=np.sum, work=0, working_set="1PiB",
                             output_bytes="1GiB")
    assert block.payload == 10 and sizeof(block) == GiB
    with pytest.raises(TypeError, match=re.escape("simulated_kernel: pass op= to combine 2")):
        simulated_kernel(block, block)


def test_speed_and_tenant_schedules():
    dev = SimulatedDevice(speed=1, speed_schedule=[(10, 0.5), (20, 0.1)],
                          tenant=[(0, 10, "1GiB"), (20, 50, 0)])
    now = time.time()
    for elapsed, speed, tenant in [(5, 1, (10, GiB)), (15, 0.5, (10, GiB)), (25, 0.1, (50, 0))]:
        dev.restart_clock(now - elapsed)
        assert dev.speed() == speed and dev.tenant_now() == tenant
    dev.set_speed(3)
    assert dev.speed() == 3
    assert Tenant.coerce((30, "1GiB")) == Tenant(30, GiB)


def test_bad_configuration_messages():
    with pytest.raises(ValueError, match="^simulated_cluster: speeds is empty; give one speed"):
        with simulated_cluster(speeds=()):
            pass
    with pytest.raises(ValueError, match=re.escape(
            "simulated_cluster: device_memory has 1 entries for 2 workers (one per speed).")):
        with simulated_cluster(speeds=(1, 1), device_memory=["1GiB"]):
            pass
    with pytest.raises(ValueError, match=re.escape(
            "Simulated device speed must be a finite number > 0, got 0.0.")):
        SimulatedDevice(speed=0)
    with pytest.raises(ValueError, match=re.escape(
            "Tenant utilization must be a percentage 0-100, got 120.")):
        Tenant(utilization=120)


# --- assert_eq ---------------------------------------------------------------------------


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=requires_cupy)])
def xp(request):
    return pytest.importorskip(request.param)


def test_assert_eq_arrays(xp):
    x = np.arange(12.0).reshape(3, 4)
    assert_eq(xp.asarray(x), x)
    assert_eq(dask.array.from_array(x, chunks=2), xp.asarray(x))
    assert_eq(SimulatedDeviceBlock(x), x * (1 + 1e-12))
    with pytest.raises(AssertionError, match=re.escape("shapes differ: (3, 4) vs (4, 3)")):
        assert_eq(xp.asarray(x), x.T)
    with pytest.raises(AssertionError, match="dtypes differ: float64 vs int64"):
        assert_eq(x, x.astype("int64"))
    assert_eq(x, x.astype("int64"), check_dtype=False)
    with pytest.raises(AssertionError):
        assert_eq(x, x + 1)


def test_assert_eq_frames():
    df = pd.DataFrame({"a": [1, 2, 3], "b": [0.5, 1.5, 2.5]})
    assert_eq(dask.dataframe.from_pandas(df, npartitions=2), df)
    assert_eq(df.set_index("a"), df.set_index("a"))
    assert_eq(df["b"], df["b"].set_axis([7, 8, 9]), check_index=False)
    with pytest.raises(AssertionError):
        assert_eq(df, df.assign(b=df.b + 1))
    with pytest.raises(AssertionError, match="assert_eq: DataFrame vs Series."):
        assert_eq(df, df["a"])


def test_device_scale_keeps_simulated_compute_within_the_host_cores():
    import os

    from blockflow.testing import device_scale

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    k = device_scale([1, 1, 0.5, 0.25])
    assert k >= 1 and k == int(k)
    assert 2.75 / k <= 0.7 * cores or k == 1  # within 70 % of the cores
    assert k == 1 or 2.75 / (k - 1) > 0.7 * cores  # and the smallest such whole factor
    assert device_scale([0.1]) == 1.0
    with pytest.raises(ValueError, match="fraction"):
        device_scale([1], fraction=0)
