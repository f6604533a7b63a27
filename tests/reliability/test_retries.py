"""Flaky and failing kernels: ``retries=`` through map_blocks, tree_reduce, flights.run, CLI.

Failures are counted in files, so a kernel fails once *in the whole cluster* however many
worker processes run it, and the number of attempts is known afterwards.
"""

from __future__ import annotations

import functools
import gc
import os

import dask.array as da
import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from distributed import Client, LocalCluster
from distributed.diagnostics.plugin import SchedulerPlugin

import blockflow
from blockflow.cli import cli
from blockflow.errors import BlockKernelError
from blockflow.workloads import flights

from loadaware import wait_until


def _attempt(marks: str, name: str) -> int:
    """Record one attempt under ``name``; return 0 for the first attempt in the whole cluster
    and 1 for any other. The first is decided by creating a marker file exclusively, so two
    worker processes attempting at once cannot both count as first or both as later."""
    path = os.path.join(marks, name)
    with open(path, "a") as f:  # O_APPEND: whole lines, also from several processes
        f.write("x\n")
    try:
        os.close(os.open(path + ".first", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return 1
    return 0


def attempts(marks, name: str) -> int:
    path = os.path.join(marks, name)
    return len(open(path).read().splitlines()) if os.path.exists(path) else 0


def fail_once(block, block_id=None, *, marks, bad=3):
    """+1, except that the first attempt on block ``bad`` raises."""
    if block_id == (bad,) and _attempt(marks, f"block-{bad}") == 0:
        raise ConnectionResetError(f"flaky read of block {bad}")
    return block + 1


def always_fail(block, block_id=None, *, marks, bad=3):
    if block_id == (bad,):
        _attempt(marks, f"block-{bad}")
        raise ValueError(f"block {bad} is corrupt")
    return block + 1


def flaky_sum(x, axis=None, keepdims=False, *, marks):
    """np.sum whose first call on a non-empty block raises."""
    if x.size and _attempt(marks, "chunk") == 0:
        raise ConnectionResetError("flaky chunk")
    return np.sum(x, axis=axis, keepdims=keepdims)


_drop_cancelled = flights.drop_cancelled  # the real kernel, before tests replace it


def flaky_drop(part, partition_info=None, *, marks, bad=2, always=False):
    """flights.drop_cancelled, failing on partition ``bad`` once (or always)."""
    if partition_info is not None and partition_info["number"] == bad:
        if _attempt(marks, f"partition-{bad}") == 0 or always:
            raise OSError(f"lost connection while reading partition {bad}")
    return _drop_cancelled(part)


class RecordRetries(SchedulerPlugin):
    """Records ``TaskState.retries`` of every task when it first starts processing."""

    name = "test-record-retries"

    async def start(self, scheduler):
        self.scheduler, self.seen = scheduler, {}

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "processing" and key not in self.seen:
            self.seen[key] = self.scheduler.tasks[key].retries


def _seen_retries(dask_scheduler=None) -> dict:
    """What the recorder saw since the last call."""
    plugin = dask_scheduler.plugins[RecordRetries.name]
    seen, plugin.seen = plugin.seen, {}
    return seen


def _flights_tasks(dask_scheduler=None) -> int:
    return sum(str(k).startswith("('blockflow-load-flights") for k in dask_scheduler.tasks)


def forget_earlier_runs(client) -> None:
    """Wait until the scheduler has forgotten earlier runs' tasks: a task that still exists
    when a graph with the same key arrives keeps the ``retries`` it had."""
    gc.collect()  # futures kept alive by reference cycles of earlier tracebacks
    wait_until(lambda: client.run_on_scheduler(_flights_tasks) == 0, timeout=30,
               message="earlier flights tasks to be released")


@pytest.fixture
def record_retries(proc_client):
    proc_client.register_plugin(RecordRetries())
    yield lambda: proc_client.run_on_scheduler(_seen_retries)
    proc_client.unregister_scheduler_plugin(RecordRetries.name)


# --- map_blocks / tree_reduce: retries inside the task --------------------------------


def test_a_kernel_failing_once_succeeds_with_retries(proc_client, tmp_path):
    x = da.arange(60, chunks=10)
    y = blockflow.map_blocks(fail_once, x, marks=str(tmp_path), retries=1)
    np.testing.assert_array_equal(proc_client.compute(y).result(), np.arange(60) + 1)
    assert attempts(tmp_path, "block-3") == 2


def test_without_retries_the_same_kernel_fails_naming_the_block(proc_client, tmp_path):
    y = blockflow.map_blocks(fail_once, da.arange(60, chunks=10), marks=str(tmp_path))
    with pytest.raises(BlockKernelError) as info:
        proc_client.compute(y).result()
    assert str(info.value) == (
        "blockflow kernel 'fail_once' failed on block (3,): ConnectionResetError: flaky read "
        "of block 3")


def test_a_kernel_always_failing_on_one_block_names_it_after_all_attempts(proc_client,
                                                                          tmp_path):
    y = blockflow.map_blocks(always_fail, da.arange(60, chunks=10), marks=str(tmp_path),
                             retries=2)
    with pytest.raises(BlockKernelError) as info:
        proc_client.compute(y).result()
    assert str(info.value) == (
        "blockflow kernel 'always_fail' failed on block (3,) after 3 attempts: ValueError: "
        "block 3 is corrupt")
    assert attempts(tmp_path, "block-3") == 3


def test_tree_reduce_retries_a_flaky_chunk(proc_client, tmp_path):
    chunk = functools.partial(flaky_sum, marks=str(tmp_path))
    x = da.arange(1_000, chunks=100)
    total = blockflow.tree_reduce(x, chunk, np.sum, split_every=4, retries=1)
    assert proc_client.compute(total).result() == np.arange(1_000).sum()
    assert attempts(tmp_path, "chunk") == 11  # 10 blocks, one of them twice
    (tmp_path / "chunk").unlink()
    (tmp_path / "chunk.first").unlink()
    # Other blocks, so other keys: the same keys could be served from the first result,
    # which the scheduler may still hold when this graph arrives.
    y = da.arange(1_000, chunks=125)
    with pytest.raises(BlockKernelError) as info:
        proc_client.compute(blockflow.tree_reduce(y, chunk, np.sum, split_every=4)).result()
    assert str(info.value) == (
        "blockflow tree_reduce: chunk function 'flaky_sum' failed: ConnectionResetError: "
        "flaky chunk")


# --- both at once: blockflow's retries= and distributed's task retries -------------------


def fail_times(block, block_id=None, *, marks, times, bad=3):
    """+1, except that block ``bad`` raises on its first ``times`` attempts in the cluster."""
    if block_id == (bad,):
        path = os.path.join(marks, f"block-{bad}")
        with open(path, "a") as f:  # O_APPEND: whole lines, also from several processes
            f.write("x\n")
        if attempts(marks, f"block-{bad}") <= times:
            raise ConnectionResetError(f"flaky read of block {bad}")
    return block + 1


@pytest.mark.parametrize(("ours", "theirs"), [(2, 2), (3, 1), (1, 3)])
def test_map_blocks_and_compute_retries_combine_to_the_larger(proc_client, tmp_path, ours,
                                                              theirs):
    """map_blocks(retries=b) computed with client.compute(retries=d): 1 + max(b, d) attempts
    of a failing block in all, wherever distributed reruns the task; not (1 + b) * (1 + d)
    (9 for 2 and 2, when each of distributed's runs made blockflow's attempts again)."""
    y = blockflow.map_blocks(always_fail, da.arange(60, chunks=10), marks=str(tmp_path),
                             retries=ours)
    with pytest.raises(BlockKernelError) as info:
        proc_client.compute(y, retries=theirs).result()
    total = 1 + max(ours, theirs)
    assert attempts(tmp_path, "block-3") == total
    assert str(info.value) == (
        f"blockflow kernel 'always_fail' failed on block (3,) after {total} attempts: "
        f"ValueError: block 3 is corrupt")


def test_combined_retries_still_rescue_a_block_within_the_larger(proc_client, tmp_path):
    y = blockflow.map_blocks(fail_times, da.arange(60, chunks=10), marks=str(tmp_path),
                             times=2, retries=2)
    result = proc_client.compute(y, retries=2).result()
    np.testing.assert_array_equal(result, np.arange(60) + 1)
    assert attempts(tmp_path, "block-3") == 3
    # a third failure exhausts the 3 attempts of retries=2 (it once had up to 9)
    (tmp_path / "z").mkdir()
    z = blockflow.map_blocks(fail_times, da.arange(60, chunks=10),
                             marks=str(tmp_path / "z"), times=3, retries=2)
    with pytest.raises(BlockKernelError, match=r"after 3 attempts: ConnectionResetError"):
        proc_client.compute(z, retries=2).result()
    assert attempts(tmp_path / "z", "block-3") == 3


def test_tree_reduce_and_compute_retries_combine_to_the_larger(proc_client, tmp_path):
    def corrupt_sum(x, axis=None, keepdims=False):
        if x.size and x.ravel()[0] == 300:  # the block starting at 300
            _attempt(str(tmp_path), "chunk")
            raise ValueError("block is corrupt")
        return np.sum(x, axis=axis, keepdims=keepdims)

    total = blockflow.tree_reduce(da.arange(1_000, chunks=100), corrupt_sum, np.sum,
                                  split_every=4, retries=1)
    with pytest.raises(BlockKernelError) as info:
        proc_client.compute(total, retries=2).result()
    assert attempts(tmp_path, "chunk") == 3
    assert str(info.value) == (
        "blockflow tree_reduce: chunk function 'corrupt_sum' failed after 3 attempts: "
        "ValueError: block is corrupt")


def test_combined_retries_on_a_scheduler_without_blockflow(tmp_path):
    """The same count on plain distributed (no blockflow plugin, threads in one process)."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        y = blockflow.map_blocks(always_fail, da.arange(60, chunks=10), marks=str(tmp_path),
                                 retries=2)
        with pytest.raises(BlockKernelError, match=r"after 3 attempts: ValueError"):
            client.compute(y, retries=2).result()
    assert attempts(tmp_path, "block-3") == 3


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_retries_must_be_a_non_negative_int(bad):
    x = da.ones(4, chunks=2)
    with pytest.raises(ValueError) as info:
        blockflow.map_blocks(np.negative, x, retries=bad)
    assert str(info.value) == (
        f"blockflow.map_blocks: retries must be an integer >= 0 (extra attempts per block), "
        f"got {bad!r}.")
    with pytest.raises(ValueError, match=r"^blockflow.tree_reduce: retries must be"):
        blockflow.tree_reduce(x, np.sum, retries=bad)
    with pytest.raises(ValueError, match=r"^flights: retries must be"):
        flights.run(None, retries=bad)


# --- flights.run and the CLI: distributed's task retries -------------------------------


@pytest.mark.slow
def test_flights_run_retries_a_flaky_partition_on_the_scheduler(proc_client, tmp_path,
                                                                 monkeypatch, record_retries):
    kwargs = dict(scale=1, partitions_per_copy=4, split_every=4, progress=False)
    undisturbed = flights.run(proc_client, **kwargs)
    assert set(record_retries().values()) == {0}  # distributed's default
    forget_earlier_runs(proc_client)
    monkeypatch.setattr(flights, "drop_cancelled",
                        functools.partial(flaky_drop, marks=str(tmp_path)))
    result = flights.run(proc_client, retries=2, output=tmp_path / "out", **kwargs)
    assert attempts(tmp_path, "partition-2") == 2
    for name, table in undisturbed.tables.items():
        pd.testing.assert_frame_equal(result.tables[name], table, check_exact=True)
    seen = record_retries()
    assert seen and set(seen.values()) == {2}, seen  # every task of the run, on the scheduler


@pytest.mark.slow
def test_flights_run_with_a_partition_that_always_fails_writes_nothing(proc_client, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setattr(flights, "drop_cancelled",
                        functools.partial(flaky_drop, marks=str(tmp_path), always=True))
    out = tmp_path / "out"
    with pytest.raises(BlockKernelError) as info:
        flights.run(proc_client, scale=1, retries=1, output=out, progress=False)
    assert str(info.value) == (  # the attempts of all of distributed's runs of the task
        "blockflow kernel 'flaky_drop' failed on partition 2 after 2 attempts: OSError: lost "
        "connection while reading partition 2")
    assert attempts(tmp_path, "partition-2") == 2  # the first try and one retry
    assert sorted(p.name for p in tmp_path.iterdir()) == [  # no output at all
        "partition-2", "partition-2.first"]


@pytest.mark.slow
def test_cli_retries_reach_the_scheduler(proc_client, tmp_path, record_retries):
    address = proc_client.scheduler.address
    out = tmp_path / "out"
    record_retries()
    # Keys no earlier test used (3 partitions): a task still known to the scheduler (an
    # erred run's inputs stay there as "released") keeps the retries it had.
    result = CliRunner().invoke(cli, [
        "run", "flights", "--address", address, "--scale", "1", "--partitions-per-copy", "3",
        "--retries", "3", "--output", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert (out / "by_carrier.parquet").exists()
    seen = record_retries()
    assert seen and set(seen.values()) == {3}, seen


def test_cli_refuses_negative_retries(tmp_path):
    result = CliRunner().invoke(cli, ["run", "flights", "--retries", "-1",
                                      "--output", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "Invalid value for '--retries': -1 is not in the range x>=0." in result.output
