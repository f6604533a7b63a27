"""Pools, prices and objectives (issue 29): blockflow.Pool, the LP over the throughput
matrix, cost accounting, objectives on real clusters of simulated pools, and the one-line
errors for what cannot be met."""

from __future__ import annotations

import re

import pytest
from loadaware import wait_until

import blockflow
from blockflow.errors import ObjectiveError
from blockflow.scheduling import Rebalancer
from blockflow.scheduling.view import plugin_status
from blockflow.pools.plan import plan, throughput_matrix
from blockflow.pools.pool import Pool, pools_of, requested_pools
from blockflow.testing.cluster import simulated_cluster
from blockflow.testing.simulated import simulated_kernel

FAST = Pool("fast", provider="gcp", price=4.0, speed=4)
SLOW = Pool("slow", provider="gcp", price=0.5, speed=1)
POOLS = {"fast": FAST, "slow": SLOW}
SECONDS = {"k": {"fast": 0.25, "slow": 1.0}}


# --- the data model ------------------------------------------------------------------


def test_pool_is_exported_and_validates_with_one_line():
    assert blockflow.Pool is Pool
    with pytest.raises(ValueError, match=re.escape(
            "blockflow.Pool 'a': price must be a number >= 0 (dollars per worker-hour), "
            "got -1.")):
        Pool("a", price=-1)
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        Pool("bad name")
    with pytest.raises(ValueError, match="speed must be a number > 0"):
        Pool("a", speed=0)
    with pytest.raises(ValueError, match="egress must be a number >= 0"):
        Pool("a", egress=float("nan"))
    p = Pool("l4", provider="gcp", region="us-east1", price=0.8, egress=0.12, speed=2)
    assert Pool.from_dict(p.to_dict()) == p
    assert p.resource == "pool:l4"


def test_pools_of_reads_the_metric_and_defaults():
    workers = {"a": {"metrics": {"blockflow-pool": FAST.to_dict()}},
               "b": {"metrics": {"blockflow-pool": {"name": "bad name"}}}, "c": {}}
    got = pools_of(workers)
    assert got["a"] == FAST and got["b"].name == got["c"].name == "default"
    assert requested_pools({"pool:x": 1, "GPU": 1}, ["pool:y", "tcp://h:1"]) == {"x", "y"}


def test_objective_validates_before_anything_runs():
    assert blockflow.objective("cost", deadline="2m").deadline == 120.0
    assert blockflow.objective().kind == "makespan"
    with pytest.raises(ValueError, match="kind must be one of makespan, cost, got 'speed'"):
        blockflow.objective("speed")
    with pytest.raises(ValueError, match="deadline must be a positive duration"):
        blockflow.objective("cost", deadline=-5)
    with pytest.raises(ValueError, match="a deadline goes with the 'cost' objective"):
        blockflow.objective("makespan", deadline=5)
    with pytest.raises(ValueError, match="budget must be a positive number of dollars"):
        blockflow.objective("makespan", budget=0)
    with pytest.raises(ValueError, match="a budget goes with the 'makespan' objective"):
        blockflow.objective("cost", budget=1)


# --- the LP ----------------------------------------------------------------------------


def test_deadline_plan_keeps_work_on_the_cheap_pool_and_names_the_shortfall():
    # slow alone: 4 workers x 20 s = 80 of 100 tasks; fast takes the 20 it must
    p = plan({"k": 100}, SECONDS, POOLS, {"fast": 2, "slow": 4}, deadline=20)
    assert p.feasible
    assert p.tasks["k"] == pytest.approx({"fast": 20.0, "slow": 80.0})
    # cost = busy worker-seconds x price: fast 20 x 0.25 s at $4/h, slow 80 s at $0.5/h
    assert p.cost == pytest.approx((5 * 4 + 80 * 0.5) / 3600)
    assert p.workers_needed == {"fast": 1, "slow": 4}
    # 5 s: fast 2 workers x 20 tasks + slow 20 = 60 of 100: 40 more need 2 more fast workers
    bad = plan({"k": 100}, SECONDS, POOLS, {"fast": 2, "slow": 4}, deadline=5)
    assert not bad.feasible
    assert bad.shortfall == ("deadline 5s cannot be met: needs >= 4 workers of pool 'fast' "
                             "(has 2); add workers or extend the deadline")


