"""Request routing: send each inference request to the worker that will answer it first.

:class:`Router` keeps a model loaded on every worker (shipped once, as :func:`blockflow.predict`
does) and dispatches each request batch, as one task pinned to one worker, to the worker whose
**speed-normalised projected finish** is earliest:

    finish(w) = (backlog(w) / threads(w) + cost) x seconds_per_unit(w)

``backlog`` is the cost (rows, by default) of the requests already routed to ``w`` and not yet
answered; ``seconds_per_unit`` is measured from the compute time of ``w``'s own answers by
blockflow's one throughput estimator (:class:`~blockflow.scheduling.estimate.Throughput`: the
median of its last ``WINDOW`` answers after the first, with a fixed cost per answer; a first
answer pays for loading the model and warming up, so it counts only while no worker has a
warm one), and before any answer from ``w`` it is the measured workers' seconds scaled by
blockflow's learned speeds known with confidence (:func:`~blockflow.scheduling.client.
learned_speeds`) where the scheduler plugin runs. The finish is placed by
:func:`~blockflow.scheduling.estimate.earliest_finish`. This is join-the-shortest-expected-delay (blockflow heuristic after Whitt 1986), which
beats round-robin and power-of-two-choices when devices differ in speed.

Workers that are paused (by blockflow's plugin or by distributed) or whose device memory is
nearly full (``blockflow.routing.memory-full``) get no new requests while another worker can
take them. A lost worker's unanswered requests are routed again to the others; each request
is answered exactly once (a late duplicate answer is dropped and counted).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from dask.utils import parse_timedelta

from blockflow import config
from blockflow.cluster.identity import workers_info
from blockflow.ml.inference import ModelRef, ship_model
from blockflow._distributed.metrics import read_metrics
from blockflow.scheduling.client import fetch, learned_speeds, plugin_status
from blockflow.scheduling.estimate import Throughput, earliest_finish

__all__ = ["Router"]

logger = logging.getLogger(__name__)

#: Warm answers per worker whose median is its seconds per unit (a short window: a worker
#: that slows down is seen after half of it).
WINDOW = 8

#: Seconds between reads of blockflow's plugin (learned speeds, paused workers).
PLUGIN_REFRESH = 1.0


def _answer(ref: ModelRef, batch):
    """The task of one request: run the model on the batch, time the compute."""
    from distributed import get_worker

    loaded, _ = ref.resolve()
    with loaded.lock:
        start = time.perf_counter()
        out = loaded(batch)
        elapsed = time.perf_counter() - start
    return out, elapsed, get_worker().address


@dataclass
class _Request:
    id: int
    batch: Any
    cost: float
    submitted: float
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    worker: str | None = None
    attempt: int = 0
    task: Any = None  # the distributed Future of the current attempt
    answered_by: str | None = None
    answered: float | None = None
    workers_by_attempt: dict = field(default_factory=dict)


class Router:
    """Route inference request batches to the worker that will answer first.

    Parameters
    ----------
    client : distributed.Client
        The cluster (its workers all get the model once).
    model : torch.nn.Module, ONNX model, estimator or callable
        As in :func:`blockflow.predict`.
    method : str, optional
        Estimators: ``"predict"`` (default), ``"predict_proba"``...
    interval : str or float, optional
        How often worker state is refreshed and lost workers' requests routed again
        (seconds or ``"200ms"``); default config ``blockflow.routing.interval``.
    memory_full : float, optional
        Device-memory fraction (0-1) at or above which a worker gets no new requests;
        default config ``blockflow.routing.memory-full``.
    depth : int, optional
        At most this many requests per worker thread in flight; the rest wait in the
        router and go to the worker whose projected finish is earliest when one frees up
        (late binding: useful while speeds are unknown, costly where the answer's round
        trip is slow). Default None: every request is routed when it arrives.

    Examples
    --------
    >>> with blockflow.routing.Router(client, model) as router:  # doctest: +SKIP
    ...     answers = [f.result() for f in router.map(batches)]
    """

    def __init__(self, client, model, *, method: str | None = None, interval=None,
                 memory_full: float | None = None, depth: int | None = None):
        self.client = client
        # a model given here is shipped here and freed by close(); a ModelRef stays the
        # caller's to close
        self._owns_ref = not isinstance(model, ModelRef)
        self.ref = model if isinstance(model, ModelRef) else ship_model(
            model, method=method, client=client, entry="blockflow.Router")
        self.interval = parse_timedelta(config.get("routing.interval", interval))
        self.memory_full = float(config.get("routing.memory-full", memory_full))
        if depth is not None and (isinstance(depth, bool) or int(depth) < 1):
            raise ValueError(f"blockflow: Router depth must be None or >= 1 request per "
                             f"thread, got {depth!r}.")
        self.depth = None if depth is None else int(depth)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._requests: dict[int, _Request] = {}  # unanswered
        self._waiting: deque[_Request] = deque()  # no usable worker yet
        self._backlog: Counter = Counter()
        self._inflight: Counter = Counter()  # tasks routed to each worker, not yet back
        # seconds per cost unit from the answers' compute times; a worker's first answer
        # pays for loading the model and warming up: kept apart, trusted only while no
        # worker has a warm answer (cold starts are discounted)
        self._throughput = Throughput(window=WINDOW)
        self._workers: dict[str, dict] = {}
        self._speeds: dict[str, float] = {}  # learned, known with confidence
        self._excluded: dict[str, str] = {}  # worker -> why it gets no new requests
        self._events: queue.Queue = queue.Queue()
        self.counts = Counter()  # submitted, answered, rerouted, duplicates, failed
        self.answered_by: Counter = Counter()
        self.decisions: deque = deque(maxlen=10_000)
        self._closed = False
        self._plugin_view: tuple[dict, dict] = ({}, {})
        self._plugin_due = 0.0
        self._missing: set[str] = set()
        self._fetcher = concurrent.futures.ThreadPoolExecutor(
            4, thread_name_prefix="blockflow-router-fetch")
        self._refresh()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="blockflow-router",
                                        daemon=True)
        self._watcher = threading.Thread(target=self._watch, name="blockflow-router-watch",
                                         daemon=True)
        self._thread.start()
        self._watcher.start()

    # -- public API ------------------------------------------------------------------

    def submit(self, batch, *, cost: float | None = None) -> concurrent.futures.Future:
        """Route one request batch.

        Parameters
        ----------
        batch : array
            The rows to predict (NumPy/CuPy array, what the model takes).
        cost : float, optional
            Its work in any unit proportional to compute time; default its number of rows.

        Returns
        -------
        concurrent.futures.Future
            Resolves to the model's output for ``batch``, exactly once.
        """
        if self._closed:
            raise RuntimeError("blockflow: this Router is closed; make a new one.")
        cost = float(len(batch) if cost is None else cost)
        req = _Request(next(self._ids), batch, cost, time.perf_counter())
        with self._lock:
            self._requests[req.id] = req
            self.counts["submitted"] += 1
            if self._waiting:  # first come, first served
                self._waiting.append(req)
            else:
                self._dispatch(req)
        return req.future

    def map(self, batches, *, costs=None) -> list[concurrent.futures.Future]:
        """:meth:`submit` each batch; the futures in the same order."""
        costs = [None] * len(batches) if costs is None else costs
        return [self.submit(b, cost=c) for b, c in zip(batches, costs)]

    def stats(self) -> dict[str, Any]:
        """Plain data: ``counts`` (submitted, answered, rerouted, duplicates, failed),
        ``answered_by`` (worker -> answers), ``seconds_per_unit`` (measured, per worker:
        from its warm answers, or its first answer while it has only that one),
        ``excluded`` (worker -> why it gets no new requests), ``pending``."""
        with self._lock:
            return {"counts": dict(self.counts), "answered_by": dict(self.answered_by),
                    "seconds_per_unit": self._throughput.observed_seconds_per_unit(),
                    "excluded": dict(self._excluded), "pending": len(self._requests)}

    def close(self) -> None:
        """Stop routing; unanswered requests are cancelled, and the model this Router
        shipped leaves the workers (a :class:`~blockflow.ml.inference.ModelRef` passed in
        stays open: close it yourself)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._events.put(None)
        self._thread.join(timeout=10)
        self._watcher.join(timeout=10)
        self._fetcher.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for req in list(self._requests.values()):
                if req.task is not None:
                    req.task.cancel()
                req.future.cancel()
            self._requests.clear()
        if self._owns_ref:
            self.ref.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- choosing a worker -----------------------------------------------------------------

    def _threads(self, w: str) -> int:
        return max(int(self._workers[w].get("nthreads") or 1), 1)

    def _choose(self, cost: float) -> tuple[str | None, dict]:
        alive = list(self._workers)
        usable = [w for w in alive if w not in self._excluded] or alive
        if not usable:
            return None, {}
        spu = self._throughput.seconds_per_unit(alive, self._speeds)
        ready = {w: self._backlog[w] / self._threads(w) * spu[w] for w in usable}
        finish = {w: ready[w] + cost * spu[w] for w in usable}
        best = earliest_finish(1, ready, spu, units=[cost],
                               tie=lambda w, _: (self._backlog[w], w))[0]
        return best.worker, finish

    def _full(self, w: str) -> bool:
        return self.depth is not None and self._inflight[w] >= self.depth * self._threads(w)

    def _dispatch(self, req: _Request, *, front: bool = False) -> None:  # under self._lock
        worker, finish = self._choose(req.cost)
        if worker is None or self._full(worker):
            # Late binding: the earliest-finishing worker has ``depth`` requests per thread
            # already; the request waits here (not in a worker's queue) until a worker
            # frees up, so a burst is not committed on estimates made before any answer.
            (self._waiting.appendleft if front else self._waiting.append)(req)
            return
        self._inflight[worker] += 1
        req.attempt += 1
        req.worker = worker
        req.workers_by_attempt[req.attempt] = worker
        self._backlog[worker] += req.cost
        key = f"blockflow-request-{self.ref.token[:8]}-{req.id}-{req.attempt}"
        task = self.client.submit(_answer, self.ref, req.batch, key=key, workers=[worker],
                                  allow_other_workers=False, pure=False)
        req.task = task
        attempt = req.attempt
        task.add_done_callback(lambda f, r=req, a=attempt: self._events.put((r, a, f)))
        self.decisions.append({
            "time": time.time(), "action": "route" if attempt == 1 else "reroute",
            "request": req.id, "worker": worker,
            "reason": "earliest speed-normalised projected finish",
            "projected_finish": {w: round(v, 6) for w, v in finish.items()},
            "excluded": dict(self._excluded)})

    # -- the router's thread: answers, worker state, lost workers ---------------------------

    def _loop(self) -> None:
        """The routing thread: answers in, waiting requests out (never blocked by RPCs)."""
        while True:
            event = self._events.get()
            if event is None:
                return
            try:
                self._finished(*event)
            except Exception:  # never let the router's thread die: requests would hang
                logger.exception("blockflow router: error while routing")

    def _watch(self) -> None:
        """The refresh thread: worker state from the scheduler (its RPCs take 0.1-0.3 s on
        a loaded machine, so they run beside the routing thread, not in it)."""
        while not self._stop.wait(self.interval):
            try:
                self._refresh()
            except Exception:
                if not self._closed:
                    logger.exception("blockflow router: error while refreshing worker state")

    def _finished(self, req: _Request, attempt: int, task) -> None:
        with self._lock:  # the attempt's work is over: release what it held
            worker = req.workers_by_attempt.pop(attempt, None)
            if worker is not None:
                if self._inflight.get(worker, 0) > 0:
                    self._inflight[worker] -= 1
                if self._backlog.get(worker, 0) > 0:
                    self._backlog[worker] = max(self._backlog[worker] - req.cost, 0.0)
        try:
            self._settle(req, attempt, task)
        finally:
            with self._lock:
                self._drain()

    def _drain(self) -> None:  # under self._lock: send waiting requests to free workers
        for _ in range(len(self._waiting)):
            req = self._waiting.popleft()
            before = len(self._waiting)
            self._dispatch(req, front=True)
            if len(self._waiting) > before:  # it waits again: so would those behind it
                break

    def _settle(self, req: _Request, attempt: int, task) -> None:
        status = task.status
        if status == "finished":  # fetch the answer off the routing thread
            self._fetcher.submit(self._fetch, req, attempt, task)
            return
        self._failed(req, attempt, task, status)

    def _fetch(self, req: _Request, attempt: int, task) -> None:
        try:
            out, elapsed, worker = fetch(task, timeout=30, deadline=30)
        except Exception as e:  # lost between finishing and fetching: route again
            logger.info("blockflow router: request %s result lost (%s)", req.id, e)
            with self._lock:
                if not req.future.done() and attempt == req.attempt:
                    self.counts["rerouted"] += 1
                    self._dispatch(req)
            return
        try:
            with self._lock:
                if req.future.done():
                    self.counts["duplicates"] += 1
                    return
                if attempt != req.attempt and req.task is not None:
                    req.task.cancel()  # an earlier attempt answered first
                req.answered_by, req.answered = worker, time.perf_counter()
                self._requests.pop(req.id, None)
                self.counts["answered"] += 1
                self.answered_by[worker] += 1
                if req.cost > 0:
                    self._throughput.observe(worker, req.cost, elapsed)
            req.future.set_result(out)
        except Exception:  # never lose an answer to a bookkeeping error
            logger.exception("blockflow router: error while answering request %s", req.id)

    def _failed(self, req: _Request, attempt: int, task, status: str) -> None:
        if status == "cancelled" or attempt != req.attempt:
            return  # an attempt we replaced, or the client is closing
        exc = task.exception(timeout=30)
        if _worker_lost(exc):
            with self._lock:
                if req.future.done():
                    return
                self.counts["rerouted"] += 1
                self._dispatch(req)
            return
        with self._lock:  # the model itself failed: that is the answer
            self._requests.pop(req.id, None)
            self.counts["failed"] += 1
        if not req.future.done():
            req.future.set_exception(exc)

    def _refresh(self) -> None:
        workers = workers_info(self.client)
        paused, speeds = self._plugin_view
        if time.monotonic() >= self._plugin_due:  # the plugin's view changes slowly
            self._plugin_due = time.monotonic() + PLUGIN_REFRESH
            try:
                status = plugin_status(self.client, since=time.time())
                paused = dict(status.get("paused") or {})
                speeds = learned_speeds(self.client, status).known
            except RuntimeError:  # no blockflow plugin: distributed's status, own measurements
                pass
            self._plugin_view = (paused, speeds)
        excluded = {}
        for a, w in workers.items():
            if w.get("status") not in (None, "running"):
                excluded[a] = f"worker status {w.get('status')}"
            elif a in paused:
                excluded[a] = f"paused by blockflow: {paused[a]}"
            else:
                frac = read_metrics(w.get("metrics")).gpu_memory_fraction
                if frac is not None and frac >= self.memory_full:
                    excluded[a] = (f"device memory {frac:.0%} full (>= "
                                   f"{self.memory_full:.0%})")
        with self._lock:
            self._workers = workers
            self._speeds = dict(speeds)
            self._excluded = excluded
            # A worker is lost when two refreshes in a row miss it (one reply may be cut).
            gone = {r.worker for r in self._requests.values()
                    if r.worker is not None and r.worker not in workers}
            lost_workers, self._missing = gone & self._missing, gone
            lost = [r for r in self._requests.values()
                    if r.worker in lost_workers and not r.future.done()]
            for req in lost:  # its worker left: route it again
                self._backlog.pop(req.worker, None)
                req.workers_by_attempt.pop(req.attempt, None)
                if req.task is not None:
                    req.task.cancel()
                self.counts["rerouted"] += 1
                self.decisions.append({"time": time.time(), "action": "lost",
                                       "request": req.id, "worker": req.worker,
                                       "reason": "worker left the cluster"})
                self._dispatch(req)
            for w in [w for w in self._backlog if w not in workers]:
                del self._backlog[w]
            for w in [w for w in self._inflight if w not in workers]:
                del self._inflight[w]
            self._drain()


def _worker_lost(exc: BaseException | None) -> bool:
    """Whether ``exc`` says the worker went away (not that the model failed)."""
    if exc is None:
        return False
    from distributed import KilledWorker
    from distributed.comm.core import CommClosedError

    return isinstance(exc, (KilledWorker, CommClosedError, OSError, TimeoutError))
