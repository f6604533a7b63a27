"""Blockwise kernels: run a per-block function over dask arrays, dataframes and xarray objects.

:func:`map_blocks` wraps :meth:`dask.array.map_blocks`,
:meth:`dask.dataframe.DataFrame.map_partitions` and :func:`xarray.map_blocks`, adding input
checks, ``blockflow-<kernel>`` task names, errors naming the failed block, and a check of
each returned block against the declared output. Guide: docs/guide/data.md.
"""

from __future__ import annotations

import itertools
import logging
import math
import warnings
from typing import Any, Callable

import dask.array as da
import dask.dataframe as dd
import numpy as np
from dask.array.core import apply_infer_dtype
from dask.array.utils import compute_meta, meta_from_array
from dask.utils import funcname, parse_bytes
from distributed import default_client

from blockflow import block_sizing
from blockflow.block_kernels import (
    _ArrayKernel,
    _ArrayKernelWithInfo,
    _is_array,
    _PartitionKernel,
    _wants,
    _XarrayKernel,
)
from blockflow.core.kernel import check_placement, check_retries
from blockflow.device_blocks import advise_blocks, note_gpu_workers
from blockflow.errors import (
    BlockflowWarning,
    EmptyCollectionError,
    describe,
    not_a_collection,
)
from blockflow.scheduling.actions import KERNEL_PREFIX  # the scheduling vocabulary's name
from blockflow.scheduling.view import worker_memory

__all__ = ["KERNEL_PREFIX", "check_retries", "kernel_name", "map_blocks", "validate_array"]

logger = logging.getLogger(__name__)


