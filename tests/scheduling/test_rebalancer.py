"""The rebalancer's decisions on real schedulers and workers reporting simulated GPU metrics.

Decision logic runs on ``gen_cluster`` with the control loop off (``interval=0``) and
explicit ``run_once()`` calls, so every step is deterministic.
"""

from __future__ import annotations

import asyncio
from collections import Counter
import math
import time

import dask.array as da
import numpy as np
import pytest
from distributed import wait
from distributed.core import Status
from distributed.utils_test import gen_cluster, slowinc
from loadaware import async_wait_until

import blockflow
from blockflow.scheduling import Rebalancer
from blockflow.scheduling.actions import Action, Decision
from blockflow._distributed import check_scheduler
from blockflow.scheduling.speed import SpeedModel
from blockflow.testing import (SimulatedDevice, Tenant, install_simulated_devices, set_speed,
                               set_tenant)

GiB = 2**30


async def _plugin(c, s, policy="dynamic") -> Rebalancer:
    await c.register_plugin(Rebalancer(policy=policy, interval=0))
    return s.plugins["blockflow-rebalancer"]


async def _heartbeats(c):
    async def beat(dask_worker):
        await dask_worker.heartbeat()

    await c.run(beat)


def _actions(decisions, action):
    return [d for d in decisions if d.action == action]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_hot_worker_gets_no_new_tasks(c, s, a, b, w):
    await install_simulated_devices(c, {a.address: SimulatedDevice(tenant=Tenant(95, 0))},
                                    default=SimulatedDevice())
    plugin = await _plugin(c, s)  # its first tick runs at once, before any graph arrives
    log = [d for d in plugin.decisions if d["action"] != "join"]
    assert [(d["action"], d["worker"]) for d in log] == [("pause", a.address)]
    assert "busy with other work" in log[0]["reason"]
    assert log[0]["seen_gpu_utilization"] == 95
    assert plugin.run_once() == []  # nothing new to decide
    assert s.workers[a.address].status == Status.paused
    futs = c.map(slowinc, range(30), delay=0.01)
    await wait(futs)
    assert not any(a.address in {ws.address for ws in s.tasks[f.key].who_has} for f in futs)
    assert a.state.executed_count == 0


def _sleep_inc(x, delay):
    time.sleep(delay)
    return x + 1


