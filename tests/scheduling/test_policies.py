"""Scheduling policies on synthetic snapshots: plain data in, decisions out, no cluster.

The same policies run on real schedulers in test_rebalancer.py; here every input is
written out, so each rule (pause, hysteresis, last worker, moves, no bounce, static shares,
device-memory AMM plan) is checked on its own.
"""

from __future__ import annotations

import dataclasses

import inspect

import pytest
from distributed.utils_test import gen_cluster

from blockflow import _distributed
from blockflow._distributed.metrics import WorkerMetrics
from blockflow.scheduling import policies
from blockflow.scheduling.policies import (
    POLICIES,
    REGISTRY,
    ClusterSnapshot,
    ComposedPolicy,
    DeviceMemoryAMMPolicy,
    DynamicPolicy,
    MemoryPolicy,
    ObservePolicy,
    RebalancePolicy,
    StaticCapacityPolicy,
    StaticRoundRobinPolicy,
    make_policy,
)
from blockflow.scheduling.rules import MoveRule, PauseRule, RuleContext
from blockflow.scheduling.rules.move import best_target

GiB = 2**30


def metrics(util=None, used=None, total=None, own=None):
    return WorkerMetrics(gpu_utilization=util, gpu_memory_used=used, gpu_memory_total=total,
                         host_memory=None, own_utilization=own)


def worker(addr, *, util=None, used=None, total=None, own=None, status="running",
           paused=False, processing=0, executing=0, occupancy=0.0, speed=1.0, nthreads=1,
           capacity=None):
    return _distributed.WorkerView(
        address=addr, nthreads=nthreads, status=status, paused_by_blockflow=paused,
        metrics=metrics(util, used, total, own), speed=speed, processing=processing,
        executing=executing, occupancy=occupancy, capacity=capacity)


def task(key, duration=1.0, *, group="blockflow-k", state="processing", restricted=False,
         runnable=True, valid=None, comm=None, priority=()):
    return _distributed.TaskView(key=key, group=group, state=state, priority=priority,
                                 duration=duration, restricted=restricted, runnable=runnable,
                                 allowed_workers=valid, comm_cost=comm or {})


def snap(workers, *, waiting=None, queued=0, event="tick", new_tasks=()):
    return ClusterSnapshot(time=0.0, workers={w.address: w for w in workers}, queued=queued,
                           event=event, waiting=waiting or {}, new_tasks=list(new_tasks))


def run(policy, snapshot):
    return list(policy.run(snapshot))


# --- registry and interface --------------------------------------------------------------


def test_one_registry_of_module_level_policy_classes():
    assert POLICIES == tuple(REGISTRY) == ("dynamic", "memory", "static-round-robin",
                                           "static-capacity", "off")
    for name, cls in REGISTRY.items():
        assert cls.name == name
        assert issubclass(cls, RebalancePolicy)
        assert getattr(policies, cls.__name__) is cls  # module level: nameable by path
        assert "<locals>" not in cls.__qualname__
        assert isinstance(make_policy(name), cls)
    assert inspect.isabstract(RebalancePolicy)
    with pytest.raises(ValueError, match=r"Unknown blockflow policy 'nonsense'; choose one "
                                         r"of dynamic, memory, static-round-robin, "
                                         r"static-capacity, off\."):
        make_policy("nonsense")


def test_the_cli_and_the_plugin_read_the_registry():
    import blockflow.scheduling
    from blockflow.cli import cli

    assert blockflow.scheduling.POLICIES is POLICIES
    run_cmd = cli.commands["run"]
    params = [p for c in getattr(run_cmd, "commands", {"": run_cmd}).values()
              for p in c.params if p.name == "policy"]
    assert params and all(tuple(p.type.choices) == POLICIES for p in params)


def test_observe_and_memory_yield_no_tick_decisions():
    s = snap([worker("a", util=99, used=99, total=100), worker("b")])
    assert run(ObservePolicy(), s) == []
    assert run(MemoryPolicy(), s) == []
    (amm,) = MemoryPolicy(memory_high=0.9, memory_low=0.5).amm_policies()
    assert isinstance(amm, DeviceMemoryAMMPolicy)
    assert (amm.memory_high, amm.memory_low) == (0.9, 0.5)


# --- dynamic: pause and resume -----------------------------------------------------------


def test_dynamic_pauses_a_gpu_busy_with_other_work_and_logs_what_it_saw():
    s = snap([worker("a", util=95, used=0, total=GiB, own=0), worker("b", util=0, used=0,
                                                                    total=GiB, own=0)])
    (d,) = run(DynamicPolicy(), s)
    assert (d.action, d.worker) == ("pause", "a")
    assert d.reason == "GPU 95% busy with other work >= 80%"
    assert d.seen["gpu_utilization"] == 95


def test_dynamic_counts_a_workers_own_load_as_its_own():
    # 90 % utilisation, 85 % of it this worker's own kernels: not hot
    s = snap([worker("a", util=90, used=0, total=GiB, own=85, processing=1, executing=1),
              worker("b")])
    assert run(DynamicPolicy(), s) == []
    # own utilisation unknown: the executing share of its threads is assumed its own
    s = snap([worker("a", util=90, used=0, total=GiB, own=None, processing=1, executing=1),
              worker("b")])
    assert run(DynamicPolicy(), s) == []


def test_dynamic_pauses_a_nearly_full_device():
    s = snap([worker("a", util=0, used=0.9 * GiB, total=GiB), worker("b")])
    (d,) = run(DynamicPolicy(), s)
    assert (d.action, d.reason) == ("pause", "device memory 90% >= high-water 85%")


