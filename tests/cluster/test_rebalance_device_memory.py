"""Evening out device memory: ``blockflow.rebalance`` and its AMM policy.

The evening plan of :class:`DeviceMemoryAMMPolicy` is checked on synthetic worker views and held
results (no cluster), including a bounded property test of "within one block of the
capacity-weighted target"; ``blockflow.rebalance`` runs end to end on ``gen_cluster`` workers
with simulated devices of different capacities.
"""

from __future__ import annotations


import numpy as np
import pytest
from distributed import wait
from distributed.utils_test import gen_cluster
from hypothesis import given, settings
from hypothesis import strategies as st
from loadaware import async_wait_until

import blockflow
from blockflow import _distributed
from blockflow._distributed.metrics import WorkerMetrics
from blockflow.scheduling import Rebalancer
from blockflow.scheduling.device_memory import DeviceBytes, DeviceMemoryAMMPolicy
from blockflow.testing import (
    SimulatedDevice,
    device_stats,
    install_simulated_devices,
    simulated_kernel,
)

MiB, GiB = 2**20, 2**30


def view(addr, total=None, used=None, status="running"):
    m = WorkerMetrics(gpu_utilization=None if total is None else 0.0, gpu_memory_used=used,
                      gpu_memory_total=total, host_memory=None)
    return _distributed.WorkerView(address=addr, nthreads=1, status=status,
                                   paused_by_blockflow=False, metrics=m, speed=1.0,
                                   processing=0, executing=0, occupancy=0.0)


def held_from(placement: dict, sizes: dict, addrs) -> dict:
    """address -> HeldResult list (largest first) from key -> set of holders."""
    held = {a: [] for a in addrs}
    for key, holders in placement.items():
        for a in holders:
            held[a].append(_distributed.HeldResult(key, sizes[key], frozenset(holders)))
    for lst in held.values():
        lst.sort(key=lambda r: r.nbytes, reverse=True)
    return held


class Logged(DeviceMemoryAMMPolicy):
    def __init__(self, **kw):
        super().__init__(even=True, **kw)
        self.logged = []

    def log(self, action, worker, reason, seen, key=None, target=None):
        self.logged.append((action, worker, key, target, reason))


def plan(policy, workers, held, accept=True):
    """The suggestions of one plan, as ``(op, key, candidates)``; the AMM accepts each
    (sends back its only candidate) unless ``accept`` is False or says no for that key."""
    gen = policy.plan({w.address: w for w in workers}, held)
    out = []
    try:
        s = next(gen)
        while True:
            out.append((s.op, s.key, set(s.candidates)))
            ok = accept(s) if callable(accept) else accept
            s = gen.send(sorted(s.candidates)[0] if ok else None)
    except StopIteration:
        pass
    return out


def enact(placement: dict, suggestions) -> dict:
    """Placement after the AMM enacted ``suggestions`` and the copies landed."""
    placement = {k: set(v) for k, v in placement.items()}
    for op, key, cands in suggestions:
        (addr,) = cands
        if op == "replicate":
            placement[key].add(addr)
        else:
            assert len(placement[key]) > 1, "never drop the last copy"
            placement[key].discard(addr)
    return placement


def run_cycles(policy, workers, placement, sizes, max_cycles=10):
    """Plan and enact until a plan suggests nothing; returns (placement, plans)."""
    addrs = [w.address for w in workers]
    plans = []
    for _ in range(max_cycles):
        out = plan(policy, workers, held_from(placement, sizes, addrs))
        if not out:
            break
        plans.append(out)
        placement = enact(placement, out)
    else:
        raise AssertionError(f"no end after {max_cycles} cycles")
    return placement, plans


def measure(policy, workers, placement, sizes) -> DeviceBytes:
    addrs = [w.address for w in workers]
    return policy.device_bytes({w.address: w for w in workers},
                               held_from(placement, sizes, addrs))


# --- the plan on synthetic data ---------------------------------------------------------


