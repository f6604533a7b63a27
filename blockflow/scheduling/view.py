"""The client's one view of the cluster: what blockflow's scheduler plugin knows.

Runs in the user's process and talks to the scheduler through a ``distributed.Client`` (no
scheduler object is touched here). Tuning, training, inference routing, parallelism and the
data kernels read the cluster through these functions rather than each their own:

- :func:`scheduler_identity`, :func:`workers_info`: the scheduler's identity read directly
  (never the client's shared copy, which its periodic refresh can empty).
- :func:`plugin_status`, :func:`decisions`, :func:`task_counts`: the plugin's state.
- :func:`learned_speeds`: the plugin's learned speeds with their confidence, under the one
  confidence rule (:data:`~blockflow.scheduling.estimate.CONFIDENT`).
- :func:`worker_memory` / :func:`memory_of`: per-worker host and device memory (total, used,
  free), built on the one metrics parser, :func:`~blockflow._distributed.metrics.read_metrics`.
- :func:`declared_speeds`: the devices' nominal relative speeds a fresh cluster already
  tells (the ``blockflow-capacity`` worker metric), the prior before any work is timed.
- :class:`ThroughputView`: the one throughput estimator
  (:class:`~blockflow.scheduling.estimate.Throughput`) with the plugin's speeds as its prior.

Waiting for futures while workers die is :mod:`blockflow.scheduling.wait`;
the placement arithmetic is :mod:`blockflow.scheduling.estimate` (pure, for scheduler-side
rules too).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from distributed import Client

from blockflow._distributed.metrics import CAPACITY_METRIC, clean_number, read_metrics
from blockflow._distributed.client import has_scheduler_plugin
from blockflow.scheduling.estimate import CONFIDENT, Throughput, confident_speeds

__all__ = [
    "scheduler_identity",
    "workers_info",
    "throughput",
    "LearnedSpeeds",
    "ThroughputView",
    "WorkerMemory",
    "decisions",
    "declared_speeds",
    "learned_speeds",
    "memory_of",
    "plugin_status",
    "task_counts",
    "worker_memory",
]


# -- the plugin's state --------------------------------------------------------------------

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
        ``speeds``, ``speed_confidence`` (read them with :func:`learned_speeds`), ``paused``,
        ``workers``, ``memory_peak`` (bytes), ``decisions``.

    Raises
    ------
    RuntimeError
        If the scheduler runs no blockflow plugin (connect with :func:`blockflow.connect`, or
        start the scheduler with ``--preload blockflow.scheduling.preload``).
    """
    if not _has_plugin(client):  # spares the scheduler an unknown-op error
        raise RuntimeError(
            "The scheduler runs no blockflow plugin: connect with blockflow.connect(...) or "
            "start the scheduler with `dask scheduler --preload blockflow.scheduling.preload`."
        )
    status = client.sync(client.scheduler.blockflow_status, **kwargs)
    return status


def throughput(client: Client, status: Mapping[str, Any] | None = None):
    """The throughput matrix: seconds per task of each task group on each pool.

    Learned by blockflow's speed model (warm tasks only) and read from the scheduler plugin
    (:func:`blockflow.pools.plan.throughput_matrix`, Gavel's matrix): a pool that ran
    a group shows the median over its workers; a pool that ran none of it shows the
    group's time elsewhere scaled by the pools' typical speeds (its ``speed`` hint).

    Parameters
    ----------
    client : distributed.Client
    status : dict, optional
        A :func:`plugin_status` already read.

    Returns
    -------
    pandas.DataFrame
        One row per task group (index ``group``), one column per pool (seconds per task),
        sorted; empty when nothing was measured yet.

    Raises
    ------
    RuntimeError
        If the scheduler runs no blockflow plugin.
    """
    import pandas as pd

    matrix = (status if status is not None else plugin_status(client)).get("throughput") or {}
    pools = sorted({p for row in matrix.values() for p in row})
    df = pd.DataFrame([[matrix[g].get(p) for p in pools] for g in sorted(matrix)],
                      index=pd.Index(sorted(matrix), name="group"),
                      columns=pd.Index(pools, name="pool"), dtype="float64")
    return df


