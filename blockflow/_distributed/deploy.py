"""A ``SpecCluster``'s private hooks: starting workers, reconciling the spec, the adaptive slot.

``SpecCluster._correct_state`` (start and stop workers until they match ``worker_spec``) and
``Cluster._adaptive`` (the one running ``Adaptive``) are internal to distributed;
:class:`blockflow.PoolCluster` and the HPC helpers drive them only through these functions.
"""

from __future__ import annotations

from collections.abc import Callable

from distributed.core import Status
from distributed.utils import NoOpAwaitable

from blockflow._distributed.checks import _fail

__all__ = ["correct_state_soon", "replace_adaptive", "start_spec_workers"]


def correct_state_soon(cluster):
    """Reconcile ``cluster``'s workers with its ``worker_spec`` on its event loop, as
    ``SpecCluster.scale`` does; an awaitable that does nothing when ``cluster`` is asynchronous,
    else None."""
    cluster.loop.add_callback(cluster._correct_state)
    return NoOpAwaitable() if cluster.asynchronous else None


def replace_adaptive(cluster, make: Callable[[], object]):
    """Stop ``cluster``'s running adaptive (``Cluster._adaptive``), install ``make()`` in its
    place and return it, as ``Cluster.adapt`` does."""
    old = getattr(cluster, "_adaptive", None)
    if old is not None:
        old.stop(reason="adapt-called")
    cluster._adaptive = make()
    return cluster._adaptive


def start_spec_workers(cluster) -> None:
    """Start the workers whose specs were added to ``cluster.worker_spec`` (a ``SpecCluster``,
    such as dask-jobqueue's) and wait until each started or failed.

    Raises
    ------
    Exception
        The first worker's start failure (a job the queue refused); ``SpecCluster.scale``
        only logs it.
    IncompatibleSchedulerError
        If distributed no longer has ``SpecCluster._correct_state``.
    """
    correct_state = getattr(cluster, "_correct_state", None)
    if not callable(correct_state):
        _fail("SpecCluster._correct_state (starting a cluster's new workers)")
    try:
        cluster.sync(correct_state)
    except Exception:
        # a worker whose start raised stays "created", and SpecCluster's close asserts that
        # every worker it created has closed or failed
        for w in list(cluster.workers.values()):
            if getattr(w, "status", None) == Status.created:
                w.status = Status.failed
        raise
