"""Speculative backup copies of straggling blockflow kernels.

The rule on plain data (which running task gets a copy, where, within what budget), then on
real clusters of simulated GPU workers: a device that slows down mid-task has its task
overtaken by a copy on an idle device (results right, each block once, the decision log
saying so), kernels marked ``speculative=False`` are never copied, identical devices get no
copies, and when the original finishes first the copy is cancelled and its result dropped.
"""

from __future__ import annotations

import logging
import time

import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster
from distributed.utils_test import gen_cluster
from loadaware import async_wait_until, scaled, wait_until

import blockflow
from blockflow import _distributed
from blockflow.scheduling import speculation as _speculation
from blockflow.scheduling.view import workers_info
from blockflow.scheduling import Rebalancer
from blockflow.scheduling.policies import ClusterSnapshot, DynamicPolicy
from blockflow.testing import restart_clock, simulated_cluster, simulated_kernel


def _worker(addr, *, processing=0, speed=1.0, nthreads=1):
    from blockflow._distributed.metrics import WorkerMetrics

    return _distributed.WorkerView(
        address=addr, nthreads=nthreads, status="running", paused_by_blockflow=False,
        metrics=WorkerMetrics(None, None, None, None, None), speed=speed,
        processing=processing, executing=min(processing, nthreads), occupancy=0.0)


def _running(key, elapsed, duration=1.0, *, kernel=True, measured=True, input_bytes=0):
    return _distributed.RunningTask(key=key, group="blockflow-k", elapsed=elapsed,
                                    duration=duration, duration_measured=measured,
                                    input_bytes=input_bytes, kernel=kernel)


def _snap(workers, running, backups=None, bandwidth=1e9, queued=0, held=frozenset()):
    return ClusterSnapshot(time=0.0, workers={w.address: w for w in workers},
                           running=running, backups=backups or {}, bandwidth=bandwidth,
                           queued=queued, held=frozenset(held))


def _policy(**kw):
    kw.setdefault("backup_slots", 0.1)
    kw.setdefault("backup_ratio", 2.0)
    kw.setdefault("backup_min_elapsed", 0.5)
    return DynamicPolicy(speculation=True, **kw)


# --- the rule, on plain data ------------------------------------------------------------------


def test_a_task_on_a_slow_worker_is_copied_to_the_fastest_idle_worker():
    ws = [_worker("slow", processing=1, speed=0.2), _worker("idle-fast", speed=1.0),
          _worker("idle-slower", speed=0.5), _worker("busy", processing=1)]
    # expected 1/0.2 = 5 s, 1 s elapsed: 4 s to end vs 1 s for a copy on "idle-fast"
    out = _policy().backup.backups(_snap(ws, {"slow": [_running("k", 1.0)]}))
    assert [(d.action, d.worker, d.target, d.key) for d in out] == [
        ("speculate", "slow", "idle-fast", "k")]
    assert out[0].seen["time_to_end"] == pytest.approx(4.0)
    assert out[0].seen["backup_time"] == pytest.approx(1.0)


def test_an_overrunning_task_is_copied_only_once_it_ran_well_beyond_a_copys_time():
    ws = [_worker("a", processing=1), _worker("b")]
    # speed 1 believed: expected 1 s; overran, so its time to end is taken as its elapsed
    assert not _policy().backup.backups(_snap(ws, {"a": [_running("k", 1.5)]}))  # 1.5 < 2 x 1
    assert _policy().backup.backups(_snap(ws, {"a": [_running("k", 2.5)]}))  # 2.5 > 2 x 1


