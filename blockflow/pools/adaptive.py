"""Per-pool elastic scaling: :class:`PoolAdaptive`, distributed's ``Adaptive`` per pool
(dask-kubernetes#914).

Guide: :doc:`/guide/pools`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from statistics import median
from typing import Any

from dask.utils import parse_timedelta
from distributed.deploy.adaptive import Adaptive

from blockflow import _distributed, config

__all__ = ["PoolAdaptive"]

logger = logging.getLogger(__name__)


class PoolAdaptive(Adaptive):
    """Adaptive scaling of a :class:`blockflow.PoolCluster`, one target per pool.

    Every interval it asks the scheduler plugin for each pool's target
    (:mod:`blockflow.pools.scaling`), starts the workers a pool lacks and forgets those retired.

    Parameters
    ----------
    cluster : blockflow.PoolCluster
    pools : mapping, optional
        Pool name -> ``(minimum, maximum)`` workers.
    minimum, maximum : int, optional
        Bounds of pools not named in ``pools``; default 0 and the pool's size now (at least 1).
    interval, wait_count, target_duration : optional
        As for distributed's ``Adaptive`` (``distributed.adaptive.*``).
    startup : str or float, default "5s"
        Seconds a new worker takes to join, until one of its pool (or, before that, of any
        pool) is measured.
    hold : str or float, optional
        How long a worker is kept after it arrives, and a pool's target after the plan asked
        for it, while the run has an objective (default ``blockflow.scaling.hold``; 0: no
        hysteresis). Without an objective idle workers go after ``wait_count`` checks, as
        with distributed's ``Adaptive``.

    Attributes
    ----------
    targets : dict of str to int
        Pool name -> the scheduler's latest target.
    retired : list of str
        Workers the scheduler retired, in order.
    checks : int

    Raises
    ------
    ValueError
        For a pool the cluster does not have, a minimum above the maximum, or a negative
        or unreadable ``hold``.
    """

    def __init__(self, cluster, pools: Mapping[str, tuple[int, int]] | None = None, *,
                 minimum: int | None = None, maximum: int | None = None,
                 interval=None, wait_count: int | None = None, target_duration=None,
                 startup: str | float = "5s", hold: str | float | None = None,
                 **kwargs: Any):
        self.state = "inactive"  # until distributed's Adaptive starts (and for __del__)
        bounds: dict[str, tuple[int, int]] = {}
        for name in (pools or {}):
            if name not in cluster.pools:
                raise ValueError(f"PoolCluster.adapt: no pool named {name!r}; the pools are "
                                 f"{sorted(cluster.pools)}.")
        for name in cluster.pools:
            if pools and name in pools:
                lo, hi = pools[name]
            else:
                lo = minimum or 0
                hi = maximum if maximum is not None else max(len(cluster.workers_of(name)), 1)
            if not (isinstance(lo, int) and isinstance(hi, int)) or lo < 0 or hi < lo:
                raise ValueError(f"PoolCluster.adapt: pool {name!r} needs 0 <= minimum <= "
                                 f"maximum (whole workers), got ({lo!r}, {hi!r}).")
            bounds[name] = (lo, hi)
        self.bounds = bounds
        try:
            self.hold = float(parse_timedelta(config.get("scaling.hold", hold)))
        except (TypeError, ValueError):
            self.hold = -1.0
        if not self.hold >= 0:
            raise ValueError(f"PoolCluster.adapt: hold must be a duration >= 0 (\"30s\", or "
                             f"seconds): how long a worker is kept after it arrives; got "
                             f"{config.get('scaling.hold', hold)!r}.")
        self.startup_guess = parse_timedelta(startup)
        self._asked: dict[str, tuple[str, float]] = {}  # worker name -> (pool, when started)
        self._joined: dict[str, list[float]] = {}  # pool -> seconds its workers took to join
        self.targets: dict[str, int] = {}
        self.reasons: dict[str, str] = {}
        self.retired: list[str] = []  # names of the workers the scheduler retired
        self._leaving: set[str] = set()  # retired on the scheduler, not gone from it yet
        self.checks = 0  # scaling checks done (every one, whether it changed anything)
        self._pool_check_running = False
        super().__init__(cluster, interval=interval, minimum=sum(b[0] for b in bounds.values()),
                         maximum=sum(b[1] for b in bounds.values()), wait_count=wait_count,
                         target_duration=target_duration, **kwargs)

    @property
    def startup(self) -> float:
        """Seconds a new worker takes to join: the median measured (all pools), else the guess."""
        joined = [t for times in self._joined.values() for t in times]
        return median(joined) if joined else self.startup_guess

    def startup_of(self, pool: str) -> float:
        """Seconds a new worker of ``pool`` takes to join: the median measured of the pool,
        else of all pools (:attr:`startup`)."""
        times = self._joined.get(pool)
        return median(times) if times else self.startup

    async def target(self) -> int:  # distributed's interface: the total of the pools
        return sum(self.targets.values())

    def _observed_names(self) -> set[str]:
        info = self.cluster.scheduler_info.get("workers", {})
        return {str(w.get("name")) for w in info.values()}

    async def adapt(self) -> None:
        """One check: ask each pool's target, start the workers it lacks, forget those retired."""
        if self._pool_check_running:
            return
        self._pool_check_running = True
        try:
            await self._adapt_pools()
        finally:
            self._pool_check_running = False

    async def _adapt_pools(self) -> None:
        cluster = self.cluster
        observed = self._observed_names()
        now = time.time()
        # a worker the scheduler retires is forgotten (its spec removed) only once it has
        # left the scheduler: distributed's retire_workers first moves its results to other
        # workers; closing it earlier would lose them and the scheduler would compute them
        # again
        gone = sorted(n for n in self._leaving if n not in observed)
        if gone:
            self._leaving.difference_update(gone)
            gone = [n for n in gone if n in cluster.worker_spec]
            if gone:
                self.log.append((now, {"status": "down", "workers": gone}))
                await cluster.scale_down(gone)
        for name in list(self._asked):
            if name in observed:
                pool, asked = self._asked.pop(name)
                times = self._joined.setdefault(pool, [])
                times.append(now - asked)
                del times[:-20]
            elif name not in cluster.worker_spec:
                self._asked.pop(name)
        starting = {p: sum(1 for n in cluster.workers_of(p) if str(n) not in observed)
                    for p in cluster.pools}
        threads = {p: int((cluster.pool_worker_spec(p)["options"].get("nthreads")
                           or cluster.pool_worker_spec(p)["options"].get("cores") or 1))
                   for p in cluster.pools}
        reply = await _distributed.call_scheduler_handler(
            self.scheduler, "blockflow_pool_targets", pools={n: p.to_dict() for n, p in cluster.pools.items()},
            bounds={n: list(b) for n, b in self.bounds.items()},
            starting=starting, threads=threads, target_duration=self.target_duration,
            startup={p: self.startup_of(p) for p in cluster.pools},
            wait_count=self.wait_count, hold=self.hold, interval=self.interval)
        self.targets, self.reasons = reply["targets"], reply["reasons"]
        for name in reply.get("retiring", ()):
            # retired on the scheduler (idle, of a pool above its target): forgotten once
            # gone (above, on a later check)
            if name in cluster.worker_spec and name not in self._leaving:
                self._leaving.add(name)
                self.retired.append(name)
        up = {}
        for pool, target in self.targets.items():
            have = len(cluster.workers_of(pool))
            if target > have:
                up[pool] = target
        if up:
            before = set(cluster.worker_spec)
            self.log.append((time.time(), {"status": "up", "pools": dict(up)}))
            cluster.scale(up)
            for name in set(cluster.worker_spec) - before:
                self._asked[str(name)] = (cluster.worker_spec[name].get("pool"), time.time())
        self.checks += 1

