"""Start an embedded cluster or connect to a running Dask scheduler, with blockflow's plugin.

See :func:`connect`; the client's view of the cluster (:mod:`blockflow.scheduling.view`) and its
waits (:mod:`blockflow.scheduling.wait`) are re-exported here."""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import dask.config
from dask.utils import parse_timedelta
from distributed import Client, LocalCluster, Security
from distributed.diagnostics.plugin import WorkerPlugin

from blockflow import _distributed, config
from blockflow._distributed.metrics import read_metrics
from blockflow.backends import GPU_INSTALL_HINT, GPUUnavailableError, gpu_device_count, has_package
from blockflow.cluster import handshake as _handshake
from blockflow.cluster import main_guard as _main_guard
from blockflow.device_pool import CuPyPool, GPUPoolError, gpu_cluster_kwargs
from blockflow.devices import DeviceMetrics
from blockflow.errors import BlockflowWarning, describe
from blockflow.pools.cluster import pools_from_settings
from blockflow.pools.pool import Pool, PoolMember, heartbeat_now
from blockflow.scheduling.extensions import scheduler_extensions
from blockflow.scheduling.plugin import Rebalancer
from blockflow.scheduling.policies import policy_error
from blockflow.scheduling.view import (  # noqa: F401  (re-exported: the public names)
    DECISION_COLUMNS,
    SEEN_METRICS,
    decisions,
    plugin_status,
    task_counts,
    workers_info,
)
from blockflow.scheduling.wait import (  # noqa: F401  (re-exported)
    add_worker_plugin,
    gather_results,
    run_each,
    wait_for,
)

__all__ = [
    "connect",
    "decisions",
    "gather_results",
    "gpu_status",
    "plugin_status",
    "task_counts",
    "wait_for",
]

logger = logging.getLogger(__name__)


