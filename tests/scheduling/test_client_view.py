"""The client's one view of the cluster (blockflow.scheduling.view), on real in-process
clusters: the plugin's state, learned speeds, memory, the throughput estimator with its
prior, and waiting while workers die."""

from __future__ import annotations

import datetime
import math
import time

import pandas as pd
import pytest
from distributed import Client, LocalCluster

import blockflow
from blockflow.cluster import connection
from blockflow.scheduling.view import workers_info
from blockflow.errors import WorkerLostError
from blockflow.scheduling import view, wait
from blockflow.scheduling.view import (
    LearnedSpeeds,
    ThroughputView,
    learned_speeds,
    memory_of,
    worker_memory,
)
from blockflow.scheduling.wait import fetch, gather_as_done, wait_any
from loadaware import scaled, wait_until


def test_the_public_names_stay_where_they_were():
    for name in ("plugin_status", "decisions", "task_counts"):
        assert getattr(blockflow, name) is getattr(view, name)
        assert getattr(connection, name) is getattr(view, name)
    for name in ("wait_for", "gather_results"):
        assert getattr(connection, name) is getattr(wait, name)


def test_plugin_status_task_counts_and_decisions(client):
    assert client.submit(sum, [1, 2], pure=False).result() == 3
    status = view.plugin_status(client)
    assert status["policy"] == "off"
    assert set(status["speeds"]) == set(workers_info(client))
    counts = view.task_counts(client)
    assert sum(counts.values()) >= 1
    assert list(view.decisions(client).columns[:7]) == view.DECISION_COLUMNS


def _record(dask_scheduler, reason: str) -> None:
    """Log a ``keep`` record in the scheduler's plugin (a decision with a known reason)."""
    from blockflow.scheduling.actions import Record, Recorded

    dask_scheduler.plugins["blockflow-rebalancer"]._log(
        Record(Recorded.KEEP, "tcp://w:1", reason, {}))


def test_decisions_give_epoch_seconds_and_since_takes_seconds_or_a_datetime(client):
    # decisions() gave datetimes where run_report(since=) and status.json take epoch seconds
    client.run_on_scheduler(_record, reason="before")
    time.sleep(0.05)
    between = time.time()
    time.sleep(0.05)
    client.run_on_scheduler(_record, reason="after")
    log = view.decisions(client)
    assert log["time"].dtype == "float64"
    after = log[log.reason == "after"]["time"].iloc[0]
    assert between < after <= time.time()  # the clock time.time() and status.json use
    aware = datetime.datetime.fromtimestamp(between, datetime.timezone.utc)
    naive_local = datetime.datetime.fromtimestamp(between)  # local time, as Python reads it
    for since in (between, aware, naive_local, pd.Timestamp(aware)):
        assert list(view.decisions(client, since=since).reason) == ["after"], since
        assert [d["reason"] for d in view.plugin_status(client, since=since)["decisions"]
                ] == ["after"], since
    # a time the log gives back selects what came after it
    assert list(view.decisions(client, since=after).reason) == []
    for bad in ("yesterday", True, datetime.date.today()):
        with pytest.raises(TypeError, match=r"since= must be seconds since the epoch "
                                            r"\(time.time\(\)\) or a datetime, got "):
            view.decisions(client, since=bad)
    with pytest.raises(ValueError, match="since= must be a finite time, got nan"):
        view.plugin_status(client, since=float("nan"))


def test_plugin_status_without_the_plugin_says_how_to_get_it():
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        with pytest.raises(RuntimeError, match="runs no blockflow plugin"):
            view.plugin_status(c)
        # the view then knows no speeds, rather than failing
        assert learned_speeds(c) == LearnedSpeeds({}, {})
        assert not learned_speeds(c)


def test_learned_speeds_read_the_plugin_under_one_confidence_rule(client):
    got = learned_speeds(client)
    workers = set(workers_info(client))
    assert set(got.speeds) == workers and set(got.confidence) == workers
    assert set(got.known) <= workers
    assert all(got.confidence[a] >= 0.5 for a in got.known)
    synthetic = LearnedSpeeds({"a": 2.0, "b": 0.5}, {"a": 0.8, "b": 0.3})
    assert synthetic.known == {"a": 2.0}


def test_worker_memory_on_the_cluster(client):
    infos = workers_info(client)
    memory = worker_memory(client)
    assert set(memory) == set(infos)
    for a, m in memory.items():
        assert m.host_total == infos[a]["memory_limit"]
        assert not m.has_device  # CPU workers
        assert m.free == m.host_free <= m.host_total


def test_memory_readings_are_cleaned_by_the_one_parser():
    gpu = memory_of({"memory_limit": 8e9, "metrics": {
        "memory": 1e9, "gpu-memory-total": 16e9, "gpu_memory_used": 4e9}})
    assert (gpu.device_total, gpu.device_used, gpu.device_free) == (16e9, 4e9, 12e9)
    assert gpu.host_free == 7e9 and gpu.free == 12e9 and gpu.total == (16e9, "device")
    # a NaN or negative reading is unknown, never zero use
    odd = memory_of({"memory_limit": "lots", "metrics": {
        "memory": -5, "gpu-memory-total": 16e9, "gpu_memory_used": float("nan")}})
    assert odd.host_total is None and odd.host_used is None and odd.device_free is None
    assert odd.free == 16e9  # nothing known in use on the device
    assert memory_of({}).free == math.inf and memory_of({}).total is None
    host = memory_of({"memory_limit": 4e9, "metrics": {"memory": 5e9}})
    assert host.free == 0.0 and host.total == (4e9, "host")