def test_dynamic_never_pauses_the_last_usable_worker():
    s = snap([worker("a", util=99, used=0, total=GiB, own=0)])
    (d,) = run(DynamicPolicy(), s)
    assert d.action == "keep" and "last usable worker" in d.reason
    s = snap([worker("a", util=99, used=0, total=GiB, own=0),
              worker("b", util=99, used=0, total=GiB, own=0)])
    assert [d.action for d in run(DynamicPolicy(), s)] == ["pause", "keep"]


@pytest.mark.parametrize("used, expected", [(0.80, []), (0.71, []), (0.70, ["resume"]),
                                            (0.10, ["resume"])])
def test_dynamic_resumes_below_the_low_water_mark_only(used, expected):
    s = snap([worker("a", util=0, used=used * GiB, total=GiB, paused=True, status="paused"),
              worker("b")])
    assert [d.action for d in run(DynamicPolicy(), s)] == expected


def test_dynamic_leaves_pauses_it_did_not_make_alone():
    s = snap([worker("a", util=0, used=0, total=GiB, status="paused"), worker("b")])
    assert run(DynamicPolicy(), s) == []


def test_dynamic_without_gpu_metrics_never_pauses():
    s = snap([worker("a"), worker("b")])
    assert run(DynamicPolicy(), s) == []


# --- dynamic: moves ----------------------------------------------------------------------


def test_dynamic_moves_waiting_tasks_from_the_busiest_worker_to_idle_ones():
    waiting = {"a": [task(("blockflow-k", i)) for i in range(5, 0, -1)]}
    s = snap([worker("a", processing=6, executing=1, occupancy=6.0), worker("b"),
              worker("c")], waiting=waiting)
    moves = run(DynamicPolicy(), s)
    assert [d.action for d in moves] == ["move"] * len(moves)
    assert 2 <= len(moves) <= 5
    assert {d.target for d in moves} == {"b", "c"}
    assert all(d.worker == "a" for d in moves)
    assert moves[0].key == ("blockflow-k", 5)  # the last to run moves first


def test_dynamic_moves_respect_valid_workers_and_comm_cost():
    waiting = {"a": [task("t1", valid=frozenset({"c"})), task("t2", comm={"b": 100.0})]}
    s = snap([worker("a", processing=4, executing=1, occupancy=4.0), worker("b"),
              worker("c")], waiting=waiting)
    moves = run(DynamicPolicy(), s)
    assert [(d.key, d.target) for d in moves] == [("t1", "c"), ("t2", "c")]


def test_dynamic_moves_nothing_when_the_gain_is_too_small():
    waiting = {"a": [task("t", duration=0.001)]}
    s = snap([worker("a", processing=2, executing=1, occupancy=0.002), worker("b")],
             waiting=waiting)
    assert run(DynamicPolicy(), s) == []


def test_dynamic_never_moves_a_task_back_to_a_worker_it_left():
    policy = DynamicPolicy()
    s1 = snap([worker("a", processing=3, executing=1, occupancy=3.0), worker("b")],
              waiting={"a": [task("t")]})
    assert [(d.key, d.target) for d in run(policy, s1)] == [("t", "b")]
    s2 = snap([worker("a"), worker("b", processing=3, executing=1, occupancy=3.0)],
              waiting={"b": [task("t")]})
    assert run(policy, s2) == []
    # ... unless it now sits on a paused worker
    s3 = snap([worker("a"), worker("b", processing=3, executing=1, occupancy=3.0,
                                    status="paused")], waiting={"b": [task("t")]})
    assert [(d.key, d.target) for d in run(policy, s3)] == [("t", "a")]


def test_dynamic_balancing_leaves_data_bound_tasks_with_their_data():
    """A 1 s task whose inputs take 1.5 s to send (more than its compute) stays, though
    moving it would finish it earlier; one taking 0.1 s moves, when the gain covers twice the
    transfer; off a paused worker either moves. (Issue 39: the bound was a quarter of the
    compute, which left 32 MiB inputs of 0.3 s tasks unbalanced with stealing suspended.)"""
    def tasks():
        return [task("heavy", comm={"b": 1.5}), task("light", comm={"b": 0.1})]

    s = snap([worker("a", processing=6, executing=1, occupancy=6.0), worker("b")],
             waiting={"a": tasks()})
    decisions = run(DynamicPolicy(), s)
    assert [(d.key, d.target) for d in decisions if d.action == "move"] == [("light", "b")]
    # the refused move is logged once, with its transfer (the heavy task)
    assert [(d.action, d.key, d.target) for d in decisions if d.action != "move"] == [
        ("keep", "heavy", "b")]
    # the gain (about 1 s here) must exceed twice the transfer
    s = snap([worker("a", processing=2, executing=1, occupancy=2.0), worker("b")],
             waiting={"a": [task("light", comm={"b": 0.2})]})
    assert [(d.key, d.target) for d in run(DynamicPolicy(), s)] == [("light", "b")]
    s = snap([worker("a", processing=2, executing=1, occupancy=1.5), worker("b")],
             waiting={"a": [task("light", comm={"b": 0.24})]})
    assert [d.action for d in run(DynamicPolicy(), s)] == ["keep"]
    s = snap([worker("a", processing=6, executing=1, occupancy=6.0, status="paused"),
              worker("b")], waiting={"a": tasks()})
    assert {d.key for d in run(DynamicPolicy(), s)} == {"heavy", "light"}


