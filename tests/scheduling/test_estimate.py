"""The pure estimator and placement arithmetic (blockflow.scheduling.estimate), on synthetic
inputs: no cluster."""

from __future__ import annotations

import itertools
import math

import pytest

from blockflow.scheduling.estimate import (
    CONFIDENT,
    Throughput,
    call_cost,
    confident_speeds,
    earliest_finish,
    fixed_units,
    prior_seconds_per_unit,
)


def test_only_confident_finite_positive_speeds_count_as_known():
    speeds = {"a": 2.0, "b": 0.7, "c": 1.0, "d": float("nan"), "e": 0.0}
    conf = {"a": 0.9, "b": CONFIDENT, "c": 0.49, "d": 1.0, "e": 1.0}
    assert confident_speeds(speeds, conf) == {"a": 2.0, "b": 0.7}
    assert confident_speeds(speeds, None) == {}
    assert confident_speeds(None, conf) == {}


def test_the_cold_start_is_dropped():
    t = Throughput(fixed=False)
    assert not t.observe("a", 1, 10.0)  # model loaded, caches cold: not its speed
    assert t.observe("a", 1, 1.0)
    assert t.observe("a", 2, 2.0)
    assert t.seconds_per_unit(["a"]) == {"a": 1.0}
    assert t.cold_seconds_per_unit() == {"a": 10.0}
    assert t.observed_seconds_per_unit() == {"a": 1.0}


def test_cold_starts_stand_in_only_while_no_worker_is_warm():
    t = Throughput(fixed=False)
    t.observe("a", 1, 4.0)
    t.observe("b", 1, 2.0)
    assert t.seconds_per_unit(["a", "b"]) == {"a": 4.0, "b": 2.0}
    t.observe("b", 1, 1.0)  # b is warm now: a's cold start no longer counts as its speed
    assert t.seconds_per_unit(["a", "b"]) == {"a": 1.0, "b": 1.0}


def test_the_prior_speeds_unmeasured_workers_through_the_measured_ones():
    t = Throughput(fixed=False, cold=0)
    t.observe("a", 10, 5.0)  # 0.5 s per unit
    # b twice as fast as a by the plugin's learned speeds: half a's seconds per unit
    assert t.seconds_per_unit(["a", "b"], {"a": 1.0, "b": 2.0}) == {"a": 0.5, "b": 0.25}
    # without a prior, an unmeasured worker is taken as the typical measured one
    assert t.seconds_per_unit(["a", "b"]) == {"a": 0.5, "b": 0.5}
    # measured beats the prior
    t.observe("b", 10, 10.0)
    assert t.seconds_per_unit(["a", "b"], {"a": 1.0, "b": 2.0}) == {"a": 0.5, "b": 1.0}


def test_with_nothing_measured_the_prior_alone_gives_seconds_per_unit():
    assert Throughput().seconds_per_unit(["a", "b", "c"], {"a": 2.0, "b": 0.5}) == {
        "a": 0.5, "b": 2.0, "c": 1.0}
    assert prior_seconds_per_unit(["a"], {}, None) == {"a": 1.0}


def test_a_fixed_cost_per_call_is_fitted_and_taken_out_of_the_rate():
    # every call takes 0.1 s per unit plus 1 s: a fixed cost of 10 units
    t = Throughput(cold=0)
    for units in (10, 20, 40):
        t.observe("a", units, 1.0 + 0.1 * units)
    assert t.fixed == pytest.approx(10.0)
    assert t.seconds_per_unit(["a"])["a"] == pytest.approx(0.1)
    assert t.seconds("a", 30, {"a": 0.1}) == pytest.approx(4.0)
    # calls of one size cannot tell a fixed cost apart: none is fitted
    assert fixed_units({"a": [(10, 2.0), (10, 2.1)]}) == 0.0


def test_forgetting_a_worker_starts_it_cold_again():
    t = Throughput(fixed=False)
    t.observe("a", 1, 9.0)
    t.observe("a", 1, 1.0)
    t.forget("a")
    assert not t.measured("a")
    assert not t.observe("a", 1, 9.0)


def test_call_cost_solves_the_first_call_against_the_others():
    # c + s n: c = 0.03, s = 0.001
    calls = [(100, 0.13), (20, 0.05), (20, 0.05)]
    assert call_cost(calls) == pytest.approx(0.03)
    assert call_cost(calls[:1]) is None


