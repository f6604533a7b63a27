"""The client's one view of the cluster: what blockflow's scheduler plugin knows.

Runs in the user's process and reads the scheduler through a ``distributed.Client``.
Waiting is :mod:`blockflow.scheduling.wait`; placement arithmetic
:mod:`blockflow.scheduling.estimate`. Guide: :doc:`/guide/scheduling`.
"""

from __future__ import annotations

import datetime as _dt
import math
import numbers
import time
from dataclasses import dataclass
from statistics import median
from typing import Any, Iterable, Mapping

from distributed import Client

from blockflow._distributed.client import has_scheduler_plugin
from blockflow._distributed.metrics import CAPACITY_METRIC, clean_number, read_metrics
from blockflow.scheduling.actions import PROBE_PREFIX as _PROBE_PREFIX
from blockflow.scheduling.estimate import CONFIDENT, Throughput, confident_speeds

__all__ = [
    "epoch_seconds",
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
    "task_overheads",
    "worker_memory",
]


# -- times ---------------------------------------------------------------------------------

def epoch_seconds(value: Any, name: str = "since") -> float | None:
    """A time as seconds since the epoch, the one time type of decisions, reports and routes.

    Parameters
    ----------
    value : float, int, datetime.datetime (or pandas.Timestamp), or None
        Seconds since the epoch, or a datetime: one with a time zone is that instant, a naive
        one is local time (as :meth:`datetime.datetime.timestamp` reads it, also for a naive
        ``pandas.Timestamp``). None passes through.
    name : str, default "since"
        The argument's name, for the error message.

    Returns
    -------
    float or None

    Raises
    ------
    TypeError
        For anything else (a string, a bool, a date without a time).
    ValueError
        For a number that is not finite.
    """
    if value is None:
        return None
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:  # local time, whatever the class (pandas reads UTC)
            return _dt.datetime(*value.timetuple()[:6], value.microsecond).timestamp()
        return float(value.timestamp())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}= must be seconds since the epoch (time.time()) or a "
                        f"datetime, got {type(value).__name__} {value!r}.")
    if not math.isfinite(value):
        raise ValueError(f"{name}= must be a finite time, got {value!r}.")
    return float(value)


# -- the plugin's state --------------------------------------------------------------------

def plugin_status(client: Client, **kwargs: Any) -> dict[str, Any]:
    """State of blockflow's scheduler plugin, as plain data (``kwargs``: ``since``, ``task_log``,
    ``run``, see :meth:`blockflow.scheduling.Rebalancer.status`; ``since`` in seconds since
    the epoch or a datetime, :func:`epoch_seconds`).

    Raises
    ------
    RuntimeError
        If the scheduler runs no blockflow plugin.
    TypeError, ValueError
        For a ``since`` that is no time.
    """
    if "since" in kwargs:
        kwargs["since"] = epoch_seconds(kwargs["since"])
    if not _has_plugin(client):  # spares the scheduler an unknown-op error
        raise RuntimeError(
            "The scheduler runs no blockflow plugin: connect with blockflow.connect(...) or "
            "start the scheduler with `dask scheduler --preload blockflow.scheduling.preload`."
        )
    status = client.sync(client.scheduler.blockflow_status, **kwargs)
    return status


def throughput(client: Client, status: Mapping[str, Any] | None = None):
    """The throughput matrix as a DataFrame: seconds per task, task groups by pools
    (:func:`blockflow.pools.plan.throughput_matrix`); ``status``: a :func:`plugin_status` reply.

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
    """Worker address -> tasks finished since the plugin started (``kernels_only``: blockflow
    kernel tasks only).
    """
    status = plugin_status(client)
    return status["kernel_counts" if kernels_only else "task_counts"]


DECISION_COLUMNS = ["time", "policy", "action", "worker", "target", "key", "reason"]
SEEN_METRICS = ("gpu_utilization", "gpu_memory_fraction", "speed", "processing",
                "projected_finish")


def decisions(client: Client, since: Any = None):
    """The rebalancer's decision log after ``since`` as a pandas DataFrame, oldest first:
    columns :data:`DECISION_COLUMNS`, then ``seen_*``, the metrics each decision saw (None
    where unknown).

    Parameters
    ----------
    client : distributed.Client
    since : float or datetime, optional
        Seconds since the epoch or a datetime (:func:`epoch_seconds`).

    Returns
    -------
    pandas.DataFrame
        ``time`` in seconds since the epoch (float), as :func:`blockflow.run_report`'s
        ``since=`` and ``/blockflow/status.json`` take and give times.

    Raises
    ------
    RuntimeError
        If the scheduler runs no blockflow plugin.
    TypeError, ValueError
        For a ``since`` that is no time.
    """
    import pandas as pd

    since = epoch_seconds(since)
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
    df["time"] = df["time"].astype("float64")
    return df.reset_index(drop=True)



# -- learned speeds ------------------------------------------------------------------------

@dataclass(frozen=True)
class LearnedSpeeds:
    """The plugin's learned speeds (1.0 typical) and confidences (0-1)."""

    speeds: dict
    confidence: dict

    @property
    def known(self) -> dict[str, float]:
        """Speeds with confidence at least :data:`~blockflow.scheduling.estimate.CONFIDENT`."""
        return confident_speeds(self.speeds, self.confidence, CONFIDENT)

    def __bool__(self) -> bool:
        return bool(self.known)


