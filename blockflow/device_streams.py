"""Tasks overlapped on a GPU: each worker thread runs its device tasks on its own CUDA stream.

:class:`~blockflow.core.kernel.Kernel` calls :func:`call_on_stream` for a task whose
arguments hold CuPy arrays (nothing else: without CuPy imported, the kernel wrapper makes one
``sys.modules`` look-up and calls the function as before). The function runs inside
``with stream:`` on the calling thread's own non-blocking stream (one per thread and device,
:func:`thread_stream`), which first waits (on the device, not the host) for what the legacy
default stream was given before: blocks another task left there are complete before this
task reads them. Afterwards only *that* stream is synchronised, never the device, so the
result is complete when another thread's task reads it while the other threads' tasks keep
the device busy. With ``blockflow.cluster.gpu-threads-per-worker`` threads, that many tasks
are in flight per GPU.

Device time: two events on the stream time the task's device span (from the stream reaching
the task to the end of its last kernel); spans are placed on one time line per device (from a
reference event that moves up every 30 s, :class:`DeviceClock`) and their union (overlapping tasks counted once,
:class:`BusyIntervals`) is the worker's heartbeat metric ``blockflow-device-seconds``
(:data:`~blockflow._distributed.metrics.DEVICE_SECONDS_METRIC`). Each task's span is also
digested as the fine performance metric ``device`` (seconds), shown on Dask's "Fine
Performance Metrics" page beside the thread's CPU and non-CPU time.

Guide: :doc:`/guide/clusters`, "GPU workers".
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from blockflow import _distributed
from blockflow._distributed.metrics import DEVICE_SECONDS_METRIC, POOL_FREE_METRIC

__all__ = ["BusyIntervals", "DeviceClock", "call_on_stream", "device_seconds",
           "grow_pool", "holds_device_arrays", "reserve_per_stream", "thread_stream"]

#: Label of the fine performance metric a device task digests (seconds).
FINE_METRIC = "device"


class BusyIntervals:
    """The length of the union of time intervals, added in any order; thread-safe.

    Parameters
    ----------
    keep : int, default 256
        Disjoint intervals kept apart; beyond that the oldest are folded into the total and
        a later interval is counted only from the end of what was folded (never twice).

    Notes
    -----
    O(``keep``) per :meth:`add` at worst; intervals usually arrive nearly in order, so the
    search starts from the end.
    """

    def __init__(self, keep: int = 256):
        self.keep = max(int(keep), 1)
        self._lock = threading.Lock()
        self._spans: list[list[float]] = []  # disjoint, sorted [start, end]
        self._folded = 0.0  # seconds of the intervals folded into the total
        self._horizon = float("-inf")  # nothing before this is counted again

    def add(self, start: float, end: float) -> None:
        """Count ``[start, end]`` (seconds on any one time line); empty or reversed: nothing.

        Raises
        ------
        ValueError
            If either end is not a finite number.
        """
        start, end = float(start), float(end)
        if not (abs(start) < float("inf") and abs(end) < float("inf")):
            raise ValueError(f"BusyIntervals: interval ends must be finite, got "
                             f"[{start}, {end}].")
        with self._lock:
            start = max(start, self._horizon)
            if end <= start:
                return
            spans = self._spans
            i = len(spans)
            while i > 0 and spans[i - 1][0] > start:  # the first span starting after it
                i -= 1
            # merge with the span before when they touch, then with those after
            if i > 0 and spans[i - 1][1] >= start:
                i -= 1
                spans[i][1] = max(spans[i][1], end)
            else:
                spans.insert(i, [start, end])
            while i + 1 < len(spans) and spans[i + 1][0] <= spans[i][1]:
                spans[i][1] = max(spans[i][1], spans.pop(i + 1)[1])
            while len(spans) > self.keep:
                s, e = spans.pop(0)
                self._folded += e - s
                self._horizon = e

    def total(self) -> float:
        """Seconds covered by the union of the intervals added."""
        with self._lock:
            return self._folded + sum(e - s for s, e in self._spans)


class DeviceClock:
    """The busy time of one device as this process's tasks used it.

    CUDA gives the time between two events as a 32-bit float of milliseconds
    (``cudaEventElapsedTime``): timed from one reference recorded at start-up, spans hours
    later would round to milliseconds. So a span's length is timed between its own two
    events, and the reference moves up to a span's start once it is :data:`REANCHOR` seconds
    old (the time line kept continuous: the new reference's place on it is the span's).

    Parameters
    ----------
    cupy : module
    reference : cupy.cuda.Event
        Recorded (and complete) on the device: task spans are timed from it.
    """

    #: Seconds after which the reference moves up to the next span's start (float32
    #: milliseconds at 30 s: ~2 microseconds apart).
    REANCHOR = 30.0

    def __init__(self, cupy, reference):
        self.cupy = cupy
        self.reference = reference
        self.offset = 0.0  # the reference's place on the time line, seconds
        self.busy = BusyIntervals()
        self._lock = threading.Lock()

    def add(self, start, end) -> float:
        """Count the span between two completed events; returns its seconds."""
        elapsed = self.cupy.cuda.get_elapsed_time  # milliseconds between two events
        seconds = max(elapsed(start, end) / 1000.0, 0.0)
        with self._lock:
            try:
                since = elapsed(self.reference, start) / 1000.0
            except Exception:  # another thread's span began before the reference moved up:
                since = 0.0  # placed at the reference, should CUDA refuse a negative time
            t0 = self.offset + since
            if since > self.REANCHOR:
                self.reference, self.offset = start, t0
        self.busy.add(t0, t0 + seconds)
        return seconds


logger = logging.getLogger(__name__)

_clocks: dict[int, DeviceClock] = {}  # device id -> its clock, in this process
_clocks_lock = threading.Lock()
_local = threading.local()  # .streams: device id -> this thread's stream
_reported: set = set()  # ids of the workers that report this process's device seconds
# bytes of CuPy's pool a new stream takes up front, and how many streams still take them
_reserve = [0, 0]


def reserve_per_stream(nbytes: int, streams: int) -> None:
    """Have the next ``streams`` threads' streams, when made, grow CuPy's default pool by
    ``nbytes`` each on that stream (:func:`grow_pool`): CuPy keeps freed memory per stream, so
    a pool grown on one stream serves only its allocations. Later streams (threads that
    replace others) take nothing, so the pool stays at the size asked. Set by
    :class:`blockflow.device_pool.CuPyPool`."""
    with _clocks_lock:
        _reserve[:] = [max(int(nbytes), 0), max(int(streams), 0)]


def _take_reserve() -> int:
    """The bytes a stream made now grows the pool by (0 once the shares are taken)."""
    with _clocks_lock:
        if _reserve[1] <= 0:
            return 0
        _reserve[1] -= 1
        return _reserve[0]


def grow_pool(cupy, stream, nbytes: int, where: str = "this worker") -> bool:
    """Allocate ``nbytes`` from CuPy's default memory pool on ``stream`` (None: the current
    stream) and free them back: the pool keeps them for that stream's later allocations.
    False, and nothing done, when CuPy allocates through another allocator (RMM) or the
    device has no room left (logged)."""
    pool = cupy.get_default_memory_pool()
    if nbytes <= 0 or getattr(cupy.cuda.get_allocator(), "__self__", None) is not pool:
        return False
    try:
        if stream is None:
            chunk = pool.malloc(nbytes)
        else:
            with stream:
                chunk = pool.malloc(nbytes)
    except cupy.cuda.memory.OutOfMemoryError:
        logger.info("blockflow: CuPy's memory pool on %s could not grow by %d bytes for a "
                    "stream: the device is full; its blocks allocate as they come", where,
                    nbytes)
        return False
    del chunk  # back into the pool, cached for this stream
    return True


def device_seconds() -> float:
    """Seconds the devices of this process were busy with its device tasks (each device's
    union of task spans, summed over devices); 0.0 before any."""
    return sum(c.busy.total() for c in list(_clocks.values()))


def _metric(worker=None) -> float:
    return round(device_seconds(), 6)


def holds_device_arrays(ndarray: type, args: tuple, kwargs: dict) -> bool:
    """Whether the arguments, or the items of an argument that is a list or tuple, include an
    instance of ``ndarray`` (CuPy's); the cheap test of :func:`call_on_stream`."""
    for values in (args, kwargs.values() if kwargs else ()):
        for a in values:
            if isinstance(a, ndarray):
                return True
            if type(a) is list or type(a) is tuple:
                for b in a:
                    if isinstance(b, ndarray):
                        return True
    return False


def thread_stream(cupy) -> tuple[Any, DeviceClock]:
    """This thread's non-blocking stream on the current device, and the device's clock
    (both made at first use; a thread's first stream also has its worker report the
    device seconds and takes its share of the memory pool, :func:`reserve_per_stream`)."""
    device = cupy.cuda.Device().id
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = cupy.cuda.Stream(non_blocking=True)
        grow_pool(cupy, stream, _take_reserve())
        _report()  # this thread's worker reports the device seconds (once per worker)
    clock = _clocks.get(device)
    if clock is None:
        with _clocks_lock:
            clock = _clocks.get(device)
            if clock is None:
                reference = stream.record()
                reference.synchronize()  # complete before any span is timed from it
                clock = _clocks[device] = DeviceClock(cupy, reference)
    return stream, clock


def _report() -> None:
    """Report :func:`device_seconds` as the worker's ``blockflow-device-seconds`` metric."""
    try:
        from distributed import get_worker
        worker = get_worker()
    except ValueError:  # not in a task on a worker
        return
    if id(worker) not in _reported:
        _reported.add(id(worker))
        _distributed.set_worker_metric_soon(worker, DEVICE_SECONDS_METRIC, _metric)
        pool_free = pool_free_metric()
        if pool_free is not None:
            _distributed.set_worker_metric_soon(worker, POOL_FREE_METRIC, pool_free)


def pool_free_metric() -> Callable | None:
    """The worker metric ``blockflow-device-pool-free``: bytes CuPy's default memory pool
    holds unused on the current device (NVML counts them as used); None without CuPy or
    when CuPy allocates through another allocator (an RMM pool, whose cached bytes are not
    reported)."""
    import sys

    cupy = sys.modules.get("cupy")
    if cupy is None:
        return None
    try:
        pool = cupy.get_default_memory_pool()
        if getattr(cupy.cuda.get_allocator(), "__self__", None) is not pool:
            return None
    except Exception:  # CuPy without a usable device
        return None

    def free_bytes(worker=None) -> int:
        return int(pool.free_bytes())

    return free_bytes


def call_on_stream(cupy, func: Callable, args: tuple, kwargs: dict):
    """``func(*args, **kwargs)`` on this thread's stream when the arguments hold CuPy arrays
    (:func:`holds_device_arrays`), else plainly; see the module docstring.

    Returns
    -------
    The function's result, its device work complete.

    Raises
    ------
    Exception
        What the function raises (its stream synchronised first, quietly); a CUDA error of
        the synchronisation itself.
    """
    if not holds_device_arrays(cupy.ndarray, args, kwargs):
        return func(*args, **kwargs)
    stream, clock = thread_stream(cupy)
    # what other tasks left on the legacy default stream (blocking streams) comes first
    ready = cupy.cuda.Event(disable_timing=True)
    ready.record(cupy.cuda.Stream.null)
    stream.wait_event(ready)
    wall = time.perf_counter()
    start = stream.record()
    try:
        with stream:
            result = func(*args, **kwargs)
    except BaseException:
        try:
            stream.synchronize()  # no work of a failed attempt runs on under the next
        except Exception:  # the function's own error says more
            pass
        raise
    end = stream.record()
    end.synchronize()  # this stream up to here: never the whole device
    seconds = min(clock.add(start, end), time.perf_counter() - wall)
    _distributed.digest_task_seconds(FINE_METRIC, seconds)
    return result
