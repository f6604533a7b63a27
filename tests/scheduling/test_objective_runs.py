"""An objective belongs to the run it was given for (issue 39): a refused or erred run's
objective ends with it, money is counted at the prices in force when it was spent, a miss is
one line when it becomes certain, and two runs at once are planned and reported each on its
own - on real clusters of simulated pools."""

from __future__ import annotations

import dask.array as da
import pytest
from loadaware import wait_until

import blockflow
from blockflow.errors import ObjectiveError
from blockflow.pools.pool import Pool
from blockflow.scheduling import Rebalancer
from blockflow.scheduling.view import plugin_status
from blockflow.testing.cluster import simulated_cluster
from blockflow.testing.simulated import simulated_kernel

pytestmark = pytest.mark.slow

FAST = Pool("fast", provider="gcp", price=4.0, speed=4)
SLOW = Pool("slow", provider="gcp", price=0.5, speed=1)


@pytest.fixture
def pooled():
    """1 fast worker (speed 4, $4/h) and 2 slow (speed 1, $0.5/h), as threads, with
    blockflow's plugin; the ``simulated_kernel`` group measured."""
    with simulated_cluster(pools={FAST: 1, SLOW: 2}, processes=False) as client:
        client.register_plugin(Rebalancer(policy="dynamic", interval="50ms"))
        client.gather(client.map(simulated_kernel, range(12), work=0.05, pure=False))
        wait_until(lambda: "simulated_kernel" in blockflow.throughput(client).index,
                   message="the group measured")
        yield client


def _inc(x):
    return x + 1


def _boom(x):
    raise ValueError("boom")


def test_a_refused_objective_does_not_refuse_the_clients_later_computations(pooled):
    client = pooled
    with pytest.raises(ObjectiveError, match="deadline 0.01s cannot be met"):
        with blockflow.objective("cost", deadline=0.01):
            client.gather(client.map(simulated_kernel, range(50), work=0.05, pure=False))
    # the same client, no objective: submit, map and a dask.array compute all run
    assert client.submit(_inc, 1).result(timeout=30) == 2
    assert client.gather(client.map(_inc, range(4))) == [1, 2, 3, 4]
    x = da.ones(8, chunks=2)
    assert int(x.sum().compute()) == 8
    status = plugin_status(client)
    assert status["run"]["objective"] is None
    assert status["objective"] is None


def test_a_plain_run_after_an_objective_run_with_an_error_has_no_objective(pooled):
    client = pooled
    with blockflow.objective("cost", deadline=120):
        fs = client.map(simulated_kernel, range(6), work=0.02, pure=False)
        bad = client.submit(_boom, 1)
        dependent = client.submit(_inc, bad)
        client.gather(fs)
        with pytest.raises(ValueError, match="boom"):
            dependent.result(timeout=30)
    assert client.gather(client.map(_inc, range(3), pure=False)) == [1, 2, 3]
    status = plugin_status(client)
    assert status["run"]["objective"] is None, status["run"]
    assert status["objective"] is None, status["objective"]


# --- money at the prices in force when it was spent ---------------------------------------


def test_a_price_change_bills_the_seconds_before_it_at_the_old_price():
    from blockflow.pools.plan import run_cost

    dear = Pool("p", price=3600.0)  # $1 a second
    cheap = Pool("p", price=360.0)  # $0.1 a second
    # there before the run, first task at 10, the price dropped at 20, the run ended at 30
    lifetimes = {"w": (cheap, 0.0, None, ((0.0, dear), (20.0, cheap)))}
    c = run_cost(lifetimes, (5.0, 30.0), first_use={"w": 10.0}, busy={"w": 20.0},
                 busy_cost={"w": 10 * 1.0 + 10 * 0.1})
    assert c["total_cost"] == pytest.approx(10 * 1.0 + 10 * 0.1)
    assert c["compute_cost"] == pytest.approx(11.0) and c["idle_cost"] == pytest.approx(0.0)
    # a price that rose: the seconds before it at the old one
    up = {"w": (dear, 0.0, None, ((0.0, cheap), (20.0, dear)))}
    assert run_cost(up, (5.0, 30.0), first_use={"w": 10.0})["total_cost"] == pytest.approx(
        10 * 0.1 + 10 * 1.0)


def test_the_plugin_keeps_each_price_a_worker_reported_from_when_it_reported_it():
    dear, cheap = Pool("p", price=3600.0), Pool("p", price=360.0)
    plugin = Rebalancer()
    plugin.set_pools({"w": dear}, now=5.0)
    plugin.set_pools({"w": dear}, now=6.0)  # the same pool: nothing new
    plugin.set_pools({"w": cheap}, now=20.0)
    assert plugin.lifetimes["w"] == (cheap, 5.0, None, ((5.0, dear), (20.0, cheap)))


