"""The speed model: robust to cold starts and outliers, confident only with comparisons."""

from __future__ import annotations

import math

import pytest

from blockflow.scheduling.speed import SpeedModel


def feed(m: SpeedModel, worker: str, group: str, durations) -> None:
    for d in durations:
        m.observe(worker, group, d)


def test_nothing_known_is_the_typical_speed():
    m = SpeedModel()
    assert m.speed("new") == 1.0 and m.confidence("new") == 0.0
    assert not m.heterogeneous()


def test_one_worker_alone_gives_no_evidence_however_its_durations_vary():
    # a cold task of 0.5 s then a warm one of 0.5 ms (blockflow once learned 3.16 from this)
    m = SpeedModel()
    feed(m, "a", "g", [0.5, 0.0005])
    m.update()
    assert m.speed("a") == 1.0 and m.confidence("a") == 0.0
    # 24 such tasks folded in one tick (it once learned 8,694)
    m = SpeedModel()
    feed(m, "a", "g", [0.5, 0.0005] * 12)
    m.update()
    assert m.speed("a") == 1.0


def test_cold_start_is_discarded():
    """Worker 0's first task is cold (imports, first transfer); all four are equally fast."""
    m = SpeedModel()
    feed(m, "w0", "k", [5.0] + [0.3] * 5)
    for w in ("w1", "w2", "w3"):
        feed(m, w, "k", [0.9] + [0.3] * 5)
    m.update()
    for w in ("w0", "w1", "w2", "w3"):
        assert m.speed(w) == pytest.approx(1.0)
        assert m.confidence(w) > 0.5
    assert not m.heterogeneous()


def test_learns_relative_speed_with_confidence_growing_with_observations():
    m = SpeedModel()
    confidences = []
    for _ in range(40):
        feed(m, "fast", "g", [0.05])
        feed(m, "slow", "g", [0.20])
        m.update()
        confidences.append(m.confidence("slow"))
    assert m.speed("slow") / m.speed("fast") == pytest.approx(0.25, rel=0.1)
    assert confidences == sorted(confidences) and confidences[-1] > 0.9
    assert m.heterogeneous()
    # few observations: the same true ratio, shrunk towards 1
    few = SpeedModel()
    feed(few, "fast", "g", [0.05, 0.05, 0.05])
    feed(few, "slow", "g", [0.20, 0.20, 0.20])
    few.update()
    ratio = few.speed("slow") / few.speed("fast")
    assert 0.25 < ratio < 1.0
    assert few.confidence("slow") < m.confidence("slow")


def test_outliers_do_not_move_a_median():
    m = SpeedModel()
    feed(m, "a", "g", [0.1] * 10 + [30.0])  # one task stalled behind a GC pause
    feed(m, "b", "g", [0.1] * 10)
    m.update()
    assert m.speed("a") == pytest.approx(m.speed("b"))


def test_a_poorly_observed_worker_never_looks_much_faster_than_the_best_known():
    m = SpeedModel()
    feed(m, "a", "g", [1.0] * 30)
    feed(m, "b", "g", [1.0] * 30)
    feed(m, "new", "g", [1.0, 0.001])  # one suspiciously fast warm task
    m.update()
    best = max(m.speed("a"), m.speed("b"))
    assert m.confidence("new") < 0.5
    assert m.speed("new") <= best * m.max_optimism + 1e-9


def test_groups_are_compared_only_with_themselves():
    m = SpeedModel()
    feed(m, "a", "small", [0.01] * 10)
    feed(m, "b", "big", [1.0] * 10)  # different work, not a slower worker
    m.update()
    assert m.speed("a") == m.speed("b") == 1.0


def test_reset_judges_a_worker_on_what_it_does_from_now_on():
    m = SpeedModel()
    feed(m, "a", "g", [0.4] * 20)  # slowed by another tenant
    feed(m, "b", "g", [0.1] * 20)
    m.update()
    assert m.speed("a") < 0.6 * m.speed("b")
    m.reset("a")
    assert m.speed("a") == 1.0 and m.confidence("a") == 0.0
    feed(m, "a", "g", [0.1] * 5)  # warm already: nothing discarded
    m.update()
    assert m.speed("a") == pytest.approx(m.speed("b"), rel=0.05)


def test_forget_and_bad_durations():
    m = SpeedModel()
    for bad in (float("nan"), -1.0, 0.0, float("inf"), "1s"):
        m.observe("a", "g", bad)
    assert m.update() == 0
    feed(m, "a", "g", [0.1] * 5)
    feed(m, "b", "g", [0.2] * 5)
    m.update()
    m.forget("b")
    assert m.speed("b") == 1.0 and m.observations("b") == 0
    assert m.speed("a") == 1.0  # no one left to compare with


