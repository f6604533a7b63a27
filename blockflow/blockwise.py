"""Blockwise kernels: run a per-block function over dask arrays, dataframes and xarray objects.

:func:`map_blocks` is a thin layer over :meth:`dask.array.map_blocks`,
:meth:`dask.dataframe.DataFrame.map_partitions` and :func:`xarray.map_blocks`. It keeps
Dask's laziness and metadata and adds three things: the input is checked (with errors that
say how to fix it), tasks are named ``blockflow-<kernel>`` so blockflow's scheduler plugin
recognises its kernels, and an exception inside a kernel names the block that failed.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import dask.array as da
import dask.dataframe as dd
import numpy as np
from dask.utils import funcname

from blockflow.errors import BlockKernelError, EmptyCollectionError, describe, not_a_collection

__all__ = ["KERNEL_PREFIX", "kernel_name", "map_blocks", "validate_array"]

#: Prefix of the task names of blockflow kernels (the scheduler plugin keys on it).
KERNEL_PREFIX = "blockflow-"


def kernel_name(kernel: Callable, name: str | None = None) -> str:
    """Task-name prefix of a kernel: ``blockflow-<name or the kernel's name>``."""
    base = name or funcname(kernel)
    base = base.replace("_", "-").strip("-").lower() or "kernel"
    return base if base.startswith(KERNEL_PREFIX) else KERNEL_PREFIX + base


def _wants(func: Callable, keyword: str) -> bool:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
    return keyword in params


def _fail(kernel_label: str, where: str, exc: BaseException) -> BlockKernelError:
    err = BlockKernelError(
        f"blockflow kernel {kernel_label!r} failed on {where}: {type(exc).__name__}: {exc}"
    )
    err.__cause__ = exc
    return err


class _Kernel:
    """Picklable wrapper that runs the user's kernel on one block and labels failures."""

    def __init__(self, kernel: Callable, name: str):
        self.kernel = kernel
        self.__name__ = name  # dask.utils.funcname -> task names start with "blockflow-"
        self.label = funcname(kernel)

    def __repr__(self) -> str:
        return f"<blockflow kernel {self.label}>"


class _ArrayKernel(_Kernel):
    def __init__(self, kernel, name, *, dtype=None, ndim=None):
        super().__init__(kernel, name)
        self.pass_block_id = _wants(kernel, "block_id")
        self.dtype = np.dtype(dtype) if dtype is not None else None
        self.ndim = ndim
        # Set after the output collection is built (before any task runs) so each block's
        # result can be checked against the chunk shape Dask expects.
        self.expected_chunks: tuple[tuple[int, ...], ...] | None = None

    def __call__(self, *blocks, block_id=None, **kwargs):
        if self.pass_block_id:
            kwargs["block_id"] = block_id
        if block_id is None:  # metadata inference on empty blocks: let Dask handle errors
            return self.kernel(*blocks, **kwargs)
        try:
            out = self.kernel(*blocks, **kwargs)
        except Exception as e:
            raise _fail(self.label, f"block {tuple(block_id)}", e) from e
        self._check(out, block_id)
        return out

    def _check(self, out, block_id):
        shape = getattr(out, "shape", None)
        if shape is None:
            return
        where = f"block {tuple(block_id)}"
        if self.ndim is not None and len(shape) != self.ndim:
            raise BlockKernelError(
                f"blockflow kernel {self.label!r} returned a {len(shape)}-d block for {where}, "
                f"but the output is declared {self.ndim}-d; pass chunks=/drop_axis=/new_axis= "
                f"to map_blocks to declare the shape it returns."
            )
        if self.dtype is not None and getattr(out, "dtype", self.dtype) != self.dtype:
            raise BlockKernelError(
                f"blockflow kernel {self.label!r} returned dtype {out.dtype} for {where}, but "
                f"the output is declared {self.dtype}; cast inside the kernel or pass "
                f"dtype={out.dtype}/meta= to map_blocks."
            )
        if self.expected_chunks is not None and len(block_id) == len(self.expected_chunks):
            expected = tuple(c[i] for c, i in zip(self.expected_chunks, block_id))
            if tuple(shape) != expected:
                raise BlockKernelError(
                    f"blockflow kernel {self.label!r} returned shape {tuple(shape)} for {where}, "
                    f"but Dask expects {expected} from the output chunks; pass chunks= to "
                    f"map_blocks to declare the block shapes it returns."
                )