def gpu_status() -> tuple[bool, list[str]]:
    """Whether this machine can start GPU workers (dask-cuda and a visible NVIDIA GPU).

    Returns
    -------
    (bool, list of str)
        ``(True, [])``, or False and each missing piece.
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
    security: Security | str | None = None,
    pools: Mapping[Pool, int] | None = None,
    **cluster_kwargs: Any,
) -> Client:
    """Connect to a Dask cluster (starting an embedded one if needed) and register blockflow.

    With no address: ``dask_cuda.LocalCUDACluster`` (one worker per GPU) when dask-cuda and a GPU
    are present, else ``distributed.LocalCluster``.

    Parameters
    ----------
    address : str, optional
        Scheduler address (``"tcp://host:8786"``). None starts an embedded cluster.
    gpu : bool or "auto", optional
        Embedded cluster only: ``"auto"``, True (require GPU workers) or False.
        Default ``blockflow.cluster.gpu``.
    n_workers : int, optional
        Embedded workers; default one per GPU, or distributed's default on CPU.
    threads_per_worker : int, optional
        Embedded cluster; GPU workers default to ``blockflow.cluster.gpu-threads-per-worker``
        (tasks in flight per GPU, each on its own CUDA stream), and set up the memory pool of
        ``blockflow.cluster.gpu-memory-pool`` (:func:`blockflow.device_pool.gpu_cluster_kwargs`).
    memory_limit : str or int, optional
        Host memory per worker (``"4GiB"`` or bytes).
    dashboard_address : str, optional
        Default ``blockflow.cluster.dashboard-address``.
    policy : str, optional
        Scheduler plugin policy; default ``blockflow.cluster.policy``. A running plugin keeps
        its policy (another one warns).
    timeout : str or float, optional
        Seconds to wait for the scheduler's handshake; default
        ``blockflow.cluster.connect-timeout``.
    security : distributed.Security or "temporary", optional
        TLS credentials; ``"temporary"`` (embedded only, needs ``cryptography``) makes
        self-signed ones. Default None: plain TCP.
    pools : mapping of blockflow.Pool to int, optional
        Embedded cluster only: workers per pool (:class:`blockflow.pools.pool.PoolMember`).
        Default the ``blockflow.pools`` setting
        (:func:`blockflow.pools.cluster.pools_from_settings`; none when empty).
    **cluster_kwargs
        Passed to ``LocalCluster`` / ``LocalCUDACluster``.

    Returns
    -------
    distributed.Client
        Set as default; ``client.shutdown()`` also stops an embedded cluster.

    Raises
    ------
    GPUUnavailableError
        ``gpu=True`` without a GPU or dask-cuda.
    blockflow.device_pool.GPUPoolError
        GPU workers whose memory pool cannot be set up (RMM asked but missing, a pool larger
        than the free device memory).
    OSError
        No Dask scheduler answers at ``address``; the message says what was found.
    ValueError
        Invalid ``pools``, ``policy``, ``gpu``, worker or thread counts, blockflow setting,
        ``security="temporary"`` with an address, or ``tls://`` without credentials.
    TypeError
        A non-string ``address`` or an invalid ``security``.
    ModuleNotFoundError
        ``security="temporary"`` without ``cryptography``.
    RuntimeError
        Workers could not start because the script calls ``connect()`` outside
        ``if __name__ == "__main__":`` (:mod:`blockflow.cluster.main_guard`).

    Warns
    -----
    BlockflowWarning
        Embedded cluster: the dashboard's port is taken (one line naming the port used
        instead). With an address: GPU workers without a ``GPU`` resource, or the reverse;
        a running plugin that keeps another policy.

    Notes
    -----
    An embedded cluster's workers take a terminal's Ctrl-C quietly
    (:class:`QuietInterrupt`), and its shutdown logs nothing about the data its workers
    take along (:class:`_ClosingClusterFilter`).
    """
    # A worker process importing a script that calls connect() at top level: end it now.
    _main_guard.exit_if_bootstrapping()
    config.validate()  # settings may have changed since import (dask.config.set, files)
    if address is not None and not isinstance(address, str):
        raise TypeError(
            f"blockflow.connect: address must be a scheduler address such as "
            f"'tcp://host:8786' (or None for an embedded cluster), got {describe(address)} "
            f"{address!r}."
        )
    for name, value in (("n_workers", n_workers), ("threads_per_worker", threads_per_worker)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise ValueError(
                f"blockflow.connect: {name} must be an integer >= 1 (or None for the "
                f"default), got {value!r}."
            )
    source = "pools="
    if pools is None and address is None:
        pools = pools_from_settings() or None  # the blockflow.pools setting
        source = "the blockflow.pools setting"
    pool_member, n_workers = _pool_members(pools, address, n_workers, source)
    plugin = Rebalancer(policy=policy)  # validates the policy before anything starts
    sec = _security(security, address)
    if address is not None:
        timeout_s = parse_timedelta(config.get("cluster.connect-timeout", timeout))
        _check_tls_credentials(address, sec)
        try:
            _handshake.probe_scheduler(address, timeout_s,
                                       (sec or Security()).get_connection_args("client"))
        except _handshake.ProbeError as e:
            raise OSError(f"blockflow.connect: {e}. {_probe_fix(e, address)}") from None
        # A scheduler answered: the client's own set-up (registration, scheduler info) gets
        # distributed's usual bound, not the fail-fast one, so a busy scheduler is no error.
        comm_timeout = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"))
        client = Client(address, timeout=max(timeout_s, comm_timeout), security=sec)
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
        cluster_args = dict(
            n_workers=config.get("cluster.n-workers", n_workers),
            threads_per_worker=config.get("cluster.threads-per-worker", threads_per_worker),
            memory_limit=memory_limit,
            dashboard_address=config.get("cluster.dashboard-address", dashboard_address),
            security=sec, **cluster_kwargs)
        pool_plugin = None
        if use_gpu:  # tasks in flight per GPU and the memory pool, before anything starts
            cluster_args["threads_per_worker"] = threads_per_worker
            cluster_args, pool_plugin = gpu_cluster_kwargs(cluster_args)
        with _main_guard.watch_children() as note:
            try:
                cluster = _start_local_cluster(use_gpu, **cluster_args)
            except Exception:
                if _main_guard.children_ran_main(note):
                    raise RuntimeError(_main_guard.MESSAGE) from None
                raise
        _quiet_on_purpose(cluster)
        client = Client(cluster)  # takes the cluster's security
        # its shutdown is ours: no worker logs its own close as a failed heartbeat, nor
        # a Ctrl-C that its parent (this process) takes
        add_worker_plugin(client, _distributed.QuietClose(), what="setting up the workers")
        add_worker_plugin(client, QuietInterrupt(), what="setting up the workers")
        if pool_plugin is not None:
            _set_up_pool(client, pool_plugin)
        if pool_member is not None:
            add_worker_plugin(client, pool_member, what="putting the workers in their pools")
            # the scheduler knows the pools at once
            run_each(client, heartbeat_now, what="the pools' heartbeat")
    try:
        _register_plugin(client, plugin)
        if address is not None and policy is not None:
            _warn_if_other_policy(client, plugin.policy_name)
    except BaseException:  # nothing connect started outlives its error
        cluster = None if address is not None else client.cluster
        client.close()
        if cluster is not None:
            cluster.close()
        raise
    if address is not None:
        _warn_undeclared_gpus(client)
    return client


def _pool_members(pools, address, n_workers, source: str = "pools="
                  ) -> tuple[PoolMember | None, int | None]:
    """The worker plugin putting the embedded workers in ``pools``, and their number; the
    ``blockflow.cluster.n-workers`` setting, when set, must agree."""
    if pools is None:
        return None, n_workers
    if address is not None:
        raise ValueError("blockflow.connect: pools= puts the workers of an embedded cluster "
                         "in pools; workers of a running cluster declare their own "
                         "(`dask worker --preload blockflow.pools.preload --pool NAME --price ...`).")
    items = list(pools.items()) if isinstance(pools, Mapping) else list(pools)
    names, members, i = set(), {}, 0
    for pool, n in items:
        if not isinstance(pool, Pool):
            raise TypeError(f"blockflow.connect: pools= maps blockflow.Pool to a number of "
                            f"workers, got a key {describe(pool)}.")
        if pool.name in names:
            raise ValueError(f"blockflow.connect: two pools are named {pool.name!r}; give "
                             f"each pool its own name.")
        names.add(pool.name)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"blockflow.connect: pool {pool.name!r} must have an integer "
                             f">= 1 of workers, got {n!r}.")
        for _ in range(n):
            members[str(i)] = pool
            i += 1
    if not members:
        raise ValueError("blockflow.connect: pools= is empty; give at least one pool.")
    if n_workers is not None and n_workers != i:
        raise ValueError(f"blockflow.connect: n_workers={n_workers} but {source} has {i} "
                         f"workers; leave n_workers out.")
    configured = config.get("cluster.n-workers") if n_workers is None else None
    if configured is not None and configured != i:
        raise ValueError(f"blockflow.connect: the setting blockflow.cluster.n-workers is "
                         f"{configured} but {source} has {i} workers; unset it (the pools' "
                         f"workers are the cluster's).")
    return PoolMember(members), i


def _warn_undeclared_gpus(client: Client) -> None:
    """Warn about GPU workers without a ``GPU`` resource and the reverse."""
    workers = workers_info(client)
    bare = sorted(a for a, w in workers.items() if read_metrics(w.get("metrics")).has_gpu
                  and not (w.get("resources") or {}).get("GPU"))
    if bare:
        shown = ", ".join(bare[:5]) + (f" and {len(bare) - 5} more" if len(bare) > 5 else "")
        msg = (f"blockflow.connect: {len(bare)} GPU worker{'s' if len(bare) != 1 else ''} of "
               f"the cluster at {client.scheduler.address} declare"
               f"{'s' if len(bare) == 1 else ''} no GPU resource ({shown}), so tasks asking "
               f"for resources={{'GPU': 1}} never run there; start GPU workers with "
               f"`--resources GPU=1` (one per device: `dask cuda worker <scheduler> "
               f"--resources GPU=1`).")
        logger.warning(msg)
        warnings.warn(msg, BlockflowWarning, stacklevel=3)
    # the other way round: a worker that declares a GPU it does not have gets the GPU
    # tasks, whose kernels then fail there (no device) or run on its CPU
    for a in sorted(a for a, w in workers.items()
                    if (w.get("resources") or {}).get("GPU")
                    and not read_metrics(w.get("metrics")).has_gpu):
        n = workers[a]["resources"]["GPU"]
        msg = (f"blockflow.connect: worker {a} of the cluster at {client.scheduler.address} "
               f"declares GPU={n:g} (resources) but reports no GPU (no device memory in its "
               f"metrics), so tasks asking for resources={{'GPU': 1}} are sent to a worker "
               f"without one; start it without `--resources GPU=...`, or on a machine "
               f"whose GPU it can see (CUDA_VISIBLE_DEVICES, the NVIDIA driver, "
               f"distributed.diagnostics.nvml: true).")
        logger.warning(msg)
        warnings.warn(msg, BlockflowWarning, stacklevel=3)


def _running_policy(dask_scheduler=None) -> str | None:
    plugin = _distributed.scheduler_plugin(dask_scheduler, Rebalancer.name)
    return getattr(plugin, "policy_name", None)


def _warn_if_other_policy(client: Client, asked: str) -> None:
    """Warn that a scheduler already running blockflow's plugin keeps its policy."""
    running = client.run_on_scheduler(_running_policy)
    if running is not None and running != asked:
        warnings.warn(
            f"blockflow.connect: the scheduler at {client.scheduler.address} already runs "
            f"blockflow's plugin with policy {running!r}, which it keeps: policy={asked!r} is "
            f"not applied, as other clients of that cluster rely on it. To change it, restart "
            f"the scheduler with DASK_BLOCKFLOW__CLUSTER__POLICY={asked} (or "
            f"blockflow.cluster.policy in its Dask config).",
            BlockflowWarning, stacklevel=3,
        )


