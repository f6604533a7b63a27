"""The client's one view of the cluster: what blockflow's scheduler plugin knows, and how to wait.

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
- :func:`wait_for`, :func:`gather_results`, :func:`wait_any`, :func:`fetch` and
  :func:`gather_as_done`: waiting for futures while workers die, with distributed's
  ``Future.result(timeout=)`` race handled in one place (:func:`fetch`).

The placement arithmetic is in :mod:`blockflow.scheduling.estimate` (pure, for scheduler-side
rules too).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from dask.utils import parse_timedelta
from distributed import Client

from blockflow import config
from blockflow._distributed.metrics import CAPACITY_METRIC, clean_number, read_metrics
from blockflow._distributed.client import has_scheduler_plugin
from blockflow.errors import WorkerLostError
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
    "fetch",
    "fetch_many",
    "gather_as_done",
    "gather_results",
    "learned_speeds",
    "lost_roles",
    "memory_of",
    "plugin_status",
    "task_counts",
    "task_label",
    "wait_any",
    "wait_for",
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
        Columns ``time`` (UTC timestamp), ``policy``, ``action`` (a plain string: the value
        of a command, :class:`~blockflow.scheduling.actions.Action`, or of a record,
        :class:`~blockflow.scheduling.actions.Recorded`; each documented there),
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


# -- waiting while workers die -------------------------------------------------------------

def wait_for(client: Client, futures: Any, *, what: str = "the computation",
             worker_loss_timeout: str | float | None = None) -> None:
    """Wait until ``futures`` are done (finished or failed), failing if every worker is lost.

    Like :func:`distributed.wait`, except that a cluster left without any worker does not
    make it wait forever: tasks cannot run then, so after ``worker_loss_timeout`` without a
    worker it raises. Workers that come back (a nanny restarting a killed worker process, an
    autoscaler) reset the clock.

    Parameters
    ----------
    client : distributed.Client
    futures : future, collection of futures, or persisted Dask collection
    what : str, default "the computation"
        Named in the error message (e.g. ``"the flights ETL"``).
    worker_loss_timeout : str or float, optional
        Seconds (or ``"60s"``) without any worker before giving up; default
        ``blockflow.cluster.worker-loss-timeout``.

    Raises
    ------
    WorkerLostError
        If the cluster has had no worker for ``worker_loss_timeout`` while results were
        unfinished.
    """
    from distributed import futures_of

    pending = futures_of(futures)
    n = len(pending)
    futures = None  # a traceback keeps this frame: it must not keep the results alive
    limit = parse_timedelta(config.get("cluster.worker-loss-timeout", worker_loss_timeout))
    check_every = min(0.5, max(limit / 4, 0.05))
    checked = time.monotonic()
    lost_since = None
    # Polls Future.done() (local state) rather than distributed.wait(timeout=): a timed-out
    # wait leaves the futures referenced by its traceback until the garbage collector runs,
    # which keeps finished results on the workers for longer.
    while True:
        if any(f.status in ("error", "cancelled") for f in pending):
            return  # the caller's gather raises it: no need to wait for the rest
        pending = [f for f in pending if not f.done()]
        if not pending:
            return
        time.sleep(0.02)
        now = time.monotonic()
        if now - checked < check_every:
            continue
        checked = now
        if client.nthreads():
            lost_since = None
            continue
        lost_since = now if lost_since is None else lost_since
        if now - lost_since >= limit:
            left = len([f for f in pending if not f.done()])
            pending = None
            raise WorkerLostError(
                f"blockflow: every worker of the cluster at {client.scheduler.address} was "
                f"lost during {what}; with no worker for {limit:g} s, {left} of {n} "
                f"results could not be computed. Restart the workers (or the cluster) and run "
                f"again. Workers that keep dying usually run out of memory or crash: their "
                f"logs say which; give them more memory (memory_limit=) or use smaller blocks. "
                f"(blockflow.cluster.worker-loss-timeout sets how long to wait.)"
            )


def gather_results(client: Client, futures: Any, *, what: str = "the computation",
                   worker_loss_timeout: str | float | None = None) -> Any:
    """:func:`wait_for` the futures, then gather their results; worker deaths explained.

    Parameters
    ----------
    client : distributed.Client
    futures : future or collection of futures
        As for :meth:`distributed.Client.gather`.
    what : str, default "the computation"
        Named in error messages.
    worker_loss_timeout : str or float, optional
        See :func:`wait_for`.

    Returns
    -------
    object
        What ``client.gather(futures)`` returns.

    Raises
    ------
    WorkerLostError
        If every worker was lost (see :func:`wait_for`), or in place of distributed's
        ``KilledWorker`` (a task whose workers died ``allowed-failures + 1`` times); the
        original is chained as ``__cause__``.
    Exception
        A task's own exception, as ``client.gather`` raises it.
    """
    from distributed import KilledWorker

    wait_for(client, futures, what=what, worker_loss_timeout=worker_loss_timeout)
    try:
        return client.gather(futures)
    except KilledWorker as e:
        futures = None  # the traceback keeps this frame: don't keep the results alive
        last = getattr(e.last_worker, "address", e.last_worker)
        n = e.allowed_failures + 1
        raise WorkerLostError(
            f"blockflow: {what} failed because workers died while running "
            f"{task_label(e.task)}: "
            f"the worker running it died {n} time{'s' if n != 1 else ''} (the last one was "
            f"{last}), so Dask gave up on it (KilledWorker). A task that kills its worker usually runs "
            f"it out of memory or crashes native code: check the worker logs, give workers "
            f"more memory (memory_limit=) or use smaller blocks; if the deaths had nothing to "
            f"do with the task, raise distributed.scheduler.allowed-failures and run again."
        ) from e


def task_label(key) -> str:
    """A task key as messages name it: the step (the key's name without its token) and,
    for a block's task, the block index: ``"block (3,) of step 'blockflow-clean'"`` for
    ``('blockflow-clean-1f3a...', 3)``; never the token."""
    from dask.utils import key_split

    name = key_split(key)
    if isinstance(key, tuple) and len(key) > 1:
        return f"block {tuple(key[1:])} of step {name!r}"
    return f"step {name!r}"


def fetch(future, *, timeout: float = 10.0, deadline: float | None = None) -> Any:
    """The result of a finished future; raises if it was lost before it came back.

    ``Future.result(timeout=)`` runs distributed's ``sync()`` with a callback timeout: it
    blocks while the client re-schedules a result it could not gather (its worker was killed
    between the task's end and the fetch), and a timeout racing the result's arrival can end
    with neither a result nor an error (``UnboundLocalError``). This handles both: it asks
    again while the future is still finished, and gives up once it is not (a task pinned to
    a lost worker would never run again) or after ``deadline`` seconds.

    Parameters
    ----------
    future : distributed.Future
    timeout : float, default 10.0
        Seconds per ask.
    deadline : float, optional
        Seconds in all before giving up (default: no bound while the future stays finished).

    Returns
    -------
    object
        The future's result.

    Raises
    ------
    WorkerLostError
        If the result was lost before it was fetched, or the deadline passed; ``lost`` names
        the future's key.
    Exception
        The task's own exception, as ``Future.result`` raises it.
    """
    end = None if deadline is None else time.monotonic() + deadline
    while True:
        try:
            return future.result(timeout=timeout)
        except (TimeoutError, UnboundLocalError):
            pass
        if future.status != "finished" or (end is not None and time.monotonic() >= end):
            raise WorkerLostError(
                f"blockflow: the result of {future.key!r} was lost before it could be "
                f"fetched (status {future.status!r}): the worker holding it left.",
                lost=[str(future.key)])


def lost_roles(client: Client, what: str, roles: Mapping[str, str], fix: str,
               *, settle: float = 2.0) -> WorkerLostError | None:
    """The error for a computation whose workers left: what each lost worker held.

    Code that pins work to workers (a pipeline's stages, tensor-parallel shards) calls this
    when a wait fails, so that the user reads which stage or shard on which worker was
    lost, not distributed's internal keys (``pipeline-collect-...``, ``KeyError:
    'tcp://...'``).

    Parameters
    ----------
    client : distributed.Client
    what : str
        The computation (``"the pipeline pass over rows 0-511 (8 micro-batches)"``).
    roles : mapping of str to str
        Worker address to what it held (``"stage 1 (layers 2-3)"``).
    fix : str
        What to do about it.
    settle : float, default 2.0
        Seconds to wait for the scheduler to notice a worker that died just now.

    Returns
    -------
    WorkerLostError or None
        With ``lost`` the workers gone; None when every worker of ``roles`` is alive (the
        failure was something else: re-raise it).
    """
    end = time.monotonic() + settle
    while True:
        alive = set(workers_info(client))
        gone = sorted(a for a in roles if a not in alive)
        if gone or time.monotonic() >= end:
            break
        time.sleep(0.1)
    if not gone:
        return None
    held = "; ".join(f"{roles[a]} on worker {a}" for a in gone)
    return WorkerLostError(
        f"blockflow: {what} failed: lost {held}, which left the cluster; {fix}", lost=gone)


def fetch_many(futures, *, timeout: float = 10.0) -> list:
    """The results of several finished futures in one request (one round trip, not one
    per future, where results come back at a high rate).

    The gather runs on the client's event loop under ``timeout`` (never an unbounded
    ``Client.gather``: a result lost with its worker would be waited for). Any failure
    (a lost result, the timeout, a task's own exception) raises; the caller falls back on
    :func:`fetch` for each future to tell which.

    Parameters
    ----------
    futures : list of distributed.Future
        Finished futures of one client.
    timeout : float, default 10.0
        Seconds for the whole gather.

    Returns
    -------
    list
        The results, in the order of ``futures``.

    Raises
    ------
    Exception
        Whatever stopped the gather (``TimeoutError`` on the timeout).
    """
    import asyncio

    futures = list(futures)
    if not futures:
        return []
    client = futures[0].client

    async def gather():
        return await asyncio.wait_for(client.gather(futures, asynchronous=True), timeout)

    return list(client.sync(gather))


def wait_any(futures: Iterable, timeout: float = 1.0) -> list:
    """The futures of ``futures`` that are done, waiting up to ``timeout`` for the first.

    Parameters
    ----------
    futures : iterable of distributed.Future
    timeout : float, default 1.0

    Returns
    -------
    list
        Done futures (empty when none finished in time).
    """
    from distributed import TimeoutError as DTimeout
    from distributed import wait

    futures = list(futures)
    if not futures:
        return []
    try:
        done, _ = wait(futures, timeout=timeout, return_when="FIRST_COMPLETED")
    except (DTimeout, TimeoutError):
        return []
    return [f for f in futures if f in done]


def gather_as_done(futures: Iterable, *, alive: Callable[[], Iterable[str]],
                   needed: Iterable[str] = (), poll: float = 0.5,
                   get: Callable[[Any], Any] | None = None,
                   deadline: float | None = None) -> list:
    """Every future's result, fetched as soon as it is done; fails fast on a lost worker.

    Waits with :func:`wait_any`, then fetches (never ``Future.result(timeout=)``, see
    :func:`fetch`). A result whose fetch fails, or a wait that times out, checks the workers:
    when one of ``needed`` is no longer ``alive`` (distributed would recompute or raise, but
    results pinned to it never come), it raises.

    Parameters
    ----------
    futures : iterable of distributed.Future
    alive : callable
        Returns the addresses of the workers alive now.
    needed : iterable of str
        The workers the futures need (those holding their inputs).
    poll : float, default 0.5
        Seconds between checks of the workers while nothing finishes.
    get : callable, optional
        Fetches one done future (default: ``future.result()``).
    deadline : float, optional
        Seconds in all before giving up on the results still to come (default: no bound).

    Returns
    -------
    list
        The results, in the order they finished.

    Raises
    ------
    WorkerLostError
        When workers of ``needed`` left; ``lost`` names them.
    TimeoutError
        When ``deadline`` passed with results still to come and no needed worker lost.
    Exception
        A task's own exception, when no needed worker was lost.
    """
    from asyncio import CancelledError

    needed = set(needed)
    get = get or (lambda f: f.result())
    pending, got = list(futures), []
    end = None if deadline is None else time.monotonic() + deadline

    def check() -> None:
        lost = needed - set(alive())
        if lost:
            raise WorkerLostError(f"blockflow: workers lost: {sorted(lost)}", lost=lost)

    while pending:
        try:
            # a future cancelled for "lost dependencies" raises in the wait as in the fetch
            done = wait_any(pending, timeout=poll)
            for f in done:
                got.append(get(f))
                pending.remove(f)
        except CancelledError:  # "lost dependencies": a worker died under the computation
            raise WorkerLostError(f"blockflow: workers lost: "
                                  f"{sorted(needed - set(alive()))}",
                                  lost=needed - set(alive())) from None
        except WorkerLostError:
            raise
        except Exception:
            check()
            raise
        if not done:
            check()
            if end is not None and time.monotonic() >= end:
                raise TimeoutError(f"blockflow: {len(pending)} results not back within "
                                   f"{deadline:g} s: {[str(f.key) for f in pending[:5]]}")
    return got

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