def test_plan_copies_to_the_under_target_worker_then_drops_from_the_source():
    workers = [view("a", total=1 * GiB), view("b", total=3 * GiB)]
    sizes = {f"x{i}": 100 * MiB for i in range(8)}
    placement = {k: {"a"} for k in sizes}
    policy = Logged()
    m = measure(policy, workers, placement, sizes)
    # 800 MiB held; capacity 1:3 -> targets 200 MiB and 600 MiB; one block = 100 MiB
    assert m.held == {"a": 800 * MiB, "b": 0}
    assert m.target == {"a": 200 * MiB, "b": 600 * MiB}
    assert (m.largest_block, m.tolerance, m.max_deviation) == (100 * MiB, 50 * MiB, 600 * MiB)
    assert not m.within_one_block

    first = plan(policy, workers, held_from(placement, sizes, "ab"))
    assert first == [("replicate", f"x{i}", {"b"}) for i in range(6)]
    assert set(policy.pending) == {f"x{i}" for i in range(6)} and policy.moves == []
    placement = enact(placement, first)
    second = plan(policy, workers, held_from(placement, sizes, "ab"))
    assert second == [("drop", f"x{i}", {"a"}) for i in range(6)]
    placement = enact(placement, second)
    assert plan(policy, workers, held_from(placement, sizes, "ab")) == []

    after = measure(policy, workers, placement, sizes)
    assert after.held == {"a": 200 * MiB, "b": 600 * MiB}
    assert after.max_deviation == 0 and after.balanced and after.within_one_block
    assert policy.pending == {}
    assert policy.moves == [{"key": f"x{i}", "source": "a", "target": "b",
                             "nbytes": 100 * MiB} for i in range(6)]
    # every copy and every drop in the decision log, recorded as "memory-move"
    assert [(a, w, k, t) for a, w, k, t, _ in policy.logged] == \
        [("memory-move", "a", f"x{i}", "b") for i in range(6)] * 2
    assert policy.logged[0][4] == ("copy 104857600 B block to b: a holds 838860800 B of "
                                   "device blocks against a capacity-weighted target of "
                                   "209715200 B (tolerance 52428800 B)")
    assert policy.logged[6][4] == "drop 104857600 B block: its copy has landed on b"

    # tolerance one block: it stops one block off (300 / 500 MiB), one move fewer
    loose = Logged(tolerance=100 * MiB)
    placement, plans = run_cycles(loose, workers, {k: {"a"} for k in sizes}, sizes)
    assert [len(p) for p in plans] == [5, 5]
    assert measure(loose, workers, placement, sizes).held == {"a": 300 * MiB, "b": 500 * MiB}


def test_plan_takes_the_largest_block_that_fits_the_deficit():
    workers = [view("a", total=GiB), view("b", total=GiB)]
    sizes = {"big": 400 * MiB, "mid": 300 * MiB, "s1": 200 * MiB, "s2": 100 * MiB}
    placement = {k: {"a"} for k in sizes}
    # 1000 MiB held, target 500 MiB each: "big" fits b's deficit, then "s2" fills the rest
    assert plan(Logged(tolerance=0), workers, held_from(placement, sizes, "ab")) == [
        ("replicate", "big", {"b"}), ("replicate", "s2", {"b"})]
    # by default (tolerance half the largest block, 200 MiB) it stops 100 MiB off
    assert plan(Logged(), workers, held_from(placement, sizes, "ab")) == [
        ("replicate", "big", {"b"})]