@pytest.mark.parametrize("kind", ["client.map", "blockflow.map_blocks", "dask.array"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3,
             config={"distributed.worker.memory.pause": False})
async def test_no_task_is_stranded_on_a_worker_paused_for_memory(c, s, a, b, w, kind):
    """A worker pauses itself (as distributed's memory monitor does) while it holds tasks
    placed there by data locality; once its running task ended and its heartbeat says it runs
    nothing, one tick moves every task it has not started (issue 27: the next one was counted
    as about to start and stayed there for good), each move logged, whatever submitted it.
    (The memory monitor is off so that it does not resume the worker at once.)"""
    plugin = await _plugin(c, s)
    data = []
    for worker in (a, b, w):  # six inputs on each worker: its tasks follow them
        data += await c.scatter([np.full(2, i) for i in range(6)], workers=[worker.address])
    if kind == "client.map":
        out = c.map(_sleep_inc, data, delay=0.3, pure=False)
    else:
        x = da.concatenate([da.from_delayed(f, shape=(2,), dtype=int) for f in data])
        mapper = blockflow.map_blocks if kind == "blockflow.map_blocks" else da.map_blocks
        out = c.compute(mapper(_sleep_inc, x, delay=0.3, dtype=int))
    await async_wait_until(lambda: a.state.executing_count, message="a task executing on a")
    a.status = Status.paused  # what distributed's memory monitor does over its threshold
    await async_wait_until(lambda: s.workers[a.address].status == Status.paused,
                           message="the scheduler sees a paused")
    await async_wait_until(lambda: not a.state.executing_count,
                           message="a's running task finished")
    await _heartbeats(c)
    waiting = {ts.key for ts in s.workers[a.address].processing}
    assert waiting, "the scenario needs tasks left on the paused worker"
    applied = plugin.run_once() + plugin.run_once()
    moves = _actions(applied, "move")
    assert {d.key for d in moves} == waiting
    assert all(d.worker == a.address and d.target != a.address for d in moves)
    logged = [d for d in plugin.decisions if d["action"] == "move"]
    assert len(logged) == len(waiting)
    assert all("worker paused itself" in d["reason"] for d in logged)
    await wait(out)  # a stays paused: everything ran elsewhere
    assert s.workers[a.address].status == Status.paused


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_queued_tasks_move_off_a_hot_worker_but_a_started_task_never_moves(c, s, a, b, w):
    await install_simulated_devices(c, {}, default=SimulatedDevice())
    plugin = await _plugin(c, s)
    data = await c.scatter(list(range(12)), workers=[a.address])
    futs = c.map(slowinc, data, delay=0.3)  # follow their data: all processing on a
    await async_wait_until(lambda: a.state.executing_count, message="a task executing on a")
    started = {k for k, ts in a.state.tasks.items() if ts.state == "executing"}
    assert len(started) == 1
    await c.run(set_tenant, Tenant(95, 0), workers=[a.address])
    await _heartbeats(c)
    applied = plugin.run_once()
    assert [d.worker for d in _actions(applied, "pause")] == [a.address]
    moves = _actions(applied, "move")
    assert moves and all(d.worker == a.address and d.target != a.address for d in moves)
    assert not started & {d.key for d in moves}
    await wait(futs)
    ran_on = {f.key: {ws.address for ws in s.tasks[f.key].who_has} for f in futs}
    (key,) = started
    assert a.address in ran_on[key]  # the started task finished where it started
    moved_away = [k for k, ws in ran_on.items() if a.address not in ws]
    assert len(moved_away) >= len(moves) - 1
    assert await c.gather(futs) == [i + 1 for i in range(12)]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_the_last_usable_worker_is_never_paused(c, s, a):
    await install_simulated_devices(c, {a.address: SimulatedDevice(tenant=Tenant(99, 0))})
    plugin = await _plugin(c, s)
    log = [d for d in plugin.decisions if d["action"] != "join"]
    assert [d["action"] for d in log] == ["keep"]
    assert "last usable worker" in log[0]["reason"]
    assert s.workers[a.address].status == Status.running
    assert plugin.run_once() == []  # the same non-decision is not logged twice
    assert await c.submit(slowinc, 1, delay=0.01) == 2


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_pause_it_did_not_make_is_never_undone(c, s, a, b):
    await install_simulated_devices(c, {}, default=SimulatedDevice())
    plugin = await _plugin(c, s)
    s.handle_worker_status_change(Status.paused, s.workers[a.address], stimulus_id="user")
    for _ in range(3):
        assert not plugin.run_once()
    assert s.workers[a.address].status == Status.paused
    assert a.address not in plugin.paused


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_pause_and_resume_follow_the_memory_hysteresis(c, s, a, b):
    await install_simulated_devices(c, {}, default=SimulatedDevice(device_memory=GiB))
    plugin = await _plugin(c, s)

    async def tenant_memory(fraction):
        await c.run(set_tenant, Tenant(0, int(fraction * GiB)), workers=[a.address])
        await _heartbeats(c)
        return [(d.action, d.worker) for d in plugin.run_once()]

    assert await tenant_memory(0.80) == []  # below the 85 % high-water mark
    assert await tenant_memory(0.90) == [("pause", a.address)]
    assert await tenant_memory(0.80) == []  # between the marks: stays paused
    assert s.workers[a.address].status == Status.paused
    # the worker's own "running" status message cannot undo the pause
    s.handle_worker_status_change(Status.running, s.workers[a.address], stimulus_id="worker")
    assert await tenant_memory(0.80) == []
    assert s.workers[a.address].status == Status.paused
    assert await tenant_memory(0.60) == [("resume", a.address)]
    assert s.workers[a.address].status == Status.running
    log = [(d["action"], d["worker"]) for d in plugin.decisions if d["action"] != "join"]
    assert log == [("pause", a.address), ("resume", a.address)]
    assert plugin.decisions[-1]["seen_gpu_memory_fraction"] == pytest.approx(0.6, abs=0.01)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_bad_metric_values_are_ignored(c, s, a, b, w):
    plugin = await _plugin(c, s)
    garbage = [
        {"gpu_utilization": "hot", "gpu_memory_used": float("nan"), "gpu-memory-total": -1},
        {"gpu_utilization": None, "gpu_memory_used": "lots", "gpu-memory-total": float("inf")},
        {"gpu_utilization": float("nan"), "gpu_memory_used": -5, "gpu-memory-total": 2**30},
        {"gpu_utilization": 1e9, "gpu_memory_used": 2**40, "gpu-memory-total": "16GB"},
        {},
    ]
    for metrics in garbage:
        for ws in s.workers.values():
            ws.metrics = {**ws.metrics, **metrics}
            if not metrics:
                for k in ("gpu_utilization", "gpu_memory_used", "gpu-memory-total"):
                    ws.metrics.pop(k, None)
        applied = plugin.run_once()
        assert _actions(applied, "pause") == []
        snap = plugin.take_snapshot()
        for view in snap.workers.values():
            m = view.metrics
            for v in (m.gpu_utilization, m.gpu_memory_used, m.gpu_memory_total):
                assert v is None or (math.isfinite(v) and v >= 0)
    ws = s.workers[a.address]
    ws.metrics = "not even a dict"
    plugin.run_once()
    plugin.speeds.observe(a.address, "g", float("nan"))
    plugin.speeds.observe(a.address, "g", -1.0)
    plugin.run_once()
    assert plugin.speeds.speed(a.address) == 1.0


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
@pytest.mark.slow
async def test_memory_policy_moves_results_and_keeps_them_readable(c, s, a, b, w):
    from blockflow.testing import simulated_kernel

    await install_simulated_devices(c, {}, default=SimulatedDevice(device_memory=GiB))
    plugin = await _plugin(c, s, policy="memory")
    futs = [c.submit(simulated_kernel, i, work=0.0, output_bytes=100 * 2**20, pure=False,
                     workers=[a.address]) for i in range(6)]
    await wait(futs)
    await c.run(set_tenant, Tenant(0, int(0.4 * GiB)), workers=[a.address])
    await _heartbeats(c)
    frac = s.workers[a.address].metrics["gpu_memory_used"] / GiB
    assert frac >= 0.85
    for _ in range(4):
        await c.amm.run_once()
        await asyncio.sleep(0.3)
        await _heartbeats(c)
    held_on_a = [f for f in futs if a.address in {ws.address for ws in s.tasks[f.key].who_has}]
    assert len(held_on_a) < 6
    assert any(d["action"] == "memory-move" for d in plugin.decisions)
    assert [blk.payload for blk in await c.gather(futs)] == list(range(6))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 4)
