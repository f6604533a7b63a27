"""``blockflow.PoolCluster``: one scheduler over several pools of workers.

A :class:`distributed.SpecCluster` with one worker spec per pool; workers are local
processes or dask-jobqueue jobs (one template per pool, dask-jobqueue#381). Guide:
:doc:`/guide/pools`.
"""
from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import dask.config
from dask.utils import parse_timedelta
from distributed import Nanny, Scheduler, SpecCluster, Worker

from blockflow._distributed import correct_state_soon, replace_adaptive
from blockflow.cluster.hpc import jobqueue_defaults
from blockflow.pools.adaptive import PoolAdaptive
from blockflow.pools.pool import _POOL_RESOURCE_AMOUNT, Pool

__all__ = ["PoolCluster", "pools_from_settings"]

logger = logging.getLogger(__name__)

#: The keys of an entry of the ``blockflow.pools`` setting.
SETTING_KEYS = ("name", "provider", "region", "price", "egress", "speed", "min-billed",
                "workers")


def pools_from_settings(entries: Sequence[Mapping[str, Any]] | None = None
                        ) -> dict[Pool, int]:
    """The pools of the ``blockflow.pools`` setting, each with its number of workers.

    Parameters
    ----------
    entries : sequence of mapping, optional
        Default the setting (``dask.config``): one mapping per pool with ``name``,
        ``workers`` (>= 1) and optionally ``provider``, ``region``, ``price`` (dollars per
        worker-hour), ``egress`` (dollars per GB leaving the provider), ``speed`` (a number,
        or task group -> number) and ``min-billed`` (a duration: least billed per worker).

    Returns
    -------
    dict of Pool to int
        In the setting's order; empty when no pools are set.

    Raises
    ------
    ValueError
        One line naming the pool and the field: a missing name or worker count, an unknown
        key, a value :class:`~blockflow.pools.pool.Pool` refuses, two pools of one name, or
        a field (``min-billed``, a per-group ``speed``) this version of ``Pool`` lacks.
    """
    if entries is None:
        entries = dask.config.get("blockflow.pools", default=None) or []
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence):
        raise ValueError(f"The blockflow.pools setting must be a list of pools (mappings with "
                         f"name, workers, price, ...), got {entries!r}.")
    out: dict[Pool, int] = {}
    for i, raw in enumerate(entries):
        out_pool, n = _pool_from_setting(i, raw)
        if any(p.name == out_pool.name for p in out):
            raise ValueError(f"The blockflow.pools setting names pool {out_pool.name!r} twice "
                             f"(entry {i}); give each pool its own name.")
        out[out_pool] = n
    return out


def _pool_from_setting(i: int, raw: Any) -> tuple[Pool, int]:
    where = f"The blockflow.pools setting, entry {i}"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: a pool is a mapping (name: ..., workers: ..., price: ...), "
                         f"got {raw!r}.")
    entry = {str(k).replace("_", "-"): v for k, v in raw.items()}
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: the pool has no name; give it name: <letters, digits, "
                         f"'_', '.' or '-'>.")
    where = f"The blockflow.pools setting, pool {name!r}"
    unknown = sorted(set(entry) - set(SETTING_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; a pool has the fields "
                         f"{', '.join(SETTING_KEYS)}.")
    n = entry.get("workers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{where}: workers must be an integer >= 1 (the embedded cluster's "
                         f"workers in this pool), got {n!r}.")
    kwargs = {k: entry[k] for k in ("name", "provider", "region", "price", "egress", "speed")
              if entry.get(k) is not None}
    if entry.get("min-billed") is not None:
        try:
            seconds = parse_timedelta(entry["min-billed"])
        except (TypeError, ValueError, KeyError):
            seconds = None
        if seconds is None or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"{where}: min-billed must be a duration >= 0 ('60s' or "
                             f"seconds), got {entry['min-billed']!r}.")
        kwargs["min_billed"] = float(seconds)
    try:
        pool = Pool(**kwargs)
    except (TypeError, ValueError) as e:
        text = str(e).split(": ", 1)[-1]
        raise ValueError(f"{where}: {text.rstrip('.')}.") from None
    return pool, n


