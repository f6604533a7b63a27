"""One meaning of "this run": everything one job or one compute() submitted.

The CLI's "Tasks per worker (this run)", the dashboard's "Tasks (this run)" column and
``manifest.json``'s ``n_tasks`` / ``task_counts`` are the same numbers, for a workload that
submits two graphs (flights) as for one that submits one (array-stats).
"""

from __future__ import annotations

import json
from collections import Counter

import dask
import dask.array as da
import pytest
from dask.utils import key_split
from distributed import get_task_stream, span

import blockflow
from blockflow.dashboard.page import BlockflowPage
from blockflow.dashboard.state import dashboard_state
from blockflow.scheduling.runs import RUN_ANNOTATION, RunTracker, run_scope
from blockflow.workloads import array_stats, flights

# --- the tracker on plain data ---------------------------------------------------------------


def test_each_untagged_graph_is_a_run_and_only_its_new_tasks_count():
    t = RunTracker()
    first = t.graph(client="c", states={"a": "released", "b": "released"}, annotations={},
                    now=1.0)
    assert (first.tasks, t.current) == (2, first.id)
    t.finished("a", "w1")
    t.finished("b", "w2")
    # a second compute() reuses "a" (in memory) and adds "c": a new run with one task
    second = t.graph(client="c", states={"a": "memory", "c": "released"}, annotations={},
                     now=2.0)
    assert second.id != first.id and second.tasks == 1 and t.current == second.id
    t.finished("c", "w1")
    assert t.get(first.id)["counts"] == {"w1": 1, "w2": 1}
    assert t.current_run()["counts"] == {"w1": 1} and t.current_run()["finished"] == 1
    # a graph with nothing to run (all in memory) makes no run and leaves the current one
    assert t.graph(client="c", states={"a": "memory"}, annotations={}, now=3.0) is None
    assert t.current == second.id


def test_a_graph_submitted_while_the_clients_run_is_unfinished_joins_it():
    """``x.persist().sum().compute()``: the compute arrives while the persist still runs."""
    t = RunTracker()
    first = t.graph(client="c", states={"a": "released", "b": "released"}, annotations={},
                    now=1.0)
    t.finished("a", "w1")
    assert t.graph(client="c", states={"a": "memory", "b": "processing", "s": "released"},
                   annotations={}, now=2.0) is first
    # another client's graph meanwhile is a run of its own
    other = t.graph(client="d", states={"x": "released"}, annotations={}, now=2.5)
    assert other.id != first.id and other.client == "d"
    t.finished("b", "w2")
    t.finished("s", "w1")
    assert t.get(first.id)["tasks"] == 3 and t.get(first.id)["pending"] == 0
    # its run finished: the client's next graph starts a new run
    t.forget("x")  # cancelled: no longer pending
    assert t.get(other.id)["pending"] == 0
    third = t.graph(client="c", states={"y": "released"}, annotations={}, now=3.0)
    assert third.id not in (first.id, other.id) and t.current == third.id


def test_tagged_graphs_are_one_run_and_a_rerun_counts_again():
    t = RunTracker()
    tag = {RUN_ANNOTATION: {"a": {"id": "job-1", "name": "the job"}}}
    t.graph(client="c", states={"a": "released"}, annotations=tag, now=1.0)
    t.finished("a", "w1")
    tag2 = {RUN_ANNOTATION: {"b": {"id": "job-1", "name": "the job"}}}
    run = t.graph(client="c", states={"a": "memory", "b": "released"}, annotations=tag2,
                  now=2.0)
    assert run.id == "job-1" and run.graphs == 2 and run.tasks == 2
    t.finished("b", "w2")
    t.finished("a", "w2")  # "a" recomputed after its worker was lost: counted again
    assert t.get("job-1") == {"id": "job-1", "name": "the job", "client": "c",
                              "started": 1.0, "graphs": 2, "tasks": 2, "pending": 0,
                              "finished": 3, "counts": {"w1": 1, "w2": 2},
                              "objective": None, "deadline_at": None, "group_pending": {},
                              "group_tasks": {"a": 1, "b": 1}, "spans": {},
                              "crossings": [], "ended": None}
    # a key still being computed for one run is not taken over by another graph
    t.graph(client="d", states={"x": "released"}, annotations=tag, now=3.0)
    other = t.graph(client="e", states={"x": "processing"}, annotations={}, now=4.0)
    assert other is None  # nothing new to run for it
    t.finished("x", "w1")
    assert t.get("job-1")["finished"] == 4
    t.forget("x")
    t.finished("x", "w1")  # forgotten: no longer anyone's
    assert t.get("job-1")["finished"] == 4


