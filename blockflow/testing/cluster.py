"""Clusters of simulated GPU workers: start one, or give an existing one simulated devices. Both
return once every equipped worker's GPU metrics reached the scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Iterator, Mapping, Sequence

import dask.config
from dask.utils import parse_timedelta
from distributed import Client, LocalCluster

from blockflow import _distributed
from blockflow._distributed.metrics import (
    GPU_MEMORY_TOTAL,
    GPU_MEMORY_USED,
    GPU_UTILIZATION,
    POOL_METRIC,
)
from blockflow.cluster.connection import _pool_members
from blockflow.scheduling.view import workers_info
from blockflow.testing.simulated import PLUGIN_NAME, SimulatedGPU
from blockflow.testing.simulated_device import SimulatedDevice

__all__ = ["install_simulated_devices", "simulated_cluster"]

_METRIC_KEYS = (GPU_UTILIZATION, GPU_MEMORY_USED, GPU_MEMORY_TOTAL)


def _has_metrics(metrics: Mapping | None) -> bool:
    return isinstance(metrics, Mapping) and all(k in metrics for k in _METRIC_KEYS)


def _expected(plugin: SimulatedGPU, workers: Mapping[str, Any]) -> list[str]:
    """Addresses of the workers that get a device (``workers``: address -> name)."""
    return [a for a, name in workers.items()
            if plugin.default is not None or a in plugin.devices or str(name) in plugin.devices]


async def _heartbeat(dask_worker) -> None:
    await _distributed.worker_heartbeat(dask_worker)


async def install_simulated_devices(client_or_scheduler, devices, *, default=None,
                                    timeout: float | str = "10s") -> SimulatedGPU:
    """Register simulated devices and wait until the scheduler sees their metrics (async).

    For ``gen_cluster`` tests::

        await install_simulated_devices(c, {a.address: SimulatedDevice(speed=0.5)})

    Parameters
    ----------
    client_or_scheduler : distributed.Client (asynchronous) or distributed.Scheduler
    devices : SimulatedDevice or mapping
        Worker address or name -> :class:`SimulatedDevice`.
    default : SimulatedDevice, optional
        For workers not in ``devices``.
    timeout : float or str, default "10s"

    Returns
    -------
    SimulatedGPU

    Raises
    ------
    TimeoutError
        If some worker's metrics have not arrived within ``timeout``.
    """
    plugin = SimulatedGPU(devices, default=default)
    deadline = time.monotonic() + parse_timedelta(timeout)
    if isinstance(client_or_scheduler, Client):
        client = client_or_scheduler
        await client.register_plugin(plugin)
        await client.run(_heartbeat)

        async def workers():
            info = await client.scheduler.identity(n_workers=-1)
            return {a: (w.get("name"), w.get("metrics")) for a, w in info["workers"].items()}
    else:
        scheduler = client_or_scheduler
        await _distributed.register_worker_plugin_on_scheduler(
            scheduler, plugin, PLUGIN_NAME, idempotent=plugin.idempotent)

        async def workers():
            return _distributed.worker_names_and_metrics(scheduler)

    while True:
        seen = await workers()
        missing = [a for a in _expected(plugin, {a: n for a, (n, _) in seen.items()})
                   if not _has_metrics(seen[a][1])]
        if not missing:
            return plugin
        if time.monotonic() > deadline:
            raise TimeoutError(f"Simulated GPU metrics of workers {missing} did not reach the "
                               f"scheduler within {parse_timedelta(timeout):g} s.")
        await asyncio.sleep(0.05)


def _per_worker(value, n: int, what: str) -> list:
    """``value`` for each of ``n`` workers: a list of n, a dict {index: value}, or one value
    (strings, numbers, a Tenant, None) for all."""
    if isinstance(value, Mapping):
        bad = [k for k in value if not (isinstance(k, int) and 0 <= k < n)]
        if bad:
            raise ValueError(f"simulated_cluster: {what} keys must be worker indices 0..{n - 1}, "
                             f"got {bad}.")
        return [value.get(i) for i in range(n)]
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"simulated_cluster: {what} has {len(value)} entries for "
                             f"{n} workers (one per speed).")
        return list(value)
    return [value] * n


@contextlib.contextmanager
def simulated_cluster(speeds: Sequence[float] = (1, 1, 0.5, 0.25),
                      device_memory: int | str | Sequence[int | str] = "16GiB",
                      tenants=None, *, speed_schedules=None, threads_per_worker: int = 1,
                      processes: bool = True, host_spill: bool = False,
                      timeout: float | str = "30s", pools=None, **cluster_kwargs) -> Iterator:
    """Start a real ``LocalCluster`` of simulated GPU workers (no blockflow plugin) and yield a
    client to it.

    Parameters
    ----------
    speeds : sequence of float, default (1, 1, 0.5, 0.25)
        One speed per worker (worker ``i`` is named ``i``).
    device_memory : int, str or sequence, default "16GiB"
        Bytes, one for all or one per worker.
    tenants : Tenant, list or dict, optional
        One :class:`Tenant` for all, or per worker (list or ``{index: tenant}``).
    speed_schedules : list or dict, optional
        Per worker, ``(seconds, speed)`` pairs (:class:`SimulatedDevice`).
    threads_per_worker : int, default 1
    processes : bool, default True
    host_spill : bool, default False
    timeout : float or str, default "30s"
    pools : mapping of blockflow.Pool to int, optional
        Workers in pools at each pool's ``speed`` (per task group where it maps groups to
        speeds); replaces ``speeds``.
    **cluster_kwargs
        Passed to ``distributed.LocalCluster``.

    Yields
    ------
    distributed.Client
        Closed with its cluster on exit.

    Raises
    ------
    ValueError
        For an empty ``speeds``, a speed <= 0, or per-worker lists of the wrong length.
    TimeoutError
        If the metrics do not arrive within ``timeout``.
    """
    member = None
    if pools is not None:
        member, n = _pool_members(pools, None, None)
        speeds = [member.pools[str(i)].speed_of() or 1.0 for i in range(n)]
    n = len(speeds)
    if n == 0:
        raise ValueError("simulated_cluster: speeds is empty; give one speed per worker.")
    per_worker = zip(speeds, _per_worker(device_memory, n, "device_memory"),
                     _per_worker(tenants, n, "tenants"),
                     _per_worker(speed_schedules, n, "speed_schedules"))
    group_speeds = ({i: dict(member.pools[str(i)].speed) for i in range(n)
                     if isinstance(member.pools[str(i)].speed, tuple)} if member else {})
    plugin = SimulatedGPU({
        i: SimulatedDevice(speed=s, device_memory=m, tenant=t, speed_schedule=sch,
                           group_speeds=group_speeds.get(i))
        for i, (s, m, t, sch) in enumerate(per_worker)
    })
    cluster_kwargs.setdefault("dashboard_address", ":0")
    spill = {} if host_spill else {"distributed.worker.memory.target": False,
                                    "distributed.worker.memory.spill": False}
    with dask.config.set(spill):
        cluster = LocalCluster(n_workers=n, threads_per_worker=threads_per_worker,
                               processes=processes, **cluster_kwargs)
    with cluster, Client(cluster) as client:
        client.register_plugin(plugin)
        if member is not None:
            client.register_plugin(member)
        client.run(_heartbeat)
        deadline = time.monotonic() + parse_timedelta(timeout)
        while True:
            workers = workers_info(client)
            missing = [a for a, w in workers.items() if not _has_metrics(w.get("metrics"))
                       or (member is not None and POOL_METRIC not in w.get("metrics", {}))]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"Simulated GPU metrics of workers {missing} did not reach "
                                   f"the scheduler within {parse_timedelta(timeout):g} s.")
            time.sleep(0.05)
        yield client
