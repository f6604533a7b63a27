"""Resident shards: row blocks of (features, labels) kept on workers in proportion to speed.

:class:`ResidentShards` places each row block on one worker once: a GLM's pass
(:mod:`blockflow.ml._passes`) sends only its parameters and row indices, and a
data-parallel rank (:mod:`blockflow.ml.train`) reads the blocks on its worker. Each
worker's share follows its speed, capped by free memory (*speed-weighted sharding*, a
blockflow heuristic; xgboost.dask, DDP and Ray Train shard equally). Guide:
docs/guide/ai.md.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable, Sequence

import dask
import dask.core
import numpy as np
from dask.utils import format_bytes
from distributed import KilledWorker, futures_of

from blockflow.errors import WorkerLostError
from blockflow.ml._group import worker_processes
from blockflow.ml._passes import ShardPasses
from blockflow.scheduling.estimate import Throughput, earliest_finish
from blockflow.scheduling.view import declared_speeds, learned_speeds, memory_of, worker_memory, workers_info
from blockflow.scheduling.wait import wait_for

__all__ = ["ResidentShards"]


def _pair(x, y, check=None, block=0, offset=0):
    """A block's ``(X, y)``, checked for non-finite values by ``check``."""
    if check is not None:
        return check(x, y, block, offset)
    return (x, y)


def _keys_below(graphs, j: int, wanted: set) -> set:
    """The keys of ``wanted`` that row block ``j`` of ``graphs`` (``(array, its graph as a
    dict)`` each) is computed from."""
    out: set = set()
    for a, dsk in graphs:
        key = a.__dask_keys__()[j]
        while isinstance(key, list):  # a row block: its first (only) column block
            key = key[0]
        stack, seen = [key], set()
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            if k in wanted:
                out.add(k)
            elif k in dsk:
                stack.extend(dask.core.get_dependencies(dsk, k))
    return out


def _rows_of(pair) -> int:
    return len(pair[0])


def _pair_copy(pair):
    return pair


