"""Resident shards: row blocks of (features, labels) kept on workers in proportion to speed.

Training and GLM fitting make many passes over the same data. :class:`ResidentShards` places
each row block of ``X``/``y`` on one worker once (a task restricted to that worker), so a pass
sends only parameters and row indices, never data. Each worker's share of the rows follows
its speed (capped by free memory), so every worker's part of a pass takes about as long:
*speed-weighted sharding* (a blockflow heuristic; xgboost.dask, DDP and Ray Train give
every worker an equal shard and a synchronous step waits for the slowest).

A pass (:meth:`ResidentShards.map_sum`) runs one task per worker over its own blocks and sums
the per-worker results with a fan-in tree of ``split_every`` (as :func:`blockflow.tree_reduce`
does for collections) whose root is the client: it adds the top level's partial sums as each
arrives, fetched straight from the workers, so only the last one's transfer follows the
slowest worker. If a worker is lost during a pass, its blocks are placed again on the
survivors from the source collection and the pass is redone: at most one pass is lost. A
call to a lost worker (a post, a thief's request) ends as soon as the scheduler drops it
(:mod:`blockflow.ml._peers`), not after distributed's connect timeout.

Speeds: the prior is the scheduler plugin's learned speed (``blockflow.plugin_status``) when
blockflow's plugin runs, else 1; it is then refined from the shards' own throughput (rows per
compute second, a median over the 16 latest passes, so that one cold first pass stops
counting from the third, with a pass's fixed cost estimated and counted apart: see
:meth:`ResidentShards.overhead_rows`), which the plugin's per-task speed model cannot
measure here because speed-weighted tasks deliberately differ in size.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from blockflow import config
from blockflow.scheduling.view import workers_info
from blockflow.ml._peers import PeerGone, Peers, peer_timeout
from blockflow.ml._post import POSTED, Posted, PostPlugin
from blockflow.ml._steal import StealPlugin
from blockflow.errors import WorkerLostError
from blockflow.scheduling.view import learned_speeds, memory_of, worker_memory
from blockflow.scheduling.wait import gather_as_done, wait_for
from blockflow.scheduling.estimate import Throughput, earliest_finish

__all__ = ["ResidentShards", "as_row_blocks", "known_rows"]


def as_row_blocks(X, y=None):
    """``X`` (and ``y``) as dask arrays chunked along rows only, with matching row chunks.

    Parameters
    ----------
    X : dask.array.Array, dask.dataframe.DataFrame or NumPy/CuPy array
        Features, shape ``(n_samples, n_features)``; dataframes are converted with
        ``to_dask_array(lengths=True)``.
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
    import dask.array as da
    import dask.dataframe as dd

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
    """``a`` (a dask array) with its row chunk sizes known: computed
    (``compute_chunk_sizes()``) where a filter (``a[mask]``) left them unknown."""
    if any(math.isnan(c) for c in a.chunks[0]):
        a = a.compute_chunk_sizes()
    return a


def _pair(x, y, check=None, block=0, offset=0):
    """A block's ``(X, y)``; ``check`` (a :class:`blockflow.ml._finite.FiniteCheck`) looks
    for non-finite values in this, the first task that reads the block."""
    if check is not None:
        return check(x, y, block, offset)
    return (x, y)


def _rows_of(pair) -> int:
    return len(pair[0])


def _pair_copy(pair):
    return pair


def _run_shard(func, blocks, rows, args, steal=None):
    """On a worker: ``func([(X, y) blocks], [row indices or None], *args)`` timed.

    ``steal``: ``(pass id, peers, chunks, prior seconds per row, reserve, peer timeout)``,
    the
    arguments of :func:`blockflow.ml._steal.run_stealing` after ``args``, to run the rows
    in chunks and then take rows peers have not started; None: one call. A
    :class:`blockflow.ml._post.Posted` in ``args`` is waited for (a pass submitted ahead,
    :meth:`ResidentShards.prepare`); cancelled, the task returns nothing."""
    from blockflow.ml._post import resolve

    me = _worker_address()
    args = resolve(me, args)
    if args is None:  # its pass was cancelled, or its post never came
        return {"value": None, "seconds": {}, "rows": {}, "stolen": {}, "own": {},
                "cancelled": True}
    t0 = time.perf_counter()  # after the wait: only work is timed
    if steal is None:
        out = func(blocks, rows, *args)
        n, stolen = sum(len(r) if r is not None else len(b[0])
                        for b, r in zip(blocks, rows)), 0
        busy = own = time.perf_counter() - t0
    else:
        from blockflow.ml._steal import run_stealing
        out, n, stolen, busy, own = run_stealing(func, blocks, rows, args, *steal)
    # seconds in func: a stealing worker's last requests to its peers are not work; "own":
    # the seconds on its own rows, which its speed is measured on
    return {"value": out, "seconds": {me: busy}, "rows": {me: n}, "stolen": {me: stolen},
            "own": {me: own}}


def _worker_address() -> str:
    from distributed import get_worker
    return get_worker().address