def test_memory_is_bounded():
    m = SpeedModel(window=4, max_groups=3)
    for g in range(10):
        feed(m, "a", f"g{g}", [0.1] * 10)
        feed(m, "b", f"g{g}", [0.2] * 10)
    m.update()
    assert len(m.groups) == 3
    assert all(len(d) == 4 for per in m.groups.values() for d in per.values())
    assert math.isfinite(m.speed("a"))


def test_uneven_blocks_on_identical_workers_are_not_taken_for_uneven_workers():
    """Flights-like groups: partition sizes vary 10x, both workers draw from the same sizes.
    Their medians differ by chance; that is noise, not speed (blockflow once moved 266 % of
    the input bytes between two identical workers on such evidence)."""
    import random

    false_alarms = 0
    for seed in range(50):
        rng = random.Random(seed)
        m = SpeedModel()
        for g in range(6):
            for w in ("a", "b"):
                feed(m, w, f"g{g}", [0.05 * math.exp(rng.gauss(0, 0.8)) for _ in range(6)])
        m.update()
        false_alarms += m.heterogeneous()
    assert false_alarms <= 2  # a 4 % false-alarm rate on noise this wide (sd 0.8 in log)


def test_a_truly_slower_worker_is_found_despite_noise():
    import random

    rng = random.Random(0)
    m = SpeedModel()
    for w, d in (("a", 0.05), ("b", 0.05), ("slow", 0.2)):
        feed(m, w, "g", [d * math.exp(rng.gauss(0, 0.1)) for _ in range(20)])
    m.update()
    assert m.heterogeneous()
    assert m.speed("slow") / m.speed("a") == pytest.approx(0.25, rel=0.2)


def test_a_worker_that_slows_mid_run_is_seen_slow_after_a_few_tasks():
    m = SpeedModel()
    for w in ("a", "b", "c", "d"):
        feed(m, w, "g", [0.06] * 5)
    m.update()
    assert not m.heterogeneous()
    feed(m, "a", "g", [0.3])  # one slow task: could be an outlier
    for w in ("b", "c", "d"):
        feed(m, w, "g", [0.06] * 2)
    m.update()
    assert m.speed("a") == pytest.approx(m.speed("b"), rel=0.05)
    feed(m, "a", "g", [0.3])  # the second in a row: a level shift
    m.update()
    assert m.speed("a") < 0.6 * m.speed("b")
    assert m.heterogeneous()


def test_noisy_groups_do_not_drown_a_clear_one():
    """Persisted-input runs: many tiny, noisy tasks (no speed signal) beside the kernels,
    where one device is 4x slower. The kernels' tight evidence decides."""
    import random

    rng = random.Random(1)
    m = SpeedModel()
    for w in ("a", "b", "c", "slow"):
        feed(m, w, "make-input", [0.002 * math.exp(rng.gauss(0, 0.8)) for _ in range(60)])
        d = 0.2 if w == "slow" else 0.05
        feed(m, w, "kernel", [d * math.exp(rng.gauss(0, 0.05)) for _ in range(20)])
    m.update()
    assert m.speed("slow") / m.speed("a") == pytest.approx(0.25, rel=0.25)
    assert m.heterogeneous()


def test_blocks_of_uneven_size_rank_uneven_workers_rightly():
    """Log-normal block sizes (sd 1 in log) on speeds 1, 1, 0.5, 0.25, observed one task at a
    time. Two large draws in a row are common with sizes this uneven; the change-point rule
    once took them for a change of speed and kept only them (learned 0.87, 1.69, 1.44, 0.73).
    """
    import random

    truth = {"a": 1.0, "b": 1.0, "half": 0.5, "quarter": 0.25}
    errors = []
    for seed in range(20):
        rng = random.Random(seed)
        m = SpeedModel()
        for i in range(40):
            for w, s in truth.items():
                m.observe(w, "g", 0.05 * math.exp(rng.gauss(0, 1.0)) / s)
            m.update()
        got = {w: m.speed(w) / math.sqrt(m.speed("a") * m.speed("b")) for w in truth}
        # the order is right every time (the old rule: 12 of 20), ...
        assert got["quarter"] < got["half"] < min(got["a"], got["b"]), (seed, got)
        errors.append(sum(abs(math.log(got[w] / truth[w])) for w in truth) / len(truth))
    # ... and the speeds are about right: mean |log error| 0.15 (the old rule: 0.33)
    assert sum(errors) / len(errors) < 0.22, errors


