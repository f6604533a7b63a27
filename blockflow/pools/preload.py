"""Worker preload: ``dask worker SCHEDULER --preload blockflow.pools.preload --pool l4 --price 0.8``.

Puts a worker started elsewhere in a :class:`blockflow.Pool`
(:class:`blockflow.pools.pool.PoolMember`). Options: ``--pool`` (required), ``--provider``,
``--region``, ``--price`` (dollars per worker-hour), ``--egress`` (dollars per GB leaving the
provider), ``--speed`` (relative, 1.0 typical).
"""

from __future__ import annotations

import click

from blockflow.pools.pool import Pool, PoolMember


@click.command()
@click.option("--pool", "pool_name", required=True, help="The worker's pool (e.g. l4).")
@click.option("--provider", default="local", show_default=True,
              help="Who runs the machine (gcp, aws, onprem...).")
@click.option("--region", default="", help="The provider's region.")
@click.option("--price", type=float, default=None,
              help="Dollars per worker-hour (needed by a cost objective or a budget).")
@click.option("--egress", "--egress-price", "egress", type=float, default=0.0, show_default=True,
              help="Dollars per GB leaving the provider.")
@click.option("--speed", type=float, default=None,
              help="Relative speed hint (1.0 = the typical worker).")
async def dask_setup(worker, pool_name, provider, region, price, egress, speed):
    try:
        pool = Pool(pool_name, provider=provider, region=region, price=price, egress=egress,
                    speed=speed)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    await PoolMember(pool).setup(worker)