def test_nothing_is_copied_without_a_measured_duration_an_idle_worker_or_budget():
    ws = [_worker("slow", processing=1, speed=0.2), _worker("idle")]
    run = {"slow": [_running("k", 1.0)]}
    assert not _policy().backup.backups(_snap(ws, {"slow": [_running("k", 1.0, measured=False)]}))
    assert not _policy().backup.backups(_snap(ws, {"slow": [_running("k", 1.0, kernel=False)]}))
    assert not _policy().backup.backups(_snap(ws, {"slow": [_running("k", 0.2)]}))  # too young
    busy = [ws[0], _worker("idle", processing=1)]
    assert not _policy().backup.backups(_snap(busy, run))  # nobody idle
    # one copy already runs (budget: 10 % of 2 threads, at least 1)
    assert not _policy().backup.backups(_snap(ws, run, backups={"other": "x"}))
    # the idle worker already runs a copy (outside the scheduler's count)
    ws3 = ws + [_worker("third")]
    out = _policy(backup_slots=1.0).backup.backups(_snap(ws3, run, backups={"other": "idle"}))
    assert [d.target for d in out] == ["third"]
    assert not DynamicPolicy(speculation=False).backup.backups(_snap(ws, run))
    # new work first: a worker a waiting task moves to this tick, or the scheduler's queue
    assert not _policy().backup.backups(_snap(ws, run), taken=frozenset({"idle"}))
    queued = _snap(ws, run)
    queued.queued = 3
    assert not _policy().backup.backups(queued)


# --- holding a slowed worker back from the queue's last tasks ---------------------------------


def _slowed_fleet(recent=0.2):
    ws = [_worker("w0", processing=1), _worker("w1", processing=1),
          _worker("w2", processing=1), _worker("w3", processing=1)]
    ws[0].recent_speed = recent  # its latest task took 1 / recent times the others'
    running = {a: [_running(f"k-{a}", 0.1)] for a in ("w0", "w1", "w2", "w3")}
    return ws, running


def test_a_slowed_worker_is_held_back_when_the_others_empty_the_queue_before_it():
    ws, running = _slowed_fleet()
    # its running task ends in 1 s / 0.2 - 0.1 s = 4.9 s, its next takes 5 s more; the other
    # three do the 5 queued + that one in 2 s
    out = _policy().hold.holds(_snap(ws, running, queued=5))
    assert [(d.action, d.worker) for d in out] == [("hold", "w0")]
    assert out[0].seen["own_time"] == pytest.approx(9.9)
    assert out[0].seen["others_time"] == pytest.approx(2.0)
    # tasks the others hold but have not started count as theirs: with 2 waiting on each,
    # 5 queued + 1 + 6 take them 4 s
    busy = [ws[0]] + [_worker(w.address, processing=3) for w in ws[1:]]
    out = _policy().hold.holds(_snap(busy, running, queued=5))
    assert out[0].seen["others_time"] == pytest.approx(4.0)
    assert not _policy().hold.holds(_snap(busy, running, queued=25))  # (25 + 7) / 3 > 9.9
    # a long queue: it helps empty it, so it keeps pulling (30 + 1 tasks take 3 x 1 s ...)
    assert not _policy().hold.holds(_snap(ws, running, queued=30))
    # no queue: nothing to hold it from; and without backup copies nothing is held
    assert not _policy().hold.holds(_snap(ws, running, queued=0))
    assert not DynamicPolicy(speculation=False).hold.holds(_snap(ws, running, queued=5))


def test_only_clear_slowness_holds_a_worker_back():
    """A latest task 1.5x slower than the others' is noise as often as not: the worker keeps
    pulling. A task running past its duration bounds the speed from the running task."""
    ws, running = _slowed_fleet(recent=0.67)
    assert not _policy().hold.holds(_snap(ws, running, queued=2))
    ws, running = _slowed_fleet(recent=None)
    running["w0"] = [_running("k-w0", 4.0)]  # 4 s into a 1 s task: speed <= 0.25
    assert [d.worker for d in _policy().hold.holds(_snap(ws, running, queued=2))] == ["w0"]


def test_a_held_worker_is_released_once_the_queue_is_empty():
    ws, running = _slowed_fleet()
    ws[0].status = "paused"
    kept = _policy().hold.holds(_snap(ws, running, queued=2, held={"w0"}))
    assert kept == []  # still held: the condition holds
    out = _policy().hold.holds(_snap(ws, running, queued=0, held={"w0"}))
    assert [(d.action, d.worker) for d in out] == [("release", "w0")]


