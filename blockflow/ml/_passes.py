"""A pass over resident shards: one task per worker, gathered by a fan-in tree to the client.

Each block's value is kept apart up the tree and the client adds them in block order, so a
pass's sum is bitwise the same whatever the placement and the order tasks finish in (a
fixed-order sum, as NumPy's over the same blocks).

What :meth:`ResidentShards.map_sum <blockflow.ml.ResidentShards.map_sum>` submits and waits
for (GLMs' full-batch gradients: a few parameters, passed as a small task argument).
Neural networks train on torch.distributed instead (:mod:`blockflow.ml.train`).
"""

from __future__ import annotations

import time
from collections import defaultdict

import dask
from distributed import get_worker

from blockflow.reduction import choose_split_every
from blockflow.scheduling.wait import gather_as_done

__all__ = ["ShardPasses", "add_values"]


def add_values(a, b):
    """``a + b`` for arrays, numbers and tuples of them; None (no rows) adds nothing."""
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, tuple):
        return tuple(add_values(x, z) for x, z in zip(a, b))
    return a + b


def _run_shard(func, blocks, rows, args, ids):
    """On a worker: ``func([(X, y)], [row indices or None], *args)`` per block, timed; the
    values by block id."""
    me = get_worker().address
    t0 = time.perf_counter()
    values = {j: func([b], [r], *args) for j, b, r in zip(ids, blocks, rows)}
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

    def _submit(self, func, rows, args) -> list:
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
                    [None if rows is None else rows[j] for j in js], args, js))
        k = max(2, self.split_every or choose_split_every(1 << 20, 1 << 30))
        while len(parts) > k:  # the fan-in tree on the workers: a node sums up to k parts
            parts = [parts[i] if len(parts[i:i + k]) == 1 else
                     dask.delayed(_add, pure=False)(*parts[i:i + k])
                     for i in range(0, len(parts), k)]
        return self.client.compute(parts, optimize_graph=False)

    def _wait(self, parts) -> dict:
        """The top level's parts, each fetched once done; ``value``: the blocks' values added
        in block order."""
        got = _add(*gather_as_done(parts, alive=self._workers,
                                   needed=set(self.placement.values()), poll=self.poll))
        value = None
        for j in sorted(got["values"]):
            value = add_values(value, got["values"][j])
        return dict(got, value=value)
