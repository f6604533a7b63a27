"""The plugin stays cheap as the cluster grows: a tick judges the workers that changed, not
all of them, nor the tasks; the plugin measures its own cost.

Counts, not times: which worker views a tick reads, which waiting tasks it asks for.
"""

from __future__ import annotations

import asyncio

import numpy as np
from distributed import wait
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.utils_test import gen_cluster, inc

from blockflow import _distributed
from blockflow._distributed.metrics import WorkerMetrics
from blockflow.scheduling import Rebalancer
from blockflow.scheduling.actions import Action, Recorded
from blockflow.scheduling.policies import ClusterSnapshot, DynamicPolicy

GiB = 2**30


class Watched(_distributed.WorkerView):
    """A worker view that records every attribute read of it (while ``reads`` is a set)."""

    reads: set | None = None

    def __getattribute__(self, name):
        reads = type(self).reads
        if reads is not None:
            reads.add(object.__getattribute__(self, "address"))
        return object.__getattribute__(self, name)


def view(addr, *, util=30.0, own=30.0, processing=2, executing=1, cls=Watched):
    return cls(address=addr, nthreads=1, status="running", paused_by_blockflow=False,
               metrics=WorkerMetrics(gpu_utilization=util, gpu_memory_used=4 * GiB,
                                     gpu_memory_total=16 * GiB, host_memory=None,
                                     own_utilization=own),
               speed=1.0, processing=processing, executing=executing,
               occupancy=1e-4 * processing)


class Waiting(dict):
    """``snapshot.waiting`` that records which workers' waiting tasks were asked for."""

    def __init__(self, addresses):
        super().__init__()
        self.addresses = set(addresses)
        self.asked: list[str] = []

    def get(self, addr, default=()):
        self.asked.append(addr)
        return iter(())


def tick(workers, *, changed, queued, waiting):
    return ClusterSnapshot(time=0.0, workers=workers, queued=queued, waiting=waiting,
                           changed=changed)


def test_a_tick_reads_only_the_workers_that_changed():
    addrs = [f"tcp://10.0.{i // 250}.{i % 250}:1" for i in range(1000)]
    workers = {a: view(a) for a in addrs}
    waiting = Waiting(addrs)
    policy = DynamicPolicy()
    assert list(policy.run(tick(workers, changed=None, queued=100_000, waiting=waiting))) == []
    # 5 workers send new metrics; one of them is now busy with other work (95 %), with
    # nothing waiting on it (its one task runs)
    changed = addrs[10:15]
    for a in changed:
        workers[a] = view(a, cls=_distributed.WorkerView)
    hot = addrs[12]
    workers[hot] = view(hot, util=95.0, own=0.0, processing=1, executing=1,
                        cls=_distributed.WorkerView)
    Watched.reads, waiting.asked = set(), []
    try:
        out = list(policy.run(tick(workers, changed=frozenset(changed), queued=100_000,
                                   waiting=waiting)))
        unchanged_read = Watched.reads
    finally:
        Watched.reads = None
    assert [(d.action, d.worker) for d in out] == [(Action.PAUSE, hot)]
    assert unchanged_read == set()  # not one of the 995 others was looked at
    assert waiting.asked == []  # nor any task: 100,000 queued cost what 1 would


def test_a_worker_kept_as_the_last_usable_one_is_paused_once_another_returns():
    a, b = "tcp://a:1", "tcp://b:1"
    policy = DynamicPolicy()
    hot = view(a, util=95.0, own=0.0, processing=0, executing=0,
               cls=_distributed.WorkerView)
    gone = view(b, processing=0, executing=0, cls=_distributed.WorkerView)
    gone.status = "closing"
    first = list(policy.run(tick({a: hot, b: gone}, changed=None, queued=0, waiting={})))
    assert [(d.action, d.worker) for d in first] == [(Recorded.KEEP, a)]
    back = view(b, processing=0, executing=0, cls=_distributed.WorkerView)
    # only b changed; a, kept last time, is judged again
    second = list(policy.run(tick({a: hot, b: back}, changed=frozenset({b}), queued=0,
                                  waiting={})))
    assert [(d.action, d.worker) for d in second] == [(Action.PAUSE, a)]