def learned_speeds(client: Client, status: Mapping[str, Any] | None = None) -> LearnedSpeeds:
    """The plugin's :class:`LearnedSpeeds` (from ``status`` if given); empty without a plugin."""
    if status is None:
        try:
            status = plugin_status(client)
        except (RuntimeError, KeyError, OSError):  # no plugin, or the scheduler is gone
            status = {}
    return LearnedSpeeds(dict(status.get("speeds") or {}),
                         dict(status.get("speed_confidence") or {}))


def declared_speeds(client: Client, workers: Mapping[str, Mapping] | None = None
                    ) -> dict[str, float]:
    """Worker -> its ``blockflow-capacity`` metric over the median reported: nominal relative
    speeds, the prior before any timing. ``workers``: a :func:`workers_info` reply.
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

    typical = median(caps.values())
    return {a: c / typical for a, c in caps.items()}


# -- memory --------------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerMemory:
    """One worker's memory in bytes (None: not reported): ``host_total`` (``memory_limit``),
    ``host_used``, ``device_total``, ``device_used``.
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
        """``host_total - host_used``, or None without a limit."""
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
        """Free device memory on a GPU worker (its total if use is unknown), else free host memory,
        else ``math.inf``.
        """
        if self.has_device:
            return self.device_total if self.device_free is None else self.device_free
        host = self.host_free
        return math.inf if host is None else host

    @property
    def total(self) -> tuple[float, str] | None:
        """``(bytes, "device" or "host")``, or None when neither is known."""
        if self.has_device:
            return self.device_total, "device"
        if self.host_total:
            return self.host_total, "host"
        return None


def memory_of(info: Mapping[str, Any]) -> WorkerMemory:
    """A worker's :class:`WorkerMemory` from its :func:`workers_info` entry."""
    m = read_metrics(info.get("metrics"))
    return WorkerMemory(host_total=clean_number(info.get("memory_limit")) or None,
                        host_used=m.host_memory, device_total=m.gpu_memory_total,
                        device_used=m.gpu_memory_used)


def worker_memory(client: Client, workers: Mapping[str, Mapping] | None = None
                  ) -> dict[str, WorkerMemory]:
    """Worker address -> :class:`WorkerMemory` from its last heartbeat."""
    workers = workers_info(client) if workers is None else workers
    return {a: memory_of(info) for a, info in workers.items()}


# -- throughput ----------------------------------------------------------------------------

class ThroughputView:
    """The one throughput estimator, fed by timed calls, with the plugin's known speeds as prior
    (re-read every ``refresh`` seconds; ``client`` None: no prior). ``kwargs`` go to
    :class:`~blockflow.scheduling.estimate.Throughput`.
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
        """Use these speeds as the prior until the next read."""
        self._prior = dict(speeds)
        self._read = time.monotonic()

    def prior(self) -> dict[str, float]:
        """The plugin's known speeds (re-read every ``refresh`` seconds)."""
        now = time.monotonic()
        if self.client is not None and now - self._read >= self.refresh:
            self._read = now
            self._prior = learned_speeds(self.client).known
        return dict(self._prior)

    def seconds_per_unit(self, workers: Iterable[str]) -> dict[str, float]:
        """Seconds per unit of work of each worker (measured, else from the prior)."""
        return self.estimate.seconds_per_unit(workers, self.prior())


# -- per-task overhead ---------------------------------------------------------------------

#: Key prefix of the overhead probe's no-op tasks; the scheduler plugin leaves them out of
#: its runs, counts and billed time (:data:`blockflow.scheduling.actions.PROBE_PREFIX`).
PROBE_PREFIX = _PROBE_PREFIX
#: Run name the probe's tasks are counted under (its own run, of its own client).
PROBE_RUN = "blockflow overhead probe"
#: Seconds a worker's measured overhead is reused.
OVERHEAD_TTL = 600.0
#: No-op tasks per probe (``n``).
PROBE_TASKS = 16
#: Per-task overhead assumed for a worker no probe measured, seconds (Dask's documented
#: ~1 ms per task: https://docs.dask.org/en/stable/best-practices.html).
DEFAULT_OVERHEAD = 1e-3
#: Seconds a worker that did not answer the probe is not probed again (callers fall back).
PROBE_RETRY = 60.0
# (scheduler, worker) -> (seconds per task, or None: it did not answer; when)
_overheads: dict[tuple[str, str], tuple[float | None, float]] = {}