def test_a_held_worker_stays_held_while_no_kernel_runs_at_a_tick():
    """Between two short kernels, a tick may find no kernel running on any worker (their
    input tasks run, or a result is on its way): the held worker must stay held while the
    queue lasts. It was released at such a tick with 4 of 96 blocks queued, pulled a block
    it needed 0.63 s for, and the stage waited for it (benchmarks/stragglers.py)."""
    ws, running = _slowed_fleet()
    policy = _policy()
    assert [d.action for d in policy.hold.holds(_snap(ws, running, queued=5))] == ["hold"]
    ws[0].status = "paused"
    idle = {a: [] for a in running}  # nothing runs at this tick
    assert policy.hold.holds(_snap(ws, idle, queued=4, held={"w0"})) == []
    # the queue is empty: released, and the stage's duration is forgotten
    out = policy.hold.holds(_snap(ws, idle, queued=0, held={"w0"}))
    assert [(d.action, d.worker) for d in out] == [("release", "w0")]
    ws[0].status = "running"
    assert policy.hold.holds(_snap(ws, idle, queued=4)) == []  # no kernel measured in this stage
    # a new graph: its stage's kernels are measured afresh, even while something is queued
    assert [d.action for d in policy.hold.holds(_snap(ws, running, queued=5))] == ["hold"]
    graph = _snap(ws, {})
    graph.event = "graph"
    list(policy.run(graph))
    assert policy.hold.holds(_snap(ws, idle, queued=5)) == []


def test_an_evidently_slowed_worker_receives_no_moved_work():
    ws, running = _slowed_fleet()
    policy = _policy()
    snap = _snap(ws, running)
    assert policy.hold.slowed_now(snap, "w0") and not policy.hold.slowed_now(snap, "w1")
    assert all(d.target != "w0" for d in policy.move.moves(snap, set()))


def test_a_task_waiting_behind_the_straggler_does_not_hold_its_copy_back():
    """The straggler's worker holds a second task (one that became ready behind it, whose
    data is there): no idle worker takes it, so it must not stop the copy (it did: the slowed
    device ran on for 4 s while two devices idled)."""
    waiting = [_worker("slow", processing=2, speed=0.2), _worker("idle")]
    out = _policy().backup.backups(_snap(waiting, {"slow": [_running("k", 1.0)]}))
    assert [(d.worker, d.target) for d in out] == [("slow", "idle")]


def test_a_prefix_keeps_its_measured_duration_when_distributed_forgets_it():
    """distributed resets a prefix's average to -1 once one task runs past twice of it (and
    estimates 2x the longest run so far): the straggler would then look unmeasured."""
    from distributed.scheduler import TaskPrefix

    class Scheduler:  # what prefix_duration reads of a scheduler
        def _get_prefix_duration(self, prefix):
            return 2 * prefix.max_exec_time if prefix.duration_average < 0 else \
                prefix.duration_average

    sched, prefix = Scheduler(), TaskPrefix("blockflow-k")
    assert _distributed.prefix_duration(sched, prefix)[1] is False  # nothing measured yet
    prefix.add_duration("compute", 0.0, 0.5)
    assert _distributed.prefix_duration(sched, prefix) == (0.5, True)
    prefix.add_exec_time(3.0)  # a straggler: distributed forgets the average
    assert prefix.duration_average == -1
    assert _distributed.prefix_duration(sched, prefix) == (0.5, True)
    assert _distributed.prefix_duration(Scheduler(), prefix)[1] is False  # per scheduler


def test_the_copys_time_counts_sending_inputs_and_result():
    ws = [_worker("slow", processing=1, speed=0.25), _worker("idle")]
    # 4 s expected, 1 s elapsed: 3 s to end; compute 1 s + 2 x 1 GB at 1 GB/s = 3 s
    run = {"slow": [_running("k", 1.0, input_bytes=10**9)]}
    assert not _policy().backup.backups(_snap(ws, run, bandwidth=1e9))
    assert _policy().backup.backups(_snap(ws, run, bandwidth=1e11))


