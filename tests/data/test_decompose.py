"""Skew-aware blocks and block sizing for devices (blockflow.decompose, blockflow.block_sizing), on real clusters.

Property tests (hypothesis) check that re-cutting blocks never changes values or their order
(arrays of any dtype, dataframes with empty partitions); the rest checks the rules (5x the
median, the floor, merging, the opt-out setting), fitting blocks to simulated device memory,
and map_blocks' automatic modes.
"""

from __future__ import annotations

import logging

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client, LocalCluster, wait
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blockflow
from blockflow.scheduling.view import workers_info
from blockflow.block_sizing import fit_blocks
from blockflow.decompose import recorded_resizes, split_skewed
from blockflow.testing import set_tenant, simulated_cluster

GiB, MiB = 2**30, 2**20

DTYPES = ["int8", "uint16", "int64", "float32", "float64", "complex64", "bool",
          "datetime64[ns]", "U3"]


def _values(n: int, dtype: str) -> np.ndarray:
    base = np.arange(n)
    if dtype == "bool":
        return base % 3 == 0
    if dtype.startswith("datetime"):
        return base.astype("datetime64[ns]")
    if dtype == "U3":
        return np.array([str(i % 1000) for i in base], dtype="U3")
    return base.astype(dtype)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(0, 60), min_size=1, max_size=25),
       dtype=st.sampled_from(DTYPES), factor=st.floats(1.5, 8),
       merge_below=st.floats(0, 0.9), width=st.integers(1, 3))
def test_split_and_merge_keep_array_values_and_order(sizes, dtype, factor, merge_below, width):
    if sum(sizes) == 0:
        sizes = sizes + [1]
    values = np.stack([_values(sum(sizes), dtype)] * width, axis=1)
    x = da.from_array(values, chunks=(tuple(sizes), width))
    y, change = split_skewed(x, factor=factor, floor=0, merge_below=merge_below)
    np.testing.assert_array_equal(y.compute(scheduler="sync"), values)
    assert y.dtype == x.dtype and y.shape == x.shape and y.chunks[1] == x.chunks[1]
    if change is None:
        assert y is x
        return
    assert change.before == tuple(sizes) and change.after == y.chunks[0]
    med = float(np.median([s for s in sizes if s]))
    target = max(med, sum(sizes) / len(sizes))
    kept = [s for s in sizes if s <= factor * med]
    # every skewed block is cut to about the target; nothing grows beyond a kept block
    assert max(y.chunks[0]) <= max([int(np.ceil(target))] + kept)


def _frame(n: int) -> pd.DataFrame:
    return pd.DataFrame({"i": np.arange(n), "x": np.arange(n) * 0.5,
                         "s": [f"r{i}" for i in range(n)]},
                        index=pd.RangeIndex(n, name="row"))