def test_dynamic_only_moves_off_paused_workers_while_the_scheduler_queues():
    waiting = {"a": [task("t1")], "b": [task("t2")]}
    s = snap([worker("a", processing=3, executing=1, occupancy=3.0),
              worker("b", processing=3, executing=1, occupancy=3.0, status="paused"),
              worker("c")], waiting=waiting, queued=10)
    assert [(d.worker, d.key) for d in run(DynamicPolicy(), s)] == [("b", "t2")]


def test_dynamic_move_budget():
    waiting = {"a": [task(i) for i in range(50)]}
    s = snap([worker("a", processing=51, executing=1, occupancy=51.0)]
             + [worker(f"w{i}") for i in range(8)], waiting=waiting)
    assert len(run(DynamicPolicy(move_budget=3), s)) == 3


def test_a_worker_that_paused_itself_keeps_no_waiting_task():
    """A worker paused for host memory (``stopped``) starts nothing: its last task not
    started moves too, though it holds no more tasks than threads (issue 27: one task was
    left there for good); each rescue is logged with its reason."""
    workers = [worker("a", processing=1, executing=0, occupancy=1.0, status="paused"),
               worker("b", processing=3, executing=1, occupancy=3.0), worker("c")]
    s = ClusterSnapshot(time=0.0, workers={w.address: w for w in workers},
                        waiting={"a": [task("t")]}, stopped=frozenset({"a"}), balancing=False)
    (d,) = run(DynamicPolicy(), s)
    assert (d.worker, d.key, d.target) == ("a", "t", "c")
    assert d.reason.startswith("projected finish never here (worker paused itself")
    # a worker blockflow paused (scheduler side) takes its next task itself: none listed
    s.stopped = frozenset()
    s.waiting = {"a": []}
    assert run(DynamicPolicy(), s) == []


def test_rescues_off_a_paused_worker_are_outside_the_move_budget():
    """However many tasks a paused worker holds, they all move in one tick; the budget bounds
    moves between running workers only."""
    waiting = {"a": [task(("p", i), 0.01) for i in range(200)],
               "b": [task(("r", i)) for i in range(20)]}
    s = snap([worker("a", processing=200, occupancy=2.0, status="paused"),
              worker("b", processing=21, executing=1, occupancy=21.0)]
             + [worker(f"w{i}") for i in range(4)], waiting=waiting)
    out = run(DynamicPolicy(move_budget=3), s)
    assert sum(d.worker == "a" for d in out) == 200
    assert sum(d.worker == "b" for d in out) == 3


def test_dynamic_does_nothing_when_a_graph_arrives():
    s = snap([worker("a", util=99, used=0, total=GiB, own=0), worker("b")], event="graph",
             new_tasks=[task(("blockflow-k", 0), state="released")])
    assert run(DynamicPolicy(), s) == []


def test_dynamic_moved_memory_is_bounded():
    """The move rule remembers the workers a task was moved off for at most
    ``moved_memory`` tasks (oldest forgotten first), on its own and inside the policy."""
    waiting = {"a": [task(i) for i in range(40)]}
    s = snap([worker("a", processing=41, executing=1, occupancy=41.0)]
             + [worker(f"w{i}") for i in range(8)], waiting=waiting)
    rule = MoveRule(best_target, move_budget=100, min_gain=0.005, moved_memory=10)
    assert len(rule.run(s, RuleContext())) > 10
    assert len(rule.moved_off) == 10
    policy = DynamicPolicy(move_budget=100)
    policy.move.moved_memory = 10
    assert len(run(policy, s)) > 10
    assert len(policy.move.moved_off) == 10


# --- static policies ---------------------------------------------------------------------


def _new_tasks(n, **kw):
    return [task(("blockflow-k", i), state="released", **kw) for i in range(n)]


def test_static_round_robin_assigns_kernel_blocks_in_turn_when_a_graph_arrives():
    ws = [worker("a"), worker("b"), worker("c")]
    new = _new_tasks(30) + [task(("other", 0), group="other", state="released"),
                            task(("blockflow-k", 99), state="released", restricted=True),
                            task(("blockflow-k", 98), state="memory"),
                            task(("blockflow-k", 97), state="released", runnable=False)]
    ds = run(StaticRoundRobinPolicy(), snap(ws, event="graph", new_tasks=new))
    assert sorted((d.worker, len(d.keys)) for d in ds) == [("a", 10), ("b", 10), ("c", 10)]
    assert {k for d in ds for k in d.keys} == {("blockflow-k", i) for i in range(30)}
    assert all(d.action == "assign" for d in ds)
    assert run(StaticRoundRobinPolicy(), snap(ws, new_tasks=new)) == []  # ticks: nothing


def test_static_policies_skip_workers_that_are_not_running():
    ws = [worker("a"), worker("b", status="paused")]
    ds = run(StaticRoundRobinPolicy(), snap(ws, event="graph", new_tasks=_new_tasks(4)))
    assert [(d.worker, len(d.keys)) for d in ds] == [("a", 4)]
    assert run(StaticRoundRobinPolicy(), snap([worker("b", status="paused")], event="graph",
                                              new_tasks=_new_tasks(4))) == []


def test_static_capacity_assigns_in_proportion_to_capacity_or_threads():
    ws = [worker("a", capacity=1), worker("b", capacity=1), worker("c", capacity=0.5),
          worker("d", capacity=0.25)]
    ds = run(StaticCapacityPolicy(), snap(ws, event="graph", new_tasks=_new_tasks(110)))
    assert {d.worker: len(d.keys) for d in ds} == {"a": 40, "b": 40, "c": 20, "d": 10}
    ws = [worker("a", nthreads=3), worker("b", nthreads=1)]
    ds = run(StaticCapacityPolicy(), snap(ws, event="graph", new_tasks=_new_tasks(40)))
    assert {d.worker: len(d.keys) for d in ds} == {"a": 30, "b": 10}