def test_a_paused_workers_waiting_tasks_are_still_rescued_when_only_it_changed():
    addrs = [f"tcp://w{i}:1" for i in range(50)]
    workers = {a: view(a, cls=_distributed.WorkerView) for a in addrs}
    policy = DynamicPolicy()
    list(policy.run(tick(workers, changed=None, queued=10, waiting={})))
    stuck = addrs[7]
    workers[stuck] = view(stuck, processing=3, executing=1, cls=_distributed.WorkerView)
    workers[stuck].status = "paused"
    tasks = {stuck: [_distributed.TaskView(key=f"t{i}", group="g", duration=1.0)
                     for i in range(2)]}
    out = list(policy.run(ClusterSnapshot(
        time=0.0, workers=workers, queued=10, waiting={a: iter(tasks.get(a, ()))
                                                      for a in addrs},
        changed=frozenset({stuck}))))
    moves = [d for d in out if d.action == Action.MOVE]
    assert sorted(d.key for d in moves) == ["t0", "t1"]
    assert all(d.worker == stuck and d.target != stuck for d in moves)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_ticks_reuse_unchanged_views_and_the_plugin_reports_its_cost(c, s, a, b, w):
    await c.register_plugin(Rebalancer(policy="dynamic", interval=0))
    plugin = s.plugins["blockflow-rebalancer"]
    plugin.run_once()
    first = plugin._last_snap.workers
    plugin.run_once()
    snap = plugin._last_snap
    assert snap.changed == frozenset()  # no heartbeat, no task: every view reused
    assert all(snap.workers[x] is first[x] for x in first)
    ws = s.workers[a.address]
    ws.metrics = {**ws.metrics, "gpu_utilization": 97.0, "gpu_memory_used": 1.0,
                  "gpu-memory-total": 16.0 * GiB}
    applied = plugin.run_once()
    assert plugin._last_snap.changed == frozenset({a.address})
    assert plugin._last_snap.workers[a.address].metrics.gpu_utilization == 97.0
    assert [(d.action, d.worker) for d in applied] == [(Action.PAUSE, a.address)]
    # a snapshot taken between ticks does not hide what changed from the next tick
    ws2 = s.workers[b.address]
    ws2.metrics = {**ws2.metrics, "gpu_utilization": 97.0, "gpu_memory_used": 1.0,
                   "gpu-memory-total": 16.0 * GiB}
    plugin.take_snapshot()
    applied = plugin.run_once()
    assert [(d.action, d.worker) for d in applied] == [(Action.PAUSE, b.address)]

    await wait(c.map(inc, range(20)))
    cost = (await c.scheduler.blockflow_status())["cost"]
    assert cost["tasks"] == 20
    assert cost["hook_seconds"] > 0 and cost["per_task_us"] > 0
    assert cost["tick_count"] == plugin.ticks >= 5
    assert 0 < cost["tick_ms_median"] <= cost["tick_ms_max"]
    assert cost["tick_ms_max_without_full_gc"] <= cost["tick_ms_max"]
    assert 0 <= cost["ticks_with_full_gc"] <= cost["tick_count"]
    assert cost["all_in_per_task_us"] > cost["per_task_us"]
    assert set(plugin.status()["workers"]) == set(s.workers)  # the table, built on demand


# --- the transition hook queues finished tasks; every read folds them in first -----------