def test_tracker_remembers_a_bounded_number_of_runs():
    t = RunTracker(max_runs=3)
    ids = [t.graph(client=f"c{i}", states={i: "released"}, annotations={}, now=i).id
           for i in range(5)]
    assert list(t.runs) == ids[2:] and {c for c, _ in t._client_run} == {"c2", "c3", "c4"}
    t.finished(0, "w1")  # its run was forgotten: no error, nothing counted
    assert t.get(ids[0]) is None


def test_a_run_read_from_the_tracker_carries_its_span_figures_where_distributed_has_them():
    figures = {"job-1": {"name": ["the job"], "done": True, "nbytes_total": 8}}
    t = RunTracker(span_figures=figures.get)
    tag = {RUN_ANNOTATION: {"a": {"id": "job-1", "name": "the job"}}}
    t.graph(client="c", states={"a": "released"}, annotations=tag, now=1.0)
    assert t.get("job-1")["span"] == figures["job-1"]
    t.graph(client="c", states={"b": "released"}, annotations={}, now=2.0)
    assert "span" not in t.current_run()  # an untagged run is no span of its own


def test_a_run_scope_is_a_span_nested_in_the_open_one_and_reentered_it_continues():
    with span("study") as study, run_scope("the job", "job-1") as run_id:
        ann = dask.get_annotations()
        assert ann["span"] == {"name": ("study", "the job"), "ids": (study, "job-1")}
        assert ann[RUN_ANNOTATION] == {"id": "job-1", "name": "the job"}
        with run_scope("the job", run_id):  # the same run again: not a span in itself
            assert dask.get_annotations()["span"] == ann["span"]
        with run_scope("a stage") as inner:
            assert dask.get_annotations()["span"]["ids"] == (study, "job-1", inner)
            assert dask.get_annotations()[RUN_ANNOTATION]["id"] == inner


# --- the same numbers everywhere, on a real cluster -------------------------------------------


def _run_status(client, run_id):
    return blockflow.plugin_status(client, run=run_id)["requested_run"]


def test_flights_is_one_run_for_the_dashboard_the_result_and_the_manifest(client, tmp_path):
    out = tmp_path / "out"
    with get_task_stream(client) as stream:  # every task that ran meanwhile: the job's
        result = flights.run(client, scale=1, partitions_per_copy=2, output=out,
                             progress=False)
    status = blockflow.plugin_status(client)
    run = status["run"]
    # the dashboard's run is the whole job: both graphs, not only the aggregation
    assert run["name"] == "the flights ETL (scale 1)" and run["graphs"] == 2
    assert run["counts"] == result.task_counts
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["task_counts"] == result.task_counts
    assert manifest["n_tasks"] == sum(manifest["task_counts"].values()) == result.n_tasks
    assert run["finished"] == run["tasks"] == result.n_tasks
    # both graphs are counted: the loads (first graph) as the aggregations (second), and
    # every task the workers ran for the job, once
    assert result.n_tasks == len(stream.data)
    by_worker = Counter(t["worker"] for t in stream.data)
    assert dict(by_worker) == result.task_counts
    assert sum(key_split(t["key"]) == "blockflow-load-flights" for t in stream.data) == 2
    state = client.sync(_dashboard_state, client.cluster.scheduler)
    assert {w["address"]: w["tasks_run"] for w in state["workers"]
            if w["tasks_run"]} == result.task_counts
    assert state["run"]["name"] == run["name"] and state["run"]["finished"] == result.n_tasks
    page = BlockflowPage(client.cluster.scheduler)
    client.sync(_update, page)
    assert "this run: <b>the flights ETL (scale 1)</b>" in page.header.text
    assert f"{result.n_tasks:,} tasks finished of {result.n_tasks:,} submitted" in \
        page.header.text
    shown = dict(zip(page.workers.data["address"], page.workers.data["tasks_run"]))
    assert {w: n for w, n in shown.items() if n} == result.task_counts


