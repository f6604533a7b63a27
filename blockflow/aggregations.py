"""Grouped tree reductions of dask dataframes: per-group moments and quantiles in one pass.

Both run through :func:`blockflow.tree_reduce` with one-row-per-group partials and match
pandas' ``groupby(by, dropna=dropna)``; partitions may be pandas or cuDF. Guide:
docs/guide/data.md.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Iterable, Sequence

import dask.dataframe as dd
import numpy as np
import pandas as pd

from blockflow.core.moments import merge_moments
from blockflow.errors import not_a_collection
from blockflow.reduction import tree_reduce

__all__ = [
    "ROWS",
    "grouped_moments",
    "grouped_quantiles",
    "histogram_quantiles",
    "quantile_label",
]

#: Column of :func:`grouped_moments` results with the number of rows of each group.
ROWS = "rows"

# Column names of partial results (double underscore: not clashing with user columns).
_BIN = "__bin"
_COUNT = "__count"
# Largest bin index (2**62): bin indices are int64, with room for the rounding.
_MAX_BIN = float(2**62)


# --- argument checks ---------------------------------------------------------------------


def _as_list(names: str | Iterable[str], what: str, func: str) -> list[str]:
    out = [names] if isinstance(names, str) else list(names)
    if not out:
        raise ValueError(f"{func}: give at least one {what} column.")
    if len(set(out)) != len(out):
        raise ValueError(f"{func}: {what} columns {out} contain duplicates.")
    return out


def _check_frame(ddf: Any, by: list[str], columns: list[str], func: str) -> None:
    if not isinstance(ddf, dd.DataFrame):
        raise not_a_collection(func, "the input", ddf)
    missing = [c for c in by + columns if c not in ddf.columns]
    if missing:
        raise KeyError(
            f"{func}: column(s) {missing} not in the dataframe; it has "
            f"{[str(c) for c in ddf.columns]}."
        )
    overlap = sorted(set(by) & set(columns))
    if overlap:
        raise ValueError(f"{func}: {overlap} cannot be both a group key and a value column.")
    for c in columns:
        dtype = ddf[c].dtype
        if not (pd.api.types.is_numeric_dtype(dtype) and not pd.api.types.is_bool_dtype(dtype)):
            raise TypeError(
                f"{func}: column {c!r} has dtype {dtype}; moments and quantiles need a numeric "
                f"(integer or float) column."
            )


def _check_dropna(dropna: Any, func: str) -> bool:
    if not isinstance(dropna, (bool, np.bool_)):
        raise TypeError(
            f"{func}: dropna must be True (drop rows with a missing key, as pandas' groupby) "
            f"or False (keep them as their own group), got {dropna!r}."
        )
    return bool(dropna)


def _to_host(frame):
    """A pandas object for a pandas or cuDF one (cuDF copies to host memory)."""
    if isinstance(frame, (pd.DataFrame, pd.Series)):
        return frame
    return frame.to_pandas()


# --- moments -----------------------------------------------------------------------------


def _moment_columns(columns: Sequence[str]) -> list[str]:
    return [f"{c}__{s}" for c in columns for s in ("count", "mean", "m2", "max")]


def _moments_chunk(part, *, by: list[str], columns: list[str], dropna: bool):
    """Per-group ``(rows, count, mean, M2, max)`` of one partition (keys as columns)."""
    groups = part.groupby(by, dropna=dropna, sort=False)
    values = groups[columns]
    # one grouping, one groupby method per statistic (cheaper than agg([...]) in pandas);
    # M2 = var(ddof=1) * (count - 1), 0 for single-row groups
    count, mean, var, vmax = values.count(), values.mean(), values.var(), values.max()
    stats = {}
    for c in columns:
        stats[f"{c}__count"] = count[c]
        stats[f"{c}__mean"] = mean[c]
        stats[f"{c}__m2"] = (var[c] * (count[c] - 1)).fillna(0.0)
        stats[f"{c}__max"] = vmax[c]
    return groups.size().to_frame(ROWS).assign(**stats).reset_index()


def _merge_moments(partials, *, by: list[str], columns: list[str]):
    """Merge partial moments of the same groups (:func:`blockflow.core.moments.merge_moments`)."""
    partials = partials.reset_index(drop=True)  # concatenated partials repeat index labels
    group = partials.groupby(by, dropna=False, sort=False).ngroup()

    def total(values):  # sum over the rows of each group, on every row of the group
        return values.groupby(group, sort=False).transform("sum")

    merged = {}
    for c in columns:
        count, mean, m2 = merge_moments(partials[f"{c}__count"], partials[f"{c}__mean"],
                                        partials[f"{c}__m2"], total)
        merged.update({f"{c}__count": count, f"{c}__mean": mean, f"{c}__m2": m2})
    # The merged values are the same on every row of a group, so any reduction that skips
    # NaN picks them up ("max" is available in pandas and cuDF alike).
    spec = {ROWS: "sum"}
    for c in columns:
        spec.update({f"{c}__count": "max", f"{c}__mean": "max", f"{c}__m2": "max",
                     f"{c}__max": "max"})
    out = partials[by + [ROWS] + [f"{c}__max" for c in columns]].assign(**merged)
    out = out.groupby(by, dropna=False, sort=True).agg(spec)
    return out[[ROWS] + _moment_columns(columns)].reset_index()


def _finalize_moments(partials, *, by: list[str], columns: list[str], dtypes: dict):
    """The last merge as ``count, mean, std (ddof=1), max`` per column."""
    merged = _merge_moments(partials, by=by, columns=columns)
    out = merged[by + [ROWS]].copy()
    for c in columns:
        count = merged[f"{c}__count"]
        out[f"{c}_count"] = count
        out[f"{c}_mean"] = merged[f"{c}__mean"]
        # ddof=1 like pandas; undefined (NaN) for groups with fewer than two values.
        out[f"{c}_std"] = ((merged[f"{c}__m2"] / (count - 1)) ** 0.5).where(count > 1)
        # Integer columns have no missing values, so every group's max exists and casts
        # back exactly (the merge may have passed through float64 when partials mixed).
        out[f"{c}_max"] = merged[f"{c}__max"].astype(dtypes[c])
    return out


def grouped_moments(
    ddf: dd.DataFrame,
    by: str | Sequence[str],
    columns: str | Sequence[str],
    *,
    dropna: bool = True,
    split_every: int | None = None,
) -> dd.DataFrame:
    """Rows, count, mean, standard deviation and maximum of columns per group, by tree reduction.

    Parameters
    ----------
    ddf : dask.dataframe.DataFrame
        Pandas or cuDF partitions.
    by : str or sequence of str
        Group-key column(s).
    columns : str or sequence of str
        Numeric (integer or float) value columns; missing values are skipped.
    dropna : bool, default True
        As pandas' ``groupby(..., dropna=)``: drop rows with a missing key, or keep them as
        groups of their own, sorted last.
    split_every : int, optional
        Fan-in of the tree (>= 2); default: sized from worker memory by
        :func:`blockflow.tree_reduce`.

    Returns
    -------
    dask.dataframe.DataFrame
        Lazy, one partition, one row per group sorted by the keys: the keys, ``rows`` and per
        value column ``c_count``, ``c_mean``, ``c_std`` (ddof=1), ``c_max`` (the column's
        dtype), as pandas' ``.agg(["size", "count", "mean", "std", "max"])``.

    Raises
    ------
        If ``ddf`` is not a dask DataFrame, a value column is not numeric or ``dropna`` is
        not a bool.
    KeyError
        If a column is missing.
    ValueError
        If ``by`` or ``columns`` is empty, duplicated or overlapping, or ``split_every < 2``.

    See Also
    --------
    grouped_quantiles : per-group quantiles by tree reduction of histograms.

    Notes
    -----
    Method: Chan, Golub and LeVeque, "Updating formulae and a pairwise algorithm for
    computing sample variances", STAN-CS-79-773 (1979).

    Examples
    --------
    >>> import pandas as pd, dask.dataframe as dd
    >>> df = pd.DataFrame({"k": ["a", "a", "b", "b"], "x": [1.0, 3.0, 10.0, 10.0]})
    >>> grouped_moments(dd.from_pandas(df, npartitions=2), "k", "x").compute()
       k  rows  x_count  x_mean     x_std  x_max
    0  a     2        2     2.0  1.414214    3.0
    1  b     2        2    10.0  0.000000   10.0
    """
    func = "blockflow.aggregations.grouped_moments"
    by = _as_list(by, "group-key", func)
    columns = _as_list(columns, "value", func)
    _check_frame(ddf, by, columns, func)
    dropna = _check_dropna(dropna, func)
    ddf = ddf[by + columns]
    chunk = functools.partial(_moments_chunk, by=by, columns=columns, dropna=dropna)
    aggregate = functools.partial(_finalize_moments, by=by, columns=columns,
                                  dtypes={c: ddf[c].dtype for c in columns})
    return tree_reduce(
        ddf, chunk, functools.partial(_merge_moments, by=by, columns=columns), aggregate,
        split_every=split_every, name="grouped-moments",
        meta=aggregate(chunk(ddf._meta)),  # the empty table: what an empty input gives
    )


# --- quantiles ---------------------------------------------------------------------------


def quantile_label(q: float) -> str:
    """Column-name suffix of quantile ``q`` (0-1): ``0.5 -> "p50"``, ``0.999 -> "p99.9"``."""
    return f"p{round(q * 100, 10):g}"


def _check_quantiles(q: float | Sequence[float], func: str) -> list[float]:
    qs = [q] if isinstance(q, (int, float, np.number)) else list(q)
    if not qs:
        raise ValueError(f"{func}: give at least one quantile q in [0, 1].")
    for v in qs:
        if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not 0 <= v <= 1:
            raise ValueError(f"{func}: quantiles must be numbers in [0, 1], got {v!r}.")
    labels = [quantile_label(float(v)) for v in qs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"{func}: quantiles {qs} contain duplicates.")
    return [float(v) for v in qs]


def _histogram_chunk(part, *, by: list[str], column: str, bin_width: float, dropna: bool):
    """Per-group value counts of one partition on the grid ``bin_width * k``."""
    x = part[column]
    present = x.notna()
    filled = x.fillna(0)
    if bool((filled.astype("float64").abs() / bin_width >= _MAX_BIN).any()):  # also +-inf
        raise ValueError(
            f"blockflow.aggregations.grouped_quantiles: column {column!r} has infinite values "
            f"or values beyond {_MAX_BIN:.3g} x bin_width, which a histogram cannot bin; "
            f"drop or clip them first (or use a larger bin_width)."
        )
    bins = (filled / bin_width).round().astype("int64")
    keyed = part[by].assign(**{_BIN: bins, _COUNT: present.astype("int64")})
    counts = keyed.groupby(by + [_BIN], dropna=dropna, sort=False)[_COUNT].sum()
    return counts.to_frame(_COUNT).reset_index()


def _merge_histograms(partials, *, by: list[str]):
    """Add the counts of equal (group, bin) pairs."""
    merged = partials.groupby(by + [_BIN], dropna=False, sort=False)[_COUNT].sum()
    return merged.to_frame(_COUNT).reset_index()


def histogram_quantiles(
    histogram,
    by: Sequence[str],
    q: Sequence[float],
    *,
    bin_width: float = 1.0,
    value: str = "value",
) -> pd.DataFrame:
    """Quantiles per group from a histogram, interpolated like NumPy's ``"linear"`` method.

    Parameters
    ----------
    histogram : pandas.DataFrame or cudf.DataFrame
        Columns ``by``, ``"__bin"`` (int64 ``k``: values nearest ``k * bin_width``) and
        ``"__count"`` (int64), each (group, bin) once.
    by : sequence of str
        Group-key columns.
    q : sequence of float
        Quantiles in [0, 1].
    bin_width : float, default 1.0
        Width of the bins, in the values' units.
    value : str, default "value"
        Prefix of the result columns: ``<value>_p50`` etc.

    Returns
    -------
    pandas.DataFrame
        One row per group (sorted by the keys) with one float64 column per quantile.
    """
    by = list(by)
    hist = _to_host(histogram)
    hist = hist.sort_values(by + [_BIN], na_position="last", kind="stable")
    labels = [f"{value}_{quantile_label(quantile)}" for quantile in q]
    if len(hist) == 0:  # no group at all: the empty table
        out = hist[by].reset_index(drop=True)
        return out.assign(**{label: np.zeros(0, dtype=np.float64) for label in labels})
    counts = hist[_COUNT].to_numpy(dtype=np.int64)
    values = hist[_BIN].to_numpy(dtype=np.int64).astype(np.float64) * bin_width
    group = hist.groupby(by, dropna=False, sort=False).ngroup().to_numpy()
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    cum = np.cumsum(counts)
    before = np.r_[0, cum][starts]  # values in earlier groups
    ends = np.r_[starts[1:], len(hist)] - 1
    n = cum[ends] - before
    has_values = n > 0
    last = len(hist) - 1
    out = hist.iloc[starts][by].reset_index(drop=True)
    for quantile, label in zip(q, labels):
        h = np.maximum(n - 1, 0) * quantile
        lo = np.floor(h).astype(np.int64)
        hi = np.minimum(lo + 1, np.maximum(n - 1, 0))
        # side="right" skips zero-count rows (their cumulative count equals the previous);
        # groups without values are masked below, their positions only kept in range.
        v_lo = values[np.minimum(np.searchsorted(cum, before + lo, side="right"), last)]
        v_hi = values[np.minimum(np.searchsorted(cum, before + hi, side="right"), last)]
        out[label] = np.where(has_values, v_lo + (h - lo) * (v_hi - v_lo), np.nan)
    return out


def _finalize_quantiles(partials, *, by: list[str], column: str, q: list[float],
                        bin_width: float):
    merged = _merge_histograms(partials, by=by)
    return histogram_quantiles(merged, by, q, bin_width=bin_width, value=column)


def grouped_quantiles(
    ddf: dd.DataFrame,
    by: str | Sequence[str],
    column: str,
    q: float | Sequence[float] = (0.5, 0.9),
    *,
    bin_width: float = 1.0,
    dropna: bool = True,
    split_every: int | None = None,
) -> dd.DataFrame:
    """Quantiles of a column per group, from a tree reduction of per-group histograms.

    Parameters
    ----------
    ddf : dask.dataframe.DataFrame
        Pandas or cuDF partitions.
    by : str or sequence of str
        Group-key column(s).
    column : str
        Numeric value column with finite values; missing values are skipped.
    q : float or sequence of float, default (0.5, 0.9)
        Quantiles in [0, 1].
    bin_width : float, default 1.0
        Histogram resolution, in the column's units (> 0).
    dropna : bool, default True
        As pandas' ``groupby(..., dropna=)``.
    split_every : int, optional
        Fan-in of the tree (>= 2); default: sized from worker memory by
        :func:`blockflow.tree_reduce`.

    Returns
    -------
    dask.dataframe.DataFrame
        Lazy, one partition, one row per group sorted by the keys: the keys and
        ``<column>_p<100 q>`` (float64) per quantile, e.g. ``arr_delay_p50``.

    Raises
    ------
    TypeError
        If ``ddf`` is not a dask DataFrame, ``column`` is not numeric or ``dropna`` not bool.
    KeyError
        If a column is missing.
    ValueError
        If a quantile is outside [0, 1], ``bin_width`` is not finite and positive, or
        ``split_every < 2``; at compute time for an infinite value.

    See Also
    --------
    grouped_moments : per-group count, mean, standard deviation and maximum.

    Notes
    -----
    Method: blockflow heuristic. Exact when every value is a multiple of ``bin_width``,
    otherwise within ``bin_width / 2``.

    Examples
    --------
    >>> import pandas as pd, dask.dataframe as dd
    >>> df = pd.DataFrame({"k": ["a"] * 4 + ["b"] * 2, "x": [1, 2, 3, 4, 10, 20]})
    >>> grouped_quantiles(dd.from_pandas(df, npartitions=3), "k", "x", [0.5, 0.9]).compute()
       k  x_p50  x_p90
    0  a    2.5    3.7
    1  b   15.0   19.0
    """
    func = "blockflow.aggregations.grouped_quantiles"
    by = _as_list(by, "group-key", func)
    if not isinstance(column, str):
        raise TypeError(f"{func}: column must be one column name (str), got {column!r}.")
    _check_frame(ddf, by, [column], func)
    qs = _check_quantiles(q, func)
    if (isinstance(bin_width, bool) or not isinstance(bin_width, (int, float, np.number))
            or not math.isfinite(bin_width) or bin_width <= 0):
        raise ValueError(f"{func}: bin_width must be a finite number > 0, got {bin_width!r}.")
    bin_width = float(bin_width)
    dropna = _check_dropna(dropna, func)
    ddf = ddf[by + [column]]
    chunk = functools.partial(_histogram_chunk, by=by, column=column, bin_width=bin_width,
                              dropna=dropna)
    aggregate = functools.partial(_finalize_quantiles, by=by, column=column, q=qs,
                                  bin_width=bin_width)
    return tree_reduce(
        ddf, chunk, functools.partial(_merge_histograms, by=by), aggregate,
        split_every=split_every, name="grouped-quantiles",
        meta=aggregate(chunk(ddf._meta)),  # the empty table: what an empty input gives
    )