async def test_static_capacity_assigns_blocks_in_proportion_to_capacity(c, s, *workers):
    import dask.array as da

    speeds = [1, 1, 0.5, 0.25]
    await install_simulated_devices(
        c, {wk.address: SimulatedDevice(speed=sp) for wk, sp in zip(workers, speeds)})
    plugin = await _plugin(c, s, policy="static-capacity")
    x = blockflow.map_blocks(lambda blk: blk + 1, da.zeros(110, chunks=1), name="static")
    y = c.persist(x)
    await wait(y)
    counts = [sum(1 for ts in s.tasks.values() if ts.key[0].startswith("blockflow-static")
                  and wk.address in {w.address for w in ts.who_has}) for wk in workers]
    assert counts == [40, 40, 20, 10]
    assert {d["action"] for d in plugin.decisions} >= {"assign"}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_static_round_robin_assigns_blocks_in_turn(c, s, *workers):
    import dask.array as da

    await _plugin(c, s, policy="static-round-robin")
    x = blockflow.map_blocks(lambda blk: blk + 1, da.zeros(30, chunks=1), name="rr")
    y = c.persist(x)
    await wait(y)
    counts = [sum(1 for ts in s.tasks.values() if ts.key[0].startswith("blockflow-rr")
                  and wk.address in {w.address for w in ts.who_has}) for wk in workers]
    assert counts == [10, 10, 10]


