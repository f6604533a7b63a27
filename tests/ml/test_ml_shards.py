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


def _slow_sum_rows(blocks, rows):
    import time
    time.sleep(0.02)
    return _sum_rows(blocks, rows)


@pytest.fixture(scope="module")
def client5():
    with LocalCluster(n_workers=5, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


@pytest.mark.parametrize("split_every", [2, 3, 8])
@pytest.mark.parametrize("direct", [True, False])
def test_the_fan_in_ends_on_the_client_with_every_row_once(client5, split_every, direct):
    values = np.arange(N, dtype=float) ** 2
    with dask.config.set({"blockflow.ml.direct-gather": direct}):
        shards = ResidentShards(client5, da.from_array(values[:, None], chunks=20),
                                da.zeros(N, chunks=20), split_every=split_every)
    assert len(set(shards.placement.values())) == 5
    # the workers' level of the tree leaves at most split_every partial sums to the client
    parts = shards._submit(_sum_rows, None, ()).futures
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
    assert shards._direct is direct
    shards.close()


def test_an_unmeasured_worker_keeps_a_larger_reserve_until_a_pass_measures_it(client5):
    values = np.arange(N, dtype=float)
    shards = ResidentShards(client5, da.from_array(values[:, None], chunks=20),
                            da.zeros(N, chunks=20))
    workers = sorted(set(shards.placement.values()))
    # no pass of this fit has measured anyone: every share follows a prior
    _, peers, _, spr, reserve, timeout = shards._steal_plan(workers)
    assert timeout == shards.peer_timeout == 5.0
    assert peers == workers and spr == {}
    assert reserve == dict.fromkeys(workers, 0.5)
    # a measured pass (long enough to time), no stealing: none gave rows
    assert shards.map_sum(_slow_sum_rows)[1] == N
    _, _, _, spr, reserve, _ = shards._steal_plan(workers)
    assert set(spr) == set(workers)
    assert reserve == dict.fromkeys(workers, 0.2)
    # a worker the fit has not measured (one that joined, say) keeps the larger reserve
    lost = workers[0]
    shards._throughput.forget(lost)
    with dask.config.set({"blockflow.ml.steal-reserve-unmeasured": 0.4}):
        again = ResidentShards(client5, da.from_array(values[:, None], chunks=20),
                               da.zeros(N, chunks=20))
    for a in workers:  # the same measurements
        for units, seconds in shards._throughput.warm_calls(a):
            again._throughput.observe(a, units, seconds)
    reserve = again._steal_plan(workers)[4]
    assert reserve[lost] == 0.4
    assert all(reserve[a] == 0.2 for a in workers if a != lost)
    shards.close()
    again.close()