def kernel_name(kernel: Callable, name: str | None = None) -> str:
    """Task-name prefix of a kernel: ``blockflow-<name or the kernel's name>``."""
    base = name or funcname(kernel)
    base = base.replace("_", "-").strip("-").lower() or "kernel"
    return base if base.startswith(KERNEL_PREFIX) else KERNEL_PREFIX + base


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
    retries: int | None = None,
    working_set: int | str | Callable[[int], int] | None = None,
    resources: dict[str, float] | None = None,
    workers: str | list[str] | None = None,
    allow_other_workers: bool | None = None,
    speculative: bool | None = None,
    **kwargs: Any,
):
    """Run ``kernel`` on every block of one or more Dask collections, lazily.

    The same kernel runs on NumPy/pandas blocks on CPU workers and CuPy/cuDF blocks on GPU
    workers (:func:`blockflow.backends.array_module`).

    Parameters
    ----------
    kernel : callable
        ``kernel(*blocks, **kwargs) -> block``. Array kernels may take ``block_id`` or
        ``block_info``; dataframe kernels ``partition_info``, as in Dask.
    *collections : dask.array.Array, dask.dataframe.DataFrame/Series, or xarray object
        Inputs of one kind whose blocks pair up one to one. Arrays align from the right
        (length-1 axes broadcast, other axes chunked alike); dataframes have equal partition
        counts; xarray arguments are chunked like argument 0.
    name : str, optional
        Task-name prefix; default ``blockflow-<kernel name>`` (always ``blockflow-...``).
    dtype, meta, chunks, drop_axis, new_axis : optional
        As in :func:`dask.array.map_blocks`, but the kernel runs once per block
        (``drop_axis`` and ``chunks`` may not merge or split blocks). Returned blocks are
        checked against the declared dtype, ndim and shape, partitions against ``meta``.
    template : xarray object, optional
        Xarray: the output template, as in :func:`xarray.map_blocks`.
    working_set : int, str or callable, optional
        Device memory, in bytes, the kernel needs for one block (``"2GiB"`` accepted), or
        ``working_set(block nbytes) -> bytes`` (arrays only); blocks are placed where they
        fit. Ignored with a ``BlockflowWarning`` without GPU workers.
    retries : int, optional
        Extra attempts, in place inside the task, of a block whose kernel raises (default
        0); ``1 + max(retries, d)`` in all under ``client.compute(..., retries=d)``.
    resources : dict of str to float, optional
        Worker resources each block's task needs, e.g. ``{"GPU": 1}``; survives graph
        optimisation. Unsatisfiable ones fail after
        ``blockflow.resources.unsatisfiable-timeout`` with :class:`~blockflow.ResourceError`.
    workers : str or list of str, optional
        Workers that may run the kernel's tasks (distributed's ``workers=``).
    allow_other_workers : bool, optional
        With ``workers``: others may run the tasks when those cannot.
    speculative : bool, optional
        Whether a straggling block may get a backup copy (default True, with
        ``blockflow.speculation.enabled``); pass False for kernels that are not idempotent.
    **kwargs
        Passed to ``kernel`` whole, not split into blocks.

    Returns
    -------
    dask.array.Array, dask.dataframe.DataFrame/Series, or xarray object
        Lazy result with one block per input block, after any re-cut (see Notes).

    Raises
    ------
    TypeError
        If an input is not a Dask collection, inputs are of different kinds, or a
        declaration does not apply to the inputs' kind.
    ValueError
        If chunk sizes are unknown, inputs' chunks or partition counts differ, an axis or
        ``chunks`` would merge or split blocks, or ``retries``, ``resources``, ``workers``
        or ``allow_other_workers`` is invalid.
    EmptyCollectionError
        If an input array has no elements.
    BlockKernelError
        At compute time, if the kernel raises on its last attempt or returns something other
        than declared.
    DeviceMemoryError
        At compute time, if the kernel runs out of device memory and no worker has room.

    Notes
    -----
    Blocks may be re-cut along one axis first (:mod:`blockflow.decompose`,
    :mod:`blockflow.block_sizing`; config ``blockflow.skew.*`` and ``blockflow.blocks.*``);
    block indices are those of the new blocks.

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
        raise TypeError(
            "blockflow.map_blocks: give at least one Dask collection after the kernel.")
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
    retries = check_retries(retries, "blockflow.map_blocks")
    placement = check_placement(resources, workers, allow_other_workers, "blockflow.map_blocks")
    if speculative is not None and not isinstance(speculative, bool):
        raise TypeError(f"blockflow.map_blocks: speculative must be True or False (whether "
                        f"a straggling block may get a backup copy), got {speculative!r}.")
    task_name = kernel_name(kernel, name)
    kind = kinds[0]
    working_set = _check_working_set(working_set, kind)
    _warn_working_set_without_gpu(working_set)
    _check_options(kind, dtype=dtype, meta=meta, chunks=chunks, drop_axis=drop_axis,
                   new_axis=new_axis, template=template)
    if kind == "array":
        return _map_arrays(kernel, collections, task_name, dtype, meta, chunks, drop_axis,
                           new_axis, kwargs, retries, working_set, placement,
                           speculative=speculative is not False)
    if kind == "dataframe":
        return _map_partitions(kernel, collections, task_name, meta, kwargs, retries,
                               working_set, placement, speculative=speculative is not False)
    return _map_xarray(kernel, collections, task_name, template, kwargs, retries, working_set,
                       placement, speculative=speculative is not False)


def _check_working_set(working_set, kind: str):
    """``working_set=`` as bytes (int) or a callable (arrays only); a clear error otherwise."""
    if working_set is None:
        return None
    if callable(working_set):
        if kind != "array":
            raise TypeError(
                f"blockflow.map_blocks: working_set= as a callable of the block's size needs "
                f"block sizes known before computing, which {kind} inputs do not have; give "
                f"the bytes a block needs, e.g. working_set='2GiB'.")
        return working_set
    try:
        nbytes = parse_bytes(working_set) if isinstance(working_set, str) else working_set
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 1:
            raise ValueError(working_set)
    except (ValueError, TypeError):
        raise ValueError(
            f"blockflow.map_blocks: working_set must be a number of bytes >= 1, a size such "
            f"as '2GiB', or a callable of the block's bytes, got {working_set!r}.") from None
    return int(nbytes)


def _warn_working_set_without_gpu(working_set) -> None:
    """Warn that ``working_set=`` is not applied on a cluster without GPU workers."""
    if working_set is None:
        return
    try:
        client = default_client()
    except ValueError:
        return
    if client.status != "running" or client.asynchronous:  # no synchronous question
        return
    memory = worker_memory(client)
    note_gpu_workers(client, any(m.has_device for m in memory.values()))  # for the advice
    if memory and not any(m.has_device for m in memory.values()):
        warnings.warn(
            "blockflow.map_blocks: working_set= is the device (GPU) memory a block needs, "
            f"and none of the cluster's {len(memory)} workers has a GPU, so it is not "
            "applied (blocks are neither placed nor split by it; host memory is managed by "
            "the workers' memory_limit and spilling): drop working_set= on CPU clusters, "
            "or run on GPU workers.", BlockflowWarning, stacklevel=3)


def _block_working_sets(working_set, x) -> dict[tuple, int] | int | None:
    """Per block index of ``x``, the bytes ``working_set(block nbytes)`` declares."""
    if not callable(working_set):
        return working_set
    itemsize = x.dtype.itemsize
    out = {}
    for index in itertools.product(*(range(len(c)) for c in x.chunks)):
        nbytes = itemsize * math.prod(x.chunks[a][i] for a, i in enumerate(index))
        value = working_set(nbytes)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer, float)) \
                or not value >= 0:
            raise ValueError(
                f"blockflow.map_blocks: working_set({nbytes}) for block {index} returned "
                f"{value!r}; it must return a number of bytes >= 0.")
        out[index] = int(value)
    return out


#: The output declarations each kind of input uses, and how to name them in messages.
_OPTIONS = {
    "array": (("dtype", "meta", "chunks", "drop_axis", "new_axis"), "dask array",
              "dtype=, meta=, chunks=, drop_axis= or new_axis="),
    "dataframe": (("meta",), "dataframe", "meta="),
    "xarray": (("template",), "xarray", "template="),
}


def _check_options(kind: str, **options) -> None:
    """Refuse output declarations that do not apply to the inputs' kind."""
    used, label, instead = _OPTIONS[kind]
    unused = [f"{k}=" for k, v in options.items() if v is not None and k not in used]
    if unused:
        raise TypeError(
            f"blockflow.map_blocks: {', '.join(unused)} {'is' if len(unused) == 1 else 'are'} "
            f"not used for {label} inputs; declare the output with {instead} instead."
        )


