"""dask-jobqueue on a real Slurm: blockflow's preload and worker resources, two partitions.

One ``SLURMCluster`` for the module (:func:`blockflow.cluster.hpc.slurm_cluster`): two workers
in partition ``fast`` declaring ``GPU=1``, one added from partition ``slow``
(:func:`blockflow.cluster.hpc.add_workers`). Its workers are real batch jobs of the session's
one-node Slurm (``conftest.py``), started by ``sbatch`` and cancelled with the cluster.
"""

from __future__ import annotations

import sys
import time

import functools
import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from distributed import Client, LocalCluster, get_worker, wait

import blockflow
from blockflow.cli import cli
from blockflow.cluster.hpc import add_workers, slurm_cluster
from blockflow.scheduling.view import workers_info
from blockflow.errors import ClusterStartError
from blockflow.scheduling.view import plugin_status
from blockflow.testing import SimulatedDevice, SimulatedGPU, simulated_kernel
from loadaware import scaled, wait_until
from blockflow.workloads import flights

SPEEDS = {"fast": 1.0, "slow": 0.2}
# 3 GB: a worker holding the flights tables stays below distributed's pause at 80 % of it
JOB = dict(cores=1, memory="3GB", processes=1, walltime="00:20:00")


def _options(slurm, **kw):
    return {**JOB, "log_directory": slurm.job_directory,
            "scheduler_options": {"dashboard_address": ":0"}, "timeout": 120, **kw}


@pytest.fixture(scope="module")
def hpc(slurm):
    """(cluster, client, seconds the two fast workers took to come up). Every worker declares
    ``GPU=1`` and carries a simulated GPU: speed 1 in partition fast, 0.2 in slow."""
    t0 = time.perf_counter()
    cluster = slurm_cluster("fast", n_workers=2, worker_resources={"GPU": 1},
                            **_options(slurm))
    startup = time.perf_counter() - t0
    try:
        add_workers(cluster, 1, queue="slow", timeout=120)
        with Client(cluster) as client:  # blockflow's plugin comes from the preload
            part = _partitions(client)
            client.register_plugin(SimulatedGPU(
                {a: SimulatedDevice(speed=SPEEDS[q]) for a, q in part.items()}))
            wait_until(lambda: all(w.device == "gpu" for w in blockflow.inventory(client)),
                       message="the simulated GPU metrics of the Slurm workers")
            yield cluster, client, startup
    finally:
        cluster.close()


def _partitions(client) -> dict[str, str]:
    """Worker address -> its Slurm partition, as the worker's environment says."""
    return {a: w.job_queue for a, w in
            ((w.address, w) for w in blockflow.inventory(client))}


@pytest.mark.slow
def test_workers_come_up_as_slurm_jobs_with_the_plugin_and_resources(hpc, slurm,
                                                                     record_property):
    cluster, client, startup = hpc
    record_property("slurm_worker_startup_s", round(startup, 1))
    print(f"\ntwo Slurm workers up in {startup:.1f} s")
    assert plugin_status(client)["policy"] == "dynamic"  # the preload ran on the scheduler
    jobs = {name: job.job_id for name, job in cluster.workers.items()}
    assert len(jobs) == 3 and all(jobs.values())
    assert sorted(slurm.jobs()) == sorted(jobs.values())  # real batch jobs, running
    inv = blockflow.inventory(client)
    assert {w.job_id for w in inv} == set(jobs.values())
    assert sorted(w.job_queue for w in inv) == ["fast", "fast", "slow"]
    assert all(w.job_system == "slurm" for w in inv)
    assert all(w.resources == {"GPU": 1} for w in inv)  # --resources GPU=1
    assert client.submit(lambda: get_worker().name, resources={"GPU": 1},
                         pure=False).result() in jobs


