"""Ready workloads that blockflow's CLI runs; each submodule's ``run(client, ...)`` returns a
result with the data, timings and per-worker task counts. Oracles:
:mod:`blockflow.workloads.reference`."""

__all__ = ["JobFailed"]


class JobFailed(RuntimeError):
    """A ready job ended with nothing to write (every tuning trial failed, ...)."""
