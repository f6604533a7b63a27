"""Tree reductions over dask arrays, dataframes and xarray objects, with a memory-aware fan-in.

:func:`tree_reduce` builds on :func:`dask.array.reduction` and ``DataFrame.reduction``,
adding the fan-in choice of :mod:`blockflow.fan_in` and the result dtype NumPy would give
for the whole input (:func:`result_dtypes`).
"""

from __future__ import annotations

import logging
import inspect
from typing import Any, Callable

import dask.array as da
import dask.dataframe as dd
import numpy as np
from dask.array.optimization import optimize
from dask.array.utils import meta_from_array
from dask.base import tokenize
from dask.core import flatten
from dask.dataframe.utils import is_dataframe_like, is_series_like, meta_nonempty
from dask.utils import parse_bytes

from blockflow import config
from blockflow._distributed.graph import alias_target, renamed_task
from blockflow.core.kernel import Kernel, check_placement, check_retries
from blockflow.core.reduction_dtypes import (
    _decomposition,
    _plan_dtypes,
    _refuse_non_tree,
    result_dtypes,
)
from blockflow.blockwise import kernel_name, validate_array
from blockflow.backends import is_device_block
from blockflow.device_blocks import advise_blocks
from blockflow.errors import not_a_collection
from blockflow.fan_in import (
    _array_block_bytes,
    _check_split_every_dict,
    _resolve_split_every,
    choose_split_every,
    smallest_worker_memory,
)

__all__ = ["choose_split_every", "result_dtypes", "smallest_worker_memory", "tree_reduce"]

logger = logging.getLogger(__name__)


