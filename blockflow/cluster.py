"""Start an embedded cluster or connect to a running Dask scheduler, with blockflow's plugin.

With no address, :func:`connect` starts ``dask_cuda.LocalCUDACluster`` (one worker per GPU)
when dask-cuda and a GPU are present, else ``distributed.LocalCluster`` with worker
processes. With an address it connects to a running scheduler (``dask scheduler``,
dask-jobqueue, dask-kubernetes). Either way blockflow's scheduler plugin is registered.
"""

from __future__ import annotations

import logging
from typing import Any

from dask.utils import parse_timedelta
from distributed import Client, LocalCluster

from blockflow import config
from blockflow.backends import GPU_INSTALL_HINT, GPUUnavailableError, gpu_device_count, has_package
from blockflow.scheduling.plugin import Rebalancer

__all__ = ["connect", "decisions", "gpu_status", "plugin_status", "task_counts"]

logger = logging.getLogger(__name__)


def gpu_status() -> tuple[bool, list[str]]:
    """Whether this machine can start GPU workers, and the pieces missing if not.

    Returns
    -------
    (bool, list of str)
        ``(True, [])`` when dask-cuda (with its CUDA bindings) is installed and at least one
        NVIDIA GPU is visible; else False and a description of each missing piece.
    """
    missing = []
    if gpu_device_count() == 0:
        missing.append("no NVIDIA GPU is visible (NVML and the CUDA runtime report 0 devices)")
    if not has_package("dask_cuda"):
        missing.append("dask-cuda is not installed")
    return not missing, missing


def _check_gpu_arg(gpu: Any) -> None:
    if gpu not in (True, False, "auto"):
        raise ValueError(f"blockflow.connect: gpu must be True, False or 'auto', got {gpu!r}.")


def connect(
    address: str | None = None,
    *,
    gpu: bool | str | None = None,
    n_workers: int | None = None,
    threads_per_worker: int | None = None,
    memory_limit: str | int | None = None,
    dashboard_address: str | None = None,
    policy: str | None = None,
    timeout: str | float | None = None,
    **cluster_kwargs: Any,
) -> Client:
    """Connect to a Dask cluster (starting an embedded one if needed) and register blockflow.

    Parameters
    ----------
    address : str, optional
        Scheduler address (``"tcp://host:8786"``). None starts an embedded cluster.
    gpu : bool or "auto", optional
        Embedded cluster only. ``"auto"``: GPU workers when dask-cuda and a GPU are present;
        True: require them; False: CPU workers. Default ``blockflow.cluster.gpu``.
    n_workers : int, optional
        Embedded cluster's workers; default one per GPU, or distributed's default on CPU.
    threads_per_worker : int, optional
        Threads per worker of the embedded cluster (GPU workers default to 1).
    memory_limit : str or int, optional
        Host memory per worker (``"4GiB"`` or bytes); distributed's default if None.
    dashboard_address : str, optional
        Where the embedded cluster's dashboard listens; default
        ``blockflow.cluster.dashboard-address`` (localhost only).
    policy : str, optional
        Scheduling policy of blockflow's scheduler plugin; default ``blockflow.cluster.policy``.
    timeout : str or float, optional
        How long to wait for the scheduler at ``address`` (default
        ``blockflow.cluster.connect-timeout``).
    **cluster_kwargs
        Passed to ``LocalCluster`` / ``LocalCUDACluster``.

    Returns
    -------
    distributed.Client
        The client (set as default). For an embedded cluster, ``client.cluster`` is it;
        ``client.shutdown()`` stops both.

    Raises
    ------
    GPUUnavailableError
        If ``gpu=True`` and no GPU is visible or dask-cuda is not installed; the message
        lists the missing pieces and the ``pip install "blockflow[gpu]"`` fix.
    OSError
        If ``address`` cannot be reached within ``timeout``; the message names the address.
    ValueError
        For an unknown ``policy`` or ``gpu`` value.
    """
    plugin = Rebalancer(policy=policy)  # validates the policy before anything starts
    if address is not None:
        timeout_s = parse_timedelta(config.get("cluster.connect-timeout", timeout))
        try:
            client = Client(address, timeout=timeout_s)
        except (OSError, TimeoutError) as e:
            raise OSError(
                f"blockflow.connect: could not reach a Dask scheduler at {address!r} within "
                f"{timeout_s:g} s ({type(e).__name__}: {e}). Start one with `dask scheduler "
                f"--preload blockflow.scheduling.preload`, or check the address and port."
            ) from None
    else:
        gpu = config.get("cluster.gpu", gpu)
        _check_gpu_arg(gpu)
        ok, missing = gpu_status()
        if gpu is True and not ok:
            raise GPUUnavailableError(
                "blockflow.connect(gpu=True): this machine cannot start GPU workers: "
                + "; ".join(missing)
                + f". On a machine with an NVIDIA GPU install the GPU extra with "
                f"`{GPU_INSTALL_HINT}`, or pass gpu='auto' or gpu=False to use CPU workers."
            )
        use_gpu = ok and gpu is not False
        cluster = _start_local_cluster(
            use_gpu, n_workers=config.get("cluster.n-workers", n_workers),
            threads_per_worker=config.get("cluster.threads-per-worker", threads_per_worker),
            memory_limit=memory_limit,
            dashboard_address=config.get("cluster.dashboard-address", dashboard_address),
            **cluster_kwargs,
        )
        client = Client(cluster)
    _register_plugin(client, plugin)
    return client


