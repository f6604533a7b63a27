"""blockflow.cluster.hpc without a batch system: batch job facts, options, bad input.

The real thing (a one-node Slurm, dask-jobqueue's SLURMCluster) is in tests/hpc/.
"""

from __future__ import annotations

import pytest

from blockflow.cluster.hpc import _scheduler_options, batch_job, jobqueue_cluster


@pytest.mark.parametrize("env, expected", [
    ({"SLURM_JOB_ID": "4711", "SLURM_JOB_PARTITION": "gpu"},
     {"system": "slurm", "job_id": "4711", "queue": "gpu"}),
    ({"PBS_JOBID": "12.pbs01", "PBS_QUEUE": "workq"},
     {"system": "pbs", "job_id": "12.pbs01", "queue": "workq"}),
    ({"LSB_JOBID": "99"}, {"system": "lsf", "job_id": "99"}),
    ({"JOB_ID": "7", "SGE_ROOT": "/opt/sge", "QUEUE": "all.q"},
     {"system": "sge", "job_id": "7", "queue": "all.q"}),
    ({"JOB_ID": "7"}, {}),  # JOB_ID alone is not SGE's
    ({}, {}),
])
def test_batch_job_reads_the_batch_systems_environment(env, expected):
    assert batch_job(env) == expected


def test_the_preload_is_added_once_with_its_policy():
    opts = _scheduler_options({"dashboard_address": ":0"}, "dynamic")
    assert opts == {"dashboard_address": ":0", "preload": ["blockflow.scheduling.preload"],
                    "preload_argv": [["--blockflow-policy", "dynamic"]]}
    mine = _scheduler_options({"preload": ["mypreload", "blockflow.scheduling.preload"],
                               "preload_argv": ["--x"]}, "off")
    assert mine["preload"] == ["mypreload", "blockflow.scheduling.preload"]
    assert mine["preload_argv"] == [["--x"], ["--blockflow-policy", "off"]]
    assert _scheduler_options(None, None) == {"preload": ["blockflow.scheduling.preload"]}


@pytest.mark.parametrize("kwargs, error, message", [
    ({"system": "torque"}, ValueError, "jobqueue_cluster: unknown batch system 'torque'; "
                                       "choose one of htcondor, lsf, moab, oar, pbs, sge, slurm."),
    ({"n_workers": -1}, ValueError, "jobqueue_cluster: n_workers must be an integer >= 0, "
                                    "got -1."),
    ({"timeout": 0}, ValueError, "timeout must be a duration > 0 (seconds, or '10m'), got 0."),
    ({"policy": "fastest"}, ValueError, "jobqueue_cluster: unknown policy 'fastest'; choose "
                                        "one of "),
    ({"worker_resources": {"GPU": -1}}, ValueError,
     "worker_resources: GPU must be a number > 0, got -1."),
    ({"worker_resources": ["GPU"]}, TypeError,
     "worker_resources must be a dict such as {'GPU': 1}, got list."),
])
def test_bad_input_is_one_line_before_anything_is_submitted(kwargs, error, message):
    pytest.importorskip("dask_jobqueue")
    kwargs = {"system": "slurm", **kwargs}
    with pytest.raises(error) as e:
        jobqueue_cluster(kwargs.pop("system"), cores=1, memory="1GB", **kwargs)
    assert str(e.value).startswith(message)


def test_dask_jobqueue_defaults_dropped_by_a_config_reset_are_restored(monkeypatch):
    # distributed's test harness (and any code that restores a config snapshot taken before
    # dask_jobqueue was imported) drops the defaults dask-jobqueue adds at import; the
    # cluster classes then fail with KeyError 'jobqueue' (seen on CI)
    import dask
    import dask_jobqueue  # noqa: F401  (its defaults are in the config now)

    monkeypatch.delitem(dask.config.config, "jobqueue")
    with dask.config.set({"jobqueue.pbs.walltime": "00:05:00"}):  # the user's value wins
        cluster = jobqueue_cluster("pbs", n_workers=0, cores=1, memory="1GB",
                                   scheduler_options={"dashboard_address": ":0"})
        try:
            assert dask.config.get("jobqueue.pbs.interface", "missing") is None
            assert "walltime=00:05:00" in cluster.job_script()
        finally:
            cluster.close()