def test_two_runs_sharing_a_worker_are_each_billed_their_own_use_of_it():
    from blockflow.pools.plan import run_cost
    from blockflow.scheduling.runs import RunTracker

    t = RunTracker()
    a = t.graph(client="c1", states={"a1": "released", "a2": "released"}, annotations={},
                now=0.0)
    b = t.graph(client="c2", states={"b1": "released"}, annotations={}, now=0.0)
    t.executed("a1", "w", 0.0, 1.0)
    t.finished("a1", "w")
    t.executed("b1", "w", 1.0, 3.0)  # inside a's span on w: b's use, billed to b
    t.finished("b1", "w")
    t.executed("a2", "w", 3.0, 4.0)
    t.finished("a2", "w")
    assert a.shared == {"w": 2.0} and b.shared == {}
    life = {"w": (Pool("p", price=3600.0), -10.0, None)}  # $1 a second

    def bill(run, end):
        return run_cost(life, (run.started, end), first_use={"w": run.spans["w"][0]},
                        busy=run.busy, shared=run.shared)["total_cost"]

    # the worker's 4 s are billed once: 2 s to each run (before: 4 s to a and 2 s to b)
    assert bill(a, 4.0) == pytest.approx(2.0) and bill(b, 3.0) == pytest.approx(2.0)


def _set_price(price):
    def set_it(dask_worker):
        from blockflow import _distributed
        from blockflow.pools.pool import POOL_METRIC

        info = Pool("slow", provider="gcp", price=price, speed=1).to_dict()
        _distributed.set_worker_metric(dask_worker, POOL_METRIC, lambda w: info)
    return set_it


def test_run_report_bills_a_run_at_the_prices_in_force_while_it_ran():
    from blockflow.pools.pool import heartbeat_now
    from blockflow.scheduling.runs import run_scope

    dear = Pool("slow", provider="gcp", price=50.0, speed=1)
    with simulated_cluster(pools={FAST: 1, dear: 2}, processes=False) as client:
        client.register_plugin(Rebalancer(policy="dynamic", interval="50ms"))
        slow = [a for a, p in _pools_of(client).items() if p == "slow"]
        with run_scope("price drops mid-run"):
            client.gather(client.map(simulated_kernel, range(8), work=0.3, pure=False,
                                     resources={"pool:slow": 1}))
            # the slow pool's price drops 100x between the run's two graphs
            client.run(_set_price(0.5), workers=slow)
            client.run(heartbeat_now, workers=slow)
            wait_until(lambda: plugin_status(client)["pools"]["slow"]["price"] == 0.5,
                       message="the new price known")
            client.gather(client.map(simulated_kernel, range(2), work=0.01, pure=False,
                                     resources={"pool:slow": 1}))
        report = blockflow.run_report(client)
    slow_cost = report.pools["pools"]["slow"]
    before = slow_cost["busy_seconds"] - 2 * 0.01 * 3  # the first graph's busy seconds
    # the seconds before the change at $50/h (before: all of them at $0.5/h, 100x less)
    assert report.pools["total_cost"] >= 0.9 * before * 50.0 / 3600, report.pools
    assert report.pools["total_cost"] <= slow_cost["billed_seconds"] * 50.0 / 3600 + 1e-9


def _pools_of(client):
    return {a: name for name, info in plugin_status(client)["pools"].items()
            for a in info["workers"]}


# --- a miss is one line when it becomes certain --------------------------------------------


def _objective_lines(client, run_id=None):
    return [d for d in plugin_status(client)["decisions"] if d["action"] == "objective"
            and (run_id is None or d.get("seen_run") == run_id)]


def trainer(x):
    return simulated_kernel(x, work=0.4)


def _warm(client):
    client.gather(client.map(trainer, range(6), pure=False))
    wait_until(lambda: "trainer" in blockflow.throughput(client).index,
               message="the group measured")


