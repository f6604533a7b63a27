"""Ready workloads that blockflow's CLI runs; each submodule's ``run(client, ...)`` returns a
result with the data, timings and per-worker task counts. Oracles:
:mod:`blockflow.workloads.reference`."""

__all__ = ["JobFailed", "dashboard_page"]


class JobFailed(RuntimeError):
    """A ready job ended with nothing to write (every tuning trial failed, ...)."""


def dashboard_page(link: str | None) -> str | None:
    """blockflow's dashboard page (``.../blockflow``) from a cluster's dashboard link
    (``client.dashboard_link``, ``.../status``): what the command line prints and the
    manifests record. Another link is returned as it is, None as None."""
    if link and link.endswith("/status"):
        return link[: -len("status")] + "blockflow"
    return link
