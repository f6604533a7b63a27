"""The plan is what runs (issue 37), on real clusters of simulated pools: each task group runs
on the pool the plan gives it; a budget buys speed when tasks have inputs, within the budget,
with the run's tasks waiting at the scheduler rather than queued on workers; egress is
counted when data moves, whatever the memory manager drops later; a lost worker's planned
tasks run elsewhere; the plugin going away hands the held tasks back."""

from __future__ import annotations

import threading
import time

import dask
import numpy as np
import pytest
from loadaware import wait_until

import blockflow
from blockflow.pools.pool import Pool
from blockflow.scheduling import Rebalancer
from blockflow.scheduling.runs import run_scope
from blockflow.scheduling.view import plugin_status
from blockflow.testing.cluster import simulated_cluster
from blockflow.testing.simulated import simulated_kernel
from blockflow.testing.simulated_device import SimulatedDeviceBlock

pytestmark = pytest.mark.slow


def etl(x):
    return simulated_kernel(x, work=0.1)


def train(x):
    return simulated_kernel(x, work=0.4)


def _made(i, nbytes=10_000_000):
    return SimulatedDeviceBlock(np.int64(i), nbytes)


def _pools_of(client):
    return {a: name for name, info in plugin_status(client)["pools"].items()
            for a in info["workers"]}


def _ran_on(client, futures):
    where = _pools_of(client)
    return [where[client.who_has([f])[f.key][0]] for f in futures]


@pytest.fixture
def fast_slow():
    """One fast worker (speed 4, $4/h) and two slow (speed 1, $0.5/h), as threads, with
    blockflow's plugin; the ``train`` group measured."""
    fast = Pool("fast", price=4.0, speed=4)
    slow = Pool("slow", price=0.5, speed=1)
    with simulated_cluster(pools={fast: 1, slow: 2}, processes=False) as client:
        client.register_plugin(Rebalancer(policy="dynamic", interval="50ms"))
        _warm(client, train)
        yield client


def _warm(client, *fns):
    n = 2 * len(client.scheduler_info()["workers"])
    for fn in fns:
        client.gather(client.map(fn, range(n), pure=False))
    wait_until(lambda: all(fn.__name__ in blockflow.throughput(client).index for fn in fns),
               message="the groups measured")


def test_each_group_runs_on_the_pool_the_plan_gives_it():
    # train gains 8x on the gpu pool, etl 1.2x; the cpu pool alone misses the deadline, so
    # the plan buys gpu time for train - the group that gains most - and keeps etl on the
    # cpus; execution follows it (before: the group that gained little took the gpu, the
    # other was pushed onto the cpus)
    cpu = Pool("cpu", price=0.5, speed={"etl": 1, "train": 1})
    gpu = Pool("gpu", price=4.0, speed={"etl": 1.2, "train": 8})
    with simulated_cluster(pools={cpu: 2, gpu: 1}, processes=False) as client:
        client.register_plugin(Rebalancer(policy="dynamic", interval="50ms"))
        _warm(client, etl, train)
        # cpus alone: 16 x 0.1 + 16 x 0.4 = 8 s of work on 2 workers = 4 s; deadline 2.5 s
        t0 = time.time()
        with run_scope("by group"), blockflow.objective("cost", deadline=2.5):
            fe = client.map(etl, range(16), pure=False)
            ft = client.map(train, range(16), pure=False)
            client.gather(fe + ft)
        took = time.time() - t0
        on_etl, on_train = _ran_on(client, fe), _ran_on(client, ft)
        # etl stays on the cpus but for the run's tail (its last tasks go where they end
        # first) or a deadline a loaded host made unreachable (every free worker then works)
        lost = [d for d in plugin_status(client)["decisions"] if d["action"] == "objective"]
        assert on_etl.count("gpu") <= (4 if lost else 2), (on_etl, lost)
        assert on_train.count("gpu") >= 4, on_train
        assert took < 2.5 * 1.5, took  # a loaded host: the deadline's order, not its letter
        assert on_train.count("gpu") > 2 * on_etl.count("gpu"), (on_etl, on_train)


