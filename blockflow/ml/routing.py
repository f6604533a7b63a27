"""Request routing: send each inference request to the worker that will answer it first.

:class:`Router` holds requests centrally, one queue per caller served in turn
(:mod:`blockflow.ml._fair_queue`), and sends each, in batches, to the worker where it is
expected to finish first (the work sent there and not yet done, plus its cost, times the
worker's learned seconds per unit) once that worker has room: its running task and one more.
Guide: docs/guide/ai.md.
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
from typing import Any, Hashable

from dask.utils import parse_timedelta
from distributed import KilledWorker, get_worker
from distributed.comm import CommClosedError

from blockflow import config
from blockflow._distributed.metrics import read_metrics
from blockflow.ml._fair_queue import FairQueue, Lane, dispatch
from blockflow.ml.inference import _module
from blockflow.ml.model_cache import ModelRef, ship_model
from blockflow.scheduling.estimate import Throughput
from blockflow.scheduling.view import learned_speeds, plugin_status, workers_info
from blockflow.scheduling.wait import fetch, fetch_many

__all__ = ["Router"]

logger = logging.getLogger(__name__)

#: Warm answers per worker whose median is its seconds per unit (a short window: a worker
#: that slows down is seen after half of it).
WINDOW = 8

#: Seconds between reads of blockflow's plugin (learned speeds, paused workers).
PLUGIN_REFRESH = 1.0


def _answer(ref: ModelRef, batches: list):
    """The task of one batch of requests: each request's ``(ok, output or exception,
    seconds)`` and the worker."""
    loaded, _ = ref.resolve()
    out = []
    for batch in batches:
        with loaded.lock:
            start = time.perf_counter()
            try:
                if len(batch) == 0:
                    zeros = _module(batch).zeros((2, *batch.shape[1:]), dtype=batch.dtype)
                    result, ok = loaded(zeros)[:0], True
                else:
                    result, ok = loaded(batch), True
            except Exception as e:  # the model failed on this request: that is its answer
                result, ok = e, False
            elapsed = time.perf_counter() - start
        out.append((ok, result, elapsed))
    return out, get_worker().address


@dataclass
class _Request:
    id: int
    batch: Any
    cost: float
    caller: Any
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    attempt: int = 0
    sent: Any = None  # the _Batch of the current attempt


@dataclass
class _Batch:
    id: int
    worker: str
    requests: list
    seconds: float  # expected
    task: Any = None  # its distributed Future
    released: bool = False  # its worker's expected work and slot given back


class Router:
    """Route inference requests, in batches, to the worker that will answer first, callers
    served in turn.

    Parameters
    ----------
    client : distributed.Client
    model : torch.nn.Module, ONNX model, estimator or callable
        As in :func:`blockflow.predict`.
    method : str, optional
        Estimators: ``"predict"`` (default), ``"predict_proba"``...
    interval : str or float, optional
        How often worker state is refreshed (seconds or ``"200ms"``); default config
        ``blockflow.routing.interval``.
    memory_full : float, optional
        Device-memory fraction (0-1) at or above which a worker gets no new requests;
        default config ``blockflow.routing.memory-full``.
    depth : int, optional
        At most this many requests per worker thread in flight; default None (bounded by
        the batch bounds and task slots).
    batch_size : int, optional
        At most this many requests in one task (>= 1); default config
        ``blockflow.routing.batch-size``.
    batch_seconds : str or float, optional
        At most this much estimated work in one task (seconds or ``"200ms"``); default
        config ``blockflow.routing.batch-seconds``.

    Notes
    -----
    Requests wait in the router, one queue per caller (``caller=`` of :meth:`submit`; default
    the calling thread), taken in deficit round robin on cost, each to the worker where it is
    expected to finish first once that worker has room (its running task per thread and one
    more): no worker idles while a request it would finish first waits, a slow worker gets a
    request only when it would finish it first, and a caller that floods cannot starve a
    light one. ``router.decisions`` (a deque of dict) records every batch sent (``"route"``
    or ``"reroute"``, with its callers) and each request lost with its worker.

    Examples
    --------
    >>> with blockflow.Router(client, model) as router:  # doctest: +SKIP
    ...     answers = [f.result() for f in router.map(batches)]
    """

    def __init__(self, client, model, *, method: str | None = None, interval=None,
                 memory_full: float | None = None, depth: int | None = None,
                 batch_size: int | None = None, batch_seconds=None):
        self.client = client
        self.interval = parse_timedelta(config.get("routing.interval", interval))
        self.memory_full = float(config.get("routing.memory-full", memory_full))
        if depth is not None and (isinstance(depth, bool) or int(depth) < 1):
            raise ValueError(f"blockflow: Router depth must be None or >= 1 request per "
                             f"thread, got {depth!r}.")
        self.depth = None if depth is None else int(depth)
        size = config.get("routing.batch-size", batch_size)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"blockflow: Router batch_size must be an int >= 1 request per "
                             f"task, got {size!r}.")
        self.batch_size = size
        self.batch_seconds = parse_timedelta(config.get("routing.batch-seconds",
                                                        batch_seconds))
        if not self.batch_seconds or self.batch_seconds <= 0:
            raise ValueError(f"blockflow: Router batch_seconds must be > 0 seconds of "
                             f"estimated work per task, got {batch_seconds!r}.")
        # a model given here is shipped here and freed by close(); a ModelRef stays the
        # caller's to close
        self._owns_ref = not isinstance(model, ModelRef)
        self.ref = model if isinstance(model, ModelRef) else ship_model(
            model, method=method, client=client, entry="blockflow.Router")
        self._ids = itertools.count()
        self._batch_ids = itertools.count()
        self._lock = threading.Lock()
        self._requests: dict[int, _Request] = {}  # unanswered
        # not sent: held here per caller until the device each finishes first on has room
        self._waiting = FairQueue(dead=lambda r: r.future.done())
        self._batches: dict[int, _Batch] = {}  # sent, not yet released
        self._inflight: Counter = Counter()  # requests sent to each worker, not yet back
        self._by_caller: Counter = Counter()  # requests sent for each caller, not yet back
        self._tasks: Counter = Counter()  # batches (tasks) in flight per worker
        self._expected: Counter = Counter()  # their expected seconds per worker
        self._started: dict[str, float] = {}  # when its oldest batch in flight began (monotonic)
        # seconds per cost unit from the answers' compute times; a worker's first answer
        # pays for loading the model and warming up: kept apart, trusted only while no
        # worker has a warm answer (cold starts are discounted)
        self._throughput = Throughput(window=WINDOW)
        self._workers: dict[str, dict] = {}
        self._speeds: dict[str, float] = {}  # learned, known with confidence
        self._excluded: dict[str, str] = {}  # worker -> why it gets no new requests
        self._events: queue.Queue = queue.Queue()
        self.counts = Counter()  # submitted, answered, rerouted, duplicates, failed, batches
        self.answered_by: Counter = Counter()
        self.decisions: deque = deque(maxlen=10_000)
        self._closed = False
        self._plugin_view: tuple[dict, dict] = ({}, {})
        self._plugin_due = 0.0
        self._missing: set[str] = set()
        self._finished_batches: queue.Queue = queue.Queue()  # to fetch, oldest first
        self._fetcher = concurrent.futures.ThreadPoolExecutor(
            2, thread_name_prefix="blockflow-router-fetch")
        self._refresh()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="blockflow-router",
                                        daemon=True)
        self._watcher = threading.Thread(target=self._watch, name="blockflow-router-watch",
                                         daemon=True)
        self._thread.start()
        self._watcher.start()
        for _ in range(2):  # two gathers in flight: one round trip hides behind the other
            self._fetcher.submit(self._fetch_loop)

    # -- public API ------------------------------------------------------------------

    def submit(self, batch, *, cost: float | None = None,
               caller: Hashable | None = None) -> concurrent.futures.Future:
        """Route one request; returns a future of the model's output, resolved exactly once.

        Parameters
        ----------
        batch : array
            The model's input (rows).
        cost : float, optional
            Its work in units (default its rows): its expected seconds are cost x the
            device's learned seconds per unit.
        caller : hashable, optional
            Who sends it (a user, tenant or client id): callers share the devices by cost,
            each caller's requests in the order sent. Default: the calling thread.
        """
        if self._closed:
            raise RuntimeError("blockflow: this Router is closed; make a new one.")
        cost = float(len(batch) if cost is None else cost)
        caller = _caller() if caller is None else caller
        req = _Request(next(self._ids), batch, cost, caller)
        with self._lock:
            self._requests[req.id] = req
            self.counts["submitted"] += 1
            self._waiting.push(req, caller, cost)
            if any(self._free(w) for w in self._usable()):
                self._pump()
        return req.future

    def map(self, batches, *, costs=None,
            caller: Hashable | None = None) -> list[concurrent.futures.Future]:
        """:meth:`submit` each batch (for one ``caller``); the futures in the same order."""
        costs = [None] * len(batches) if costs is None else costs
        caller = _caller() if caller is None else caller
        with self._lock:  # one placement for the lot, not one per request
            self._mapping = True
        try:
            futures = [self.submit(b, cost=c, caller=caller) for b, c in zip(batches, costs)]
        finally:
            with self._lock:
                self._mapping = False
                self._pump()
        return futures

    _mapping = False

    def stats(self) -> dict[str, Any]:
        """Plain data: ``counts``, ``answered_by``, ``seconds_per_unit``, ``excluded``,
        ``pending``, ``waiting`` and ``waiting_by_caller``."""
        with self._lock:
            return {"counts": dict(self.counts), "answered_by": dict(self.answered_by),
                    "seconds_per_unit": self._throughput.observed_seconds_per_unit(),
                    "excluded": dict(self._excluded), "pending": len(self._requests),
                    "waiting": len(self._waiting),
                    "waiting_by_caller": self._waiting.callers()}

    def close(self) -> None:
        """Stop routing and cancel unanswered requests; a model this Router shipped leaves
        the workers (a passed-in ModelRef stays open)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._events.put(None)
        for _ in range(2):
            self._finished_batches.put(None)
        self._thread.join(timeout=10)
        self._watcher.join(timeout=10)
        self._fetcher.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for b in list(self._batches.values()):
                if b.task is not None:
                    b.task.cancel()
            for req in list(self._requests.values()):
                req.future.cancel()
            self._requests.clear()
            self._waiting.clear()
            self._batches.clear()
        if self._owns_ref:
            self.ref.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- choosing workers and sending batches ------------------------------------------------

    def _threads(self, w: str) -> int:
        return max(int(self._workers[w].get("nthreads") or 1), 1)

    def _usable(self) -> list[str]:
        alive = list(self._workers)
        return [w for w in alive if w not in self._excluded] or alive

    def _room(self, w: str) -> int:
        """Tasks ``w`` may still be sent: one running per thread and one waiting behind."""
        if self._cap(w) == 0:
            return 0
        return max(self._threads(w) + 1 - self._tasks[w], 0)

    def _cap(self, w: str) -> int | None:
        """Requests ``w`` may still be sent under ``depth`` (None: no bound)."""
        if self.depth is None:
            return None
        return max(self.depth * self._threads(w) - self._inflight[w], 0)

    def _free(self, w: str) -> bool:
        return self._room(w) > 0

    def _ready(self, w: str, now: float) -> float:
        """Expected seconds until the work sent to ``w`` ends, per thread: the estimates of
        its batches in flight less the time its oldest one has run."""
        if not self._tasks[w]:
            return 0.0
        return max(self._expected[w] - (now - self._started.get(w, now)), 0.0) / self._threads(w)

    def _pump(self) -> None:  # under self._lock: send waiting requests where they finish first
        if self._mapping or self._closed or not len(self._waiting):
            return
        usable = self._usable()
        light = [c for c, n in self._waiting.callers().items()
                 if n and not self._by_caller.get(c)]
        if not usable or not (light or any(self._free(w) for w in usable)):
            return
        spu = self._throughput.seconds_per_unit(list(self._workers), self._speeds)
        now = time.monotonic()
        lanes = {w: Lane(ready=self._ready(w, now), spu=spu[w], room=self._room(w),
                         cap=self._cap(w), order=(spu[w], self._tasks[w], w)) for w in usable}
        finish = {w: round(lane.ready, 6) for w, lane in lanes.items()}
        sent = dispatch(self._waiting, lanes, batch_size=self.batch_size,
                        batch_seconds=self.batch_seconds, caller=lambda r: r.caller)
        for w, batches in sent.items():
            for reqs, seconds in batches:
                self._send(w, reqs, seconds, finish, now)
        sent = self._jump(light, lanes, finish, now) or sent
        if sent:
            self.decisions[-1]["after"] = {  # the state the last batch left
                "in_flight": {w: self._tasks[w] for w in usable},
                "waiting": len(self._waiting)}

    def _jump(self, light: list, lanes: dict, finish: dict, now: float) -> bool:
        """Send the next request of each caller with nothing in flight (``light``) alone to
        the worker that finishes it first, ahead of the batches queued there (task priority):
        beside a flood it waits for one running batch, not the flood's queued ones. A flood
        always has requests in flight, so it never jumps. True if any was sent."""
        sent = False
        for c in light:
            if self._by_caller.get(c) or c not in self._waiting.callers():
                continue  # sent by dispatch meanwhile
            item, cost = self._waiting.peek_caller(c)
            open_ = [w for w, lane in lanes.items() if lane.spu > 0 and lane.cap != 0]
            if not open_:
                return sent
            w = min(open_, key=lambda w: (lanes[w].ready + lanes[w].spu * cost,
                                          lanes[w].order))
            self._waiting.pop_caller(c)
            lanes[w].ready += lanes[w].spu * cost
            if lanes[w].cap is not None:
                lanes[w].cap -= 1
            self._send(w, [item], lanes[w].spu * cost, finish, now, priority=1)
            sent = True
        return sent

    def _send(self, worker: str, reqs: list, seconds: float, finish: dict, now: float,
              priority: int = 0) -> None:
        b = _Batch(next(self._batch_ids), worker, reqs, seconds)
        for r in reqs:
            self._by_caller[r.caller] += 1
        if not self._tasks[worker]:
            self._started[worker] = now
        again = False
        for r in reqs:
            again |= r.attempt > 0
            r.attempt += 1
            r.sent = b
        self._batches[b.id] = b
        self._tasks[worker] += 1
        self._inflight[worker] += len(reqs)
        self._expected[worker] += seconds
        self.counts["batches"] += 1
        key = f"blockflow-request-{self.ref.token[:8]}-{reqs[0].id}-b{b.id}"
        b.task = self.client.submit(_answer, self.ref, [r.batch for r in reqs], key=key,
                                    workers=[worker], allow_other_workers=False, pure=False,
                                    priority=priority)
        b.task.add_done_callback(lambda f, b=b: self._events.put((b, f)))
        self.decisions.append({
            "time": time.time(), "action": "reroute" if again else "route",
            "request": reqs[0].id, "requests": [r.id for r in reqs], "worker": worker,
            "estimated_seconds": round(seconds, 6),
            "reason": "shortest expected finish",
            "callers": [r.caller for r in reqs],
            "busy_until": finish,
            "excluded": dict(self._excluded)})

    def _release(self, b: _Batch) -> None:  # under self._lock: the batch's work is over
        if b.released:
            return
        b.released = True
        self._batches.pop(b.id, None)
        w = b.worker
        if self._tasks.get(w, 0) > 0:
            self._tasks[w] -= 1
        if self._inflight.get(w, 0) > 0:
            self._inflight[w] = max(self._inflight[w] - len(b.requests), 0)
        if self._expected.get(w, 0) > 0:
            self._expected[w] = max(self._expected[w] - b.seconds, 0.0)
        for r in b.requests:
            self._by_caller[r.caller] -= 1
            if self._by_caller[r.caller] <= 0:
                del self._by_caller[r.caller]
        self._started[w] = time.monotonic()  # the next batch waiting on it starts now

    def _again(self, reqs: list, b: _Batch) -> None:  # under self._lock: route them again
        again = [r for r in reqs if not r.future.done() and r.sent is b]
        for r in again:  # they go first: they waited longest
            r.sent = None
            self._waiting.push_first(r, r.cost)
        self.counts["rerouted"] += len(again)

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
        """The refresh thread: worker state from the scheduler."""
        while not self._stop.wait(self.interval):
            try:
                self._refresh()
            except Exception:
                if not self._closed:
                    logger.exception("blockflow router: error while refreshing worker state")

    def _finished(self, b: _Batch, task) -> None:
        with self._lock:
            self._release(b)
        try:
            if task.status == "finished":  # fetch the answers off the routing thread
                self._finished_batches.put((b, task))
            else:
                self._failed(b, task)
        finally:
            with self._lock:
                self._pump()

    def _fetch_loop(self) -> None:
        """A fetching thread: finished batches gathered in one request."""
        while True:
            item = self._finished_batches.get()
            if item is None:
                return
            group = [item]
            while len(group) < 64:
                try:
                    more = self._finished_batches.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._finished_batches.put(None)  # the other thread's stop
                    break
                group.append(more)
            try:
                try:
                    results = fetch_many([t for _, t in group], timeout=30)
                except Exception:  # a lost result or a failed task: find which, one by one
                    results = None
                for k, (b, task) in enumerate(group):
                    self._fetch(b, task, None if results is None else results[k])
            except Exception:  # never let a fetching thread die: answers would hang
                if not self._closed:
                    logger.exception("blockflow router: error while fetching answers")

    def _fetch(self, b: _Batch, task, result=None) -> None:
        try:
            answers, worker = (fetch(task, timeout=30, deadline=30) if result is None
                               else result)
        except Exception as e:  # lost between finishing and fetching: route again
            logger.info("blockflow router: batch of requests %s result lost (%s)",
                        [r.id for r in b.requests], e)
            with self._lock:
                self._again(b.requests, b)
                self._pump()
            return
        settled = []
        with self._lock:
            for r, (ok, out, elapsed) in zip(b.requests, answers):
                try:
                    if r.future.done():
                        self.counts["duplicates"] += 1
                        continue
                    self._requests.pop(r.id, None)
                    if ok:
                        self.counts["answered"] += 1
                        self.answered_by[worker] += 1
                        if r.cost > 0:
                            self._throughput.observe(worker, r.cost, elapsed)
                    else:
                        self.counts["failed"] += 1
                    settled.append((r, ok, out))
                except Exception:  # never lose an answer to a bookkeeping error
                    logger.exception("blockflow router: error while answering request %s",
                                     r.id)
                    settled.append((r, ok, out))
        for r, ok, out in settled:
            if r.future.done():
                continue
            (r.future.set_result if ok else r.future.set_exception)(out)

    def _failed(self, b: _Batch, task) -> None:
        if task.status == "cancelled":
            return  # a batch whose worker left (its requests are routed again), or closing
        if task.status != "error":
            # neither finished nor failed: its result went with its worker, and distributed
            # would compute it again, but it is pinned to that worker (it would wait
            # forever, and a wait for its exception with it): route its requests again
            task.cancel()
            with self._lock:
                self._again(b.requests, b)
            return
        exc = task.exception(timeout=30)
        if _worker_lost(exc):
            with self._lock:
                self._again(b.requests, b)
            return
        failed = []
        with self._lock:  # the task itself failed (not one model call): that is the answer
            for r in b.requests:
                if not r.future.done() and r.sent is b:
                    self._requests.pop(r.id, None)
                    self.counts["failed"] += 1
                    failed.append(r)
        for r in failed:
            if not r.future.done():
                r.future.set_exception(exc)

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
            gone = {b.worker for b in self._batches.values() if b.worker not in workers}
            lost_workers, self._missing = gone & self._missing, gone
            for b in [b for b in self._batches.values() if b.worker in lost_workers]:
                if b.task is not None:
                    b.task.cancel()
                self._release(b)
                for r in b.requests:
                    if not r.future.done() and r.sent is b:
                        self.decisions.append({"time": time.time(), "action": "lost",
                                               "request": r.id, "worker": b.worker,
                                               "reason": "worker left the cluster"})
                self._again(b.requests, b)
            for counter in (self._inflight, self._tasks, self._expected):
                for w in [w for w in counter if w not in workers]:
                    del counter[w]
            self._pump()


def _caller() -> str:
    """The default caller: the calling thread."""
    t = threading.current_thread()
    return f"thread {t.name} ({t.ident})"


def _worker_lost(exc: BaseException | None) -> bool:
    """Whether ``exc`` says the worker went away (not that the model failed)."""
    if exc is None:
        return False
    return isinstance(exc, (KilledWorker, CommClosedError, OSError, TimeoutError))