@gen_cluster(client=True)
async def test_boundary_matches_this_distributed(c, s, a, b):
    """Fails loudly if distributed changes an internal blockflow relies on."""
    check_scheduler(s)
    from blockflow import _distributed

    _distributed.check_worker_state(s.workers[a.address])
    _distributed.check_worker(a)
    _distributed.check_dashboard()
    ws = s.workers[a.address]
    assert _distributed.set_worker_status(s, a.address, True, "test-pause")
    assert ws.status == Status.paused and ws not in s.running
    assert _distributed.set_worker_status(s, a.address, False, "test-resume")
    assert ws.status == Status.running
    assert not _distributed.set_worker_status(s, "tcp://127.0.0.1:1", True, "gone")
    data = await c.scatter(list(range(6)), workers=[a.address])
    futs = c.map(slowinc, data, delay=0.2)
    await async_wait_until(lambda: len(s.workers[a.address].processing) >= 6,
                           message="6 tasks processing on a")
    waiting = list(_distributed.waiting_tasks(s, thieves=[b.address])[a.address])
    assert waiting and all(isinstance(t, _distributed.TaskView) for t in waiting)
    last = waiting[0]  # lowest priority first
    assert last.key == max(s.workers[a.address].processing, key=lambda ts: ts.priority).key
    assert last.duration > 0 and last.group == "slowinc"
    assert last.comm_cost[b.address] >= 0 and last.allowed_workers is None
    assert last.input_bytes > 0
    views = _distributed.worker_views(s)
    assert views[a.address].processing == 6 and views[b.address].processing == 0
    assert _distributed.move_task(s, last.key, a.address, b.address)
    assert not _distributed.move_task(s, last.key, a.address, b.address)  # pending already
    await wait(futs)
    assert b.address in {w.address for w in s.tasks[last.key].who_has}
    held = _distributed.held_results(s)[b.address]
    assert last.key in {r.key for r in held}


@gen_cluster(client=True, nthreads=[])
async def test_checks_run_again_when_the_first_worker_joins(c, s):
    """A scheduler started with --preload has no worker when the plugin starts."""
    from distributed import Worker

    await c.register_plugin(Rebalancer(policy="off", interval=0))
    plugin = s.plugins["blockflow-rebalancer"]
    assert not plugin._worker_checked
    async with Worker(s.address, nthreads=1):
        await async_wait_until(lambda: s.workers, message="the worker to join")
        assert plugin._worker_checked


def test_speed_model_learns_relative_speed_with_a_prior():
    m = SpeedModel()
    assert m.speed("new") == 1.0
    for _ in range(40):
        m.observe("fast", "g", 0.05)
        m.observe("slow", "g", 0.20)
    m.update()
    assert m.speed("slow") / m.speed("fast") == pytest.approx(0.25, rel=0.1)
    m.forget("slow")
    assert m.speed("slow") == 1.0 and m.observations("slow") == 0


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
@pytest.mark.slow
async def test_knowing_nothing_it_leaves_balancing_to_distributed(c, s, a, b, w):
    """No GPU metrics, no speeds measured: blockflow moves nothing and distributed's own
    work stealing (left running) spreads the tasks, as in plain Dask."""
    plugin = await _plugin(c, s)
    data = await c.scatter(list(range(12)), workers=[a.address])
    futs = c.map(slowinc, data, delay=0.2)  # every task follows its data to a
    await async_wait_until(lambda: len(s.workers[a.address].processing) >= 12 or any(
        s.workers[x].processing for x in (b.address, w.address)),
        message="12 tasks processing on a, or any on b or w")
    applied = plugin.run_once()
    assert _actions(applied, "move") == [] and not plugin.status()["balancing"]
    assert s.periodic_callbacks["stealing"].is_running()
    await wait(futs)
    assert await c.gather(futs) == [i + 1 for i in range(12)]
    ran = Counter(next(iter(s.tasks[f.key].who_has)).address for f in futs)
    assert ran[a.address] < 12  # distributed stole some


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
@pytest.mark.slow
async def test_with_known_speeds_it_balances_on_queue_and_speed(c, s, a, b, w):
    plugin = await _plugin(c, s)
    assert all("gpu-memory-total" not in ws.metrics for ws in s.workers.values())
    for addr, d in ((a.address, 0.4), (b.address, 0.1), (w.address, 0.1)):
        for _ in range(6):
            plugin.speeds.observe(addr, "earlier", d)
    data = await c.scatter(list(range(12)), workers=[a.address])
    futs = c.map(slowinc, data, delay=0.2)  # every task follows its data to a
    await async_wait_until(lambda: len(s.workers[a.address].processing) >= 12,
                           message="12 tasks processing on a")
    applied = plugin.run_once()
    assert plugin.status()["balancing"]
    assert not s.periodic_callbacks["stealing"].is_running()
    (handover,) = [d for d in plugin.decisions if d["action"] == "suspend-stealing"]
    assert handover["seen_speeds"][a.address] < handover["seen_speeds"][b.address]
    assert not _actions(applied, "pause")
    moves = _actions(applied, "move")
    assert len(moves) >= 6 and {d.target for d in moves} == {b.address, w.address}
    assert all(d.seen["gpu_utilization"] is None for d in moves)
    await wait(futs)
    assert await c.gather(futs) == [i + 1 for i in range(12)]
    ran = Counter(next(iter(s.tasks[f.key].who_has)).address for f in futs)
    assert ran[a.address] < 12 and ran[b.address] + ran[w.address] >= 6


