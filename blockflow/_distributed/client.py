"""The client side: distributed's client API where blockflow needs more than its public face."""

from __future__ import annotations

from collections.abc import Callable

from distributed.diagnostics.progressbar import ProgressBar
from distributed.utils import is_kernel

__all__ = ["SchedulerProgress", "add_worker_plugin_each", "call_scheduler_handler",
           "data_holders", "has_scheduler_plugin", "in_notebook_kernel",
           "remove_worker_plugin_each"]


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


async def _add_on_scheduler(plugin: bytes, name: str, idempotent: bool, timeout: float,
                            dask_scheduler=None):
    from blockflow._distributed.actions import add_worker_plugin

    return await add_worker_plugin(dask_scheduler, plugin, name, idempotent, timeout)


async def _remove_on_scheduler(name: str, timeout: float, dask_scheduler=None):
    from blockflow._distributed.actions import remove_worker_plugin

    if name not in dask_scheduler.worker_plugins:
        return None
    return await remove_worker_plugin(dask_scheduler, name, timeout)


def _raise_setup_error(errors: dict) -> None:
    """Raise the first worker's error as ``Client.register_plugin`` does."""
    from distributed.core import clean_exception

    for reply in errors.values():
        exception, traceback = (_opened(reply.get(k)) for k in ("exception", "traceback"))
        _, exc, tb = clean_exception(exception, traceback)
        raise exc.with_traceback(tb)


def _opened(value):
    """A worker's reply field as it reaches the client through the scheduler still wrapped
    (``Serialize`` in-process, ``Serialized`` from another process, of the pickled
    exception or traceback), which ``clean_exception`` does not open: the bytes inside."""
    from distributed.protocol.serialize import Serialize, Serialized, deserialize

    if isinstance(value, Serialized):
        return deserialize(value.header, value.frames)
    if isinstance(value, Serialize):
        return value.data
    return value


def add_worker_plugin_each(client, plugin, timeout: float) -> dict[str, str]:
    """``client.register_plugin(plugin)`` for a worker plugin, each running worker bounded by
    ``timeout`` seconds on the scheduler's side (``actions.add_worker_plugin``).

    Returns
    -------
    dict
        Address -> why, for the workers that did not answer (still listed by the scheduler).

    Raises
    ------
    Exception
        A worker's error from the plugin's ``setup``, as ``Client.register_plugin`` raises it.
    """
    from distributed.diagnostics.plugin import _get_plugin_name
    from distributed.protocol.pickle import dumps

    name = _get_plugin_name(plugin)
    try:
        errors, failed = client.run_on_scheduler(
            _add_on_scheduler, dumps(plugin), name, bool(getattr(plugin, "idempotent", False)),
            float(timeout))
    except ImportError:  # a scheduler without blockflow: distributed's own registration
        client.register_plugin(plugin)
        return {}
    _raise_setup_error(errors)
    return failed


def remove_worker_plugin_each(client, name: str, timeout: float) -> dict[str, str]:
    """``client.unregister_worker_plugin(name)``, each worker bounded by ``timeout`` seconds;
    nothing when no such plugin is registered. Returns as :func:`add_worker_plugin_each`."""
    try:
        got = client.run_on_scheduler(_remove_on_scheduler, name, float(timeout))
    except ImportError:  # a scheduler without blockflow
        client.unregister_worker_plugin(name)
        return {}
    if got is None:
        return {}
    errors, failed = got
    _raise_setup_error(errors)
    return failed
