"""Work stealing inside a pass: the rows a worker has not started go to an idle peer.

Speed-weighted shares balance what is *predicted*; a step still waits for whichever worker
the moment slows (a co-tenant's kernel, clocks, a noisy host: on a 2-core host the compute
time per row of one task varies by 10-20 % from step to step). Inside a pass, each worker's
task therefore works through its rows in chunks taken from the front of a
:class:`RowPool` (all but a reserve, a fifth by default, in one kernel call; the reserve in
halving chunks, never less than ``1 / chunks`` of its rows), and a worker that has
finished its own rows asks its peers for rows they have not started, taken from the
back. The owner of a pool decides under its
lock how many rows to give: as many as make the thief and the owner finish together, by
both their measured seconds per row and the round trip (none when handing over would not
finish earlier). Every row of the pass is still processed exactly once, so the sum over
workers is unchanged (up to floating-point summation order).

The request goes worker to worker through a comm handler (``blockflow_steal``, installed by
:class:`StealPlugin`), with the rows' data in the reply: no scheduler round trip, no task.

Sources: guided self-scheduling (Polychronopoulos and Kuck, IEEE Trans. Computers, 1987)
for the owner's chunks; work stealing from the back of a victim's queue (Blumofe and
Leiserson, JACM 1999); the hand-over rule that both finish together is a blockflow
heuristic.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Any, Callable

import numpy as np
from distributed.diagnostics.plugin import WorkerPlugin

__all__ = ["RowPool", "StealPlugin", "run_stealing"]

# (pass id, worker address) -> the pool of that worker's task in that pass
_POOLS: dict[tuple[str, str], RowPool] = {}
_POOLS_LOCK = threading.Lock()
HANDLER = "blockflow_steal"
# Seconds a thief waits for a peer's answer.
REQUEST_TIMEOUT = 10.0


class RowPool:
    """One worker's rows of one pass, claimed from the front by its own task and from the
    back by peers, each row exactly once.

    Parameters
    ----------
    blocks : list of (X, y)
        The worker's resident blocks used in this pass.
    rows : list of numpy.ndarray or None
        Per block, the local row indices of the pass (None: all its rows).
    chunks : int
        The owner's chunks are never smaller than ``1 / chunks`` of its rows (fewer, larger
        kernel calls; the last chunk in flight bounds how unevenly the workers can end).
    prior_spr : float, optional
        Seconds per row expected for this worker (from earlier passes), used until its
        first chunk is timed.
    reserve : float, default 0.2
        Fraction 0-1 of the rows kept out of the owner's first chunk, then run in halving
        chunks: only those can go to a thief. Each kernel call costs (a fixed part, a
        smaller batch, cold caches after another device's turn): guided chunks of a third
        of what is left (7-9 calls a step) cost 5-15 % more device time per row on the
        training benchmark, the reserve 4-8 % with 3-4 calls.
    """

    def __init__(self, blocks, rows, chunks: int, prior_spr: float | None = None,
                 reserve: float = 0.2):
        self.blocks = blocks
        sizes, idx = [], []
        for (xb, _), r in zip(blocks, rows):
            r = np.arange(len(xb)) if r is None else np.asarray(r)
            sizes.append(len(r))
            idx.append(r)
        self.block_of = np.repeat(np.arange(len(blocks)), sizes)
        self.local = np.concatenate(idx) if idx else np.zeros(0, int)
        self.n = len(self.local)
        self.front, self.back = 0, self.n
        self.min_chunk = max(1, math.ceil(self.n / max(1, chunks)))
        self.reserve = reserve
        self.prior_spr = prior_spr
        self.lock = threading.Lock()
        self.done_rows, self.busy = 0, 0.0  # the owner's finished chunks
        self.flight: tuple[float, int] | None = None  # (start, rows) of the chunk running
        self.given = 0

    def take_front(self) -> tuple[int, int] | None:
        """The owner's next chunk as a span ``(lo, hi)`` of the pool, or None when empty."""
        with self.lock:
            left = self.back - self.front
            if left <= 0:
                self.flight = None
                return None
            if self.front == 0:  # all but the reserve in one kernel call
                c = max(self.min_chunk, math.floor(self.n * (1 - self.reserve)))
            else:  # the reserve in halving chunks (guided self-scheduling)
                c = max(math.ceil(left / 2), self.min_chunk)
            if left - c < self.min_chunk / 2:
                c = left  # no remnant smaller than half a chunk
            c = min(left, c)
            lo = self.front
            self.front += c
            self.flight = (time.perf_counter(), c)
            return lo, self.front

    def finished(self, rows: int, seconds: float) -> None:
        """The owner's chunk of ``rows`` took ``seconds``."""
        with self.lock:
            self.done_rows += rows
            self.busy += seconds
            self.flight = None

    def close(self) -> None:
        """Nothing more to give (the owner is done, or gave up)."""
        with self.lock:
            self.back = self.front

    def _spr(self, now: float) -> float | None:
        if self.done_rows:
            return self.busy / self.done_rows
        bound = None
        if self.flight is not None:  # the chunk running has taken at least this long
            bound = (now - self.flight[0]) / self.flight[1]
        if self.prior_spr is not None:
            return max(self.prior_spr, bound or 0.0)
        return bound

    def _left(self, now: float) -> tuple[float, int, float | None]:
        spr = self._spr(now)
        unclaimed = self.back - self.front
        if spr is None:
            return math.inf if unclaimed else 0.0, unclaimed, None
        flight = 0.0
        if self.flight is not None:
            flight = max(0.0, spr * self.flight[1] - (now - self.flight[0]))
        return spr * unclaimed + flight, unclaimed, spr

    def status(self) -> dict:
        """``{"left": seconds of work expected, "rows": rows not started, "spr": seconds
        per row or None}``."""
        with self.lock:
            left, unclaimed, spr = self._left(time.perf_counter())
        return {"left": left, "rows": unclaimed, "spr": spr}

    def give(self, thief_spr: float | None, overhead: float) -> tuple[int, int] | None:
        """Hand the last rows over to a thief: as many as make both finish together
        (:func:`rows_to_give`); None when not one row would end earlier at the thief."""
        with self.lock:
            left, unclaimed, spr = self._left(time.perf_counter())
            r = rows_to_give(left, unclaimed, spr, thief_spr, overhead)
            if r < 1:
                return None
            self.back -= r
            self.given += r
            return self.back, self.back + r

    def parts(self, lo: int, hi: int) -> tuple[list, list]:
        """``(blocks, rows)`` of the span, for ``func(blocks, rows, *args)``."""
        blocks, rows = [], []
        b, loc = self.block_of[lo:hi], self.local[lo:hi]
        for j in np.unique(b):
            blocks.append(self.blocks[j])
            rows.append(loc[b == j])
        return blocks, rows

    def data(self, lo: int, hi: int) -> tuple[Any, Any]:
        """The span's features and labels on the host (to send to a thief)."""
        from blockflow.backends import _block_to_host

        blocks, rows = self.parts(lo, hi)
        xs = [_block_to_host(xb[r]) for (xb, _), r in zip(blocks, rows)]
        ys = [_block_to_host(yb[r]) for (_, yb), r in zip(blocks, rows)]
        return np.concatenate(xs), np.concatenate(ys)


def rows_to_give(left: float, unclaimed: int, spr: float | None, thief_spr: float | None,
                 overhead: float) -> int:
    """Rows an owner hands to a thief so that both finish together.

    With ``T`` the owner's expected seconds left (``left``), ``s`` its seconds per row,
    ``t`` the thief's and ``o`` the hand-over's round trip, ``r = floor((T - o) / (s + t))``,
    at most ``unclaimed``: the owner then ends at ``T - s r`` and the thief at ``o + t r``.
    Unknown rates: the thief's is taken as the owner's; with neither, half the rows.
    A blockflow heuristic.
    """
    if unclaimed <= 0:
        return 0
    if spr is None:
        return unclaimed // 2
    t = spr if thief_spr is None else thief_spr
    if spr + t <= 0:
        return unclaimed
    return max(0, min(unclaimed, math.floor((left - overhead) / (spr + t))))


def _handler_for(worker):
    def blockflow_steal(pass_id: str, action: str = "status", spr: float | None = None,
                        overhead: float = 0.0) -> dict:
        from distributed.protocol import to_serialize

        pool = _POOLS.get((pass_id, worker.address))
        if pool is None:  # not started, or done
            return {"left": 0.0, "rows": 0}
        if action == "status":
            return pool.status()
        span = pool.give(spr, overhead)
        if span is None:
            return {"rows": 0}
        x, y = pool.data(*span)
        return {"rows": span[1] - span[0], "x": to_serialize(x), "y": to_serialize(y)}
    return blockflow_steal


class StealPlugin(WorkerPlugin):
    """Worker plugin installing the ``blockflow_steal`` comm handler (see module doc).

    Registered by :class:`blockflow.ml.ResidentShards` when a pass may steal
    (``client.register_plugin(StealPlugin(), name="blockflow-steal")``); workers that join
    later get it too.
    """

    name = "blockflow-steal"

    def setup(self, worker) -> None:
        from blockflow._distributed import add_worker_handler
        add_worker_handler(worker, HANDLER, _handler_for(worker))

    def teardown(self, worker) -> None:
        from blockflow._distributed import remove_worker_handler
        remove_worker_handler(worker, HANDLER)


def _add(a, b):
    """``a + b`` for arrays, numbers and tuples of them; None (no rows) adds nothing."""
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, tuple):
        return tuple(_add(x, z) for x, z in zip(a, b))
    return a + b