def test_the_longest_times_to_end_come_first_within_the_budget():
    ws = [_worker(f"s{i}", processing=1, speed=0.1) for i in range(3)] + [
        _worker(f"f{i}") for i in range(17)]
    run = {"s0": [_running("a", 1.0)], "s1": [_running("b", 3.0)], "s2": [_running("c", 2.0)]}
    out = _policy().backup.backups(_snap(ws, run))  # 20 threads x 10 % = 2 copies
    assert [d.key for d in out] == ["a", "c"]
    assert len({d.target for d in out}) == 2


def test_settings_are_read_from_the_blockflow_namespace():
    import dask

    with dask.config.set({"blockflow.speculation.enabled": False,
                          "blockflow.speculation.max-slots": 0.5}):
        p = DynamicPolicy()
    assert p.speculation is False and p.backup_slots == 0.5
    with dask.config.set({"blockflow.speculation.hold-slowdown": 4.0}):
        p = _policy()
    ws, running = _slowed_fleet(recent=0.3)  # 3.3x slower: held at 2x, not at 4x
    assert p.hold_slowdown == 4.0 and not p.hold.holds(_snap(ws, running, queued=5))
    assert _policy().hold.holds(_snap(ws, running, queued=5))


# --- on real clusters --------------------------------------------------------------------------


def _kernel(block, block_id=None, work=0.3):
    return np.array([simulated_kernel(block, op=np.sum, work=work)], dtype=object)


def _backups(client, since):
    st = blockflow.plugin_status(client, since=since)
    return ([d for d in st["decisions"] if d["action"] == "speculate"],
            [d for d in st["decisions"] if d["action"] == "backup"], st["speculation"])


def _warm(client):
    """Measured durations first (the rule copies nothing it has not measured)."""
    blockflow.map_blocks(_kernel, da.ones(8, chunks=1), dtype=object, name="warm",
                         work=0.2).compute()


@pytest.mark.slow
def test_a_device_slowed_mid_task_is_overtaken_by_a_backup_copy():
    """Worker 0 drops to a tenth of its speed 0.6 s into the run: its running block would
    take about 3 s more; a copy on an idle device wins, the block's result is right and
    comes once, and the log tells it."""
    with simulated_cluster(speeds=[1, 1, 1], silence_logs=logging.CRITICAL) as client:
        client.register_plugin(Rebalancer(policy="dynamic"))
        _warm(client)
        addrs = sorted(workers_info(client),
                       key=lambda a: int(workers_info(client)[a]["name"]))
        from blockflow.testing import set_speed

        x = da.arange(9, chunks=1)
        y = blockflow.map_blocks(_kernel, x, dtype=object, name="bench", work=0.5)
        since = time.time()
        fut = client.compute(y)
        time.sleep(0.6)
        client.run(set_speed, 0.1, workers=[addrs[0]])
        res = fut.result(timeout=scaled(60))
        assert sorted(int(b.payload) for b in res) == list(range(9))
        wait_until(lambda: _backups(client, since)[1], timeout=20, interval=0.1,
                   message="the backup's outcome in the decision log")
        spec, outcome, stats = _backups(client, since)
        assert spec and all(d["worker"] == addrs[0] for d in spec), spec
        assert [d["seen_outcome"] for d in outcome] == ["backup-won"] * len(outcome)
        assert stats["backup-won"] >= 1 and stats["launched"] >= 1
        assert spec[0]["target"] != addrs[0]
        # the dashboard page's state (and /blockflow/status.json) counts them
        from blockflow.dashboard.state import dashboard_state

        shown = client.run_on_scheduler(
            lambda dask_scheduler: dashboard_state(dask_scheduler)["speculation"])
        assert shown["launched"] == stats["launched"] and shown["won"] >= 1