def test_budget_plan_buys_speed_until_the_money_runs_out():
    fastest = plan({"k": 100}, SECONDS, POOLS, {"fast": 2, "slow": 4})
    assert fastest.makespan == pytest.approx(100 / 12)  # 8 + 4 tasks per second
    cheapest = plan({"k": 100}, SECONDS, POOLS, {"fast": 2, "slow": 4}, deadline=1e9)
    assert cheapest.tasks["k"] == pytest.approx({"slow": 100.0})
    mid = (fastest.cost + cheapest.cost) / 2
    p = plan({"k": 100}, SECONDS, POOLS, {"fast": 2, "slow": 4}, budget=mid)
    assert p.cost <= mid + 1e-12 and fastest.makespan < p.makespan < cheapest.makespan
    low = plan({"k": 100}, SECONDS, POOLS, {"fast": 2, "slow": 4}, budget=cheapest.cost / 2)
    assert not low.feasible
    assert re.fullmatch(r"budget \$0\.006944 is below the cheapest possible run "
                        r"\(\$0\.01389\); raise the budget to at least \$0\.01389",
                        low.shortfall)


def test_plan_charges_egress_for_inputs_leaving_their_provider():
    # the cheap pool alone meets the deadline: egress makes nothing cross
    a = Pool("a", provider="aws", price=0.5, egress=0.09)
    b = Pool("b", provider="gcp", price=0.4)
    seconds = {"k": {"a": 1.0, "b": 1.0}}
    free = plan({"k": 10}, seconds, {"a": a, "b": b}, {"a": 10, "b": 10}, deadline=10)
    assert free.tasks["k"] == pytest.approx({"b": 10.0})  # b is cheaper without egress
    paid = plan({"k": 10}, seconds, {"a": a, "b": b}, {"a": 10, "b": 10}, deadline=10,
                egress={"k": {"b": 1e9 / 1e9 * 0.09}})
    assert paid.tasks["k"] == pytest.approx({"a": 10.0})


def test_throughput_matrix_starts_new_pools_from_their_typical_speed():
    pools = {"w1": FAST, "w2": SLOW, "w3": SLOW}
    m = throughput_matrix({"k": {"w2": 1.0, "w3": 1.2}, "j": {"w1": 0.5}}, pools)
    assert m["k"] == pytest.approx({"slow": 1.1, "fast": 1.1 / 4})
    assert m["j"] == pytest.approx({"fast": 0.5, "slow": 2.0})


# --- real clusters of simulated pools --------------------------------------------------

@pytest.fixture
def pooled():
    """1 fast worker (speed 4, $4/h) and 2 slow (speed 1, $0.5/h), as threads, with
    blockflow's plugin (dynamic policy)."""
    with simulated_cluster(pools={FAST: 1, SLOW: 2}, processes=False) as client:
        client.register_plugin(Rebalancer(policy="dynamic", interval="50ms"))
        yield client


def _decisions(client, action):
    return [d for d in plugin_status(client)["decisions"] if d["action"] == action]


@pytest.mark.slow
def test_pools_reach_the_scheduler_inventory_and_status(pooled):
    inv = blockflow.inventory(pooled)
    assert sorted((w.pool, w.provider, w.price) for w in inv) == [
        ("fast", "gcp", 4.0), ("slow", "gcp", 0.5), ("slow", "gcp", 0.5)]
    assert "pool" in inv.to_pandas().columns and "fast" in repr(inv)
    status = plugin_status(pooled)
    assert {n: len(p["workers"]) for n, p in status["pools"].items()} == {"fast": 1, "slow": 2}
    # the pool's resource pins work to it
    fast_worker = status["pools"]["fast"]["workers"][0]
    fs = pooled.map(simulated_kernel, range(4), work=0.01, pure=False,
                    resources={"pool:fast": 1})
    pooled.gather(fs)
    assert {tuple(v) for v in pooled.who_has(fs).values()} == {(fast_worker,)}


