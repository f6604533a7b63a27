"""A pass over resident shards: submitted, posted, summed by a fan-in, waited for, cancelled.

One task per worker over its resident blocks, summed by a fan-in tree whose root is the
client (:meth:`ResidentShards.map_sum <blockflow.ml.ResidentShards.map_sum>`); see
:mod:`blockflow.ml._post` and :mod:`blockflow.ml._steal`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import dask
from distributed import get_worker
from distributed.protocol import to_serialize

from blockflow.errors import WorkerLostError
from blockflow.ml._peers import PeerGone, Peers
from blockflow.ml._post import HANDLER as POST_HANDLER
from blockflow.ml._post import POSTED, Posted, PostPlugin, resolve
from blockflow.ml._steal import StealPlugin, add_values, run_stealing
from blockflow.reduction import choose_split_every
from blockflow.scheduling.wait import gather_as_done

__all__ = ["ShardPasses"]


def _run_shard(func, blocks, rows, args, steal=None):
    """On a worker: ``func([(X, y) blocks], [row indices or None], *args)`` timed; ``steal``
    holds :func:`blockflow.ml._steal.run_stealing`'s further arguments, or None."""
    me = get_worker().address
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
        out, n, stolen, busy, own = run_stealing(func, blocks, rows, args, *steal)
    # seconds in func: a stealing worker's last requests to its peers are not work; "own":
    # the seconds on its own rows, which its speed is measured on
    return {"value": out, "seconds": {me: busy}, "rows": {me: n}, "stolen": {me: stolen},
            "own": {me: own}}


def _add(*parts):
    """Sum the ``value``s (arrays, numbers, tuples of them); merge the timing dicts."""
    value = None
    for p in parts:
        value = add_values(value, p["value"])
    seconds, rows, stolen, own = {}, {}, {}, {}
    for p in parts:
        seconds.update(p["seconds"])
        rows.update(p["rows"])
        stolen.update(p.get("stolen", {}))
        own.update(p.get("own", {}))
    return {"value": value, "seconds": seconds, "rows": rows, "stolen": stolen, "own": own,
            "cancelled": any(p.get("cancelled") for p in parts)}


class ShardPasses:
    """How :class:`blockflow.ml.ResidentShards` submits, posts, waits for and cancels a
    pass (a mixin)."""

    def _current(self, p: _Pass, func, rows, steal) -> bool:
        """Whether a prepared pass still matches the blocks' placement and the call."""
        return (p in self._ahead and p.version == self._version and p.func is func
                and p.rows is rows and p.steal == bool(steal))

    def _post(self, p: _Pass, value) -> None:
        """Send the pass's posted value to each of its workers (concurrently); a post to a
        lost worker redoes the pass on the survivors."""
        peers = Peers(self.client, p.workers, self.peer_timeout)

        async def send():
            # the scheduler's word comes while the posts travel: a post to a worker it
            # dropped ends as soon as it comes (waiting for it first would put a round
            # trip to the scheduler on every step)
            peers.start_refresh()
            return await asyncio.gather(*(peers.call(
                a, lambda a=a: getattr(self.client.rpc(a), POST_HANDLER)(
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
        peers = Peers(self.client, p.workers, self.peer_timeout)

        async def send():
            # a lost worker has nothing to cancel: those the scheduler lists, none waited
            # on long
            await peers.refresh()
            return await asyncio.gather(*(peers.call(
                a, lambda a=a: getattr(self.client.rpc(a), POST_HANDLER)(key=p.post.key,
                                                                    cancel=True))
                for a in peers.live), return_exceptions=True)
        try:
            self.client.sync(send)
        except Exception:  # the client is closing, or the cluster has no worker left
            pass

    def _submit(self, func, rows, args, measure: bool = True, steal: bool = False,
                value: Any = None, post: bool = True) -> _Pass:
        """The pass as one graph: a task per worker and the fan-in tree up to its top level;
        ``POSTED`` arguments become :class:`blockflow.ml._post.Posted` placeholders."""
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
        """A stealing pass's arguments for :func:`blockflow.ml._steal.run_stealing`, with
        each worker's reserve raised after it gave rows away (a blockflow heuristic)."""
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
        """Register a worker plugin serving a comm handler on every worker, once."""
        if plugin.name in self._installed:
            return
        self.client.register_plugin(plugin(), name=plugin.name)
        self._installed.add(plugin.name)

    def _wait(self, parts) -> dict:
        """The sum of the top level's partial sums, each fetched once done."""
        got = gather_as_done(parts, alive=self._workers, needed=set(self.placement.values()),
                             poll=self.poll, get=self._fetch)
        return _add(*got)

    def _fetch(self, future):
        """A finished partial sum, from its worker directly (``blockflow.ml.direct-gather``)."""
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


class _PostFailed(Exception):
    """A post did not reach a live worker: posting is off, the pass is submitted again."""