@pytest.mark.slow
def test_identical_devices_get_no_copies_and_unmarked_kernels_none_ever():
    with simulated_cluster(speeds=[1, 1], speed_schedules={0: [(0.0, 0.1)]},
                           silence_logs=logging.CRITICAL) as client:
        client.register_plugin(Rebalancer(policy="dynamic"))
        _warm(client)
        since = time.time()
        client.run(restart_clock, time.time())
        # worker 0 is 10x slower throughout, but this kernel may not be copied
        y = blockflow.map_blocks(_kernel, da.arange(4, chunks=1), dtype=object,
                                 name="writes", speculative=False, work=0.2)
        assert sorted(int(b.payload) for b in y.compute()) == [0, 1, 2, 3]
        spec, _, _ = _backups(client, since)
        assert spec == []
    with simulated_cluster(speeds=[1, 1], silence_logs=logging.CRITICAL) as client:
        client.register_plugin(Rebalancer(policy="dynamic"))
        _warm(client)
        since = time.time()
        y = blockflow.map_blocks(_kernel, da.arange(12, chunks=1), dtype=object,
                                 name="same", work=0.2)
        assert sorted(int(b.payload) for b in y.compute()) == list(range(12))
        spec, _, stats = _backups(client, since)
        assert spec == [] and stats["launched"] == 0


def test_map_blocks_refuses_a_speculative_that_is_not_a_bool():
    with pytest.raises(TypeError, match="speculative must be True or False"):
        blockflow.map_blocks(lambda b: b, da.ones(4, chunks=2), speculative="no")


def test_the_first_result_wins_and_the_other_copy_is_cancelled():
    """Worker side, on a real in-process cluster: the original is slow, a copy is asked for
    through the worker's RPC handler; the copy wins, the original's simulated device stops
    (cancelled) and the task returns the copy's result. Then the reverse: the original
    finishes first, the copy is told to stop, and its result is dropped."""
    import asyncio

    from blockflow.testing import SimulatedDevice, SimulatedGPU

    async def running_on(address):
        """The key of the kernel that starts running on ``address`` (polled, 10 s at most)."""
        running = await async_wait_until(
            lambda: [k_ for (a, k_) in _speculation._running if a == address], timeout=10,
            message=f"a kernel to start on {address}")
        return running[0]

    async def main():
        async with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                asynchronous=True, dashboard_address=":0",
                                silence_logs=logging.CRITICAL) as cluster, \
                Client(cluster, asynchronous=True) as client:
            w0, w1 = sorted(cluster.workers.values(), key=lambda w: w.name)
            await client.register_plugin(SimulatedGPU({
                w0.name: SimulatedDevice(speed=0.05), w1.name: SimulatedDevice(speed=1.0)}))
            from blockflow.scheduling.speculation import SpeculationHandlers

            await client.register_plugin(SpeculationHandlers())
            x = da.from_array(np.arange(4.0), chunks=4)

            def k(block):
                return simulated_kernel(block, op=np.sum, work=0.2).payload

            y = blockflow.map_blocks(k, x, dtype=float, drop_axis=0, chunks=())
            fut = client.compute(y, workers=[w0.address])
            key = await running_on(w0.address)
            t0 = time.monotonic()
            reply = await w0.rpc(w0.address).blockflow_speculate(key=key, target=w1.address)
            assert reply["outcome"] == "backup-won", reply
            assert await fut == 6.0
            assert time.monotonic() - t0 < 4.0  # the original alone needs 4 s at speed 0.05

            # the reverse: the original (fast) wins; the copy on the slow device is stopped
            y2 = blockflow.map_blocks(k, x + 1, dtype=float, drop_axis=0, chunks=())
            fut2 = client.compute(y2, workers=[w1.address])
            key2 = await running_on(w1.address)
            reply2 = await w1.rpc(w1.address).blockflow_speculate(key=key2, target=w0.address)
            assert reply2["outcome"] in ("original-won", "finished-first"), reply2
            assert await fut2 == 10.0
            assert not _speculation._backups  # the copy is gone

    asyncio.run(main())