class _ArrayKernelWithInfo(_ArrayKernel):
    def __call__(self, *blocks, block_id=None, block_info=None, **kwargs):
        return super().__call__(*blocks, block_id=block_id, block_info=block_info, **kwargs)


class _PartitionKernel(_Kernel):
    def __init__(self, kernel, name):
        super().__init__(kernel, name)
        self.pass_info = _wants(kernel, "partition_info")

    def __call__(self, *parts, partition_info=None, **kwargs):
        if self.pass_info:
            kwargs["partition_info"] = partition_info
        if partition_info is None:  # metadata emulation on sample partitions
            return self.kernel(*parts, **kwargs)
        try:
            return self.kernel(*parts, **kwargs)
        except Exception as e:
            raise _fail(self.label, f"partition {partition_info['number']}", e) from e


class _XarrayKernel(_Kernel):
    def __call__(self, *objs, **kwargs):
        try:
            return self.kernel(*objs, **kwargs)
        except Exception as e:
            raise _fail(self.label, f"the block at {_xarray_block_label(objs[0])}", e) from e


def _xarray_block_label(obj) -> str:
    parts = []
    for dim in obj.dims:
        if dim in obj.indexes and obj.sizes[dim]:
            idx = obj.indexes[dim]
            parts.append(f"{dim}={idx[0]}..{idx[-1]}")
        else:
            parts.append(f"{dim}[{obj.sizes[dim]}]")
    return "{" + ", ".join(parts) + "}"


def validate_array(x: da.Array, func: str, position: str = "argument 0") -> None:
    """Check that a dask array has known chunk sizes and at least one element.

    Raises
    ------
    ValueError
        If a chunk size is unknown (NaN); the message says to call ``compute_chunk_sizes()``.
    EmptyCollectionError
        If the array has no elements.
    """
    for axis, c in enumerate(x.chunks):
        if any(isinstance(s, float) and math.isnan(s) for s in c):
            raise ValueError(
                f"{func}: {position} has unknown (NaN) chunk sizes along axis {axis}; "
                f"call x = x.compute_chunk_sizes() first so blocks can be placed and sized."
            )
    if x.size == 0:
        raise EmptyCollectionError(
            f"{func}: {position} is empty (shape {x.shape}); there are no blocks to run on."
        )


def _kind(obj) -> str | None:
    if isinstance(obj, da.Array):
        return "array"
    if isinstance(obj, (dd.DataFrame, dd.Series)):
        return "dataframe"
    mod = type(obj).__module__.split(".")[0]
    if mod == "xarray":
        import xarray as xr

        if isinstance(obj, (xr.DataArray, xr.Dataset)):
            return "xarray"
    return None


def map_blocks(
    kernel: Callable,
    *collections: Any,
    name: str | None = None,
    dtype: Any = None,
    meta: Any = None,
    chunks: Any = None,
    drop_axis: Any = None,
    new_axis: Any = None,
    template: Any = None,
    **kwargs: Any,
):
    """Run ``kernel`` on every block of one or more Dask collections, lazily.

    The same kernel runs on NumPy/pandas blocks on CPU workers and on CuPy/cuDF blocks on GPU
    workers: find the right module inside the kernel with
    :func:`blockflow.backends.array_module` / :func:`~blockflow.backends.dataframe_module`.

    Parameters
    ----------
    kernel : callable
        ``kernel(*blocks, **kwargs) -> block``. Array kernels may take ``block_id`` (tuple of
        block indices) or ``block_info``; dataframe kernels may take ``partition_info``
        (``{"number": int, "division": object}``), as in Dask.
    *collections : dask.array.Array, dask.dataframe.DataFrame/Series, or xarray object
        The inputs, all of one kind. Arrays of the same dimensionality must have identical
        chunks; dataframes the same number of partitions; xarray objects are aligned by
        :func:`xarray.map_blocks`.
    name : str, optional
        Task-name prefix; default ``blockflow-<kernel name>``. Always starts with
        ``blockflow-`` so the scheduler plugin recognises the tasks.
    dtype, meta, chunks, drop_axis, new_axis : optional
        Arrays: as in :func:`dask.array.map_blocks`. When given, every block's dtype, ndim
        and shape are checked against them at run time. ``meta`` also applies to dataframes
        (as in ``map_partitions``).
    template : xarray object, optional
        Xarray: the output template, as in :func:`xarray.map_blocks`.
    **kwargs
        Passed to ``kernel`` unchanged.

    Returns
    -------
    dask.array.Array, dask.dataframe.DataFrame/Series, or xarray object
        Lazy result with one block per input block.

    Raises
    ------
    TypeError
        If an input is not a Dask collection (e.g. a NumPy array or pandas frame: the message
        says how to wrap it) or inputs are of different kinds.
    ValueError
        If array chunk sizes are unknown (NaN), or chunks / partition counts of the inputs
        differ (the message names the inputs and axis).
    EmptyCollectionError
        If an input array has no elements.
    BlockKernelError
        At compute time, if the kernel raises on a block: the message names the block and the
        original exception.

    Examples
    --------
    >>> import dask.array as da, blockflow
    >>> x = da.ones((100, 100), chunks=50)
    >>> blockflow.map_blocks(lambda b: b * 2, x).sum().compute()
    20000.0
    """
    if not callable(kernel):
        raise TypeError(
            f"blockflow.map_blocks: the kernel must be callable, got {describe(kernel)}; "
            f"call map_blocks(kernel, *collections)."
        )
    if not collections:
        raise TypeError("blockflow.map_blocks: give at least one Dask collection after the kernel.")
    kinds = []
    for i, c in enumerate(collections):
        k = _kind(c)
        if k is None:
            raise not_a_collection("blockflow.map_blocks", f"argument {i}", c)
        kinds.append(k)
    if len(set(kinds)) > 1:
        raise TypeError(
            f"blockflow.map_blocks: all inputs must be of one kind, got {kinds}; convert them "
            f"first (e.g. xarray_obj.data for its dask array)."
        )
    task_name = kernel_name(kernel, name)
    kind = kinds[0]
    if kind == "array":
        return _map_arrays(kernel, collections, task_name, dtype, meta, chunks, drop_axis,
                           new_axis, kwargs)
    if kind == "dataframe":
        return _map_partitions(kernel, collections, task_name, meta, kwargs)
    return _map_xarray(kernel, collections, task_name, template, kwargs)


