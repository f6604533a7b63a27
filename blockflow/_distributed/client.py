"""The client side: distributed's client API where blockflow needs more than its public face.

:func:`data_holders` (``Client.who_has``, whose name is also a ``TaskState`` internal's) and
:class:`SchedulerProgress`, distributed's progress feed handed to a drawing callback (it
overrides ``ProgressBar``'s private drawing method, so it lives here).
"""

from __future__ import annotations

from collections.abc import Callable

from distributed.diagnostics.progressbar import ProgressBar

__all__ = ["SchedulerProgress", "call_scheduler_handler", "data_holders", "has_scheduler_plugin",
           "is_gc_diagnosis_callback", "start_spec_workers"]



def is_gc_diagnosis_callback(obj) -> bool:
    """Whether ``obj`` is distributed's garbage-collection timer callback
    (``distributed.gc.GCDiagnosis``, enabled in every process that runs a scheduler or a
    worker): an exception raised inside it, such as a Ctrl-C's KeyboardInterrupt arriving
    during a collection, is reported by Python as "Exception ignored in ..." with a
    traceback, and leaves the timer in a state its next call reports the same way."""
    from distributed.gc import GCDiagnosis

    return getattr(obj, "__func__", None) is GCDiagnosis._gc_callback


def start_spec_workers(cluster) -> None:
    """Start the workers of a ``distributed.deploy.SpecCluster`` (dask-jobqueue's clusters)
    whose specs were added to ``cluster.worker_spec``, and wait until each started or failed.

    ``SpecCluster.scale`` does the same in the background, where a worker that fails to
    start (a job the queue refuses) is only logged; here its exception is raised
    (``SpecCluster._correct_state``, internal, awaited as the cluster's constructor does).
    """
    correct_state = getattr(cluster, "_correct_state", None)
    if not callable(correct_state):
        from blockflow._distributed.checks import _fail

        _fail("SpecCluster._correct_state (starting a cluster's new workers)")
    try:
        cluster.sync(correct_state)
    except Exception:
        from distributed.core import Status

        # a worker whose start raised (its job refused) stays "created", and SpecCluster's
        # close asserts that every worker it created has closed or failed
        for w in list(cluster.workers.values()):
            if getattr(w, "status", None) == Status.created:
                w.status = Status.failed
        raise


def data_holders(client, futures) -> dict:
    """Key -> addresses of the workers holding it, for ``futures`` (``Client.who_has``: a
    public client call, here because its name is also a ``TaskState`` internal's)."""
    return {k: list(v) for k, v in client.who_has(list(futures)).items()}


class SchedulerProgress(ProgressBar):
    """distributed's progress feed (tasks still to run for some futures), for clusters
    without blockflow's plugin; hands each count to ``draw(done, total)``.

    Parameters
    ----------
    futures : list of distributed.Future
    client : distributed.Client
    draw : callable
        ``draw(done, total)``, called from the client's event loop on each update.
    interval : str, default "200ms"
        How often the scheduler sends counts.
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


async def call_scheduler_handler(comm, name: str, **kwargs):
    """Call the scheduler RPC handler ``name`` through ``comm`` (a cluster's
    ``scheduler_comm`` or a client's ``scheduler``) and return its answer."""
    return await getattr(comm, name)(**kwargs)
