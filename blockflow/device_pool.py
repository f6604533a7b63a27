"""The GPU workers' memory pool and threads: what ``connect(gpu=True)`` asks of dask-cuda.

:func:`gpu_cluster_kwargs` turns the settings ``blockflow.cluster.gpu-threads-per-worker``,
``gpu-memory-pool`` and ``gpu-pool-fraction`` into ``LocalCUDACluster`` arguments: worker
threads (each a task in flight on its own CUDA stream, :mod:`blockflow.device_streams`) and,
with RMM installed, dask-cuda's own RMM pool (``rmm_pool_size``, CuPy allocating from it
through ``rmm_allocator_external_lib_list``). Without RMM it returns :class:`CuPyPool`, the
worker plugin that enlarges CuPy's default memory pool up front (allocations of the pool's
initial size, freed back into the pool: a share for the default stream at set-up, one for
each worker thread's stream when it is made, as CuPy keeps freed memory per stream), so that
blocks allocate from cached device memory instead of ``cudaMalloc`` on the critical path. The same plugin serves clusters started
outside blockflow (``dask scheduler --preload blockflow.scheduling.preload``).

Guide: :doc:`/guide/clusters`, "GPU workers".
"""

from __future__ import annotations

import inspect
import logging
import numbers
from typing import Any, Collection

from dask.utils import format_bytes
from distributed.diagnostics.plugin import WorkerPlugin

from blockflow import config, device_streams
from blockflow import _distributed
from blockflow._distributed import POOL_FREE_METRIC, check_worker

__all__ = ["CuPyPool", "GPUPoolError", "enlarge_cupy_pool", "gpu_cluster_kwargs",
           "pool_settings"]

logger = logging.getLogger(__name__)


class GPUPoolError(RuntimeError):
    """A GPU memory pool that cannot be set up as the settings ask (one line: the setting
    and the fix)."""


def pool_settings(pool: Any = None, fraction: Any = None) -> tuple[str | bool, float]:
    """``(pool, fraction)``: the arguments, else ``blockflow.cluster.gpu-memory-pool`` and
    ``gpu-pool-fraction``, checked.

    Raises
    ------
    ValueError
        A pool other than "auto", "rmm", "cupy" or false, a fraction not in (0, 1].
    """
    pool = config.get("cluster.gpu-memory-pool", pool)
    fraction = config.get("cluster.gpu-pool-fraction", fraction)
    if not (pool is False or pool in ("auto", "rmm", "cupy")):
        raise ValueError(f"blockflow: the setting blockflow.cluster.gpu-memory-pool must be "
                         f"'auto', 'rmm', 'cupy' or false, got {pool!r}.")
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) \
            or not 0 < fraction <= 1:
        raise ValueError(f"blockflow: the setting blockflow.cluster.gpu-pool-fraction must be "
                         f"a fraction of device memory in (0, 1], e.g. 0.5, got {fraction!r}.")
    return pool, float(fraction)


def _cuda_cluster_arguments() -> frozenset:
    """The argument names ``dask_cuda.LocalCUDACluster`` takes (imported only here)."""
    from dask_cuda import LocalCUDACluster

    return frozenset(inspect.signature(LocalCUDACluster).parameters)


def gpu_cluster_kwargs(kwargs: dict, *, pool: Any = None, fraction: Any = None,
                       has_rmm: bool | None = None, accepts: Collection[str] | None = None,
                       device_memory: int | None = None, device_free: int | None = None
                       ) -> tuple[dict, CuPyPool | None]:
    """``LocalCUDACluster`` arguments for ``connect(gpu=True)``, and the worker plugin to
    install once it runs (None: none).

    Parameters
    ----------
    kwargs : dict
        What connect passes (None values dropped); the caller's own ``threads_per_worker``
        and ``rmm_*`` arguments win.
    pool, fraction : optional
        As :func:`pool_settings`.
    has_rmm : bool, optional
        Whether RMM is installed; default: looked up.
    accepts : collection of str, optional
        ``LocalCUDACluster``'s argument names; default: read from dask-cuda.
    device_memory, device_free : int, optional
        Bytes of memory, and free now, of the GPUs (the first one's); default: NVML's, when
        it answers.

    Returns
    -------
    (dict, CuPyPool or None)
        ``threads_per_worker`` defaults to ``blockflow.cluster.gpu-threads-per-worker``; with
        RMM (``auto`` or ``rmm``) ``rmm_pool_size`` is ``fraction`` of ``device_memory`` in
        bytes (a multiple of 256; the fraction itself, which recent dask-cuda reads as one,
        when the memory is unknown) and CuPy allocates from it
        (``rmm_allocator_external_lib_list``); otherwise (``auto`` without RMM or with a
        dask-cuda that cannot point CuPy at RMM, or ``cupy``) a :class:`CuPyPool` plugin.

    Raises
    ------
    GPUPoolError
        ``rmm`` asked but RMM is not installed; an RMM pool larger than the free memory.
    ValueError
        Invalid settings (:func:`pool_settings`) or threads per worker.
    """
    out = {k: v for k, v in kwargs.items() if v is not None}
    threads = config.get("cluster.gpu-threads-per-worker", out.get("threads_per_worker"))
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads < 1:
        raise ValueError(f"blockflow: the setting blockflow.cluster.gpu-threads-per-worker "
                         f"must be an integer >= 1 (tasks in flight per GPU), got {threads!r}.")
    out["threads_per_worker"] = int(threads)
    pool, fraction = pool_settings(pool, fraction)
    if pool is False or any(k.startswith("rmm_") for k in out):
        return out, None  # no pool, or the caller set up RMM: theirs rules
    if has_rmm is None:
        from blockflow.backends import has_package
        has_rmm = has_package("rmm")
    if pool == "rmm" and not has_rmm:
        raise GPUPoolError(
            "blockflow.connect(gpu=True): the setting blockflow.cluster.gpu-memory-pool is "
            "'rmm' but RMM is not installed; install it (`pip install rmm-cu12`) or set "
            "gpu-memory-pool to 'auto' or 'cupy'.")
    if has_rmm and pool != "cupy":
        accepts = _cuda_cluster_arguments() if accepts is None else accepts
        if pool == "auto" and "rmm_allocator_external_lib_list" not in accepts:
            has_rmm = False  # this dask-cuda cannot have CuPy allocate from its RMM pool
    if pool == "cupy" or not has_rmm:
        return out, CuPyPool(fraction)
    if device_memory is None:
        device_memory, device_free = _device_memory()
    size = int(fraction * device_memory) // 256 * 256 if device_memory else None
    if size is not None and device_free is not None and size > device_free:
        raise GPUPoolError(
            f"blockflow.connect(gpu=True): the GPUs' RMM pool asks for {format_bytes(size)} "
            f"(blockflow.cluster.gpu-pool-fraction {fraction:g} of {format_bytes(device_memory)})"
            f" but only {format_bytes(device_free)} are free; lower gpu-pool-fraction or set "
            f"blockflow.cluster.gpu-memory-pool to false.")
    out["rmm_pool_size"] = fraction if size is None else size
    if "rmm_allocator_external_lib_list" in accepts:
        out["rmm_allocator_external_lib_list"] = ["cupy"]
    return out, None


