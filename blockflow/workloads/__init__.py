"""Ready workloads that blockflow's CLI runs (array statistics, flights ETL, ...).

Each workload is a submodule with a ``run(client, *, size=..., output=..., ...)`` entry point
returning a result object with the computed data, timings and per-worker task counts.
"""