def _has_plugin(client: Client) -> bool:
    from blockflow.scheduling.plugin import Rebalancer  # its registered name only

    return has_scheduler_plugin(client, Rebalancer.name)


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
SEEN_METRICS = ("gpu_utilization", "gpu_memory_fraction", "speed", "processing",
                "projected_finish")


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
        Columns ``time`` (UTC timestamp), ``policy``, ``action`` (the value of a
        :class:`~blockflow.scheduling.actions.Action`, a plain string: ``pause``,
        ``resume``, ``handover``, ``hold``, ``release``, ``move``, ``assign``, ``place``,
        ``speculate``, ``restrict``, ``admit``, ``fail``, ``balance``, ``defer``, ``keep``,
        ``wait``, ``backup``, ``memory-move``, ``join``, ``forget``; each documented there),
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
    # The metrics every pause/resume/move decision records, present even in an empty log
    # (so that code filtering on them works before the first decision); others as logged.
    seen = sorted({f"seen_{k}" for k in SEEN_METRICS}
                  | {c for c in df.columns if c.startswith("seen_")})
    for c in seen:
        if c not in df:
            df[c] = pd.Series(dtype="object")
    df = df[DECISION_COLUMNS + seen]
    df["time"] = pd.to_datetime(df["time"], unit="s", utc=True)
    return df.reset_index(drop=True)



# -- learned speeds ------------------------------------------------------------------------

@dataclass(frozen=True)
class LearnedSpeeds:
    """The scheduler plugin's learned speeds, with the one rule for which count as known.

    Attributes
    ----------
    speeds : dict of str to float
        Worker address to relative speed (1.0 typical, larger faster), shrunk towards 1.0 by
        what the plugin has not seen (see :mod:`blockflow.scheduling.speed`).
    confidence : dict of str to float
        Worker address to confidence 0-1.
    """

    speeds: dict
    confidence: dict

    @property
    def known(self) -> dict[str, float]:
        """Speeds with confidence at least :data:`~blockflow.scheduling.estimate.CONFIDENT`:
        the only ones blockflow's client-side code acts on (a speed below it is a guess)."""
        return confident_speeds(self.speeds, self.confidence, CONFIDENT)

    def __bool__(self) -> bool:
        return bool(self.known)


def learned_speeds(client: Client, status: Mapping[str, Any] | None = None) -> LearnedSpeeds:
    """The plugin's learned speeds and confidences; empty without a reachable plugin.

    Parameters
    ----------
    client : distributed.Client
    status : mapping, optional
        A :func:`plugin_status` reply already fetched (spares a round trip).

    Returns
    -------
    LearnedSpeeds
    """
    if status is None:
        try:
            status = plugin_status(client)
        except (RuntimeError, KeyError, OSError):  # no plugin, or the scheduler is gone
            status = {}
    return LearnedSpeeds(dict(status.get("speeds") or {}),
                         dict(status.get("speed_confidence") or {}))


def declared_speeds(client: Client, workers: Mapping[str, Mapping] | None = None
                    ) -> dict[str, float]:
    """The workers' nominal relative speeds, from what their devices declare.

    A worker whose device reports the ``blockflow-capacity`` metric (a GPU's SM cores x max
    SM clock, :mod:`blockflow.devices`; a simulated device's speed) gets its
    capacity over the median capacity of the workers that report one (1.0 typical, larger
    faster). This is what a fresh cluster tells before any work: a prior, below speeds
    measured on real work (:func:`learned_speeds`, :class:`ThroughputView`).

    Parameters
    ----------
    client : distributed.Client
    workers : mapping, optional
        :func:`~blockflow.scheduling.view.workers_info` already fetched.

    Returns
    -------
    dict of str to float
        Only the workers that report a capacity (none: empty).
    """
    workers = workers_info(client) if workers is None else workers
    caps = {}
    for a, info in workers.items():
        metrics = info.get("metrics")
        cap = clean_number(metrics.get(CAPACITY_METRIC)) if isinstance(metrics, Mapping) \
            else None
        if cap:
            caps[a] = cap
    if not caps:
        return {}
    from statistics import median

    typical = median(caps.values())
    return {a: c / typical for a, c in caps.items()}


# -- memory --------------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerMemory:
    """One worker's memory, bytes; None where the worker does not report it.

    Attributes
    ----------
    host_total : float or None
        The worker's ``memory_limit``.
    host_used : float or None
        Its process memory (the ``memory`` metric).
    device_total, device_used : float or None
        Device memory from its GPU metrics (NVML, or a simulated device).
    """

    host_total: float | None
    host_used: float | None
    device_total: float | None
    device_used: float | None

    @property
    def has_device(self) -> bool:
        """Whether the worker reports device memory."""
        return bool(self.device_total)

    @property
    def host_free(self) -> float | None:
        """``host_total - host_used`` (used unknown counts as 0), or None without a limit."""
        if not self.host_total:
            return None
        return max(self.host_total - (self.host_used or 0.0), 0.0)

    @property
    def device_free(self) -> float | None:
        """``device_total - device_used``, or None when either is unknown."""
        if not self.has_device or self.device_used is None:
            return None
        return max(self.device_total - self.device_used, 0.0)

    @property
    def free(self) -> float:
        """The memory blocks placed on this worker live in: free device memory on a GPU
        worker (its total while its use is unknown), else free host memory, else
        ``math.inf`` (nothing known)."""
        if self.has_device:
            return self.device_total if self.device_free is None else self.device_free
        host = self.host_free
        return math.inf if host is None else host

    @property
    def total(self) -> tuple[float, str] | None:
        """``(bytes, "device" or "host")``: device memory on a GPU worker, else the host
        limit; None when neither is known."""
        if self.has_device:
            return self.device_total, "device"
        if self.host_total:
            return self.host_total, "host"
        return None