@pytest.mark.slow
def test_cost_objective_keeps_the_run_on_the_cheap_pool_when_it_meets_the_deadline(pooled):
    import numpy as np

    with blockflow.objective("cost", deadline=60):
        fs = pooled.map(simulated_kernel, range(30), work=0.05, op=np.negative, pure=False)
        out = pooled.gather(fs)
    assert [b.payload for b in out] == [-i for i in range(30)]
    fast = plugin_status(pooled)["pools"]["fast"]["workers"][0]
    assert plugin_status(pooled)["run_counts"].get(fast, 0) == 0  # never began the run
    # the run's cost per pool, compute and idle apart, and the LP bound beside it
    report = blockflow.run_report(pooled)
    assert report.pools is not None
    assert set(report.pools["pools"]) == {"fast", "slow"}
    assert report.pools["pools"]["fast"]["workers"] == 0  # there before, unused: not billed
    assert report.pools["objective"]["kind"] == "cost"
    assert report.pools["lower_bound"]["feasible"]
    assert report.pools["total_cost"] >= report.pools["lower_bound"]["cost"] * 0.999
    table = report.cost_table()
    assert set(table.pool) == {"fast", "slow"}
    assert {"compute_cost", "idle_cost", "egress_cost"} <= set(table.columns)
    # what the run spent so far, the figure the budget rule and the scaling rule read
    spent = plugin_status(pooled)["objective"]["spent"]
    assert spent == pytest.approx(report.pools["compute_cost"] + report.pools["idle_cost"],
                                  rel=1e-6)
    tm = blockflow.throughput(pooled)
    assert list(tm.columns) == ["fast", "slow"] and "simulated_kernel" in tm.index


@pytest.mark.slow
def test_unknown_pool_in_resources_fails_at_once_with_one_line(pooled):
    fut = pooled.submit(simulated_kernel, 1, work=0.01, resources={"pool:gpu-a100": 1})
    with pytest.raises(ObjectiveError, match=re.escape(
            "ask for pool 'gpu-a100', which no worker declares (pools: fast, slow); use "
            "one of those names in resources={'pool:<name>': 1}")):
        fut.result(timeout=30)


@pytest.mark.slow
def test_cost_objective_refuses_pools_without_a_price():
    with simulated_cluster(pools={Pool("a", speed=2): 1, Pool("b"): 1},
                           processes=False) as client:
        client.register_plugin(Rebalancer(policy="dynamic", interval="50ms"))
        with blockflow.objective("cost", deadline=30):
            fs = client.map(simulated_kernel, range(4), work=0.01, pure=False)
        with pytest.raises(ObjectiveError, match=re.escape(
                "blockflow.objective: pool 'a' has no price, which the cost objective "
                "needs; give it one")):
            client.gather(fs)
        assert not any(plugin_status(client)["task_counts"].values())  # nothing ran


@pytest.mark.slow
def test_impossible_deadline_and_budget_fail_before_anything_runs(pooled):
    # measure the group first: the objective is judged on what was measured
    pooled.gather(pooled.map(simulated_kernel, range(12), work=0.05, pure=False))
    wait_until(lambda: "simulated_kernel" in blockflow.throughput(pooled).index,
               message="the group measured")
    before = sum(plugin_status(pooled)["task_counts"].values())
    with blockflow.objective("cost", deadline=0.01):
        fs = pooled.map(simulated_kernel, range(50), work=0.05, pure=False)
    with pytest.raises(ObjectiveError, match=r"^blockflow\.objective: deadline 0\.01s cannot "
                       r"be met: needs >= \d+ workers of pool '(fast|slow)' \(has \d\); add "
                       r"workers or extend the deadline$"):
        pooled.gather(fs)
    with blockflow.objective("makespan", budget=1e-9):
        fs = pooled.map(simulated_kernel, range(50), work=0.05, pure=False)
    with pytest.raises(ObjectiveError, match=r"budget \$1e-09 is below the cheapest possible "
                       r"run \(\$[0-9.e-]+\)"):
        pooled.gather(fs)
    assert sum(plugin_status(pooled)["task_counts"].values()) == before
    assert len(_decisions(pooled, "fail")) == 2