@pytest.mark.parametrize("kwargs, message", [
    (dict(memory_low=0.99), "blockflow rebalancer: memory_low=0.99 must be below "
     "memory_high=0.85: a worker paused at memory_high resumes once it falls below "
     "memory_low; lower memory_low or raise memory_high (settings "
     "blockflow.rebalancer.memory-low / memory-high)."),
    (dict(hot_low=80, hot_high=80), "blockflow rebalancer: hot_low=80 must be below "
     "hot_high=80: a worker paused at hot_high resumes once it falls below hot_low; lower "
     "hot_low or raise hot_high (settings blockflow.rebalancer.hot-low / hot-high)."),
])
def test_dynamic_policy_refuses_resume_thresholds_at_or_above_pause(kwargs, message):
    from blockflow.scheduling.policies import DynamicPolicy

    with pytest.raises(ValueError) as info:
        DynamicPolicy(**kwargs)
    assert str(info.value) == message


@gen_cluster(client=True)
async def test_a_changed_internal_fails_loudly_naming_it(c, s, a, b):
    from blockflow._distributed import IncompatibleSchedulerError

    ws = s.workers[a.address]
    saved_metrics = ws.metrics
    ws.metrics = None
    try:
        with pytest.raises(IncompatibleSchedulerError, match=r"WorkerState\.metrics"):
            check_scheduler(s)
    finally:
        ws.metrics = saved_metrics
    stealing = s.extensions["stealing"]
    stealing.move_task_request = lambda ts, thief: None  # a changed signature
    try:
        with pytest.raises(IncompatibleSchedulerError,
                           match=r"WorkStealing\.move_task_request\(ts, victim, thief\).*"
                                 r"distributed 2026\.7\.1"):
            check_scheduler(s)
    finally:
        del stealing.move_task_request
    check_scheduler(s)


def first_sum(block, delay):
    time.sleep(delay)
    return float(block[0])


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
@pytest.mark.slow
async def test_data_bound_tasks_leave_balancing_to_distributed_whatever_the_speeds(c, s, a, b,
                                                                                   w):
    """Issue 39: with speeds known to differ blockflow paused distributed's stealing, then
    refused every move of tasks whose inputs (32 MiB) take longer to send than the move
    gains: nothing balanced (1.12x plain Dask). Data-bound work stays with distributed's
    stealing, as in plain Dask: not suspended, nothing moved by blockflow."""
    plugin = await _plugin(c, s)
    for addr, d in ((a.address, 0.4), (b.address, 0.1), (w.address, 0.1)):
        for _ in range(6):
            plugin.speeds.observe(addr, "earlier", d)
    s.bandwidth = 100e6  # distributed's default: 32 MiB in 0.34 s, a task computes 0.2 s
    data = await c.scatter([np.full(4 * 2**20, float(i)) for i in range(6)],
                           workers=[a.address])
    futs = c.map(first_sum, data, delay=0.2)  # every task follows its data to a
    await async_wait_until(lambda: len(s.workers[a.address].processing) >= 6,
                           message="6 tasks processing on a")
    applied = plugin.run_once()
    assert not _actions(applied, "move") and not plugin.status()["balancing"]
    assert s.periodic_callbacks["stealing"].is_running()
    assert not [d for d in plugin.decisions if d["action"] == "suspend-stealing"]
    assert await c.gather(futs) == [float(i) for i in range(6)]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 4, timeout=120)
