"""The pool rules on plain data.

The objective rule under a budget spends only what is left after the money already spent
*and committed* (tasks queued on a pool's workers run there), and does not take a parked
pool back when the time it sat parked - billed again the moment it runs a task, a worker's
bill running from its first task to its last - leaves no money for it. The scaling rule
keeps a pool's workers while the run still has work for the pool."""

from __future__ import annotations

from collections import Counter

from blockflow import _distributed
from blockflow.scheduling.actions import Action, Recorded
from blockflow.pools.objective import Objective
from blockflow.scheduling.policies import ClusterSnapshot
from blockflow.pools.pool import Pool
from blockflow.pools.objective_rule import ObjectiveRule
from blockflow.scheduling.runs import Run

FAST = Pool("fast", provider="gcp", price=4.0, speed=4)
SLOW = Pool("slow", provider="aws", price=0.5, speed=1)
SECONDS = {"k": {"fast": 0.125, "slow": 0.5}}
FAST_TASK = 0.125 * 4.0 / 3600  # dollars
SLOW_TASK = 0.5 * 0.5 / 3600
NOW = 1000.0


def _worker(addr, pool, processing=0):
    from blockflow._distributed.metrics import WorkerMetrics

    return _distributed.WorkerView(
        address=addr, nthreads=1, status="running", paused_by_blockflow=False,
        metrics=WorkerMetrics(None, None, None, None, None), speed=1.0,
        processing=processing, executing=0, occupancy=0.0, pool=pool.to_dict())


def _snap(budget, pending, *, fast_queued=0, parked=(), fast_stopped=None):
    workers = {"f0": _worker("f0", FAST, fast_queued), "f1": _worker("f1", FAST),
               **{f"s{i}": _worker(f"s{i}", SLOW) for i in range(4)}}
    run = Run(id="r", name="r", client=None, started=NOW - 20,
              objective=Objective("makespan", None, budget), pending=pending,
              group_pending=Counter({"k": pending}))
    # every worker ran one task, without gaps, ending at fast_stopped (fast) or now
    for a in workers:
        t = SECONDS["k"]["fast" if a.startswith("f") else "slow"]
        stop = fast_stopped if fast_stopped is not None and a.startswith("f") else NOW
        run.spans[a] = [stop - t, stop]
        run.busy[a] = t
    if fast_stopped is not None:
        for a in ("f0", "f1"):
            workers[a].status = "paused"
    return ClusterSnapshot(time=NOW, workers=workers, event="tick", run=run,
                           parked=frozenset(parked), throughput=SECONDS)


def _spent_so_far():
    return 2 * FAST_TASK + 4 * SLOW_TASK


def test_tasks_queued_on_a_pool_count_as_committed_money():
    # 20 tasks left, 4 of them already queued on a fast worker (they run there); the
    # budget left pays for 20 slow tasks only: with the queued fast tasks the run
    # overspends, so the rule says so now (before: the LP counted the queued tasks as
    # free to go anywhere and saw the budget met)
    budget = _spent_so_far() + 20 * SLOW_TASK + 1e-9
    rule = ObjectiveRule()
    out = rule.run(_snap(budget, 20, fast_queued=4), None)
    missed = [d for d in out if d.action == Recorded.OBJECTIVE]
    assert len(missed) == 1, out
    assert "budget can no longer be met" in missed[0].reason
    committed = missed[0].seen["committed"]
    assert abs(committed - 4 * FAST_TASK) < 1e-6
    assert missed[0].seen["projected_cost"] > budget


