"""Device out of memory on simulated GPUs (blockflow.testing), and how blockflow reports it.

A block whose working set fits no device fails with a DeviceMemoryError naming the block, the
bytes asked for and the largest free device memory of any worker; a block that fits on
another device is placed there by the dynamic policy, which pauses a nearly-full worker.
"""

from __future__ import annotations

import pickle

import dask.array as da
import numpy as np
import pytest

from blockflow import map_blocks
from blockflow.errors import BlockKernelError, DeviceMemoryError, is_device_oom, requested_bytes
from blockflow.scheduling import Rebalancer
from blockflow.testing import device_stats, set_tenant, simulated_cluster, simulated_kernel

from .conftest import wait_until

GiB, MiB = 2**30, 2**20


def on_device(block, *, working_set):
    """A kernel that needs ``working_set`` bytes of (simulated) device memory."""
    return simulated_kernel(block, work=0.01, working_set=working_set).payload


async def _heartbeat(dask_worker):
    await dask_worker.heartbeat()


def _idle(dask_scheduler=None) -> bool:
    return not any(ws.processing for ws in dask_scheduler.workers.values())


def _executing(dask_worker=None) -> int:
    return dask_worker.state.executing_count


def _by_name(client) -> list[str]:
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return sorted(workers, key=lambda a: int(workers[a]["name"]))


def test_a_block_too_big_for_every_device_names_its_size_and_the_free_memory():
    with simulated_cluster(speeds=(1, 1), device_memory="1GiB", processes=False) as client:
        y = map_blocks(on_device, da.ones(10, chunks=10), working_set=2 * GiB)
        with pytest.raises(DeviceMemoryError) as info:
            client.compute(y).result()
        first = sorted(_by_name(client))[0]  # equal free memory: the first address is named
    assert str(info.value).startswith(
        "blockflow kernel 'on_device' ran out of device memory on block (0,): it asked for "
        "2,147,483,648 bytes (2.00 GiB) of device memory, but the largest free device memory "
        f"of any worker is 1,073,741,824 bytes (1.00 GiB, on {first}). Make the block fit: use "
        "smaller blocks (rechunk or repartition), free device memory (persisted results, other "
        "processes on the GPU), or use workers with larger GPUs. SimulatedOutOfMemoryError: "
        "Out of memory allocating 2,147,483,648 bytes (allocated so far: 0 bytes). Simulated "
        "device of worker ")
    err = info.value
    assert (err.block, err.working_set, err.largest_free) == ("block (0,)", 2 * GiB, GiB)
    assert isinstance(err, BlockKernelError) and isinstance(err, MemoryError)


def test_a_block_that_fits_elsewhere_is_placed_there_by_the_dynamic_policy():
    with simulated_cluster(speeds=(1, 1), device_memory="1GiB", processes=False) as client:
        full, roomy = _by_name(client)
        client.run(set_tenant, (0, 900 * MiB), workers=[full])  # another process: 88 % used
        client.run(_heartbeat)
        x = da.ones(80, chunks=10)  # 8 blocks of 300 MiB working set: fit only on `roomy`
        # Plain Dask places blocks on the nearly-full device too, where they cannot fit ...
        with pytest.raises(DeviceMemoryError) as info:
            client.compute(map_blocks(on_device, x, working_set=300 * MiB)).result()
        assert info.value.working_set == 300 * MiB
        assert info.value.largest_free > 600 * MiB  # ... though another device had room
        assert client.run(device_stats, workers=[full])[full]["oom_errors"] >= 1

        # ... blockflow's dynamic policy pauses the nearly-full worker (memory >= 85 %).
        # Tasks of the failed run still executing on workers (the scheduler has let them go)
        # would count as kernels of the next run: wait until the workers are idle too.
        wait_until(lambda: client.run_on_scheduler(_idle)
                   and not any(client.run(_executing).values()), what="the failed run to drain")
        client.register_plugin(Rebalancer(policy="dynamic"))
        status = client.sync(client.scheduler.blockflow_status)
        assert list(status["paused"]) == [full]
        before = client.run(device_stats)
        y = map_blocks(on_device, x, working_set=300 * MiB, name="placed")
        np.testing.assert_array_equal(client.compute(y).result(), np.ones(80))
        after = client.run(device_stats)
    assert after[full]["kernels"] == before[full]["kernels"]
    assert after[full]["oom_errors"] == before[full]["oom_errors"]
    assert after[roomy]["kernels"] - before[roomy]["kernels"] == 8


class OutOfMemoryError(MemoryError):
    """Named like ``cupy.cuda.memory.OutOfMemoryError`` (matched by name, CuPy not needed)."""


@pytest.mark.parametrize("exc, oom, size", [
    (OutOfMemoryError("Out of memory allocating 1,024 bytes (allocated so far: 0 bytes)."),
     True, 1024),
    (MemoryError("std::bad_alloc: out_of_memory: CUDA error at: rmm/mr/device/cuda.hpp"),
     True, None),
    (MemoryError("host memory exhausted"), False, None),
    (ValueError("Out of memory allocating 5 bytes"), False, 5),
])
def test_device_out_of_memory_errors_are_told_apart(exc, oom, size):
    assert is_device_oom(exc) is oom
    assert requested_bytes(exc) == size


def test_device_memory_error_keeps_its_details_across_processes():
    err = DeviceMemoryError("message", block="partition 7", working_set=5, largest_free=3)
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.block, back.working_set, back.largest_free) == (
        "message", "partition 7", 5, 3)
