"""Preload module for ``dask scheduler --preload blockflow.scheduling.preload``.

Installs blockflow's plugin (policy: ``--blockflow-policy`` or ``blockflow.cluster.policy``)
and the extensions of ``blockflow.scheduler.extensions`` on a scheduler started outside
blockflow.
"""

from __future__ import annotations

import click
from dask.utils import parse_timedelta

from blockflow import _distributed, config
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
    # workers that join later get blockflow's device metrics (nothing on CPU workers)
    await _distributed.register_worker_plugin_on_scheduler(
        scheduler, DeviceMetrics(), DeviceMetrics.name, idempotent=True,
        timeout=parse_timedelta(config.get("cluster.worker-call-timeout")))
