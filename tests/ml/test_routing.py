"""blockflow.routing.Router on real clusters of simulated devices: requests go to the worker
that answers first, skip workers with full device memory, survive a killed worker, and each
is answered exactly once with the model's own output."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from distributed import Client, LocalCluster
from loadaware import wait_until

from blockflow.ml.routing import Router
from blockflow.testing import Tenant, simulated_cluster, simulated_kernel

sklearn = pytest.importorskip("sklearn")
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.linear_model import RidgeClassifier  # noqa: E402

from blockflow.scheduling.view import workers_info


class SimulatedModel:
    """A real model whose batches take ``seconds_per_row x rows / speed`` on the worker's
    simulated device (speed 1 elsewhere)."""

    def __init__(self, model, seconds_per_row: float):
        self.model, self.seconds_per_row = model, seconds_per_row

    def __call__(self, batch):
        return simulated_kernel(batch, op=self.model.predict,
                                work=len(batch) * self.seconds_per_row).payload


@pytest.fixture(scope="module")
def digits():
    X, y = load_digits(return_X_y=True)
    return X, RidgeClassifier().fit(X, y)  # closed form: quick on a loaded machine


def _by_name(client) -> list[str]:
    """Worker addresses in the order of their names (simulated_cluster's speed order)."""
    workers = workers_info(client)
    return sorted(workers, key=lambda a: workers[a]["name"])


def _check_answers(futures, batches, model, timeout=120):
    for f, b in zip(futures, batches):
        np.testing.assert_array_equal(f.result(timeout=timeout), model.predict(b))


def test_requests_go_to_the_worker_that_answers_first(digits):
    X, model = digits
    batches = [X[i * 10:(i + 1) * 10] for i in range(60)]
    with simulated_cluster(speeds=(1, 0.25), processes=False) as client:
        fast, slow = _by_name(client)
        with Router(client, SimulatedModel(model, 0.003)) as router:
            for f in router.map(batches[:4]):  # first answers: the router measures speeds
                f.result(timeout=120)
            futures = router.map(batches)
            _check_answers(futures, batches, model)
            stats = router.stats()
            decisions = list(router.decisions)
    assert stats["counts"]["answered"] == 64 and stats["pending"] == 0
    assert stats["counts"].get("duplicates", 0) == 0
    # Speed 1 against 0.25: the fast worker answers most requests (4:1 would be ideal;
    # round-robin gives 1:1; the 4 first requests go 2:2, before any answer).
    assert stats["answered_by"][fast] >= 2.5 * stats["answered_by"].get(slow, 0)
    assert stats["seconds_per_unit"][slow] > 2 * stats["seconds_per_unit"][fast]
    # A late-binding router (depth=1) learns as it goes, from a cold start.
    with simulated_cluster(speeds=(1, 0.25), processes=False) as client:
        fast, slow = _by_name(client)
        with Router(client, SimulatedModel(model, 0.003), depth=1) as router:
            _check_answers(router.map(batches), batches, model)
            late = router.stats()
    assert late["answered_by"][fast] >= 2 * late["answered_by"].get(slow, 0)
    assert decisions and decisions[0]["reason"] == "shortest expected finish"



class ColdStartModel(SimulatedModel):
    """The fast worker's first batch also pays ``cold`` seconds (loading the model, warming
    up): a cold start, not its speed."""

    def __init__(self, model, seconds_per_row: float, cold: float, cold_worker: str):
        super().__init__(model, seconds_per_row)
        self.cold, self.cold_worker, self.warm = cold, cold_worker, set()

    def __call__(self, batch):
        from distributed import get_worker

        me = get_worker().address
        if me == self.cold_worker and me not in self.warm:
            self.warm.add(me)
            time.sleep(self.cold)
        return super().__call__(batch)


def test_a_cold_first_answer_does_not_starve_the_fast_worker(digits):
    # The fast worker's first answer takes 10x a warm slow one: taken as its speed, a
    # late-binding router (depth=1) would wait for the slow worker and starve the fast one.
    X, model = digits
    batches = [X[i * 10:(i + 1) * 10] for i in range(48)]
    with simulated_cluster(speeds=(1, 0.25), processes=False) as client:
        fast, slow = _by_name(client)
        with Router(client, ColdStartModel(model, 0.003, 1.2, fast), depth=1) as router:
            _check_answers(router.map(batches), batches, model)
            stats = router.stats()
    assert stats["counts"]["answered"] == 48 and stats["counts"].get("duplicates", 0) == 0
    # Ideal: the slow worker answers every 0.12 s from the start, the fast one every 0.03 s
    # after its 1.2 s cold start: 48 requests end at ~2.1 s, about 30 fast to 18 slow. A
    # router taking the cold start for the fast worker's speed gives it ~1 in 10 (about 5
    # to 43). On a loaded machine each answer's fixed overhead (the round trip, sleeps that
    # overshoot) weighs more on the fast worker's short answers, so the split moves towards
    # even (28 to 20 seen): the test asserts the fast worker is not starved -- it answers
    # more than the slow one -- not the ideal split.
    assert stats["answered_by"][fast] > stats["answered_by"].get(slow, 0), stats
    # warm answers only: the fast worker's measured rate is its speed, not its cold start
    assert stats["seconds_per_unit"][slow] > 2 * stats["seconds_per_unit"][fast], stats


def test_nearly_full_device_gets_no_requests(digits):
    X, model = digits
    batches = [X[i * 5:(i + 1) * 5] for i in range(20)]
    with simulated_cluster(speeds=(1, 1), device_memory="1GiB",
                           tenants=[None, Tenant(memory="990MiB")], processes=False) as client:
        by_name = {w["name"]: a for a, w in workers_info(client).items()}
        with Router(client, SimulatedModel(model, 0.002)) as router:
            _check_answers(router.map(batches), batches, model)
            stats = router.stats()
    assert "device memory" in stats["excluded"][by_name[1]]
    assert stats["answered_by"] == {by_name[0]: 20}


@pytest.mark.slow
def test_killed_worker_requests_are_answered_elsewhere_exactly_once(digits):
    X, model = digits
    batches = [X[i * 20:(i + 1) * 20] for i in range(40)]
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=60)
        with Router(client, SimulatedModel(model, 0.01)) as router:  # 0.2 s per request
            futures = router.map(batches)
            wait_until(lambda: router.stats()["counts"].get("answered", 0) >= 4, timeout=60,
                       message="4 requests answered")
            pids = client.run(os.getpid)
            victim = max(router.stats()["answered_by"], key=lambda a: a)  # one that works
            os.kill(pids[victim], 9)
            _check_answers(futures, batches, model, timeout=180)
            stats = router.stats()
            lost = [d for d in router.decisions if d["action"] == "lost"]
    assert stats["counts"]["answered"] == 40 and stats["pending"] == 0, stats
    assert stats["counts"].get("duplicates", 0) == 0, stats
    # The victim's queued requests were routed again (found lost, or failed to fetch).
    assert stats["counts"].get("rerouted", 0) >= 1, (stats, lost)
    assert all(d["worker"] == victim for d in lost), (victim, lost)


