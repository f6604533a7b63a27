"""Block sizing: rechunk so each block plus its kernel's working set fits the smallest
worker's free memory and, on GPU workers, reaches the size they want (:func:`fit_blocks`,
:func:`device_block_target` from :mod:`blockflow.device_blocks`), and the re-cutting
:func:`blockflow.map_blocks` applies before its stage (config ``blockflow.skew.*``,
``blockflow.blocks.*``). Guide: docs/guide/data.md.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import dask
import dask.array as da
from dask.utils import format_bytes, parse_bytes
from distributed import default_client

from blockflow import config, decompose
from blockflow.decompose import (
    BlockResize,
    _array_skew,
    _check_axis,
    _fit_plan,
    _frame_skew,
    _known,
    _record,
    _row_bytes,
    _settings,
    _skew_plan,
    _xarray_dim,
    _xarray_resize,
    _xarray_row_bytes,
)
from blockflow.device_blocks import (
    DeviceBlockTarget,
    device_block_target,
    grow_blocks,
    grow_xarray,
)
from blockflow.scheduling.view import worker_memory

__all__ = ["DeviceBlockTarget", "device_block_target", "fit_blocks", "prepare_arrays",
           "prepare_frames", "prepare_xarray", "smallest_free_memory"]

logger = logging.getLogger("blockflow.decompose")


def smallest_free_memory(client=None, *, host: bool = True) -> tuple[int, str] | None:
    """Free memory of the worker with the least, in bytes, and its kind.

    GPU workers count free device memory; without them and with ``host=True``, the smallest
    host ``memory_limit``. None when unknown.
    """
    if client is None:
        try:
            client = default_client()
        except ValueError:
            return None
    if client.status != "running" or client.asynchronous:  # cannot be asked synchronously
        return None
    memory = worker_memory(client).values()
    free = [m.device_free for m in memory if m.device_free is not None]
    if free:
        return int(min(free)), "device"
    if not host:
        return None
    limits = [int(m.host_total) for m in memory if m.host_total]
    return (min(limits), "host") if limits else None


def _max_rows(row_bytes: float, working_set, budget: float, most: int) -> int:
    """The most rows ``r <= most`` with ``r x row_bytes + working_set(bytes) <= budget``."""
    def fits(r: int) -> bool:
        nbytes = int(r * row_bytes)
        need = working_set(nbytes) if callable(working_set) else (working_set or 0)
        return nbytes + need <= budget

    if fits(most):
        return most
    lo, hi = 0, most  # fits(lo) (or lo == 0), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo if lo and fits(lo) else 0


def _array_fit(x: da.Array, working_set, budget: float, axes=None, label=""
               ) -> tuple[int, tuple] | None | str:
    """``(axis, new chunks)`` so every block fits; None when all fit; ``("nowhere", row
    bytes)`` when one row does not."""
    if x.ndim == 0 or not _known(x.chunks):
        return None
    axes = list(range(x.ndim)) if axes is None else list(axes)
    axes = [a for a in axes if x.shape[a] > 1]
    if not axes:
        return None
    axis = max(axes, key=lambda a: (max(x.chunks[a]), -a))  # the longest blocks
    rb = _row_bytes(x, axis)
    most = max(x.chunks[axis])
    r = _max_rows(rb, working_set, budget, most)
    if r == 0:
        return "nowhere", rb
    plan = _fit_plan(x.chunks[axis], r)
    if plan is None:
        return None
    _record(BlockResize("array", "fit-device-memory", axis, tuple(x.chunks[axis]),
                        plan.sizes, rb, plan.split, 0, time.time(), label))
    return axis, plan.sizes


def fit_blocks(x, working_set: int | str | Callable[[int], int] | None = None, *,
               safety: float | None = None, client=None, axis: int | str | None = None):
    """Rechunk so each block plus its kernel's working set fits the smallest worker's free
    memory, with a safety margin; on GPU workers, also grow smaller blocks to the size those
    workers want.

    The budget is the least free device memory of any GPU worker (else the smallest host
    ``memory_limit``) times ``1 - safety``; blocks above it are split evenly along one axis.
    Method: blockflow heuristic (binary search on rows). On a cluster with GPU workers, blocks
    below :func:`device_block_target` are then merged into blocks of about that size (arrays:
    along one axis, more when it is merged whole; xarray: along one dimension; reason
    ``"device-target"``); CPU-only clusters: no merging.

    Parameters
    ----------
    x : dask.array.Array or xarray object
    working_set : int, str or callable, optional
        Bytes the kernel needs besides its block (``"2GiB"`` accepted), or a callable
        ``working_set(block nbytes) -> bytes``. Default: 0 for the memory fit, one output
        block for the GPU block size.
    safety : float, optional
        Fraction 0-1 of the free memory kept free; default ``blockflow.blocks.safety``.
    client : distributed.Client, optional
        Default: the current default client.
    axis : int or str, optional
        The axis (arrays) or dimension (xarray) to split; default the longest blocks'.

    Returns
    -------
    (collection, BlockResize or None)
        The rechunked collection (the input itself when nothing changes) and the change,
        or None.

    Raises
    ------
    TypeError
        If ``x`` is not a Dask array or chunked xarray object.
    ValueError
        If not even a one-row block fits the budget, or ``safety`` is not in [0, 1).
    """
    safety = float(config.get("blocks.safety", safety))
    device_ws = working_set
    working_set = 0 if working_set is None else working_set
    if not 0 <= safety < 1:
        raise ValueError(f"blockflow.fit_blocks: safety must be a fraction 0-1 of the free "
                         f"memory to keep free, got {safety!r}; e.g. 0.2.")
    if isinstance(working_set, str):
        working_set = parse_bytes(working_set)
    is_xarray = type(x).__module__.split(".")[0] == "xarray"
    if not isinstance(x, da.Array) and not is_xarray:
        raise TypeError(f"blockflow.fit_blocks: expected a Dask array or chunked xarray "
                        f"object, got {type(x).__name__}; for dataframes, repartition by "
                        f"rows (df.repartition(partition_size=...)).")
    free = smallest_free_memory(client)
    if free is None:
        logger.info("blockflow: fit_blocks found no cluster memory figures; blocks unchanged")
        return x, None
    budget = free[0] * (1 - safety)
    before = decompose._count
    if is_xarray:
        out = _xarray_fit(x, working_set, budget, axis, free)
        if free[1] == "device":  # GPU workers: grow small blocks to the size they want
            with dask.config.set({"blockflow.blocks.safety": safety}):
                target = device_block_target(client, working_set=device_ws)
            if target is not None:
                out = grow_xarray(out, target.nbytes, dim=axis, label="blockflow.fit_blocks")
    else:
        axes = None if axis is None else [_check_axis(axis, x.ndim)]
        found = _array_fit(x, working_set, budget, axes)
        if found is not None and found[0] == "nowhere":
            raise ValueError(_nowhere("blockflow.fit_blocks", found[1], working_set, free,
                                      safety))
        out = x if found is None else x.rechunk({found[0]: found[1]})
        if free[1] == "device":  # GPU workers: grow small blocks to the size they want
            with dask.config.set({"blockflow.blocks.safety": safety}):
                target = device_block_target(client, working_set=device_ws)
            if target is not None:
                out, _ = grow_blocks(out, target.nbytes, label="blockflow.fit_blocks",
                                     axis=None if axis is None else axes[0])
    return out, (decompose._records[-1] if decompose._count > before else None)


def _xarray_fit(obj, working_set, budget, dim, free):
    dim = _xarray_dim(obj, dim)
    if dim is None:
        return obj
    sizes = tuple(int(s) for s in obj.chunksizes[dim])
    rb = _xarray_row_bytes(obj, dim)
    r = _max_rows(rb, working_set, budget, max(sizes))
    if r == 0:
        raise ValueError(_nowhere("blockflow.fit_blocks", rb, working_set, free,
                                  1 - budget / free[0]))
    return _xarray_resize(obj, dim, lambda s, _: _fit_plan(s, r), "fit-device-memory")


def _nowhere(func: str, row_bytes, working_set, free, safety) -> str:
    need = working_set(int(row_bytes)) if callable(working_set) else working_set
    return (f"{func}: even a one-row block ({format_bytes(int(row_bytes))}) with its working "
            f"set ({format_bytes(int(need or 0))}) exceeds {1 - safety:.0%} of the smallest "
            f"worker's free {free[1]} memory ({format_bytes(free[0])}); lower the working "
            f"set, the safety margin (blockflow.blocks.safety), or use workers with more "
            f"memory.")


# -- what blockflow.map_blocks calls ------------------------------------------------------

def prepare_arrays(arrays: Sequence[da.Array], *, working_set=None, skip_axes=(),
                   label: str = "") -> list[da.Array]:
    """Re-cut aligned arrays before a blockwise stage (skew, then device memory); axes in
    ``skip_axes`` are never re-cut."""
    arrays = list(arrays)
    ndim = max(x.ndim for x in arrays)
    widest = max(arrays, key=lambda a: a.ndim)
    axes = [a for a in range(ndim) if a not in set(skip_axes)]
    if config.get("skew.enabled"):
        factor, floor, merge_below = _settings(None, None, None)
        found = _array_skew(widest, factor, floor, merge_below, axes, label)
        if found is not None:
            arrays = _rechunk_all(arrays, ndim, *found)
            widest = max(arrays, key=lambda a: a.ndim)
    if working_set is not None and config.get("blocks.fit-device-memory") == "auto":
        free = smallest_free_memory(host=False)
        if free is not None:
            budget = free[0] * (1 - float(config.get("blocks.safety")))
            found = _array_fit(widest, working_set, budget, axes, label)
            if found is not None and found[0] == "nowhere":  # leave it to the run time
                logger.info("blockflow: %s: no block size fits its working set in %s of "
                            "free %s memory; blocks unchanged", label or "map_blocks",
                            format_bytes(int(budget)), free[1])
            elif found is not None:
                arrays = _rechunk_all(arrays, ndim, *found)
    return arrays


def _rechunk_all(arrays, ndim: int, axis: int, sizes: tuple) -> list[da.Array]:
    out = []
    for x in arrays:
        a = axis - (ndim - x.ndim)
        if a >= 0 and x.shape[a] != 1 and tuple(x.chunks[a]) != tuple(sizes):
            x = x.rechunk({a: sizes})
        out.append(x)
    return out


def prepare_frames(frames: Sequence, *, label: str = "") -> list:
    """Split skewed partitions of a single dataframe whose lengths are cheap to know."""
    frames = list(frames)
    if not config.get("skew.enabled") or len(frames) != 1:
        return frames
    factor, floor, merge_below = _settings(None, None, None)
    return [_frame_skew(frames[0], factor, floor, merge_below, None, label)]


def prepare_xarray(objs: Sequence, *, working_set=None, label: str = "") -> list:
    """Re-cut argument 0 of an xarray stage along its chunked dimension, and the others
    alike."""
    objs = list(objs)
    main = objs[0]
    if config.get("skew.enabled"):
        factor, floor, merge_below = _settings(None, None, None)
        main = _xarray_resize(main, None, lambda s, rb: _skew_plan(
            s, rb, factor, floor, merge_below), "skew", label)
    if working_set is not None and config.get("blocks.fit-device-memory") == "auto" \
            and not callable(working_set):
        free = smallest_free_memory(host=False)
        dim = _xarray_dim(main)
        if free is not None and dim is not None:
            budget = free[0] * (1 - float(config.get("blocks.safety")))
            rb = _xarray_row_bytes(main, dim)
            r = _max_rows(rb, working_set, budget, max(main.chunksizes[dim]))
            if r:
                main = _xarray_resize(main, dim, lambda s, _: _fit_plan(s, r),
                                      "fit-device-memory", label)
    if main is objs[0]:
        return objs
    new = dict(main.chunksizes)
    out = [main]
    for o in objs[1:]:
        change = {d: new[d] for d in o.chunksizes if d in new and
                  tuple(o.chunksizes[d]) != tuple(new[d])}
        out.append(o.chunk(change) if change else o)
    return out