def _span(run_id, dask_scheduler=None):
    s = dask_scheduler.extensions["spans"].spans.get(run_id)
    return None if s is None else {"name": s.name, "done": s.done, "groups": len(s.groups),
                                   "nbytes": s.nbytes_total, "duration": s.duration}


def test_a_run_is_a_distributed_span_with_distributeds_own_figures(client):
    with run_scope("twelve ones") as run_id:
        assert int(da.ones(12, chunks=3).sum().compute()) == 12
    seen = client.run_on_scheduler(_span, run_id)  # distributed's SpansSchedulerExtension
    assert seen["name"] == ("twelve ones",) and seen["done"] and seen["groups"] >= 2
    assert seen["nbytes"] > 0 and seen["duration"] > 0
    run = _run_status(client, run_id)
    assert run["name"] == "twelve ones" and run["finished"] == run["tasks"] > 4
    figures = run["span"]  # the run as blockflow reports it carries the span's figures
    assert figures["name"] == ["twelve ones"] and figures["done"]
    assert figures["nbytes_total"] == seen["nbytes"]
    assert figures["enqueued"] <= figures["start"] <= figures["stop"]
    assert figures["duration"] == pytest.approx(seen["duration"])


def _same(x):
    return x


def test_a_run_counts_its_tasks_where_distributed_files_them_under_an_earlier_span(client):
    """distributed puts a task on the span of its task group (``_same``: every submit of
    the function while one is held), so the run's id travels in its own annotation."""
    with run_scope("first") as first:
        held = client.map(_same, range(3), pure=False)
        client.gather(held)
    with run_scope("second") as second:
        assert client.gather(client.map(_same, range(3, 8), pure=False)) == [3, 4, 5, 6, 7]
    assert _run_status(client, first)["tasks"] == 3
    assert _run_status(client, second)["tasks"] == _run_status(client, second)["finished"] == 5
    assert client.run_on_scheduler(_span, second) is None  # filed under "first"
    assert "span" not in _run_status(client, second)
    del held


async def _dashboard_state(scheduler):
    return dashboard_state(scheduler)


async def _update(page):
    page.update()


def test_array_stats_n_tasks_is_the_sum_of_its_task_counts(client, tmp_path):
    out = tmp_path / "stats"
    result = array_stats.run(client, size="small", output=out, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["n_tasks"] == sum(manifest["task_counts"].values()) == result.n_tasks
    # the graph as built has more keys than run: optimisation fuses some (70 vs 63 here)
    assert result.n_tasks <= len(array_stats.build("small", 0).__dask_graph__())
    assert blockflow.plugin_status(client)["run"]["counts"] == result.task_counts


def test_a_compute_is_a_run_of_its_own_and_an_earlier_job_keeps_its_counts(client):
    result = array_stats.run(client, size="small", progress=False)
    before = blockflow.plugin_status(client)["run"]
    x = da.ones(12, chunks=3)
    assert int(x.sum().compute()) == 12
    run = blockflow.plugin_status(client)["run"]
    assert run["id"] != before["id"] and run["graphs"] == 1
    # 4 blocks + their partial sums and the aggregate: every task of this compute only
    assert run["finished"] == run["tasks"] and 4 < run["finished"] < 12
    assert _run_status(client, before["id"])["counts"] == result.task_counts


@pytest.mark.slow
def test_work_of_another_client_during_a_job_is_not_counted(client, cluster):
    from distributed import Client

    alone = array_stats.run(client, size="small", progress=False)
    with Client(cluster) as other:
        # 40 tasks of 0.1 s on 2 threads, submitted first: they run first, during the job
        busy = other.compute(da.ones(40, chunks=1).map_blocks(_sleepy).sum())
        before = sum(blockflow.task_counts(client).values())
        result = array_stats.run(client, size="small", progress=False)
        during = sum(blockflow.task_counts(client).values()) - before
        assert busy.result() == 40
    assert during > result.n_tasks  # the other client's tasks finished meanwhile ...
    assert result.task_counts and result.n_tasks == sum(result.task_counts.values())
    assert result.n_tasks == alone.n_tasks  # ... and none of them counts for the job


def _sleepy(b):
    import time

    time.sleep(0.1)
    return b
