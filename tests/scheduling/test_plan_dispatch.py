"""The plan's dispatch and billing on plain data (issue 37): each group's tasks go to the pool
the plan gives it, an idle pool the plan did not choose does not grab them, the run's tail
goes to whoever ends it first, a lost worker's tasks wait for the plan again; workers that
began a run are sunk cost to the LP; billing runs from a worker's arrival to its
retirement."""

from __future__ import annotations

import pytest

from blockflow.pools.dispatch import PlanDispatch
from blockflow.pools.plan import plan, run_cost
from blockflow.pools.pool import Pool
from blockflow.scheduling import Rebalancer

CPU = Pool("cpu", provider="aws", price=0.5, egress=0.09)
GPU = Pool("gpu", provider="gcp", price=4.0)
POOLS = {"c0": CPU, "c1": CPU, "g0": GPU}
SECONDS = {"etl": {"cpu": 0.4, "gpu": 0.3}, "train": {"cpu": 0.8, "gpu": 0.1}}
NOW = 1000.0


def _dispatch(quota, ready, *, active=("c0", "c1", "g0"), **kw) -> PlanDispatch:
    d = PlanDispatch("r")
    d.hold([f"{g}-{i}" for g, n in ready.items() for i in range(n)],
           ready={f"{g}-{i}": True for g, n in ready.items() for i in range(n)})
    d.quota = {g: dict(row) for g, row in quota.items()}
    d.seconds, d.active = SECONDS, set(active)
    for k, v in kw.items():
        setattr(d, k, v)
    return d


def _free(**slots):
    return {a: (n, n) for a, n in slots.items()}


def test_each_group_goes_to_the_pool_the_plan_gives_it():
    d = _dispatch({"etl": {"cpu": 4}, "train": {"gpu": 4}}, {"etl": 4, "train": 4})
    out = d.choose(_free(c0=1, c1=1, g0=1), POOLS, NOW)
    assert sorted(out.values()) == ["c0", "c1", "g0"]
    assert {k.split("-")[0] for k, a in out.items() if a == "g0"} == {"train"}
    assert {k.split("-")[0] for k, a in out.items() if a != "g0"} == {"etl"}
    assert d.quota["train"]["gpu"] == 3 and d.quota["etl"]["cpu"] == 2


def test_an_idle_pool_the_plan_did_not_choose_leaves_the_task_for_the_busy_one():
    # train waits for the (busy) gpu the plan chose; the idle cpu workers do not grab it
    d = _dispatch({"train": {"gpu": 8}}, {"train": 8})
    assert d.choose(_free(c0=1, c1=1, g0=0), POOLS, NOW) == {}
    # ... unless the deadline needs every worker (the rule sets greedy)
    d.greedy = True
    assert set(d.choose(_free(c0=1, c1=1, g0=0), POOLS, NOW).values()) == {"c0", "c1"}


def test_a_worker_off_the_plan_takes_only_what_ends_before_the_plan_and_pays_no_egress():
    d = _dispatch({"train": {"gpu": 8}, "etl": {"gpu": 2}}, {"train": 8, "etl": 2},
                  active=("g0",), finish_by=NOW + 0.5)
    # g0's quota spent on other work: it may take an etl task off the plan if it ends in time
    d.quota = {"train": {"cpu": 8}, "etl": {"cpu": 2}}
    d.active = {"c0", "c1", "g0"}
    out = d.choose(_free(c0=0, c1=0, g0=1), POOLS, NOW)
    assert [k.split("-")[0] for k in out] == ["etl"]  # 0.3 s ends by finish_by; train suits it
    # inputs the gpu would pay egress to receive: it takes nothing off the plan
    d = _dispatch({"train": {"cpu": 8}}, {"train": 8}, finish_by=NOW + 5,
                  egress={"train": {"gpu": 0.002, "cpu": 0.0}})
    assert d.choose(_free(c0=0, c1=0, g0=1), POOLS, NOW) == {}


def test_at_the_tail_the_worker_that_ends_a_task_first_takes_it():
    # one task left, both pools planned half: the gpu ends it in 0.1 s, a cpu in 0.8 s
    d = _dispatch({"train": {"gpu": 0.5, "cpu": 0.5}}, {"train": 1})
    out = d.choose(_free(c0=1, c1=1, g0=1), POOLS, NOW)
    assert list(out.values()) == ["g0"]
    # with the gpu busy for 2 s more, a cpu takes it
    d = _dispatch({"train": {"gpu": 0.5, "cpu": 0.5}}, {"train": 1})
    d.sent["x"], d.ends["x"] = "g0", NOW + 2.0
    out = d.choose({"c0": (1, 1), "c1": (1, 1), "g0": (1, 0)}, POOLS, NOW)
    assert list(out.values()) in (["c0"], ["c1"])


