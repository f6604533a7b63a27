"""How tree reductions get NumPy's result dtypes, and NumPy functions that are not trees.

:func:`result_dtypes` runs a reduction's steps once on a sample, as Dask infers dtypes, so a
tree reduction's result has NumPy's dtype and partials never narrow. :func:`_decomposition`
gives mean, var, std and count_nonzero as sums or moments merged with Chan et al.'s update
(:mod:`blockflow.core.moments`); medians and percentiles are refused.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Callable

import dask.array as da
import numpy as np
from dask.utils import getargspec

from blockflow.core.moments import merge_moments

__all__ = ["result_dtypes"]

logger = logging.getLogger("blockflow.reduction")


# --- result dtypes ---------------------------------------------------------------------


def _accepts_dtype(func: Callable) -> bool:
    """Whether ``func`` names a ``dtype`` parameter (Dask's own test, ``getargspec``)."""
    try:
        spec = getargspec(func)
    except TypeError:  # builtins without a signature
        return False
    return "dtype" in spec.args or "dtype" in spec.kwonlyargs


def _nest(part: Any, depth: int) -> Any:
    """One partial as Dask hands it to ``combine`` with ``concatenate=False``."""
    for _ in range(depth):
        part = [part]
    return part


def _dtype_of(value: Any) -> np.dtype | None:
    if hasattr(value, "dtype") and isinstance(getattr(value, "dtype"), np.dtype):
        return value.dtype
    if isinstance(value, (bool, int, float, complex, np.generic)):
        return np.asarray(value).dtype
    return None


def result_dtypes(
    x: da.Array,
    chunk: Callable,
    combine: Callable | None = None,
    aggregate: Callable | None = None,
    *,
    axis: tuple[int, ...] | None = None,
    keepdims: bool = False,
    concatenate: bool = True,
) -> tuple[np.dtype | None, np.dtype | None]:
    """The dtypes a tree reduction's partials and result naturally have, found by running it.

    NumPy's dtype rules depend on dtypes, not values, so running the steps on an empty (or
    one-element) sample gives NumPy's result dtype. Method: Dask's own dtype inference.

    Parameters
    ----------
    x : dask.array.Array
        The input (its dtype, dimensions and ``_meta`` type).
    chunk, combine, aggregate : callable
        The steps, as :func:`blockflow.tree_reduce` takes them.
    axis : tuple of int, optional
        Reduced axes, non-negative (default all).
    keepdims, concatenate : bool
        As in :func:`blockflow.tree_reduce`.

    Returns
    -------
    (numpy.dtype or None, numpy.dtype or None)
        The dtype of ``chunk``'s partials (None when not arrays) and of the result;
        ``(None, None)`` when a step fails on the sample.
    """
    combine = combine or aggregate or chunk
    aggregate = aggregate or combine
    axes = tuple(range(x.ndim)) if axis is None else tuple(axis)
    meta = getattr(x, "_meta", None)
    depth = 0 if concatenate else len(axes)
    # An empty sample first (Dask's meta convention: user functions are called on empty
    # blocks, never on made-up data), one element when the steps refuse empty input (np.min)
    for size in (0, 1):
        shape = (size,) * x.ndim
        try:
            sample = np.ones_like(meta, shape=shape, dtype=x.dtype) if meta is not None \
                else np.ones(shape, dtype=x.dtype)
        except Exception:  # a backend without ones_like(shape=)
            sample = np.ones(shape, dtype=x.dtype)
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")  # e.g. the mean of nothing, ddof >= 1
                part = chunk(sample, axis=axes, keepdims=True)
                merged = combine(_nest(part, depth), axis=axes, keepdims=True)
                out = aggregate(_nest(merged, depth), axis=axes, keepdims=keepdims)
        except Exception as e:
            logger.debug("tree_reduce: no dtype from a sample of %d element(s) (%s: %s)",
                         size ** x.ndim, type(e).__name__, e)
            continue
        if _dtype_of(out) is not None:
            return _dtype_of(part), _dtype_of(out)
    return None, None


def _accumulation_dtype(partial: np.dtype | None, result: np.dtype, given: np.dtype
                        ) -> np.dtype:
    """The dtype ``chunk`` and ``combine`` accumulate in: the result's or wider."""
    natural = partial if partial is not None else given
    if natural.kind in "biufc" and result.kind in "biufc":
        return np.promote_types(natural, result)
    return result


# --- NumPy functions that do not combine with themselves -------------------------------
#
# The single-function form reduces partials with the same function: right for sum, prod,
# min, max, any, all (and their nan- forms), wrong for a mean of block means or a count of
# counts. These get a decomposition of their own; those without one are refused.


def _count(x, axis, valid):
    if valid is not None:
        return np.sum(valid, axis=axis, keepdims=True, dtype=np.int64)
    shape = [1 if i in axis else n for i, n in enumerate(x.shape)]
    return np.full_like(x, int(np.prod([x.shape[i] for i in axis])), dtype=np.int64,
                        shape=shape)


def _moments_chunk(x, axis=None, keepdims=True, *, order, nan, dtype,
                   computing_meta=False):
    """Partial ``{"n", "s"}`` (order 1) or ``{"n", "mean", "m2"}`` (order 2) of one block,
    accumulated in ``dtype``; ``nan=True`` skips NaN as ``np.nanmean`` does."""
    if computing_meta:
        return x
    valid = ~np.isnan(x) if nan and x.dtype.kind in "fc" else None
    total = np.nansum if valid is not None else np.sum
    n = _count(x, axis, valid)
    s = total(x, axis=axis, keepdims=True, dtype=dtype)
    if order == 1:
        return {"n": n, "s": s}
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = s / n
    dev = x.astype(dtype, copy=False) - mean
    return {"n": n, "mean": mean, "m2": total(dev * dev, axis=axis, keepdims=True)}


def _parts(parts) -> list:
    return [q for p in parts for q in _parts(p)] if isinstance(parts, list) else [parts]


def _moments_combine(parts, axis=None, keepdims=True, *, order, computing_meta=False):
    """Merge partials: sums for order 1, Chan et al.'s update (:func:`merge_moments`)."""
    if computing_meta:
        return parts
    flat = _parts(parts)
    stack = {k: np.stack([p[k] for p in flat]) for k in flat[0]}
    if order == 1:
        return {k: v.sum(axis=0) for k, v in stack.items()}
    n, mean, m2 = merge_moments(stack["n"], stack["mean"], stack["m2"],
                                lambda a: a.sum(axis=0))
    return {"n": n, "mean": mean, "m2": m2}


def _moments_aggregate(parts, axis=None, keepdims=False, *, stat, order, result,
                       computing_meta=False):
    """``mean``, ``var`` (ddof 0) or ``std`` from the merged partials."""
    if computing_meta:
        return parts
    m = _moments_combine(parts, axis=axis, order=order)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = m["s"] / m["n"] if order == 1 else m["m2"] / m["n"]
        if stat == "std":
            out = np.sqrt(out)
    out = out.astype(result, copy=False)
    return out if keepdims else out.squeeze(axis=axis)


def _count_nonzero_chunk(x, axis=None, keepdims=True):
    return np.count_nonzero(x, axis=axis, keepdims=True)


def _decomposition(func: Callable, x: da.Array, axes, keepdims, dtype) -> tuple | None:
    """``(chunk, combine, aggregate, concatenate)`` for NumPy's mean/var/std/count_nonzero
    (and nan- forms) given alone; None for any other function."""
    moments = {np.mean: ("mean", 1, False), np.nanmean: ("mean", 1, True),
               np.var: ("var", 2, False), np.nanvar: ("var", 2, True),
               np.std: ("std", 2, False), np.nanstd: ("std", 2, True)}
    if func is np.count_nonzero:
        return _count_nonzero_chunk, np.sum, np.sum, True
    if func not in moments:
        return None
    stat, order, nan = moments[func]
    if dtype is None:
        _, dtype = result_dtypes(x, func, axis=axes, keepdims=keepdims)
    dtype = np.dtype(dtype) if dtype is not None else np.dtype("f8")
    acc = np.promote_types(dtype, "f8") if dtype.kind in "fc" else np.dtype("f8")
    return (functools.partial(_moments_chunk, order=order, nan=nan, dtype=acc),
            functools.partial(_moments_combine, order=order),
            functools.partial(_moments_aggregate, stat=stat, order=order, result=dtype),
            False)


#: Reductions whose value over block results is not their value over the whole input,
#: and that have no decomposition here: tree_reduce refuses them given alone.
_NOT_A_TREE = ("median", "nanmedian", "percentile", "nanpercentile", "quantile",
               "nanquantile", "ptp", "argmin", "argmax", "nanargmin", "nanargmax", "average")


def _refuse_non_tree(func: Callable, what: str) -> None:
    """A one-line error for a NumPy function that cannot reduce its own partials."""
    name = next((n for n in _NOT_A_TREE if getattr(np, n, None) is func), None)
    if what == "frame" and name is None:
        name = next((n for n in ("mean", "nanmean", "var", "nanvar", "std", "nanstd",
                                 "count_nonzero") if getattr(np, n) is func), None)
    if name is None:
        return
    fix = (f"dask.array.{name}(x, ...)" if what == "array"
           else "the dataframe's own method (e.g. df.mean())")
    raise ValueError(
        f"blockflow.tree_reduce: numpy.{name} of block results is not numpy.{name} of the "
        f"whole input, so it cannot reduce on its own; use {fix} or pass chunk, combine "
        f"and aggregate functions that merge partial results."
    )



def _plan_dtypes(x: da.Array, funcs, steps, axes, keepdims, concatenate, dtype) -> np.dtype:
    """Set the dtype each step computes in; return the result's dtype (the user's, else
    :func:`result_dtypes`'s, else the input's)."""
    partial, natural = result_dtypes(x, *funcs, axis=axes, keepdims=keepdims,
                                     concatenate=concatenate)
    chunk, combine, aggregate = steps
    if dtype is not None:
        result = np.dtype(dtype)
        aggregate.cast = result
    elif natural is not None:
        result = natural
    else:
        logger.info("tree_reduce of %s: result dtype not inferred from a one-element "
                    "sample; declared as the input's (%s), the steps use their own", x.name,
                    x.dtype)
        return x.dtype
    acc = _accumulation_dtype(partial, result, x.dtype)
    for step, want in ((chunk, acc), (combine, acc), (aggregate, result)):
        if _accepts_dtype(step.func):
            step.dtype = want
    return result