def test_plan_overshoots_a_target_only_when_it_narrows_the_gap():
    workers = [view("a", total=GiB), view("b", total=GiB)]
    sizes = {"p": 300 * MiB, "q": 300 * MiB}
    # 600 MiB, target 300 each: one 300 MiB block moves, exactly balanced
    placement = {k: {"a"} for k in sizes}
    assert len(plan(Logged(tolerance=0), workers, held_from(placement, sizes, "ab"))) == 1
    # three workers, 2 x 200 MiB on a: no block fits a 133 MiB deficit, but moving one
    # (b then 67 MiB over) narrows the 400 MiB gap and ends within one block
    three = workers + [view("c", total=GiB)]
    sizes = {"p": 200 * MiB, "q": 200 * MiB}
    policy = Logged()
    placement, plans = run_cycles(policy, three, {k: {"a"} for k in sizes}, sizes)
    assert plans[0] == [("replicate", "p", {"b"})]
    m = measure(policy, three, placement, sizes)
    assert m.held == {"a": 200 * MiB, "b": 200 * MiB, "c": 0}
    assert m.max_deviation == pytest.approx(400 * MiB / 3) and m.within_one_block
    # 400 + 0 with one 400 MiB block: moving it would only swap the imbalance
    sizes = {"p": 400 * MiB}
    assert plan(Logged(tolerance=0), workers, held_from({"p": {"a"}}, sizes, "ab")) == []
    # 3 blocks of 300 MiB on a, 0 on b: after one move (600/300) the gap is 300 MiB, not
    # more than a block: no second move, even with tolerance 0 (it would not narrow it)
    sizes = {k: 300 * MiB for k in "xyz"}
    out = plan(Logged(tolerance=0), workers, held_from({k: {"a"} for k in "xyz"}, sizes, "ab"))
    assert out == [("replicate", "x", {"b"})]


def test_identical_balanced_workers_get_no_moves():
    workers = [view(a, total=8 * GiB) for a in "abcd"]
    sizes = {f"x{i}": (i % 3 + 1) * 64 * MiB for i in range(12)}
    placement = {f"x{i}": {"abcd"[i % 4]} for i in range(12)}  # 256 MiB... 320 MiB each
    m = measure(Logged(), workers, placement, sizes)
    assert m.max_deviation <= m.largest_block
    assert plan(Logged(), workers, held_from(placement, sizes, "abcd")) == []


def test_tolerance_bytes_or_size_string():
    workers = [view("a", total=GiB), view("b", total=GiB)]
    sizes = {f"x{i}": 100 * MiB for i in range(8)}
    placement = {k: {"a"} for k in sizes}
    held = held_from(placement, sizes, "ab")
    # 800 / 0 vs 400 / 400: deviation 400 MiB
    assert plan(Logged(tolerance="400MiB"), workers, held) == []
    assert len(plan(Logged(tolerance=300 * MiB), workers, held)) == 1
    assert len(plan(Logged(tolerance=0), workers, held)) == 4
    assert Logged(tolerance="1KiB").tolerance == 1024
    with pytest.raises(ValueError, match=r"^DeviceMemoryAMMPolicy: tolerance must be "
                                         r">= 0 bytes, got -1\.$"):
        DeviceMemoryAMMPolicy(even=True, tolerance=-1)


def test_only_running_device_workers_named_keys_and_single_copies_count():
    workers = [view("a", total=GiB), view("b", total=GiB), view("cpu"),
               view("paused", total=GiB, status="paused")]
    sizes = {"x": 400 * MiB, "y": 400 * MiB, "host": 400 * MiB, "twice": 400 * MiB}
    placement = {"x": {"a"}, "y": {"a"}, "host": {"cpu"}, "twice": {"a", "b"}}
    policy = Logged(tolerance=0)
    assert policy.capacities({w.address: w for w in workers}) == {"a": GiB, "b": GiB}
    m = measure(policy, workers, placement, sizes)
    assert m.held == {"a": 1200 * MiB, "b": 400 * MiB}  # "host" is on no device worker
    # "twice" has two copies: never moved; x or y is
    out = plan(policy, workers, held_from(placement, sizes, [w.address for w in workers]))
    assert out == [("replicate", "x", {"b"})]
    # only the keys named: x and y, 800 MiB on a, none on b
    named = Logged(keys=["x", "y"], tolerance=0)
    assert measure(named, workers, placement, sizes).held == {"a": 800 * MiB, "b": 0}
    out = plan(named, workers, held_from(placement, sizes, [w.address for w in workers]))
    assert out == [("replicate", "x", {"b"})]
    # only the workers named: none to balance with
    assert plan(Logged(workers=["a", "cpu"]), workers,
                held_from(placement, sizes, [w.address for w in workers])) == []