def _start_local_cluster(use_gpu: bool, **kwargs) -> LocalCluster:
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if use_gpu:
        from dask_cuda import LocalCUDACluster

        logger.info("blockflow: starting LocalCUDACluster (%s)", kwargs)
        return LocalCUDACluster(**kwargs)
    kwargs.setdefault("processes", True)
    logger.info("blockflow: starting LocalCluster (%s)", kwargs)
    return LocalCluster(**kwargs)


def _register_plugin(client: Client, plugin: Rebalancer) -> None:
    from blockflow.dashboard.plugin import DashboardPlugin
    from blockflow.scheduling.devicemetrics import DeviceMetrics

    try:
        client.register_plugin(plugin)
        client.register_plugin(DashboardPlugin())
        client.register_plugin(DeviceMetrics())  # adds nothing on workers without a GPU
    except (ModuleNotFoundError, ImportError) as e:
        raise RuntimeError(
            f"blockflow.connect: the scheduler at {client.scheduler.address} cannot load "
            f"blockflow's scheduler plugin ({e}). Install blockflow where the scheduler runs, "
            f"or start it with `dask scheduler --preload blockflow.scheduling.preload`."
        ) from e


def plugin_status(client: Client, **kwargs: Any) -> dict[str, Any]:
    """State of blockflow's scheduler plugin: policy, task counts, worker snapshot, decisions.

    Parameters
    ----------
    client : distributed.Client
    **kwargs
        ``since`` (seconds since the epoch) and ``task_log`` (bool), passed to
        :meth:`blockflow.scheduling.Rebalancer.status`.

    Returns
    -------
    dict
        Plain data: ``policy``, ``ticks``, ``task_counts``, ``kernel_counts``, ``run_counts``,
        ``speeds``, ``paused``, ``workers``, ``memory_peak`` (bytes), ``decisions``.

    Raises
    ------
    RuntimeError
        If the scheduler runs no blockflow plugin (connect with :func:`connect`, or start the
        scheduler with ``--preload blockflow.scheduling.preload``).
    """
    if not client.run_on_scheduler(_has_plugin):  # spares the scheduler an unknown-op error
        raise RuntimeError(
            "The scheduler runs no blockflow plugin: connect with blockflow.connect(...) or "
            "start the scheduler with `dask scheduler --preload blockflow.scheduling.preload`."
        )
    status = client.sync(client.scheduler.blockflow_status, **kwargs)
    return status


def _has_plugin(dask_scheduler=None) -> bool:
    return Rebalancer.name in dask_scheduler.plugins


def task_counts(client: Client, *, kernels_only: bool = False) -> dict[str, int]:
    """Tasks finished per worker since the plugin started (cumulative).

    Parameters
    ----------
    client : distributed.Client
    kernels_only : bool, default False
        Count only blockflow kernel tasks (names starting ``blockflow-``).

    Returns
    -------
    dict of str to int
        Worker address to number of tasks it finished.
    """
    status = plugin_status(client)
    return status["kernel_counts" if kernels_only else "task_counts"]


DECISION_COLUMNS = ["time", "policy", "action", "worker", "target", "key", "reason"]


def decisions(client: Client, since: float | None = None):
    """The rebalancer's decision log as a pandas DataFrame, oldest first.

    Parameters
    ----------
    client : distributed.Client
    since : float, optional
        Only decisions after this time (seconds since the epoch, e.g. ``time.time()`` taken
        before a computation).

    Returns
    -------
    pandas.DataFrame
        Columns ``time`` (UTC timestamp), ``policy``, ``action`` (``pause``, ``resume``,
        ``move``, ``memory-move``, ``assign``, ``keep``, ``handover``, ``join``, ``forget``),
        ``worker``, ``target`` (moves), ``key`` (moves), ``reason``, then ``seen_*`` columns
        with the metrics the decision saw (GPU utilisation in percent, device-memory
        fraction 0-1, learned speed, tasks processing, projected finish in seconds; None
        where unknown). The log is bounded (``blockflow.rebalancer.decision-log-size``).

    Raises
    ------
    RuntimeError
        If the scheduler runs no blockflow plugin.
    """
    import pandas as pd

    rows = plugin_status(client)["decisions"]
    if since is not None:
        rows = [r for r in rows if r["time"] > since]
    df = pd.DataFrame(rows)
    for c in DECISION_COLUMNS:
        if c not in df:
            df[c] = pd.Series(dtype="float64" if c == "time" else "object")
    seen = sorted(c for c in df.columns if c.startswith("seen_"))
    df = df[DECISION_COLUMNS + seen]
    df["time"] = pd.to_datetime(df["time"], unit="s", utc=True)
    return df.reset_index(drop=True)
