"""Skew splitting: re-cut a collection's blocks so that no block dominates a stage.

:func:`split_skewed` splits blocks far above the median and merges runs of tiny ones, as
Spark's adaptive query execution does for skewed shuffle partitions; sizing blocks to device
memory is :mod:`blockflow.block_sizing`. Every re-cut is logged on ``blockflow.decompose``
and kept as a :class:`BlockResize` for :func:`blockflow.run_report`. Guide: docs/guide/data.md.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
from dask import delayed
from dask.dataframe.dispatch import concat
from dask.utils import format_bytes, parse_bytes
from distributed import Future, futures_of

from blockflow import config
from blockflow._distributed.client import data_holders
from blockflow.scheduling.view import workers_info

__all__ = ["BlockResize", "recorded_resizes", "split_skewed"]

logger = logging.getLogger(__name__)

#: The last changes made in this process (what run reports show).
_records: collections.deque = collections.deque(maxlen=1000)
#: Index into the records of the first one no run report has shown yet (see run_report).
_reported = 0
_count = 0  # records made in this process so far


@dataclass(frozen=True)
class BlockResize:
    """One change of a collection's blocks along one axis.

    Attributes
    ----------
    kind : str
        ``"array"``, ``"dataframe"`` or ``"xarray"``.
    reason : str
        ``"skew"`` or ``"fit-device-memory"``.
    axis : int or str
        The axis (arrays), dimension name (xarray) or ``0`` (dataframe rows) re-cut.
    before, after : tuple of int
        Rows per block along ``axis`` before and after.
    row_bytes : float
        Bytes of one row of the largest block; dataframes: mean bytes per row.
    split, merged : int
        Input blocks split into pieces; input blocks merged with neighbours.
    time : float
        When the change was made (seconds since the epoch).
    label : str
        What it was made for (the kernel's task-name prefix).
    unit : str
        ``"rows"``, or ``"bytes"`` for a persisted dataframe (``row_bytes`` is then 1).
    """

    kind: str
    reason: str
    axis: Any
    before: tuple
    after: tuple
    row_bytes: float
    split: int
    merged: int
    time: float
    label: str = ""
    unit: str = "rows"

    @property
    def before_bytes(self) -> tuple:
        """Bytes per block before (rows x ``row_bytes``)."""
        return tuple(int(r * self.row_bytes) for r in self.before)

    @property
    def after_bytes(self) -> tuple:
        """Bytes per block after (rows x ``row_bytes``)."""
        return tuple(int(r * self.row_bytes) for r in self.after)

    def summary(self) -> str:
        """One line: what changed and the block sizes before and after."""
        what = []
        if self.split:
            what.append(f"split {self.split} block{'s' if self.split != 1 else ''}")
        if self.merged:
            what.append(f"merged {self.merged} tiny block{'s' if self.merged != 1 else ''}")
        for_ = f" for {self.label}" if self.label else ""
        return (f"{self.reason}{for_}: {' and '.join(what) or 'unchanged'} along "
                f"{'dimension' if isinstance(self.axis, str) else 'axis'} {self.axis!r}: "
                f"{_describe(self.before, self.row_bytes, self.unit)} -> "
                f"{_describe(self.after, self.row_bytes, self.unit)}")

    def to_dict(self) -> dict:
        """Plain data, with ``before_bytes`` and ``after_bytes`` added."""
        out = asdict(self)
        out.update(before_bytes=self.before_bytes, after_bytes=self.after_bytes)
        return out


def _describe(sizes: Sequence[int], row_bytes: float, unit: str = "rows") -> str:
    n = len(sizes)
    big = max(sizes, default=0)
    med = float(np.median(sizes)) if n else 0.0
    if unit == "bytes":
        return (f"{n} block{'s' if n != 1 else ''} (largest {format_bytes(int(big))}; "
                f"median {format_bytes(int(med))})")
    return (f"{n} block{'s' if n != 1 else ''} (largest {big:,} rows, "
            f"{format_bytes(int(big * row_bytes))}; median {med:,.0f} rows, "
            f"{format_bytes(int(med * row_bytes))})")


def _record(change: BlockResize) -> BlockResize:
    global _count
    _records.append(change)
    _count += 1
    logger.info("blockflow: %s", change.summary())
    return change


def recorded_resizes(since=None, *, unreported: bool = False) -> list[BlockResize]:
    """The block changes made in this process (the last 1,000), oldest first.

    Parameters
    ----------
    since : float or datetime, optional
        Only those made at or after this time (seconds since the epoch or a datetime,
        :func:`blockflow.scheduling.view.epoch_seconds`).
    unreported : bool, default False
        Only those no earlier ``unreported=True`` call returned, and mark them returned.

    Returns
    -------
    list of BlockResize
    """
    from blockflow.scheduling.view import epoch_seconds

    global _reported
    since = epoch_seconds(since)
    out = list(_records)
    if unreported:
        first = max(0, len(out) - (_count - _reported))
        out = out[first:]
        _reported = _count
    if since is not None:
        out = [r for r in out if r.time >= since]
    return out


# -- the plan: new block sizes along one axis ---------------------------------------------

@dataclass
class _Plan:
    pieces: list  # (first block, last block + 1, start row in first, stop row) per piece
    split: int
    merged: int

    @property
    def sizes(self) -> tuple:
        return tuple(hi - lo for _, _, lo, hi in self.pieces)


def _even(n: int, k: int) -> list[int]:
    """``n`` rows in ``k`` pieces whose sizes differ by at most one."""
    q, r = divmod(n, k)
    return [q + 1] * r + [q] * (k - r)


def _skew_plan(sizes: Sequence[int], row_bytes: float, factor: float, floor: int,
               merge_below: float, max_piece: float | None = None,
               threads: int | None = None) -> _Plan | None:
    """The re-cut :func:`split_skewed` describes, as pieces; None when nothing changes.

    With ``threads`` (the stage's worker threads), the collection is also skewed when a
    block exceeds ``max_piece`` x the balanced stage (the same rows in as many even blocks,
    ``ceil(blocks / threads)`` of them per thread), and pieces are at most ``max_piece - 1``
    x the per-thread share: greedy list scheduling ends within the share plus the largest
    piece (Graham 1969), so the stage stays within ``max_piece`` x the balanced time.
    """
    max_piece = _max_piece() if max_piece is None else max_piece
    sizes = [int(s) for s in sizes]
    nonempty = [s for s in sizes if s > 0]
    if len(sizes) < 2 or not nonempty:
        return None
    med = float(np.median(nonempty))
    total = sum(sizes)
    target = max(med, total / len(sizes))
    tiny = merge_below * target
    merge = merge_below > 0 and total * row_bytes > floor
    skewed = any(s > factor * med and s * row_bytes > floor for s in sizes)
    if threads:
        balanced = math.ceil(len(sizes) / threads) * total / len(sizes)
        skewed = skewed or any(s > max_piece * balanced and s * row_bytes > floor
                               for s in sizes)
    cut = min(factor * med, max_piece * target) if skewed else factor * med
    if threads and skewed:  # pieces a fraction of the per-thread share (and merged runs)
        cut = min(cut, max(max_piece - 1, 0.125) * total / threads)
        target = min(target, cut)
    pieces, split, merged, i = [], 0, 0, 0
    while i < len(sizes):
        s = sizes[i]
        if s > cut and s * row_bytes > floor:
            start = 0
            for n in _even(s, math.ceil(s / target)):
                pieces.append((i, i + 1, start, start + n))
                start += n
            split, i = split + 1, i + 1
            continue
        j = i
        while merge and j < len(sizes) and sizes[j] < tiny:
            j += 1
        if j - i < 2:  # not a run of tiny blocks: keep the block as it is
            pieces.append((i, i + 1, 0, s))
            i += 1
            continue
        first, acc = i, 0
        for k in range(i, j):  # greedy groups of at most the target
            if k > first and acc + sizes[k] > target:
                pieces.append((first, k, 0, acc))
                merged += (k - first) if k - first > 1 else 0
                first, acc = k, 0
            acc += sizes[k]
        pieces.append((first, j, 0, acc))
        merged += (j - first) if j - first > 1 else 0
        i = j
    plan = _Plan(pieces, split, merged)
    return plan if (split or merged) else None


def _fit_plan(sizes: Sequence[int], max_rows: int) -> _Plan | None:
    """Split every block above ``max_rows`` into even pieces of at most ``max_rows``."""
    pieces, split = [], 0
    for i, s in enumerate(int(s) for s in sizes):
        if s <= max_rows:
            pieces.append((i, i + 1, 0, s))
            continue
        start = 0
        for n in _even(s, math.ceil(s / max_rows)):
            pieces.append((i, i + 1, start, start + n))
            start += n
        split += 1
    return _Plan(pieces, split, 0) if split else None


def _settings(factor, floor, merge_below) -> tuple[float, int, float]:
    factor = float(config.get("skew.factor", factor))
    floor = config.get("skew.floor", floor)
    floor = parse_bytes(floor) if isinstance(floor, str) else int(floor)
    merge_below = float(config.get("skew.merge-below", merge_below))
    if not factor > 1:
        raise ValueError(f"blockflow.split_skewed: factor must be above 1, got {factor!r}; a "
                         f"block is skewed when larger than factor x the median, e.g. 5.")
    if floor < 0:
        raise ValueError(f"blockflow.split_skewed: floor must be a size >= 0, got {floor!r}; "
                         f"e.g. floor='64MiB'.")
    if not 0 <= merge_below < 1:
        raise ValueError(f"blockflow.split_skewed: merge_below must be a fraction 0-1 of the "
                         f"median block, got {merge_below!r}; 0 turns merging off.")
    return factor, floor, merge_below


def _max_piece() -> float:
    value = float(config.get("skew.max-piece"))
    if not value >= 1:
        raise ValueError(f"blockflow.skew.max-piece must be at least 1, got {value!r}; it is "
                         f"the largest piece of a skewed collection as a multiple of the "
                         f"target size, e.g. 1.25.")
    return value


# -- arrays --------------------------------------------------------------------------------

def _row_bytes(x: da.Array, axis: int) -> float:
    """Bytes of one row along ``axis`` of the array's largest block."""
    other = [max(c, default=0) for a, c in enumerate(x.chunks) if a != axis]
    return float(x.dtype.itemsize * math.prod(other))


def _known(chunks) -> bool:
    return not any(isinstance(s, float) and math.isnan(s) for c in chunks for s in c)


def _chunked_axis(x: da.Array, axes: Sequence[int] | None = None) -> int | None:
    """The axis with the most blocks (the first on ties), among ``axes``."""
    axes = list(range(x.ndim)) if axes is None else list(axes)
    if not axes:
        return None
    return max(axes, key=lambda a: (len(x.chunks[a]), -a))


def _array_skew(x: da.Array, factor, floor, merge_below, axes=None, label=""
                ) -> tuple[int, tuple] | None:
    if x.ndim == 0 or not _known(x.chunks):
        return None
    axis = _chunked_axis(x, axes)
    if axis is None:
        return None
    rb = _row_bytes(x, axis)
    plan = _skew_plan(x.chunks[axis], rb, factor, floor, merge_below)
    if plan is None:
        return None
    _record(BlockResize("array", "skew", axis, tuple(x.chunks[axis]), plan.sizes, rb,
                        plan.split, plan.merged, time.time(), label))
    return axis, plan.sizes


def split_skewed(collection, *, factor: float | None = None, floor: int | str | None = None,
                 merge_below: float | None = None, axis: int | str | None = None,
                 lengths: Sequence[int] | bool | None = None):
    """Split blocks far larger than the median, and merge runs of tiny ones.

    A block is skewed above ``factor`` times the median block's rows and ``floor`` bytes; it
    is split into even pieces of about the larger of the median and the mean block. Runs of
    blocks below ``merge_below`` times that target are merged. Values and order are
    unchanged. Method: Spark's adaptive skew handling; the target and merging rule are
    blockflow heuristics.

    Parameters
    ----------
    collection : dask.array.Array, dask.dataframe.DataFrame/Series, or xarray object
        Re-cut along ``axis`` (arrays, xarray) or by rows (dataframes).
    factor : float, optional
        Times the median a block must exceed to be split; default ``blockflow.skew.factor``.
    floor : int or str, optional
        Bytes (``"64MiB"`` accepted) a block must exceed to be split; default
        ``blockflow.skew.floor``.
    merge_below : float, optional
        Fraction 0-1 of the target below which a block is tiny (0: no merging); default
        ``blockflow.skew.merge-below``.
    axis : int or str, optional
        The axis (arrays) or dimension (xarray) to re-cut; default the one with most blocks.
    lengths : sequence of int or bool, optional
        Dataframes: partition lengths in rows; ``True`` computes them. Default: sizes where
        cheap to know, otherwise nothing changes.

    Returns
    -------
    (collection, BlockResize or None)
        The re-cut collection (the input itself when nothing changes) and the change.

    Raises
    ------
    TypeError
        If ``collection`` is not a Dask array, dataframe or chunked xarray object.
    ValueError
        If ``factor <= 1``, ``floor < 0``, ``merge_below`` is not in [0, 1), ``axis`` is out
        of range, or ``lengths`` does not match the partitions.

    Examples
    --------
    >>> import dask.array as da
    >>> x = da.ones(1100, chunks=((1000,) + (10,) * 10,))
    >>> y, change = split_skewed(x, floor=0)
    >>> y.chunks[0][:3], len(y.chunks[0])
    ((10, 10, 10), 110)
    """
    factor, floor, merge_below = _settings(factor, floor, merge_below)
    before = _count
    if isinstance(collection, da.Array):
        axes = None if axis is None else [_check_axis(axis, collection.ndim)]
        found = _array_skew(collection, factor, floor, merge_below, axes)
        if found is None:
            return collection, None
        a, sizes = found
        out = collection.rechunk({a: sizes})
    elif isinstance(collection, (dd.DataFrame, dd.Series)):
        out = _frame_skew(collection, factor, floor, merge_below, lengths)
    elif type(collection).__module__.split(".")[0] == "xarray":
        out = _xarray_resize(collection, axis, lambda sizes, rb: _skew_plan(
            sizes, rb, factor, floor, merge_below), "skew")
    else:
        raise TypeError(
            f"blockflow.split_skewed: expected a Dask array, dataframe or chunked xarray "
            f"object, got {type(collection).__name__}; wrap it first (da.from_array, "
            f"dd.from_pandas, obj.chunk()).")
    return out, (_records[-1] if _count > before else None)


def _check_axis(axis, ndim: int) -> int:
    if not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
        raise ValueError(f"blockflow.split_skewed: axis={axis!r} is out of range for the "
                         f"{ndim}-d array; give an axis from {-ndim} to {ndim - 1}.")
    return int(axis) % ndim


# -- dataframes ----------------------------------------------------------------------------

def _len_and_bytes(part):
    nbytes = part.memory_usage(deep=True)
    nbytes = int(nbytes.sum()) if hasattr(nbytes, "sum") else int(nbytes)
    return pd.Series([(len(part), nbytes)])


def _meta_row_bytes(meta) -> float:
    """Estimated bytes per row from the dtypes (64 for text and objects)."""
    dtypes = list(meta.dtypes) if hasattr(meta, "columns") else [meta.dtype]
    dtypes.append(meta.index.dtype)
    return float(sum(getattr(d, "itemsize", 0) if getattr(d, "kind", "O") in "biufcmM"
                     else 64 for d in dtypes))


def _persisted_futures(df) -> list | None:
    """Futures of a persisted dataframe's partitions in order, or None if any is not done."""
    expr = df.expr
    if type(expr).__name__ != "FromGraph":
        return None
    try:
        layer = expr.operand("layer")
        futures = [layer[k] for k in expr.operand("keys")]
    except Exception:
        return None
    if len(futures) != df.npartitions or not all(
            isinstance(f, Future) and f.status == "finished" for f in futures):
        return None
    return futures


def partition_sizes(df, lengths: Sequence[int] | bool | None = None
                    ) -> tuple[tuple[int, ...], float, str] | None:
    """``(sizes per partition, bytes per unit, unit)`` of a dataframe when cheap to know,
    else None; ``unit`` is ``"rows"``, or ``"bytes"`` for a persisted frame."""
    if lengths is not None and lengths is not True and lengths is not False:
        lengths = tuple(int(n) for n in lengths)
        if len(lengths) != df.npartitions:
            raise ValueError(
                f"blockflow.split_skewed: lengths gives {len(lengths)} lengths for "
                f"{df.npartitions} partitions; give one per partition.")
        return lengths, _meta_row_bytes(df._meta), "rows"
    if lengths is False:
        return None
    expr = df.expr
    if type(expr).__name__ == "FromPandas" and lengths is None:
        try:  # dask-expr knows the lengths of a frame it split itself
            rows = tuple(int(n) for n in expr._get_lengths())
            sample = expr.operand("frame").iloc[:1000]  # bytes per row from a sample: cheap
            usage = sample.memory_usage(deep=True)
            total = int(usage.sum()) if hasattr(usage, "sum") else int(usage)
            return rows, total / max(len(sample), 1), "rows"
        except Exception:  # private API moved: fall through (no sizes)
            pass
    if lengths is True:
        pairs = df.map_partitions(_len_and_bytes, meta=(None, object)).compute().tolist()
        rows = tuple(int(r) for r, _ in pairs)
        total = sum(b for _, b in pairs)
        return rows, total / max(sum(rows), 1), "rows"
    futures = _persisted_futures(df)
    if futures is not None:
        try:
            held = futures[0].client.nbytes([f.key for f in futures], summary=False)
        except Exception:  # released meanwhile: sizes unknown
            held = {}
        if all(f.key in held for f in futures):
            return tuple(int(held[f.key]) for f in futures), 1.0, "bytes"
    return None


def _slice_share(part, lo: int, hi: int, size: int):
    """Rows ``[lo, hi)`` of a partition of ``size`` units (rows or bytes)."""
    n = len(part)
    return part.iloc[n * lo // size: n * hi // size] if size else part.iloc[0:0]


def _concat_parts(*parts):
    return concat(list(parts))


def _identity(part):
    return part


def _spread_persisted(futures, rows: Sequence[int], plan: _Plan, threads: dict) -> list:
    """The pieces of a persisted frame as futures, split partitions' pieces placed on the
    least-loaded worker per thread, largest first, counting the partitions kept where they
    are (longest-processing-time placement; Dask would queue them where the partition is)."""
    client = futures[0].client
    load = dict.fromkeys(threads, 0.0)
    kept_at = {i: p[0] for i, p in enumerate(plan.pieces)
               if p[1] - p[0] == 1 and p[3] - p[2] == rows[p[0]]}
    try:  # who holds the partitions kept as they are: their stage runs there
        held = data_holders(client, [futures[k] for k in kept_at.values()]) if kept_at else {}
    except Exception:  # placement is a heuristic: without holders, spread evenly
        held = {}
    for k in kept_at.values():
        where = [w for w in held.get(futures[k].key, ()) if w in load]
        if where:
            load[where[0]] += rows[k] / threads[where[0]]
    # One graph for all cuts, copies and merges (dozens of graph updates cost seconds on a
    # loaded scheduler); worker annotations survive because the graph is not optimised.
    todo = {}
    for i in sorted(set(range(len(plan.pieces))) - set(kept_at),
                    key=lambda i: plan.sizes[i], reverse=True):
        first, stop, lo, hi = plan.pieces[i]
        if stop - first > 1:
            piece = delayed(_concat_parts, pure=True)(*futures[first:stop])
        else:  # the cut runs where the partition is, its piece then moves
            piece = delayed(_slice_share, pure=True)(futures[first], lo, hi, rows[first])
        if load:
            w = min(sorted(load), key=load.__getitem__)
            load[w] += plan.sizes[i] / threads[w]
            with dask.annotate(workers=[w], allow_other_workers=True):
                piece = delayed(_identity, pure=True)(piece)
        todo[i] = piece
    done = dict(zip(todo, client.persist(list(todo.values()), optimize_graph=False)))
    return [futures_of(done[i])[0] if i in done else futures[p[0]]
            for i, p in enumerate(plan.pieces)]


def _frame_from_plan(df, rows: Sequence[int], plan: _Plan, threads: dict | None = None):
    futures = _persisted_futures(df) if plan.split else None
    if futures is not None:
        new = _spread_persisted(futures, rows, plan,
                                threads if threads is not None else _threads(futures[0].client))
        return dd.from_delayed(new, meta=df._meta, divisions=None, verify_meta=False,
                               prefix="blockflow-recut")
    parts = df.to_delayed(optimize_graph=False)  # persisted frames: far faster to run
    new = []
    for first, stop, lo, hi in plan.pieces:
        if stop - first > 1:
            new.append(delayed(_concat_parts, pure=True)(*parts[first:stop]))
        elif lo == 0 and hi == rows[first]:  # neither split nor merged
            new.append(parts[first])
        else:
            new.append(delayed(_slice_share, pure=True)(parts[first], lo, hi, rows[first]))
    divisions = None
    if df.known_divisions and not plan.split:
        divisions = tuple(df.divisions[p[0]] for p in plan.pieces) + (df.divisions[-1],)
    return dd.from_delayed(new, meta=df._meta, divisions=divisions, verify_meta=False,
                           prefix="blockflow-recut")


def _threads(client) -> dict:
    """Worker address -> threads, of the cluster a persisted frame's stage runs on."""
    return {w: max(int(i.get("nthreads") or 1), 1) for w, i in workers_info(client).items()}


def _frame_skew(df, factor, floor, merge_below, lengths=None, label=""):
    known = partition_sizes(df, lengths)
    if known is None:
        logger.debug("blockflow: partition lengths of %s are not known cheaply; not "
                     "checked for skew (pass lengths=True to compute them)", label or "a frame")
        return df
    rows, rb, unit = known
    futures = _persisted_futures(df) if unit == "bytes" else None  # its stage's threads:
    threads = _threads(futures[0].client) if futures else None
    plan = _skew_plan(rows, rb, factor, floor, merge_below,
                      threads=sum(threads.values()) if threads else None)
    if plan is None:
        return df
    _record(BlockResize("dataframe", "skew", 0, rows, plan.sizes, rb, plan.split,
                        plan.merged, time.time(), label, unit))
    return _frame_from_plan(df, rows, plan, threads)


# -- xarray --------------------------------------------------------------------------------

def _xarray_dim(obj, dim=None) -> str | None:
    chunks = dict(obj.chunksizes)
    if dim is not None:
        if dim not in chunks:
            raise ValueError(f"blockflow.split_skewed: dimension {dim!r} is not chunked; "
                             f"chunked dimensions: {sorted(map(str, chunks))}.")
        return dim
    if not chunks:
        return None
    return max(chunks, key=lambda d: len(chunks[d]))


def _xarray_row_bytes(obj, dim) -> float:
    """Bytes of one row along ``dim`` of the largest block (all variables with ``dim``)."""
    sizes = dict(obj.chunksizes)
    per_block = 1.0
    for d, c in sizes.items():
        if d != dim and len(c):
            per_block *= max(c) / max(sum(c), 1)
    n = obj.sizes[dim]
    return obj.nbytes / max(n, 1) * per_block


def _xarray_resize(obj, dim, planner: Callable, reason: str, label: str = ""):
    dim = _xarray_dim(obj, dim)
    if dim is None:
        return obj
    sizes = tuple(int(s) for s in obj.chunksizes[dim])
    rb = _xarray_row_bytes(obj, dim)
    plan = planner(sizes, rb)
    if plan is None:
        return obj
    _record(BlockResize("xarray", reason, str(dim), sizes, plan.sizes, rb, plan.split,
                        plan.merged, time.time(), label))
    return obj.chunk({dim: plan.sizes})