_START_SCHEDULER = "`dask scheduler --preload blockflow.scheduling.preload`"
_WAIT_LONGER = ("to wait longer for a scheduler that is still starting, raise timeout= (CLI: "
                "--timeout; setting blockflow.cluster.connect-timeout)")


def _probe_fix(e: _handshake.ProbeError, address: str) -> str:
    """What to do about a failed look at ``address`` (the probe says what it found)."""
    plain = "tcp://" + address.split("://", 1)[-1]
    secure = "tls://" + address.split("://", 1)[-1]
    if e.kind == "refused":
        return (f"Start a scheduler there ({_START_SCHEDULER}) or check the address and "
                f"port; {_WAIT_LONGER}.")
    if e.kind == "unresolved":
        return "Check the host name in the address."
    if e.kind == "unreachable":
        return ("Check the address, that the host is up and that no firewall blocks the "
                f"port; {_WAIT_LONGER}.")
    if e.kind == "tls-server":
        return (f"Connect to {secure!r} with security=distributed.Security(...) holding "
                f"credentials that cluster trusts.")
    if e.kind == "not-dask":
        return ("Check the address and port: a Dask scheduler listens on its own port (8786 "
                "by default; 8787 is its dashboard, which speaks HTTP).")
    if e.kind in ("silent", "closed"):
        if address.startswith("tls://"):
            return "Check the address and port, and that the scheduler there is running."
        # asked too: it speaks neither HTTP nor TLS
        return "It is not a Dask scheduler: check the address and port."
    if e.kind == "not-tls":
        return (f"If it is a plain Dask scheduler, connect to {plain!r} without TLS "
                f"credentials; otherwise check the address and port, and that security= "
                f"holds credentials that cluster trusts.")
    if e.kind == "tls":
        return ("Check that security= holds the CA and client certificate that cluster "
                "trusts (distributed.Security(tls_ca_file=..., tls_client_cert=..., "
                "tls_client_key=...)).")
    if e.kind == "not-scheduler":
        return "Connect to the scheduler's address (the one its workers were started with)."
    return "Check the address and port."