async def _quiet_plugin(c, s) -> Rebalancer:
    await c.register_plugin(Rebalancer(policy="dynamic", interval=0))  # no ticks
    return s.plugins["blockflow-rebalancer"]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_finished_tasks_are_counted_when_status_is_read_with_the_loop_off(c, s, a, b):
    plugin = await _quiet_plugin(c, s)
    futs = c.map(inc, range(20))
    await wait(futs)
    assert plugin._finished  # queued by the hook, not folded in yet (no tick)
    status = await c.scheduler.blockflow_status()
    assert sum(status["task_counts"].values()) == 20
    assert sum(status["run_counts"].values()) == 20
    assert status["run"]["pending"] == 0 and status["run"]["tasks"] == 20
    assert status["cost"]["tasks"] == 20 and status["cost"]["hook_seconds"] > 0
    assert not plugin._finished
    got = await c.scheduler.blockflow_status(task_log=True)
    assert len(got["task_log"]) == 20


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_graph_after_a_finished_compute_starts_its_own_run_with_the_loop_off(
        c, s, a, b):
    plugin = await _quiet_plugin(c, s)
    first = c.map(inc, range(20))
    await wait(first)
    assert plugin._finished
    # the first run's tasks are folded in before the graph is accounted: it is done, so
    # the second graph is a run of its own (not joined to a run that looks unfinished)
    second = c.map(inc, range(100, 110))
    await wait(second)
    status = await c.scheduler.blockflow_status()
    assert status["run"]["tasks"] == 10 and status["run"]["graphs"] == 1, status["run"]
    assert sum(status["run_counts"].values()) == 10
    assert sum(status["task_counts"].values()) == 30


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_task_forgotten_right_after_it_finished_is_counted_in_order(c, s, a, b):
    plugin = await _quiet_plugin(c, s)
    fut = c.submit(inc, 1)
    assert await fut == 2
    key = fut.key
    del fut
    while key in s.tasks:
        await asyncio.sleep(0.01)
    assert [e[0] for e in plugin._finished] == [key, key]  # finished, then forgotten
    status = await c.scheduler.blockflow_status()
    # its end counted for its run before its forgetting dropped it from the run
    assert sum(status["run_counts"].values()) == 1 and status["run"]["pending"] == 0
    assert key not in plugin.runs._key_run


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_the_queue_of_finished_tasks_is_bounded_with_the_loop_off(c, s, a, b):
    plugin = await _quiet_plugin(c, s)
    plugin.max_queued = 5
    await wait(c.map(inc, range(40)))
    assert len(plugin._finished) < 5
    assert sum(plugin.task_counts.values()) == 40


def test_a_tick_a_full_garbage_collection_ran_in_is_counted_apart():
    from blockflow.scheduling.overhead import PluginCost

    cost = PluginCost()
    cost.tick(0.002)
    cost.tick(0.25, full_gc=True)  # the whole process paused for a full collection
    cost.tick(0.004)
    d = cost.as_dict(tasks=10)
    assert d["tick_ms_max"] == 250.0 and d["ticks_with_full_gc"] == 1
    assert d["tick_ms_max_without_full_gc"] == 4.0
    assert d["tick_count"] == 3


# --- the first graph on fresh workers is dispatched as plain Dask dispatches it ----------


class _Dispatches(SchedulerPlugin):
    """Scheduler plugin recording ``(key, start, finish, stimulus)`` of every transition."""

    name = "test-dispatches"

    def __init__(self):
        self.seen: list[tuple] = []

    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs):
        self.seen.append((key, start, finish, stimulus_id or ""))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2,
             config={"distributed.scheduler.worker-saturation": 1.0})
async def test_the_first_graph_on_fresh_workers_waits_for_nothing(c, s, a, b):
    # issue 39: the first graph on fresh workers started ~0.5 s after plain Dask's. The
    # plugin's own first tick, its worker plugins, no heartbeat metrics yet (fresh workers)
    # and the kernel tasks' declarations must not hold a task: as many blocks as threads
    # leave for the workers in the graph's own stimulus, none waits in no-worker or on
    # blockflow's hold address, and the plugin decides nothing about them
    import dask.array as da

    import blockflow

    await c.register_plugin(Rebalancer(policy="dynamic"))
    tracer = _Dispatches()
    s.add_plugin(tracer, name=tracer.name)
    x = da.ones(8, chunks=1)
    y = blockflow.map_blocks(inc, x, dtype=x.dtype)
    futures = c.compute(y.to_delayed().ravel().tolist())
    await wait(futures)
    kernels = {k for k, *_ in tracer.seen if str(k[0] if isinstance(k, tuple) else k)
               .startswith("blockflow-inc")}
    assert len(kernels) == 8
    sent_at_once = {k for k, _, finish, stim in tracer.seen
                    if finish == "processing" and stim.startswith("update-graph")}
    assert len(sent_at_once) >= 2, tracer.seen[:20]  # one per thread, at the graph itself
    assert not [t for t in tracer.seen if t[2] == "no-worker"]
    assert not [k for k in kernels if _distributed.HOLD_ADDRESS
                in (s.tasks[k].worker_restrictions or ()) if k in s.tasks]
    status = await c.scheduler.blockflow_status()
    assert not [d for d in status["decisions"]
                if d["action"] not in (Recorded.JOIN.value, Recorded.FORGET.value)], \
        status["decisions"]
    assert [np.asarray(v).item() for v in await c.gather(futures)] == [2.0] * 8