def tree_reduce(
    collection: Any,
    chunk: Callable,
    combine: Callable | None = None,
    aggregate: Callable | None = None,
    *,
    split_every: int | None = None,
    axis: int | tuple[int, ...] | None = None,
    dim: str | tuple[str, ...] | None = None,
    keepdims: bool = False,
    dtype: Any = None,
    meta: Any = None,
    concatenate: bool = True,
    block_bytes: int | None = None,
    name: str | None = None,
    retries: int | None = None,
    resources: dict[str, float] | None = None,
    workers: str | list[str] | None = None,
    allow_other_workers: bool | None = None,
):
    """Reduce a Dask collection with a tree of ``chunk``, ``combine`` and ``aggregate`` tasks.


    Parameters
    ----------
    collection : dask.array.Array, dask.dataframe.DataFrame/Series, or xarray.DataArray
        Any chunking. Arrays need known chunk sizes and at least one element.
    chunk : callable
        Applied to every block: ``chunk(block, axis=, keepdims=)`` for arrays (as in
        :func:`dask.array.reduction`), ``chunk(partition)`` for dataframes. Given alone it
        also reduces the partials; ``np.mean``, ``np.var``, ``np.std`` and
        ``np.count_nonzero`` alone run as a moments merge (Chan et al.), ``np.median`` and
        arg-reductions alone are refused.
    combine : callable, optional
        Merges ``split_every`` partial results (concatenated unless ``concatenate=False``).
        Default: ``aggregate``.
    aggregate : callable, optional
        Final step, called as ``combine``. Default: ``chunk``.
    split_every : int or dict of int to int, optional
        Fan-in of each level, >= 2. Default ``blockflow.reduction.split-every``, else
        :func:`choose_split_every`. Arrays also take ``{axis: fan-in}``.
    axis : int or tuple of int, optional
        Arrays: the axes to reduce (default all).
    dim : str or tuple of str, optional
        xarray: the dimensions to reduce (default all).
    keepdims : bool, default False
        Arrays: keep reduced axes with length 1.
    dtype : numpy dtype, optional
        Arrays: the result's dtype; default what NumPy gives for the whole input
        (:func:`result_dtypes`).
    meta : object, optional
        Metadata of the result (dataframes: as in ``DataFrame.reduction``).
    concatenate : bool, default True
        Arrays: concatenate partials before ``combine``/``aggregate``; False for non-array
        partials (``combine`` then gets nested lists).
    block_bytes : int, optional
        Bytes of one block for sizing ``split_every``; default the largest array block, or
        ``blockflow.reduction.dataframe-block-bytes``.
    name : str, optional
        Task-name prefix, after ``blockflow-`` (arrays only).
    retries : int, optional
        Extra attempts, in place inside the task, of a step whose function raises (default
        0); with ``client.compute(..., retries=d)``, ``1 + max(retries, d)`` in all.
    resources : dict of str to float, optional
        Worker resources each task needs, as in :func:`blockflow.map_blocks`.
    workers : str or list of str, optional
        Workers that may run the tasks (distributed's ``workers=``).
    allow_other_workers : bool, optional
        With ``workers``: others may run them when those cannot.

    Returns
    -------
    Lazy dask array / dataframe object / xarray.DataArray (or scalar-like dask object).

    Raises
    ------
    TypeError
        If ``collection`` is not a Dask collection, or ``split_every`` or ``axis`` has the
        wrong type.
    ValueError
        If ``split_every < 2``, chunk sizes are unknown, ``retries`` or placement arguments
        are invalid, ``chunk`` alone cannot reduce its own partials, or ``axis`` is out of
        range or repeated.
    EmptyCollectionError
        If an array has no elements.
    BlockKernelError
        At compute time, if a step raises on its last attempt.
    DeviceMemoryError
        At compute time, if a step runs out of device memory.
    """
    retries = check_retries(retries, "blockflow.tree_reduce")
    placement = check_placement(resources, workers, allow_other_workers,
                                "blockflow.tree_reduce")
    if type(collection).__module__.split(".")[0] == "xarray":
        if axis is not None or keepdims:
            raise TypeError(
                "blockflow.tree_reduce: for xarray objects name the dimensions with dim=... "
                "(axis= and keepdims= apply to dask arrays only)."
            )
        return _tree_reduce_xarray(
            collection, chunk, combine, aggregate, split_every=split_every, dim=dim,
            dtype=dtype, meta=meta, concatenate=concatenate, block_bytes=block_bytes, name=name,
            retries=retries, resources=resources, workers=workers,
            allow_other_workers=allow_other_workers,
        )
    alone = combine is None and aggregate is None  # the single-function form
    combine = combine or aggregate or chunk
    aggregate = aggregate or combine
    token = kernel_name(chunk, name)
    funcs = (chunk, combine, aggregate)
    steps = [_ReductionStep(f, stage, retries, placement=placement)
             for f, stage in zip(funcs, ("chunk", "combine", "aggregate"))]
    if isinstance(collection, da.Array):
        validate_array(collection, "blockflow.tree_reduce", "the collection")
        advise_blocks(collection, "blockflow.tree_reduce", working_set=0, passes=1,
                      device=is_device_block(collection._meta))
        axes = _check_axis(axis, collection.ndim)
        if alone:
            _refuse_non_tree(chunk, "array")
            parts = _decomposition(chunk, collection, axes, keepdims, dtype)
            if parts is not None:
                *funcs, concatenate = parts
                steps = [_ReductionStep(f, step.stage, retries, label=step.label,
                                        placement=placement)
                         for f, step in zip(funcs, steps)]
        dtype = _plan_dtypes(collection, funcs, steps, axes, keepdims, concatenate, dtype)
        chunk, combine, aggregate = steps
        chunk.inferred = True
        nbytes = block_bytes or _array_block_bytes(collection)
        if isinstance(split_every, dict):
            fan_in = _check_split_every_dict(split_every, collection.ndim)
        else:
            fan_in = _resolve_split_every(split_every, nbytes, f"{collection.name}",
                                          device=is_device_block(collection._meta))
        if meta is None:
            # Spare Dask from inferring metadata by calling chunk on an empty block, which
            # fails for partials that are not arrays (dicts with concatenate=False).
            ndim = collection.ndim if keepdims else collection.ndim - len(axes)
            meta = meta_from_array(collection, ndim=ndim, dtype=dtype)
        if not concatenate:
            chunk = _MetaSafeChunk(chunk)
            if any(0 in c for c in collection.chunks):  # zero-size blocks would look like meta
                collection = collection.rechunk(
                    tuple(tuple(s for s in c if s) or (0,) for c in collection.chunks))
        out = da.reduction(
            collection, chunk, aggregate, combine=combine, axis=axes, keepdims=keepdims,
            dtype=dtype, split_every=fan_in,
            name=token, concatenate=concatenate, meta=meta,
        )
        _go_live(steps)
        return TreeReducedArray(out.dask, out.name, out.chunks, meta=out._meta)
    chunk, combine, aggregate = steps
    if isinstance(collection, (dd.DataFrame, dd.Series)):
        if alone:
            _refuse_non_tree(chunk.func, "frame")
        nbytes = block_bytes or parse_bytes(config.get("reduction.dataframe-block-bytes"))
        fan_in = _resolve_split_every(split_every, nbytes, f"a dataframe of "
                                      f"{collection.npartitions} partitions",
                                      device=is_device_block(collection._meta))
        kwargs = {} if meta is None else {"meta": meta}
        out = collection.reduction(
            _FrameStep(chunk), aggregate=_FrameStep(aggregate), combine=_FrameStep(combine),
            split_every=fan_in, token=token, **kwargs,
        )
        _go_live(steps)
        return out
    raise not_a_collection("blockflow.tree_reduce", "the collection", collection)


