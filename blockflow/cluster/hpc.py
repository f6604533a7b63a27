"""HPC job queues through dask-jobqueue: workers as batch jobs, blockflow's scheduler plugin."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import time
from typing import Any, Mapping

import dask.config
from dask.utils import parse_timedelta

from blockflow import _distributed
from blockflow.errors import ClusterStartError
from blockflow.scheduling.policies import POLICIES, policy_class

__all__ = ["add_workers", "batch_job", "jobqueue_cluster", "slurm_cluster"]

#: The scheduler preload that installs blockflow's scheduler plugin.
PRELOAD = "blockflow.scheduling.preload"

#: Batch system -> dask-jobqueue cluster class name.
SYSTEMS = {
    "slurm": "SLURMCluster",
    "pbs": "PBSCluster",
    "sge": "SGECluster",
    "lsf": "LSFCluster",
    "htcondor": "HTCondorCluster",
    "oar": "OARCluster",
    "moab": "MoabCluster",
}

#: Environment variables a batch system sets in its jobs: system -> (job id, queue), and
#: for SGE a variable that tells its JOB_ID from a generic one.
_JOB_ENV = (
    ("slurm", "SLURM_JOB_ID", "SLURM_JOB_PARTITION", None),
    ("pbs", "PBS_JOBID", "PBS_QUEUE", None),
    ("lsf", "LSB_JOBID", "LSB_QUEUE", None),
    ("sge", "JOB_ID", "QUEUE", "SGE_ROOT"),
)

_MISSING = ("blockflow.cluster.hpc needs dask-jobqueue, which is not installed; "
            "pip install dask-jobqueue")


def batch_job(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The batch job this process runs in (Slurm, PBS, LSF, SGE), from ``environ`` (default
    ``os.environ``): ``{"system", "job_id", "queue"}``, or ``{}``."""
    env = os.environ if environ is None else environ
    for system, job_var, queue_var, marker in _JOB_ENV:
        job_id = env.get(job_var)
        if job_id and (marker is None or env.get(marker)):
            out = {"system": system, "job_id": str(job_id)}
            if env.get(queue_var):
                out["queue"] = str(env[queue_var])
            return out
    return {}


def jobqueue_defaults() -> None:
    """Put dask-jobqueue's configuration defaults back into ``dask.config`` if a reset since
    its import dropped them (user values keep priority). Call after importing dask-jobqueue."""
    if "interface" not in (dask.config.get("jobqueue.slurm", None) or {}):
        from dask_jobqueue.config import reconfigure

        reconfigure()


def _cluster_class(system: str):
    try:
        import dask_jobqueue
    except ImportError:
        raise ImportError(_MISSING) from None
    if system not in SYSTEMS:
        raise ValueError(f"jobqueue_cluster: unknown batch system {system!r}; choose one of "
                         f"{', '.join(sorted(SYSTEMS))}.")
    jobqueue_defaults()
    return getattr(dask_jobqueue, SYSTEMS[system])


def _resources_arg(resources: Mapping[str, float] | None) -> list[str]:
    """``["--resources", "GPU=1 MEM=2"]`` for ``dask worker`` (validated), or ``[]``."""
    if not resources:
        return []
    if not isinstance(resources, Mapping):
        raise TypeError(f"worker_resources must be a dict such as {{'GPU': 1}}, got "
                        f"{type(resources).__name__}.")
    parts = []
    for name, amount in resources.items():
        if not isinstance(name, str) or not name or any(c in name for c in " =,"):
            raise ValueError(f"worker_resources: {name!r} is not a resource name (a word such "
                             f"as 'GPU').")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
            raise ValueError(f"worker_resources: {name} must be a number > 0, got {amount!r}.")
        parts.append(f"{name}={amount:g}")
    return ["--resources", " ".join(parts)]


