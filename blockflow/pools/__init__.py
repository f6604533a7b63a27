"""Pools: named groups of workers with a provider and a price, and the plans made over them.

* :mod:`blockflow.pools.pool` — :class:`~blockflow.pools.pool.Pool` and the worker plugin that
  puts a worker in one;
* :mod:`blockflow.pools.preload` — ``dask worker --preload blockflow.pools.preload --pool l4``;
* :mod:`blockflow.pools.objective` — cost by a deadline, makespan within a budget;
* :mod:`blockflow.pools.plan` — the throughput matrix, the LP plan and run costs;
* :mod:`blockflow.pools.objective_rule` — the scheduler rule that parks pools for an objective;
* :mod:`blockflow.pools.scaling` — per-pool worker targets for elastic scaling;
* :mod:`blockflow.pools.cluster`, :mod:`blockflow.pools.adaptive` — a ``SpecCluster`` of
  pools and its adaptive scaling.

The public names are re-exported from :mod:`blockflow`.
"""