def test_an_unmeasured_group_is_measured_first_on_its_cheapest_pool():
    d = _dispatch({"etl": {"cpu": 4}}, {"etl": 4, "score": 2}, first={"score": "cpu"})
    d.seconds = {"etl": SECONDS["etl"]}
    out = d.choose(_free(c0=1, c1=1, g0=1), POOLS, NOW)
    assert sorted(k.split("-")[0] for k, a in out.items() if a != "g0") == ["score", "score"]


def test_a_lost_workers_tasks_wait_for_the_plan_again():
    d = _dispatch({"train": {"gpu": 4}}, {"train": 4})
    out = d.choose(_free(c0=0, c1=0, g0=2), POOLS, NOW)
    assert len(out) == 2 and d.holds() == 2
    lost = d.lost("g0")
    assert sorted(lost) == sorted(out) and not d.sent
    d.hold(lost, {k: True for k in lost})
    assert d.ready_count() == {"train": 4}


def test_workers_that_began_the_run_are_sunk_cost_to_the_plan():
    pools = {"fast": Pool("fast", price=4.0), "slow": Pool("slow", price=0.5)}
    seconds = {"k": {"fast": 0.25, "slow": 1.0}}
    # 10 s to the deadline, 30 tasks: the slow pool alone (2 workers) does 20
    cold = plan({"k": 30}, seconds, pools, {"fast": 1, "slow": 2}, deadline=10)
    assert cold.tasks["k"]["fast"] == pytest.approx(10)
    # the fast worker began the run (billed to its end whatever it does): its time is free,
    # so it takes all it can, and the plan's cost counts its whole horizon
    warm = plan({"k": 30}, seconds, pools, {"fast": 1, "slow": 2}, deadline=10,
                sunk={"fast": 1})
    assert warm.tasks["k"]["fast"] == pytest.approx(30)
    assert warm.cost == pytest.approx(10 * 4.0 / 3600)
    # a budget: the begun worker is billed to the end of the makespan the plan picks
    budget = plan({"k": 30}, seconds, pools, {"fast": 1, "slow": 2}, budget=1.0,
                  sunk={"fast": 1, "slow": 2})
    assert budget.makespan == pytest.approx(30 / 6)  # all three working: 6 tasks a second
    assert budget.cost == pytest.approx(budget.makespan * (4.0 + 2 * 0.5) / 3600)


def test_billing_runs_from_arrival_to_retirement_idle_included():
    fast = Pool("fast", provider="gcp", price=3600.0, min_billed=60.0)  # $1 per second
    slow = Pool("slow", provider="aws", price=3600.0, egress=0.1)
    lifetimes = {
        "early": (slow, 0.0, None),  # there before the run; first task at 12: billed 12-30
        "unused": (slow, 0.0, None),  # there before, took nothing: not billed
        "started": (fast, 15.0, 20.0),  # started for the run, retired idle: its min_billed
        "gone": (slow, 0.0, 25.0),  # there before, used from 11, left at 25
    }
    c = run_cost(lifetimes, (10.0, 30.0), first_use={"early": 12.0, "gone": 11.0},
                 busy={"early": 6.0, "gone": 14.0},
                 crossings=[("slow", "gcp", 2_000_000_000)])
    assert c["pools"]["slow"]["workers"] == 2
    assert c["pools"]["slow"]["billed_seconds"] == pytest.approx(18 + 14)
    assert c["pools"]["slow"]["busy_seconds"] == pytest.approx(20)
    assert c["pools"]["slow"]["idle_cost"] == pytest.approx(12)
    assert c["pools"]["fast"] == pytest.approx({
        "workers": 1, "billed_seconds": 60.0, "busy_seconds": 0.0, "idle_seconds": 60.0,
        "price": 3600.0, "compute_cost": 0.0, "idle_cost": 60.0, "cost": 60.0})
    assert c["egress"]["by_pool"]["slow"] == {"bytes": 2_000_000_000,
                                              "cost": pytest.approx(0.2),
                                              "to": {"gcp": 2_000_000_000}}
    assert c["total_cost"] == pytest.approx(32 + 60 + 0.2)
    assert c["compute_cost"] + c["idle_cost"] + c["egress"]["cost"] == pytest.approx(
        c["total_cost"])


def test_the_plugin_records_arrivals_and_departures_for_billing():
    plugin = Rebalancer()
    plugin.set_pools({"a": CPU}, now=5.0)  # present when the plugin started
    plugin.worker_arrived("b", 10.0)
    plugin.set_pools({"a": CPU, "b": GPU}, now=11.0)  # b's pool is known from its metrics
    plugin.worker_left("b", 20.0)
    assert plugin.lifetimes == {"a": (CPU, 5.0, None, ((5.0, CPU),)),
                                "b": (GPU, 10.0, 20.0, ((10.0, GPU),))}
    # a worker that comes back at the same address is a new lifetime
    plugin.worker_arrived("b", 30.0)
    plugin.set_pools({"a": CPU, "b": GPU}, now=31.0)
    assert plugin.lifetimes["b"] == (GPU, 30.0, None, ((30.0, GPU),))
