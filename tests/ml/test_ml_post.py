"""Passes submitted ahead of their parameters (blockflow.ml._post, ResidentShards.prepare):
the value posted straight to the waiting tasks, cancellation when blocks move, the
fallback through the graph, and the scheduler plugin leaving the wait out of its speed
model. Real clusters (in-process workers, and worker processes for the trainer)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import dask
import dask.array as da
from distributed import Client, LocalCluster, wait

import blockflow  # noqa: F401  (loads blockflow's settings before gen_cluster copies them)
from blockflow.ml._post import POSTED, Posted, deliver, resolve
from blockflow.ml._shards import ResidentShards

N = 240


def _weighted(blocks, rows, w):
    """Sum over rows of w x the row's value (w posted or literal), and the row count."""
    xs = [b[0] if r is None else b[0][r] for b, r in zip(blocks, rows)]
    return np.array([sum(float((x * w).sum()) for x in xs), sum(len(x) for x in xs)])


@pytest.fixture(scope="module")
def client4():
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


def _shards(client):
    values = np.arange(N, dtype=float)
    return ResidentShards(client, da.from_array(values[:, None], chunks=20),
                          da.zeros(N, chunks=20)), values


def test_resolve_waits_for_the_post_of_its_own_worker():
    p = Posted()
    # a post to another worker's slot (in-process workers share the module) is not ours
    deliver("tcp://b", p.key, 2.0)
    assert resolve("tcp://a", (1, p, 3), timeout=0.05) is None
    threading.Timer(0.05, deliver, ("tcp://a", p.key, 7.0)).start()
    assert resolve("tcp://a", (1, p, 3), timeout=10) == (1, 7.0, 3)
    assert resolve("tcp://b", (p,), timeout=1) == (2.0,)
    q = Posted()
    deliver("tcp://a", q.key, cancel=True)  # a cancel before the task starts holds too
    assert resolve("tcp://a", (q,), timeout=10) is None
    assert resolve("tcp://a", (1, 2), timeout=0) == (1, 2)  # nothing posted: unchanged


def test_a_prepared_pass_runs_on_the_posted_value(client4):
    shards, values = _shards(client4)
    rows = [np.arange(0, 20, 2)] * (N // 20)
    expected = 3.0 * sum(values[j * 20:(j + 1) * 20][::2].sum() for j in range(N // 20))
    ahead = shards.prepare(_weighted, rows, (POSTED,))
    assert ahead is not None and ahead.post is not None
    time.sleep(0.2)  # its tasks are on their workers, waiting
    assert not any(f.done() for f in ahead.futures)
    out = shards.map_sum(_weighted, rows, (POSTED,), posted=3.0, ahead=ahead)
    np.testing.assert_allclose(out, [expected, len(rows) * 10])
    assert not shards._ahead
    # posted as it is submitted (no pass ahead), the same sum
    out = shards.map_sum(_weighted, rows, (POSTED,), posted=3.0)
    np.testing.assert_allclose(out, [expected, len(rows) * 10])
    shards.close()


def test_a_waiting_task_holds_no_thread_of_its_worker(client4):
    shards, _ = _shards(client4)
    ahead = shards.prepare(_weighted, None, (POSTED,))
    # every worker has one thread, each with a task of the pass waiting for its post:
    # other work still runs there
    others = [client4.submit(lambda i: i + 1, i, workers=[a], pure=False)
              for i, a in enumerate(ahead.workers)]
    wait(others, timeout=30)
    assert client4.gather(others) == list(range(1, len(ahead.workers) + 1))
    out = shards.map_sum(_weighted, None, (POSTED,), posted=1.0, ahead=ahead)
    assert out[1] == N
    shards.close()


def test_blocks_that_move_cancel_the_pass_prepared_on_them(client4):
    shards, values = _shards(client4)
    ahead = shards.prepare(_weighted, None, (POSTED,))
    old = dict(shards.placement)
    a, b = sorted(set(old.values()))[:2]
    j = next(j for j, w in old.items() if w == a)
    shards._place({**old, j: b})  # one block moves
    assert not shards._ahead
    # the cancelled tasks returned at once, with nothing
    wait(ahead.futures, timeout=30)
    assert all(f.result()["cancelled"] for f in ahead.futures)
    out = shards.map_sum(_weighted, None, (POSTED,), posted=2.0, ahead=ahead)
    np.testing.assert_allclose(out, [2 * values.sum(), N])
    shards.close()


def test_close_cancels_a_prepared_pass(client4):
    shards, _ = _shards(client4)
    ahead = shards.prepare(_weighted, None, (POSTED,))
    shards.close()
    wait(ahead.futures, timeout=30)
    assert all(f.result()["cancelled"] for f in ahead.futures)


@pytest.mark.parametrize("key", ["blockflow.ml.direct-gather", "blockflow.ml.post-ahead"])
def test_posting_off_sends_the_value_in_the_graph(client4, key):
    with dask.config.set({key: False}):
        shards, values = _shards(client4)
    assert shards.prepare(_weighted, None, (POSTED,)) is None
    ahead = shards.last_ahead
    out = shards.map_sum(_weighted, None, (POSTED,), posted=0.5)
    np.testing.assert_allclose(out, [0.5 * values.sum(), N])
    assert not ahead and not shards.last_ahead and not shards._installed & {"blockflow-post"}
    shards.close()


def _wait_then_work():
    from blockflow._distributed import add_task_wait
    time.sleep(0.6)
    add_task_wait(0.6)  # as a task waiting for its post reports it
    time.sleep(0.05)
    return 1


def _work():
    time.sleep(0.05)
    return 1


def _busy_log(dask_scheduler):
    from blockflow.scheduling import Rebalancer
    plugin = next(p for p in dask_scheduler.plugins.values() if isinstance(p, Rebalancer))
    return [e - s for _, s, e in plugin.task_log]


def test_the_plugin_counts_only_a_tasks_compute_not_its_wait():
    from blockflow.scheduling import Rebalancer
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        client.register_plugin(Rebalancer(policy="dynamic"))
        for f in (_wait_then_work, _work):
            client.submit(f, pure=False).result()
        waited, worked = client.run_on_scheduler(_busy_log)[-2:]
    # the waiting task's busy time is its compute after the wait (0.05 s, not 0.65 s)
    assert 0.04 <= waited < 0.4, waited
    assert 0.04 <= worked < 0.4, worked
