"""Preload module for ``dask scheduler --preload blockflow.scheduling.preload``.

Installs blockflow's scheduler plugin on a scheduler started outside blockflow (a real
cluster: ``dask scheduler``, dask-jobqueue, dask-kubernetes). The policy comes from
``blockflow.cluster.policy`` (``DASK_BLOCKFLOW__CLUSTER__POLICY``) or ``--blockflow-policy``.
"""

from __future__ import annotations

import click

from blockflow.scheduling.plugin import POLICIES, Rebalancer


@click.command()
@click.option("--blockflow-policy", type=click.Choice(POLICIES), default=None,
              help="Scheduling policy (default: blockflow.cluster.policy).")
async def dask_setup(scheduler, blockflow_policy=None):
    from distributed.protocol.pickle import dumps

    from blockflow.dashboard.plugin import DashboardPlugin
    from blockflow.devices import DeviceMetrics

    scheduler.add_plugin(Rebalancer(policy=blockflow_policy))
    scheduler.add_plugin(DashboardPlugin())
    # workers that join later get blockflow's device metrics (nothing on CPU workers)
    await scheduler.register_worker_plugin(None, dumps(DeviceMetrics()), DeviceMetrics.name,
                                           idempotent=True)
