"""A pass over resident shards: one task per worker, gathered by a fan-in tree to the client.

Each block's value is kept apart up the tree and the client adds them in block order, so a
pass's sum is bitwise the same whatever the placement and the order tasks finish in (a
fixed-order sum, as NumPy's over the same blocks).

What :meth:`ResidentShards.map_sum <blockflow.ml.ResidentShards.map_sum>` submits and waits
for (GLMs' full-batch gradients: a few parameters, passed as a small task argument).
Neural networks train on torch.distributed instead (:mod:`blockflow.ml.train`).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict

import dask
import numpy as np
from distributed import get_worker

from blockflow.backends import array_module
from blockflow.reduction import choose_split_every
from blockflow.scheduling.wait import gather_as_done

__all__ = ["GROUP", "ShardPasses", "exact_sum", "group_terms", "merge_groups", "two_part_sum"]


def two_part_sum(a):
    """Sums over the rows of ``a`` (2-D, float64; NumPy or CuPy) as two rows ``[hi, lo]``
    whose exact sum is the rows' exact sum to about 2**-100 relative.

    A pairwise tree of error-free additions (Knuth's TwoSum: ``s + e == x + y`` exactly;
    the first half of the rows with the second, contiguous), the errors summed apart into
    ``lo``; what is left is second order, so blocks cut at other rows give the same total
    once :func:`exact_sum` rounds it (compensated summation, Ogita, Rump and Oishi 2005).
    """
    xp = array_module(a)
    lo = a[:0].sum(axis=0)  # zeros of the right kind and shape
    while a.shape[0] > 1:
        h = a.shape[0] // 2
        x, y = a[:h], a[h:2 * h]
        s = x + y
        bb = s - x
        e = s - bb
        xp.subtract(x, e, out=e)
        xp.subtract(y, bb, out=bb)
        e += bb
        lo += e.sum(axis=0)
        a = xp.concatenate([s, a[2 * h:]]) if a.shape[0] % 2 else s
    return _stack(a[0] if a.shape[0] else lo * 0, lo)


def _host(a) -> np.ndarray:
    """``a`` as a NumPy float64 array (CuPy's copied to the host)."""
    if hasattr(a, "get") and not isinstance(a, np.ndarray):
        a = a.get()
    return np.asarray(a, dtype=float)


def _stack(hi, lo) -> np.ndarray:
    return np.stack([_host(hi), _host(lo)])


def exact_sum(values) -> np.ndarray:
    """Column sums of the blocks' ``values`` (each a row, or rows, of terms) correctly
    rounded once (:func:`math.fsum`, Shewchuk's exact partials): the same whatever the
    order or the grouping of the terms."""
    parts = np.vstack([np.atleast_2d(np.asarray(v, dtype=float)) for v in values])
    return np.array([math.fsum(c) for c in parts.T])


#: Rows per group of :func:`group_terms`: groups start at multiples of it in the data's
#: rows, whatever the blocks.
GROUP = 256  # 16 cost 1.5-1.8x a BLAS pass, 256 1.3x (benchmarks/training.py --only glm)


def _group_sums(columns: list) -> np.ndarray:
    """Each run of ``GROUP`` rows' sum (fewer: one partial group) of ``columns`` (arrays
    ``(g,)`` or ``(g, c)``), as ``(groups, k)``: the one way every group is summed,
    whichever block or pieces it came from."""
    g = len(columns[0])
    size = GROUP if g % GROUP == 0 and g else max(g, 1)
    return np.concatenate([_host(a.reshape((-1, size) + a.shape[1:]).sum(axis=1)).reshape(
        -1 if g else 0, int(np.prod(a.shape[1:], dtype=int))) for a in columns], axis=1)


def _rows(column, lo: int, hi: int):
    """Rows ``lo:hi`` of a column of :func:`group_terms` (a pair ``(x, w)``: of
    ``x * w[:, None]``)."""
    if isinstance(column, tuple):
        x, w = column
        return x[lo:hi] * w[lo:hi, None]
    return column[lo:hi]


def group_terms(columns: list, first: int, chunk: int = 16 * GROUP) -> dict:
    """On a worker: a block's terms (``columns``: arrays ``(n,)`` or ``(n, c)`` of rows
    ``first...`` of the data, NumPy or CuPy; a pair ``(x, w)`` for ``x * w[:, None]``,
    formed ``chunk`` rows at a time) in fixed row groups: ``parts``, the groups the block
    holds whole, summed (:func:`two_part_sum` over their sums); ``pieces``, ``(group,
    first row, columns)`` of the groups it holds part of (:func:`merge_groups` joins them
    across blocks)."""
    n = len(columns[0][0] if isinstance(columns[0], tuple) else columns[0])
    a = min(-first % GROUP, n)  # rows before the first whole group
    b = a + (n - a) // GROUP * GROUP  # rows up to the end of the last whole group
    pieces = [((first + lo) // GROUP, first + lo, [_host(_rows(c, lo, hi)) for c in columns])
              for lo, hi in ((0, a), (b, n)) if hi > lo]
    sums = [_group_sums([_rows(c, lo, min(lo + chunk, b)) for c in columns])
            for lo in range(a, b, chunk)]
    k = sum(int(np.prod(_rows(c, 0, 0).shape[1:], dtype=int)) for c in columns)
    return {"parts": two_part_sum(np.concatenate(sums) if sums else np.zeros((0, k))),
            "pieces": pieces}


def merge_groups(values) -> np.ndarray:
    """The column sums of blocks' :func:`group_terms`: each group the blocks cut joined
    and summed as a whole one, all correctly rounded once (:func:`exact_sum`). The same
    bits whatever the blocks' boundaries."""
    cut: dict[int, list] = defaultdict(list)
    for v in values:
        for g, lo, cols in v["pieces"]:
            cut[g].append((lo, cols))
    joined = []
    for _, ps in sorted(cut.items()):
        ps = [cols for _, cols in sorted(ps, key=lambda p: p[0])]
        joined.append(_group_sums([np.concatenate(c) for c in zip(*ps)]))
    return exact_sum([v["parts"] for v in values] + joined)


def _run_shard(func, blocks, rows, args, ids, firsts=None):
    """On a worker: ``func([(X, y)], [row indices or None], *args)`` per block (with
    ``firsts``, its first row's index in the data appended), timed; the values by block
    id."""
    me = get_worker().address
    t0 = time.perf_counter()
    values = {j: func([b], [r], *args, *(() if firsts is None else (firsts[i],)))
              for i, (j, b, r) in enumerate(zip(ids, blocks, rows))}
    n = sum(len(r) if r is not None else len(b[0]) for b, r in zip(blocks, rows))
    return {"values": values, "seconds": {me: time.perf_counter() - t0}, "rows": {me: n}}


def _add(*parts):
    """Merge the blocks' ``values`` and the timing dicts (no arithmetic: the client adds)."""
    values, seconds, rows = {}, {}, {}
    for p in parts:
        values.update(p["values"])
        seconds.update(p["seconds"])
        rows.update(p["rows"])
    return {"values": values, "seconds": seconds, "rows": rows}


class ShardPasses:
    """How :class:`blockflow.ml.ResidentShards` submits and waits for a pass (a mixin)."""

    def _submit(self, func, rows, args, first_rows: bool = False) -> list:
        """The pass as one graph: a task per worker and the fan-in tree up to its top level
        (at most ``split_every`` futures, which the client adds)."""
        by_worker: dict[str, list[int]] = defaultdict(list)
        for j in sorted(self.placement):
            if rows is None or len(rows[j]):
                by_worker[self.placement[j]].append(j)
        parts = []
        r0 = self.overhead_rows()
        for a, js in sorted(by_worker.items()):
            n = sum(self.block_rows[j] if rows is None else len(rows[j]) for j in js)
            # the shares differ in rows on purpose (so that they last the same): the
            # scheduler plugin's speed model compares seconds per row, not per task
            with dask.annotate(workers=[a], allow_other_workers=False,
                               blockflow_work=n + r0):
                parts.append(dask.delayed(_run_shard, pure=False)(
                    func, [self.futures[j] for j in js],
                    [None if rows is None else rows[j] for j in js], args, js,
                    [int(self.offsets[j]) for j in js] if first_rows else None))
        k = max(2, self.split_every or choose_split_every(1 << 20, 1 << 30))
        while len(parts) > k:  # the fan-in tree on the workers: a node sums up to k parts
            parts = [parts[i] if len(parts[i:i + k]) == 1 else
                     dask.delayed(_add, pure=False)(*parts[i:i + k])
                     for i in range(0, len(parts), k)]
        return self.client.compute(parts, optimize_graph=False)

    def _wait(self, parts, merge=None) -> dict:
        """The top level's parts, each fetched once done; ``value``: ``merge`` (default
        :func:`exact_sum`) of the blocks' values in block order."""
        got = _add(*gather_as_done(parts, alive=self._workers,
                                   needed=set(self.placement.values()), poll=self.poll))
        value = (merge or exact_sum)([got["values"][j] for j in sorted(got["values"])])
        return dict(got, value=value)
