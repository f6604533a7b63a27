"""The client side: distributed's client API where blockflow needs more than its public face."""

from __future__ import annotations

from collections.abc import Callable

from distributed.diagnostics.progressbar import ProgressBar
from distributed.utils import is_kernel

__all__ = ["SchedulerProgress", "call_scheduler_handler", "data_holders", "has_scheduler_plugin",
           "in_notebook_kernel"]


def in_notebook_kernel() -> bool:
    """Whether this process runs inside a Jupyter/IPython kernel (``distributed.utils.is_kernel``)."""
    return is_kernel()


def data_holders(client, futures) -> dict:
    """Key -> addresses of the workers holding it, for ``futures`` (``Client.who_has``: a
    public client call, here because its name is also a ``TaskState`` internal's)."""
    return {k: list(v) for k, v in client.who_has(list(futures)).items()}


class SchedulerProgress(ProgressBar):
    """distributed's progress feed for clusters without blockflow's plugin.

    Parameters
    ----------
    futures : list of distributed.Future
    client : distributed.Client
    draw : callable
        ``draw(done, total)``, called from the client's event loop.
    interval : str, default "200ms"
    """

    def __init__(self, futures, client, draw: Callable[[int, int], None],
                 interval: str = "200ms"):
        super().__init__(futures, scheduler=client.scheduler.address, interval=interval,
                         complete=False)
        self._blockflow_draw = draw

    def _draw_bar(self, remaining, all, **kwargs) -> None:  # distributed's drawing hook
        self._blockflow_draw(all - remaining, all)


def _has_plugin(name: str, dask_scheduler=None) -> bool:
    from blockflow._distributed import scheduler_plugin

    return scheduler_plugin(dask_scheduler, name) is not None


def has_scheduler_plugin(client, name: str) -> bool:
    """Whether the scheduler ``client`` talks to has a plugin registered under ``name``."""
    return bool(client.run_on_scheduler(_has_plugin, name))


async def call_scheduler_handler(comm, name: str, **kwargs):
    """Call the scheduler RPC handler ``name`` through ``comm`` and return its answer."""
    return await getattr(comm, name)(**kwargs)