def _map_arrays(kernel, arrays, task_name, dtype, meta, chunks, drop_axis, new_axis, kwargs,
                retries=0, working_set=None, placement=None, speculative=True):
    for i, x in enumerate(arrays):
        validate_array(x, "blockflow.map_blocks", f"argument {i}")
    _check_aligned_chunks(arrays)
    ndim = max(x.ndim for x in arrays)
    drop = _axes(drop_axis, ndim, "drop_axis", "input") if drop_axis is not None else []
    _check_dropped_axes(arrays, drop, drop_axis)
    if chunks is None:  # declared output chunks pin the input's: never re-cut then
        arrays = block_sizing.prepare_arrays(arrays, working_set=working_set, skip_axes=drop,
                                          label=task_name)
    # blocks far below what GPU workers want: one advisory line (never a silent re-cut)
    advise_blocks(max(arrays, key=lambda a: a.ndim), "blockflow.map_blocks",
                  working_set=working_set, alike=len(arrays) > 1)
    kept = ndim - len(drop)
    if new_axis is not None:
        new_ndim = kept + (1 if _is_int(new_axis) else len(_axis_list(new_axis, "new_axis")))
        new = _axes(new_axis, new_ndim, "new_axis", "output")
    elif chunks is not None and len(chunks) > kept:  # Dask adds the leading axes as new
        new = list(range(len(chunks) - kept))
    else:
        new = []
    # Pass the normalised axes: Dask inserts a negative new_axis at the wrong place.
    drop_axis = drop or None
    new_axis = new if new_axis is not None else None
    declared_dtype = dtype if dtype is not None else getattr(meta, "dtype", None)
    wants_info = _wants(kernel, "block_info")
    cls = _ArrayKernelWithInfo if wants_info else _ArrayKernel
    widest = max(arrays, key=lambda a: a.ndim)
    declared_ws = _block_working_sets(working_set, widest)
    if isinstance(declared_ws, dict) and (drop or new):
        declared_ws = max(declared_ws.values(), default=None)  # output blocks differ
    wrapped = cls(kernel, task_name, dtype=declared_dtype, retries=retries,
                  working_set=declared_ws, placement=placement)
    if not speculative:
        wrapped.speculative = False
    if meta is None:  # Dask would call the kernel twice (meta, then dtype) to infer these
        dtype, meta = _infer_output(wrapped, arrays, dtype, kept + len(new), kwargs)
    opts = {}
    for k, v in dict(dtype=dtype, meta=meta, chunks=chunks, drop_axis=drop_axis,
                     new_axis=new_axis).items():
        if v is not None:
            opts[k] = v
    out = da.map_blocks(wrapped, *arrays, token=task_name, **opts, **kwargs)
    # Dask works out the output's dimensions (meta=np.array((), dtype=...) is 1-d whatever
    # the output): check blocks against those, as against its chunks.
    wrapped.ndim, wrapped.expected_chunks = out.ndim, out.chunks
    _check_new_axes(out, new)
    return out