def _check_axis(axis: Any, ndim: int) -> tuple[int, ...]:
    """The axes ``axis=`` reduces, as non-negative ints (all for None); TypeError for a bad
    type, ValueError for an axis out of range or named twice."""
    if axis is None:
        return tuple(range(ndim))
    items = list(axis) if isinstance(axis, (tuple, list)) else [axis]
    for a in items:
        if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
            raise TypeError(
                f"blockflow.tree_reduce: axis must be an int or a tuple of ints, got "
                f"{axis!r}."
            )
    normalized = []
    for a in items:
        if not -ndim <= a < ndim:
            raise ValueError(
                f"blockflow.tree_reduce: axis {int(a)} is out of range for the collection's "
                f"{ndim} dimensions; use an axis from {-ndim} to {ndim - 1}."
            )
        a = int(a) % ndim
        if a in normalized:
            raise ValueError(
                f"blockflow.tree_reduce: axis {axis!r} names axis {a} twice (the collection "
                f"has {ndim} dimensions); name each axis once."
            )
        normalized.append(a)
    return tuple(normalized)


def _go_live(steps) -> None:
    """The graph is built: from now on the steps run on real blocks (see _ReductionStep)."""
    for step in steps:
        step.live = True


def optimize_without_aliases(dsk, keys, **kwargs):
    """Dask's array optimisation, then each fusion ``Alias`` task with a single dependent is
    replaced by its renamed target: one task per block. A blockflow heuristic on top of
    :func:`dask.array.optimization.optimize`.
    """
    dsk = dict(optimize(dsk, keys, **kwargs))
    dependents: dict = {}
    for node in dsk.values():
        for dep in getattr(node, "dependencies", ()):
            dependents[dep] = dependents.get(dep, 0) + 1
    keep = set(flatten_keys(keys))
    for key, node in list(dsk.items()):
        aliased = alias_target(node)
        if aliased is None or aliased == key:
            continue
        target = dsk.get(aliased)
        if target is None or dependents.get(aliased, 0) != 1 or aliased in keep:
            continue
        dsk[key] = renamed_task(target, key)
        del dsk[aliased]
    return dsk


def flatten_keys(keys):
    return flatten(keys) if isinstance(keys, list) else [keys]


class TreeReducedArray(da.Array):
    """The dask array :func:`tree_reduce` returns; its optimisation also removes fusion
    aliases (:func:`optimize_without_aliases`)."""

    __dask_optimize__ = staticmethod(optimize_without_aliases)


class _ReductionStep(Kernel):
    """``chunk``, ``combine`` or ``aggregate`` as its tasks run it
    (:class:`blockflow.core.kernel.Kernel`); Dask's metadata inference calls run once."""

    logger = logger

    def __init__(self, func, stage: str, retries: int = 0, label: str | None = None,
                 placement: dict | None = None):
        super().__init__(func, retries, step=stage, placement=placement)
        self.__wrapped__ = inspect.unwrap(func)  # e.g. np.sum's Python implementation
        self.stage = stage
        self.label = label or self.label  # a decomposition keeps the user's function's name
        self.__name__ = self.label
        self.live = False
        self.inferred = False  # its dtypes were found (_plan_dtypes ran it once on a sample)
        self.dtype = None  # passed as dtype= (overriding Dask's), see _plan_dtypes
        self.cast = None  # the user's dtype=, for the aggregate's result

    def __repr__(self) -> str:
        return f"<blockflow tree_reduce {self.stage} {self.label}>"

    def __call__(self, *args, **kwargs):
        if self.dtype is not None:
            kwargs["dtype"] = self.dtype
        if not self.live or kwargs.get("computing_meta"):
            if self.inferred and args and getattr(args[0], "size", None) == 0:
                # Dask's metadata call on an empty block: the function already ran once
                # for the dtypes, and Dask ignores the partials' meta (not called again)
                return meta_from_array(args[0], dtype=self.dtype or args[0].dtype)
            return self.func(*args, **kwargs)
        out = self.run(lambda: f"a tree_reduce {self.stage} step", *args, **kwargs)
        if self.cast is not None and getattr(out, "dtype", self.cast) != self.cast:
            out = out.astype(self.cast)
        return out

    def __dask_tokenize__(self):
        return (type(self).__name__, tokenize(self.func), self.stage, self.retries,
                str(self.dtype), str(self.cast), repr(self.placement))


