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

import blockflow
from blockflow import map_blocks
from blockflow.scheduling.view import workers_info
from blockflow.errors import BlockKernelError, DeviceMemoryError, is_device_oom, requested_bytes
from blockflow.scheduling import Rebalancer
from blockflow.testing import device_stats, set_tenant, simulated_cluster, simulated_kernel

from loadaware import wait_until

GiB, MiB = 2**30, 2**20


def on_device(block, *, need):
    """A kernel that needs ``need`` bytes of (simulated) device memory."""
    return simulated_kernel(block, work=0.01, working_set=need).payload


async def _heartbeat(dask_worker):
    await dask_worker.heartbeat()


def _idle(dask_scheduler=None) -> bool:
    return not any(ws.processing for ws in dask_scheduler.workers.values())


def _executing(dask_worker=None) -> int:
    return dask_worker.state.executing_count


def _by_name(client) -> list[str]:
    workers = workers_info(client)
    return sorted(workers, key=lambda a: int(workers[a]["name"]))


def test_a_block_too_big_for_every_device_names_its_size_and_the_free_memory():
    with simulated_cluster(speeds=(1, 1), device_memory="1GiB", processes=False) as client:
        y = map_blocks(on_device, da.ones(10, chunks=10), need=2 * GiB, working_set=2 * GiB)
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
    assert err.largest_free < err.working_set  # it never claims room it did not have
    assert isinstance(err, BlockKernelError) and isinstance(err, MemoryError)


@pytest.mark.slow
def test_a_block_that_fits_elsewhere_is_never_a_device_memory_error():
    """A nearly-full device and a roomy one; 8 blocks whose kernel needs 300 MiB.

    blockflow once raised DeviceMemoryError ("the largest free device memory of any worker
    is 1.00 GiB") for a 300 MiB block while the roomy device idled.
    """
    with simulated_cluster(speeds=(1, 1), device_memory="1GiB", processes=False) as client:
        full, roomy = _by_name(client)
        client.run(set_tenant, (0, 900 * MiB), workers=[full])  # another process: 88 % used
        client.run(_heartbeat)
        x = da.ones(80, chunks=10)  # 8 blocks of 300 MiB working set: fit only on `roomy`
        # Without a policy the scheduler puts blocks on the nearly-full device too; a block
        # that runs out of device memory there is rescheduled, a few times; if the scheduler
        # (which knows nothing of device memory) keeps placing it there, the error says how
        # to place it - never that the largest free device memory was too small.
        y = map_blocks(on_device, x, need=300 * MiB)
        try:
            np.testing.assert_array_equal(client.compute(y).result(), np.ones(80))
        except DeviceMemoryError as e:
            assert e.largest_free is None and e.working_set == 300 * MiB
            assert f"has room. Declare what a block needs, map_blocks(..., " \
                   f"working_set={300 * MiB})" in str(e)
        assert client.run(device_stats, workers=[full])[full]["oom_errors"] >= 1

        # With the dynamic policy and the working set declared, no block goes there at all.
        wait_until(lambda: client.run_on_scheduler(_idle)
                   and not any(client.run(_executing).values()), message="the first run to drain")
        client.register_plugin(Rebalancer(policy="dynamic"))
        before = client.run(device_stats)
        y = map_blocks(on_device, x, need=300 * MiB, working_set=300 * MiB, name="placed")
        np.testing.assert_array_equal(client.compute(y).result(), np.ones(80))
        after = client.run(device_stats)
        log = blockflow.decisions(client)
    assert after[full]["kernels"] == before[full]["kernels"]
    assert after[full]["oom_errors"] == before[full]["oom_errors"]
    assert after[roomy]["kernels"] - before[roomy]["kernels"] == 8
    assert {"pause", "place"} & set(log["action"])


def test_blocks_are_placed_by_working_set_where_they_fit():
    """Two devices with 1 GiB and 8 GiB free; kernels need 2 GiB: all run on the 8 GiB one,
    none out of memory, none a DeviceMemoryError (the issue's scenario)."""
    with simulated_cluster(speeds=(1, 1), device_memory=["1GiB", "8GiB"],
                           processes=False) as client:
        small, big = _by_name(client)
        client.register_plugin(Rebalancer(policy="dynamic"))
        y = map_blocks(on_device, da.ones(12, chunks=1), need=2 * GiB,
                       working_set=lambda nbytes: 2 * GiB)
        np.testing.assert_array_equal(client.compute(y).result(), np.ones(12))
        stats = client.run(device_stats)
        log = blockflow.decisions(client)
    assert stats[small]["oom_errors"] == 0 and stats[small]["kernels"] == 0
    assert stats[big]["kernels"] == 12
    place = log[log["action"] == "place"]
    assert len(place) == 1 and place.iloc[0]["worker"] == big
    assert place.iloc[0]["seen_working_set"] == 2 * GiB


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