def test_a_budget_that_covers_the_committed_tasks_is_planned_with_them():
    budget = _spent_so_far() + 4 * FAST_TASK + 16 * SLOW_TASK + 6 * (FAST_TASK - SLOW_TASK)
    rule = ObjectiveRule()
    out = rule.run(_snap(budget, 20, fast_queued=4), None)
    assert not [d for d in out if d.action == Recorded.OBJECTIVE], out
    entry = rule.plans["r"]
    assert abs(entry["committed"] - 4 * FAST_TASK) < 1e-6
    # spent + committed + the plan for the 16 tasks not queued stays within the budget
    assert entry["spent"] + entry["committed"] + entry["plan"]["cost"] <= budget + 1e-6
    # the money of 6 slow tasks made fast, less half a fast task kept back for rounding
    # (one slow task's upgrade here): 5
    assert abs(entry["plan"]["tasks"]["k"].get("fast", 0) - 5) < 1e-6


def test_a_parked_pool_is_not_taken_back_when_its_idle_bill_leaves_no_money():
    # the fast pool was parked 10 s ago; the budget left would buy 6 fast tasks, but the
    # fast workers would be billed the 10 s they sat parked (2 x 10 s x $4/h = 80 fast
    # tasks' worth): the rule keeps the fast pool parked (before: unparked it)
    budget = _spent_so_far() + 20 * SLOW_TASK + 6 * (FAST_TASK - SLOW_TASK)
    rule = ObjectiveRule()
    out = rule.run(_snap(budget, 20, parked=("f0", "f1"), fast_stopped=NOW - 10), None)
    assert not [d for d in out if d.action in (Action.UNPARK, Action.MOVE)], out
    assert not [d for d in out if d.action == Recorded.OBJECTIVE], out
    assert rule.plans["r"]["plan"]["tasks"]["k"].get("fast", 0) == 0


def test_scaling_keeps_a_planned_pools_idle_workers_while_the_run_has_work():
    # 2 fast workers idle for a moment, 4 slow busy; the cost plan for the work left needs
    # one fast worker: the rule does not retire the other mid-run (the plan's rounding
    # flips between 1 and 2 and a retired worker costs its start-up when it is asked back)
    from blockflow.pools.scaling import PoolScalingRule, ScalingRequest

    snap = _snap(1.0, 96)
    for i in range(4):
        snap.workers[f"s{i}"].processing = 1
    run = snap.run
    run.objective = Objective("cost", 8.0, None)
    run.started = NOW
    request = ScalingRequest(pools={"fast": FAST, "slow": SLOW},
                             bounds={"fast": (0, 2), "slow": (0, 4)}, wait_count=1,
                             startup=0.5)
    rule = PoolScalingRule()
    out = [d for _ in range(3) for d in rule.run(snap, request, run, {"k": 0.5})]
    assert not [d for d in out if d.action == Action.RETIRE], out
    assert rule.targets["fast"] == 2 and "keeps its 2 workers" in rule.reasons["fast"]
    # no work left: the pool shrinks to its minimum, idle workers retired
    run.group_pending.clear()
    out = [d for _ in range(2) for d in rule.run(snap, request, run, {"k": 0.5})]
    assert {d.worker for d in out if d.action == Action.RETIRE} == {"f0", "f1"}


def test_a_parked_pool_comes_back_with_the_workers_the_plan_needs_cheapest_first():
    # near the deadline the cheap pool cannot finish alone: the plan needs a little of the
    # parked fast pool - one worker, the one parked most recently (the other sat parked
    # longer: taking it back bills that whole gap)
    snap = _snap(1.0, 16, parked=("f0", "f1"), fast_stopped=NOW - 3)
    snap.run.spans["f1"] = [NOW - 3.125, NOW - 1]
    for i in range(4):
        snap.workers[f"s{i}"].processing = 1
    run = snap.run
    run.objective = Objective("cost", 2.5, None)
    run.started = NOW - 0.5  # 2 s left: the slow pool takes 4 x 3.5 = 14 of 16
    rule = ObjectiveRule()
    out = rule.run(snap, None)
    assert 0 < rule.plans["r"]["plan"]["tasks"]["k"].get("fast", 0) < 4, rule.plans["r"]
    assert [d.worker for d in out if d.action == Action.UNPARK] == ["f1"], out