class ResidentShards(ShardPasses):
    """Row blocks of ``(X, y)`` held on workers, shares proportional to speed.

    Parameters
    ----------
    client : distributed.Client
    X : dask.array.Array
        Features, chunked along rows only (see :func:`as_row_blocks`).
    y : dask.array.Array
        Labels with the same row chunks.
    sharding : {"speed", "equal"}, default "speed"
        Rows proportional to speed, or the same number of blocks per worker.
    memory_fraction : float, default 0.5
        Fraction 0-1 of a worker's free (device) memory its blocks may take.
    split_every : int, optional
        Fan-in of the sum over workers; default from ``choose_split_every``.
    rebalance_gain : float, default 0.05
        Move blocks only when the slowest worker's predicted time drops by more than this
        fraction (0-1).
    poll : float, default 0.5
        Seconds between checks for lost workers while a pass runs.
    one_per_process : bool, default False
        Place blocks only on one worker per process (:func:`blockflow.ml._group.
        worker_processes`): each holds one torch.distributed rank.

    Raises
    ------
    RuntimeError
        If the cluster has no workers.
    ValueError
        From ``check``: a non-finite value, or no finite row left after dropping.
    MemoryError
        If a block is larger than any worker's memory limit, before anything runs.
    WorkerLostError
        In place of ``KilledWorker`` while blocks are loaded or moved, naming the block.
    """

    def __init__(self, client, X, y, *, sharding: str = "speed", memory_fraction: float = 0.5,
                 split_every: int | None = None, rebalance_gain: float = 0.05,
                 poll: float = 0.5, one_per_process: bool = False, check=None):
        if sharding not in ("speed", "equal"):
            raise ValueError(f"blockflow: sharding must be 'speed' or 'equal', got "
                             f"{sharding!r}.")
        self.client, self.sharding = client, sharding
        self.memory_fraction, self.split_every = memory_fraction, split_every
        self.rebalance_gain, self.poll = rebalance_gain, poll
        self.one_per_process = bool(one_per_process)
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
        # data the user scattered: Dask cannot recompute it, so its holders are kept to
        # name them if it goes (a dask collection's own tasks are recomputed)
        self._xy = (X, y)
        self._sources = {f.key: f for f in futures_of(X) + futures_of(y)}
        held = [f for f in self._sources.values() if f.status == "finished"]
        self._holders = dict(client.who_has(held)) if held else {}
        # per worker, the latest passes' or steps' (rows processed, seconds) and the fixed
        # cost per pass fitted through them (the one throughput estimator). No call is
        # dropped as a cold start: the blocks are resident before the first.
        self._throughput = Throughput(window=16, cold=0)
        self._fraction = 1.0  # rows processed per resident row, latest pass
        self.recoveries: list[dict] = []
        self._version = 0  # counts placements that moved blocks
        self.last_seconds, self.last_rows = {}, {}
        self.moves = 0
        self.placement: dict[int, str] = {}
        self.futures: dict[int, Any] = {}
        self._place(self._assign(self._workers(), {}))
        if check is not None and check.drop:
            self._count_kept_rows()

    def _count_kept_rows(self) -> None:
        """Row counts per resident block after non-finite rows were dropped."""
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
        return (f"block {j} (rows {int(self.offsets[j]):,}-{int(self.offsets[j + 1]) - 1:,}, "
                f"{format_bytes(self.block_bytes[j])} of X and y)")

    def _too_large(self, j: int, workers: dict[str, dict]) -> str | None:
        """Why no worker can hold block ``j``, or None if one can or limits are unknown."""
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
        """Refuse a block no worker can hold before anything runs."""
        if self.block_bytes:
            j = int(np.argmax(self.block_bytes))
            why = self._too_large(j, workers)
            if why:
                raise MemoryError(why)

    def _killed(self, blocks: list[int], e: BaseException) -> WorkerLostError:
        """KilledWorker on blocks' tasks as a message naming the blocks."""
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
        if self.one_per_process:
            workers = {a: workers[a] for a in worker_processes(self.client, info=workers)}
        return workers

    def _prior_speeds(self) -> dict[str, float]:
        # only speeds the plugin knows with confidence (it reports 1.0 for workers it
        # knows nothing about), else the devices' declared nominal speeds (GPU models)
        return learned_speeds(self.client).known or declared_speeds(self.client)

    def knows_speeds(self) -> bool:
        """Whether a pass has measured a speed, or the scheduler plugin has learned some."""
        return bool(self._throughput.measured_seconds_per_unit()
                    or learned_speeds(self.client).known)

    def observe(self, worker: str, rows: float, seconds: float) -> None:
        """Feed one timed call (``rows`` processed in ``seconds`` of the worker's own work,
        waits on peers excluded) to the speed model; the call's rows per resident row set
        how the fixed cost per call is counted in resident rows."""
        if seconds > 0 and rows > 0:
            self._throughput.observe(worker, rows, seconds)
            held = self.rows_per_worker().get(worker, 0)
            if held:
                self._fraction = min(1.0, rows / held)

    def overhead_rows(self) -> float:
        """A pass's fixed cost per worker, in rows processed; 0 until passes of differing
        row counts exist (:func:`blockflow.scheduling.estimate.fixed_units`, a blockflow
        heuristic)."""
        return self._throughput.fixed

    def speeds(self, workers) -> dict[str, float]:
        """Relative speed per worker: measured rows (plus :meth:`overhead_rows`) per
        second, else the plugin's learned speed, else 1."""
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
        """Block -> worker: round robin (``"equal"``) or equal predicted pass times
        ``(rows + r0) / speed`` within capacity (``"speed"``)."""
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
        moved = [j for j, a in placement.items() if self.placement.get(j) != a]
        if moved:
            self._version += 1
        alive = set(self._workers()) if self.placement else set()
        # A block still held by a live worker is copied from there (worker to worker); the
        # others come from the source collection, all in one graph: each block's graph
        # carries its source, and one submission per block would send it once per block.
        fresh = [j for j in moved if self.placement.get(j) not in alive or j not in
                 self.futures]
        self.refuse_lost_sources(fresh)
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
        sources.clear()
        src = None  # a traceback of this frame must not keep a block alive
        self.moves += len(moved) if self.placement else 0
        self.placement = dict(placement)
        wait_for(self.client, [self.futures[j] for j in moved], what="moving blocks")
        if any(self.futures[j].status == "cancelled" for j in moved):
            self.refuse_lost_sources([j for j in moved if self.futures[j].status ==
                                       "cancelled"], settle=True)
        if not any(self.futures[j].status == "error" for j in moved):
            return
        # the errors are taken with exception(), which raises nothing: a raised one's
        # traceback would keep the blocks referenced in a cycle until the next gc
        killed = {j: self.futures[j].exception() for j in moved
                  if self.futures[j].status == "error"}
        killed = {j: e for j, e in killed.items() if isinstance(e, KilledWorker)}
        if killed:  # on internal keys: name the blocks
            error = self._killed(sorted(killed), next(iter(killed.values())))
        else:
            # a block could not be read or failed its check (a non-finite value): the
            # first such block's own error, once all have run (the lowest rows first)
            end = time.monotonic() + 30
            while not all(self.futures[j].done() for j in moved) and time.monotonic() < end:
                time.sleep(0.02)
            error = self.futures[min(j for j in moved if self.futures[j].status ==
                                     "error")].exception()
        self.close()  # nothing of this placement stays on the workers
        try:
            raise error.with_traceback(None)
        finally:  # no cycle through this frame: it would hold the blocks until a gc
            del error, killed

    def refuse_lost_sources(self, blocks: list[int], settle: bool = False) -> None:
        """One line naming ``blocks`` whose source is data the user scattered that was lost
        with its worker (Dask cannot recompute it); with ``settle``, a few seconds for the
        scheduler's word that a source held by a lost worker is gone.

        Raises
        ------
        WorkerLostError
            Naming the blocks, the workers that held them and how to avoid it.
        """
        if not self._sources:
            return
        alive = set(workers_info(self.client))
        end = time.monotonic() + (5.0 if settle else 0.0)
        while time.monotonic() < end and any(
                f.status == "finished" and not alive & set(self._holders.get(k, ()))
                for k, f in self._sources.items()):
            time.sleep(0.05)
        gone = {k for k, f in self._sources.items() if f.status in ("cancelled", "error")}
        if not gone:
            return
        graphs = [(a, dict(a.__dask_graph__())) for a in self._xy]
        lost = {j: _keys_below(graphs, j, gone) for j in blocks}
        lost = {j: ks for j, ks in lost.items() if ks}
        if not lost:
            return
        where = sorted({w for ks in lost.values() for k in ks
                        for w in self._holders.get(k, ())})
        js = sorted(lost)
        what = self._block(js[0]) if len(js) == 1 else "blocks " + ", ".join(
            f"{j} (rows {int(self.offsets[j]):,}-{int(self.offsets[j + 1]) - 1:,})"
            for j in js)
        self.close()
        held = (f"worker{'s' * (len(where) > 1)} {', '.join(where)}, which left the cluster"
                if where else "a worker that left the cluster")
        raise WorkerLostError(
            f"blockflow: {what} came from data scattered only to {held}, and Dask cannot "
            f"recompute scattered data; pass the arrays themselves (NumPy, or a dask array "
            f"built from them) or keep copies of the scattered data on several workers "
            f"(client.replicate(futures, n=2), or scatter(..., broadcast=True)).", lost=where)

    def rebalance(self) -> int:
        """Move blocks when measured speeds predict a gain over ``rebalance_gain``; returns
        the number of blocks moved."""
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

    # --- a pass (the machinery: blockflow.ml._passes) ----------------------------------

    def map_sum(self, func: Callable, rows: Sequence | None = None, args: tuple = (),
                *, measure: bool = True, first_rows: bool = False,
                merge: Callable | None = None) -> Any:
        """``sum over workers of func(blocks, rows, *args)``, each on its own blocks.

        Parameters
        ----------
        func : callable
            ``func(blocks, rows, *args)`` on a worker, over its ``(X, y)`` blocks and local
            row indices (None: all); returns a summable array, number or tuple.
        rows : list, optional
            Per block, the rows to use; None uses all. Empty selections are skipped.
        args : tuple
            Further arguments (small: they travel in the graph).
        measure : bool, default True
            Whether the pass's timings count towards the workers' speeds.
        first_rows : bool, default False
            Pass each block's first row (its index in the data) after ``args``.
        merge : callable, optional
            ``merge(values)`` of the blocks' values in block order; default
            :func:`~blockflow.ml._passes.exact_sum` (column sums correctly rounded once).

        Returns
        -------
        object
            The sum; :attr:`last_seconds` and :attr:`last_rows` describe the pass.

        Raises
        ------
        RuntimeError
            If workers keep leaving (1000 passes lost in a row).
        """
        for _ in range(1000):
            parts = self._submit(func, rows, args, first_rows)
            try:
                out = self._wait(parts, merge)
            except WorkerLostError as e:
                lost = set(e.lost)
            else:
                lost = None
            if lost is not None:  # out of the except: no internal error chained
                del parts
                self._recover(lost)
                continue
            self.last_seconds, self.last_rows = out["seconds"], out["rows"]
            if measure:
                for a, s in out["seconds"].items():
                    if s > 0.005 and out["rows"].get(a, 0) > 0:
                        self._throughput.observe(a, out["rows"][a], s)
                held = self.rows_per_worker()
                resident = sum(held.get(a, 0) for a in out["rows"])
                if resident:
                    self._fraction = sum(out["rows"].values()) / resident
            return out["value"]
        raise RuntimeError("blockflow: workers kept disappearing; check the cluster.")

    def _recover(self, lost: set[str]) -> None:
        self.recoveries.append({"time": time.time(), "lost": sorted(lost),
                                "blocks": sum(a in lost for a in self.placement.values())})
        for a in lost:
            self._throughput.forget(a)
        self.rebalance()

    def close(self) -> None:
        """Release the blocks."""
        self.futures.clear()