def _security(security: Any, address: str | None) -> Security | None:
    if security is None:
        return None
    if isinstance(security, Security):
        return security
    if isinstance(security, str) and security == "temporary":
        if address is not None:
            raise ValueError(
                f"blockflow.connect: security='temporary' makes new self-signed credentials, "
                f"which only an embedded cluster can use; to connect to {address!r} pass "
                f"security=distributed.Security(...) with the credentials that cluster trusts."
            )
        if not has_package("cryptography"):
            raise ModuleNotFoundError(
                "blockflow.connect(security='temporary') needs the package 'cryptography' to "
                "make self-signed TLS credentials; install it with `pip install cryptography`."
            )
        return Security.temporary()
    raise TypeError(
        f"blockflow.connect: security must be a distributed.Security, 'temporary' or None, "
        f"got {describe(security)}."
    )


def _check_tls_credentials(address: str, security: Security | None) -> None:
    """A ``tls://`` address needs an SSL context: from ``security`` or the Dask config; a
    ``security`` that requires encryption needs a ``tls://`` address."""
    if not address.startswith("tls://"):
        if security is not None and security.require_encryption:
            scheme = f"a {address.split('://')[0]}://" if "://" in address else "a plain"
            raise ValueError(
                f"blockflow.connect: security= requires encryption, but {address!r} is "
                f"{scheme} address, which is not encrypted; connect to the scheduler's "
                f"tls:// address (the scheduler prints it), e.g. "
                f"{'tls://' + address.split('://')[-1]!r}."
            )
        return
    sec = security if security is not None else Security()
    if sec.get_connection_args("client").get("ssl_context") is None:
        raise ValueError(
            f"blockflow.connect: the scheduler at {address!r} talks TLS, but no credentials "
            f"were given; pass security=distributed.Security(tls_ca_file=..., "
            f"tls_client_cert=..., tls_client_key=..., require_encryption=True) with that "
            f"cluster's certificates, or set distributed.comm.tls.* in the Dask config."
        )