@pytest.mark.slow
async def test_cold_start_on_one_worker_spreads_like_plain_dask(c, s, *workers):
    """24 inputs made on worker 0 of four identical devices, one 0.3 s kernel each.

    blockflow once learned worker 0's speed as 27-575 from its first, cold task, suspended
    distributed's stealing and ran all 24 kernels on worker 0 (2.6x slower than plain Dask).
    """
    from blockflow.testing import simulated_kernel

    w0 = workers[0].address
    await install_simulated_devices(c, {}, default=SimulatedDevice())
    await c.register_plugin(Rebalancer(policy="dynamic", interval=0.1))
    plugin = s.plugins["blockflow-rebalancer"]
    data = await c.scatter(list(range(24)), workers=[w0])
    futs = c.map(simulated_kernel, data, work=0.3, pure=False)
    await wait(futs)
    assert [blk.payload for blk in await c.gather(futs)] == list(range(24))
    ran = Counter(next(iter(s.tasks[f.key].who_has)).address for f in futs)
    assert ran[w0] <= 12 and len(ran) >= 3, ran
    for addr in s.workers:
        assert 1 / 1.5 <= plugin.speeds.speed(addr) <= 1.5, plugin.status()["speeds"]
    assert not [d for d in plugin.decisions if d["action"] == "suspend-stealing"]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, timeout=120)
@pytest.mark.slow
async def test_a_resumed_worker_is_judged_on_what_it_does_next(c, s, a, b, w):
    await install_simulated_devices(c, {}, default=SimulatedDevice())
    plugin = await _plugin(c, s)
    for addr, d in ((a.address, 0.4), (b.address, 0.1), (w.address, 0.1)):
        for _ in range(8):  # a looked slow while another tenant shared its GPU
            plugin.speeds.observe(addr, "kernel", d)
    await c.run(set_tenant, Tenant(95, 0), workers=[a.address])
    await _heartbeats(c)
    assert [d.action for d in plugin.run_once()] == ["pause"]
    assert plugin.speeds.speed(a.address) < 0.5 * plugin.speeds.speed(b.address)
    await c.run(set_tenant, Tenant(0, 0), workers=[a.address])
    await _heartbeats(c)
    assert [d.action for d in plugin.run_once()] == ["resume"]
    assert plugin.speeds.speed(a.address) == 1.0
    assert plugin.speeds.confidence(a.address) == 0.0
    # its share of the next work stays with it: nothing is moved off it for being "slow"
    data = []
    for wk in (a, b, w):
        data += await c.scatter(list(range(4)), workers=[wk.address])
    futs = c.map(slowinc, data, delay=0.5)
    await async_wait_until(lambda: sum(len(ws.processing) for ws in s.workers.values()) >= 12
                           or any(f.status == "finished" for f in futs), timeout=120,
                           message="12 tasks processing, or one finished")
    moved_off_a = [d for d in plugin.run_once() if d.action == "move" and d.worker == a.address]
    assert moved_off_a == []
    await wait(futs)
    ran = Counter(next(iter(s.tasks[f.key].who_has)).address for f in futs)
    assert ran[a.address] >= 3, ran


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_reapplied_pauses_and_closing_act_through_the_actuator_only(c, s, a, b):
    """A worker's own status message that sets it running is paused again by a ``reapply``
    command; closing restores stealing and releases holds through the handler table,
    logging nothing."""
    plugin = await _plugin(c, s, policy="off")
    snap = plugin.take_snapshot()
    assert plugin.apply(Decision(Action.SUSPEND_STEALING, "", "test"), snap)
    assert plugin.apply(Decision(Action.PAUSE, a.address, "test"), snap)
    assert plugin.apply(Decision(Action.HOLD, b.address, "test"), snap)
    assert not s.periodic_callbacks["stealing"].is_running()
    # the workers' own status messages set them running again
    for addr in (a.address, b.address):
        s.handle_worker_status_change(Status.running, s.workers[addr], stimulus_id="own")
    logged = len(plugin.decisions)
    plugin.run_once()
    assert {s.workers[x].status for x in (a.address, b.address)} == {Status.paused}
    assert len(plugin.decisions) == logged  # re-applied pauses are not logged
    await plugin.close()
    assert s.periodic_callbacks["stealing"].is_running()
    assert s.workers[b.address].status == Status.running and not plugin.held
    assert s.workers[a.address].status == Status.paused  # a pause outlives a hold
    assert len(plugin.decisions) == logged


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_an_unregistered_plugin_hands_back_stealing_and_stops_its_loop(c, s, a, b):
    """distributed's ``unregister_scheduler_plugin`` does not call ``close()``: the plugin's
    next tick sees it is gone and hands back what it holds."""
    await c.register_plugin(Rebalancer(policy="dynamic", interval=0.05))
    plugin = s.plugins["blockflow-rebalancer"]
    plugin.act([Decision(Action.SUSPEND_STEALING, "", "speeds differ (test)")])
    assert not s.periodic_callbacks["stealing"].is_running()
    assert "blockflow-rebalancer" in s.periodic_callbacks

    await c.unregister_scheduler_plugin("blockflow-rebalancer")

    await async_wait_until(lambda: "blockflow-rebalancer" not in s.periodic_callbacks,
                           message="the unregistered plugin's loop to stop")
    assert s.periodic_callbacks["stealing"].is_running()
    assert plugin.run_once() == []  # it acts no more


