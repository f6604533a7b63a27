"""Pools: every worker belongs to a named pool with a provider, a region and prices.

:class:`PoolMember` reports a worker's pool as :data:`POOL_METRIC` and declares the resource
``"pool:<name>"``; :func:`pools_of` reads it back; workers reporting none are in
:data:`DEFAULT_POOL`. Guide: :doc:`/guide/pools`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from blockflow import _distributed
from blockflow._distributed.metrics import POOL_METRIC

__all__ = ["DEFAULT_POOL", "POOL_METRIC", "POOL_RESOURCE_PREFIX", "Pool", "PoolMember",
           "heartbeat_now", "pool_from_metric", "pools_of", "requested_pools"]

#: Prefix of the worker resource a pool's workers declare (``"pool:<name>"``).
POOL_RESOURCE_PREFIX = "pool:"
#: Amount of the pool resource each worker declares: enough that a task asking for one
#: unit is limited only by the worker's threads.
_POOL_RESOURCE_AMOUNT = 1e6

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class Pool:
    """A pool of workers: one kind of machine, at one price, at one provider.

    Parameters
    ----------
    name : str
        Letters, digits, ``_ . -``: ``"l4"``.
    provider : str, default "local"
        Who runs the machines (``"gcp"``, ``"onprem"``).
    region : str, default ""
    price : float, optional
        Dollars per worker-hour (>= 0); None (unknown) is refused by a cost objective or budget.
    egress : float, default 0.0
        Dollars per GB (1e9 bytes) sent from this pool's workers to another provider's.
    speed : float or mapping of str to float, optional
        Relative speed prior (> 0; 1.0 typical) until speeds are learned: one number, or task
        group (key prefix) -> speed where groups gain differently from this pool's machines
        (a row of Gavel's throughput matrix); groups not named use the median of the others.
    min_billed : float, default 0.0
        Seconds: the least a worker is billed for, from its arrival (a cloud's minimum
        increment, 60 for many).

    Raises
    ------
    ValueError
        For a malformed name, a negative or non-finite price, egress or ``min_billed``, or a
        speed <= 0.
    """

    name: str
    provider: str = "local"
    region: str = ""
    price: float | None = None
    egress: float = 0.0
    speed: float | Mapping[str, float] | None = None
    min_billed: float = 0.0

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"blockflow.Pool: name must be a non-empty string of letters, "
                             f"digits, '_', '.' or '-', got {self.name!r}.")
        for field_name in ("price", "egress", "min_billed"):
            value = getattr(self, field_name)
            if value is None and field_name == "price":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"blockflow.Pool {self.name!r}: {field_name} must be a number >= 0 "
                    f"({_UNITS[field_name]}), got {value!r}.")
            object.__setattr__(self, field_name, float(value))
        if isinstance(self.speed, Mapping) or isinstance(self.speed, tuple):
            # kept as sorted (group, speed) pairs: a Pool stays hashable
            pairs = tuple(sorted((str(g), _speed(self.name, v, g))
                                 for g, v in dict(self.speed).items()))
            if not pairs:
                raise ValueError(f"blockflow.Pool {self.name!r}: speed mapping is empty; give "
                                 f"task group -> speed, or one number.")
            object.__setattr__(self, "speed", pairs)
        elif self.speed is not None:
            object.__setattr__(self, "speed", _speed(self.name, self.speed))
        object.__setattr__(self, "provider", str(self.provider or "local"))
        object.__setattr__(self, "region", str(self.region or ""))

    def speed_of(self, group: str | None = None) -> float | None:
        """The speed prior of ``group``'s tasks here: its own, else the pool's (the median of
        a per-group mapping); None when the pool declares none."""
        if not isinstance(self.speed, tuple):
            return self.speed
        pairs = dict(self.speed)
        if group in pairs:
            return pairs[group]
        return median(pairs.values())

    @property
    def resource(self) -> str:
        """The worker resource this pool's workers declare: ``"pool:<name>"``."""
        return POOL_RESOURCE_PREFIX + self.name

    @property
    def price_per_second(self) -> float:
        """Dollars per worker-second (0 when the price is unknown)."""
        return (self.price or 0.0) / 3600.0

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the worker metric, JSON)."""
        d = asdict(self)
        if isinstance(self.speed, tuple):
            d["speed"] = dict(self.speed)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Pool:
        """The pool a :meth:`to_dict` dict describes (unknown keys ignored).

        Raises
        ------
        ValueError
            If the dict describes no valid pool.
        """
        fields = ("name", "provider", "region", "price", "egress", "speed", "min_billed")
        return cls(**{k: d[k] for k in fields if k in d
                      and not (k in ("egress", "min_billed") and d[k] is None)})


_UNITS = {"price": "dollars per worker-hour", "egress": "dollars per GB sent to another "
          "provider", "min_billed": "seconds"}


def _speed(pool: str, value: Any, group: str | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        what = f"speed of group {group!r}" if group is not None else "speed"
        raise ValueError(f"blockflow.Pool {pool!r}: {what} must be a number > 0 (1.0 = the "
                         f"typical worker), got {value!r}.")
    return float(value)


#: The pool of workers that report none.
DEFAULT_POOL = Pool("default")


def pool_from_metric(value: Any) -> Pool | None:
    """The pool a :data:`POOL_METRIC` value describes; None if missing or malformed."""
    if not isinstance(value, Mapping):
        return None
    try:
        return Pool.from_dict(value)
    except (TypeError, ValueError):
        return None


def pools_of(workers: Mapping[str, Any]) -> dict[str, Pool]:
    """Address -> :class:`Pool` of each worker (a :class:`~blockflow._distributed.WorkerView` or
    scheduler info dict); :data:`DEFAULT_POOL` for those reporting none.
    """
    out = {}
    for addr, w in workers.items():
        if isinstance(w, Mapping):
            value = (w.get("metrics") or {}).get(POOL_METRIC)
        else:
            value = getattr(w, "pool", None)
        out[addr] = pool_from_metric(value) or DEFAULT_POOL
    return out


def requested_pools(resources: Mapping[str, Any] | None, workers: Any = None) -> set[str]:
    """Pool names a task's ``resources=`` (``{"pool:fast": 1}``) or ``workers=``
    (``"pool:fast"``) ask for."""
    names = {k[len(POOL_RESOURCE_PREFIX):] for k in (resources or {})
             if isinstance(k, str) and k.startswith(POOL_RESOURCE_PREFIX)}
    if isinstance(workers, str):
        workers = [workers]
    for w in workers or ():
        if isinstance(w, str) and w.startswith(POOL_RESOURCE_PREFIX):
            names.add(w[len(POOL_RESOURCE_PREFIX):])
    return names


async def heartbeat_now(dask_worker=None) -> None:
    """``client.run(heartbeat_now)``: heartbeat now, so the scheduler knows the pool at once."""
    await _distributed.worker_heartbeat(dask_worker)


class PoolMember(WorkerPlugin):
    """Worker plugin: each worker reports its pool and declares the pool's resource.

    Parameters
    ----------
    pools : Pool or mapping
        One :class:`Pool` for every worker, or worker name or address -> :class:`Pool`.
    default : Pool, optional
        For workers not named in ``pools``.

    Raises
    ------
    TypeError
        If a value is not a :class:`Pool`.
    """

    name = "blockflow-pool"
    idempotent = True

    def __init__(self, pools: Pool | Mapping[Any, Pool], default: Pool | None = None):
        if isinstance(pools, Pool):
            pools, default = {}, pools
        self.pools = {str(k): v for k, v in dict(pools).items()}
        for k, v in [*self.pools.items(), ("default", default)]:
            if v is not None and not isinstance(v, Pool):
                raise TypeError(f"blockflow: the pool for {k!r} must be a blockflow.Pool, "
                                f"got {type(v).__name__}.")
        self.default = default
        self.pool: Pool | None = None

    async def setup(self, worker) -> None:
        _distributed.check_worker(worker)
        pool = self.pools.get(str(worker.address), self.pools.get(str(worker.name),
                                                                  self.default))
        if pool is None:
            return
        self.pool = pool
        info = pool.to_dict()
        _distributed.set_worker_metric(worker, POOL_METRIC, lambda w: info)
        if pool.resource not in _distributed.worker_declared_resources(worker):
            await _distributed.declare_worker_resources(
                worker, {pool.resource: _POOL_RESOURCE_AMOUNT})

    def teardown(self, worker) -> None:
        _distributed.remove_worker_metric(worker, POOL_METRIC)