def test_throughput_view_drops_the_cold_start_and_uses_the_prior(client):
    tv = ThroughputView(client, fixed=False)
    workers = sorted(workers_info(client))
    a, b = workers
    # no plugin speed known with confidence yet on a fresh cluster: measurements only
    tv.set_prior({b: 2.0})
    tv.observe(a, 10, 30.0)  # cold
    tv.observe(a, 10, 5.0)
    assert tv.seconds_per_unit(workers) == {a: 0.5, b: 0.25}
    tv.refresh = 0.0  # the prior is read from the plugin again
    assert set(tv.prior()) <= set(workers)


def _sleep_then(x, seconds):
    time.sleep(seconds)
    return x


@pytest.fixture
def two_workers():
    """A cluster of its own: the tests below kill one of its workers."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        yield cluster, c


def _close(cluster, client, address):
    worker = next(w for w in cluster.workers.values() if w.address == address)
    client.sync(worker.close, executor_wait=False)  # not waiting for its running tasks


def test_wait_survives_a_killed_worker_whose_results_distributed_recomputes(two_workers):
    cluster, c = two_workers
    a, b = sorted(workers_info(c))
    # loose restrictions: distributed may run them elsewhere once b is gone
    futures = [c.submit(_sleep_then, i, 0.2, pure=False, workers=[b],
                        allow_other_workers=True) for i in range(6)]
    futures = [c.submit(_sleep_then, f, 0.0, pure=False) for f in futures]
    # kill b while it runs them: once one of its tasks has started
    wait_until(lambda: c.processing().get(b), timeout=10,
               message=f"a task running on {b}")
    _close(cluster, c, b)
    got = gather_as_done(futures, alive=lambda: workers_info(c), needed=(), poll=0.2,
                         deadline=scaled(60))
    assert sorted(got) == list(range(6))


def test_wait_names_the_lost_worker_its_pinned_results_needed(two_workers):
    cluster, c = two_workers
    a, b = sorted(workers_info(c))
    quick = c.submit(_sleep_then, 1, 0.0, pure=False, workers=[a])
    stuck = c.submit(_sleep_then, 2, 3.0, pure=False, workers=[b],
                     allow_other_workers=False)
    assert wait_any([quick, stuck], timeout=scaled(10)) == [quick]
    _close(cluster, c, b)
    start = time.monotonic()
    with pytest.raises(WorkerLostError) as info:
        gather_as_done([quick, stuck], alive=lambda: workers_info(c), needed={a, b},
                       poll=0.2, deadline=scaled(60))
    assert info.value.lost == {b}
    assert b in str(info.value)
    assert time.monotonic() - start < scaled(10, at_most=60)


def test_fetch_gives_up_on_a_result_lost_before_it_was_fetched(two_workers):
    cluster, c = two_workers
    a, b = sorted(workers_info(c))
    fut = c.submit(_sleep_then, 3, 0.0, pure=False, workers=[b], allow_other_workers=False)
    assert fetch(fut, timeout=scaled(10)) == 3
    _close(cluster, c, b)
    # the client hears that the only copy is gone
    wait_until(lambda: fut.status != "finished", timeout=10,
               message="the client to hear that the result's only copy is gone")
    with pytest.raises(WorkerLostError) as info:
        fetch(fut, timeout=0.5, deadline=scaled(5))
    assert info.value.lost == {str(fut.key)}


def test_gather_as_done_has_a_deadline(two_workers):
    _, c = two_workers
    slow = c.submit(time.sleep, 3, pure=False)
    with pytest.raises(TimeoutError, match="1 results not back within 0.5 s"):
        gather_as_done([slow], alive=lambda: workers_info(c), poll=0.1, deadline=0.5)
    slow.cancel()


def test_fetch_raises_the_tasks_own_error(two_workers):
    _, c = two_workers
    fut = c.submit(math.sqrt, -1.0, pure=False)
    with pytest.raises(ValueError):
        fetch(fut, timeout=scaled(10))


def test_fetch_many_gathers_finished_results_in_order(two_workers):
    from blockflow.scheduling.wait import fetch_many

    _, c = two_workers
    futures = [c.submit(_sleep_then, i, 0.0, pure=False) for i in range(6)]
    for f in futures:
        fetch(f, timeout=scaled(10))
    assert fetch_many(futures[::-1], timeout=scaled(10)) == [5, 4, 3, 2, 1, 0]
    assert fetch_many([]) == []
    bad = c.submit(math.sqrt, -1.0, pure=False)
    with pytest.raises(ValueError):  # a task's own error stops the gather
        fetch_many([futures[0], bad], timeout=scaled(10))
    slow = c.submit(time.sleep, 3, pure=False)
    with pytest.raises(TimeoutError):  # never an unbounded wait
        fetch_many([slow], timeout=0.2)
    slow.cancel()