@pytest.mark.slow
def test_blockflow_info_lists_the_workers_with_their_slurm_job_ids(hpc):
    cluster, client, _ = hpc
    result = CliRunner().invoke(cli, ["info", "--address", cluster.scheduler_address],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("<blockflow.Inventory: 3 workers, 3 threads")
    assert "batch job" in result.output
    lines = result.output.splitlines()
    for name, job in cluster.workers.items():
        queue = "slow" if name.startswith("slow-") else "fast"
        (line,) = [ln for ln in lines if f"slurm {job.job_id} ({queue})" in ln]
        assert any(addr in line for addr in workers_info(client))


@pytest.mark.slow
def test_flights_on_slurm_gives_the_tables_of_a_local_cluster(hpc):
    _, client, _ = hpc
    on_slurm = flights.run(client, scale=1, partitions_per_copy=4, progress=False)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as local, Client(local) as local_client:
        on_local = flights.run(local_client, scale=1, partitions_per_copy=4, progress=False)
    assert on_slurm.input_rows == on_local.input_rows == 336_776
    for name in ("by_carrier", "by_origin_month"):
        pd.testing.assert_frame_equal(getattr(on_slurm, name), getattr(on_local, name),
                                      check_exact=True)
    assert len(on_slurm.task_counts) >= 2  # spread over the Slurm workers


# Slurm's workers cannot import this test module: what they run comes from importable modules
KERNEL = functools.partial(simulated_kernel, op=np.sum, work=0.15)


@pytest.mark.slow
def test_heterogeneous_partitions_with_simulated_speeds(hpc):
    """Workers of partition fast run at simulated speed 1, slow at 0.2: the results are
    exact, and the fast workers take most of the GPU tasks."""
    _, client, _ = hpc
    part = _partitions(client)
    blocks = [np.arange(i, i + 10) for i in range(40)]
    futures = client.map(KERNEL, blocks, pure=False, resources={"GPU": 1})
    wait(futures, timeout=scaled(60, at_most=240))
    results = [b.payload for b in client.gather(futures)]
    who = client.who_has(futures)
    assert results == [int(np.arange(i, i + 10).sum()) for i in range(40)]
    counts = {"fast": 0, "slow": 0}
    for holders in who.values():
        counts[part[holders[0]]] += 1
    assert counts["fast"] + counts["slow"] == 40
    assert counts["fast"] > counts["slow"], counts


# --- faults: one line each, never a hang -----------------------------------------------------


@pytest.mark.slow
def test_a_partition_that_does_not_exist(slurm):
    with pytest.raises(ClusterStartError) as e:
        before = slurm.jobs()
        slurm_cluster("nosuch", n_workers=1, **_options(slurm))
    assert str(e.value) == ("Slurm partition 'nosuch' does not exist (partitions: fast, "
                            "slow); pass queue= one of them.")
    assert slurm.jobs() == before  # nothing submitted


@pytest.mark.slow
def test_slurm_not_running(slurm, tmp_path, monkeypatch):
    """sinfo cannot reach a controller (nothing listens at the port in SLURM_CONF)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    conf = tmp_path / "slurm.conf"
    conf.write_text("\n".join(
        f"SlurmctldPort={closed}" if line.startswith("SlurmctldPort=") else line
        for line in open(slurm.conf).read().splitlines()) + "\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    t0 = time.monotonic()
    with pytest.raises(ClusterStartError) as e:
        slurm_cluster("fast", n_workers=1, **_options(slurm))
    message = str(e.value)
    assert message.startswith("Slurm is not answering (sinfo: ")
    assert message.endswith("start slurmctld (and munged) on the controller, or point "
                            "SLURM_CONF at the cluster's slurm.conf.")
    assert "\n" not in message
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_a_job_slurm_refuses(slurm):
    with pytest.raises(ClusterStartError) as e:
        slurm_cluster("fast", n_workers=1, **_options(slurm, memory="100000GB"))
    message = str(e.value)
    assert message.startswith("slurm refused the worker job (sbatch: sbatch: error: ")
    assert message.endswith("check the job options (queue=, cores=, memory=, walltime=, "
                            "account=, job_extra_directives=) against the queue's limits.")
    assert "\n" not in message


@pytest.mark.slow
def test_a_worker_that_cannot_reach_the_scheduler(slurm):
    """The job runs, but its worker is in a network namespace of its own (unshare -n: no
    route to the scheduler): after the timeout, one line naming the job, node and address."""
    import shutil

    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to cut a job off the network")
    with pytest.raises(ClusterStartError) as e:
        slurm_cluster("slow", n_workers=1, **_options(
            slurm, timeout=10, python=f"unshare -n {sys.executable}", death_timeout=30))
    message = str(e.value)
    assert message.startswith("slurm job ")
    assert (f"(worker 'SLURMCluster-0') runs on {slurm.node} but its worker did not reach "
            f"the scheduler at tcp://") in message
    assert "within 10 s: the node cannot connect to that address; start the cluster with " \
           "interface= (or scheduler_options={'interface': ...}) naming a network the " \
           "compute nodes share; its log: " in message
    assert "\n" not in message
    time.sleep(1)
    assert all(job not in slurm.jobs() for job in message.split()[2:3])  # cancelled


def test_without_dask_jobqueue_one_line_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "dask_jobqueue", None)  # as if not installed
    with pytest.raises(ImportError) as e:
        slurm_cluster("fast", n_workers=1, cores=1, memory="1GB")
    assert str(e.value) == ("blockflow.cluster.hpc needs dask-jobqueue, which is not "
                            "installed; pip install dask-jobqueue")