def pool_preload_argv(pool: Pool) -> list[str]:
    """The ``blockflow.pools.preload`` options describing ``pool``."""
    argv = ["--pool", pool.name, "--provider", pool.provider]
    if pool.region:
        argv += ["--region", pool.region]
    if pool.price is not None:
        argv += ["--price", repr(pool.price)]
    if pool.egress:
        argv += ["--egress", repr(pool.egress)]
    if isinstance(pool.speed, tuple):
        argv += ["--speed", ",".join(f"{g}={v!r}" for g, v in pool.speed)]
    elif pool.speed is not None:
        argv += ["--speed", repr(pool.speed)]
    if pool.min_billed:
        argv += ["--min-billed", repr(pool.min_billed)]
    return argv


def _job_class(job_cls):
    """A dask-jobqueue job class from the class or its short name (``"slurm"``)."""
    if not isinstance(job_cls, str):
        if getattr(job_cls, "__module__", "").startswith("dask_jobqueue"):
            jobqueue_defaults()
        return job_cls
    try:
        import dask_jobqueue  # noqa: F401
    except ImportError:
        raise ImportError(f"PoolCluster(job_cls={job_cls!r}) needs dask-jobqueue: "
                          "pip install dask-jobqueue") from None
    jobqueue_defaults()
    names = {"slurm": "SLURMJob", "pbs": "PBSJob", "sge": "SGEJob", "lsf": "LSFJob",
             "htcondor": "HTCondorJob", "oar": "OARJob", "moab": "MoabJob"}
    try:
        module = importlib.import_module(f"dask_jobqueue.{job_cls.lower()}")
        return getattr(module, names[job_cls.lower()])
    except (KeyError, ImportError):
        raise ValueError(f"PoolCluster: unknown job_cls {job_cls!r}; use one of "
                         f"{sorted(names)} or a dask-jobqueue Job class.") from None