def test_a_steady_worker_that_slows_is_still_seen_beside_noisy_groups():
    """The noise-aware change-point rule keeps the two-task detection for steady durations."""
    m = SpeedModel()
    for w in ("a", "b"):
        feed(m, w, "g", [0.05, 0.052, 0.049, 0.051, 0.05])
    m.update()
    feed(m, "a", "g", [0.2, 0.21])
    feed(m, "b", "g", [0.05, 0.05])
    m.update()
    assert m.speed("a") < 0.5 * m.speed("b")


def test_a_host_side_group_that_ended_does_not_outvote_the_kernel_running_now():
    """Inputs made on the host CPU (equal on every worker, tight) before kernels on devices
    of speeds 1, 1, 0.5, 0.25 with uneven blocks: the kernel decides once it has run a while
    (the host group once dragged the slow device's learned speed to 0.8)."""
    import random

    truth = {"a": 1.0, "b": 1.0, "half": 0.5, "quarter": 0.25}
    rng = random.Random(3)
    m = SpeedModel()
    for w in truth:
        feed(m, w, "random_sample", [0.03 * math.exp(rng.gauss(0, 0.3)) for _ in range(64)])
    m.update()
    for i in range(40):
        for w, s in truth.items():
            m.observe(w, "kernel", 0.05 * math.exp(rng.gauss(0, 0.7)) / s)
        m.update()
    fast = math.sqrt(m.speed("a") * m.speed("b"))
    assert m.speed("quarter") / fast < 0.45
    assert m.speed("half") / fast < 0.8
    assert m.heterogeneous()


def test_recent_speed_is_the_latest_warm_task_against_the_group():
    m = SpeedModel()
    feed(m, "a", "g", [0.1] * 6)
    feed(m, "b", "g", [0.1] * 6)
    m.update()
    assert m.recent_speed("a") == pytest.approx(1.0)
    feed(m, "a", "g", [0.5])  # throttled: one task five times the group's
    m.update()
    assert m.recent_speed("a") == pytest.approx(0.2, rel=1e-6)
    assert m.speed("a") > 0.9  # one duration does not move the learned speed
    assert m.recent_speed("nobody") is None
    alone = SpeedModel()
    feed(alone, "a", "g", [0.1] * 4)
    alone.update()
    assert alone.recent_speed("a") is None  # nothing to compare with
    m.reset("a")
    assert m.recent_speed("a") is None


def test_balancing_started_is_kept_while_the_evidence_stays_fair():
    """Blocks of uneven work (log-normal, sd 1 in log) on workers of speeds 1, 1, 0.5 and
    0.25: a few durations each do not prove the difference at 0.1 %, but they still show it
    at 10 %. Balancing starts only on the strict test; once started it is kept on the loose
    one (it was handed back to distributed's stealing 0.85 s into a 6.6 s run of the
    persisted-skewed benchmark, and only taken up again at 4.45 s: 1.43x the ideal)."""
    import random

    from blockflow.scheduling.policies import ClusterSnapshot
    from blockflow.scheduling.rules import StealingRule

    def tick(model, rule):
        """The balancing flag of one tick: the rule reads the speed model's two tests off a
        snapshot (the strict one while off, the weak one while on, as the plugin takes
        them), and hands balancing over as it changes."""
        snap = ClusterSnapshot(time=0.0, workers={},
                               speeds_differ=not rule.active and model.heterogeneous(workers),
                               speeds_differ_weakly=rule.active and model.heterogeneous(
                                   workers, min_ratio=1.15, z=1.64))
        snap.balancing = rule.judge(snap)
        rule.run(snap)
        return snap.balancing

    rng = random.Random(2)
    m = SpeedModel()
    for w, s, n in (("a", 1, 12), ("b", 1, 12), ("c", 0.5, 6), ("d", 0.25, 4)):
        feed(m, w, "g", [0.03 / s * math.exp(rng.gauss(0, 1.0)) for _ in range(n)])
    m.update()
    assert not m.heterogeneous()
    assert m.heterogeneous(min_ratio=1.15, z=1.64)
    rule = StealingRule(hands_over=True)
    workers = ["a", "b", "c", "d"]
    assert not tick(m, rule)  # not started: the strict test
    assert not rule.active
    # balancing (distributed's stealing paused) once a strict test proved a difference
    strong = SpeedModel()
    for w, s in (("a", 1), ("b", 1), ("c", 0.5), ("d", 0.25)):
        feed(strong, w, "g", [0.03 / s] * 12)
    strong.update()
    assert tick(strong, rule) and rule.active and rule.calm == 0
    assert all(tick(m, rule) for _ in range(3 * rule.calm_ticks))
    # once the durations no longer show a difference (identical workers' noise of the same
    # width), balancing goes back to distributed after calm_ticks ticks
    rng = random.Random(5)
    same = SpeedModel()
    for w in workers:
        feed(same, w, "g", [0.03 * math.exp(rng.gauss(0, 1.0)) for _ in range(12)])
    same.update()
    assert not same.heterogeneous(min_ratio=1.15, z=1.64)
    kept = [tick(same, rule) for _ in range(rule.calm_ticks)]
    assert all(kept[:-1]) and not kept[-1]
    assert not rule.active  # handed back ("defer")


