"""Work stealing inside a pass (blockflow.ml._steal) on real clusters.

A slow worker's rows that it has not started go to idle peers, worker to worker; every row
is still processed exactly once, so the pass's sum (and a training step's gradient) is
unchanged. No part of Dask is mocked.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

import dask.array as da
from distributed import Client, LocalCluster, get_worker
from distributed.utils_test import gen_cluster
from loadaware import scaled

from blockflow.ml._shards import ResidentShards
from blockflow.ml._steal import RowPool, rows_to_give
from blockflow.scheduling.estimate import call_cost

N = 240


def test_rows_to_give_makes_owner_and_thief_finish_together():
    # 1 s left at 10 ms a row (100 rows), an equal thief: half each
    assert rows_to_give(1.0, 100, 0.01, 0.01, 0.0) == 50
    # a thief 10x slower takes fewer rows: both end at ~0.91 s
    r = rows_to_give(1.0, 100, 0.01, 0.1, 0.0)
    assert r == 9 and abs((1.0 - 0.01 * r) - 0.1 * r) < 0.11
    # the round trip counts against the thief
    assert rows_to_give(1.0, 100, 0.01, 0.01, 0.5) == 25
    # not one row would end earlier at the thief
    assert rows_to_give(0.015, 1, 0.01, 0.01, 0.0) == 0
    assert rows_to_give(0.5, 0, 0.01, 0.01, 0.0) == 0
    # nothing timed, no prior: an even split; the thief's unknown rate is the owner's
    assert rows_to_give(float("inf"), 9, None, None, 0.0) == 4
    assert rows_to_give(1.0, 100, 0.01, None, 0.0) == 50
    # never more than the rows not started
    assert rows_to_give(10.0, 7, 0.01, 0.001, 0.0) == 7


def test_call_cost_is_the_part_of_a_call_that_does_not_shrink_with_its_rows():
    # every call 30 ms + 2 ms a row
    calls = [(n, 0.03 + 0.002 * n) for n in (80, 10, 6, 4)]
    assert call_cost(calls) == pytest.approx(0.03)
    assert call_cost([(80, 0.19), (20, 0.04)]) == pytest.approx(0.0)  # no fixed part
    assert call_cost([(80, 0.19)]) is None  # one call: nothing to compare
    # a small call faster per row than the first (noise) gives 0, not a negative cost
    assert call_cost([(80, 0.2), (10, 0.01)]) == 0.0


def test_row_pool_hands_out_every_row_once_under_concurrent_thieves():
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 30, size=40)
    blocks = [(np.arange(s, dtype=float)[:, None] + 1000 * j, np.zeros(s))
              for j, s in enumerate(sizes)]
    rows = [rng.permutation(s)[: rng.integers(0, s + 1)] if s else np.arange(0)
            for s in sizes]
    rows[3] = None  # all rows of block 3
    pool = RowPool(blocks, rows, chunks=16, prior_spr=1e-4)
    spans, lock = [], threading.Lock()

    def owner():
        while (span := pool.take_front()) is not None:
            time.sleep(1e-4 * (span[1] - span[0]))
            pool.finished(span[1] - span[0], 1e-4 * (span[1] - span[0]))
            with lock:
                spans.append(span)
        pool.close()

    def thief(spr):
        while True:
            span = pool.give(spr, 0.0)
            if span is None:
                if pool.back <= pool.front:
                    return
                time.sleep(1e-4)
                continue
            with lock:
                spans.append(span)

    threads = [threading.Thread(target=owner)] + [
        threading.Thread(target=thief, args=(s,)) for s in (1e-5, 1e-4, 1e-3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    covered = np.zeros(pool.n, int)
    for lo, hi in spans:
        covered[lo:hi] += 1
    assert (covered == 1).all()
    assert pool.given > 0
    # the spans map back to exactly the pass's (block, row) pairs
    got = sorted((int(x[0]) for lo, hi in spans
                  for (xb, _), r in zip(*pool.parts(lo, hi)) for x in xb[r]))
    want = sorted(int(x[0]) for (xb, _), r in zip(blocks, rows)
                  for x in (xb if r is None else xb[r]))
    assert got == want


def _timed_pool(n, reserve=0.2, fixed=0.0):
    blocks = [(np.arange(n, dtype=float)[:, None], np.zeros(n))]
    pool = RowPool(blocks, [None], chunks=16, prior_spr=1.0, reserve=reserve, fixed=fixed)
    lo, hi = pool.take_front()
    return pool, hi - lo


def _target_in(pool, peers):
    """``pool.set_target(peers)``; the target as seconds from the call, bracketed by the
    clock before and after it (no bound on how long the call itself took)."""
    before = time.perf_counter()
    pool.set_target(peers)
    after = time.perf_counter()
    return pool.target - after, pool.target - before


# The rates below are seconds per row, so that the rows an owner can fit before its target
# have margins of a second or so: the outcomes do not depend on how long the test thread
# waits for a core between two lines.


def test_an_owner_on_time_runs_its_reserve_in_one_more_call():
    pool, first = _timed_pool(100)
    assert first == 80  # all but the reserve (a fifth)
    pool.finished(first, 80.0)  # 1 s a row, as expected
    # three peers, each with 20 s left at 1 s a row: the rows left (20 + 3 x 20) over four
    # equal workers end the pass in 20 s, when this owner's 20 rows end too
    lo_s, hi_s = _target_in(pool, [{"left": 20.0, "rows": 20, "spr": 1.0}] * 3)
    assert lo_s <= 20.0 <= hi_s + 1e-9
    lo, hi = pool.take_front()
    assert hi - lo == 20 and pool.back == pool.front  # one call, nothing left


def test_a_late_owner_leaves_its_excess_for_its_peers():
    pool, first = _timed_pool(100)
    pool.finished(first, 160.0)  # 2 s a row: twice as slow as planned
    # three peers with 20 s left at 1 s a row: balanced, the pass ends in (20 + 3 x 20)
    # rows / (0.5 + 3 x 1) rows per second = 22.9 s, so this owner runs the 11 rows it can
    # finish by then and leaves the other 9 at the back for its peers
    lo_s, hi_s = _target_in(pool, [{"left": 20.0, "rows": 20, "spr": 1.0}] * 3)
    assert lo_s <= 80 / 3.5 <= hi_s + 1e-9
    lo, hi = pool.take_front()
    assert (lo, hi) == (80, 91)
    assert pool.back - pool.front == 9
    span = pool.give(1.0, 0.0)  # a peer takes rows not started, from the back
    assert span is not None and span[1] == 100
    # three peers about done: the pass ends in (20 + 3) / 3.5 = 6.6 s, 3 of its rows;
    # it still runs at least 1/16 of its rows (7) in a call
    pool, _ = _timed_pool(100)
    pool.finished(80, 160.0)
    _target_in(pool, [{"left": 1.0, "rows": 0, "spr": 1.0}] * 3)
    lo, hi = pool.take_front()
    assert 1 <= hi - lo <= 7 and hi - lo == pool.min_chunk == 7, (lo, hi)
    assert pool.back - pool.front >= 13
    # peers without a rate (not started) or done ones without one are left out
    pool2, _ = _timed_pool(100)
    pool2.finished(80, 80.0)
    lo_s, hi_s = _target_in(pool2, [{"left": 0.0, "rows": 0},
                                    {"left": float("inf"), "rows": 9}])
    assert lo_s <= 20.0 <= hi_s + 1e-9


def test_an_owners_fixed_cost_per_call_counts_in_its_time_left():
    pool, first = _timed_pool(100, fixed=5.0)
    pool.finished(first, 80.0)
    st = pool.status()  # 20 rows not started at 1 s a row, plus one more call's 5 s
    assert st["rows"] == 20 and st["left"] == pytest.approx(25.0)
    # alone, it ends in 25 s; its next call (5 s fixed) then fits all 20 rows
    _target_in(pool, [])
    lo, hi = pool.take_front()
    assert hi - lo == 20


def test_past_the_target_or_without_one_the_reserve_halves():
    pool, first = _timed_pool(160)
    pool.finished(first, 1.28)
    lo, hi = pool.take_front()  # no target (no peer asked): half of the 32 rows left
    assert hi - lo == 16
    pool.finished(16, 0.16)
    pool.target = time.perf_counter() - 1.0  # past it
    lo, hi = pool.take_front()
    assert hi - lo == 10 and pool.back - pool.front == 6  # half, at least 1/16 of 160
    lo, hi = pool.take_front()
    assert hi - lo == 6


def _sum_rows(blocks, rows, slow):
    """Sum of row values and count; worker named ``slow`` takes 20 ms a row, others 1 ms."""
    n = sum(len(b[0]) if r is None else len(r) for b, r in zip(blocks, rows))
    s = sum(float((b[0] if r is None else b[0][r]).sum()) for b, r in zip(blocks, rows))
    time.sleep(n * (20e-3 if str(get_worker().name) == str(slow) else 1e-3))
    return np.array([s, n])


@pytest.mark.parametrize("processes", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_pass_that_steals_sums_every_row_once(processes):
    values = np.arange(N, dtype=float) ** 2
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=processes,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        X = da.from_array(values[:, None], chunks=10)
        y = da.zeros(N, chunks=10)
        shards = ResidentShards(client, X, y, sharding="equal")
        slow = next(a for a, w in client.scheduler_info()["workers"].items()
                    if str(w["name"]) == "2")
        held = shards.rows_per_worker()
        assert held[slow] == N // 3
        subset = [np.arange(0, 10, 3)] * (N // 10)
        for i, rows in enumerate((None, None, None, subset)):
            total = shards.map_sum(_sum_rows, rows, (2,), steal=True)
            want = values.reshape(-1, 10)[:, ::3].sum() if rows else values.sum()
            n = N if rows is None else 4 * (N // 10)
            np.testing.assert_allclose(total, [want, n])
            assert sum(shards.last_rows.values()) == n
            assert shards.last_stolen[slow] == 0
            if i == 0:
                # nothing is known of any worker's speed yet: the slow one's rate is only
                # bounded by its first chunk's time so far, and it may give little
                continue
            # the 20x slower worker gave rows it had not started to the others: its
            # reserve (a fifth) once its rate is known, then, having been behind, up to
            # two thirds
            assert sum(shards.last_stolen.values()) > 0, (i, shards.last_rows)
            assert shards.last_rows[slow] < (0.9 if i == 1 else 0.6) * n / 3, (
                i, shards.last_rows)
        # without stealing each worker sums exactly its own rows
        total = shards.map_sum(_sum_rows, None, (2,))
        np.testing.assert_allclose(total, [values.sum(), N])
        assert shards.last_rows[slow] == N // 3
        assert not any(shards.last_stolen.values())
        shards.close()


def test_a_pass_steals_only_where_a_peer_is_registered():
    """Without the worker plugin (a pass that does not steal never installs it), a chunked
    pass still processes every row, on its own worker."""
    from blockflow.ml._passes import _run_shard

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        blocks = [(np.arange(20.)[:, None], np.zeros(20))]
        peers = sorted(client.scheduler_info()["workers"])
        out = client.submit(_run_shard, _sum_rows, blocks, [None], (None,),
                            ("p", peers, 16, {}), pure=False).result()
        np.testing.assert_allclose(out["value"], [190.0, 20])
        assert list(out["stolen"].values()) == [0]


def test_rows_lost_in_a_failed_hand_over_redo_the_pass(monkeypatch):
    """A peer hands rows over, then its reply fails (here: the rows' data cannot be read):
    the thief gets nothing, the pass's row count comes up short, and the pass is redone,
    so the sum is still exact."""
    from blockflow.ml import _steal

    real, calls = RowPool.data, []

    def fails_once(self, lo, hi):
        calls.append((lo, hi))
        if len(calls) == 1:
            raise OSError("reply lost")
        return real(self, lo, hi)

    monkeypatch.setattr(_steal.RowPool, "data", fails_once)
    values = np.arange(N, dtype=float)
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        shards = ResidentShards(client, da.from_array(values[:, None], chunks=10),
                                da.zeros(N, chunks=10), sharding="equal")
        total = shards.map_sum(_sum_rows, None, (2,), steal=True)
        np.testing.assert_allclose(total, [values.sum(), N])
        assert calls and shards.redone_passes == 1
        assert sum(shards.last_rows.values()) == N


def _silent_server():
    """A TCP server that accepts connections and never answers (a hung peer, or one whose
    address is no worker's): ``(address, accepted connections, close)``."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    accepted = []

    def serve():
        while True:
            try:
                accepted.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=serve, daemon=True).start()

    def close():
        srv.close()
        for c in accepted:
            c.close()

    return f"tcp://127.0.0.1:{srv.getsockname()[1]}", accepted, close


def test_a_thief_never_asks_a_peer_that_is_no_longer_a_worker():
    """A pass submitted before a worker was lost lists it among the peers: the thief learns
    from the scheduler that it is no worker and never calls it (it used to wait for its
    answer up to 10 s, twice: a 20-42 s training step after a lost worker)."""
    import dask

    from blockflow.ml._passes import _run_shard
    from blockflow.ml._steal import StealPlugin

    gone, accepted, close = _silent_server()
    with dask.config.set({"blockflow.ml.peer-timeout": "60s"}), LocalCluster(
            n_workers=1, threads_per_worker=1, processes=False,
            dashboard_address=":0") as cluster, Client(cluster) as client:
        client.register_plugin(StealPlugin(), name=StealPlugin.name)
        [me] = client.scheduler_info()["workers"]
        blocks = [(np.arange(20.)[:, None], np.zeros(20))]
        t0 = time.perf_counter()
        out = client.submit(_run_shard, _sum_rows, blocks, [None], (None,),
                            ("p", [me, gone], 4, {}), pure=False).result()
        elapsed = time.perf_counter() - t0
    close()
    np.testing.assert_allclose(out["value"], [190.0, 20])
    assert not accepted, "the thief connected to an address that is no worker"
    assert elapsed < scaled(2, at_most=10), elapsed


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_call_to_a_peer_ends_when_the_scheduler_drops_it(c, s, a, b):
    """A call to a peer the scheduler drops while it waits ends within a poll or two, not
    at the timeout; one to a listed peer that does not answer ends at the timeout."""
    from blockflow.ml._peers import PeerGone, Peers

    peers = Peers(a, [b.address], timeout=60, poll=0.05)
    await peers.ready()
    assert peers.live == [b.address]
    t0 = time.perf_counter()
    call = asyncio.ensure_future(peers.call(b.address, lambda: asyncio.sleep(3600)))
    await asyncio.sleep(0.2)
    assert not call.done()
    await b.close()
    with pytest.raises(PeerGone, match=f"worker {b.address} is no longer one of the "
                                       f"scheduler's workers"):
        await call
    assert time.perf_counter() - t0 < 10
    assert peers.live == []
    with pytest.raises(PeerGone):  # not called again
        await peers.call(b.address, lambda: pytest.fail("called"))

    listed = Peers(c, [a.address], timeout=0.3, poll=0.05)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match=(
            rf"^blockflow: worker {a.address} did not answer within 0.3 s "
            rf"\(blockflow.ml.peer-timeout\).$")):
        await listed.call(a.address, lambda: asyncio.sleep(3600))
    assert 0.3 <= time.perf_counter() - t0 < 5


def test_peer_timeout_comes_from_the_configuration_and_must_be_positive():
    import dask

    from blockflow.ml._peers import peer_timeout
    from blockflow.ml._shards import _peer_timeout

    assert peer_timeout() == 5.0
    assert peer_timeout("500ms") == 0.5
    with dask.config.set({"blockflow.ml.peer-timeout": 7}):
        assert peer_timeout() == 7.0
    with pytest.raises(ValueError, match=r"^blockflow: peer_timeout must be a positive number "
                                         r"of seconds, got 0; pass it or set blockflow.ml."
                                         r"peer-timeout \(\"5s\", say\).$"):
        _peer_timeout(0)
