"""The pool rules on plain data: the scaling rule's targets, hysteresis and hold; the
objective rule's plan over held work (tests/scheduling/test_plan_dispatch.py has the
dispatch)."""

from __future__ import annotations

from collections import Counter

from blockflow import _distributed
from blockflow.scheduling.actions import Action, Recorded
from blockflow.pools.objective import Objective
from blockflow.scheduling.policies import ClusterSnapshot
from blockflow.pools.pool import Pool
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


def _snap(budget, pending, *, fast_queued=0, fast_stopped=None):
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
                           throughput=SECONDS)


def _spent_so_far():
    return 2 * FAST_TASK + 4 * SLOW_TASK


def _scaling(hold=0.0, interval=0.2, startup=0.5, wait_count=1, fast=(0, 2)):
    from blockflow.pools.scaling import PoolScalingRule, ScalingRequest

    request = ScalingRequest(pools={"fast": FAST, "slow": SLOW},
                             bounds={"fast": fast, "slow": (0, 4)}, wait_count=wait_count,
                             startup=startup, hold=hold, interval=interval)
    return PoolScalingRule(), request


def test_scaling_keeps_a_worker_its_hold_time_after_it_arrived():
    # the run has no work left: the pools go to their minimum at once, but the fast workers
    # arrived 1 s ago and the hold is 5 s: idle, they are kept until 5 s after they
    # arrived (before: retired after wait_count idle checks, whatever their age)
    rule, request = _scaling(hold=5.0)
    snap = _snap(1.0, 0)
    for i in range(4):
        snap.workers[f"s{i}"].processing = 1
    rule.arrived.update({"f0": NOW - 1, "f1": NOW - 1})
    run = snap.run
    out = []
    for t in (0, 1, 2, 3, 3.9):
        snap.time = NOW + t
        out += rule.run(snap, request, run, {"k": 0.5})
    assert not [d for d in out if d.action == Action.RETIRE], out
    assert rule.targets["fast"] == 0
    snap.time = NOW + 4.1
    out = rule.run(snap, request, run, {"k": 0.5})
    retired = [d for d in out if d.action == Action.RETIRE]
    assert sorted(d.worker for d in retired) == ["f0", "f1"], out
    assert all(d.seen["age"] >= 5.0 for d in retired)


def test_a_pools_target_does_not_go_down_and_straight_back_up():
    # a cost deadline; the fast pool runs its share. The run's backlog dips (its first
    # batch nearly done) and grows again (the next batch): the LP asks 2, 0, 0, 2 fast
    # workers; the rule keeps 2 for the hold (before: 2 -> 0 -> 2, and the fast workers,
    # idle in the dip, retired, to be started again)
    rule, request = _scaling(hold=5.0)
    snap = _cost_snap(96, 6.0, fast_begun=True)
    run = snap.run
    asked, targets, reasons, out = [], [], [], []
    for t, pending in ((0.0, 96), (0.5, 30), (1.0, 30), (1.5, 90)):
        snap.time = NOW + t
        run.group_pending["k"] = pending
        for a in ("f0", "f1"):
            snap.workers[a].processing = 1 if pending > 30 else 0
        asked.append(rule.size(snap, request, run, {"k": 0.5})[0]["fast"])
        out += rule.run(snap, request, run, {"k": 0.5})
        targets.append(rule.targets["fast"])
        reasons.append(rule.reasons["fast"])
    assert asked == [2, 0, 0, 2], asked
    assert targets == [2, 2, 2, 2], targets
    assert "keeps a target of 2: the most it needed in the last 5 s" in reasons[1]
    assert not [d for d in out if d.action in (Action.RETIRE, Recorded.SCALE)
                and d.target == "fast"], out


def test_a_budget_that_cannot_pay_for_a_pool_overrides_the_hold():
    # the budget is spent: only the cheapest pool works; the fast workers, idle and just
    # arrived, go at once (the hold would bill them for nothing)
    rule, request = _scaling(hold=30.0)
    snap = _snap(_spent_so_far() / 2, 20)
    for i in range(4):
        snap.workers[f"s{i}"].processing = 1
    out = rule.run(snap, request, snap.run, {"k": 0.5}, spent=_spent_so_far())
    assert rule.targets["fast"] == 0
    retired = [d for d in out if d.action == Action.RETIRE]
    assert sorted(d.worker for d in retired) == ["f0", "f1"], out
    assert "the budget cannot pay for it" in retired[0].reason


def test_a_pool_goes_down_once_its_need_stayed_lower_for_the_hold():
    rule, request = _scaling(hold=2.0)
    snap = _cost_snap(96, 6.0, fast_begun=True)
    run = snap.run
    rule.arrived.update({a: NOW - 60 for a in snap.workers})
    rule.run(snap, request, run, {"k": 0.5})
    assert rule.targets["fast"] == 2
    run.group_pending["k"] = 16  # the slow pool finishes it alone
    targets, out = [], []
    for t in (0.5, 1.0, 1.5, 2.5):
        snap.time = NOW + t
        out = rule.run(snap, request, run, {"k": 0.5})
        targets.append(rule.targets["fast"])
    assert targets == [2, 2, 2, 0], targets  # lower for 2 s (the hold) from 0.5 s on
    scale = [d for d in out if d.action == Recorded.SCALE and d.target == "fast"]
    assert [(d.seen["current"], d.seen["target"]) for d in scale] == [(2, 0)], out
    assert sorted(d.worker for d in out if d.action == Action.RETIRE) == ["f0", "f1"]