def test_a_deadline_lost_with_a_pools_workers_is_one_line_on_the_client_and_in_decisions(
        pooled):
    import warnings

    from blockflow.errors import BlockflowWarning
    from blockflow.scheduling.runs import run_scope

    client = pooled
    _warm(client)
    fast = [a for a, p in _pools_of(client).items() if p == "fast"][0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # slow pool alone: 24 x 0.4 s on 2 workers = 4.8 s; with the fast one 1.6 s
        with run_scope("deadline") as run_id, blockflow.objective("cost", deadline=3.5):
            fs = client.map(trainer, range(24), pure=False)
        wait_until(lambda: client.run_on_scheduler(
            lambda dask_scheduler: len(dask_scheduler.workers[fast].processing)) > 0,
            message="the fast worker took work")

        async def lose(dask_scheduler):  # every worker of the pool is gone
            await dask_scheduler.remove_worker(fast, stimulus_id="test-lost")

        client.run_on_scheduler(lose)
        assert len(client.gather(fs)) == 24  # exact, late
        wait_until(lambda: [w for w in caught if issubclass(w.category, BlockflowWarning)
                            and run_id in str(w.message)], message="a warning on the client")
    lines = _objective_lines(client, run_id)
    assert len(lines) == 1, lines
    assert "deadline" in lines[0]["reason"], lines
    told = [w for w in caught if run_id in str(w.message)]
    assert len(told) == 1 and "\n" not in str(told[0].message), [str(w.message) for w in told]
    assert told[0].filename == __file__  # at the user's with-block, not distributed's client


# --- two runs at once, each with its own objective -----------------------------------------


def test_one_lp_plans_two_runs_work_on_the_same_workers():
    from blockflow.pools.plan import RunWork, plan, plan_runs

    pools = {"fast": Pool("fast", price=4.0), "slow": Pool("slow", price=0.5)}
    seconds = {"k": {"fast": 0.1, "slow": 0.4}}
    workers = {"fast": 1, "slow": 2}
    a = RunWork({"k": 24}, seconds, deadline=3.0)
    b = RunWork({"k": 24}, seconds, budget=0.01)
    both = plan_runs({"A": a, "B": b}, pools, workers)
    # A alone is cheapest with the slow pool full to its deadline (15 tasks) and 9 fast;
    # beside B it keeps that plan: B's work runs in what A leaves
    alone = plan({"k": 24}, seconds, pools, workers, deadline=3.0)
    assert both["A"].tasks["k"] == pytest.approx(alone.tasks["k"])
    assert both["A"].cost == pytest.approx(alone.cost) and both["A"].makespan == 3.0
    # B: 2.1 s of fast time before 3 s (21 tasks), then 3 tasks at 15 a second: 3.2 s
    assert both["B"].makespan == pytest.approx(3.2, rel=1e-5)
    assert sum(both["B"].tasks["k"].values()) == pytest.approx(24)
    # planned apart, each would take the whole cluster: B alone ends by 1.6 s
    assert plan({"k": 24}, seconds, pools, workers, budget=0.01).makespan == pytest.approx(1.6)
    # a budget that buys little keeps B on the slow pool after A's deadline
    poor = plan_runs({"A": a, "B": RunWork({"k": 24}, seconds, budget=0.0014)}, pools,
                     workers)
    assert poor["B"].cost <= 0.0014 + 1e-12 and poor["B"].makespan > 3.2
    # what cannot be met together is None (the caller tells the misses)
    assert plan_runs({"A": RunWork({"k": 24}, seconds, deadline=1.0), "B": b}, pools,
                     workers) is None




def test_two_clients_objectives_are_planned_together_and_each_kept_met_or_told(pooled):
    import threading

    from distributed import Client

    client = pooled
    _warm(client)
    other = Client(client.scheduler.address, set_as_default=False)
    try:
        budget = 2 * 24 * 0.4 * 0.5 / 3600  # twice the slow pool's run
        with blockflow.objective("cost", deadline=6):
            fa = client.map(trainer, range(24), pure=False)
        with blockflow.objective("makespan", budget=budget):
            fb = other.map(trainer, range(24), pure=False)
        joint = []
        stop = threading.Event()

        def watch():
            while True:  # a poll every 0.05 s, ended at once by stop
                for o in plugin_status(client)["objectives"].values():
                    if (o["plan"] or {}).get("joint"):
                        joint.append(o["plan"]["joint"])
                if stop.wait(0.05):
                    return

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        assert len(client.gather(fa)) == 24 and len(other.gather(fb)) == 24
        stop.set()
        watcher.join()
        mine = blockflow.run_report(client).pools
        theirs = blockflow.run_report(other).pools
    finally:
        other.close()
    status = plugin_status(client)
    goals = {o["kind"]: o for o in status["objectives"].values()}
    # each run's objective is kept and reported on its own
    assert set(goals) == {"cost", "makespan"}, status["objectives"]
    assert goals["cost"]["deadline"] == 6 and goals["makespan"]["budget"] == budget
    assert mine["objective"]["kind"] == "cost" and theirs["objective"]["kind"] == "makespan"
    # the LP saw both runs' work at once
    assert any(len(j) == 2 for j in joint), joint
    # each objective is met, or its miss told in one line
    runs = {o["run"]: plugin_status(client, run=o["run"])["requested_run"]
            for o in goals.values()}
    took = runs[goals["cost"]["run"]]["ended"] - runs[goals["cost"]["run"]]["started"]
    one_task = 0.1 * 4.0 / 3600
    for kind, met in (("cost", took <= 6),
                      ("makespan", theirs["total_cost"] <= budget + one_task)):
        lines = _objective_lines(client, goals[kind]["run"])
        assert met or len(lines) == 1, (kind, took, theirs["total_cost"], budget, lines)