def _gpu_dependent(root, i, seconds):
    """A dependent that needs ``GPU=1``: ``(worker address, start, stop)``."""
    from distributed import get_worker

    start = time.time()
    time.sleep(seconds)
    return get_worker().address, start, time.time()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1, {"resources": {"GPU": 1}})] * 2,
             timeout=120)
async def test_restricted_dependents_of_a_tiny_root_spread_over_the_gpus(c, s, a, b):
    """dask/distributed#8177: a tiny root, four 1 s dependents needing ``GPU=1`` on two
    workers with one GPU each. distributed places every dependent with the root's output
    and stealing takes one (3 + 1, 3 s); blockflow hands the unmeasured restricted tasks to
    the idle GPU (the input is tiny) before any has finished: 2 + 2."""
    import dask

    await c.register_plugin(Rebalancer(policy="dynamic", interval=0.1))
    root = dask.delayed(lambda: 1)(dask_key_name="tiny-root")
    with dask.annotate(resources={"GPU": 1}):
        deps = [dask.delayed(_gpu_dependent)(root, i, 1.0, dask_key_name=("gpu-dep", i))
                for i in range(4)]
    ran = await c.gather(c.compute(deps))
    assert Counter(w for w, _, _ in ran) == {a.address: 2, b.address: 2}, ran
    # blockflow gave the idle GPU a dependent before any had finished (distributed's
    # stealing, left alone, took one only after 0.9 s of the idle GPU)
    plugin = s.plugins["blockflow-rebalancer"]
    first_stop = min(stop for _, _, stop in ran)
    moves = [d for d in plugin.decisions if d["action"] == "move" and "gpu-dep" in d["key"]]
    assert moves and moves[0]["time"] < first_stop, (moves, ran)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, timeout=120)
async def test_a_task_that_ran_through_a_pause_is_no_evidence_after_the_resume(c, s, a, b, w):
    """Issue 39, a brief pause: blockflow pauses a worker whose GPU another tenant takes and
    judges it afresh when it resumes; but the task it was running through the pause ended
    after the resume and was taken for its speed now (half), so the worker was held back
    and its tasks moved off (75 moves in one run, worker 0 ran 44 of a fair 55 blocks)."""
    from blockflow.testing import simulated_kernel

    await install_simulated_devices(c, {}, default=SimulatedDevice(device_memory=GiB))
    plugin = await _plugin(c, s)
    warm = [c.submit(simulated_kernel, i, work=0.2, workers=[wk.address], pure=False)
            for wk in (a, b, w) for i in range(3)]
    await wait(warm)
    plugin.run_once()
    assert plugin.speeds.recent_speed(a.address) == pytest.approx(1.0, rel=0.5)
    # another tenant fills its device memory and slows its kernels (a tenth of the speed)
    # while a task runs: paused; the tenant leaves before the task ends: resumed
    await c.run(set_speed, 0.1, workers=[a.address])
    through = c.submit(simulated_kernel, 9, work=0.2, workers=[a.address], pure=False)
    await async_wait_until(lambda: any(
        ts.key == through.key for ts in s.workers[a.address].executing),
        message="the task running on the worker to pause")
    await c.run(set_tenant, Tenant(0, int(0.9 * GiB)), workers=[a.address])
    await _heartbeats(c)
    assert [d.action for d in plugin.run_once()] == ["pause"]
    await c.run(set_tenant, Tenant(0, 0), workers=[a.address])
    await c.run(set_speed, 1.0, workers=[a.address])
    await _heartbeats(c)
    assert [d.action for d in plugin.run_once()] == ["resume"]
    assert not through.done()  # (2 s at a tenth of the speed)
    await wait(through)
    plugin.run_once()
    # what it ran through the pause says nothing of its speed now
    assert plugin.speeds.recent_speed(a.address) is None
    assert plugin.speeds.speed(a.address) == 1.0
    assert not [d for d in plugin.decisions if d["action"] == "hold"]