def _brute_force_makespan(durations: dict[str, list[float]], n: int) -> float:
    best = math.inf
    for assign in itertools.product(list(durations), repeat=n):
        load = dict.fromkeys(durations, 0.0)
        for i, w in enumerate(assign):
            load[w] += durations[w][i]
        best = min(best, max(load.values()))
    return best


def test_each_item_goes_where_it_finishes_first():
    # fast takes 1 s per unit, slow 3 s
    spu = {"fast": 1.0, "slow": 3.0}
    placed = earliest_finish(4, {"fast": 0.0, "slow": 0.0}, spu)
    assert [p.worker for p in placed] == ["fast", "fast", "fast", "slow"]  # a tie: first
    assert [p.finish for p in placed] == [1.0, 2.0, 3.0, 3.0]
    # every placement is the earliest finish available when it was made
    ready = {"fast": 0.0, "slow": 0.0}
    for p in placed:
        assert p.finish == min(ready[w] + spu[w] for w in ready)
        ready[p.worker] = p.finish
    # here it is also the best makespan
    assert max(p.finish for p in placed) == _brute_force_makespan(
        {w: [s] * 4 for w, s in spu.items()}, 4)


def test_a_snapshot_of_queued_work_and_speeds_is_the_ready_time():
    # the scheduler's view: queued units / speed is when each worker is free
    speed = {"a": 2.0, "b": 1.0}
    queued = {"a": 10.0, "b": 2.0}
    placed = earliest_finish(1, {w: queued[w] / speed[w] for w in speed},
                             {w: 1 / speed[w] for w in speed}, units=[4.0])
    assert placed[0].worker == "b" and placed[0].finish == 6.0


def test_threads_are_slots_and_ties_follow_the_tie_key():
    placed = earliest_finish(3, {"a": 0.0, "b": 0.0}, {"a": 1.0, "b": 1.0},
                             threads={"a": 2}, tie=lambda w, k: (w != "b", k))
    assert [(p.worker, p.slot) for p in placed] == [("b", 0), ("a", 0), ("a", 1)]
    assert all(p.finish == 1.0 for p in placed)
    # per-slot ready times
    placed = earliest_finish(1, {"a": [5.0, 0.5], "b": [1.0]}, {"a": 1.0, "b": 1.0})
    assert (placed[0].worker, placed[0].slot) == ("a", 1)


def test_items_with_their_own_seconds_and_capacity():
    cost = [4.0, 1.0]
    placed = earliest_finish(2, {"a": 0.0, "b": 0.0}, lambda i, w: cost[i] / {"a": 2, "b": 1}[w])
    assert [p.worker for p in placed] == ["a", "b"]
    # the fast worker has room for one item only: the second goes to the slow one
    placed = earliest_finish(2, {"a": 0.0, "b": 0.0}, {"a": 1.0, "b": 5.0},
                             sizes=[6, 6], capacity={"a": 10, "b": 100})
    assert [p.worker for p in placed] == ["a", "b"]
    # nowhere fits: every worker is eligible
    placed = earliest_finish(1, {"a": 0.0, "b": 0.0}, {"a": 1.0, "b": 5.0},
                             sizes=[1000], capacity={"a": 10, "b": 100})
    assert placed[0].worker == "a"


def test_queued_work_and_speeds_from_a_snapshot():
    # the scheduler's form: units queued per worker, units per second
    placed = earliest_finish(3, {"a": 10.0, "b": 2.0}, speeds={"a": 2.0, "b": 1.0},
                             units=[4.0, 4.0, 4.0])
    assert [p.worker for p in placed] == ["b", "a", "a"]
    assert [p.finish for p in placed] == [6.0, 7.0, 9.0]
    assert placed[0].start == 2.0
    # a fixed cost per call, in units: (10 + 4 + 2) / 2 == (2 + 4 + 2) / 1, the first wins
    placed = earliest_finish(1, {"a": 10.0, "b": 2.0}, speeds={"a": 2.0, "b": 1.0},
                             units=[4.0], fixed=2.0)
    assert (placed[0].worker, placed[0].finish) == ("a", 8.0)
    with pytest.raises(ValueError, match="either seconds or speeds"):
        earliest_finish(1, {"a": 0.0})