def _infer_output(wrapped, arrays, dtype, ndim: int, kwargs) -> tuple[Any, Any]:
    """``(dtype, meta)`` of a kernel's output blocks, with one call of the kernel at most.

    With ``dtype`` declared the kernel is not called: ``meta`` is an empty array of the
    inputs' type (the first input not on NumPy, else argument 0) and that dtype. Without
    it, the kernel runs once on the inputs' empty blocks (Dask's ``compute_meta``); only when
    that call fails or returns no array does Dask's dtype inference run it on one-element
    blocks (``apply_infer_dtype``: its ValueError names the fix, ``dtype=``).
    """
    source = next((a for a in arrays if type(a._meta).__module__.split(".")[0] != "numpy"),
                  arrays[0])
    if dtype is None:
        meta = compute_meta(wrapped, None, *arrays, **kwargs)
        if _is_array(meta) and isinstance(getattr(meta, "dtype", None), np.dtype):
            return meta.dtype, meta
        dtype = apply_infer_dtype(wrapped, arrays, kwargs, "blockflow.map_blocks")
    return dtype, meta_from_array(source, ndim=ndim, dtype=dtype)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _axis_list(value, option: str) -> list:
    """``drop_axis``/``new_axis`` as a list: an int, or a sequence of ints."""
    if _is_int(value):
        return [value]
    try:
        items = list(value)
    except TypeError:
        items = None
    if items is None or not all(_is_int(a) for a in items):
        raise TypeError(
            f"blockflow.map_blocks: {option}= must be an int or a sequence of ints, got "
            f"{value!r}; e.g. {option}=0 or {option}=(0, 1)."
        )
    return items


def _axes(value, ndim: int, option: str, of: str) -> list[int]:
    """``drop_axis``/``new_axis`` as sorted axes ``0 <= a < ndim``."""
    items = _axis_list(value, option)
    for a in items:
        if not -ndim <= a < ndim:
            raise ValueError(
                f"blockflow.map_blocks: {option}={value!r} is out of range for the {ndim}-d "
                f"{of}; give axes from {-ndim} to {ndim - 1}."
            )
    axes = sorted(int(a) % ndim for a in items)
    if len(set(axes)) != len(axes):
        raise ValueError(
            f"blockflow.map_blocks: {option}={value!r} names an axis more than once; give "
            f"each axis once."
        )
    return axes


def _check_aligned_chunks(arrays) -> None:
    """Refuse arrays whose blocks do not pair up one to one (axes aligned from the right,
    length-1 axes broadcasting)."""
    ndim = max(x.ndim for x in arrays)
    for axis in range(ndim):
        ref = None
        for i, x in enumerate(arrays):
            a = axis - (ndim - x.ndim)
            if a < 0 or x.shape[a] == 1:
                continue
            if ref is None:
                ref = (i, x, a)
                continue
            j, first, b = ref
            if x.chunks[a] == first.chunks[b]:
                continue
            if x.ndim == first.ndim == ndim:
                where = f"axis {axis}"
            else:
                where = (f"axis {axis} of the output (axis {b} of argument {j}, axis {a} of "
                         f"argument {i}; axes align from the right, as in NumPy broadcasting)")
            fix = ("y = y.rechunk(x.chunks)" if x.shape == first.shape
                   else f"y = y.rechunk({{{a}: x.chunks[{b}]}})")
            raise ValueError(
                f"blockflow.map_blocks: arguments {j} and {i} have different chunks along "
                f"{where}: {first.chunks[b]} vs {x.chunks[a]}; rechunk one to match, e.g. "
                f"{fix}."
            )