def test_receiver_free_device_memory_is_respected():
    workers = [view("a", total=4 * GiB, used=2 * GiB), view("b", total=4 * GiB, used=3.9 * GiB)]
    sizes = {f"x{i}": 256 * MiB for i in range(8)}
    placement = {k: {"a"} for k in sizes}
    # target 1 GiB each, but b has 0.1 GiB free: no 256 MiB block fits there
    assert plan(Logged(), workers, held_from(placement, sizes, "ab")) == []
    workers[1] = view("b", total=4 * GiB, used=3.5 * GiB)  # 512 MiB free: two blocks
    assert len(plan(Logged(), workers, held_from(placement, sizes, "ab"))) == 2


def test_declined_copies_leave_the_block_and_log_nothing():
    workers = [view("a", total=GiB), view("b", total=GiB)]
    sizes = {"x": 300 * MiB, "y": 300 * MiB, "z": 200 * MiB}
    held = held_from({k: {"a"} for k in sizes}, sizes, "ab")
    policy = Logged()
    # 800 / 0 MiB, target 400 each: x (the largest that fits b's deficit) is offered
    assert plan(policy, workers, held, accept=False) == [("replicate", "x", {"b"})]
    assert policy.pending == {} and policy.logged == []
    # the next plan starts from the real state again
    assert plan(policy, workers, held) == [("replicate", "x", {"b"})]
    assert set(policy.pending) == {"x"} and [e[2] for e in policy.logged] == ["x"]


def test_a_block_the_descent_moves_twice_is_copied_once_or_not_at_all():
    # capacities 1:2, blocks of 1 and 3 MiB on a: step by step, the 1 MiB block goes to b,
    # then the 3 MiB one, then the 1 MiB one back: only the 3 MiB block is copied
    workers = [view("a", total=GiB), view("b", total=2 * GiB)]
    sizes = {"k0": MiB, "k1": 3 * MiB}
    policy = Logged(tolerance=0)
    placement, plans = run_cycles(policy, workers, {k: {"a"} for k in sizes}, sizes)
    assert plans == [[("replicate", "k1", {"b"})], [("drop", "k1", {"a"})]]
    assert measure(policy, workers, placement, sizes).held == {"a": MiB, "b": 3 * MiB}


def test_a_copy_that_never_lands_is_planned_afresh():
    workers = [view("a", total=GiB), view("b", total=GiB)]
    sizes = {"x": 300 * MiB, "y": 300 * MiB}
    placement = {k: {"a"} for k in sizes}
    policy = Logged(tolerance=0)
    held = held_from(placement, sizes, "ab")
    assert plan(policy, workers, held) == [("replicate", "x", {"b"})]
    # the copy is still in flight: counted as moved, nothing new
    assert plan(policy, workers, held) == []
    assert plan(policy, workers, held) == []
    # given up after two plans: the block is planned again
    assert plan(policy, workers, held) == [("replicate", "x", {"b"})]


def test_a_refused_drop_is_retried():
    workers = [view("a", total=GiB), view("b", total=GiB)]
    sizes = {"x": 300 * MiB, "y": 300 * MiB}
    policy = Logged(tolerance=0)
    plan(policy, workers, held_from({k: {"a"} for k in sizes}, sizes, "ab"))
    landed = held_from({"x": {"a", "b"}, "y": {"a"}}, sizes, "ab")
    assert plan(policy, workers, landed, accept=False) == [("drop", "x", {"a"})]
    assert plan(policy, workers, landed) == [("drop", "x", {"a"})]
    assert policy.moves == [{"key": "x", "source": "a", "target": "b", "nbytes": 300 * MiB}]


@settings(max_examples=40, deadline=None)
@given(caps=st.lists(st.integers(1, 16), min_size=2, max_size=6),
       blocks=st.lists(st.tuples(st.integers(1, 64), st.integers(0, 5)), min_size=1,
                       max_size=60),
       tolerance=st.sampled_from([None, 0]))