# --- device-memory AMM policy ------------------------------------------------------------


def _plan(policy, workers, held, accept=True):
    gen = policy.plan({w.address: w for w in workers}, held)
    out, chosen = [], None
    try:
        s = next(gen)
        while True:
            out.append(s)
            chosen = (sorted(s.candidates)[0] if accept else None)
            s = gen.send(chosen)
    except StopIteration:
        pass
    return out


class _Logged(DeviceMemoryAMMPolicy):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.logged = []

    def log(self, action, worker, reason, seen, key=None, target=None):
        self.logged.append((action, worker, key, target))


def test_device_memory_amm_plan_copies_off_then_drops_largest_first():
    full = worker("a", used=0.95 * GiB, total=GiB)
    roomy = worker("b", used=0.1 * GiB, total=GiB)
    held = {"a": [_distributed.HeldResult("big", int(0.2 * GiB), frozenset({"a", "b"})),
                  _distributed.HeldResult("mid", int(0.1 * GiB), frozenset({"a"})),
                  _distributed.HeldResult("small", 1000, frozenset({"a"}))],
            "b": []}
    policy = _Logged(memory_high=0.85, memory_low=0.7)
    out = _plan(policy, [full, roomy], held)
    # 0.95 - 0.70 = 0.25 GiB to free: drop "big" (held on b too), copy "mid" to b
    assert [(s.op, s.key, set(s.candidates)) for s in out] == [
        ("drop", "big", {"a"}), ("replicate", "mid", {"b"})]
    assert [(a, k) for a, _, k, _ in policy.logged] == [("memory-move", "big"),
                                                        ("memory-move", "mid")]
    assert policy.logged[1][3] == "b"


