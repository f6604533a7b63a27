"""Work stealing inside a pass: the rows a worker has not started go to an idle peer.

Each worker's task works through a :class:`RowPool` of its rows from the front; a worker
done with its own rows asks peers for rows from the back of theirs (``blockflow_steal``,
served by :class:`StealPlugin`). Every row is processed exactly once, so the sum is
unchanged. Sources: guided self-scheduling (Polychronopoulos and Kuck, 1987); work stealing
(Blumofe and Leiserson, JACM 1999); the hand-over rule is a blockflow heuristic.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import defaultdict, deque
from statistics import median
from typing import Any, Callable

import numpy as np
from distributed import get_worker
from distributed.protocol import to_serialize
from distributed.utils import sync

from blockflow._distributed import HandlerPlugin, call_worker, has_worker_handler
from blockflow.backends import _block_to_host, array_module
from blockflow.ml._peers import Peers, peer_timeout
from blockflow.scheduling.estimate import call_cost

__all__ = ["RowPool", "StealPlugin", "add_values", "rows_to_give", "run_stealing"]

# (pass id, worker address) -> the pool of that worker's task in that pass
_POOLS: dict[tuple[str, str], RowPool] = {}
_POOLS_LOCK = threading.Lock()
HANDLER = "blockflow_steal"
# (worker address, kernel) -> the latest passes' estimates of its fixed seconds per call
_CALL_COST: dict[tuple[str, str], deque] = defaultdict(lambda: deque(maxlen=16))


class RowPool:
    """One worker's rows of one pass, claimed from the front by its own task and from the
    back by peers.

    Parameters
    ----------
    blocks : list of (X, y)
        The worker's resident blocks used in this pass.
    rows : list of numpy.ndarray or None
        Per block, the local row indices of the pass (None: all its rows).
    chunks : int
        The owner's chunks are never smaller than ``1 / chunks`` of its rows.
    prior_spr : float, optional
        Expected seconds per row for this worker, until its first chunk is timed.
    reserve : float, default 0.2
        Fraction 0-1 of the rows kept out of the owner's first chunk (only those can be
        stolen).
    fixed : float, default 0.0
        The owner's fixed seconds per kernel call (:func:`call_cost`).
    """

    def __init__(self, blocks, rows, chunks: int, prior_spr: float | None = None,
                 reserve: float = 0.2, fixed: float = 0.0):
        self.blocks = blocks
        self.fixed = fixed  # seconds per kernel call that do not shrink with its rows
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
        self.target: float | None = None  # perf_counter time the pass should end (balanced)

    def take_front(self) -> tuple[int, int] | None:
        """The owner's next chunk as a span ``(lo, hi)`` of the pool, or None when empty."""
        with self.lock:
            left = self.back - self.front
            if left <= 0:
                self.flight = None
                return None
            now = time.perf_counter()
            spr = self.busy / self.done_rows if self.done_rows else None
            if self.front == 0:  # all but the reserve in one kernel call
                c = max(self.min_chunk, math.floor(self.n * (1 - self.reserve)))
            elif self.target is not None and spr and now < self.target:
                # the rows it can finish by the pass's balanced end, at its rate in this
                # pass: all of them when on time (one more call), else the rest is left
                # at the back for the peers that will be idle by then
                c = max(self.min_chunk,
                        math.floor((self.target - now - self.fixed) / spr))
            else:  # the reserve in halving chunks (guided self-scheduling)
                c = max(math.ceil(left / 2), self.min_chunk)
            if left - c < self.min_chunk / 2:
                c = left  # no remnant smaller than half a chunk
            c = min(left, c)
            lo = self.front
            self.front += c
            self.flight = (now, c)
            return lo, self.front

    def finished(self, rows: int, seconds: float) -> None:
        """The owner's chunk of ``rows`` took ``seconds``."""
        with self.lock:
            self.done_rows += rows
            self.busy += seconds
            self.flight = None

    def set_target(self, peers: list[dict]) -> None:
        """The time the pass ends when its rows left are balanced over all workers.

        ``peers``: the other workers' :meth:`status` replies. The end is
        ``now + sum(R_i) / sum(r_i)`` over rows left ``R_i`` and rates ``r_i`` (a blockflow
        heuristic).
        """
        with self.lock:
            now = time.perf_counter()
            left, _, spr = self._left(now)
            if not spr:
                return
            rows, rate = left / spr, 1 / spr
            for st in peers:
                p = st.get("spr")
                if p and p > 0 and math.isfinite(st.get("left", math.inf)):
                    rows += st["left"] / p
                    rate += 1 / p
            self.target = now + rows / rate

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
        if self.flight is not None:  # the chunk running: its fixed part and its rows
            flight = max(0.0, self.fixed + spr * self.flight[1] - (now - self.flight[0]))
        # the rows not started take one more call at least
        return spr * unclaimed + (self.fixed if unclaimed else 0.0) + flight, unclaimed, spr

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
        blocks, rows = self.parts(lo, hi)
        xs = [_block_to_host(xb[r]) for (xb, _), r in zip(blocks, rows)]
        ys = [_block_to_host(yb[r]) for (_, yb), r in zip(blocks, rows)]
        return np.concatenate(xs), np.concatenate(ys)