def _set_up_pool(client: Client, plugin: CuPyPool) -> None:
    """Install the GPU workers' memory pool; its error (one line) closes what connect
    started."""
    try:
        add_worker_plugin(client, plugin, what="setting up the GPU workers' memory pool")
    except GPUPoolError as e:
        cluster = client.cluster
        client.close()
        cluster.close()
        raise GPUPoolError(str(e)) from None


def _start_local_cluster(use_gpu: bool, **kwargs) -> LocalCluster:
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if use_gpu:
        from dask_cuda import LocalCUDACluster as start
        # one worker per device: each declares its GPU, for resources={"GPU": 1} tasks
        kwargs["resources"] = {"GPU": 1, **(kwargs.get("resources") or {})}
    else:
        start = LocalCluster
        kwargs.setdefault("processes", True)
    logger.info("blockflow: starting %s (%s)", start.__name__, kwargs)
    with warnings.catch_warnings(record=True) as caught:
        cluster = start(**kwargs)
    try:
        _rewarn(caught)
    except BaseException:  # warnings turned into errors: nothing connect started outlives it
        cluster.close()
        raise
    return cluster


def _rewarn(caught: list[warnings.WarningMessage]) -> None:
    """Warn again what the cluster's start warned; distributed's warning about a taken
    dashboard port (three lines, about distributed's own source line) as one line."""
    for w in caught:
        taken = _PORT_TAKEN.match(str(w.message))
        if taken is None:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno,
                                   source=w.source)
            continue
        msg = (f"blockflow.connect: the dashboard's port {taken[1]} is taken (another Dask "
               f"cluster on this machine?), so this cluster's dashboard is on port {taken[2]} "
               f"instead; choose one with dashboard_address= (setting "
               f"blockflow.cluster.dashboard-address, ':0' for any free port).")
        warnings.warn(msg, BlockflowWarning, stacklevel=4)  # the caller of connect()