def _check_dropped_axes(arrays, drop: list[int], drop_axis) -> None:
    """Refuse a dropped axis split into several blocks (one kernel call per block)."""
    ndim = max(x.ndim for x in arrays)
    for axis in drop:
        for i, x in enumerate(arrays):
            a = axis - (ndim - x.ndim)
            if a < 0 or len(x.chunks[a]) == 1:
                continue
            where = f"axis {axis}" if a == axis else f"axis {axis} (its axis {a})"
            raise ValueError(
                f"blockflow.map_blocks: drop_axis={drop_axis!r} drops {where}, along which "
                f"argument {i} has {len(x.chunks[a])} blocks {x.chunks[a]}; Dask would join "
                f"them into one kernel call, but map_blocks runs one call per block. Rechunk "
                f"that axis to one block first (x = x.rechunk({{{a}: -1}})) or reduce along "
                f"it with blockflow.tree_reduce."
            )


def _check_new_axes(out, new: list[int]) -> None:
    """Refuse a new axis split into several blocks."""
    for axis in new:
        c = out.chunks[axis]
        if len(c) > 1:
            raise ValueError(
                f"blockflow.map_blocks: chunks= splits new axis {axis} into {len(c)} blocks "
                f"{c}, so the kernel would run {len(c)} times on each input block, but "
                f"map_blocks runs one call per block. Give the new axis one block "
                f"(chunks {(sum(c),)} along it) and rechunk the result afterwards if needed "
                f"(y = y.rechunk({{{axis}: {c[0]}}}))."
            )


def _map_partitions(kernel, frames, task_name, meta, kwargs, retries=0, working_set=None,
                    placement=None, speculative=True):
    first = frames[0]
    for i, f in enumerate(frames[1:], start=1):
        if f.npartitions != first.npartitions:
            raise ValueError(
                f"blockflow.map_blocks: arguments 0 and {i} have {first.npartitions} and "
                f"{f.npartitions} partitions; repartition one to match, e.g. "
                f"b = b.repartition(npartitions=a.npartitions)."
            )
    frames = block_sizing.prepare_frames(frames, label=task_name)
    first = frames[0]
    wrapped = _PartitionKernel(kernel, task_name, retries, working_set, placement)
    if not speculative:
        wrapped.speculative = False
    opts = {} if meta is None else {"meta": meta}
    out = first.map_partitions(wrapped, *frames[1:], **opts, **kwargs)
    wrapped.meta = out._meta
    wrapped.check_dtypes = meta is not None
    return out


def _map_xarray(kernel, objs, task_name, template, kwargs, retries=0, working_set=None,
                placement=None, speculative=True):
    import xarray as xr

    for i, o in enumerate(objs):
        if not o.chunks:
            raise not_a_collection("blockflow.map_blocks", f"argument {i}", o)
    _check_xarray_chunks(objs)
    if template is None:  # a template pins the output's chunks: never re-cut then
        objs = block_sizing.prepare_xarray(objs, working_set=working_set, label=task_name)
    main = objs[0]
    if isinstance(main, xr.DataArray) and main.chunks:  # as for arrays: one advisory line
        advise_blocks(main.data, "blockflow.map_blocks", working_set=working_set,
                      alike=len(objs) > 1, dims=main.dims)
    wrapped = _XarrayKernel(kernel, task_name, retries, working_set, placement)
    if not speculative:
        wrapped.speculative = False
    return xr.map_blocks(wrapped, objs[0], args=list(objs[1:]), kwargs=kwargs, template=template)


def _check_xarray_chunks(objs) -> None:
    """Refuse xarray arguments not chunked like argument 0 (``xarray.map_blocks`` would
    silently keep one result per output block)."""
    main = objs[0]
    own = dict(main.chunksizes)
    ref = {d: tuple(own.get(d, (main.sizes[d],))) for d in main.dims}
    for i, o in enumerate(objs[1:], start=1):
        for dim, c in o.chunksizes.items():
            c = tuple(c)
            if dim in ref and c != ref[dim]:
                raise ValueError(
                    f"blockflow.map_blocks: arguments 0 and {i} have different chunks along "
                    f"dimension {dim!r}: {ref[dim]} vs {c}; chunk one to match, e.g. "
                    f"y = y.chunk({{{dim!r}: {ref[dim]}}})."
                )
            if dim not in ref and len(c) > 1:
                raise ValueError(
                    f"blockflow.map_blocks: arguments 0 and {i} have different chunks along "
                    f"dimension {dim!r}: one block (argument 0 does not have that dimension) "
                    f"vs {c}; xarray would hand each call only one of those blocks. Put it in "
                    f"one block, e.g. y = y.chunk({{{dim!r}: -1}})."
                )