def test_an_unpicklable_model_is_refused_before_routing_and_close_frees_the_model(digits):
    import threading
    import types

    from blockflow.ml._pickling import FIX
    from blockflow.ml.inference import cache_state, ship_model

    X, model = digits
    bad = RidgeClassifier().fit(X, model.predict(X))
    bad.transform_ = types.SimpleNamespace(fn=threading.Lock())
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        with pytest.raises(TypeError) as e:
            Router(client, bad)
        assert str(e.value) == (
            "blockflow.Router: cannot ship the model to the workers: model.transform_.fn is a "
            "_thread.lock that cannot be pickled (TypeError: cannot pickle '_thread.lock' "
            f"object); {FIX}.")
        assert client.run_on_scheduler(lambda dask_scheduler: [
            n for n in dask_scheduler.worker_plugins if n.startswith("blockflow-model")]) == []

        with Router(client, model) as router:  # shipped by the Router: freed by its close
            np.testing.assert_array_equal(router.submit(X[:10]).result(timeout=60),
                                          model.predict(X[:10]))
            token = router.ref.token
            assert any(w["models"][token]["state"] == "loaded"
                       for w in cache_state(client).values())
        assert all(token not in w["models"] for w in cache_state(client).values())

        with ship_model(model, client=client) as ref:  # a ModelRef passed in stays open
            with Router(client, ref) as router:
                router.submit(X[:5]).result(timeout=60)
            assert all(ref.token in w["models"] for w in cache_state(client).values())
        assert all(ref.token not in w["models"] for w in cache_state(client).values())