def _noop(i: int) -> None:
    return None


def task_overheads(client: Client, workers: Iterable[str], *, tasks: int | None = None,
                   timeout: str | float | None = None) -> dict[str, float]:
    """Measured per-task overhead of each worker, seconds per task (cached 10 minutes).

    Method (blockflow's): on each worker in turn, ``n`` no-op tasks pinned to it are timed
    against one (the faster of two), ``t0 = (wall_n - wall_1) / (n - 1)``: the marginal cost
    of a task through the scheduler and the worker, with the round trip left out (``wall_n /
    n`` if noise makes that difference no larger than 0). The tasks run from a
    short-lived client of their own, in their own run (:data:`PROBE_RUN`), under keys
    ``overhead-probe-*`` that blockflow's scheduler plugin leaves out of its runs, task
    counts, speeds and billed time, and are released before it returns.

    Parameters
    ----------
    client : distributed.Client
    workers : iterable of str
        Worker addresses.
    tasks : int, optional
        ``n``, at least 2; default :data:`PROBE_TASKS`.
    timeout : str or float, optional
        Seconds for all probes together; default ``blockflow.cluster.worker-call-timeout``.

    Returns
    -------
    dict
        Worker address -> seconds per task (> 0) for the workers measured now or within
        :data:`OVERHEAD_TTL`; a worker that did not answer in time (busy with other tasks,
        say) is left out, and not probed again for :data:`PROBE_RETRY` seconds (callers fall
        back on the others' figure, else :data:`DEFAULT_OVERHEAD`).
    """
    from dask.utils import parse_timedelta

    from blockflow import config

    now = time.monotonic()
    scheduler = client.scheduler.address
    out, todo = {}, []
    for w in workers:
        hit = _overheads.get((scheduler, w))
        if hit is None or now - hit[1] >= (OVERHEAD_TTL if hit[0] is not None else PROBE_RETRY):
            todo.append(w)
        elif hit[0] is not None:
            out[w] = hit[0]
    if not todo:
        return out
    n = max(2, int(tasks or PROBE_TASKS))
    limit = float(parse_timedelta(config.get("cluster.worker-call-timeout", timeout)))
    end = now + limit
    try:
        probe = Client(scheduler, security=client.security, set_as_default=False,
                       timeout=limit)
    except Exception:  # the scheduler is unreachable: nothing measured
        return out
    try:
        for w in todo:
            if time.monotonic() >= end:
                break
            t0 = _probe(probe, w, n, end)
            _overheads[(scheduler, w)] = (t0, time.monotonic())
            if t0 is not None:
                out[w] = t0
    finally:
        probe.close(timeout=limit)
    return out


def _probe(client: Client, worker: str, n: int, end: float) -> float | None:
    """One worker's ``t0`` (see :func:`task_overheads`), or None when it did not answer
    before ``end`` (monotonic seconds) or left."""
    import uuid

    from blockflow.scheduling.runs import run_scope
    from blockflow.scheduling.wait import gather_as_done

    token = uuid.uuid4().hex

    def wall(count: int, tag: str) -> float:
        start = time.perf_counter()
        with run_scope(PROBE_RUN):
            futures = [client.submit(_noop, i, key=f"{PROBE_PREFIX}-{tag}-{token}-{i}",
                                     workers=[worker], allow_other_workers=False,
                                     pure=False) for i in range(count)]
        try:
            gather_as_done(futures, alive=lambda: client.scheduler_info(n_workers=-1)[
                "workers"], needed=[worker], poll=0.2,
                deadline=max(end - time.monotonic(), 0.01))
        finally:
            client.cancel(futures)
        return time.perf_counter() - start

    try:
        wall(1, "warm")  # the function reaches the worker, its thread starts
        one = min(wall(1, "one"), wall(1, "again"))  # a hiccup in one would shrink t0
        many = wall(n, "many")
    except Exception:  # no answer in time, or the worker left
        return None
    t0 = (many - one) / (n - 1)
    return t0 if math.isfinite(t0) and t0 > 0 else max(many / n, 1e-6)


def scheduler_identity(client) -> dict[str, Any]:
    """The scheduler's identity with every worker, read from the scheduler (``client``
    synchronous).
    """
    return dict(client.sync(client.scheduler.identity, n_workers=-1))


def workers_info(client) -> dict[str, dict[str, Any]]:
    """Worker address -> the scheduler's info on it (see :func:`scheduler_identity`)."""
    return dict(scheduler_identity(client).get("workers") or {})