def test_kernels_run_in_the_tasks_own_thread_unless_the_cluster_copies_tasks():
    """A cluster without blockflow's copying plugin runs kernels exactly as plain Dask does
    (in the task's thread); with it, in a helper thread that still sees the worker."""
    import threading

    from distributed import get_worker

    from blockflow.scheduling.speculation import SpeculationHandlers

    def where(block):
        get_worker()  # the worker context reaches the kernel either way
        return np.array([threading.current_thread().name], dtype=object)

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0", silence_logs=logging.CRITICAL) as cluster, \
            Client(cluster) as client:
        x = da.ones(2, chunks=1)
        plain = blockflow.map_blocks(where, x, dtype=object, name="t1").compute()
        assert not any(n.startswith("blockflow-kernel") for n in plain), plain
        client.register_plugin(SpeculationHandlers())
        copied = blockflow.map_blocks(where, x, dtype=object, name="t2").compute()
        assert all(n.startswith("blockflow-kernel") for n in copied), copied
        marked = blockflow.map_blocks(where, x, dtype=object, name="t3",
                                      speculative=False).compute()
        assert not any(n.startswith("blockflow-kernel") for n in marked), marked


def _count_and_fail(x, *, path):
    with open(path, "a") as f:
        f.write("x\n")
    raise ConnectionResetError("flaky read")


def test_a_backup_copy_is_one_attempt_whatever_the_retries(tmp_path):
    """A copy is one more call of the kernel beside the task's own attempts: a kernel with
    side effects and retries=2 that fails in its copy runs there once, not 3 times; the
    original then runs on with its retries."""
    import functools

    from blockflow.core.kernel import Kernel

    path = str(tmp_path / "calls")
    kernel = Kernel(functools.partial(_count_and_fail, path=path), retries=2)

    async def copy(dask_worker):
        return await _speculation._backup_run(dask_worker, key="k", origin=None,
                                              call=(kernel, (1,), {}))

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0", silence_logs=logging.CRITICAL) as cluster, \
            Client(cluster) as client:
        (reply,) = client.run(copy).values()
    assert reply == {"status": "failed", "error": (
        "BlockKernelError: blockflow kernel '_count_and_fail' failed on a backup copy of "
        "task 'k': ConnectionResetError: flaky read")}
    assert len(open(path).read().splitlines()) == 1


# --- issue 27: the right evidence -------------------------------------------------------------


def _sized(x, gate=None):
    if gate is not None:
        from distributed import Event

        Event(gate).wait()
    return len(x)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_block_long_for_its_input_is_expected_long_not_a_straggler(c, s, a, b):
    """A block with 8x the input of the others was judged on the short blocks' duration
    (a copy of a 1.6 s block estimated at 0.229 s) and copied for nothing: its expected
    duration is the group's times its size over the group's typical size."""
    from distributed import Event

    await c.register_plugin(Rebalancer(policy="dynamic", interval=0))
    plugin = s.plugins["blockflow-rebalancer"]
    small = await c.scatter([np.ones(1000) for _ in range(6)])
    futs = [c.submit(_sized, x, key=f"sized-kernel-{i}") for i, x in enumerate(small)]
    assert await c.gather(futs) == [1000] * 6
    big = await c.scatter(np.ones(8000))
    gate = Event("sized-gate")
    running = c.submit(_sized, big, gate="sized-gate", key="sized-kernel-99")

    def started():
        plugin.speeds.update()
        snap = plugin.take_snapshot()
        return [t for ts in snap.running.values() for t in ts if t.key == running.key]

    await async_wait_until(lambda: bool(started()), timeout=20)
    (task,) = started()
    group_duration, _ = _distributed.prefix_duration(s, s.tasks[running.key].prefix)
    assert task.size == 64000 and plugin.speeds.size_factor("sized-kernel", 64000) == 8
    assert task.duration == pytest.approx(8 * group_duration)
    # a block at the typical size, or smaller, keeps the group's duration
    assert plugin.speeds.size_factor("sized-kernel", 8000) == 1.0
    assert plugin.speeds.size_factor("sized-kernel", 100) == 1.0
    assert plugin.speeds.size_factor("sized-kernel", None) == 1.0
    await gate.set()
    assert await running == 8000


