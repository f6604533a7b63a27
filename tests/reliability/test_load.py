"""Load: 20,000 tasks through 4 workers with the dynamic policy active, and a decision log
that stays within ``blockflow.rebalancer.decision-log-size`` however many decisions come."""

from __future__ import annotations

import time

import dask
import pytest

import blockflow
from blockflow.scheduling.view import workers_info
from blockflow.scheduling import Rebalancer
from blockflow.testing import set_tenant, simulated_cluster

from loadaware import wait_until

# 20,000 (50,000 until 2026-12-04: 170 s of a loaded 2-core machine's suite). The log's
# bound is hit by the pause/resume swings below (108 decisions for a log of 100), however
# many tasks run; the tasks are the load the control loop decides under.
N_TASKS = 20_000
LOG_SIZE = 100


def inc(x):
    return x + 1


def _wait_while_progressing(futures, *, stall: float) -> None:
    """Wait for every future; fail only when none finished for ``stall`` seconds (a bound
    that holds on a loaded machine, unlike one on the total time)."""
    done, last_change = -1, time.monotonic()
    while True:
        now_done = sum(f.done() for f in futures)
        if now_done == len(futures):
            return
        if now_done != done:
            done, last_change = now_done, time.monotonic()
        elif time.monotonic() - last_change > stall:
            raise AssertionError(f"no task finished for {stall:g} s ({done} of "
                                 f"{len(futures)} done)")
        time.sleep(0.5)


async def _heartbeat(dask_worker):
    await dask_worker.heartbeat()


@pytest.mark.slow
# 20,000 tasks are CPU-bound: a minute alone on a loaded 2-core machine, longer beside the
# suite's other processes; its own bound is a stall (no task finishing), not the total time
@pytest.mark.timeout(900)
def test_20000_tasks_with_the_dynamic_policy_and_a_bounded_decision_log():
    with dask.config.set({"blockflow.rebalancer.decision-log-size": LOG_SIZE}), \
            simulated_cluster(speeds=(1, 1, 1, 1), threads_per_worker=4,
                              processes=False) as client:  # 4 threads: less idle time
        client.register_plugin(Rebalancer(policy="dynamic"))  # ticks every 100 ms
        workers = sorted(workers_info(client))
        hot = workers[1:]  # never all: the last usable worker is never paused
        start = time.monotonic()
        futures = client.map(inc, range(N_TASKS))
        # Meanwhile, other tenants come and go on three GPUs: each swing is three pauses or
        # three resumes, decided by the control loop while the tasks run.
        decided = 0
        first_swing_done = None
        for swing in range(2 * (LOG_SIZE // 6 + 2)):
            busy = swing % 2 == 0
            client.run(set_tenant, (95, 0) if busy else None, workers=hot)
            client.run(_heartbeat, workers=hot)
            wait_until(lambda: sorted(blockflow.plugin_status(client)["paused"])
                       == (hot if busy else []), timeout=20, message=f"swing {swing}")
            decided += len(hot)
            if first_swing_done is None:
                first_swing_done = time.time()
        # More pauses and resumes than the log holds: it kept the newest (the last swing's
        # resumes) and dropped the oldest (the first swing's pauses). Checked now, while
        # the tasks still run: later decisions of other kinds push these out in turn.
        swings = blockflow.decisions(client)
        assert len(swings) <= LOG_SIZE
        last = swings.query("action == 'resume'")
        assert set(hot) <= set(last["worker"])
        assert (swings["time"] > first_swing_done).all(), swings[["time", "action"]].head()
        _wait_while_progressing(futures, stall=180)
        results = client.gather(futures)
        took = time.monotonic() - start
        assert results == [i + 1 for i in range(N_TASKS)]
        assert decided > LOG_SIZE
        log = blockflow.decisions(client)
        assert len(log) <= LOG_SIZE
        assert sum(blockflow.task_counts(client).values()) >= N_TASKS
        print(f"{N_TASKS} tasks took {took:.0f} s")  # ~16 s on an idle 2-core box