def test_plan_ends_within_one_block_of_the_capacity_weighted_target(caps, blocks, tolerance):
    workers = [view(f"w{i}", total=c * 4 * GiB) for i, c in enumerate(caps)]
    sizes = {f"k{j}": n * MiB for j, (n, _) in enumerate(blocks)}
    placement = {f"k{j}": {f"w{w % len(caps)}"} for j, (_, w) in enumerate(blocks)}
    policy = Logged(tolerance=tolerance)
    before = measure(policy, workers, placement, sizes)
    placement, plans = run_cycles(policy, workers, placement, sizes)
    after = measure(policy, workers, placement, sizes)

    assert sum(after.held.values()) == sum(before.held.values())  # nothing lost or copied
    assert all(len(h) == 1 for h in placement.values())
    # within one block (the largest) of the capacity-weighted target
    assert after.max_deviation <= after.largest_block and after.within_one_block
    # a copy cycle then a drop cycle; each block moves at most once
    assert len(plans) <= 2
    moved = [m["key"] for m in policy.moves]
    assert len(moved) == len(set(moved))
    assert policy.pending == {}
    if before.balanced and tolerance is None:
        assert plans == []


def test_policy_is_nameable_by_dotted_path():
    from distributed.utils import import_term

    assert import_term("blockflow.scheduling.device_memory.DeviceMemoryAMMPolicy") \
        is DeviceMemoryAMMPolicy


# --- blockflow.rebalance end to end ----------------------------------------------------


CAPS = {"a": 8 * GiB, "b": 4 * GiB, "c": 2 * GiB}


async def _devices(c, s, a, b, w):
    addrs = {"a": a.address, "b": b.address, "c": w.address}
    await install_simulated_devices(c, {addrs[n]: SimulatedDevice(device_memory=cap)
                                        for n, cap in CAPS.items()})
    return addrs


def _blocks(c, where, sizes):
    return [c.submit(simulated_kernel, np.full(4, i), op=np.sum, work=0.0, output_bytes=n,
                     workers=[where], allow_other_workers=False, key=f"block-{i}")
            for i, n in enumerate(sizes)]


async def _holders(c, futs):
    who = await c.who_has(futs)
    return {k: set(v) for k, v in who.items()}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_rebalance_evens_out_device_blocks_by_capacity_and_logs_moves(c, s, a, b, w):
    addrs = await _devices(c, s, a, b, w)
    await c.register_plugin(Rebalancer(policy="off", interval=0))
    futs = _blocks(c, addrs["a"], [256 * MiB] * 14)  # 3.5 GiB, all on the 8 GiB device
    await c.gather(futs)

    summary = await blockflow.rebalance(c, futs)

    # capacities 8:4:2 GiB -> 2 GiB, 1 GiB, 512 MiB: exactly 8, 4 and 2 blocks
    by = {n: addrs[n] for n in "abc"}
    assert summary["before"] == {by["a"]: 14 * 256 * MiB, by["b"]: 0, by["c"]: 0}
    assert summary["target"] == {by["a"]: 2 * GiB, by["b"]: GiB, by["c"]: 512 * MiB}
    assert summary["after"] == summary["target"]
    assert (summary["largest_block"], summary["tolerance"]) == (256 * MiB, 128 * MiB)
    assert summary["max_deviation"] == 0 and summary["within_one_block"]
    assert len(summary["moves"]) == 6 and summary["bytes_moved"] == 6 * 256 * MiB
    assert summary["cycles"] == 2  # copies, then drops
    assert summary["skipped"] == []
    assert {m["source"] for m in summary["moves"]} == {by["a"]}
    assert sorted(m["target"] for m in summary["moves"]).count(by["b"]) == 4

    # one copy each, where the summary says; results still readable and equal
    holders = await _holders(c, futs)
    assert all(len(h) == 1 for h in holders.values())
    for m in summary["moves"]:
        assert holders[m["key"]] == {m["target"]}
    values = await c.gather(futs)
    assert [v.payload for v in values] == [4 * i for i in range(14)]
    assert [v.nbytes for v in values] == [256 * MiB] * 14
    # the simulated devices hold what the summary says
    async def held_bytes():
        return {addr: st["held_bytes"] for addr, st in (await c.run(device_stats)).items()}

    async def dropped():  # the workers drop their copies asynchronously
        return await held_bytes() == summary["after"]

    await async_wait_until(dropped, timeout=5, message="the workers to drop their copies")
    assert await held_bytes() == summary["after"]

    # every copy and drop is in the decision log
    log = [d for d in s.plugins["blockflow-rebalancer"].decisions if d["action"] == "memory-move"]
    moved = sorted(m["key"] for m in summary["moves"])
    assert sorted(d["key"] for d in log if d["reason"].startswith("copy")) == moved
    assert sorted(d["key"] for d in log if d["reason"].startswith("drop")) == moved
    assert all(d["worker"] == by["a"] and d["target"] in (by["b"], by["c"]) for d in log)

    # a second call finds nothing to do
    again = await blockflow.rebalance(c, futs)
    assert again["moves"] == [] and again["cycles"] == 0 and again["after"] == summary["after"]