def _add(*parts):
    """Sum the ``value``s (arrays, numbers, tuples of them); merge the timing dicts."""
    from blockflow.ml._steal import _add as add  # None (a worker left no rows) adds nothing

    value = None
    for p in parts:
        value = add(value, p["value"])
    seconds, rows, stolen, own = {}, {}, {}, {}
    for p in parts:
        seconds.update(p["seconds"])
        rows.update(p["rows"])
        stolen.update(p.get("stolen", {}))
        own.update(p.get("own", {}))
    return {"value": value, "seconds": seconds, "rows": rows, "stolen": stolen, "own": own,
            "cancelled": any(p.get("cancelled") for p in parts)}


class ResidentShards:
    """Row blocks of ``(X, y)`` held on workers, shares proportional to speed.

    Parameters
    ----------
    client : distributed.Client
    X : dask.array.Array
        Features, chunked along rows only (see :func:`as_row_blocks`).
    y : dask.array.Array
        Labels with the same row chunks.
    sharding : {"speed", "equal"}, default "speed"
        ``"speed"``: each worker's rows proportional to its speed; ``"equal"``: the same
        number of blocks per worker (the equal-shard baseline).
    memory_fraction : float, default 0.5
        Fraction 0-1 of a worker's free memory (free device memory on GPU workers) its
        blocks may take; caps the speed share.
    split_every : int, optional
        Fan-in of the sum over workers; default from ``choose_split_every`` for the result
        size.
    rebalance_gain : float, default 0.05
        Move blocks between passes only when the predicted slowest worker's time drops by
        more than this fraction (0-1).
    poll : float, default 0.5
        Seconds between checks for lost workers while a pass runs.
    steal_chunks : int, optional
        With ``map_sum(..., steal=True)``, a worker's chunks are never smaller than this
        fraction ``1 / steal_chunks`` of its rows in the pass; default
        ``blockflow.ml.steal-chunks`` (16).
    steal_reserve : float, optional
        With stealing, the fraction 0-1 of a worker's rows kept out of its first kernel
        call (only those can go to a peer); default ``blockflow.ml.steal-reserve`` (0.2).
        A worker that gave a fraction ``g`` of its rows away in the latest pass keeps
        ``min(2/3, steal_reserve + 2 g)`` in reserve in the next (it was behind: a
        straggler sheds more each pass until the shares follow its speed; a blockflow
        heuristic).
    steal_reserve_unmeasured : float, optional
        The reserve (fraction 0-1) of a worker that no pass of this fit has measured yet:
        its share follows a prior (the scheduler plugin's speed, shrunk towards the typical
        one, or 1), so more of it is left for its peers to take over; default
        ``blockflow.ml.steal-reserve-unmeasured`` (0.5).
    check : blockflow.ml._finite.FiniteCheck, optional
        Run by the task that first reads each block (the one making it resident, no pass
        of its own): raises naming the first non-finite value of ``X``/``y`` (column or
        label, block, row), or with ``check.drop`` drops the rows holding one (the row
        counts, :attr:`block_rows`, are then those kept; :attr:`dropped_rows` counts the
        others).
    peer_timeout : float or str, optional
        Seconds (or a duration such as ``"5s"``) a call to a worker the scheduler still
        lists may go unanswered: a post of a pass's value, a cancellation, a thief's
        request to a peer. A worker the scheduler drops is given up at once. Default
        ``blockflow.ml.peer-timeout`` (5 s).

    Raises
    ------
    RuntimeError
        If the cluster has no workers.
    ValueError
        From ``check``: a non-finite value, or no finite row left after dropping.
    MemoryError
        If a block of ``X`` and ``y`` is larger than any worker's memory limit (device
        memory on GPU workers), before anything runs; the message names the block, its
        rows and bytes, the largest limit and a ``rechunk`` that fits.
    WorkerLostError
        In place of distributed's ``KilledWorker`` on a block's internal key while the
        blocks are loaded or moved: the message names the block and the memory limits.
    """

    def __init__(self, client, X, y, *, sharding: str = "speed", memory_fraction: float = 0.5,
                 split_every: int | None = None, rebalance_gain: float = 0.05,
                 poll: float = 0.5, steal_chunks: int | None = None,
                 steal_reserve: float | None = None,
                 steal_reserve_unmeasured: float | None = None,
                 peer_timeout: float | str | None = None, check=None):
        if sharding not in ("speed", "equal"):
            raise ValueError(f"blockflow: sharding must be 'speed' or 'equal', got "
                             f"{sharding!r}.")
        self.client, self.sharding = client, sharding
        self.memory_fraction, self.split_every = memory_fraction, split_every
        self.rebalance_gain, self.poll = rebalance_gain, poll
        self._x_blocks, self._y_blocks = X.to_delayed().ravel(), y.to_delayed().ravel()
        self.block_rows = [int(c) for c in X.chunks[0]]
        row_bytes = X.dtype.itemsize * X.shape[1] + y.dtype.itemsize * int(
            np.prod(y.shape[1:], dtype=int))
        self._row_bytes = row_bytes
        self.block_bytes = [r * row_bytes for r in self.block_rows]
        self.offsets = np.concatenate([[0], np.cumsum(self.block_rows)])
        self._check = check
        self._source_offsets = [int(o) for o in self.offsets[:-1]]  # rows as in X
        self.dropped_rows = 0
        self._check_blocks_fit(self._workers())
        # per worker, the latest passes' (rows processed, seconds) and the fixed cost per
        # pass fitted through them (the one throughput estimator). No pass is dropped as a
        # cold start: the blocks are resident before the first, and the first step's probe
        # pass is the one whose differing row counts fit the fixed cost.
        self._throughput = Throughput(window=16, cold=0)
        self._fraction = 1.0  # rows processed per resident row, latest pass
        self.recoveries: list[dict] = []
        self.steal_chunks = int(config.get("ml.steal-chunks", steal_chunks))
        self.steal_reserve = float(config.get("ml.steal-reserve", steal_reserve))
        self.steal_reserve_unmeasured = float(config.get("ml.steal-reserve-unmeasured",
                                                         steal_reserve_unmeasured))
        self.peer_timeout = _peer_timeout(peer_timeout)
        self._installed: set[str] = set()  # worker plugins registered
        self._ahead: set[_Pass] = set()  # passes prepared, not yet run (prepare())
        self._version = 0  # counts placements that moved blocks
        self.redone_passes = 0  # passes redone because rows went missing while stealing
        self._gave: dict[str, float] = {}  # fraction of its rows each gave, latest pass
        self._direct = bool(config.get("ml.direct-gather"))
        self._post_ahead = bool(config.get("ml.post-ahead"))
        self.last_seconds, self.last_rows, self.last_stolen = {}, {}, {}
        self.last_ahead = False
        self.moves = 0
        self.placement: dict[int, str] = {}
        self.futures: dict[int, Any] = {}
        self._place(self._assign(self._workers(), {}))
        if check is not None and check.drop:
            self._count_kept_rows()

    def _count_kept_rows(self) -> None:
        """Row counts after the non-finite rows were dropped (a length per resident block,
        no pass over the data)."""
        order = sorted(self.futures)
        kept = self.client.gather([self.client.submit(_rows_of, self.futures[j], pure=False)
                                   for j in order])
        before = sum(self.block_rows)
        self.block_rows = [int(k) for k in kept]
        self.block_bytes = [r * self._row_bytes for r in self.block_rows]
        self.offsets = np.concatenate([[0], np.cumsum(self.block_rows)])
        self.dropped_rows = before - sum(self.block_rows)
        if not sum(self.block_rows):
            self.close()
            raise ValueError(f"blockflow: every one of the {before} rows holds a non-finite "
                             f"value in X or y; nothing is left to fit after dropping them "
                             f"(impute them instead).")

    # --- workers, speeds, memory ---------------------------------------------------------

    def _block(self, j: int) -> str:
        """Block ``j`` as messages name it: its index, rows and bytes."""
        from dask.utils import format_bytes

        return (f"block {j} (rows {int(self.offsets[j]):,}-{int(self.offsets[j + 1]) - 1:,}, "
                f"{format_bytes(self.block_bytes[j])} of X and y)")

    def _too_large(self, j: int, workers: dict[str, dict]) -> str | None:
        """Why block ``j`` cannot be held by any worker (its bytes above the largest
        worker's memory limit, device memory on GPU workers), or None if it can or the
        limits are unknown."""
        from dask.utils import format_bytes

        limits = {a: m.total for a, m in worker_memory(self.client, workers).items()
                  if m.total}
        if not limits:
            return None
        a, (limit, kind) = max(limits.items(), key=lambda kv: (kv[1][0], kv[0]))
        if self.block_bytes[j] <= limit:
            return None
        row_bytes = self.block_bytes[j] / max(self.block_rows[j], 1)
        rows = max(int(limit * self.memory_fraction / 4 / row_bytes), 1)
        return (f"blockflow: {self._block(j)} is larger than any worker's memory (the "
                f"largest is {a}'s {format_bytes(int(limit))} {kind} memory limit), so the "
                f"worker holding it would be killed; cut the rows into smaller blocks, e.g. "
                f"X.rechunk({{0: {rows}}}) and y.rechunk({rows}), or give the workers more "
                f"memory (memory_limit=).")

    def _check_blocks_fit(self, workers: dict[str, dict]) -> None:
        """Refuse, before anything runs, a block no worker can hold (distributed would kill
        worker after worker on it, then raise KilledWorker on an internal key)."""
        if self.block_bytes:
            j = int(np.argmax(self.block_bytes))
            why = self._too_large(j, workers)
            if why:
                raise MemoryError(why)

    def _killed(self, blocks: list[int], e: BaseException) -> WorkerLostError:
        """distributed's KilledWorker on blocks' tasks, as a message naming the blocks
        whose tasks ran on the workers that died (the culprit among them)."""
        from dask.utils import format_bytes

        workers = self._workers()
        for j in blocks:
            why = self._too_large(j, workers)
            if why:
                return WorkerLostError(why, lost=[])
        if len(blocks) == 1:
            what = self._block(blocks[0])
        else:
            what = "blocks " + ", ".join(
                f"{j} (rows {int(self.offsets[j]):,}-{int(self.offsets[j + 1]) - 1:,})"
                for j in blocks) + (f", {format_bytes(sum(self.block_bytes[j] for j in blocks))}"
                                    f" of X and y in all")
        last = getattr(getattr(e, "last_worker", None), "address", None) or "a worker"
        limits = [m.total[0] for m in worker_memory(self.client, workers).values() if m.total]
        limit = (f"; the largest worker memory limit is {format_bytes(int(max(limits)))}"
                 if limits else "")
        return WorkerLostError(
            f"blockflow: workers died while loading {what} (the last was {last}){limit}: a "
            f"block whose loading kills its worker usually runs it out of memory or crashes "
            f"native code; check the worker logs, use smaller blocks (X.rechunk({{0: "
            f"rows}})) or give the workers more memory (memory_limit=).",
            lost=[last] if last != "a worker" else [])

    def _workers(self) -> dict[str, dict]:
        workers = workers_info(self.client)
        if not workers:
            raise RuntimeError("blockflow: the cluster has no workers; start some before "
                               "training.")
        return workers

    def _prior_speeds(self) -> dict[str, float]:
        # only speeds the plugin knows with confidence (it reports 1.0 for workers it
        # knows nothing about)
        return learned_speeds(self.client).known

    def knows_speeds(self) -> bool:
        """Whether a pass has measured a speed, or the scheduler plugin has learned some."""
        return bool(self._throughput.measured_seconds_per_unit()
                    or self._prior_speeds())

    def overhead_rows(self) -> float:
        """A pass's fixed cost per worker, in rows processed (shared by the workers).

        Model: a worker's pass takes ``k_a (r + r0)`` seconds for ``r`` rows, ``k_a`` its
        seconds per row, ``r0`` the fixed part (parameters in, model set up, result out)
        in row equivalents. ``r0`` is the median over workers of intercept / slope of a
        least-squares line through each worker's (rows, seconds), where its row counts
        differ by 25 % or more (the first step's probe pass gives that); else 0. Bounded
        by the median rows per pass. Without it, a worker with a small share looks slow
        per row, gets a smaller share still, and the shares collapse onto the fastest
        worker (a blockflow heuristic: :func:`blockflow.scheduling.estimate.fixed_units`).
        Fitted again with each measured pass.
        """
        return self._throughput.fixed

    def speeds(self, workers) -> dict[str, float]:
        """Relative speed per worker: measured row equivalents (rows plus
        :meth:`overhead_rows`) per second where seen, else the plugin's learned speed
        scaled to the measured ones, else 1 (the inverse of
        :meth:`blockflow.scheduling.estimate.Throughput.seconds_per_unit`)."""
        spu = self._throughput.seconds_per_unit(workers, self._prior_speeds())
        return {a: 1.0 / s for a, s in spu.items()}

    def _capacity(self, info: dict) -> float:
        """Bytes of blocks a worker may hold: a fraction of its free (device) memory."""
        free = memory_of(info).free
        mine = sum(self.block_bytes[j] for j, w in self.placement.items() if w == info.get(
            "address"))
        return self.memory_fraction * max(free, 0) + mine

    # --- placement -----------------------------------------------------------------------

    def _assign(self, workers: dict[str, dict], keep: dict[int, str]) -> dict[int, str]:
        """Block -> worker. ``"equal"``: round robin; ``"speed"``: rows such that every
        worker's predicted pass time ``(rows + r0) / speed`` is the same (``r0`` from
        :meth:`overhead_rows`, in resident rows), largest blocks first to the worker whose
        predicted finish stays lowest, within capacity; blocks in ``keep`` stay where they
        are while under their target."""
        addrs = sorted(workers)
        n = len(self.block_rows)
        if self.sharding == "equal":
            return {j: addrs[j % len(addrs)] for j in range(n)}
        speed = self.speeds(workers)
        total_speed = sum(speed[a] for a in addrs)
        r0 = self._resident_overhead()
        per_speed = (sum(self.block_rows) + len(addrs) * r0) / total_speed
        target = {a: max(per_speed * speed[a] - r0, 0.0) for a in addrs}
        cap = {a: self._capacity({**workers[a], "address": a}) for a in addrs}
        rows = dict.fromkeys(addrs, 0)
        used = dict.fromkeys(addrs, 0.0)
        out: dict[int, str] = {}
        order = sorted(range(n), key=lambda j: -self.block_rows[j])
        for j in order:  # keep blocks in place while their worker stays under its target
            a = keep.get(j)
            if a in rows and rows[a] + self.block_rows[j] / 2 <= target[a]:
                out[j] = a
                rows[a] += self.block_rows[j]
                used[a] += self.block_bytes[j]
        # the others by earliest finish, largest first, within capacity (ties: the address)
        rest = [j for j in order if j not in out]
        placed = earliest_finish(
            len(rest), rows, speeds=speed, fixed=r0, units=[self.block_rows[j] for j in rest],
            sizes=[self.block_bytes[j] for j in rest],
            capacity=cap, held=used, tie=lambda a, _: a)
        for p in placed:
            out[rest[p.item]] = p.worker
        return out

    def _makespan(self, placement: dict[int, str], speed: dict[str, float]) -> float:
        rows = defaultdict(int)
        for j, a in placement.items():
            rows[a] += self.block_rows[j]
        r0 = self._resident_overhead()
        return max((r + r0) / speed.get(a, 1.0) for a, r in rows.items())

    def _resident_overhead(self) -> float:
        """:meth:`overhead_rows` in resident rows (a pass processes a fraction of them)."""
        return self.overhead_rows() / max(self._fraction, 1e-9)

    def _place(self, placement: dict[int, str]) -> None:
        import dask

        moved = [j for j, a in placement.items() if self.placement.get(j) != a]
        if moved:
            # prepared passes would run on the old placement: cancelled first
            for p in list(self._ahead):
                self._cancel(p)
            self._version += 1
        alive = set(self._workers()) if self.placement else set()
        # A block still held by a live worker is copied from there (worker to worker); the
        # others come from the source collection, all in one graph: each block's graph
        # carries its source, and one submission per block would send it once per block.
        fresh = [j for j in moved if self.placement.get(j) not in alive or j not in
                 self.futures]
        sources = dict(zip(fresh, self.client.compute(
            [dask.delayed(_pair, pure=False)(self._x_blocks[j], self._y_blocks[j],
                                             self._check, j, self._source_offsets[j])
             for j in fresh])))
        for j in moved:
            # Only the resident copy is restricted to its worker (a fresh key each time: an
            # old one may be stuck restricted to a lost worker); the blocks' own graph stays
            # unrestricted, so that it can be recomputed anywhere after a loss.
            src = sources[j] if j in sources else self.futures[j]
            self.futures[j] = self.client.submit(_pair_copy, src, workers=[placement[j]],
                                                 allow_other_workers=False, pure=False)
        self.moves += len(moved) if self.placement else 0
        self.placement = dict(placement)
        wait_for(self.client, [self.futures[j] for j in moved], what="moving blocks")
        if any(self.futures[j].status == "error" for j in moved):
            from distributed import KilledWorker, wait

            killed = {j: self.futures[j].exception() for j in moved
                      if self.futures[j].status == "error"}
            killed = {j: e for j, e in killed.items() if isinstance(e, KilledWorker)}
            if killed:  # on internal keys: name the blocks
                raise self._killed(sorted(killed), next(iter(killed.values()))) from None
            # a block could not be read or failed its check (a non-finite value): the
            # first such block's own error, once all have run (the lowest rows first)
            try:
                wait([self.futures[j] for j in moved], timeout=30)
            except TimeoutError:
                pass  # the lowest block failed so far
            self.futures[min(j for j in moved if self.futures[j].status == "error")].result()

    def rebalance(self) -> int:
        """Between passes: move blocks when measured speeds predict a gain of more than
        ``rebalance_gain``; workers that joined get blocks, lost ones give theirs up.
        Returns the number of blocks moved."""
        workers = self._workers()
        lost = {j for j, a in self.placement.items() if a not in workers}
        proposal = self._assign(workers, {j: a for j, a in self.placement.items()
                                          if j not in lost})
        if not lost and self.sharding == "speed":
            speed = self.speeds(workers)
            now, new = self._makespan(self.placement, speed), self._makespan(proposal, speed)
            if new > (1 - self.rebalance_gain) * now:
                return 0
        elif not lost:
            if set(self.placement.values()) == set(workers):
                return 0
        before = self.moves
        self._place(proposal)
        return self.moves - before

    def rows_per_worker(self) -> dict[str, int]:
        rows = defaultdict(int)
        for j, a in self.placement.items():
            rows[a] += self.block_rows[j]
        return dict(rows)

    # --- a pass --------------------------------------------------------------------------

    def map_sum(self, func: Callable, rows: Sequence | None = None, args: tuple = (),
                *, measure: bool = True, steal: bool = False, posted: Any = None,
                ahead: _Pass | None = None, then: Callable[[], Any] | None = None) -> Any:
        """``sum over workers of func(blocks, rows, *args)``, each on its own blocks.

        Parameters
        ----------
        func : callable
            ``func(blocks, rows, *args)`` on a worker: ``blocks`` a list of ``(X, y)``
            blocks it holds, ``rows`` the matching list of local row indices (None: all
            rows); returns an array, a number or a tuple of them (summable).
        rows : list, optional
            Per block (index j), the rows to use; None uses all rows. Blocks given an empty
            selection are skipped.
        args : tuple
            Further arguments (parameters, a model future, ...). An argument that is
            :data:`blockflow.ml._post.POSTED` takes the value ``posted``, sent straight
            to the pass's workers once its tasks are submitted (see :meth:`prepare`;
            inside the graph instead where the client cannot reach the workers).
        measure : bool, default True
            Whether the pass's timings count towards the workers' speeds (False for a
            warm-up pass).
        steal : bool, default False
            Work stealing inside the pass (:mod:`blockflow.ml._steal`): each worker runs
            all but a reserve of its rows in one call and the reserve in halving chunks,
            and a worker done with its own takes rows its
            peers have not started, so the pass ends when the work does, not when the
            slowest share does. ``func`` is then called several times per worker (on parts
            of its blocks, and on stolen rows as one ``(X, y)`` block with rows None) and
            its results are added; it must be a sum over rows.
        posted : object, optional
            The value of the ``POSTED`` arguments (a step's parameters, say).
        ahead : object, optional
            This pass as :meth:`prepare` submitted it earlier (same ``func``, ``rows``
            object, ``args`` and ``steal``): used when the blocks have not moved since,
            else cancelled and the pass submitted now.
        then : callable, optional
            Called once the pass is on its way (submitted, its value posted), before
            waiting for it: to :meth:`prepare` the next pass, which the scheduler then
            sends to the workers while this one runs.

        Returns
        -------
        object
            The sum, with the workers' compute seconds in :attr:`last_seconds`, rows
            processed in :attr:`last_rows`, rows they took from peers in
            :attr:`last_stolen`, and in :attr:`last_ahead` whether the pass ran as
            prepared (``ahead``).
        """
        expected = sum(self.block_rows) if rows is None else sum(len(r) for r in rows)
        inline = False  # a post failed: this pass carries its value in the graph
        for attempt in range(1000):
            self.last_ahead = ahead is not None and self._current(ahead, func, rows, steal)
            if self.last_ahead:
                p = ahead
            else:
                if ahead is not None:
                    self._cancel(ahead)
                p = self._submit(func, rows, args, measure, steal, value=posted,
                                 post=not inline)
            ahead = None
            self._ahead.discard(p)
            try:
                if p.post is not None:
                    self._post(p, posted)
                if then is not None:
                    then()
                    then = None
                out = self._wait(p.futures)
            except WorkerLostError as e:
                # its tasks still waiting for a post (one did not reach a lost worker)
                # return at once; its keys are released, not cancelled: cancelling keys
                # the scheduler is recomputing can break the client's stream
                self._cancel(p)
                del p
                self._recover(e.lost)
                continue
            except _PostFailed:
                inline = True  # the pass is submitted again, with its value
                continue
            if out.get("cancelled"):
                self.redone_passes += 1  # a task's post never came (POST_TIMEOUT)
                continue
            if sum(out["rows"].values()) != expected:
                # rows handed to a thief whose reply never arrived (a peer lost or timed
                # out mid-request): the sum misses them, so the pass is redone, without
                # stealing after two such passes
                steal = steal and attempt < 1
                self.redone_passes += 1
                continue
            self.last_seconds, self.last_rows = out["seconds"], out["rows"]
            self.last_stolen = out.get("stolen", {})
            if steal:
                assigned = self._assigned_rows(rows)
                self._gave = {a: max(0, n - (out["rows"].get(a, 0) - self.last_stolen.get(
                    a, 0))) / n for a, n in assigned.items() if n}
            if not measure:
                return out["value"]
            for a, s in out["own"].items():
                # a worker's speed from its own rows: rows it stole came in extra calls,
                # small and cold, and would make a thief look slower than it is
                n_own = out["rows"].get(a, 0) - self.last_stolen.get(a, 0)
                if s > 0.005 and n_own > 0:
                    self._throughput.observe(a, n_own, s)
            held = self.rows_per_worker()
            resident = sum(held.get(a, 0) for a in out["rows"])
            if resident:
                self._fraction = sum(out["rows"].values()) / resident
            return out["value"]
        raise RuntimeError("blockflow: workers kept disappearing; check the cluster.")

    def prepare(self, func: Callable, rows: Sequence | None = None, args: tuple = (), *,
                steal: bool = False) -> _Pass | None:
        """Submit a pass now whose ``POSTED`` arguments come later (:meth:`map_sum` with
        ``ahead=``): its tasks go to their workers and wait there, holding no thread,
        until :meth:`map_sum` posts the value straight to them (``blockflow_post``, see
        :mod:`blockflow.ml._post`). A training step's pass is prepared while the step
        before it runs, so the scheduler is off the step's critical path (30-60 ms a
        step on a loaded 2-core host). The pass is cancelled, its tasks returning at once,
        when blocks move before it runs (:meth:`rebalance`, a lost worker) or on
        :meth:`close`.

        Returns
        -------
        object or None
            The submitted pass, for ``map_sum(..., ahead=)``; None where posting is off
            (``blockflow.ml.post-ahead`` or ``blockflow.ml.direct-gather`` false, or a
            post failed): the pass is then submitted with its value.
        """
        if not (self._direct and self._post_ahead) or not any(a is POSTED for a in args):
            return None
        p = self._submit(func, rows, args, True, steal)
        self._ahead.add(p)
        return p

    def _current(self, p: _Pass, func, rows, steal) -> bool:
        """Whether a prepared pass still matches the blocks' placement and the call."""
        return (p in self._ahead and p.version == self._version and p.func is func
                and p.rows is rows and p.steal == bool(steal))

    def _post(self, p: _Pass, value) -> None:
        """Send the pass's posted value to each of its workers (concurrently).

        A post to a worker the scheduler drops meanwhile ends at once and the pass is
        redone on the survivors (:class:`~blockflow.ml._peers.Peers`); a failed post waits
        for the scheduler's word (at most ``peer_timeout``) before it is taken for a
        worker out of the client's reach, so that a worker lost a moment before is not."""
        from distributed.protocol import to_serialize

        from blockflow.ml._post import HANDLER

        peers = Peers(self.client, p.workers, self.peer_timeout)

        async def send():
            # the scheduler's word comes while the posts travel: a post to a worker it
            # dropped ends as soon as it comes (waiting for it first would put a round
            # trip to the scheduler on every step)
            peers.start_refresh()
            return await asyncio.gather(*(peers.call(
                a, lambda a=a: getattr(self.client.rpc(a), HANDLER)(
                    key=p.post.key, value=to_serialize(value)), confirm=True)
                for a in p.workers), return_exceptions=True)

        replies = self.client.sync(send)
        errors = {a: r for a, r in zip(p.workers, replies) if isinstance(r, BaseException)}
        if not errors:
            return
        lost = {a for a, r in errors.items() if isinstance(r, PeerGone)}
        if lost:
            raise WorkerLostError(f"blockflow: workers lost: {sorted(lost)}", lost=lost)
        self._cancel(p)
        a, e = next(iter(errors.items()))
        if any(isinstance(r, TimeoutError) for r in errors.values()):
            # a listed worker slow to answer (a loaded host, a hung process): this pass
            # carries its value in the graph; posting stays on for the next
            raise _PostFailed()
        if len(errors) < len(p.workers):  # others took it: that worker is the problem
            warnings.warn(f"blockflow: worker {a} did not take a pass's parameters ({e}); "
                          f"this pass is submitted with them inside its task graph.",
                          RuntimeWarning, stacklevel=3)
            raise _PostFailed()
        warnings.warn(f"blockflow: the client cannot post a pass's parameters to the "
                      f"workers directly ({e!r}); sending them inside the task "
                      f"graph from now on. Set blockflow.ml.direct-gather: false where the "
                      f"workers are out of the client's reach.", RuntimeWarning, stacklevel=3)
        self._direct = False
        raise _PostFailed()

    def _cancel(self, p: _Pass) -> None:
        """Cancel a prepared pass: its waiting tasks return at once, with nothing."""
        self._ahead.discard(p)
        if p.post is None:
            return
        from blockflow.ml._post import HANDLER

        peers = Peers(self.client, p.workers, self.peer_timeout)

        async def send():
            # a lost worker has nothing to cancel: those the scheduler lists, none waited
            # on long
            await peers.refresh()
            return await asyncio.gather(*(peers.call(
                a, lambda a=a: getattr(self.client.rpc(a), HANDLER)(key=p.post.key,
                                                                    cancel=True))
                for a in peers.live), return_exceptions=True)
        try:
            self.client.sync(send)
        except Exception:  # the client is closing, or the cluster has no worker left
            pass

    def _submit(self, func, rows, args, measure: bool = True, steal: bool = False,
                value: Any = None, post: bool = True) -> _Pass:
        """The pass as one graph (one message to the scheduler): a task per worker,
        restricted to it, and the fan-in tree of their sums up to its top level (at most
        ``split_every`` partial sums, added on the client by :meth:`_wait`); returns the
        pass, with the top level's futures.

        ``POSTED`` arguments become a :class:`blockflow.ml._post.Posted` placeholder, its
        value to be posted, where the client reaches the workers (and ``post``); else
        ``value``. A task
        reports the seconds it waited for its post in its metadata
        (:func:`blockflow._distributed.add_task_wait`): the scheduler plugin's speed model
        counts only its compute.

        One graph rather than a ``client.submit`` per task: the client batches messages
        that follow one another within 10 ms, so the later workers of a pass would start
        up to 10 ms after the first."""
        import dask

        from blockflow.reduction import choose_split_every

        posting, post = post, None
        if any(a is POSTED for a in args):
            if posting and self._direct and self._post_ahead:
                self._install(PostPlugin)
                post = Posted()
            args = tuple((post or value) if a is POSTED else a for a in args)
        by_worker: dict[str, list[int]] = defaultdict(list)
        for j in sorted(self.placement):
            if rows is None or len(rows[j]):
                by_worker[self.placement[j]].append(j)
        parts = []
        r0 = self.overhead_rows()
        plan = None
        if steal and len(by_worker) > 1:
            self._install(StealPlugin)
            plan = self._steal_plan(sorted(by_worker))
        for a, js in sorted(by_worker.items()):
            n = sum(self.block_rows[j] if rows is None else len(rows[j]) for j in js)
            # the shares differ in rows on purpose (so that they last the same): the
            # scheduler plugin's speed model compares seconds per row, not per task
            with dask.annotate(workers=[a], allow_other_workers=False,
                               blockflow_work=n + r0):
                parts.append(dask.delayed(_run_shard, pure=False)(
                    func, [self.futures[j] for j in js],
                    [None if rows is None else rows[j] for j in js], args, plan,
                    # a warm-up pass (fixed costs, cold) is a group of its own: the speed
                    # model compares it with nothing
                    dask_key_name=None if measure else f"blockflow-warmup-{uuid.uuid4().hex}"))
        k = max(2, self.split_every or choose_split_every(1 << 20, 1 << 30))
        while len(parts) > k:  # the fan-in tree on the workers: a node sums up to k parts
            parts = [parts[i] if len(parts[i:i + k]) == 1 else
                     dask.delayed(_add, pure=False)(*parts[i:i + k])
                     for i in range(0, len(parts), k)]
        # the tree's root is the client: it adds the top level's (at most k) partial sums
        # as each arrives, so only the last one's transfer follows the slowest worker
        return _Pass(futures=self.client.compute(parts, optimize_graph=False), post=post,
                     workers=sorted(by_worker), version=self._version, func=func, rows=rows,
                     steal=bool(steal))

    def _steal_plan(self, workers: list[str]) -> tuple:
        """A stealing pass's arguments for :func:`blockflow.ml._steal.run_stealing`:
        ``(pass id, workers, chunks, seconds per row, reserve, peer timeout)``, seconds per
        row and reserve per worker.

        The reserve is ``steal_reserve``, raised to ``min(2/3, steal_reserve + 2 g)`` for a
        worker that gave a fraction ``g`` of its rows away in the latest pass (it was
        behind), and to at least ``steal_reserve_unmeasured`` for a worker no pass of this
        fit has measured (its share follows a prior). A blockflow heuristic."""
        # seconds per row of each worker's latest passes (k_a of the pass model): how
        # its rows compare with a thief's before its first chunk is timed
        spr = self._throughput.measured_seconds_per_unit()
        reserve = {}
        for a in workers:
            reserve[a] = min(2 / 3, self.steal_reserve + 2 * self._gave.get(a, 0.0))
            if a not in spr:
                # its share follows a prior (the plugin's speed is shrunk towards the
                # typical one): a larger reserve lets its peers take over a wrong share
                reserve[a] = max(reserve[a], self.steal_reserve_unmeasured)
        return (uuid.uuid4().hex, list(workers), self.steal_chunks, spr, reserve,
                self.peer_timeout)

    def _assigned_rows(self, rows) -> dict[str, int]:
        """Rows of a pass on each worker's own blocks (before any stealing)."""
        out: dict[str, int] = defaultdict(int)
        for j, a in self.placement.items():
            out[a] += self.block_rows[j] if rows is None else len(rows[j])
        return dict(out)

    def _install(self, plugin) -> None:
        """A worker plugin installing a comm handler (:class:`~blockflow.ml._steal.
        StealPlugin`, :class:`~blockflow.ml._post.PostPlugin`) on every worker, once per
        cluster: workers that join later get it as they start."""
        if plugin.name in self._installed:
            return
        self.client.register_plugin(plugin(), name=plugin.name)
        self._installed.add(plugin.name)

    def _wait(self, parts) -> dict:
        """The sum of the top level's partial sums, each fetched as soon as it is done
        (:func:`blockflow.scheduling.wait.gather_as_done`: a lost worker holding blocks
        raises :class:`~blockflow.errors.WorkerLostError` naming it)."""
        got = gather_as_done(parts, alive=self._workers, needed=set(self.placement.values()),
                             poll=self.poll, get=self._fetch)
        return _add(*got)

    def _fetch(self, future):
        """A finished partial sum, straight from its worker where the client can reach
        the workers (``blockflow.ml.direct-gather``), else through the scheduler."""
        if self._direct:
            try:
                return self.client.gather(future, direct=True)
            except OSError as e:  # distributed's CommClosedError is one
                if future.status != "finished":
                    raise
                warnings.warn(f"blockflow: the client cannot fetch results from the "
                              f"workers directly ({e}); fetching through the scheduler "
                              f"from now on. Set blockflow.ml.direct-gather: false where "
                              f"the workers are out of the client's reach.", RuntimeWarning,
                              stacklevel=3)
                self._direct = False
        return self.client.gather(future)

    def _recover(self, lost: set[str]) -> None:
        self.recoveries.append({"time": time.time(), "lost": sorted(lost),
                                "blocks": sum(a in lost for a in self.placement.values())})
        for a in lost:
            self._throughput.forget(a)
        self.rebalance()

    def close(self) -> None:
        """Cancel the prepared passes and release the blocks."""
        for p in list(self._ahead):
            self._cancel(p)
        self.futures.clear()  # releases the blocks


@dataclass(eq=False)
class _Pass:
    """A submitted pass: the fan-in's top-level futures and what it was submitted for."""

    futures: list
    post: Any  # blockflow.ml._post.Posted, or None: the pass carries its arguments
    workers: list[str]  # the workers running its tasks (each gets the post)
    version: int  # ResidentShards._version at submission
    func: Callable
    rows: Any
    steal: bool


def _peer_timeout(value) -> float:
    t = peer_timeout(value)
    if not (t > 0 and math.isfinite(t)):
        raise ValueError(f"blockflow: peer_timeout must be a positive number of seconds, "
                         f"got {value!r}; pass it or set blockflow.ml.peer-timeout "
                         f"(\"5s\", say).")
    return t


class _PostFailed(Exception):
    """A post did not reach a live worker: posting is off, the pass is submitted again."""


