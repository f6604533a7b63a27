"""Features and labels as row blocks: dask arrays chunked along rows only, row chunks matching."""

from __future__ import annotations

import math

import dask.array as da

__all__ = ["as_row_blocks", "known_rows"]


def as_row_blocks(X, y=None):
    """``X`` (and ``y``) as dask arrays chunked along rows only, with matching row chunks.

    Parameters
    ----------
    X : dask.array.Array, dask.dataframe.DataFrame or NumPy/CuPy array
        Features, shape ``(n_samples, n_features)``.
    y : dask array, dask Series/DataFrame or array, optional
        Labels, ``n_samples`` rows.

    Returns
    -------
    (dask.array.Array, dask.array.Array or None)

    Raises
    ------
    ValueError
        If ``X`` is not 2-D or ``y`` has a different number of rows.
    """
    import dask.dataframe as dd  # deferred: pandas and pyarrow, for dataframe input only

    def arr(a):
        if isinstance(a, (dd.DataFrame, dd.Series)):
            return a.to_dask_array(lengths=True)
        if not isinstance(a, da.Array):
            return da.from_array(a, chunks=(max(1, math.ceil(len(a) / 8)),) + a.shape[1:])
        return a

    X = arr(X)
    if X.ndim != 2:
        raise ValueError(f"blockflow: X must be 2-D (samples x features), got shape {X.shape}; "
                         f"reshape it first.")
    # a filtered collection (``X[mask]``) has unknown row counts: they are computed (on
    # both sides) before rows are compared or blocks sized
    X = known_rows(X)
    X = X.rechunk({1: -1})
    if y is None:
        return X, None
    y = known_rows(arr(y))
    if y.shape[0] != X.shape[0]:
        raise ValueError(f"blockflow: X has {X.shape[0]} rows but y has {y.shape[0]}; pass "
                         f"labels for every sample.")
    y = y.rechunk((X.chunks[0],) + tuple((-1,) * (y.ndim - 1)))
    return X, y


def known_rows(a):
    """``a`` with its row chunk sizes known (computed where a filter left them unknown)."""
    if any(math.isnan(c) for c in a.chunks[0]):
        a = a.compute_chunk_sizes()
    return a