def test_device_memory_amm_plan_needs_a_roomy_worker_and_counts_only_accepted_moves():
    full = worker("a", used=0.95 * GiB, total=GiB)
    also_full = worker("b", used=0.9 * GiB, total=GiB)
    held = {"a": [_distributed.HeldResult("x", GiB // 2, frozenset({"a"}))]}
    assert _plan(DeviceMemoryAMMPolicy(), [full, also_full], held) == []
    no_metrics = worker("c")
    assert _plan(DeviceMemoryAMMPolicy(), [full, no_metrics], held) == []
    roomy = worker("b", used=0, total=GiB)
    held = {"a": [_distributed.HeldResult(i, GiB // 8, frozenset({"a"})) for i in range(4)]}
    # declined suggestions free nothing: every result is offered
    assert len(_plan(_Logged(), [full, roomy], held, accept=False)) == 4
    # accepted ones do: 0.25 GiB to free, 1/8 GiB each
    assert len(_plan(_Logged(), [full, roomy], held, accept=True)) == 2


def test_device_memory_amm_policy_is_nameable_by_dotted_path():
    from distributed.utils import import_term

    assert import_term("blockflow.scheduling.policies.DeviceMemoryAMMPolicy") \
        is DeviceMemoryAMMPolicy
    assert import_term("blockflow.scheduling.DeviceMemoryAMMPolicy") is DeviceMemoryAMMPolicy


@gen_cluster(client=True, config={
    "distributed.scheduler.active-memory-manager.start": True,
    "distributed.scheduler.active-memory-manager.policies": [
        {"class": "blockflow.scheduling.policies.DeviceMemoryAMMPolicy",
         "memory_high": 0.9, "memory_low": 0.6}]})
async def test_device_memory_amm_policy_from_distributed_config(c, s, a, b):
    (policy,) = [p for p in s.extensions["amm"].policies
                 if isinstance(p, DeviceMemoryAMMPolicy)]
    assert (policy.memory_high, policy.memory_low) == (0.9, 0.6)
    await c.amm.run_once()  # runs with no GPU metrics: suggests nothing, raises nothing
    assert await c.submit(sum, [1, 2]) == 3


def test_dynamic_knowing_no_speeds_moves_only_off_paused_workers():
    """balancing=False: distributed's stealing balances running workers, as in plain Dask."""
    waiting = {"a": [task("t1")], "b": [task("t2")]}
    workers = [worker("a", processing=3, executing=1, occupancy=3.0),
               worker("b", processing=3, executing=1, occupancy=3.0, status="paused"),
               worker("c")]
    s = ClusterSnapshot(time=0.0, workers={w.address: w for w in workers}, waiting=waiting,
                        balancing=False)
    assert [(d.worker, d.key) for d in run(DynamicPolicy(), s)] == [("b", "t2")]
    s.balancing = True
    assert {d.key for d in run(DynamicPolicy(), s)} == {"t1", "t2"}


def test_dynamic_knowing_no_speeds_fills_idle_threads_with_measured_work():
    """Cold start (every input made on one worker): while speeds are not known to differ,
    blockflow hands tasks of measured duration to idle threads only, one per free thread;
    unmeasured ones (default duration) are left to distributed's stealing."""
    def cluster():
        return [worker("a", processing=12, executing=1, occupancy=12.0), worker("b"),
                worker("c", nthreads=2), worker("d", processing=1, executing=1,
                                                occupancy=1.0)]

    waiting = {"a": [task(("k", i)) for i in range(11, 0, -1)]}
    s = ClusterSnapshot(time=0.0, workers={w.address: w for w in cluster()},
                        waiting=waiting, balancing=False)
    moves = run(DynamicPolicy(), s)
    assert sorted(d.target for d in moves) == ["b", "c", "c"]  # d is busy: not idle
    assert [d.key for d in moves] == [("k", 11), ("k", 10), ("k", 9)]
    guessed = {"a": [task(("k", i), duration=0.5) for i in range(11, 0, -1)]}
    guessed = {"a": [dataclasses.replace(t, duration_measured=False) for t in guessed["a"]]}
    s = ClusterSnapshot(time=0.0, workers={w.address: w for w in cluster()}, waiting=guessed,
                        balancing=False)
    assert run(DynamicPolicy(), s) == []
    # inputs taking more than 5 % of the compute to send stay with their data
    heavy = {"a": [task(("k", i), comm={"b": 0.06, "c": 0.04}) for i in range(11, 0, -1)]}
    s = ClusterSnapshot(time=0.0, workers={w.address: w for w in cluster()}, waiting=heavy,
                        balancing=False)
    decisions = run(DynamicPolicy(), s)
    assert sorted(d.target for d in decisions if d.action == "move") == ["c", "c"]
    assert [(d.action, d.target) for d in decisions if d.action != "move"] == [("keep", "b")]


# --- placement by device working set ------------------------------------------------------


def test_dynamic_places_blocks_only_where_their_working_set_fits():
    """Two devices, 1 GiB and 8 GiB free; kernels needing 2 GiB go to the 8 GiB one only."""
    ws = [worker("small", used=7 * GiB, total=8 * GiB), worker("big", used=0, total=8 * GiB)]
    new = [task(("blockflow-k", i), state="released") for i in range(6)]
    new = [_distributed.TaskView(key=t.key, group=t.group, state=t.state,
                                 working_set=2 * GiB) for t in new]
    (d,) = run(DynamicPolicy(), snap(ws, event="graph", new_tasks=new))
    assert (d.action, d.workers, len(d.keys)) == ("place", ("big",), 6)
    assert d.seen["working_set"] == 2 * GiB
    assert d.seen["gpu_memory_free"] == {"small": GiB, "big": 8 * GiB}
    assert "2.00 GiB working set" in d.reason


def test_dynamic_placement_leaves_alone_what_fits_everywhere_or_nowhere():
    ws = [worker("a", used=0, total=8 * GiB), worker("b", used=0, total=8 * GiB)]

    def new(ws_bytes, **kw):
        return [_distributed.TaskView(key=("blockflow-k", i), group="blockflow-k",
                                      state="released", working_set=ws_bytes, **kw)
                for i in range(3)]

    assert run(DynamicPolicy(), snap(ws, event="graph", new_tasks=new(GiB))) == []
    (d,) = run(DynamicPolicy(), snap(ws, event="graph", new_tasks=new(16 * GiB)))
    assert d.action == "keep" and "DeviceMemoryError" in d.reason and not d.workers
    assert run(DynamicPolicy(), snap(ws, event="graph",
                                     new_tasks=new(16 * GiB, restricted=True))) == []
    assert run(DynamicPolicy(), snap(ws, event="graph", new_tasks=new(None))) == []
    # no worker reports device memory: nothing to go on
    cpus = [worker("a"), worker("b")]
    assert run(DynamicPolicy(), snap(cpus, event="graph", new_tasks=new(16 * GiB))) == []


def test_working_set_is_found_in_fused_task_specs():
    from dask._task_spec import DataNode, Task

    class K:
        def __call__(self, x):
            return x

        def blockflow_working_set(self, key):
            return 1000 * (key[1] + 1)

    inner = Task("inner", K(), 1)
    outer = Task(("blockflow-k", 2), lambda sub, *a: None, {"inner": inner},
                 DataNode(None, K()))
    assert _distributed.task_working_set(outer, ("blockflow-k", 2)) == 3000
    assert _distributed.task_working_set(Task("x", sum, [1, 2]), "x") is None


def test_dynamic_moves_a_task_once_between_busy_workers_and_again_only_to_an_idle_one():
    policy = DynamicPolicy()
    s1 = snap([worker("a", processing=3, executing=1, occupancy=3.0), worker("b"), worker("c")],
              waiting={"a": [task("t")]})
    assert [(d.key, d.target) for d in run(policy, s1)] == [("t", "b")]
    busy_c = worker("c", processing=1, executing=1, occupancy=0.5)
    s2 = snap([worker("a"), worker("b", processing=3, executing=1, occupancy=3.0), busy_c],
              waiting={"b": [task("t")]})
    # never back to the worker it was moved off, and not on to a busy one (c would finish
    # it sooner, but chasing estimates from busy worker to busy worker only churns)
    assert run(policy, s2) == []
    # an idle thread it was never moved off: it moves again (a task moved early onto a
    # worker then believed fast is not stranded there while the others idle)
    s3 = snap([worker("a"), worker("b", processing=3, executing=1, occupancy=3.0),
               worker("c")], waiting={"b": [task("t")]})
    assert [(d.key, d.target) for d in run(policy, s3)] == [("t", "c")]


# --- the balancing rule: which suspend-stealing / restore-stealing commands it yields ------------------------


def _speeds(slow: float):
    """A speed model of workers a, b (speed 1) and c (``slow``), 12 near-equal durations
    each: with c at 0.25 the speeds differ strongly (the strict test), at 0.8 weakly (only
    the weak one), at 1 not at all."""
    from blockflow.scheduling.speed import SpeedModel

    m = SpeedModel()
    for w, s in (("a", 1.0), ("b", 1.0), ("c", slow)):
        for i in range(12):
            m.observe(w, "g", 0.03 / s * (1 + 0.02 * (i % 3 - 1)))
    m.update()
    return m


STRONG, WEAK, NONE = 0.25, 0.8, 1.0


def _balancing_tick(rule, model, event="tick"):
    """One snapshot as the plugin takes it (the strict test while the rule is off, the weak
    one while on; ``balancing`` from :meth:`StealingRule.judge`) and the decisions
    :meth:`StealingRule.run` yields for it."""
    names = ["a", "b", "c"]
    ws = [worker(a, speed=model.speed(a)) for a in names]
    for w in ws:
        w.speed_confidence = model.confidence(w.address)
    s = snap(ws, event=event)
    s.speeds_differ = not rule.active and model.heterogeneous(names)
    s.speeds_differ_weakly = rule.active and model.heterogeneous(names, min_ratio=1.15, z=1.64)
    s.balancing = rule.judge(s)
    return [(d.action.value, d.worker) for d in rule.run(s, RuleContext())], s


def test_the_speed_models_of_the_balancing_tests_differ_as_named():
    strong, weak, none = _speeds(STRONG), _speeds(WEAK), _speeds(NONE)
    assert strong.heterogeneous() and strong.heterogeneous(min_ratio=1.15, z=1.64)
    assert not weak.heterogeneous() and weak.heterogeneous(min_ratio=1.15, z=1.64)
    assert not none.heterogeneous() and not none.heterogeneous(min_ratio=1.15, z=1.64)


def test_balancing_starts_only_on_a_strong_difference():
    from blockflow.scheduling.rules import StealingRule

    rule = StealingRule(hands_over=True)
    for _ in range(3):  # no difference, then a weak one: distributed keeps balancing
        assert _balancing_tick(rule, _speeds(NONE))[0] == []
        assert _balancing_tick(rule, _speeds(WEAK))[0] == []
    assert not rule.active
    decisions, _ = _balancing_tick(rule, _speeds(STRONG))
    assert decisions == [("suspend-stealing", "")] and rule.active
    # once on, a strong or weak difference yields nothing more
    assert _balancing_tick(rule, _speeds(STRONG))[0] == []
    assert _balancing_tick(rule, _speeds(WEAK))[0] == []
    assert rule.active


def test_the_balance_decision_shows_the_speeds_and_confidences_it_saw():
    from blockflow.scheduling.rules import StealingRule

    model = _speeds(STRONG)
    names = ["a", "b", "c"]
    ws = [worker(a, speed=model.speed(a)) for a in names]
    for w in ws:
        w.speed_confidence = model.confidence(w.address)
    s = snap(ws)
    s.speeds_differ = True
    s.balancing = StealingRule(hands_over=True).judge(s)
    (d,) = StealingRule(hands_over=True).run(s, RuleContext())
    assert d.action == "suspend-stealing"
    assert d.seen["speeds"] == {a: round(model.speed(a), 3) for a in names}
    assert d.seen["confidence"] == {a: round(model.confidence(a), 2) for a in names}
    assert d.seen["speeds"]["c"] < 0.5 < d.seen["confidence"]["c"]


def test_balancing_is_deferred_after_calm_ticks_without_even_a_weak_difference():
    from blockflow.scheduling.rules import StealingRule

    rule = StealingRule(hands_over=True)
    assert _balancing_tick(rule, _speeds(STRONG))[0] == [("suspend-stealing", "")]
    # calm ticks (no difference) interrupted by a weak difference start counting again
    for _ in range(rule.calm_ticks - 2):
        assert _balancing_tick(rule, _speeds(NONE))[0] == []
    assert rule.calm == rule.calm_ticks - 2
    assert _balancing_tick(rule, _speeds(WEAK))[0] == [] and rule.calm == 0
    out = [_balancing_tick(rule, _speeds(NONE))[0] for _ in range(rule.calm_ticks)]
    assert out[:-1] == [[]] * (rule.calm_ticks - 1)
    assert out[-1] == [("restore-stealing", "")] and not rule.active
    # deferred: a weak difference does not take balancing back, a strong one does
    assert _balancing_tick(rule, _speeds(WEAK))[0] == []
    assert _balancing_tick(rule, _speeds(STRONG))[0] == [("suspend-stealing", "")]


def _data_tick(rule, model, transfer: float, duration: float = 0.25):
    """A balancing tick whose workers each have waiting tasks of ``duration`` s whose inputs
    take ``transfer`` s to send to any other worker."""
    names = ["a", "b", "c"]
    ws = [worker(a, speed=model.speed(a), processing=4, executing=1, occupancy=1.0)
          for a in names]
    waiting = {a: [task(f"{a}{i}", duration, comm={o: (0.0 if o == a else transfer)
                                                   for o in names}) for i in range(3)]
               for a in names}
    s = snap(ws, waiting=waiting)
    s.speeds_differ = not rule.active and model.heterogeneous(names)
    s.speeds_differ_weakly = rule.active and model.heterogeneous(names, min_ratio=1.15, z=1.64)
    s.balancing = rule.judge(s)
    return [(d.action.value, d.worker, d.reason) for d in rule.run(s, RuleContext())], s


def test_data_bound_work_stays_with_distributeds_stealing():
    """Issue 39: 32 MiB inputs of 0.25 s tasks, a device at half speed: blockflow paused
    distributed's stealing on the speed difference, then refused every move for its transfer
    (it does not pay), so nothing balanced (1.12x plain Dask). Where moves cannot pay for
    the inputs (twice the transfer over a task's compute) stealing stays on, as in plain
    Dask, and the policy balances nothing (``balancing`` false); light inputs still hand
    balancing to blockflow."""
    from blockflow.scheduling.rules import StealingRule

    rule = StealingRule(hands_over=True)
    for _ in range(3):  # strong speed difference, data-bound: nothing suspended
        decisions, s = _data_tick(rule, _speeds(STRONG), transfer=0.3)
        assert decisions == [] and not s.balancing and not rule.active
    decisions, s = _data_tick(rule, _speeds(STRONG), transfer=0.01)  # light: blockflow's
    assert [d[:2] for d in decisions] == [("suspend-stealing", "")] and s.balancing
    # the same work turning data-bound (inputs grew): handed back at once, saying why
    decisions, s = _data_tick(rule, _speeds(STRONG), transfer=0.2)
    assert [d[:2] for d in decisions] == [("restore-stealing", "")] and not rule.active
    assert "inputs take longer to send than a move gains" in decisions[0][2]
    # nothing waiting on the workers: the last verdict stands (no flapping at the tail)
    s = snap([worker(a, speed=_speeds(STRONG).speed(a)) for a in "abc"])
    s.speeds_differ = True
    assert not rule.judge(s)
    # and the policy, told not to balance, moves none of the data-bound tasks
    decisions, s = _data_tick(StealingRule(hands_over=True), _speeds(STRONG), transfer=0.3)
    assert not [d for d in DynamicPolicy().run(s) if d.action == "move"]


def test_balancing_decisions_only_on_ticks_and_only_for_policies_that_hand_over():
    from blockflow.scheduling.rules import StealingRule

    rule = StealingRule(hands_over=True)
    decisions, s = _balancing_tick(rule, _speeds(STRONG), event="graph")
    assert decisions == [] and s.balancing and not rule.active  # graphs: never
    silent = StealingRule(hands_over=False)  # e.g. static policies: the flag alone
    decisions, s = _balancing_tick(silent, _speeds(STRONG))
    assert decisions == [] and s.balancing and not silent.active
    decisions, s = _balancing_tick(silent, _speeds(WEAK))
    assert decisions == [] and not s.balancing  # the strict test alone while off


def test_a_young_slow_streak_moves_only_the_work_it_delays():
    """Issue 27: worker "a" ran its last 0.3 s at half speed (another tenant); with 3 s of
    work queued on every worker, it is projected slow for about as long again, not for its
    whole queue: a few tasks move, not half of them (72 moves a run, 59 off that worker)."""
    def cluster(slow_for):
        a = dataclasses.replace(worker("a", processing=60, executing=1, occupancy=3.0,
                                       speed=0.5), speed_confidence=0.8, slow_for=slow_for)
        others = [worker(x, processing=60, executing=1, occupancy=3.0) for x in "bcd"]
        waiting = {"a": [task(("blockflow-k", i), duration=0.05) for i in range(59, 0, -1)]}
        return ClusterSnapshot(time=0.0, workers={w.address: w for w in [a, *others]},
                               waiting=waiting, balancing=True)

    assert cluster(0.3).workers["a"].projected_finish == pytest.approx(0.3 + 3.0 - 0.15)
    young = [d for d in run(DynamicPolicy(), cluster(0.3)) if d.action == "move"]
    for_good = [d for d in run(DynamicPolicy(), cluster(None)) if d.action == "move"]
    assert len(for_good) >= 10  # slow for good: a third of its queue goes
    assert 0 < len(young) <= 3, len(young)


def test_moves_off_a_recovered_worker_stop():
    # back at the typical speed (its pause ended): nothing moves off it
    waiting = {"a": [task(("blockflow-k", i), duration=0.05) for i in range(40, 0, -1)]}
    workers = [worker("a", processing=41, executing=1, occupancy=2.05)] + [
        worker(x, processing=60, executing=1, occupancy=3.0) for x in "bcd"]
    s = ClusterSnapshot(time=0.0, workers={w.address: w for w in workers}, waiting=waiting,
                        balancing=True)
    assert [d for d in run(DynamicPolicy(), s) if d.action == "move" and d.worker == "a"] == []


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_task_facts_equal_group_work_and_size_read_one_by_one(c, s, a):
    import dask

    x = c.submit(lambda: b"x" * 1000, key="data-1")
    await x
    with dask.annotate(blockflow_work=7):
        y = c.submit(len, x, key="sized-1")
    z = c.submit(len, x, key=("plain-len", 3))
    await c.gather([y, z])
    for key in ("data-1", "sized-1", ("plain-len", 3)):
        assert _distributed.task_facts(s, key) == (
            dask.utils.key_split(key), _distributed.task_work(s, key),
            _distributed.task_size(s, key)), key
    assert _distributed.task_facts(s, "sized-1")[1:] == (7.0, 7.0)
    assert _distributed.task_facts(s, ("plain-len", 3))[2] >= 1000  # its input's bytes
    assert _distributed.task_facts(s, "gone-9") == ("gone", None, None)


# --- policies named by dotted path, as distributed's AMM loads its policies ------------


class PauseEverythingHotPolicy(ComposedPolicy):
    """A user's policy: the pause rule alone, at 50 % device memory."""

    name = "pause-hot"

    def __init__(self):
        self.pause = PauseRule(0.5, 0.4, 90.0, 80.0)
        self.rules = [self.pause]


DOTTED = f"{__name__}.PauseEverythingHotPolicy"


def test_a_policy_is_named_by_dotted_path_from_config():
    import dask.config

    from blockflow import config
    from blockflow.scheduling import Rebalancer
    from blockflow.scheduling.policies import policy_class

    assert policy_class(DOTTED) is PauseEverythingHotPolicy
    policy = make_policy(DOTTED)
    assert isinstance(policy, PauseEverythingHotPolicy)
    # every policy owns the rules the plugin runs at their own moments
    assert policy.objective is None and policy.admission.enabled
    assert not policy.stealing_rule.hands_over and policy.kernel_placement is policy.kernel_placement
    s = snap([worker("a", used=6 * GiB, total=10 * GiB), worker("b")])
    assert [(d.action, d.worker) for d in run(policy, s)] == [("pause", "a")]
    with dask.config.set({"blockflow.cluster.policy": DOTTED}):
        config.validate()
        assert Rebalancer().policy_name == DOTTED


BUILTINS = ("choose one of dynamic, memory, static-round-robin, static-capacity, off. A dotted "
            "path to a RebalancePolicy subclass (mypkg.MyPolicy), importable where the "
            "scheduler runs, works too.")


class NeedsArgumentsPolicy(ComposedPolicy):
    """A user's policy whose constructor needs an argument blockflow does not pass."""

    def __init__(self, threshold):
        self.rules = []


@pytest.mark.parametrize("name, why", [
    ("nonsense", ""),
    ("blockflow.nowhere.Policy", ": cannot import it here (ModuleNotFoundError: No module "
                                 "named 'blockflow.nowhere')"),
    ("blockflow.scheduling.rules.PauseRule", ": it is <class "
     "'blockflow.scheduling.rules.pause.PauseRule'>, not a RebalancePolicy subclass"),
    ("collections.Counter", ": it is <class 'collections.Counter'>, not a RebalancePolicy "
                            "subclass"),
])
def test_an_unknown_policy_or_path_is_one_line_naming_why_and_the_builtins(name, why):
    with pytest.raises(ValueError) as info:
        make_policy(name)
    assert str(info.value) == f"Unknown blockflow policy {name!r}{why}; {BUILTINS}"


def test_a_policy_whose_module_fails_to_import_or_build_is_one_line_with_the_cause(
        tmp_path, monkeypatch):
    (tmp_path / "broken_policy_mod.py").write_text("raise ImportError('boom')\n")
    (tmp_path / "syntax_policy_mod.py").write_text("def (:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"^Unknown blockflow policy 'broken_policy_mod\.X': "
                                         r"cannot import it here \(ImportError: boom\); "):
        make_policy("broken_policy_mod.X")
    with pytest.raises(ValueError, match=r"^Unknown blockflow policy 'syntax_policy_mod\.X': "
                                         r"cannot import it here \(SyntaxError: "):
        make_policy("syntax_policy_mod.X")
    path = f"{__name__}.NeedsArgumentsPolicy"
    with pytest.raises(ValueError) as info:
        make_policy(path)
    assert str(info.value) == (f"blockflow policy {path!r} could not be built: TypeError: "
                               f"NeedsArgumentsPolicy.__init__() missing 1 required "
                               f"positional argument: 'threshold'")


def test_connect_with_a_policy_the_scheduler_cannot_build_leaves_nothing_running():
    """The error is one line, and neither the client nor the cluster connect started
    outlives it."""
    import distributed

    import blockflow

    path = f"{__name__}.NeedsArgumentsPolicy"
    with pytest.raises(ValueError) as info:
        blockflow.connect(n_workers=1, processes=False, dashboard_address=":0", policy=path)
    assert str(info.value).startswith(f"blockflow.connect: blockflow policy {path!r} could "
                                      f"not be built: TypeError: ")
    with pytest.raises(ValueError):
        distributed.default_client()  # no client left behind


def test_a_policy_named_by_dotted_path_passes_the_cli_option_and_the_cluster_builders():
    """``--policy mypkg.MyPolicy`` and ``cluster_spec(policy=...)`` take a dotted path as
    ``blockflow.cluster.policy`` does (checked where the scheduler runs); a mistyped name is
    one line that says a dotted path works too."""
    import click
    from click.testing import CliRunner

    from blockflow.cli.options import _PolicyChoice
    from blockflow.cluster.kubernetes import cluster_spec

    @click.command()
    @click.option("--policy", type=_PolicyChoice())
    def show(policy):
        click.echo(policy)

    ok = CliRunner().invoke(show, ["--policy", "blockflow.scheduling.policies.DynamicPolicy"])
    assert ok.exit_code == 0 and ok.output.strip() == "blockflow.scheduling.policies.DynamicPolicy"
    later = CliRunner().invoke(show, ["--policy", "nowhere.Policy"])  # checked by connect
    assert later.exit_code == 0 and later.output.strip() == "nowhere.Policy"
    typo = CliRunner().invoke(show, ["--policy", "dynamc"])
    assert typo.exit_code == 2 and "Unknown blockflow policy 'dynamc'" in typo.output
    assert "dotted path" in typo.output
    assert "|PKG.POLICY]" in CliRunner().invoke(show, ["--help"]).output
    spec = cluster_spec("bf", "ghcr.io/dask/dask:latest", policy="mypkg.MyPolicy")
    args = spec["spec"]["scheduler"]["spec"]["containers"][0]["args"]
    assert args[-2:] == ["--blockflow-policy", "mypkg.MyPolicy"]
