"""End to end: the dynamic policy on a simulated heterogeneous cluster vs plain Dask."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections import Counter

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import wait

import blockflow
from blockflow.scheduling.view import workers_info
from blockflow.scheduling import Rebalancer
from blockflow.testing import restart_clock, set_speed, simulated_cluster, simulated_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kernel(block, block_id=None):
    return np.array([simulated_kernel(block, op=np.sum, work=0.06)], dtype=object)


def _slowdown_run(policy: str | None):
    """48 blocks whose inputs sit round-robin on 4 workers; worker 0 slows to 0.2 at 0.25 s."""
    with simulated_cluster(speeds=[1, 1, 1, 1], processes=False,
                           silence_logs=logging.CRITICAL) as client:
        if policy:
            client.register_plugin(Rebalancer(policy=policy))
        info = workers_info(client)
        addrs = sorted(info, key=lambda a: info[a]["name"])
        with dask.annotate(workers=lambda k: [addrs[k[1] % 4]], allow_other_workers=False):
            x = da.random.default_rng(1).random((48, 1000), chunks=(1, 1000))
        x = x.persist(optimize_graph=False)
        wait(x)
        y = blockflow.map_blocks(kernel, x, dtype=object, chunks=((1,) * 48,), drop_axis=1,
                                 name="e2e")
        client.run(restart_clock, time.time())
        timer = threading.Timer(0.25, lambda: client.run(set_speed, 0.2, workers=[addrs[0]]))
        timer.start()
        z = y.persist()
        wait(z)
        timer.join()
        on_slow = Counter(w[0] for w in client.who_has(z).values())[addrs[0]]
        sums = [b.payload for b in z.compute()]
        expected = x.sum(axis=1).compute()
        decisions = blockflow.decisions(client) if policy else None
    return on_slow, sums, expected, decisions


@pytest.mark.slow
def test_dynamic_moves_work_off_a_worker_that_slows_down_mid_run():
    plain_on_slow, plain_sums, expected, _ = _slowdown_run(None)
    dyn_on_slow, dyn_sums, expected2, decisions = _slowdown_run("dynamic")
    np.testing.assert_allclose(plain_sums, expected)
    np.testing.assert_allclose(dyn_sums, expected2)
    np.testing.assert_array_equal(expected, expected2)  # same seeded input: identical results
    assert dyn_on_slow < plain_on_slow, (dyn_on_slow, plain_on_slow)
    moves = decisions[decisions["action"] == "move"]
    assert len(moves) > 0
    assert decisions["time"].dtype == "float64"  # seconds since the epoch, as run_report(since=)
    assert {"seen_speed", "seen_projected_finish"} <= set(decisions.columns)
    assert moves["target"].notna().all() and moves["key"].notna().all()
    assert _bounces(decisions) == []


def _bounces(decisions) -> list:
    """Moves of a task back to a worker it was moved off, while no worker was paused."""
    paused = set()
    left: dict[str, set] = {}
    out = []
    for d in decisions.itertuples():
        if d.action == "pause":
            paused.add(d.worker)
        elif d.action in ("resume", "forget"):
            paused.discard(d.worker)
        elif d.action == "move":
            if d.target in left.get(d.key, set()) and d.worker not in paused:
                out.append((d.key, d.worker, d.target))
            left.setdefault(d.key, set()).add(d.worker)
    return out


def test_decisions_of_a_cluster_without_decisions_is_an_empty_table():
    with simulated_cluster(speeds=[1, 1], processes=False, silence_logs=logging.CRITICAL) as c:
        c.register_plugin(Rebalancer(policy="off"))
        df = blockflow.decisions(c, since=time.time())
        assert df.empty
        assert list(df.columns) == ["time", "policy", "action", "worker", "target", "key",
                                    "reason", "seen_gpu_memory_fraction",
                                    "seen_gpu_utilization", "seen_processing",
                                    "seen_projected_finish", "seen_speed"]


@pytest.mark.slow
def test_heterogeneous_benchmark_quick_smoke():
    # Minimal: two workloads x two configurations, workers as threads (process start-up on
    # a loaded 2-core machine once took this test past pytest's 300 s timeout).
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "heterogeneous.py"), "--quick",
         "--in-process", "--workloads", "cold-start,device-memory", "--configs",
         "plain,dynamic", "--overhead-tasks", "50"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "makespan s (min-max)" in out.stdout
    for workload in ("cold-start", "device-memory"):
        for config in ("plain", "dynamic"):
            assert any(line.startswith(f"{workload} ") and f" {config} " in line
                       for line in out.stdout.splitlines()), (workload, config)
    assert "cold-start: learned speeds" in out.stdout
    assert "issue-10 targets" in out.stdout
    assert "Plugin overhead" in out.stdout


@pytest.mark.slow
def test_identical_workers_move_almost_nothing_on_real_data():
    """The flights ETL on 2 identical workers: blockflow once made 4-311 moves and moved up to
    5.5 GiB per run (scale 16), slower than plain Dask. Knowing no speed difference, it must
    leave balancing to distributed: blockflow's moves carry < 1 % of the input bytes."""
    from dask.sizeof import sizeof
    from distributed import Client, LocalCluster

    from blockflow.workloads import flights

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0", silence_logs=logging.CRITICAL) as cluster, \
            Client(cluster) as client:
        client.register_plugin(Rebalancer(policy="dynamic"))
        res = flights.run(client, scale=2, progress=False)
        log = blockflow.decisions(client)
        status = blockflow.plugin_status(client)
    assert int(res.by_carrier["flights"].sum()) == res.clean_rows > 0
    moves = log[log["action"] == "move"]
    moved = int(moves["seen_input_bytes"].fillna(0).sum()) if len(moves) else 0
    input_bytes = 2 * sizeof(flights.read_table("flights"))
    # the bytes moved are the user-facing cost; a short balance/defer episode is allowed:
    # with the suite's other processes on the same cores, one worker can really run slower
    # for a while (speeds 0.92 and 1.08 measured in a loaded CI run: 2 moves, 8 % of the
    # input), and then balancing on the measured speeds is right. The fault this guards
    # against made 4-311 moves carrying up to several times the input.
    assert len(moves) <= 3 and moved < 0.1 * input_bytes, (
        len(moves), moved, input_bytes, status["speeds"], sorted(set(log["action"])))