def test_declared_work_makes_tasks_of_different_sizes_comparable():
    """Tasks of one group sized to last the same (speed-weighted shares): per task, the
    workers look identical; per unit of declared work, the slow one is 4x slower."""
    per_task, per_row = SpeedModel(), SpeedModel()
    for w, rows in (("a", 400), ("b", 400), ("slow", 100)):
        for _ in range(8):
            per_task.observe(w, "shard", 0.4)
            per_row.observe(w, "shard", 0.4, rows)
    per_task.update()
    per_row.update()
    assert per_task.speed("slow") == pytest.approx(per_task.speed("a"))
    assert per_row.speed("slow") < 0.4 * per_row.speed("a")
    assert per_row.heterogeneous()
    per_row.observe("a", "shard", 0.001, 100)  # min_duration applies to the task's seconds
    per_row.observe("a", "shard", 0.4, 0)  # no work: ignored
    assert len(per_row.pending) == 0


def _brief_pause(m: SpeedModel, slow: int, normal: int) -> list[float]:
    """4 identical workers, 0.06 s tasks; another tenant halves worker "w0"'s speed for its
    first ``slow`` tasks of the stage (issue 27: ~0.6 s), then ``normal`` tasks at the
    typical speed; its learned speed after each of those."""
    for w in ("w0", "w1", "w2", "w3"):
        feed(m, w, "warm", [0.06, 0.06])
    m.update()
    for w in ("w1", "w2", "w3"):
        feed(m, w, "stage", [0.06 * (1 + 0.01 * (i % 3)) for i in range(8)])
    feed(m, "w0", "stage", [0.06] + [0.12] * slow)  # (the first is a cold start)
    m.update()
    out = []
    for i in range(normal):
        feed(m, "w0", "stage", [0.06 * (1 + 0.01 * (i % 2))])
        for w in ("w1", "w2", "w3"):
            feed(m, w, "stage", [0.06])
        m.update()
        out.append(m.speed("w0"))
    return out


def test_a_pause_that_ended_is_the_past_two_normal_durations_restore_the_speed():
    # issue 27: one worker busy with another tenant for ~0.6 s at the start kept a lower
    # learned speed for as many normal tasks as it had run slow (and its work moved off)
    m = SpeedModel()
    after = _brief_pause(m, slow=5, normal=4)
    assert after[0] < 0.8  # one normal duration is no evidence yet
    assert after[1] == pytest.approx(1.0, abs=0.05), after
    assert all(s == pytest.approx(1.0, abs=0.05) for s in after[1:]), after
    assert m.slow_for("w0") is None  # not slow now


def test_a_slow_streak_is_expected_to_last_as_long_as_it_has_so_far():
    m = SpeedModel()
    feed(m, "a", "g", [0.1] * 6)
    feed(m, "b", "g", [0.1] * 6)
    m.update()
    assert m.slow_for("a") is None
    feed(m, "a", "g", [0.3, 0.3])  # a new tenant: three times slower
    m.update()
    assert m.slow_for("a") == pytest.approx(0.6)
    feed(m, "a", "g", [0.3])
    m.update()
    assert m.slow_for("a") == pytest.approx(0.9)
    feed(m, "a", "g", [0.1])  # back to the typical speed: the streak ended
    m.update()
    assert m.slow_for("a") is None


def test_a_noisy_slow_worker_is_not_judged_recovered_on_two_lucky_draws():
    m = SpeedModel()
    import random

    rng = random.Random(5)
    for _ in range(30):
        for w, s in (("a", 1.0), ("b", 1.0), ("slow", 0.25)):
            m.observe(w, "g", 0.05 * math.exp(rng.gauss(0, 0.7)) / s)
    m.update()
    feed(m, "slow", "g", [0.05, 0.05])  # two draws at the others' level
    m.update()
    assert m.speed("slow") < 0.5