def _cost_snap(pending, left, *, fast_joined=True, fast_begun=False, throughput=SECONDS):
    snap = _snap(1.0, pending)
    snap.throughput = throughput
    for i in range(4):
        snap.workers[f"s{i}"].processing = 1
    if not fast_begun:
        for a in ("f0", "f1"):
            del snap.run.spans[a]
            del snap.run.busy[a]
    if not fast_joined:
        for a in ("f0", "f1"):
            del snap.workers[a]
    snap.run.objective = Objective("cost", 10.0, None)
    snap.run.started = NOW - (10.0 - left)
    return snap


def test_a_pool_that_has_not_begun_starts_its_share_late_and_in_one_stretch():
    # 96 tasks, 7.5 s left: the fast pool's share is a third of its time: it waits
    rule = ObjectiveRule()
    out = rule.run(_cost_snap(96, 7.5), None)
    assert rule.plans["r"]["plan"]["tasks"]["k"].get("fast", 0) > 30
    assert sorted(d.worker for d in out if d.action == Action.PARK) == ["f0", "f1"], out
    # 3 s left and 64 tasks: the share needs nearly all the fast pool's time: it starts,
    # both workers
    out = rule.run(_cost_snap(64, 3.0), None)
    assert not [d for d in out if d.action == Action.PARK], out
    # a pool that began (ran tasks of the run) follows the plan at once
    out = rule.run(_cost_snap(96, 7.5, fast_begun=True), None)
    assert not [d for d in out if d.action == Action.PARK], out


def test_before_any_group_is_measured_only_the_cheapest_pool_takes_tasks():
    rule = ObjectiveRule()
    out = rule.run(_cost_snap(96, 7.5, throughput={}), None)
    park = [d for d in out if d.action == Action.PARK]
    assert sorted(d.worker for d in park) == ["f0", "f1"], out
    assert "pool 'slow' is the cheapest per unit of work" in park[0].reason


def test_scaling_starts_a_dear_pool_from_zero_only_when_its_share_needs_it():
    from blockflow.pools.scaling import PoolScalingRule, ScalingRequest

    request = ScalingRequest(pools={"fast": FAST, "slow": SLOW},
                             bounds={"fast": (0, 2), "slow": (0, 4)}, startup=0.5)
    rule = PoolScalingRule()
    snap = _cost_snap(96, 6.0, fast_joined=False)
    targets, reasons, _ = rule.size(snap, request, snap.run, {"k": 0.5})
    assert targets == {"fast": 0, "slow": 4}, reasons
    assert "starts later" in reasons["fast"]
    snap = _cost_snap(96, 5.5, fast_joined=False)
    targets, reasons, _ = rule.size(snap, request, snap.run, {"k": 0.5})
    assert targets == {"fast": 2, "slow": 4}, reasons


def test_a_working_pool_takes_a_task_per_thread_beyond_its_plan_before_it_is_parked():
    # the fast pool began the run and holds one task per worker; the plan (few tasks
    # left beyond what the slow pool does) gives it one task: it stays on for a margin of
    # one task per thread rather than be parked and billed its gap if it must come back
    rule = ObjectiveRule()
    snap = _cost_snap(20, 2.5, fast_begun=True)
    for a in ("f0", "f1"):
        snap.workers[a].processing = 1
    out = rule.run(snap, None)
    planned = rule.plans["r"]["plan"]["tasks"]["k"].get("fast", 0)
    assert 0.5 < planned <= 2.5, rule.plans["r"]
    assert not [d for d in out if d.action == Action.PARK], out
    # with a plan that gives it nothing and its margin held, it is parked
    snap = _cost_snap(8, 2.5, fast_begun=True)
    for a in ("f0", "f1"):
        snap.workers[a].processing = 2
    out = rule.run(snap, None)
    assert sorted(d.worker for d in out if d.action == Action.PARK) == ["f0", "f1"], out
