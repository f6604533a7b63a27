"""Client-side reads of the scheduler that need a function run on it (the client's view)."""

from __future__ import annotations

__all__ = ["has_scheduler_plugin"]


def _has_plugin(name: str, dask_scheduler=None) -> bool:
    from blockflow._distributed import scheduler_plugin

    return scheduler_plugin(dask_scheduler, name) is not None


def has_scheduler_plugin(client, name: str) -> bool:
    """Whether the scheduler ``client`` talks to has a plugin registered under ``name``.

    Parameters
    ----------
    client : distributed.Client
    name : str

    Returns
    -------
    bool
    """
    return bool(client.run_on_scheduler(_has_plugin, name))