def test_a_budget_buys_speed_when_tasks_have_inputs_and_stays_within_it(fast_slow):
    # every task reads an input made on the slow pool; the budget is twice the slow pool's
    # run, enough for part of the work on the fast pool (before: nothing went to the fast
    # pool, the queued tasks were taken as fixed where Dask had put them, by their inputs)
    client = fast_slow
    xs = client.map(_made, range(24), pure=False, resources={"pool:slow": 1})
    client.gather(xs)
    # 4.8 s on both slow workers at the nominal speed; at the measured one where a loaded
    # host made it slower (the budget is judged on what was measured)
    per_task = max(0.4, float(blockflow.throughput(client).loc["train", "slow"]))
    slow_only = 24 * per_task / 2 * 2 * 0.5 / 3600
    budget = 2 * slow_only
    queued = []
    stop = threading.Event()

    def most_queued():
        while not stop.is_set():
            queued.append(max(client.run_on_scheduler(
                lambda dask_scheduler: [len(ws.processing) for ws in
                                        dask_scheduler.workers.values()])))
            time.sleep(0.1)

    watcher = threading.Thread(target=most_queued, daemon=True)
    with run_scope("budget with inputs") as run_id:
        with blockflow.objective("makespan", budget=budget):
            fs = client.map(train, xs, pure=False)
            watcher.start()
            client.gather(fs)
    stop.set()
    watcher.join()
    on = _ran_on(client, fs)
    assert on.count("fast") >= 3, on
    # queued is not spent: no worker held more of the run's tasks than distributed's
    # queuing allows a 1-thread worker (before: all 24 sat on the workers holding inputs)
    assert max(queued) <= 2, queued
    report = blockflow.run_report(client)
    one_task = 0.4 / 4 * 4.0 / 3600
    assert report.pools["total_cost"] <= budget + one_task, (report.pools, budget)
    assert plugin_status(client, run=run_id)["requested_run"]["pending"] == 0


def test_egress_is_counted_when_data_moves_whatever_the_memory_manager_drops():
    # inputs made on aws, read by tasks pinned to gcp; the memory manager (every 50 ms)
    # drops the source copy once the gcp worker holds one (before: the input's holder was
    # read when the task finished - often only the gcp copy was left - 4-21 % counted)
    aws = Pool("aws-pool", provider="aws", price=0.5, egress=0.09)
    gcp = Pool("gcp-pool", provider="gcp", price=1.0)
    amm = {"distributed.scheduler.active-memory-manager.start": True,
           "distributed.scheduler.active-memory-manager.interval": "50ms"}
    with dask.config.set(amm), simulated_cluster(pools={aws: 1, gcp: 1},
                                                 processes=False) as client:
        client.register_plugin(Rebalancer(policy="dynamic", interval="50ms"))
        wait_until(lambda: len(_pools_of(client)) == 2, message="pools known")
        ticks = plugin_status(client)["ticks"]  # a tick has seen both providers
        wait_until(lambda: plugin_status(client)["ticks"] > ticks, message="a tick")
        xs = client.map(_made, range(12), pure=False, resources={"pool:aws-pool": 1})
        client.gather(xs)
        with run_scope("egress"):
            fs = client.map(simulated_kernel, xs, work=0.2, pure=False,
                            resources={"pool:gcp-pool": 1})
            del xs
            client.gather(fs)
        # counted in the scheduler's hook as each task finished, before its result was sent
        egress = blockflow.run_report(client).pools["egress"]
        assert egress["bytes"] == 12 * 10_000_000, egress
        assert egress["by_pool"]["aws-pool"]["to"] == {"gcp": 12 * 10_000_000}
        assert egress["cost"] == pytest.approx(12 * 0.01 * 0.09)


def test_a_lost_workers_planned_tasks_run_elsewhere(fast_slow):
    client = fast_slow
    with blockflow.objective("cost", deadline=2.0):
        fs = client.map(train, range(16), pure=False)
    # once the fast worker holds planned tasks, it is lost
    fast_addr = [a for a, p in _pools_of(client).items() if p == "fast"][0]
    wait_until(lambda: client.run_on_scheduler(
        lambda dask_scheduler: len(dask_scheduler.workers[fast_addr].processing)) > 0,
        message="tasks dispatched to the fast worker")

    async def lose(dask_scheduler):
        await dask_scheduler.remove_worker(fast_addr, stimulus_id="test-lost")

    client.run_on_scheduler(lose)
    out = client.gather(fs)  # nothing waits for the worker that is gone
    assert len(out) == 16
    assert set(_ran_on(client, fs)) == {"slow"}


def test_held_tasks_go_back_to_dask_when_the_plugin_goes(fast_slow):
    client = fast_slow
    with blockflow.objective("makespan", budget=0.01):
        fs = client.map(train, range(40), pure=False)
    wait_until(lambda: (plugin_status(client)["objective"] or {}).get("dispatch"),
               message="the run is held for its plan")
    client.unregister_scheduler_plugin("blockflow-rebalancer")
    assert len(client.gather(fs, errors="raise")) == 40
