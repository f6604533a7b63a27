"""Admission control: CPU producers feeding consumers that need ``GPU=1`` stay within the
budget of outputs held at once, measured by polling the scheduler while the graph runs.

The scenario of the issue: 4 CPU workers plus one with ``GPU=1``; producer blocks each feed
one consumer that needs ``GPU=1``. Plain Dask held 193 of 200 producer outputs at once
(resource-restricted tasks are never queued, so the producers race ahead of the GPU).
"""

from __future__ import annotations

import asyncio
import time

import dask
import numpy as np
import pytest
from distributed.utils_test import gen_cluster
from loadaware import async_wait_until

import blockflow  # noqa: F401  (loads blockflow's settings before gen_cluster copies them)
from blockflow._distributed import WorkerView
from blockflow._distributed.metrics import read_metrics
from blockflow.scheduling import Rebalancer
from blockflow.scheduling.rules.admission import default_budget

PIPELINE = [("127.0.0.1", 1)] * 4 + [("127.0.0.1", 1, {"resources": {"GPU": 1}})]
MB = 2**20


def produce(i: int, nbytes: int) -> np.ndarray:
    return np.full(nbytes // 8, float(i))


def consume(block: np.ndarray, seconds: float) -> float:
    time.sleep(seconds)
    return float(block[0])


def pipeline(n: int, nbytes: int, seconds: float):
    """``n`` producers of ``nbytes`` each feeding a consumer that needs ``GPU=1`` (a
    delayed graph: its annotations reach the scheduler)."""
    producers = [dask.delayed(produce)(i, nbytes, dask_key_name=("produce", i))
                 for i in range(n)]
    with dask.annotate(resources={"GPU": 1}):
        consumers = [dask.delayed(consume)(p, seconds, dask_key_name=("consume", i))
                     for i, p in enumerate(producers)]
    return producers, consumers


async def run_and_poll(c, s, n: int, nbytes: int, seconds: float) -> tuple[int, list]:
    """Run the pipeline, polling the scheduler every 10 ms: the most producer outputs held
    in memory at once, and the results."""
    _, consumers = pipeline(n, nbytes, seconds)
    futures = c.compute(consumers)
    keys = [("produce", i) for i in range(n)]
    peak = 0
    while not all(f.done() for f in futures):
        held = sum(1 for k in keys if k in s.tasks and s.tasks[k].state == "memory")
        peak = max(peak, held)
        await asyncio.sleep(0.01)
    return peak, await c.gather(futures)


async def _plugin(c, s, **kwargs) -> Rebalancer:
    await c.register_plugin(Rebalancer(**{"policy": "dynamic", "interval": "100ms", **kwargs}))
    return s.plugins["blockflow-rebalancer"]


def _view(address, nthreads=1, resources=None) -> WorkerView:
    return WorkerView(address=address, nthreads=nthreads, status="running",
                      paused_by_blockflow=False, metrics=read_metrics({}), speed=1.0,
                      processing=0, executing=0, occupancy=0.0, resources=resources or {})


def test_default_budget_is_twice_the_gpu_threads_plus_one_per_cpu_worker():
    workers = {f"cpu{i}": _view(f"cpu{i}") for i in range(4)}
    workers["gpu"] = _view("gpu", resources={"GPU": 1})
    assert default_budget(workers, {"GPU": 1}) == 2 * 1 + 4
    workers["gpu2"] = _view("gpu2", nthreads=2, resources={"GPU": 2})
    assert default_budget(workers, {"GPU": 1}) == 2 * (1 + 2) + 4
    assert default_budget(workers, {"GPU": 2}) == 2 * 2 + 5
    assert default_budget({"cpu": _view("cpu")}, {"GPU": 1}) == 1  # never below one


@gen_cluster(client=True, nthreads=PIPELINE, timeout=120)
@pytest.mark.slow
async def test_producers_race_ahead_without_admission_control(c, s, *workers):
    # the baseline the budget is measured against: the test below can fail
    await _plugin(c, s, policy="off")
    peak, results = await run_and_poll(c, s, 60, MB, 0.05)
    assert results == [float(i) for i in range(60)]
    assert peak > 3 * 6, peak


@gen_cluster(client=True, nthreads=PIPELINE, timeout=120)
@pytest.mark.slow
async def test_admission_control_keeps_producer_outputs_within_the_budget(c, s, *workers):
    plugin = await _plugin(c, s)
    peak, results = await run_and_poll(c, s, 60, MB, 0.05)
    assert results == [float(i) for i in range(60)]
    admission = plugin.admission.status()
    assert admission["budget"] == 6 and admission["held"] == 0
    assert admission["released"] == 60
    assert peak <= 6, peak
    assert peak >= 2  # the GPU was kept fed, not starved one block at a time
    assert any(d["action"] == "admit" for d in plugin.decisions)


@gen_cluster(client=True, nthreads=PIPELINE, timeout=120,
             config={"blockflow.resources.admission-budget": 3})
async def test_the_budget_is_a_setting(c, s, *workers):
    plugin = await _plugin(c, s)
    peak, results = await run_and_poll(c, s, 30, MB, 0.02)
    assert results == [float(i) for i in range(30)]
    assert plugin.admission.status()["budget"] == 3
    assert peak <= 3, peak


@gen_cluster(client=True, nthreads=PIPELINE, timeout=120)
async def test_a_consumer_of_more_inputs_than_the_budget_still_gets_them_all(c, s, *workers):
    await _plugin(c, s)
    producers = [dask.delayed(produce)(i, 1024, dask_key_name=("part", i)) for i in range(20)]
    with dask.annotate(resources={"GPU": 1}):
        total = dask.delayed(lambda *blocks: sum(float(b[0]) for b in blocks))(
            *producers, dask_key_name="gather-on-gpu")
    assert await asyncio.wait_for(c.compute(total), 60) == sum(range(20))


@gen_cluster(client=True, nthreads=PIPELINE, timeout=120)
async def test_producers_whose_consumers_are_cancelled_are_released(c, s, *workers):
    plugin = await _plugin(c, s, policy="dynamic", interval="50ms")
    producers, consumers = pipeline(40, 1024, 0.2)
    futures = c.compute(consumers)
    kept = c.compute(producers[-1])  # a producer the client also wants
    await async_wait_until(lambda: plugin.admission.status()["released"] >= 3, timeout=120,
                           message="3 producers released by admission")
    await c.cancel(futures)
    assert (await asyncio.wait_for(kept, 60))[0] == 39.0


@pytest.mark.slow
@gen_cluster(client=True, nthreads=PIPELINE, timeout=300)
async def test_the_issue_scenario_200_blocks_of_10_mb_with_a_02s_gpu_consumer(c, s, *workers):
    plugin = await _plugin(c, s)
    peak, results = await run_and_poll(c, s, 200, 10 * MB, 0.2)
    assert results == [float(i) for i in range(200)]
    assert plugin.admission.status()["budget"] == 6
    print(f"peak producer outputs held: {peak} of 200 (budget 6)")
    assert peak <= 6, peak  # plain Dask: 193 of 200


async def map_and_poll(c, s, n: int, nbytes: int, seconds: float, tag: str = "produce",
                       gap: float = 0.0, first: int = 0) -> tuple[int, list]:
    """distributed#9164's form: ``client.map`` of the producers, then (``gap`` seconds
    later) a second ``client.map`` of consumers needing ``GPU=1``; the most producer outputs
    held at once, and the results."""
    keys = [f"{tag}-{first + i}" for i in range(n)]
    peak = 0

    def poll():
        nonlocal peak
        held = sum(1 for k in keys if k in s.tasks and s.tasks[k].state == "memory")
        peak = max(peak, held)

    producers = c.map(produce, range(n), nbytes=nbytes, key=keys)
    deadline = time.monotonic() + gap
    while time.monotonic() < deadline:
        poll()
        await asyncio.sleep(0.01)
    consumers = c.map(consume, producers, seconds=seconds, resources={"GPU": 1},
                      key=[f"consume-{k}" for k in keys])
    del producers
    while not all(f.done() for f in consumers):
        poll()
        await asyncio.sleep(0.01)
    return peak, await c.gather(consumers)


@gen_cluster(client=True, nthreads=PIPELINE, timeout=120)
@pytest.mark.slow
async def test_producers_of_consumers_submitted_later_are_held_too(c, s, *workers):
    # distributed#9164: client.map(produce), then client.map(consume, resources={"GPU": 1});
    # plain Dask (and blockflow before) held 46-52 of 60 here
    plugin = await _plugin(c, s)
    peak, results = await map_and_poll(c, s, 60, MB, 0.05)
    assert results == [float(i) for i in range(60)]
    admission = plugin.admission.status()
    assert admission["budget"] == 6 and admission["resources"] == {"GPU": 1}
    # the producers already on a worker when the consumers came (2 per worker) count
    # against the budget, those over it were taken back; the rest were taken out of the
    # queue and run as the budget allows
    assert admission["released"] >= 60 - 2 * len(workers)
    assert peak <= 6, peak
    assert admission["patterns"] == 1  # this client's "produce" feeds GPU consumers


@gen_cluster(client=True, nthreads=PIPELINE, timeout=120)
@pytest.mark.slow
async def test_a_learned_pattern_holds_producers_before_their_consumers_arrive(c, s, *workers):
    plugin = await _plugin(c, s)
    await map_and_poll(c, s, 20, MB, 0.01)
    assert plugin.admission.status()["patterns"] == 1
    # the same pipeline again, its consumers submitted well after the producers: without
    # the pattern every producer has run by then (peak ~ all of them)
    peak, results = await map_and_poll(c, s, 60, MB, 0.05, gap=0.5, first=20)
    assert results == [float(i) for i in range(60)]
    assert peak <= 6, peak
    assert plugin.admission.status()["expired"] == 0


@gen_cluster(client=True, nthreads=PIPELINE, timeout=120,
             config={"blockflow.resources.admission-grace": "300ms"})
async def test_expected_producers_run_when_no_consumer_comes_within_the_grace(c, s, *workers):
    plugin = await _plugin(c, s, interval="50ms")
    await map_and_poll(c, s, 20, 1024, 0.01)
    assert plugin.admission.status()["patterns"] == 1
    # producers of the learned prefix, and no consumer ever: held for the grace, then all run
    futures = c.map(produce, range(40), nbytes=1024, key=[f"produce-x{i}" for i in range(40)])
    results = await asyncio.wait_for(c.gather(futures), 60)
    assert [float(r[0]) for r in results] == [float(i) for i in range(40)]
    status = plugin.admission.status()
    assert status["patterns"] == 0  # a miss: the pattern is forgotten
    assert status["expected"] == 0 and status["held"] == 0
    # with the pattern gone, the next producers of that prefix are not held at all
    more = c.map(produce, range(5), nbytes=1024, key=[f"produce-y{i}" for i in range(5)])
    await asyncio.wait_for(c.gather(more), 60)
    assert plugin.admission.status()["released"] == status["released"]


@gen_cluster(client=True, nthreads=PIPELINE, timeout=120)
@pytest.mark.slow
async def test_the_same_pipeline_submitted_again_with_the_same_keys_completes(c, s, *workers):
    # client.map's keys are deterministic: running a pipeline twice resubmits its keys
    # (the second time, producers tracked from the first run are held anew, not left held)
    plugin = await _plugin(c, s)
    await map_and_poll(c, s, 20, MB, 0.01)
    _, results = await asyncio.wait_for(map_and_poll(c, s, 30, MB, 0.02, gap=0.3), 60)
    assert results == [float(i) for i in range(30)]
    assert plugin.admission.status()["patterns"] == 1


def produce_slowly(i: int, nbytes: int, seconds: float) -> np.ndarray:
    time.sleep(seconds)
    return produce(i, nbytes)


@gen_cluster(client=True, nthreads=PIPELINE, timeout=180)
async def test_two_map_pipelines_submitted_separately_hold_at_most_the_budget(c, s, *workers):
    # issue 39: two client.map pipelines (producers, then their GPU consumers), submitted
    # one after the other and running at once, held 20 of 200 producer outputs against a
    # budget of 6: the budget is the scheduler's, across graphs. Producers take 50 ms, so
    # that none ends before its consumers' graph arrives.
    plugin = await _plugin(c, s)
    n = 30
    keys = {tag: [f"{tag}-{i}" for i in range(n)] for tag in ("produce", "load")}
    consumers = {}
    for tag, tag_keys in keys.items():  # the two pipelines, each in two graphs
        producers = c.map(produce_slowly, range(n), nbytes=MB, seconds=0.05, key=tag_keys)
        consumers[tag] = c.map(consume, producers, seconds=0.02, resources={"GPU": 1},
                               key=[f"consume-{k}" for k in tag_keys])
        del producers
    everything = [k for tag_keys in keys.values() for k in tag_keys]
    peak = 0
    while not all(f.done() for fs in consumers.values() for f in fs):
        held = sum(1 for k in everything if k in s.tasks and s.tasks[k].state == "memory")
        peak = max(peak, held)
        await asyncio.sleep(0.01)
    for tag in keys:
        assert await c.gather(consumers[tag]) == [float(i) for i in range(n)]
    status = plugin.admission.status()
    assert status["budget"] == 6 and status["held"] == 0
    assert peak <= 6, peak
    assert status["peak_active"] <= 6


@gen_cluster(client=True, nthreads=PIPELINE, timeout=120,
             config={"blockflow.resources.admission-budget": 0})
async def test_a_budget_of_0_turns_admission_off_and_every_producer_runs(c, s, *workers):
    # issue 39: the policy switched the rule back on over a budget of 0 (the documented way
    # off), which then held every producer and released none: the pipeline never ended
    plugin = await _plugin(c, s)
    assert not plugin.admission.enabled
    _, consumers = pipeline(20, MB, 0.01)
    assert await c.gather(c.compute(consumers)) == [float(i) for i in range(20)]
    assert plugin.admission.status()["held"] == 0
    assert not [t for t in s.tasks.values() if t.worker_restrictions
                and "blockflow-admission://held" in t.worker_restrictions]