# -- batches: requests reach a worker without one scheduler round trip each ------------------


class CountingModel(SimulatedModel):
    """A simulated model that also counts its calls per worker task (the batch it ran in)."""

    def __call__(self, batch):
        from distributed import get_worker

        CALLS.setdefault(get_worker().get_current_task(), []).append(len(batch))
        return super().__call__(batch)


CALLS: dict = {}  # task key -> rows of each call (in-process workers share this module)


def test_a_batch_never_exceeds_its_bound(digits):
    X, model = digits
    batches = [X[i * 5:(i + 1) * 5] for i in range(80)]  # 5 rows x 2 ms: 0.01 s each
    CALLS.clear()
    with simulated_cluster(speeds=(1, 1), processes=False) as client:
        with Router(client, CountingModel(model, 0.002), batch_size=3,
                    batch_seconds="25ms") as router:
            _check_answers(router.map(batches[:4]), batches[:4], model)  # measured speeds
            _check_answers(router.map(batches), batches, model)
            stats = router.stats()
            sent = [d for d in router.decisions if d["action"] in ("route", "reroute")]
    assert stats["counts"]["answered"] == 84 and stats["counts"].get("duplicates", 0) == 0
    # at most 3 requests and 25 ms of estimated work per task (one request whatever it costs)
    assert all(len(d["requests"]) <= 3 for d in sent), sent
    assert all(len(d["requests"]) == 1 or d["estimated_seconds"] <= 0.025 for d in sent)
    assert max(len(d["requests"]) for d in sent) >= 2  # batches formed from the burst
    assert stats["counts"]["batches"] == len(sent) < 84
    # the workers saw the same: each task ran at most 3 requests, every request once
    tasks = {k: v for k, v in CALLS.items() if str(k).startswith("blockflow-request-")}
    assert sum(len(v) for v in tasks.values()) == 84
    assert max(len(v) for v in tasks.values()) <= 3


def test_batch_bounds_are_checked(digits):
    X, model = digits
    with simulated_cluster(speeds=(1,), processes=False) as client:
        with pytest.raises(ValueError) as e:
            Router(client, model, batch_size=0)
        assert str(e.value) == ("blockflow: Router batch_size must be an int >= 1 request "
                                "per task, got 0.")
        with pytest.raises(ValueError) as e:
            Router(client, model, batch_seconds=0)
        assert str(e.value) == ("blockflow: Router batch_seconds must be > 0 seconds of "
                                "estimated work per task, got 0.")


def test_a_free_worker_is_not_left_idle_while_requests_wait(digits):
    # Equal speeds: a worker with a free task slot left without work while requests wait in
    # the router is never the earliest finish. The router's record of every batch it sent
    # shows the state after it: requests still waiting only while every worker has work.
    X, model = digits
    batches = [X[i * 5:(i + 1) * 5] for i in range(90)]
    with simulated_cluster(speeds=(1, 1, 1), processes=False) as client:
        with Router(client, SimulatedModel(model, 0.002), batch_size=4) as router:
            futures = []
            for k in range(0, 90, 10):  # waves of 10, some while the workers are busy
                futures += router.map(batches[k:k + 10])
                time.sleep(0.02)
            _check_answers(futures, batches, model)
            stats = router.stats()
            after = [d["after"] for d in router.decisions if "after" in d]
    assert stats["counts"]["answered"] == 90 and stats["counts"].get("duplicates", 0) == 0
    assert after
    idle = [a for a in after if a["waiting"] and min(a["in_flight"].values()) == 0]
    assert not idle, idle
    assert min(stats["answered_by"].values()) >= 10, stats["answered_by"]


