"""Ready workloads that blockflow's CLI runs (array statistics, flights ETL, ...).

Each workload is a submodule with a ``run(client, *, size=..., output=..., ...)`` entry point
returning a result object with the computed data, timings and per-worker task counts. The
workloads share one runner (:mod:`blockflow.workloads._runner`: progress bars, task counts,
timing, atomic output); :mod:`blockflow.workloads.reference` holds their single-process test
oracles, which are not the distributed path. What a workload computes, apart from how
(:mod:`blockflow.workloads.field`, :mod:`blockflow.workloads.flights_data`), is shared by
both, so that neither imports the other.
"""

__all__ = ["JobFailed"]


class JobFailed(RuntimeError):
    """A ready job ended with nothing to write (every tuning trial failed, ...).

    The CLI ends such a job with its message as one ``Error: ...`` line, as it does every
    job's output, kernel and lost-worker errors.
    """
