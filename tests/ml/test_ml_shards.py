"""A pass's fan-in (blockflow.ml.ResidentShards): the workers sum up to the tree's top level,
the client adds the top level's partial sums as each arrives. Real in-process clusters."""

from __future__ import annotations

import numpy as np
import pytest

import dask
import dask.array as da
from distributed import Client, LocalCluster

from blockflow.ml._shards import ResidentShards

N = 300


def _sum_rows(blocks, rows):
    xs = [b[0] if r is None else b[0][r] for b, r in zip(blocks, rows)]
    return np.array([sum(float(x.sum()) for x in xs), sum(len(x) for x in xs)])


@pytest.fixture(scope="module")
def client5():
    with LocalCluster(n_workers=5, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


@pytest.mark.parametrize("split_every", [2, 3, 8])
def test_the_fan_in_ends_on_the_client_with_every_row_once(client5, split_every):
    values = np.arange(N, dtype=float) ** 2
    shards = ResidentShards(client5, da.from_array(values[:, None], chunks=20),
                            da.zeros(N, chunks=20), split_every=split_every)
    assert len(set(shards.placement.values())) == 5
    # the workers' level of the tree leaves at most split_every partial sums to the client
    parts = shards._submit(_sum_rows, None, ())
    top = 5
    while top > split_every:
        top = -(-top // split_every)
    assert len(parts) == top <= split_every
    del parts
    subset = [np.arange(0, 20, 7)] * (N // 20)
    for rows, want in ((None, [values.sum(), N]),
                       (subset, [values.reshape(-1, 20)[:, ::7].sum(), 3 * N // 20])):
        np.testing.assert_allclose(shards.map_sum(_sum_rows, rows), want)
        assert sum(shards.last_rows.values()) == want[1]
        assert len(shards.last_seconds) == 5  # every worker's timing reached the client
    shards.close()


def test_one_rank_per_process_places_blocks_on_one_worker_of_each_process(client5):
    """In-process workers share one process: torch.distributed holds one rank per process,
    so the trainer's shards go to one of them."""
    shards = ResidentShards(client5, da.ones((N, 2), chunks=20), da.zeros(N, chunks=20),
                            one_per_process=True)
    assert len(set(shards.placement.values())) == 1
    shards.close()


def test_a_block_larger_than_any_worker_is_refused_before_anything_runs():
    X = da.zeros((40_000, 8), chunks=(20_000, 8))  # 1.2 MiB blocks of X and y
    y = da.zeros(40_000, chunks=20_000)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      memory_limit="1MiB", dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        [a, b] = sorted(cluster.scheduler.workers)
        with pytest.raises(MemoryError) as e:
            ResidentShards(client, X, y)
        assert str(e.value) == (
            f"blockflow: block 0 (rows 0-19,999, 1.37 MiB of X and y) is larger than any "
            f"worker's memory (the largest is {b}'s 1.00 MiB host memory limit), so the "
            f"worker holding it would be killed; cut the rows into smaller blocks, e.g. "
            f"X.rechunk({{0: 1820}}) and y.rechunk(1820), or give the workers more memory "
            f"(memory_limit=).")
        assert not cluster.scheduler.tasks  # nothing was submitted


def _kill_worker(block):
    import os
    os._exit(1)


@pytest.mark.slow
def test_a_block_that_kills_its_worker_is_named_not_an_internal_key():
    from blockflow.errors import WorkerLostError

    X = da.zeros((400, 4), chunks=(100, 4))
    X = X.map_blocks(lambda b, block_id=None: _kill_worker(b) if block_id[0] == 2 else b,
                     dtype=X.dtype)
    y = da.zeros(400, chunks=100)
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                         dashboard_address=":0") as cluster, Client(cluster) as client:
        with pytest.raises(WorkerLostError) as e:
            ResidentShards(client, X, y)
    message = str(e.value)
    # the tasks on the worker that died fail with it (allowed-failures 0): block 2 is named
    # among them, by index and rows, never by an internal key
    assert message.startswith("blockflow: workers died while loading block"), message
    assert "2 (rows 200-299" in message, message
    assert message.endswith("check the worker logs, use smaller blocks (X.rechunk({0: "
                            "rows})) or give the workers more memory (memory_limit=)."), message
    assert "lambda" not in message and "_pair" not in message and "finalize" not in message