def test_requests_under_load_are_answered_once_in_batches(digits):
    # 1,000 requests of 2 ms of device time arriving at 500/s on 2 workers: 50 % of their
    # compute, but 500 tasks a second is beyond a loaded host's Dask (1.5-3 ms each, more
    # under load): one task per request makes the queue grow all run.
    X, model = digits
    batch = X[:10]
    n, rate = 1000, 500.0
    with simulated_cluster(speeds=(1, 1), processes=False) as client:
        with Router(client, SimulatedModel(model, 0.0002)) as router:
            _check_answers(router.map([batch] * 4), [batch] * 4, model)  # warm
            latency = [None] * n
            start = time.perf_counter()

            def answered(i, t0):
                def done(_):
                    latency[i] = time.perf_counter() - t0
                return done

            futures = []
            for i in range(n):
                delay = start + i / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                f = router.submit(batch)
                f.add_done_callback(answered(i, time.perf_counter()))
                futures.append(f)
            _check_answers(futures[-5:], [batch] * 5, model)
            wait_until(lambda: all(x is not None for x in latency), timeout=60,
                       message="every request answered")
            tasks = router.stats()["counts"].get("batches", n)
            duplicates = router.stats()["counts"].get("duplicates", 0)
    # Correctness, not speed (latency under load is benchmarks/inference.py's, measured
    # side by side with one task per request): every request answered once, with the
    # model's own output, in fewer tasks than half the requests (batches formed under load).
    assert all(x is not None for x in latency)
    assert duplicates == 0
    assert tasks < n / 2, tasks


@pytest.mark.slow
def test_killed_worker_batches_are_answered_elsewhere_exactly_once(digits):
    X, model = digits
    batches = [X[i * 20:(i + 1) * 20] for i in range(60)] * 5  # 300 requests of 10 ms
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=60)
        with Router(client, SimulatedModel(model, 0.0005), batch_seconds="100ms") as router:
            _check_answers(router.map(batches[:6]), batches[:6], model)  # measured speeds
            futures = router.map(batches)
            wait_until(lambda: router.stats()["counts"].get("answered", 0) >= 40,
                       timeout=60, message="40 requests answered")
            with router._lock:  # a worker with a batch of several requests in flight
                victim = next(b.worker for b in router._batches.values()
                              if len(b.requests) > 1)
            pids = client.run(os.getpid)
            os.kill(pids[victim], 9)
            _check_answers(futures, batches, model, timeout=180)
            stats = router.stats()
            decisions = list(router.decisions)
    lost = [d for d in decisions if d["action"] == "lost"]
    assert stats["counts"]["answered"] == 306 and stats["pending"] == 0, stats
    assert stats["counts"].get("duplicates", 0) == 0, stats
    assert stats["counts"].get("rerouted", 0) >= 2, stats  # a whole batch, at least
    assert all(d["worker"] == victim for d in lost), (victim, lost)
    again = [d for d in decisions if d["action"] == "reroute"]
    assert again and all(d["worker"] != victim for d in again), again
    # every request answered once: by a live worker or by the victim before it died
    assert sum(stats["answered_by"].values()) == 306


def test_a_request_with_no_rows_gets_an_empty_answer_of_the_models_dtype(digits):
    # scikit-learn refuses zero rows ("Found array with 0 sample(s)"): an empty request is
    # answered as blockflow.predict answers an empty block, for predict and predict_proba
    from sklearn.linear_model import LogisticRegression

    X, model = digits
    proba = LogisticRegression(max_iter=200).fit(X[:300] / 16, model.predict(X[:300]))
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        with Router(client, model) as router:
            labels = router.submit(X[:0]).result(timeout=60)
            np.testing.assert_array_equal(router.submit(X[:3]).result(timeout=60),
                                          model.predict(X[:3]))
        with Router(client, proba, method="predict_proba") as router:
            probs = router.submit(X[:0] / 16).result(timeout=60)
            assert router.stats()["counts"]["answered"] == 1
    assert labels.shape == (0,) and labels.dtype == model.predict(X[:1]).dtype
    assert probs.shape == (0, 10) and probs.dtype == np.float64


