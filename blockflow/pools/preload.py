"""Worker preload: ``dask worker SCHEDULER --preload blockflow.pools.preload --pool l4 --price 0.8``.

Puts a worker started elsewhere in a :class:`blockflow.Pool`
(:class:`blockflow.pools.pool.PoolMember`). Options: ``--pool`` (required), ``--provider``,
``--region``, ``--price`` (dollars per worker-hour), ``--egress`` (dollars per GB sent to
another provider), ``--speed`` (relative, 1.0 typical; or per task group,
``etl=1.5,train=3``), ``--min-billed`` (seconds, the least a worker is billed).
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
@click.option("--speed", default=None,
              help="Relative speed prior (1.0 = the typical worker), or one per task group: "
                   "etl=1.5,train=3.")
@click.option("--min-billed", "min_billed", type=float, default=0.0, show_default=True,
              help="Seconds: the least a worker is billed for, from its arrival.")
async def dask_setup(worker, pool_name, provider, region, price, egress, speed, min_billed):
    try:
        pool = Pool(pool_name, provider=provider, region=region, price=price, egress=egress,
                    speed=_speed(speed), min_billed=min_billed)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    await PoolMember(pool).setup(worker)


def _speed(text: str | None) -> float | dict[str, float] | None:
    """``--speed``: a number, or ``group=speed`` pairs separated by commas."""
    if text is None:
        return None
    try:
        if "=" not in text:
            return float(text)
        return {g.strip(): float(v) for g, v in (p.split("=", 1) for p in text.split(","))}
    except ValueError:
        raise click.BadParameter(f"--speed must be a number (1.5) or task group=speed pairs "
                                 f"(etl=1.5,train=3), got {text!r}.") from None