def _map_arrays(kernel, arrays, task_name, dtype, meta, chunks, drop_axis, new_axis, kwargs):
    for i, x in enumerate(arrays):
        validate_array(x, "blockflow.map_blocks", f"argument {i}")
    first = arrays[0]
    for i, x in enumerate(arrays[1:], start=1):
        if x.ndim == first.ndim and x.chunks != first.chunks:
            axis = next(a for a in range(x.ndim) if x.chunks[a] != first.chunks[a])
            raise ValueError(
                f"blockflow.map_blocks: arguments 0 and {i} have different chunks along axis "
                f"{axis}: {first.chunks[axis]} vs {x.chunks[axis]}; rechunk one to match, e.g. "
                f"y = y.rechunk(x.chunks)."
            )
    declared_dtype = dtype if dtype is not None else getattr(meta, "dtype", None)
    ndim = None
    if meta is not None and hasattr(meta, "ndim"):
        ndim = meta.ndim
    elif drop_axis is None and new_axis is None and chunks is None:
        ndim = max(x.ndim for x in arrays)
    wants_info = _wants(kernel, "block_info")
    cls = _ArrayKernelWithInfo if wants_info else _ArrayKernel
    wrapped = cls(kernel, task_name, dtype=declared_dtype, ndim=ndim)
    opts = {}
    for k, v in dict(dtype=dtype, meta=meta, chunks=chunks, drop_axis=drop_axis,
                     new_axis=new_axis).items():
        if v is not None:
            opts[k] = v
    out = da.map_blocks(wrapped, *arrays, token=task_name, **opts, **kwargs)
    wrapped.expected_chunks = out.chunks
    return out


def _map_partitions(kernel, frames, task_name, meta, kwargs):
    first = frames[0]
    for i, f in enumerate(frames[1:], start=1):
        if f.npartitions != first.npartitions:
            raise ValueError(
                f"blockflow.map_blocks: arguments 0 and {i} have {first.npartitions} and "
                f"{f.npartitions} partitions; repartition one to match, e.g. "
                f"b = b.repartition(npartitions=a.npartitions)."
            )
    wrapped = _PartitionKernel(kernel, task_name)
    opts = {} if meta is None else {"meta": meta}
    return first.map_partitions(wrapped, *frames[1:], **opts, **kwargs)


def _map_xarray(kernel, objs, task_name, template, kwargs):
    import xarray as xr

    for i, o in enumerate(objs):
        if not o.chunks:
            raise not_a_collection("blockflow.map_blocks", f"argument {i}", o)
    wrapped = _XarrayKernel(kernel, task_name)
    return xr.map_blocks(wrapped, objs[0], args=list(objs[1:]), kwargs=kwargs, template=template)