def test_a_batch_whose_result_went_with_its_worker_is_routed_again_without_waiting(
        digits, caplog):
    # A batch task that had finished loses its result with its worker: distributed would
    # compute it again, but it is pinned to that worker, so it stays pending for ever. Its
    # done event then finds it neither finished nor failed: the router routes its requests
    # again (it used to wait 30 s for an exception that never came, log "error while
    # routing" and leave the requests unanswered). Modelled with a real task pinned to an
    # address no worker has.
    import logging

    X, model = digits
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        with Router(client, SimulatedModel(model, 0.01)) as router:
            answer = router.submit(X[:5])
            (b,) = list(router._batches.values())
            stranded = client.submit(np.sum, [1], workers=["tcp://127.0.0.1:9"],
                                     allow_other_workers=False, pure=False)
            with caplog.at_level(logging.INFO, logger="blockflow.ml.routing"):
                router._events.put((b, stranded))
                np.testing.assert_array_equal(answer.result(timeout=60),
                                              model.predict(X[:5]))
                wait_until(lambda: router.stats()["counts"].get("rerouted", 0) == 1,
                           timeout=30, message="the batch routed again")
            assert stranded.status == "cancelled"
    # the router logs no error (it used to log "error while routing"); distributed's own
    # records are not its (under load asyncio once logged an unretrieved TimeoutError here,
    # not traced to its source)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR
                and r.name.startswith("blockflow")], caplog.text


# -- issue 39: requests held centrally, callers in turn, each where it finishes first --------

from blockflow.ml._fair_queue import FairQueue, simulate  # noqa: E402


def test_callers_take_turns_by_cost_and_given_back_requests_go_first():
    q = FairQueue()
    for i in range(20):
        q.push(("flood", i), "flood", 4.0)  # a caller that floods with costly requests
    for i in range(8):
        q.push(("light", i), "light", 1.0)
    q.push_first(("back", 0), 4.0)  # a request whose worker was lost
    order = [q.pop()[0] for _ in range(len(q))]
    assert order[0] == ("back", 0)
    # each turn a caller gets the same cost: one flood request of 4 units, four light of 1
    assert order[1:11] == [("flood", 0), ("light", 0), ("light", 1), ("light", 2),
                           ("light", 3), ("flood", 1), ("light", 4), ("light", 5),
                           ("light", 6), ("light", 7)]
    assert order[11:] == [("flood", i) for i in range(2, 20)] and not len(q)
    # answered requests are dropped unsent
    done = {("a", 1)}
    q = FairQueue(dead=lambda item: item in done)
    q.push(("a", 1), "a", 1)
    q.push(("a", 2), "a", 1)
    assert q.pop() == (("a", 2), 1.0) and not len(q)


def _poisson(rate, n, seed):
    return list(np.cumsum(np.random.default_rng(seed).exponential(1 / rate, n)))


@pytest.mark.parametrize("load", [0.4, 0.6, 0.8])
def test_the_policy_stays_near_shortest_expected_finish_and_never_idles_a_fast_device(load):
    # Speeds known exactly, no overhead: the router's policy (held centrally, sent where each
    # request finishes first, batches' answers back together) against per-device queues by
    # shortest expected finish (SEF) on the same arrivals. Order and counts, not wall time.
    speeds, seconds = (2, 1, 1, 0.5), 0.01
    arrivals = _poisson(load * sum(speeds) / seconds, 3000, seed=int(load * 10))
    sef = simulate(arrivals, speeds, seconds=seconds, policy="sef")
    ours = simulate(arrivals, speeds, seconds=seconds, policy="router")
    for q, bound in ((50, 1.1), (99, 1.35)):
        assert (np.percentile(ours["latency"], q)
                <= bound * np.percentile(sef["latency"], q)), q
    # the fastest device is never idle while a request waits; the slow one gets a request
    # only when it finishes it first, so no more than SEF gives it
    assert not [(t, n, idle) for t, n, idle in ours["log"] if n and 0 in idle]
    assert ours["device"].count(3) <= sef["device"].count(3) + 15
    # equal devices: none idle while a request waits
    equal = simulate(arrivals, (1, 1, 1, 1), seconds=seconds / 0.9 * 4.5 / 4, policy="router")
    assert not [entry for entry in equal["log"] if entry[1] and entry[2]]


