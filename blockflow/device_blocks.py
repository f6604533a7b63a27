"""GPU block sizes: the block size GPU workers want (:func:`device_block_target`), blocks
grown to it (:func:`blockflow.fit_blocks`, :func:`to_device`), and the one advisory line
when a blockwise stage or tree reduction gets blocks far smaller. Guide: docs/guide/data.md,
"GPU block sizes".

The rule is a blockflow heuristic bounded by RAPIDS' guidance (partitions of 1/32 to 1/8 of
device memory; https://docs.rapids.ai/api/dask-cuda/stable/ and the Dask-cuDF best
practices): a task's device time is ``passes x nbytes / bandwidth``, and its worker's
measured per-task overhead ``t0`` should be at most ``device-overhead-share`` of the task.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import dask.array as da
from dask.utils import format_bytes, parse_bytes
from distributed import default_client

from blockflow import config
from blockflow._distributed.metrics import read_metrics
from blockflow.backends import is_device_block
from blockflow.decompose import BlockResize, _known, _Plan, _record, _xarray_resize
from blockflow.errors import BlockSizeWarning
from blockflow.scheduling.view import DEFAULT_OVERHEAD, memory_of, task_overheads, workers_info

__all__ = ["DeviceBlockTarget", "advise_blocks", "device_block_target", "grow_blocks",
           "grow_xarray",
           "has_gpu_workers", "note_gpu_workers", "to_device", "worker_target"]


@dataclass(frozen=True)
class DeviceBlockTarget:
    """The block size GPU workers want, and what it was sized from.

    Attributes
    ----------
    nbytes : int
        Bytes per block.
    overhead : float
        Measured per-task overhead of ``worker``, seconds per task.
    bandwidth : float
        Device memory bandwidth of ``worker``, bytes per second.
    threads : int
        Tasks in flight on ``worker`` (its threads).
    device_memory : int
        ``worker``'s device memory, bytes.
    worker : str
        The GPU worker whose figure this is (the one every worker's blocks must fit).
    share : float
        Share (0-1) of a task's time its overhead takes at ``nbytes``:
        ``overhead / (overhead + passes x nbytes / bandwidth)``.
    """

    nbytes: int
    overhead: float
    bandwidth: float
    threads: int
    device_memory: int
    worker: str
    share: float


def _client(client):
    if client is None:
        try:
            client = default_client()
        except ValueError:
            return None
    # an asynchronous client (inside an event loop) cannot be asked synchronously: no sizing
    return client if client.status == "running" and not client.asynchronous else None


def _gpu_workers(client) -> dict[str, dict]:
    return {a: info for a, info in workers_info(client).items()
            if read_metrics(info.get("metrics")).has_gpu}


_seen_gpu: dict[str, tuple[bool, float]] = {}  # client id -> (has GPU workers, when)
_GPU_CHECK_TTL = 2.0  # seconds a "GPU workers or not" answer is reused by the advice


def has_gpu_workers(client=None) -> bool:
    """Whether the cluster has a GPU worker (one reporting device memory); the answer is
    reused for 2 s per client, so repeated stages ask the scheduler once."""
    client = _client(client)
    if client is None:
        return False
    hit = _seen_gpu.get(client.id)
    now = time.monotonic()
    if hit is None or now - hit[1] > _GPU_CHECK_TTL:
        try:
            hit = (bool(_gpu_workers(client)), now)
        except Exception:  # a scheduler that does not answer: no GPU advice
            hit = (False, now)
        _seen_gpu[client.id] = hit
    return hit[0]


def note_gpu_workers(client, has: bool) -> None:
    """Remember for :func:`has_gpu_workers` (2 s) what a caller just read from the scheduler:
    whether ``client``'s cluster has GPU workers (no second scheduler call in one stage)."""
    _seen_gpu[client.id] = (bool(has), time.monotonic())


def _working_set(working_set) -> Callable[[int], float]:
    if working_set is None:
        return lambda n: n  # one output block beside the input
    if callable(working_set):
        return working_set
    ws = parse_bytes(working_set) if isinstance(working_set, str) else int(working_set)
    return lambda n: ws


def _largest_fitting(budget: float, working_set: Callable[[int], float]) -> int:
    """The largest ``n <= budget`` bytes with ``n + working_set(n) <= budget`` (0 if none)."""
    def fits(n: int) -> bool:
        return n + working_set(n) <= budget

    hi = int(budget)
    if hi <= 0 or not fits(1):
        return 0
    if fits(hi):
        return hi
    lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def worker_target(overhead: float, bandwidth: float, device_memory: float, free: float,
                  threads: int, *, passes: float = 2, working_set=None,
                  share: float | None = None, min_fraction: float | None = None,
                  max_fraction: float | None = None, safety: float | None = None) -> int:
    """One GPU worker's block size in bytes (the rule of :func:`device_block_target`).

    ``t0 x bw x (1 - s) / (s x passes)`` clamped to ``[min_fraction, max_fraction] x
    device_memory``, then to the most bytes whose block and working set fit ``free x (1 -
    safety) / threads``. Settings default to ``blockflow.blocks.*``.
    """
    s = float(config.get("blocks.device-overhead-share", share))
    lo = float(config.get("blocks.device-min-fraction", min_fraction)) * device_memory
    hi = float(config.get("blocks.device-max-fraction", max_fraction)) * device_memory
    safety = float(config.get("blocks.safety", safety))
    rule = overhead * bandwidth * (1 - s) / (s * passes)
    nbytes = min(max(rule, lo), hi)
    cap = _largest_fitting(free * (1 - safety) / max(int(threads), 1), _working_set(working_set))
    return max(int(min(nbytes, cap)), 1)


def device_block_target(client=None, *, passes: float = 2, working_set=None
                        ) -> DeviceBlockTarget | None:
    """The block size GPU workers want: per-task overhead a small share of each task, within
    device memory.

    Per GPU worker (blockflow heuristic, bounded by RAPIDS' 1/32-1/8 of device memory): a
    block's device time is ``passes x nbytes / bandwidth`` (bandwidth: the worker metric
    ``blockflow-device-bandwidth``, else ``blockflow.blocks.device-bandwidth``); the least
    ``nbytes`` that keeps the worker's measured per-task overhead ``t0``
    (:func:`blockflow.scheduling.view.task_overheads`) under ``s =
    blockflow.blocks.device-overhead-share`` of the task is ``t0 x bw x (1 - s) / (s x
    passes)``; it is clamped to ``[device-min-fraction, device-max-fraction] x`` device
    memory, then to ``free device memory x (1 - safety) / threads`` for the block and its
    working set. The smallest GPU worker's figure is returned (the one all must fit).

    Parameters
    ----------
    client : distributed.Client, optional
        Default: the current default client.
    passes : float, default 2
        Times a task streams its block through device memory (2: read it, write the output).
    working_set : int, str or callable, optional
        Device bytes a task needs besides its block, or ``working_set(block nbytes) ->
        bytes`` (as in :func:`blockflow.fit_blocks`); default one output block (``nbytes``).

    Returns
    -------
    DeviceBlockTarget or None
        None without a running client or without GPU workers (workers reporting device
        memory).
    """
    client = _client(client)
    if client is None:
        return None
    try:
        gpus = _gpu_workers(client)
    except Exception:  # the scheduler does not answer: no figure
        return None
    if not gpus:
        return None
    measured = task_overheads(client, list(gpus))
    fallback = max(measured.values()) if measured else DEFAULT_OVERHEAD
    default_bw = float(parse_bytes(str(config.get("blocks.device-bandwidth"))))
    best = None
    for addr, info in gpus.items():
        m, mem = read_metrics(info.get("metrics")), memory_of(info)
        t0 = measured.get(addr, fallback)
        bw = m.bandwidth or default_bw
        threads = int(info.get("nthreads") or 1)
        total = float(mem.device_total)
        n = worker_target(t0, bw, total, mem.free, threads, passes=passes,
                          working_set=working_set)
        if best is None or n < best.nbytes:
            best = DeviceBlockTarget(nbytes=n, overhead=t0, bandwidth=bw, threads=threads,
                                     device_memory=int(total), worker=addr,
                                     share=t0 / (t0 + passes * n / bw))
    return best


# -- blocks grown to the target ------------------------------------------------------------

def _block_bytes(x: da.Array) -> int:
    return int(x.dtype.itemsize * math.prod(max(c, default=0) for c in x.chunks))


def _grow_axes(x: da.Array, target: int, axis: int | None) -> list[tuple[int, int, float]]:
    """``[(axis, rows per block, row bytes)]``: the one-axis merge reaching closest to
    ``target``; when it merges that axis whole and blocks are still below ``target``, the
    next axis is merged too, and so on (3-D arrays cut small on every axis). ``axis``
    given: that axis alone. Empty when no merge grows the blocks."""
    maxes = [max(c) for c in x.chunks]
    axes = [axis] if axis is not None else list(range(x.ndim))
    out: list[tuple[int, int, float]] = []
    while True:
        best = None
        for a in axes:
            if len(x.chunks[a]) < 2 or any(a == o[0] for o in out):
                continue
            rb = x.dtype.itemsize * math.prod(m for b, m in enumerate(maxes) if b != a)
            rows = min(max(int(target // max(rb, 1)), 1), x.shape[a])
            key = (rows * rb, len(x.chunks[a]), -a)
            if rows > maxes[a] and (best is None or key > best[0]):
                best = (key, a, rows, rb)
        if best is None:
            return out
        _, a, rows, rb = best
        out.append((a, rows, rb))
        maxes[a] = rows
        if rows < x.shape[a] or x.dtype.itemsize * math.prod(maxes) >= target:
            return out


def _merge_plan(sizes, rows: int) -> _Plan | None:
    """Greedy runs of neighbouring blocks of at most ``rows`` rows together."""
    pieces, merged, first, acc = [], 0, 0, 0
    for k, s in enumerate(sizes):
        if k > first and acc + s > rows:
            pieces.append((first, k, 0, acc))
            merged += k - first if k - first > 1 else 0
            first, acc = k, 0
        acc += s
    pieces.append((first, len(sizes), 0, acc))
    merged += len(sizes) - first if len(sizes) - first > 1 else 0
    return _Plan(pieces, 0, merged) if merged else None


def _sizable(x: da.Array) -> bool:
    """Whether ``x``'s blocks have a size to grow: known chunks, not empty, and bytes that
    are its data (object arrays hold pointers: no device array holds them)."""
    return x.ndim > 0 and x.size != 0 and not x.dtype.hasobject and _known(x.chunks)


def grow_blocks(x: da.Array, target: int, *, axis: int | None = None, label: str = ""):
    """Merge neighbouring blocks of ``x`` along one axis (more when that axis is merged whole
    and blocks are still small) into blocks of at most ``target`` bytes; blocks at or above
    it are kept, as are empty and object arrays. Each axis's change is recorded (reason
    ``"device-target"``).

    Returns
    -------
    (dask.array.Array, BlockResize or None)
        The last axis's change, or None.
    """
    if not _sizable(x) or _block_bytes(x) >= target:
        return x, None
    new, change = {}, None
    for a, rows, rb in _grow_axes(x, target, axis):
        plan = _merge_plan(tuple(int(s) for s in x.chunks[a]), rows)
        if plan is not None:
            new[a] = plan.sizes
            change = _record(BlockResize("array", "device-target", a, tuple(x.chunks[a]),
                                         plan.sizes, rb, 0, plan.merged, time.time(), label))
    return (x.rechunk(new), change) if new else (x, None)


def grow_xarray(obj, target: int, *, dim: str | None = None, label: str = ""):
    """:func:`grow_blocks` for a chunked xarray object: neighbouring blocks along ``dim``
    (default the dimension with the most blocks) merged into blocks of at most ``target``
    bytes (all variables with ``dim`` counted); recorded with reason ``"device-target"``.

    Returns
    -------
    The xarray object (itself when nothing changes).
    """
    def plan(sizes, row_bytes):
        rows = int(target // max(row_bytes, 1))
        return _merge_plan(sizes, rows) if rows > max(sizes) else None

    if not getattr(obj, "chunksizes", None) or not obj.nbytes:
        return obj
    return _xarray_resize(obj, dim, plan, "device-target", label)


def to_device(collection):
    """Move a Dask collection's blocks to GPU memory (NumPy -> CuPy, pandas -> cuDF), lazily;
    arrays and xarray objects are first grown to the GPU workers' block size
    (:func:`device_block_target`) when a client with GPU workers is reachable, and otherwise
    keep their chunks.

    Parameters
    ----------
    collection : dask.array.Array, dask.dataframe.DataFrame or Series, xarray.DataArray or Dataset
        xarray in-memory coordinates stay on the host; dataframes keep their partitions.

    Returns
    -------
    Same type as ``collection``, with CuPy / cuDF blocks.

    Raises
    ------
    TypeError
        If ``collection`` is not a Dask collection.
    GPUUnavailableError
        If CuPy (arrays) or cuDF (dataframes) is not installed.
    """
    from blockflow import backends

    moved = backends._move(collection, "device")  # refuses first what cannot move
    is_xarray = type(collection).__module__.split(".")[0] == "xarray"
    if not (isinstance(collection, da.Array) or is_xarray) or not has_gpu_workers():
        return moved
    target = device_block_target()
    if target is None:
        return moved
    if is_xarray:
        grown = grow_xarray(collection, target.nbytes, label="blockflow.to_device")
        return moved if grown is collection else backends._move(grown, "device")
    grown, change = grow_blocks(collection, target.nbytes, label="blockflow.to_device")
    return moved if change is None else backends._move(grown, "device")


# -- the advisory line ---------------------------------------------------------------------

_advised: dict[tuple, None] = {}  # (client id, collection name) advised, the latest 1,000


def _bounds(client, working_set) -> tuple[float, float] | None:
    """Bytes the target is at least and at most, without measuring any overhead."""
    gpus = _gpu_workers(client)
    if not gpus:
        return None
    lows, highs = [], []
    for info in gpus.values():
        mem = memory_of(info)
        threads = int(info.get("nthreads") or 1)
        total = float(mem.device_total)
        lows.append(worker_target(0.0, 1.0, total, mem.free, threads,
                                  working_set=working_set))
        highs.append(worker_target(math.inf, 1.0, total, mem.free, threads,
                                   working_set=working_set))
    return min(lows), min(highs)


def advise_blocks(x: Any, func: str, *, working_set=None, passes: float = 2,
                  device: bool | None = None, name: str = "x", alike: bool = False,
                  dims: tuple | None = None) -> str | None:
    """Warn once per collection and client (:class:`~blockflow.errors.BlockSizeWarning`) when the
    array's blocks run on GPU workers and are below ``blockflow.blocks.advise-below`` x the
    size those workers want, with the ``rechunk`` that fits; nothing on clusters without GPU
    workers.

    Parameters
    ----------
    x : object
        Only Dask arrays with known chunks, not empty and not of objects, are looked at.
    func : str
        Names the call in the line (``"blockflow.map_blocks"``).
    working_set, passes
        As in :func:`device_block_target`.
    device : bool, optional
        Whether the blocks run on the device; default: they are device arrays (CuPy) or the
        stage declares a device working set (``working_set`` given). NumPy blocks of a stage
        that declares none run on the workers' CPUs, where GPU-sized blocks would only cost
        parallelism: no line for them.
    name : str, default "x"
        The variable named in the fix.
    alike : bool, default False
        The stage has other aligned arguments: the line says to rechunk them alike.
    dims : tuple of str, optional
        ``x`` is an xarray.DataArray's data with these dimensions: the fix is
        ``x.chunk({dim: rows})``.

    Costs one scheduler call at most every 2 s on a CPU cluster (:func:`has_gpu_workers`);
    the overhead is measured only when the blocks may be too small.

    Returns
    -------
    str or None
        The line warned, or None.
    """
    below = config.get("blocks.advise-below")
    if below is False or below is None or not isinstance(x, da.Array) or not _sizable(x):
        return None
    if device is None:
        device = is_device_block(x._meta) or working_set is not None
    if not device or not has_gpu_workers():
        return None
    client = _client(None)
    seen = (None if client is None else client.id, x.name)  # once per collection and client
    if seen in _advised:
        return None
    below = float(below)
    block, total = _block_bytes(x), x.dtype.itemsize * math.prod(x.shape)
    bounds = _bounds(client, working_set) if client is not None else None
    if bounds is None or block >= below * bounds[1] or total < below * bounds[0] \
            or x.npartitions < 2:
        return None  # large enough whatever the overhead, or too small to grow into one
    target = device_block_target(client, passes=passes, working_set=working_set)
    if target is None or block >= below * target.nbytes:
        return None
    merges = _grow_axes(x, target.nbytes, None)
    if not merges:
        return None
    maxes = [max(c) for c in x.chunks]
    for a, rows, _ in merges:
        maxes[a] = rows
    new = x.dtype.itemsize * math.prod(maxes)
    if new < below * target.nbytes:
        return None  # no rechunk reaches it
    fix = ", ".join(f"{a if dims is None else repr(str(dims[a]))}: {rows}"
                    for a, rows, _ in merges)
    method = "rechunk" if dims is None else "chunk"
    bw, t0 = target.bandwidth, target.overhead
    now_share = t0 / (t0 + passes * block / bw)
    new_share = t0 / (t0 + passes * new / bw)
    line = (f"{func}: blocks of {format_bytes(block)} are too small for the GPU workers "
            f"(worker {target.worker}'s per-task overhead, {t0 * 1e3:.2g} ms, is "
            f"~{now_share:.0%} of each task); "
            f"{'rechunk every aligned argument alike, e.g. ' if alike else ''}"
            f"{name} = {name}.{method}({{{fix}}}) gives blocks of "
            f"{format_bytes(int(new))} (~{new_share:.0%} overhead), as does "
            f"{name}, _ = blockflow.fit_blocks({name}); blockflow.blocks.advise-below: false "
            f"silences this.")
    _advised[seen] = None
    while len(_advised) > 1000:
        _advised.pop(next(iter(_advised)))
    warnings.warn(line, BlockSizeWarning, stacklevel=3)
    return line