class _MetaSafeChunk:
    """Chunk function returning an empty array, not a dict, on Dask's zero-size meta block."""

    def __init__(self, func):
        self.func = func
        self.__name__ = getattr(func, "__name__", "chunk")

    def __call__(self, x, **kwargs):
        out = self.func(x, **kwargs)
        if getattr(x, "size", 1) == 0 and not hasattr(out, "dtype"):
            return meta_from_array(x, ndim=getattr(x, "ndim", 0))
        return out


class _Empty:
    """The partial of an empty partition, set aside so it cannot widen the others' dtype."""

    def __init__(self, value):
        self.value = value


def _drop_empty(obj) -> tuple[Any, bool]:
    """The scalar partials without empty partitions' ones; True when all were empty."""
    if getattr(obj, "dtype", None) != object or not hasattr(obj, "tolist"):
        return obj, False
    values = obj.tolist()
    if not any(isinstance(v, _Empty) for v in values):
        return obj, False
    kept = [v for v in values if not isinstance(v, _Empty)]
    rebuild = type(obj)
    if kept:
        return rebuild(kept), False
    return rebuild([v.value for v in values]), True


class _FrameStep:
    """A dataframe reduction step that sets empty partitions' partials aside
    (:class:`_Empty`), so they cannot widen the dtypes. A blockflow heuristic."""

    def __init__(self, step: _ReductionStep):
        self.step = step
        self.__name__ = getattr(step, "__name__", "step")

    def blockflow_placement(self):
        """The step's placement (``resources=``...), for blockflow's scheduler plugin."""
        return self.step.blockflow_placement()

    def blockflow_working_set(self, key):
        return self.step.blockflow_working_set(key)

    def __call__(self, part, **kwargs):
        if self.step.stage == "chunk":
            out = self.step(part, **kwargs)
            if not hasattr(part, "columns") and not hasattr(part, "dtype") or len(part):
                return out
            return self._empty(part, out, kwargs)
        if self.step.stage == "combine" and hasattr(part, "columns") and not len(part):
            return part  # only empty partitions' partials: pass them on, still empty
        part, all_empty = _drop_empty(part)
        out = self.step(part, **kwargs)
        return _Empty(out) if all_empty and self.step.stage == "combine" else out

    def _empty(self, part, out, kwargs):
        if is_series_like(out) and is_dataframe_like(part):  # one value per column
            try:
                sample = self.step.func(meta_nonempty(part), **kwargs)
            except Exception:  # a chunk that needs real data: its own empty result
                sample = out
            if is_series_like(sample):
                return sample.to_frame().T.iloc[:0]
            return out
        if is_series_like(out) or is_dataframe_like(out):
            return out
        return _Empty(out)

    def __dask_tokenize__(self):
        return (type(self).__name__, tokenize(self.step))


def _tree_reduce_xarray(obj, chunk, combine, aggregate, *, dim, **kwargs):
    import xarray as xr

    if not isinstance(obj, xr.DataArray):
        raise TypeError(
            "blockflow.tree_reduce: pass one xarray.DataArray (e.g. ds['var']), not a "
            f"{type(obj).__name__}; reduce each variable separately."
        )
    if not isinstance(obj.data, da.Array):
        raise not_a_collection("blockflow.tree_reduce", "the collection", obj)
    dims = obj.dims if dim is None else ((dim,) if isinstance(dim, str) else tuple(dim))
    missing = [d for d in dims if d not in obj.dims]
    if missing:
        raise ValueError(
            f"blockflow.tree_reduce: dim {missing} not in the DataArray's dims {obj.dims}."
        )
    axis = tuple(obj.get_axis_num(d) for d in dims)
    data = tree_reduce(obj.data, chunk, combine, aggregate, axis=axis, **kwargs)
    # xarray refuses to mix array subclasses in one Dataset: hand it a plain dask array
    # (its graph then keeps Dask's fusion aliases)
    data = da.Array(data.dask, data.name, data.chunks, meta=data._meta)
    kept = [d for d in obj.dims if d not in dims]
    coords = {k: v for k, v in obj.coords.items() if set(v.dims) <= set(kept)}
    out = xr.DataArray(data, dims=kept, coords=coords, attrs=obj.attrs)
    return out.rename(obj.name)  # xarray would otherwise take the dask key as the name