def test_the_policy_serves_a_light_caller_in_turn_beside_a_flood():
    # A caller flooding at twice capacity for 2 s and a light caller at 10/s: in turn, the
    # light caller's requests wait about two batches; in one FIFO they wait behind the flood.
    speeds, seconds = (2, 1, 1, 0.5), 0.01
    flood = _poisson(2 * sum(speeds) / seconds, 1800, seed=1)
    light = list(np.arange(0.05, 2.0, 0.1))
    arrivals = sorted([(t, "flood") for t in flood] + [(t, "light") for t in light])
    times, callers = [t for t, _ in arrivals], [c for _, c in arrivals]
    fair = simulate(times, speeds, seconds=seconds, callers=callers, batch_seconds=0.05)
    fifo = simulate(times, speeds, seconds=seconds, batch_seconds=0.05)
    mine = [k for k, c in enumerate(callers) if c == "light"]
    assert max(fair["latency"][k] for k in mine) <= 0.15
    assert max(fifo["latency"][k] for k in mine) > 1.0
    assert max(fair["latency"]) > 1.0  # the flood itself queues


def test_a_light_caller_is_sent_in_turn_beside_a_flood(digits):
    X, model = digits
    flood = [X[i:i + 1] for i in range(120)]
    light = [X[i:i + 1] for i in range(200, 206)]
    with simulated_cluster(speeds=(2, 1, 1, 0.5), processes=False) as client:
        with Router(client, SimulatedModel(model, 0.01)) as router:
            futures = router.map(flood, caller="flood")
            # what was sent before the light caller's requests arrived (a batch more may
            # go between this read and their arrival)
            before = sum(len(d["requests"]) for d in list(router.decisions))
            futures += router.map(light, caller="light")
            _check_answers(futures, flood + light, model)
            stats = router.stats()
            sent = [c for d in router.decisions if d["action"] in ("route", "reroute")
                    for c in d["callers"]]
    assert stats["counts"]["answered"] == 126 and stats["pending"] == 0, stats
    assert stats["counts"].get("duplicates", 0) == 0, stats
    assert len(sent) == 126 and sent.count("light") == 6
    # after they arrive, the two callers take turns: at most one flood request is sent
    # before each light one, and one batch of at most 10 may have gone before they came (in
    # one FIFO every flood request goes first)
    last = max(k for k, c in enumerate(sent) if c == "light")
    assert sent[before:last + 1].count("flood") <= 6 + 10, (before, sent)
    assert before < 100  # most of the flood was still waiting when they came


def test_each_device_answers_its_share_of_a_burst(digits):
    # Speeds 2, 1, 1, 0.5: a burst of requests held in the router goes to each device as it
    # has room, where it finishes first: shares follow the speeds. Within 10 % in the policy's
    # simulation (below); here within 25 %: on a loaded host a task's round trip can leave a
    # fast device idle between short batches more often than a slow one (and sleeps that
    # overshoot make the measured speeds closer than the simulated ones). The half-speed
    # device used to take twice its share.
    X, model = digits
    batches = [X[i:i + 1] for i in range(270)]
    with simulated_cluster(speeds=(2, 1, 1, 0.5), processes=False) as client:
        by_speed = _by_name(client)
        # batches of 200 ms: the task waiting on each device hides the round trip of the
        # next even on a loaded host
        with Router(client, SimulatedModel(model, 0.04), batch_seconds="200ms") as router:
            _check_answers(router.map(batches[:8]), batches[:8], model)  # speeds measured
            warm = dict(router.stats()["answered_by"])
            _check_answers(router.map(batches), batches, model)
            stats = router.stats()
    assert stats["counts"]["answered"] == 278 and stats["counts"].get("duplicates", 0) == 0
    counts = np.array([stats["answered_by"].get(w, 0) - warm.get(w, 0) for w in by_speed])
    shares = counts / counts.sum()
    nominal = np.array([2, 1, 1, 0.5]) / 4.5
    np.testing.assert_allclose(shares, nominal, rtol=0.25, err_msg=str(counts))


def test_the_policy_gives_each_device_its_speed_share_when_requests_queue():
    # arrivals at 1.5x capacity: every device always has work; shares within 10 % of speed
    # shares, by counts
    speeds = (2, 1, 1, 0.5)
    ours = simulate(_poisson(1.5 * 450, 3000, seed=3), speeds, seconds=0.01)
    shares = np.bincount(ours["device"], minlength=4) / 3000
    np.testing.assert_allclose(shares, np.array(speeds) / sum(speeds), rtol=0.1)