def _scheduler_options(options: Mapping[str, Any] | None, policy: str | None) -> dict:
    """``scheduler_options`` with blockflow's preload added (and its policy argument)."""
    options = dict(options or {})
    preload = options.get("preload") or []
    preload = [preload] if isinstance(preload, str) else list(preload)
    if PRELOAD not in preload:
        preload.append(PRELOAD)
    options["preload"] = preload
    if policy is not None:
        if "." in policy:
            policy_class(policy)  # a dotted path: importable here, or a one-line ValueError
        elif policy not in POLICIES:
            raise ValueError(f"jobqueue_cluster: unknown policy {policy!r}; choose one of "
                             f"{', '.join(POLICIES)}.")
        argv = options.get("preload_argv") or []
        if argv and not isinstance(argv[0], (list, tuple)):
            argv = [list(argv)] * len(preload)
        argv = [list(a) for a in argv] + [[] for _ in range(len(preload) - len(argv))]
        argv[preload.index(PRELOAD)] = ["--blockflow-policy", policy]
        options["preload_argv"] = argv
    return options


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _slurm(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def _check_slurm(queue: str | None) -> None:
    """Fail fast, in one line, when Slurm is not there or the partition does not exist."""
    if shutil.which("sinfo") is None:
        raise ClusterStartError(
            "Slurm's commands (sinfo, sbatch) are not on this machine's PATH: run on a Slurm "
            "login node, or install the Slurm client (Debian: apt-get install slurm-client).")
    try:
        out = _slurm("sinfo", "--noheader", "--format=%R")
    except subprocess.TimeoutExpired:
        out = None
    if out is None or out.returncode != 0:
        why = "no answer within 30 s" if out is None else (
            _last_line(out.stderr) or f"exit status {out.returncode}")
        raise ClusterStartError(
            f"Slurm is not answering (sinfo: {why}): start slurmctld (and munged) on the "
            f"controller, or point SLURM_CONF at the cluster's slurm.conf.")
    partitions = sorted(set(out.stdout.split()))
    if queue is not None and queue not in partitions:
        raise ClusterStartError(
            f"Slurm partition {queue!r} does not exist (partitions: "
            f"{', '.join(partitions) or 'none'}); pass queue= one of them.")


def _submit_failure(system: str, exc: BaseException) -> ClusterStartError:
    """dask-jobqueue's multi-line ``RuntimeError`` of a refused submission, as one line."""
    text = str(exc)
    cmd = text.split("Command:", 1)[1].strip().split()[0] if "Command:" in text else "submit"
    stderr = text.split("stderr:", 1)[1] if "stderr:" in text else text
    why = _last_line(stderr) or _last_line(text) or type(exc).__name__
    return ClusterStartError(
        f"{system} refused the worker job ({os.path.basename(cmd)}: {why}): check the job "
        f"options (queue=, cores=, memory=, walltime=, account=, job_extra_directives=) "
        f"against the queue's limits.")


def _job_state(system: str, job_id: str | None) -> dict[str, str]:
    """Slurm's view of one job: state, reason, partition and node ({} if unknown/gone)."""
    if system != "slurm" or not job_id or shutil.which("squeue") is None:
        return {}
    try:
        out = _slurm("squeue", "--noheader", "-j", str(job_id), "--format=%T|%r|%P|%N",
                     timeout=15)
    except subprocess.TimeoutExpired:
        return {}
    if out.returncode != 0 or not out.stdout.strip():
        return {}
    state, reason, partition, node = (out.stdout.strip().splitlines()[0].split("|") + [""] * 4)[:4]
    return {"state": state, "reason": reason, "partition": partition, "node": node}


def _joined(cluster, names) -> set[str]:
    """Spec names whose workers have joined (``<name>-<i>`` for multi-process jobs)."""
    seen = {str(w.get("name")) for w in (cluster.scheduler_info.get("workers") or {}).values()}
    return {n for n in names if n in seen or any(s.startswith(f"{n}-") for s in seen)}


def _not_joined(system: str, cluster, name: str, timeout: float,
                log_directory: str | None) -> str:
    job = cluster.workers.get(name)
    job_id = getattr(job, "job_id", None)
    address = cluster.scheduler_address
    info = _job_state(system, job_id)
    label = f"{system} job {job_id}" if job_id else f"{system} job of worker {name!r}"
    log = (f"; its log: {os.path.join(log_directory, f'*-{job_id}.err')}"
           if log_directory and job_id else "")
    state = info.get("state", "")
    if state in ("PENDING", "CONFIGURING"):
        return (f"{label} (worker {name!r}) is still {state} in queue "
                f"{info.get('partition') or '?'} after {timeout:g} s (reason: "
                f"{info.get('reason') or 'unknown'}): the queue has no free node; wait "
                f"longer (timeout=), or choose another queue=.")
    if state in ("RUNNING", "COMPLETING"):
        return (f"{label} (worker {name!r}) runs on {info.get('node') or 'its node'} but its "
                f"worker did not reach the scheduler at {address} within {timeout:g} s: the "
                f"node cannot connect to that address; start the cluster with interface= "
                f"(or scheduler_options={{'interface': ...}}) naming a network the compute "
                f"nodes share{log}.")
    return (f"{label} (worker {name!r}) ended before its worker reached the scheduler at "
            f"{address} (waited {timeout:g} s): the worker failed to start or could not "
            f"connect{log}.")


def _wait_joined(system: str, cluster, names: list[str], timeout: float,
                 log_directory: str | None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        missing = [n for n in names if n not in _joined(cluster, names)]
        if not missing:
            return
        if time.monotonic() > deadline:
            first = _not_joined(system, cluster, missing[0], timeout, log_directory)
            more = f" ({len(missing) - 1} more workers missing)" if len(missing) > 1 else ""
            raise ClusterStartError(first + more)
        time.sleep(0.2)


def _timeout(timeout) -> float:
    if timeout is None:
        timeout = dask.config.get("blockflow.cluster.worker-start-timeout")
    seconds = parse_timedelta(timeout, default="s")
    if seconds is None or seconds <= 0:
        raise ValueError(f"timeout must be a duration > 0 (seconds, or '10m'), got "
                         f"{timeout!r}.")
    return float(seconds)


def jobqueue_cluster(system: str = "slurm", *, queue: str | None = None, n_workers: int = 0,
                     worker_resources: Mapping[str, float] | None = None,
                     policy: str | None = None, timeout: str | float | None = None,
                     **jobqueue_kwargs: Any):
    """A dask-jobqueue cluster with blockflow's scheduler plugin, its workers up.

    Parameters
    ----------
    system : str, default "slurm"
        A batch system of :data:`SYSTEMS`.
    queue : str, optional
        Queue (Slurm partition) of the worker jobs.
    n_workers : int, default 0
        Worker jobs to submit; returns once their workers joined.
    worker_resources : dict, optional
        Worker resources every worker declares (``{"GPU": 1}``).
    policy : str, optional
        Default ``blockflow.cluster.policy``.
    timeout : str or float, optional
        Default ``blockflow.cluster.worker-start-timeout``.
    **jobqueue_kwargs
        Passed to the dask-jobqueue class (``cores``, ``memory``, ``walltime``, ...).

    Returns
    -------
    dask_jobqueue.JobQueueCluster

    Raises
    ------
    ImportError
        If dask-jobqueue is not installed.
    ValueError, TypeError
        For an invalid argument.
    ClusterStartError
        Slurm not answering, an unknown partition, a refused job, or a worker not joined within
        ``timeout`` (the cluster is closed first).

    Examples
    --------
    >>> cluster = jobqueue_cluster("slurm", queue="gpu", n_workers=4, cores=8,
    ...                            memory="64GB", worker_resources={"GPU": 1})
    ... # doctest: +SKIP
    """
    cls = _cluster_class(system)
    if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 0:
        raise ValueError(f"jobqueue_cluster: n_workers must be an integer >= 0, got "
                         f"{n_workers!r}.")
    wait = _timeout(timeout)
    kwargs = dict(jobqueue_kwargs)
    kwargs["scheduler_options"] = _scheduler_options(kwargs.get("scheduler_options"), policy)
    kwargs["worker_extra_args"] = (list(kwargs.get("worker_extra_args") or [])
                                   + _resources_arg(worker_resources))
    if queue is not None:
        kwargs["queue"] = queue
    if system == "slurm":
        _check_slurm(queue if queue is not None
                     else dask.config.get("jobqueue.slurm.queue", None))
    cluster = cls(n_workers=0, **kwargs)
    try:
        # dask-jobqueue's own n_workers= submits in the background, where a refused job is
        # only logged: add the specs and start them here, failures raised
        names = []
        for _ in range(n_workers):
            spec = cluster.new_worker_spec()
            cluster.worker_spec.update(spec)
            names.extend(spec)
        if names:
            try:
                _distributed.start_spec_workers(cluster)
            except RuntimeError as e:
                raise _submit_failure(system, e) from None
            _wait_joined(system, cluster, names, wait, kwargs.get("log_directory"))
    except BaseException:
        cluster.close()
        raise
    return cluster


def slurm_cluster(queue: str | None = None, *, n_workers: int = 0, **kwargs: Any):
    """``jobqueue_cluster("slurm", queue=queue, n_workers=n_workers, **kwargs)``
    (:func:`jobqueue_cluster`).

    Examples
    --------
    >>> cluster = slurm_cluster("gpu", n_workers=2, cores=8, memory="64GB",
    ...                         worker_resources={"GPU": 1})  # doctest: +SKIP
    >>> add_workers(cluster, 4, queue="cpu")                  # doctest: +SKIP
    """
    return jobqueue_cluster("slurm", queue=queue, n_workers=n_workers, **kwargs)


def add_workers(cluster, n: int, *, queue: str | None = None,
                worker_resources: Mapping[str, float] | None = None,
                timeout: str | float | None = None, **job_kwargs: Any) -> list[str]:
    """Add ``n`` workers from another queue (or with other job options) to a jobqueue cluster;
    returns once they joined.

    Parameters
    ----------
    cluster : dask_jobqueue.JobQueueCluster
    n : int
        Workers to add (>= 1).
    queue : str, optional
        Default the cluster's.
    worker_resources : dict, optional
        Instead of the cluster's (``{}`` for none).
    timeout : str or float, optional
        As for :func:`jobqueue_cluster`.
    **job_kwargs
        Job options to change (``cores``, ``memory``, ...).

    Returns
    -------
    list of str
        The new workers' names (``<queue>-<i>``).

    Raises
    ------
    ClusterStartError
        As :func:`jobqueue_cluster` (only the new jobs are cancelled).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"add_workers: n must be an integer >= 1, got {n!r}.")
    wait = _timeout(timeout)
    system = next((s for s, name in SYSTEMS.items() if type(cluster).__name__ == name), "slurm")
    spec = copy.deepcopy(cluster.new_spec)
    options = spec.setdefault("options", {})
    if queue is not None:
        options["queue"] = queue
    if worker_resources is not None:
        args = list(options.get("worker_extra_args") or [])
        if "--resources" in args:  # replace the cluster's resources
            i = args.index("--resources")
            del args[i:i + 2]
        options["worker_extra_args"] = args + _resources_arg(worker_resources)
    options.update(job_kwargs)
    if system == "slurm":
        _check_slurm(options.get("queue"))
    prefix = str(options.get("queue") or "workers")
    start = sum(1 for k in cluster.worker_spec if str(k).startswith(f"{prefix}-"))
    names = [f"{prefix}-{start + i}" for i in range(n)]
    for name in names:
        cluster.worker_spec[name] = copy.deepcopy(spec)
    try:
        _distributed.start_spec_workers(cluster)
    except RuntimeError as e:
        _drop(cluster, names)
        raise _submit_failure(system, e) from None
    try:
        _wait_joined(system, cluster, names, wait, options.get("log_directory"))
    except BaseException:
        _drop(cluster, names)
        raise
    return names


def _drop(cluster, names) -> None:
    """Remove worker specs and cancel their jobs (the rest of the cluster keeps running)."""
    for name in names:
        cluster.worker_spec.pop(name, None)
    try:
        _distributed.start_spec_workers(cluster)  # closes the workers no longer in the spec
    except Exception:
        pass