def _use(x):
    return int(x[0])


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, timeout=300, config={
    # a receiver fetches one input at a time: the work's fetches stay queued for seconds
    "distributed.worker.connections.outgoing": 1})
async def test_rebalance_while_work_fetches_data_does_not_wait_for_the_work(c, s, a, b, w):
    """Issue 39: called while work ran, ``blockflow.rebalance`` returned after 30 s (plain
    ``client.rebalance`` at once): its copies, asked of the receiving workers with the
    Active Memory Manager's ``acquire-replicas``, queue behind every input the work running
    there fetches. The receivers gather them at once, as ``client.rebalance`` does: it returns
    while the work still has inputs to fetch, the blocks moved."""
    addrs = await _devices(c, s, a, b, w)
    futs = _blocks(c, addrs["a"], [256 * MiB] * 14)
    await c.gather(futs)
    # work on the two receivers whose inputs (8 MiB each) are all on the sender
    inputs = [c.submit(np.ones, 2**20, workers=[addrs["a"]], pure=False) for _ in range(200)]
    await wait(inputs)
    work = [c.submit(_use, x, workers=[addrs["b"], addrs["c"]], pure=False) for x in inputs]
    receivers = {s.workers[addrs["b"]], s.workers[addrs["c"]]}

    def unfetched() -> int:  # work tasks on a receiver whose input is not there yet
        return sum(1 for f in work if (ts := s.tasks.get(f.key)) is not None
                   and ts.processing_on in receivers
                   and not any(ts.processing_on in d.who_has for d in ts.dependencies))

    await async_wait_until(lambda: unfetched() > 40, timeout=60,
                           message="the work to queue its fetches on the receivers")
    summary = await blockflow.rebalance(c, futs)
    left = unfetched()

    # it returned before the work had fetched its inputs (before: only once the receivers'
    # fetch queues ran dry)
    assert left > 10, left  # one fetch in flight per receiver
    by = {n: addrs[n] for n in "abc"}
    assert summary["after"] == {by["a"]: 2 * GiB, by["b"]: GiB, by["c"]: 512 * MiB}
    assert len(summary["moves"]) == 6 and summary["skipped"] == []
    assert await c.gather(work) == [1] * 200
    assert all(len(h) == 1 for h in (await _holders(c, futs)).values())


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_rebalance_of_mixed_blocks_ends_within_one_block_without_the_plugin(c, s, a, b,
                                                                                  w):
    addrs = await _devices(c, s, a, b, w)
    sizes = [(37 * i % 11 + 1) * 32 * MiB for i in range(20)]  # 32 MiB .. 352 MiB
    futs = _blocks(c, addrs["a"], sizes)
    await c.gather(futs)

    summary = await blockflow.rebalance(c)  # every held result; no blockflow plugin

    total = sum(sizes)
    assert sum(summary["after"].values()) == total
    targets = {addrs[n]: total * cap / sum(CAPS.values()) for n, cap in CAPS.items()}
    assert summary["target"] == {k: round(v) for k, v in targets.items()}
    largest = max(sizes)
    assert summary["largest_block"] == largest == 352 * MiB
    assert max(abs(summary["after"][k] - targets[k]) for k in targets) <= largest
    assert summary["within_one_block"] and summary["max_deviation"] <= largest
    assert all(len(h) == 1 for h in (await _holders(c, futs)).values())
    assert [v.payload for v in await c.gather(futs)] == [4 * i for i in range(20)]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_rebalance_bad_input_fails_with_one_line_naming_the_fix(c, s, a, b):
    with pytest.raises(ValueError, match=r"^blockflow.rebalance: no running worker reports "
                                         r"device memory \(gpu-memory-total\); use "
                                         r"client.rebalance\(\) for host memory\.$"):
        await blockflow.rebalance(c)
    await install_simulated_devices(c, SimulatedDevice(device_memory="1GiB"))
    with pytest.raises(ValueError, match=r"^blockflow.rebalance: workers \['tcp://nowhere:1'\] "
                                         r"are not in the cluster; pass addresses from "
                                         r"client.scheduler_info\(\)\['workers'\]\.$"):
        await blockflow.rebalance(c, workers=["tcp://nowhere:1"])
    with pytest.raises(ValueError, match=r"^blockflow.rebalance: 1 of workers \[.*\] run and "
                                         r"report device memory; name at least two device "
                                         r"workers\.$"):
        await blockflow.rebalance(c, workers=a.address)
    with pytest.raises(ValueError, match=r"^blockflow.rebalance: tolerance must be bytes \(an "
                                         r"int or a size like '512MiB'\), got 'lots'\.$"):
        blockflow.rebalance(c, tolerance="lots")
    with pytest.raises(ValueError, match=r"^blockflow.rebalance: tolerance must be >= 0 "
                                         r"bytes, got -5\.$"):
        blockflow.rebalance(c, tolerance=-5)
    with pytest.raises(ValueError, match=r"^blockflow.rebalance: cycles must be >= 1, "
                                         r"got 0\.$"):
        blockflow.rebalance(c, cycles=0)
    with pytest.raises(ValueError, match=r"^blockflow.rebalance: futures holds no futures"):
        blockflow.rebalance(c, [])
    # nothing held: nothing to do
    summary = await blockflow.rebalance(c)
    assert summary["moves"] == [] and summary["within_one_block"] and summary["cycles"] == 0


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, config={
    "distributed.scheduler.active-memory-manager.start": False,
    "distributed.scheduler.active-memory-manager.policies": [
        {"class": "blockflow.scheduling.device_memory.DeviceMemoryAMMPolicy", "even": True}]})