def rows_to_give(left: float, unclaimed: int, spr: float | None, thief_spr: float | None,
                 overhead: float) -> int:
    """Rows an owner hands to a thief so that both finish together.

    ``r = floor((T - o) / (s + t))`` rows, at most ``unclaimed``: ``T`` the owner's seconds
    left, ``s`` and ``t`` owner's and thief's seconds per row, ``o`` the hand-over's cost.
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


def _serve(worker, pass_id: str, action: str = "status", spr: float | None = None,
           overhead: float = 0.0) -> dict:
    """The ``blockflow_steal`` handler: a pool's :meth:`~RowPool.status`, or (``action``
    ``"claim"``) rows handed to the thief with their data."""
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


class StealPlugin(HandlerPlugin):
    """Worker plugin serving the ``blockflow_steal`` comm handler (name
    ``"blockflow-steal"``)."""

    name = "blockflow-steal"

    def handlers(self):
        return {HANDLER: _serve}


def add_values(a, b):
    """``a + b`` for arrays, numbers and tuples of them; None (no rows) adds nothing."""
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, tuple):
        return tuple(add_values(x, z) for x, z in zip(a, b))
    return a + b


def run_stealing(func: Callable, blocks, rows, args, pass_id: str, peers: list[str],
                 chunks: int, prior_spr: dict[str, float],
                 reserve: dict[str, float] | None = None, timeout: float | None = None
                 ) -> tuple[Any, int, int, float, float]:
    """On a worker: ``func`` over its rows in chunks, then over rows stolen from peers.

    Returns ``(sum or None, rows processed, rows stolen, seconds in func, seconds in func
    on its own rows)``.
    """
    worker = get_worker()
    me = worker.address
    # this worker's fixed seconds per call of this kernel (a GLM's and a CNN's differ)
    costs = _CALL_COST[me, getattr(func, "__qualname__", type(func).__name__)]
    fixed = median(costs) if costs else 0.0
    pool = RowPool(blocks, rows, chunks, prior_spr.get(me), (reserve or {}).get(me, 0.2),
                   fixed)
    key = (pass_id, me)
    others = Peers(worker, [p for p in peers if p != me], peer_timeout(timeout))
    can_ask = bool(others.addresses) and has_worker_handler(worker, HANDLER)
    xp = array_module(blocks[0][0]) if blocks else np
    if can_ask:
        # the peers the scheduler still lists, learned while the first chunk runs: a pass
        # submitted before a worker was lost must not ask it
        others.refresh_soon()

    # A peer that gives no answer gives nothing; one the scheduler dropped is not asked,
    # and a call to one it drops meanwhile ends at once: a lost peer must not hold this
    # thread for distributed's connect timeout while the pass is redone behind it.
    async def ask(p, **msg):
        return await others.call(p, lambda: call_worker(worker, p, HANDLER,
                                                        pass_id=pass_id, **msg))

    async def status():
        await others.ready()
        live = others.live
        replies = await asyncio.gather(*(ask(p, action="status") for p in live),
                                       return_exceptions=True)
        return list(zip(live, replies))

    with _POOLS_LOCK:
        _POOLS[key] = pool
    total, done, stolen, calls = None, 0, 0, []
    try:
        while (span := pool.take_front()) is not None:
            t0 = time.perf_counter()
            total = add_values(total, func(*pool.parts(*span), *args))
            calls.append((span[1] - span[0], time.perf_counter() - t0))
            pool.finished(*calls[-1])
            done += span[1] - span[0]
            if can_ask and pool.target is None and pool.back > pool.front:
                # after the first chunk: where the pass ends if balanced, from the peers'
                # progress and this pass's own rate (one round trip per pass)
                pool.set_target([r for _, r in sync(worker.loop, status)
                                 if isinstance(r, dict)])
        # done with its own rows: it stays registered, closed, so that peers asking see
        # its rate and that it has nothing left
        pool.close()
        busy = pool.busy
        if not can_ask:
            return total, done, 0, busy, busy
        spr = pool.busy / pool.done_rows if pool.done_rows else prior_spr.get(me)
        # a stolen chunk is one more kernel call: its fixed cost counts against it, as the
        # round trip does (a slow device's cold small calls cost more than they save)
        while True:
            t0 = time.perf_counter()
            replies = sync(worker.loop, status)
            # status, then the claim; then the call's fixed part
            overhead = 2 * max(time.perf_counter() - t0, 0.0005) + fixed
            # peers by work left; only those that would hand over a row at all are asked
            # (a claim that gets nothing ends the search: no polling loop on a shared host)
            ranked = sorted((r["left"], p) for p, r in replies
                            if isinstance(r, dict) and rows_to_give(
                                r["left"], r.get("rows", 0), r.get("spr"), spr,
                                overhead) >= 1)
            got = None
            for _, p in ranked[::-1]:
                try:
                    reply = sync(worker.loop, ask, p, action="claim", spr=spr,
                                 overhead=overhead)
                except Exception:  # the peer went away or did not answer in time: it
                    # gives nothing (rows it handed over in a reply that never arrived are
                    # missing from the pass's row count: ResidentShards.map_sum redoes it)
                    continue
                if reply.get("rows"):
                    got = reply
                    break
            if got is None:
                return total, done + stolen, stolen, busy, pool.busy
            t0 = time.perf_counter()
            x, y = xp.asarray(got["x"]), xp.asarray(got["y"])
            total = add_values(total, func([(x, y)], [None], *args))
            seconds = time.perf_counter() - t0
            calls.append((int(got["rows"]), seconds))
            busy += seconds
            stolen += int(got["rows"])
            spr = busy / (done + stolen)  # the thief's rate, its own rows and stolen ones
    finally:
        pool.close()
        with _POOLS_LOCK:
            _POOLS.pop(key, None)
        if (c := call_cost(calls)) is not None:
            costs.append(c)