def _device_memory() -> tuple[int | None, int | None]:
    """``(total, free)`` bytes of this process's first GPU from NVML; None where unknown."""
    from blockflow.devices import device_handle

    handle = device_handle()
    if handle is None:
        return None, None
    try:
        import pynvml

        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.total), int(info.free)
    except Exception:  # NVML without the answer: the pool as a fraction
        return None, None


def enlarge_cupy_pool(fraction: float, where: str = "this worker", threads: int = 1
                      ) -> int | None:
    """Grow CuPy's default memory pool on the current device to ``fraction`` of its memory,
    up front, in ``threads + 1`` equal shares: one now on the current stream (for tasks on
    the default stream), one on each worker thread's own stream when it is made
    (:func:`blockflow.device_streams.reserve_per_stream`; CuPy keeps freed memory per stream).
    Each share is one allocation freed back into the pool, which CuPy splits for later
    allocations.

    Returns
    -------
    int or None
        Bytes the pool is to grow by (0: it was that large already); None when there is
        nothing to do: no CuPy, no device, or CuPy allocating through another allocator
        (RMM).

    Raises
    ------
    GPUPoolError
        The device has less free memory than the pool asks.
    """
    from blockflow.backends import has_package
    from blockflow.devices import device_handle

    if not has_package("cupy") or device_handle() is None:
        return None
    import cupy

    try:
        free, total = cupy.cuda.runtime.memGetInfo()
    except Exception:  # CuPy without a usable device here
        return None
    pool = cupy.get_default_memory_pool()
    if getattr(cupy.cuda.get_allocator(), "__self__", None) is not pool:
        return None  # CuPy allocates elsewhere (an RMM pool): that pool is the pool
    size = int(fraction * total)
    need = size - int(pool.total_bytes())
    if need <= 0:
        return 0
    if need > free:
        raise GPUPoolError(
            f"blockflow: the GPU memory pool of {where} asks for {format_bytes(size)} "
            f"(blockflow.cluster.gpu-pool-fraction {fraction:g} of the device's "
            f"{format_bytes(total)}) but only {format_bytes(free)} are free; lower "
            f"gpu-pool-fraction or set blockflow.cluster.gpu-memory-pool to false.")
    threads = max(int(threads), 1)
    share = need // (threads + 1)
    device_streams.reserve_per_stream(share, threads)
    device_streams.grow_pool(cupy, None, share, where)
    logger.info("blockflow: CuPy's memory pool on %s grows to %s (%d shares of %s)", where,
                format_bytes(size), threads + 1, format_bytes(share))
    return need


class CuPyPool(WorkerPlugin):
    """Worker plugin: CuPy's default memory pool enlarged to ``fraction`` of the device's
    memory at set-up (:func:`enlarge_cupy_pool`); nothing, and nothing said, on a worker
    without CuPy or a GPU.

    Parameters
    ----------
    fraction : float, optional
        Default ``blockflow.cluster.gpu-pool-fraction`` where the plugin is made.
    """

    name = "blockflow-gpu-memory-pool"
    idempotent = True

    def __init__(self, fraction: float | None = None):
        self.fraction = pool_settings(fraction=fraction)[1]
        self.added: int | None = None  # bytes the set-up added, on the worker

    def setup(self, worker) -> None:
        check_worker(worker)
        self.added = enlarge_cupy_pool(self.fraction, where=f"worker {worker.name!r}",
                                       threads=getattr(worker, "nthreads", 1))
        if self.added is not None:  # CuPy's own pool: what it holds unused is free to blocks
            pool_free = device_streams.pool_free_metric()
            if pool_free is not None:
                _distributed.set_worker_metric(worker, POOL_FREE_METRIC, pool_free)
