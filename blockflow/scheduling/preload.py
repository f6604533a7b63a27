"""Preload module for ``dask scheduler --preload blockflow.scheduling.preload``.

Installs blockflow's plugin (policy: ``--blockflow-policy`` or ``blockflow.cluster.policy``)
and the extensions of ``blockflow.scheduler.extensions`` on a scheduler started outside
blockflow; its workers get blockflow's device metrics and, where they have CuPy and a GPU,
CuPy's memory pool enlarged up front (``blockflow.cluster.gpu-memory-pool`` "auto" or
"cupy"; :class:`blockflow.device_pool.CuPyPool`).
"""

from __future__ import annotations

import click
from dask.utils import parse_timedelta

from blockflow import _distributed, config
from blockflow.device_pool import CuPyPool, pool_settings
from blockflow.devices import DeviceMetrics
from blockflow.scheduling.extensions import scheduler_extensions
from blockflow.scheduling.plugin import Rebalancer


@click.command()
@click.option("--blockflow-policy", default=None,
              help="Scheduling policy: a built-in name or a dotted path (default: "
                   "blockflow.cluster.policy).")
async def dask_setup(scheduler, blockflow_policy=None):
    _distributed.add_scheduler_plugin(scheduler, Rebalancer(policy=blockflow_policy))
    for extension in scheduler_extensions():  # the dashboard page, by default
        _distributed.add_scheduler_plugin(scheduler, extension)
    # workers that join later get blockflow's device metrics and memory pool (nothing on
    # CPU workers)
    timeout = parse_timedelta(config.get("cluster.worker-call-timeout"))
    await _distributed.register_worker_plugin_on_scheduler(
        scheduler, DeviceMetrics(), DeviceMetrics.name, idempotent=True, timeout=timeout)
    if pool_settings()[0] in ("auto", "cupy"):  # "rmm": dask-cuda's --rmm-pool-size
        await _distributed.register_worker_plugin_on_scheduler(
            scheduler, CuPyPool(), CuPyPool.name, idempotent=True, timeout=timeout)