async def test_policy_named_in_distributed_config_balances_in_the_scheduler_amm(c, s, a, b, w):
    addrs = await _devices(c, s, a, b, w)
    futs = _blocks(c, addrs["a"], [256 * MiB] * 14)
    await c.gather(futs)
    await c.amm.run_once()  # six copies

    async def copied():
        return sum(map(len, (await _holders(c, futs)).values())) == 14 + 6

    await async_wait_until(copied, timeout=5, message="the six copies to land")
    await c.amm.run_once()  # the copies have landed: six drops
    held = {addr: 0 for addr in addrs.values()}
    for h in (await _holders(c, futs)).values():
        assert len(h) == 1
        held[h.pop()] += 256 * MiB
    assert held == {addrs["a"]: 2 * GiB, addrs["b"]: GiB, addrs["c"]: 512 * MiB}


@pytest.mark.parametrize("policy", ["dynamic", "memory", "static-round-robin",
                                    "static-capacity", "off"])
def test_rebalance_leaves_work_stealing_as_it_was(policy):
    """The copies and drops of ``blockflow.rebalance`` are records: logged, never acted on.
    distributed's stealing loop runs before and after, under every policy."""

    @gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
    async def check(c, s, a, b, w):
        addrs = await _devices(c, s, a, b, w)
        await c.register_plugin(Rebalancer(policy=policy, interval=0))
        plugin = s.plugins["blockflow-rebalancer"]
        futs = _blocks(c, addrs["a"], [256 * MiB] * 14)
        await c.gather(futs)
        stealing = s.periodic_callbacks["stealing"]
        before = (stealing.is_running(), plugin.status()["balancing"])
        assert before == (True, False)

        summary = await blockflow.rebalance(c, futs)

        assert len(summary["moves"]) == 6
        assert s.periodic_callbacks["stealing"] is stealing
        assert (stealing.is_running(), plugin.status()["balancing"]) == before
        assert [d for d in plugin.decisions if d["reason"].startswith(("copy", "drop"))]

    check()