def run_stealing(func: Callable, blocks, rows, args, pass_id: str, peers: list[str],
                 chunks: int, prior_spr: dict[str, float],
                 reserve: dict[str, float] | None = None) -> tuple[Any, int, int, float]:
    """On a worker: ``func`` over its rows in chunks, then over rows stolen from peers.

    ``reserve``: per worker, the fraction of its rows kept out of its first kernel call
    (see :class:`RowPool`; default 0.2). Returns ``(sum of func's results or None, rows
    processed, rows stolen, seconds in func)``: the last is the worker's busy time, without
    the requests to its peers.
    """
    from distributed import get_worker
    from distributed.utils import sync

    from blockflow._distributed import call_worker, has_worker_handler
    from blockflow.backends import array_module

    worker = get_worker()
    me = worker.address
    pool = RowPool(blocks, rows, chunks, prior_spr.get(me), (reserve or {}).get(me, 0.2))
    key = (pass_id, me)
    with _POOLS_LOCK:
        _POOLS[key] = pool
    total, done = None, 0
    try:
        while (span := pool.take_front()) is not None:
            t0 = time.perf_counter()
            total = _add(total, func(*pool.parts(*span), *args))
            pool.finished(span[1] - span[0], time.perf_counter() - t0)
            done += span[1] - span[0]
    finally:
        pool.close()
        with _POOLS_LOCK:
            _POOLS.pop(key, None)
    others = [p for p in peers if p != me]
    busy = pool.busy
    if not others or not has_worker_handler(worker, HANDLER):
        return total, done, 0, busy
    spr = pool.busy / pool.done_rows if pool.done_rows else prior_spr.get(me)
    xp = array_module(blocks[0][0]) if blocks else np
    stolen = 0

    # A peer that does not answer within REQUEST_TIMEOUT gives nothing: a lost peer must
    # not hold this thread for distributed's connect timeout, while the pass it belonged
    # to is redone behind it.
    async def ask(p, **msg):
        return await asyncio.wait_for(call_worker(worker, p, HANDLER, pass_id=pass_id, **msg),
                                      REQUEST_TIMEOUT)

    async def status():
        return await asyncio.gather(*(ask(p, action="status") for p in others),
                                    return_exceptions=True)

    while True:
        t0 = time.perf_counter()
        replies = sync(worker.loop, status)
        overhead = 2 * max(time.perf_counter() - t0, 0.0005)  # status, then the claim
        # peers by work left; only those that would hand over a row at all are asked (a
        # claim that gets nothing ends the search: no polling loop on a shared host)
        ranked = sorted((r["left"], p) for p, r in zip(others, replies)
                        if isinstance(r, dict) and rows_to_give(
                            r["left"], r.get("rows", 0), r.get("spr"), spr, overhead) >= 1)
        got = None
        for _, p in ranked[::-1]:
            try:
                reply = sync(worker.loop, ask, p, action="claim", spr=spr,
                             overhead=overhead)
            except Exception:  # the peer went away or did not answer: it gives nothing
                # (rows it handed over in a reply that never arrived are missing from the
                # pass's row count, and ResidentShards.map_sum redoes the pass)
                continue
            if reply.get("rows"):
                got = reply
                break
        if got is None:
            return total, done + stolen, stolen, busy
        t0 = time.perf_counter()
        x, y = xp.asarray(got["x"]), xp.asarray(got["y"])
        total = _add(total, func([(x, y)], [None], *args))
        seconds = time.perf_counter() - t0
        busy += seconds
        stolen += int(got["rows"])
        spr = busy / (done + stolen)  # the thief's rate, its own rows and stolen ones
