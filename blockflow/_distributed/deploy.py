"""A ``SpecCluster``'s private hooks (``_correct_state``, ``Cluster._adaptive``) as functions."""

from __future__ import annotations

from collections.abc import Callable

from distributed.core import Status
from distributed.utils import NoOpAwaitable

from blockflow._distributed.checks import _fail

__all__ = ["correct_state_soon", "replace_adaptive", "start_spec_workers"]


def correct_state_soon(cluster):
    """Reconcile ``cluster``'s workers with its ``worker_spec``, as ``SpecCluster.scale`` does."""
    cluster.loop.add_callback(cluster._correct_state)
    return NoOpAwaitable() if cluster.asynchronous else None


def replace_adaptive(cluster, make: Callable[[], object]):
    """Stop ``cluster``'s running adaptive, install ``make()`` in its place and return it."""
    old = getattr(cluster, "_adaptive", None)
    if old is not None:
        old.stop(reason="adapt-called")
    cluster._adaptive = make()
    return cluster._adaptive


def start_spec_workers(cluster) -> None:
    """Start the workers newly added to ``cluster.worker_spec`` and wait for each.

    Raises
    ------
    Exception
        The first start failure (``SpecCluster.scale`` only logs it).
    IncompatibleSchedulerError
        If ``SpecCluster._correct_state`` is gone.
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