def test_a_long_block_expected_long_gets_no_copy_on_identical_workers():
    ws = [_worker("a", processing=1), _worker("b")]
    # the group's 0.2 s for a block of 8x its size: 1.6 s expected, 1.2 s run, 0.4 s to end
    # vs 1.6 s for a copy; judged on 0.2 s it looked 6x overdue
    assert _policy().backup.backups(_snap(ws, {"a": [_running("k", 1.2, duration=0.2)]}))
    assert not _policy().backup.backups(_snap(ws, {"a": [_running("k", 1.2, duration=1.6)]}))


def test_a_slowed_worker_stays_held_while_the_others_hold_tasks_they_finish_sooner():
    """Queue empty, a device 10x slow from the start held back: released, it took a task
    from the fast devices (stealing, a move) and ran it 10x as long, deciding the stage (2
    of 5 coarse runs ended 1.4-1.5x the fast devices' bound)."""
    ws, running = _slowed_fleet(recent=0.1)
    ws[0].status = "paused"
    busy = [ws[0]] + [_worker(w.address, processing=2) for w in ws[1:]]
    policy = _policy()
    # queue empty, 3 tasks not started on the others: 4 x 1 s / 3 < 10 s for its next one
    assert policy.hold.holds(_snap(busy, running, queued=0, held={"w0"})) == []
    # nothing left waiting: released
    out = policy.hold.holds(_snap(ws, running, queued=0, held={"w0"}))
    assert [(d.action, d.worker) for d in out] == [("release", "w0")]
    # not held yet: held now, and its own waiting tasks then move off it where that pays
    ws[0].status = "running"
    out = policy.hold.holds(_snap(busy, running, queued=0))
    assert [(d.action, d.worker) for d in out] == [("hold", "w0")]


def test_a_cold_start_is_pessimistic_evidence_until_a_warm_task_replaces_it():
    from blockflow.scheduling.speed import SpeedModel

    m = SpeedModel()
    for w in ("f1", "f2"):
        for _ in range(4):
            m.observe(w, "g", 0.1)
    m.observe("slow", "g", 1.0)  # its first task of the group: cold, 10x the others'
    m.observe("f3", "g", 0.2)  # a cold start that paid 2x for its imports
    m.update()
    # a cold start may take cold_allowance (2) times a warm task: 0.2 here, 1.0 there
    assert m.recent_speed("slow") == pytest.approx(0.2, rel=1e-6)
    assert m.recent_speed("f3") == pytest.approx(1.0, rel=1e-6)
    assert m.speed("slow") == 1.0  # not its learned speed
    m.observe("slow", "g", 0.1)
    m.update()
    assert m.recent_speed("slow") == pytest.approx(1.0)
    # a block 8x the group's typical size that took 8x as long: no sign of a slowed worker
    for w in ("f1", "f2", "slow"):
        m.observe(w, "g", 0.1, size=1000)
    m.observe("f1", "g", 0.8, size=8000)
    m.update()
    assert m.size_factor("g", 8000) == 8
    assert m.recent_speed("f1") == pytest.approx(1.0)


