"""blockflow.run_report on a real cluster."""

from __future__ import annotations

import time

import dask.array as da
import pytest

import blockflow
from blockflow.scheduling.view import workers_info


@pytest.fixture(scope="module")
def bf_client():
    client = blockflow.connect(gpu=False, n_workers=2, threads_per_worker=1, processes=False,
                               dashboard_address="127.0.0.1:0", policy="dynamic")
    yield client
    client.shutdown()
    client.close()


def _slow_inc(b):
    time.sleep(0.01)
    return b + 1


def test_run_report_summarises_one_computation(bf_client):
    blockflow.map_blocks(_slow_inc, da.ones(40, chunks=2)).persist().sum().compute()  # before
    t0 = time.time()
    y = blockflow.map_blocks(_slow_inc, da.ones(60, chunks=3), name="report").persist()
    y.sum().compute()
    report = blockflow.run_report(bf_client, since=t0)
    workers = set(workers_info(bf_client))
    assert set(report.tasks_per_worker) <= workers
    # 20 kernel tasks, 20 sum chunks and the sum's tree; nothing of the earlier computation
    # (20 + 20 + its tree, which would push the total past 70)
    assert 40 < sum(report.tasks_per_worker.values()) <= 55
    assert 0.01 * 20 / 2 <= report.makespan < 30
    assert (report.tasks.start >= -1e-3).all() and (report.tasks.stop >= report.tasks.start).all()
    assert report.policy == "dynamic" and report.moves >= 0 and report.bytes_moved >= 0
    assert set(report.device_memory_peak) == workers
    assert all(v is None for v in report.device_memory_peak.values())  # CPU workers: n/a
    table = report.to_pandas()
    assert list(table.columns) == ["worker", "tasks", "busy_seconds", "device_memory_peak"]
    assert table.tasks.sum() == sum(report.tasks_per_worker.values())
    assert (table.busy_seconds > 0).any()
    html = report._repr_html_()
    assert "blockflow run report" in html and "n/a" in html
    assert repr(report).startswith("<blockflow.RunReport: makespan")
    fig = report.plot()
    assert len(fig.renderers) == len(report.tasks_per_worker)
    # one time type: since= as a datetime is the same window
    from datetime import datetime, timezone

    again = blockflow.run_report(bf_client, since=datetime.fromtimestamp(t0, timezone.utc))
    assert again.since == pytest.approx(t0)
    assert again.tasks_per_worker == report.tasks_per_worker
    from bokeh.embed import json_item

    assert json_item(fig)["doc"]  # serialisable: renders in a notebook


def test_run_report_defaults_to_the_current_computation(bf_client):
    time.sleep(0.2)
    blockflow.map_blocks(_slow_inc, da.ones(30, chunks=3), name="last").persist().sum().compute()
    report = blockflow.run_report(bf_client)
    assert 20 < sum(report.tasks_per_worker.values()) <= 30


def _report(moves: int, tasks: dict[str, int]) -> blockflow.RunReport:
    import pandas as pd

    rows = [(w, 0.0, 1.0) for w, n in tasks.items() for _ in range(n)]
    return blockflow.RunReport(
        since=0.0, makespan=1.0, tasks_per_worker=tasks, moves=moves, bytes_moved=2048,
        device_memory_peak={w: None for w in tasks}, policy="dynamic",
        tasks=pd.DataFrame(rows, columns=["worker", "start", "stop"]))


@pytest.mark.parametrize("moves, tasks, words", [
    (1, {"tcp://a:1": 1}, "1 task on 1 worker, 1 move (2.00 kiB)"),
    (2, {"tcp://a:1": 1, "tcp://b:1": 1200}, "1,201 tasks on 2 workers, 2 moves (2.00 kiB)"),
    (0, {}, "0 tasks on 0 workers, 0 moves (2.00 kiB)"),
])
def test_counts_are_spelt_in_the_singular_and_plural(moves, tasks, words):
    report = _report(moves, tasks)
    assert repr(report).splitlines()[0] == (
        f"<blockflow.RunReport: makespan 1.00 s, {words}, policy dynamic>")
    html_words = words.replace(f" on {len(tasks)} worker" + ("s" if len(tasks) != 1 else ""),
                               "")
    assert f"makespan 1.00 s, {html_words}, policy dynamic" in report._repr_html_()


def test_a_worker_retired_on_purpose_is_not_named_as_lost_one_that_died_is():
    import os
    import warnings

    from distributed import Client, LocalCluster

    from blockflow.cluster.report import warn_workers_left, worker_hosts
    from blockflow.errors import BlockflowWarning
    from loadaware import wait_until

    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.wait_for_workers(3)
        before = worker_hosts(client)
        retired, killed, _ = sorted(before)
        client.retire_workers([retired])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # retired by the user: nothing to say
            assert warn_workers_left(client, before, "the job") == []
        client.run(os._exit, 1, workers=[killed], on_error="ignore")
        wait_until(lambda: killed not in worker_hosts(client),
                   message="the killed worker to leave")
        with pytest.warns(BlockflowWarning, match="left during the run") as record:
            assert warn_workers_left(client, before, "the job") == [killed]
        assert len(record) == 1 and killed in str(record[0].message)