def _dask_frame(pdf: pd.DataFrame, lengths) -> dd.DataFrame:
    bounds = np.cumsum([0] + list(lengths))
    parts = [dask.delayed(pdf.iloc[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return dd.from_delayed(parts, meta=pdf.iloc[:0], verify_meta=False)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=12),
       factor=st.floats(1.5, 6), merge_below=st.floats(0, 0.9))
def test_split_and_merge_keep_dataframe_rows_and_order(lengths, factor, merge_below):
    pdf = _frame(sum(lengths))
    df = _dask_frame(pdf, lengths)
    out, change = split_skewed(df, factor=factor, floor=0, merge_below=merge_below,
                               lengths=lengths)
    got = out.compute(scheduler="sync")
    pd.testing.assert_frame_equal(got, pdf, check_index_type=False)
    if change is None:
        assert out is df
        return
    assert out.npartitions == len(change.after)
    assert tuple(out.map_partitions(len).compute(scheduler="sync")) == change.after
    assert change.kind == "dataframe" and change.before == tuple(lengths)


def test_the_5x_rule_splits_only_blocks_above_five_times_the_median():
    at = da.ones(140, chunks=((10,) * 9 + (50,),))
    assert split_skewed(at, floor=0)[1] is None  # 50 = 5 x the median 10: not skewed
    above = da.ones(141, chunks=((10,) * 9 + (51,),))
    y, change = split_skewed(above, floor=0)
    # target: the larger of the median (10) and the mean (14.1): 51 rows in 4 even pieces
    assert y.chunks[0] == (10,) * 9 + (13, 13, 13, 12)
    assert (change.split, change.merged, change.reason) == (1, 0, "skew")
    assert change.before_bytes[-1] == 51 * 8 and max(change.after_bytes) == 13 * 8


def _zipf(partitions: int, exponent: float, total: int, seed: int = 14) -> list[int]:
    """Partition lengths after a shuffle on Zipf-distributed keys (largest remainders)."""
    weights = 1.0 / np.arange(1, partitions + 1) ** exponent
    exact = weights / weights.sum() * total
    rows = np.floor(exact).astype(int)
    rows[np.argsort(exact - rows)[::-1][: total - rows.sum()]] += 1
    np.random.default_rng(seed).shuffle(rows)
    return [int(r) for r in rows]


@pytest.mark.parametrize("partitions,exponent", [(64, 1.2), (64, 1.0), (128, 1.1),
                                                 (32, 1.2), (16, 1.0)])
def test_a_skewed_collections_largest_piece_is_within_the_bound(partitions, exponent):
    """Zipf-skewed keys, 64 partitions: the 5x rule split the 8 largest partitions but kept
    one of 13,404 rows (4.7x the median 2,872: not skewed) against a target of 10,000, so
    the stage's largest piece was 1.34x the balanced one. Once the collection is skewed,
    every block above blockflow.skew.max-piece (1.25) x the target is cut too."""
    lengths = _zipf(partitions, exponent, partitions * 10_000)
    x = da.ones(sum(lengths), chunks=(tuple(lengths),))
    y, change = split_skewed(x, floor=0)
    assert change is not None and sum(y.chunks[0]) == sum(lengths)
    assert max(y.chunks[0]) <= 1.25 * 10_000
    with dask.config.set({"blockflow.skew.max-piece": 2.0}):  # the 5x rule alone
        loose = split_skewed(x, floor=0)[0]
    assert max(loose.chunks[0]) <= 2.0 * 10_000


def test_blocks_near_the_target_are_kept_when_nothing_is_skewed():
    # a block at 1.4x the mean but only 1.9x the median: not skewed, nothing re-cut
    x = da.ones(1000, chunks=((140,) + (95,) * 9 + (5,),))
    assert split_skewed(x, floor=0, merge_below=0)[1] is None
    with dask.config.set({"blockflow.skew.max-piece": 0.5}):
        with pytest.raises(ValueError, match=r"^blockflow.skew.max-piece must be at least 1, "
                                             r"got 0.5; it is the largest piece"):
            split_skewed(x, floor=0)


def test_the_floor_keeps_small_skewed_blocks():
    x = da.ones(141, chunks=((10,) * 9 + (51,),))  # the big block holds 408 bytes
    assert split_skewed(x, floor=408)[1] is None
    assert split_skewed(x, floor="400B")[1] is not None
    with dask.config.set({"blockflow.skew.floor": "1KiB"}):
        assert split_skewed(x)[1] is None


def test_runs_of_tiny_blocks_are_merged():
    x = da.arange(3020, chunks=((100,) * 15 + (1,) * 20 + (100,) * 15,))  # median 100
    y, change = split_skewed(x, floor=0)
    assert y.chunks[0] == (100,) * 15 + (20,) + (100,) * 15
    assert (change.split, change.merged) == (0, 20)
    np.testing.assert_array_equal(y.compute(scheduler="sync"), np.arange(3020))
    # a collection below the floor is left alone; merge_below=0 never merges
    assert split_skewed(x, floor="1MiB")[1] is None
    assert split_skewed(x, floor=0, merge_below=0)[1] is None


def test_empty_partitions_are_merged_with_their_tiny_neighbours():
    lengths = [0, 0, 0, 50, 40, 0, 0, 60]
    pdf = _frame(sum(lengths))
    out, change = split_skewed(_dask_frame(pdf, lengths), floor=0, lengths=lengths)
    assert change.after == (0, 50, 40, 0, 60)
    pd.testing.assert_frame_equal(out.compute(scheduler="sync"), pdf, check_index_type=False)


def test_merging_alone_keeps_known_divisions_and_splitting_makes_them_unknown():
    pdf = _frame(1000)
    merged_only = dd.from_pandas(pdf, npartitions=1).repartition(
        divisions=[0, 300, 600, 601, 602, 603, 999])
    out, change = split_skewed(merged_only, floor=0, lengths=[300, 300, 1, 1, 1, 397])
    assert change.split == 0 and out.known_divisions
    assert out.divisions == (0, 300, 600, 603, 999)
    pd.testing.assert_frame_equal(out.compute(scheduler="sync"),
                                  merged_only.compute(scheduler="sync"))
    skewed = dd.from_pandas(pdf, npartitions=1).repartition(divisions=[0, 10, 20, 30, 999])
    out, change = split_skewed(skewed, floor=0, lengths=True)
    assert change.split == 1 and not out.known_divisions
    pd.testing.assert_frame_equal(out.compute(scheduler="sync"),
                                  skewed.compute(scheduler="sync"))


def test_dataframe_lengths_are_used_only_when_cheap(client):
    pdf = _frame(2000)
    lengths = [1500] + [50] * 10
    df = _dask_frame(pdf, lengths)
    assert split_skewed(df, floor=0) == (df, None)  # unknown lengths: no extra pass
    persisted = df.persist()  # sized by the bytes the scheduler holds: no task runs
    wait(persisted)
    out, change = split_skewed(persisted, floor=0)
    assert change.unit == "bytes" and len(change.before) == 11 and change.split == 1
    assert change.before[0] > 5 * max(change.before[1:])  # 1,500 rows vs 50 (+ overhead)
    assert "(largest " in change.summary() and " rows" not in change.summary()
    pd.testing.assert_frame_equal(out.compute(), pdf, check_index_type=False)
    lengths_out = out.map_partitions(len).compute().tolist()
    assert sum(lengths_out) == 2000 and max(lengths_out) < 1500
    from_pandas = dd.from_pandas(pdf, npartitions=4)
    assert split_skewed(from_pandas, floor=0)[1] is None  # known (500 each), not skewed


def test_xarray_is_re_cut_along_its_chunked_dimension():
    xr = pytest.importorskip("xarray")
    obj = xr.Dataset({"v": (("t", "y"), np.arange(1410.0).reshape(141, 10))},
                     coords={"t": np.arange(141)}).chunk({"t": (10,) * 9 + (51,)})
    out, change = split_skewed(obj, floor=0)
    assert change.axis == "t" and out.chunksizes["t"] == (10,) * 9 + (13, 13, 13, 12)
    xr.testing.assert_identical(out.compute(), obj.compute())


def test_bad_settings_name_the_fix():
    x = da.ones(10, chunks=5)
    with pytest.raises(ValueError, match=r"^blockflow.split_skewed: factor must be above 1, "
                                         r"got 1.0; a block is skewed when larger than factor "
                                         r"x the median, e.g. 5.$"):
        split_skewed(x, factor=1)
    with pytest.raises(ValueError, match=r"lengths gives 2 lengths for 1 partitions; give one "
                                         r"per partition"):
        split_skewed(dd.from_pandas(_frame(3), npartitions=1), lengths=[1, 2])
    with pytest.raises(TypeError, match="expected a Dask array, dataframe or chunked xarray"):
        split_skewed(np.ones(3))


def _double(block):
    return block * 2


def test_map_blocks_splits_skewed_blocks_unless_turned_off(client, caplog):
    x = da.arange(1410, chunks=((100,) * 9 + (510,),))
    with dask.config.set({"blockflow.skew.floor": "1KiB"}):
        with caplog.at_level(logging.INFO, logger="blockflow.decompose"):
            y = blockflow.map_blocks(_double, x, name="skewed")
        assert len(y.chunks[0]) == 9 + 4  # 510 rows (4,080 bytes) in pieces of ~141
        np.testing.assert_array_equal(y.compute(), np.arange(1410) * 2)
        change = recorded_resizes()[-1]
        assert change.label == "blockflow-skewed" and change.after == y.chunks[0]
        assert "skew for blockflow-skewed: split 1 block along axis 0: 10 blocks (largest " \
               "510 rows, 3.98 kiB; median 100 rows, 800 B) -> 13 blocks" in caplog.text
        with dask.config.set({"blockflow.skew.enabled": False}):
            assert blockflow.map_blocks(_double, x).chunks == x.chunks
        # output chunks declared: the input's blocks are kept
        assert blockflow.map_blocks(_double, x, chunks=x.chunks).chunks == x.chunks
    assert blockflow.map_blocks(_double, x).chunks == x.chunks  # below the default floor


def test_map_blocks_recuts_every_aligned_argument_alike(client):
    x = da.arange(1410, chunks=((100,) * 9 + (510,),))
    w = da.ones((3, 1410), chunks=(3, x.chunks[0]))
    with dask.config.set({"blockflow.skew.floor": 0}):
        y = blockflow.map_blocks(np.add, w, x)
    assert y.chunks[1] == (100,) * 9 + (128, 128, 127, 127)
    np.testing.assert_array_equal(y.compute(), np.ones((3, 1410)) + np.arange(1410))


def _rows(part):
    return part.assign(n=len(part))


def test_pieces_of_a_persisted_partition_go_to_the_least_loaded_workers(client):
    a, b = sorted(workers_info(client))
    pdf = _frame(2000)
    df = _dask_frame(pdf, [1500] + [50] * 10).persist(workers=[a])  # all on one worker
    wait(df)
    out, change = split_skewed(df, floor=0)
    cut = len(change.after) - 10  # partition 0's pieces come first
    assert cut > 1
    held = out.persist()
    wait(held)
    holders = client.who_has(held)
    where = [ws for _, ws in sorted((k[1], ws) for k, ws in holders.items())]  # by partition
    assert b in {w for ws in where[:cut] for w in ws}  # b held nothing: it takes pieces
    assert {w for ws in where[cut:] for w in ws} == {a}  # the others stay where they were
    pd.testing.assert_frame_equal(held.compute(), pdf, check_index_type=False)


def test_map_blocks_splits_a_persisted_skewed_dataframe(client):
    pdf = _frame(2000)
    df = _dask_frame(pdf, [1500] + [50] * 10).persist()
    wait(df)
    with dask.config.set({"blockflow.skew.floor": 0}):
        out = blockflow.map_blocks(_rows, df)
    got = out.compute()
    assert got.n.max() < 1500 and out.npartitions > 11
    pd.testing.assert_frame_equal(got.drop(columns="n"), pdf, check_index_type=False)


def test_partitions_skewed_by_a_shuffle_are_cut_to_a_fraction_of_each_threads_share():
    """Issue 39: after a shuffle on a Zipf key, 8 partitions on 8 threads held up to 2.5x a
    thread's share of the rows; none was 5x the median, so nothing was split and the stage
    took the largest partition's time. Sizes known once the shuffle is persisted are read,
    and every piece the stage runs is at most (max-piece - 1) x a thread's share."""
    rng = np.random.default_rng(0)
    n, parts = 40_000, 8
    weights = 1.0 / np.arange(1, 201) ** 1.2
    pdf = pd.DataFrame({"key": rng.choice(200, size=n, p=weights / weights.sum()),
                        "x": np.arange(n) * 0.5})
    with LocalCluster(n_workers=2, threads_per_worker=4, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster):
        shuffled = dd.from_pandas(pdf, npartitions=parts, sort=False).shuffle(
            on="key", npartitions=parts).persist()
        wait(shuffled)
        lengths = shuffled.map_partitions(len).compute().tolist()
        share = n / 8  # 8 threads
        assert max(lengths) > 1.25 * share  # the shuffle made one partition dominate
        with dask.config.set({"blockflow.skew.floor": 0}):
            got = blockflow.map_blocks(_rows, shuffled).compute()
            balanced = dd.from_pandas(pdf, npartitions=parts, sort=False).persist()
            wait(balanced)
            assert split_skewed(balanced)[1] is None  # even partitions: left as they are
    assert got.n.max() <= 0.25 * share * 1.05  # 5 %: pieces are cut by bytes, not rows
    pd.testing.assert_frame_equal(got.drop(columns="n").sort_index(), pdf)


def test_run_report_lists_the_blocks_re_cut():
    import time

    client = blockflow.connect(gpu=False, n_workers=1, threads_per_worker=2, processes=False,
                               dashboard_address="127.0.0.1:0")
    try:
        t0 = time.time()
        x = da.arange(1410, chunks=((100,) * 9 + (510,),))
        with dask.config.set({"blockflow.skew.floor": 0}):
            blockflow.map_blocks(_double, x, name="reported").sum().compute()
        report = blockflow.run_report(client, since=t0)
        assert [c.label for c in report.block_changes] == ["blockflow-reported"]
        assert "blocks re-cut: skew for blockflow-reported: split 1 block" in repr(report)
        assert "Blocks re-cut before blockwise stages" in report._repr_html_()
        later = blockflow.run_report(client, since=time.time())
        assert later.block_changes == []
    finally:
        client.shutdown()
        client.close()


def test_fit_blocks_without_a_cluster_changes_nothing():
    from distributed import default_client

    with pytest.raises(ValueError):
        default_client()  # no client in this test
    x = da.ones(10, chunks=5)
    assert fit_blocks(x, 100) == (x, None)


def test_fit_blocks_on_cpu_workers_uses_host_memory(client):
    limit = min(w["memory_limit"] for w in workers_info(client).values())
    rows = int(limit // (8 * 1024)) * 2  # blocks twice the host memory limit
    x = da.ones((rows, 1024), chunks=(rows, 1024))
    y, change = fit_blocks(x, 0, client=client)
    assert max(y.chunks[0]) * 8 * 1024 <= 0.8 * limit and change is not None


def test_map_blocks_keeps_blocks_on_cpu_only_clusters_and_says_working_set_is_unused(client):
    x = da.ones((4096, 1024), chunks=(4096, 1024))
    with pytest.warns(blockflow.BlockflowWarning) as caught:
        y = blockflow.map_blocks(_double, x, working_set=lambda n: 10**15)
    assert y.chunks == x.chunks
    n = len(workers_info(client))
    assert [str(w.message) for w in caught] == [
        f"blockflow.map_blocks: working_set= is the device (GPU) memory a block needs, and "
        f"none of the cluster's {n} workers has a GPU, so it is not applied (blocks are "
        f"neither placed nor split by it; host memory is managed by the workers' "
        f"memory_limit and spilling): drop working_set= on CPU clusters, or run on GPU "
        f"workers."]


# -- fitting blocks to device memory -------------------------------------------------------

def _by_name(client) -> list[str]:
    workers = workers_info(client)
    return sorted(workers, key=lambda a: int(workers[a]["name"]))


async def _heartbeat(dask_worker):
    await dask_worker.heartbeat()


@pytest.fixture(scope="module")
def devices():
    """Two simulated GPUs of 1 GiB and 4 GiB (the smallest decides)."""
    with simulated_cluster(speeds=(1, 1), device_memory=["1GiB", "4GiB"],
                           processes=False) as client:
        yield client


def test_fit_blocks_fits_block_and_working_set_in_the_smallest_free_device_memory(devices):
    x = da.ones((2**17, 1024), chunks=(2**16, 1024))  # 8 KiB rows, 512 MiB blocks
    y, change = fit_blocks(x, lambda nbytes: 2 * nbytes, client=devices)
    budget = 0.8 * GiB  # 1 GiB free x (1 - safety 0.2)
    assert max(y.chunks[0]) * 8 * 1024 * 3 <= budget
    assert (max(y.chunks[0]) + 1) * 8 * 1024 * 3 > budget / 2  # not cut needlessly small
    assert change.reason == "fit-device-memory" and change.split == 2
    assert sum(y.chunks[0]) == 2**17
    # blocks that fit are left alone
    assert fit_blocks(x, 0, client=devices, safety=0.5) == (x, None)
    # another process takes 600 MiB of the small device: smaller blocks fit its free memory
    small = _by_name(devices)[0]
    devices.run(set_tenant, (0, 600 * MiB), workers=[small])
    devices.run(_heartbeat)
    try:
        z, _ = fit_blocks(x, lambda nbytes: 2 * nbytes, client=devices)
        assert max(z.chunks[0]) * 8 * 1024 * 3 <= 0.8 * 424 * MiB
    finally:
        devices.run(set_tenant, None, workers=[small])
        devices.run(_heartbeat)


def test_fit_blocks_says_when_no_block_fits(devices):
    x = da.ones((1024, 1024), chunks=(512, 1024))  # split along axis 1: rows of 512 x 8 B
    with pytest.raises(ValueError) as info:
        fit_blocks(x, "2GiB", client=devices)
    assert str(info.value) == (
        "blockflow.fit_blocks: even a one-row block (4.00 kiB) with its working set "
        "(2.00 GiB) exceeds 80% of the smallest worker's free device memory (1.00 GiB); "
        "lower the working set, the safety margin (blockflow.blocks.safety), or use workers "
        "with more memory.")


def test_map_blocks_fits_blocks_to_device_memory_when_the_working_set_is_known(devices):
    x = da.ones((4096, 1024), chunks=(4096, 1024))  # one 32 MiB block
    y = blockflow.map_blocks(_double, x, working_set=lambda nbytes: 40 * nbytes)
    # 41 x 32 MiB > 0.8 GiB: two blocks of 2,048 rows (41 x 16 MiB fits)
    assert y.chunks[0] == (2048, 2048)
    np.testing.assert_array_equal(y.sum().compute(), 2 * 4096 * 1024)
    assert recorded_resizes()[-1].reason == "fit-device-memory"
    with dask.config.set({"blockflow.blocks.fit-device-memory": False}):
        assert blockflow.map_blocks(_double, x, working_set=lambda n: 40 * n).chunks == x.chunks
    # a constant working set no split can fit is left to the run time (DeviceMemoryError)
    assert blockflow.map_blocks(_double, x, working_set="2GiB").chunks == x.chunks