def _held_with_inputs(input_seconds: float):
    """w0 10x slow and held back (it runs on, slowly), three 1 s tasks waiting on it whose
    inputs it holds and take ``input_seconds`` to send; w1 and w2 busy for 1 s each."""
    ws = [_worker("w0", processing=4), _worker("w1", processing=1),
          _worker("w2", processing=1)]
    ws[0].recent_speed, ws[0].status = 0.1, "paused"
    ws[0].occupancy, ws[1].occupancy, ws[2].occupancy = 4.0, 1.0, 1.0
    tasks = [_distributed.TaskView(key=("blockflow-k", i), group="blockflow-k", duration=1.0,
                                   input_bytes=10**8, comm_cost={"w1": input_seconds,
                                                                 "w2": input_seconds},
                                   comm_bytes={"w1": 10**8, "w2": 10**8})
             for i in (3, 2, 1)]
    running = {a: [_running(f"k-{a}", 0.1)] for a in ("w0", "w1", "w2")}
    return ClusterSnapshot(time=0.0, workers={w.address: w for w in ws}, running=running,
                           backups={}, bandwidth=1e9, held=frozenset({"w0"}),
                           waiting={"w0": tasks})


def test_a_held_workers_tasks_move_only_where_the_gain_pays_for_their_inputs():
    """Issue 39: tasks whose inputs are large next to their compute. A worker held back for
    slowness still runs the tasks it holds; they moved off it at once whatever their inputs
    (as off a worker that runs nothing), paying transfers plain Dask never makes (4.13 s
    against plain's 3.52 s, no backup launched). Now a move must gain more than twice its
    transfer (blockflow.scheduling.estimate.move_pays), as any move."""
    from blockflow.scheduling.estimate import move_pays

    # cheap inputs (10 ms): the held worker's 40 s queue moves to the fast ones
    moves = [d for d in _policy().move.moves(_held_with_inputs(0.01), set())
             if d.action == "move"]
    assert {d.worker for d in moves} == {"w0"} and len(moves) >= 2
    assert {d.target for d in moves} == {"w1", "w2"}
    # 0.9 s to send each input for a 1 s task: w0 finishes 40 s from now, w1 ~ 2.9 s; that
    # pays. But a held worker nearly through its queue keeps its tasks:
    snap = _held_with_inputs(0.9)
    snap.workers["w0"].occupancy = 0.35  # 3.5 s left at a tenth of the speed
    moved = [d for d in _policy().move.moves(snap, set()) if d.action == "move"]
    assert moved == [], moved  # 3.5 s here vs 2.9 s there: gains 0.6 s < 2 x 0.9 s
    assert move_pays(3.5, 1.9, 0.3, 0.1) and not move_pays(3.5, 2.9, 0.9, 0.1)


def test_a_held_worker_is_not_released_when_the_overrun_that_held_it_becomes_a_cold_start():
    """Issue 39, coarse stragglers: a device 10x slow from the start was held on its first
    block's overrun (speed <= 0.1); when that block ended, its cold start (counted at half
    its time) showed 0.2, and with 12 blocks queued it was released, took a block it needed
    2 s for, and the stage waited (worst of 5 at 1.44x the fast devices' bound)."""
    ws, _ = _slowed_fleet(recent=None)
    running = {a: [_running(f"k-{a}", 0.1, duration=0.2)] for a in ("w1", "w2", "w3")}
    running["w0"] = [_running("k-w0", 1.9, duration=0.2)]  # 0.2 s block, 1.9 s running
    busy = [ws[0]] + [_worker(w.address, processing=2) for w in ws[1:]]
    policy = _policy()
    out = policy.hold.holds(_snap(busy, running, queued=12))
    assert [(d.action, d.worker) for d in out] == [("hold", "w0")]
    # the block ended: its cold start says 0.2 (a 5x slow device: 1 s for its next block,
    # while the others run 12 + 1 + 3 blocks of 0.2 s in 1.07 s); it is still evidently slow,
    # and judged at the 0.1 it showed
    busy[0].status, busy[0].recent_speed, busy[0].processing = "paused", 0.2, 0
    del running["w0"]
    out = policy.hold.holds(_snap(busy, running, queued=12, held={"w0"}))
    assert out == [], out
    # its latest task shows it fast again: released
    busy[0].recent_speed = 1.0
    out = policy.hold.holds(_snap(busy, running, queued=12, held={"w0"}))
    assert [(d.action, d.worker) for d in out] == [("release", "w0")]