@pytest.mark.slow
def test_a_deadline_missed_mid_run_warns_with_the_projected_finish_and_goes_on(pooled):
    # a group never measured is not refused up front; once measured, the deadline is past
    with blockflow.objective("cost", deadline=0.2):
        fs = pooled.map(simulated_kernel, range(16), work=0.1, pure=False)
    pooled.gather(fs)
    missed = wait_until(lambda: _decisions(pooled, "objective"),
                        message="an objective warning")
    assert re.match(r"run compute-\d+: deadline can no longer be met: projected finish in "
                    r"[0-9.]+ s with "
                    r"every pool, ([0-9.]+ s left to the deadline|the deadline passed "
                    r"[0-9.]+ s ago); every free worker takes work$", missed[0]["reason"])
    assert "seen_projected_finish_in" in missed[0]


@pytest.mark.slow
def test_connect_puts_the_embedded_workers_in_pools():
    client = blockflow.connect(pools={FAST: 1, SLOW: 2}, processes=False, gpu=False,
                               threads_per_worker=1, dashboard_address=":0")
    try:
        status = plugin_status(client)
        assert {n: len(p["workers"]) for n, p in status["pools"].items()} == {
            "fast": 1, "slow": 2}
        assert status["pools"]["fast"]["price"] == 4.0
    finally:
        client.shutdown()
        client.close()


def test_connect_pools_bad_input_is_one_line():
    with pytest.raises(ValueError, match="pool 'fast' must have an integer >= 1 of workers"):
        blockflow.connect(pools={FAST: 0})
    with pytest.raises(ValueError, match="n_workers=3 but pools= has 1 workers"):
        blockflow.connect(pools={FAST: 1}, n_workers=3)
    with pytest.raises(ValueError, match="pools= puts the workers of an embedded cluster"):
        blockflow.connect("tcp://127.0.0.1:1", pools={FAST: 1})


def _made_on(i):
    from blockflow.testing.simulated_device import SimulatedDeviceBlock

    return SimulatedDeviceBlock(i, 10_000_000)


def _group_inputs(client, group):
    def read(dask_scheduler):
        seen = dask_scheduler.plugins["blockflow-rebalancer"].group_inputs.get(group)
        return None if seen is None else (seen[0], dict(seen[1]), seen[2])

    return client.run_on_scheduler(read)


@pytest.mark.slow
def test_egress_is_priced_from_this_runs_inputs_not_the_groups_past():
    """A group whose tasks read inputs made on another provider in one run, and nothing in
    the next, is priced no egress in the next from the moment its graph arrives: the old
    history made a budget run after such a run buy 4 fast tasks instead of 28 (11.6 s
    instead of 8.9 s, benchmarks/pools.py, one run in three)."""
    from blockflow.scheduling.runs import run_scope

    aws = Pool("slow", provider="aws", price=0.5, speed=1, egress=0.09)
    with simulated_cluster(pools={FAST: 1, aws: 2}, processes=False) as client:
        client.register_plugin(Rebalancer(policy="dynamic", interval="50ms"))
        with run_scope("inputs on aws") as first:
            xs = client.map(_made_on, range(6), pure=False, resources={"pool:slow": 1})
            client.gather(client.map(simulated_kernel, xs, work=0.01, pure=False))
        wait_until(lambda: (_group_inputs(client, "simulated_kernel") or (0,))[0] >= 6,
                   message="the first run's inputs recorded")
        n, by, run = _group_inputs(client, "simulated_kernel")
        assert run == first and by.get("slow", 0) >= 6 * 10_000_000, (n, by, run)
        with run_scope("no inputs") as second:
            fs = client.map(simulated_kernel, range(4), work=0.5, pure=False)
            # the graph alone resets what the group is priced (before any task finished)
            wait_until(lambda: _group_inputs(client, "simulated_kernel")[2] == second,
                       message="the second run's graph seen")
            assert _group_inputs(client, "simulated_kernel")[1] == {}
            client.gather(fs)
        assert _group_inputs(client, "simulated_kernel")[1] == {}