def memory_of(info: Mapping[str, Any]) -> WorkerMemory:
    """A worker's memory from the scheduler's info on it (as :func:`workers_info` gives).

    Parameters
    ----------
    info : mapping
        With ``memory_limit`` and ``metrics``; anything missing or malformed is unknown.

    Returns
    -------
    WorkerMemory
    """
    m = read_metrics(info.get("metrics"))
    return WorkerMemory(host_total=clean_number(info.get("memory_limit")) or None,
                        host_used=m.host_memory, device_total=m.gpu_memory_total,
                        device_used=m.gpu_memory_used)


def worker_memory(client: Client, workers: Mapping[str, Mapping] | None = None
                  ) -> dict[str, WorkerMemory]:
    """Worker address to its memory, from the metrics of its last heartbeat.

    Parameters
    ----------
    client : distributed.Client
    workers : mapping, optional
        :func:`~blockflow.scheduling.view.workers_info` already fetched.

    Returns
    -------
    dict of str to WorkerMemory
    """
    workers = workers_info(client) if workers is None else workers
    return {a: memory_of(info) for a, info in workers.items()}


# -- throughput ----------------------------------------------------------------------------

class ThroughputView:
    """The one throughput estimator, fed by timed calls, with the plugin's speeds as prior.

    Seconds per unit of work per worker (:class:`~blockflow.scheduling.estimate.
    Throughput`: cold start dropped, a fixed cost per call, median of the warm calls);
    workers not yet measured get the plugin's speeds known with confidence
    (:func:`learned_speeds`), read at most every ``refresh`` seconds.

    Parameters
    ----------
    client : distributed.Client or None
        None: no prior (measurements only).
    refresh : float, default 1.0
        Seconds between reads of the plugin's speeds.
    **kwargs
        Passed to :class:`~blockflow.scheduling.estimate.Throughput`.
    """

    def __init__(self, client: Client | None, refresh: float = 1.0, **kwargs: Any):
        self.client, self.refresh = client, float(refresh)
        self.estimate = Throughput(**kwargs)
        self._prior: dict[str, float] = {}
        self._read = -math.inf

    def observe(self, worker: str, units: float, seconds: float) -> bool:
        """Record a call (see :meth:`Throughput.observe`)."""
        return self.estimate.observe(worker, units, seconds)

    def forget(self, worker: str) -> None:
        """Drop a worker's measurements."""
        self.estimate.forget(worker)

    def set_prior(self, speeds: Mapping[str, float]) -> None:
        """Use these speeds (known with confidence) as the prior until the next read."""
        self._prior = dict(speeds)
        self._read = time.monotonic()

    def prior(self) -> dict[str, float]:
        """The plugin's speeds known with confidence (re-read every ``refresh`` seconds)."""
        now = time.monotonic()
        if self.client is not None and now - self._read >= self.refresh:
            self._read = now
            self._prior = learned_speeds(self.client).known
        return dict(self._prior)

    def seconds_per_unit(self, workers: Iterable[str]) -> dict[str, float]:
        """Seconds per unit of work of each worker (measured, else from the prior)."""
        return self.estimate.seconds_per_unit(workers, self.prior())


def scheduler_identity(client) -> dict[str, Any]:
    """The scheduler's identity with every worker, as ``Client.scheduler_info(-1)`` gives it.

    Parameters
    ----------
    client : distributed.Client
        A synchronous client (in a worker thread, ``get_client()`` is one).

    Returns
    -------
    dict
        ``id``, ``address``, ``workers`` (address -> info dict with ``name``, ``nthreads``,
        ``memory_limit`` (bytes), ``metrics``, ``resources``, ...), and the scheduler's
        other identity fields.
    """
    return dict(client.sync(client.scheduler.identity, n_workers=-1))


def workers_info(client) -> dict[str, dict[str, Any]]:
    """Worker address -> the scheduler's info on that worker (see :func:`scheduler_identity`)."""
    return dict(scheduler_identity(client).get("workers") or {})