class PoolCluster(SpecCluster):
    """A Dask cluster made of named pools of workers, under one scheduler.

    Worker ``i`` of pool ``p`` is named ``"p-i"`` and declares the resource ``pool:p``; the
    scheduler runs blockflow's plugin.

    Parameters
    ----------
    pools : mapping of Pool to int
        Each pool and its initial worker count.
    threads_per_worker : int, default 1
        Threads of each local worker (jobs: ``cores`` in ``jobs``).
    memory_limit : str or int, optional
        Host memory per local worker (distributed's default if None).
    processes : bool, default True
        Local workers as processes (``Nanny``) or threads (``Worker``).
    worker_options, jobs : mapping, optional
        Pool name -> extra keyword arguments of its worker or job class; with ``job_cls``,
        pool name -> job options (``queue``, ``cores``, ``memory``, ...).
    job_cls : type or str, optional
        A dask-jobqueue job class or its short name (``"slurm"``).
    scheduler_options : mapping, optional
    policy : str, optional
        Scheduling policy (default ``blockflow.cluster.policy``).
    **kwargs
        Passed to :class:`distributed.SpecCluster`.

    Raises
    ------
    TypeError, ValueError
        For keys that are not :class:`blockflow.Pool`, a negative count, duplicate names, or
        options naming unknown pools.
    ImportError
        If ``job_cls`` is a name and dask-jobqueue is missing.

    Examples
    --------
    >>> cluster = PoolCluster({Pool("fast", price=4): 2, Pool("slow", price=0.5): 4})
    >>> cluster.adapt(pools={"fast": (0, 2), "slow": (0, 8)})     # doctest: +SKIP

    On Slurm, one partition per pool::

        PoolCluster({Pool("gpu", price=2.5): 0, Pool("cpu", price=0.1): 0}, job_cls="slurm",
                    jobs={"gpu": {"queue": "gpu"}, "cpu": {"queue": "cpu"}})
    """

    def __init__(self, pools: Mapping[Pool, int], *, threads_per_worker: int = 1,
                 memory_limit: str | int | None = None, processes: bool = True,
                 worker_options: Mapping[str, Mapping[str, Any]] | None = None,
                 job_cls=None, jobs: Mapping[str, Mapping[str, Any]] | None = None,
                 scheduler_options: Mapping[str, Any] | None = None,
                 policy: str | None = None, **kwargs: Any):
        if not isinstance(pools, Mapping) or not pools:
            raise TypeError("PoolCluster: pools must be a non-empty mapping "
                            "{blockflow.Pool(...): n_workers, ...}.")
        self.pools: dict[str, Pool] = {}
        counts: dict[str, int] = {}
        for pool, n in pools.items():
            if not isinstance(pool, Pool):
                raise TypeError(f"PoolCluster: pools keys must be blockflow.Pool, got "
                                f"{type(pool).__name__} ({pool!r}).")
            if pool.name in self.pools:
                raise ValueError(f"PoolCluster: two pools are named {pool.name!r}; give each "
                                 f"pool its own name.")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"PoolCluster: pool {pool.name!r} needs a worker count >= 0, "
                                 f"got {n!r}.")
            self.pools[pool.name] = pool
            counts[pool.name] = n
        for what, opts in (("worker_options", worker_options), ("jobs", jobs)):
            unknown = sorted(set(opts or ()) - set(self.pools))
            if unknown:
                raise ValueError(f"PoolCluster: {what} names unknown pools {unknown}; the "
                                 f"pools are {sorted(self.pools)}.")
        if jobs and job_cls is None:
            raise ValueError("PoolCluster: jobs= needs job_cls= (e.g. job_cls='slurm').")
        self.job_cls = _job_class(job_cls) if job_cls is not None else None
        self._jobs = {k: dict(v) for k, v in (jobs or {}).items()}
        self._worker_options = {k: dict(v) for k, v in (worker_options or {}).items()}
        self._threads = int(threads_per_worker)
        self._memory_limit = memory_limit
        self._processes = bool(processes)
        kwargs.setdefault("silence_logs", logging.ERROR)
        self._silence_logs = kwargs["silence_logs"]
        self._counters: dict[str, int] = {name: 0 for name in self.pools}
        argv = ["--blockflow-policy", policy] if policy else []
        sched = {"dashboard_address": ":0", "preload": ["blockflow.scheduling.preload"],
                 "preload_argv": [argv], **dict(scheduler_options or {})}
        if self.job_cls is None:
            sched.setdefault("host", "127.0.0.1")
        specs = {}
        for name, n in counts.items():
            for _ in range(n):
                specs.update(self.new_pool_worker_spec(name))
        super().__init__(workers=specs, scheduler={"cls": Scheduler, "options": sched},
                         worker=None, **kwargs)

    # --- worker specs, one kind per pool ------------------------------------------------

    def pool_worker_spec(self, pool_name: str) -> dict[str, Any]:
        """The spec (``{"cls", "options", "pool"}``) of one new worker of ``pool_name``.

        Raises
        ------
        ValueError
            If ``pool_name`` names no pool.
        """
        pool = self._pool(pool_name)
        argv = pool_preload_argv(pool)
        if self.job_cls is not None:
            opts = {"cores": self._threads, "memory": "2GiB", "processes": 1,
                    **self._jobs.get(pool.name, {}), **self._worker_options.get(pool.name, {})}
            extra = list(opts.pop("worker_extra_args", None) or [])
            resources = f"{pool.resource}={_POOL_RESOURCE_AMOUNT:g}"
            opts["worker_extra_args"] = extra + ["--resources", resources,
                                                 "--preload", "blockflow.pools.preload", *argv]
            opts.setdefault("job_name", f"blockflow-{pool.name}")
            return {"cls": self.job_cls, "options": opts, "pool": pool.name}
        extra = dict(self._worker_options.get(pool.name, {}))
        resources = {**dict(extra.pop("resources", None) or {}),
                     pool.resource: _POOL_RESOURCE_AMOUNT}
        opts = {"nthreads": self._threads, "resources": resources,
                "preload": ["blockflow.pools.preload"], "preload_argv": [argv],
                "host": "127.0.0.1", "dashboard": False,
                "silence_logs": self._silence_logs, **extra}
        if self._memory_limit is not None:
            opts["memory_limit"] = self._memory_limit
        return {"cls": Nanny if self._processes else Worker, "options": opts,
                "pool": pool.name}

    def new_pool_worker_spec(self, pool_name: str) -> dict[str, dict[str, Any]]:
        """``{name: spec}`` of the next worker of ``pool_name`` (named ``"<pool>-<i>"``)."""
        while True:
            name = f"{pool_name}-{self._counters[pool_name]}"
            self._counters[pool_name] += 1
            if name not in getattr(self, "worker_spec", {}):
                return {name: self.pool_worker_spec(pool_name)}

    def _pool(self, pool_name: str) -> Pool:
        try:
            return self.pools[pool_name]
        except KeyError:
            raise ValueError(f"PoolCluster: no pool named {pool_name!r}; the pools are "
                             f"{sorted(self.pools)}.") from None

    def workers_of(self, pool_name: str) -> list[str]:
        """Names of the workers this cluster plans for ``pool_name``."""
        self._pool(pool_name)
        return [n for n, s in self.worker_spec.items() if s.get("pool") == pool_name]

    @property
    def pool_sizes(self) -> dict[str, int]:
        """Pool name -> workers planned now (launched or not)."""
        return {p: len(self.workers_of(p)) for p in self.pools}

    # --- scaling ------------------------------------------------------------------------

    def scale(self, n: int | Mapping[str, int] = 0, memory=None, cores=None, *,
              pool: str | None = None):
        """Scale one pool to ``n`` workers (``pool=``), or several (``n={"fast": 2, ...}``).

        A pool shrinks by its unlaunched workers first, then its newest. An int ``n`` without
        ``pool`` is spread over the pools in proportion to their sizes.

        Raises
        ------
        ValueError
            If ``pool`` names no pool, a count is negative, or ``memory``/``cores`` are given.
        """
        if isinstance(n, Mapping):
            targets = {p: int(k) for p, k in n.items()}
        elif pool is not None:
            targets = {pool: int(n)}
        else:
            if memory is not None or cores is not None:
                raise ValueError("PoolCluster.scale: memory= and cores= are not supported; "
                                 "give workers per pool: scale({'fast': 2, 'slow': 4}).")
            targets = self._spread(int(n))
        for p, k in targets.items():
            self._pool(p)
            if k < 0:
                raise ValueError(f"PoolCluster.scale: pool {p!r} needs a count >= 0, got {k}.")
        for p, k in targets.items():
            names = self.workers_of(p)
            if len(names) > k:
                launched = set(self.workers)
                # not-yet-launched first, then the newest
                order = sorted(names, key=lambda w: (w in launched, -_index(w)))
                for w in order[: len(names) - k]:
                    del self.worker_spec[w]
            elif self.status.name not in ("closing", "closed"):
                for _ in range(k - len(names)):
                    self.worker_spec.update(self.new_pool_worker_spec(p))
        return correct_state_soon(self)

    def _spread(self, n: int) -> dict[str, int]:
        sizes = self.pool_sizes
        total = sum(sizes.values())
        if total == 0:
            weights = {p: 1 for p in sizes}
            total = len(sizes)
        else:
            weights = sizes
        out = {p: math.floor(n * w / total) for p, w in weights.items()}
        for p in sorted(weights, key=lambda p: -weights[p])[: n - sum(out.values())]:
            out[p] += 1
        return out

    def adapt(self, *, pools: Mapping[str, tuple[int, int]] | None = None,
              Adaptive=None, **kwargs: Any):
        """Size every pool from the backlog, the throughput matrix and the prices.

        Parameters
        ----------
        pools : mapping, optional
            Pool name -> ``(minimum, maximum)`` workers.
        Adaptive : type, default :class:`blockflow.pools.adaptive.PoolAdaptive`
        **kwargs
            ``interval``, ``wait_count``, ``target_duration``, ``minimum``, ``maximum``,
            ``startup``, ``hold`` (:class:`~blockflow.pools.adaptive.PoolAdaptive`).

        Returns
        -------
        PoolAdaptive
        """
        cls = Adaptive or PoolAdaptive
        return replace_adaptive(self, lambda: cls(self, pools=pools, **kwargs))


def _index(name) -> int:
    try:
        return int(str(name).rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1