def test_no_scale_record_when_a_pool_has_its_target_already():
    # the first check: the fast pool has no worker and needs none, the slow pool has its
    # four: nothing to record (before: "0 -> 0 workers" and "4 -> 4 workers")
    rule, request = _scaling()
    snap = _cost_snap(50, 8.0, fast_joined=False)
    out = rule.run(snap, request, snap.run, {"k": 0.5})
    assert rule.targets == {"fast": 0, "slow": 4}, rule.reasons
    assert not [d for d in out if d.action == Recorded.SCALE], out
    # a change is recorded once
    snap.run.group_pending["k"] = 96
    snap.time = NOW + 3.0
    out = [d for _ in range(3) for d in rule.run(snap, request, snap.run, {"k": 0.5})]
    scale = [d for d in out if d.action == Recorded.SCALE]
    assert [(d.target, d.seen["current"], d.seen["target"]) for d in scale] == [
        ("fast", 0, 2)], out


def test_workers_not_joined_yet_have_the_time_left_less_their_start_up():
    # 80 tasks, 6 s left; one fast worker started but not joined, start-up 2 s: the fast
    # share (36 tasks, 4.5 s of one worker) does not fit in the 3.5 s a new worker has
    # after its start-up: two are needed (before: the starting worker counted as there,
    # one asked for, and the deadline missed)
    rule, request = _scaling(startup=2.0)
    request.starting = {"fast": 1}
    snap = _cost_snap(80, 6.0, fast_joined=False)
    targets, reasons, _ = rule.size(snap, request, snap.run, {"k": 0.5})
    assert targets == {"fast": 2, "slow": 4}, reasons
    assert "less start-up for workers not joined" in reasons["fast"]


def test_a_missed_deadline_starts_no_worker_that_would_join_after_the_work():
    # 0.4 s left, less than one slow task: the deadline cannot be met. The 6 tasks left
    # take the workers there 0.4 s, less than a new worker's start-up: no pool grows
    # (before: every pool at its maximum, a fast worker started and never used)
    rule, request = _scaling()
    snap = _cost_snap(6, 0.4, fast_begun=True)
    del snap.workers["f1"]
    targets, reasons, _ = rule.size(snap, request, snap.run, {"k": 0.5})
    assert targets == {"fast": 1, "slow": 4}, reasons
    assert "before a new worker of pool 'fast' would join" in reasons["fast"]
    # 96 tasks left take 6 s: a new worker helps
    snap.run.group_pending["k"] = 96
    targets, reasons, _ = rule.size(snap, request, snap.run, {"k": 0.5})
    assert targets == {"fast": 2, "slow": 4}, reasons
    assert "every pool at its maximum" in reasons["fast"]


def test_reasons_print_the_learned_speed_of_a_pool_once_measured():
    from types import SimpleNamespace

    from blockflow.pools.scaling import _speed_hint

    rule, request = _scaling()
    snap = _cost_snap(96, 6.0, fast_begun=True)
    _, reasons, _ = rule.size(snap, request, snap.run, {"k": 0.5})
    assert "speed 4x declared" in reasons["fast"], reasons
    # measured: the fast workers run at 2.2 times the typical worker, not the declared 4
    for a, w in snap.workers.items():
        w.speed, w.speed_confidence = (2.2, 0.8) if a.startswith("f") else (0.9, 0.8)
    _, reasons, seen = rule.size(snap, request, snap.run, {"k": 0.5})
    assert "speed 2.2x learned" in reasons["fast"], reasons
    assert "speed 0.9x learned" in reasons["slow"], reasons
    assert seen["speeds"] == {"fast": 2.2, "slow": 0.9}
    # a per-group speed hint: its median
    assert _speed_hint(SimpleNamespace(speed={"train": 4.0, "etl": 1.0, "io": 2.0})) == 2.0
    assert _speed_hint(SimpleNamespace(speed=None)) is None


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


def test_scaling_starts_a_dear_pool_from_zero_only_when_its_share_needs_it():
    rule, request = _scaling()
    snap = _cost_snap(96, 6.0, fast_joined=False)
    targets, reasons, _ = rule.size(snap, request, snap.run, {"k": 0.5})
    assert targets == {"fast": 0, "slow": 4}, reasons
    assert "starts later" in reasons["fast"]
    snap = _cost_snap(96, 5.5, fast_joined=False)
    targets, reasons, _ = rule.size(snap, request, snap.run, {"k": 0.5})
    assert targets == {"fast": 2, "slow": 4}, reasons


def test_a_dear_pool_is_not_started_so_late_that_its_share_cannot_fit():
    # as above at 6 s left, but the checks are 1 s apart: at the next one the fast share
    # would need more than late_start of what the pool could still do after a slow
    # start-up: it starts now (before: it waited, the start-up and the check's delay
    # taken out of the deadline's margin)
    rule, request = _scaling(interval=1.0)
    snap = _cost_snap(96, 6.0, fast_joined=False)
    targets, reasons, _ = rule.size(snap, request, snap.run, {"k": 0.5})
    assert targets == {"fast": 2, "slow": 4}, reasons