#: distributed's warning (node.py) when the dashboard's port is taken: the port asked for,
#: and the one it took instead.
_PORT_TAKEN = re.compile(r"Port (\d+) is already in use\..*?on port (\d+) instead", re.S)


class QuietInterrupt(WorkerPlugin):
    """Worker plugin of the clusters :func:`connect` starts: a SIGINT (a terminal's Ctrl-C
    reaches every process of its group) does not interrupt the worker process with a
    ``KeyboardInterrupt`` traceback; it silences the worker's logs instead. The process
    that started the cluster takes the Ctrl-C and closes the workers (the command line:
    one line and exit status 130; a script: its ``KeyboardInterrupt``), and what a worker
    closed under a running task would log is not news then. Worker processes whose main
    thread runs the worker only (distributed's nanny); threads of this process keep
    Python's handling."""

    name = "blockflow-quiet-interrupt"

    def __init__(self):
        self.parent = os.getpid()  # the process that started the cluster keeps its handler

    def setup(self, worker) -> None:
        if (os.getpid() == self.parent
                or threading.current_thread() is not threading.main_thread()):
            return  # a worker in this process, or in threads of another's: theirs rules
        signal.signal(signal.SIGINT, _silence_logs)
        if hasattr(signal, "pthread_sigmask"):  # the command line starts workers with it
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked: take it


def _silence_logs(signum, frame) -> None:
    """A worker's SIGINT handler (:class:`QuietInterrupt`): from now on it logs nothing."""
    names = [n for n in list(logging.root.manager.loggerDict)
             if n.split(".")[0] in ("distributed", "tornado", "asyncio", "blockflow")]
    for name in ("distributed", "tornado", "asyncio", "blockflow", *names):
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)


class _ClosingClusterFilter(logging.Filter):
    """Drops distributed's records about the work and worker processes a cluster started
    by :func:`connect` loses while it is being closed on purpose (``client.shutdown()``,
    ``cluster.close()``, the end of the script): the scheduler's "Removing worker ...
    caused the cluster to lose ..." (a WARNING and an ERROR listing every key still held)
    and the nanny's "Worker process still alive after 4.0 seconds, killing". Only while
    such a cluster closes: the same records at any other time are real losses."""

    def __init__(self):
        super().__init__()
        self.clusters: weakref.WeakSet = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if not (msg.startswith("Worker process still alive after")
                or (msg.startswith("Removing worker ") and "caused the cluster to lose" in msg)):
            return True
        return not any(getattr(c.status, "name", None) in ("closing", "closed")
                       for c in list(self.clusters))


_closing_filter = _ClosingClusterFilter()


def _quiet_on_purpose(cluster) -> None:
    """Keep ``cluster``'s own shutdown from logging what it drops (:class:`_ClosingClusterFilter`)."""
    for name in ("distributed.scheduler", "distributed.nanny"):
        log = logging.getLogger(name)
        if _closing_filter not in log.filters:
            log.addFilter(_closing_filter)
    _closing_filter.clusters.add(cluster)


def _register_plugin(client: Client, plugin: Rebalancer) -> None:
    try:
        if "." in plugin.policy_name:  # a dotted path: importable where the scheduler runs?
            error = client.run_on_scheduler(policy_error, plugin.policy_name)
            if error:
                raise ValueError(f"blockflow.connect: {error}")
        client.register_plugin(plugin)
        for extension in scheduler_extensions():  # blockflow.scheduler.extensions
            client.register_plugin(extension)
        # adds nothing on workers without a GPU; a worker that does not answer is named
        add_worker_plugin(client, DeviceMetrics(), what="blockflow's device metrics")
    except (ModuleNotFoundError, ImportError) as e:
        raise RuntimeError(
            f"blockflow.connect: the scheduler at {client.scheduler.address} cannot load "
            f"blockflow's scheduler plugin ({e}). Install blockflow where the scheduler runs, "
            f"or start it with `dask scheduler --preload blockflow.scheduling.preload`."
        ) from e
