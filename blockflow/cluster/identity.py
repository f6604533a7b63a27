"""Client-side reads of the scheduler's identity that cannot come back empty.

``distributed.Client.scheduler_info()`` stores the scheduler's reply on the client and
returns the stored copy; the client's own periodic refresh (every
``distributed.client.scheduler-info-interval``) stores a reply *without* workers. When that
refresh lands between a ``scheduler_info(n_workers=-1)`` call and its return, the caller sees
``{"workers": {}}``: no workers on a running cluster (seen here under load). blockflow asks
the scheduler directly and uses the reply it got, never the shared copy.
"""

from __future__ import annotations

from typing import Any

__all__ = ["scheduler_identity", "workers_info"]


def scheduler_identity(client) -> dict[str, Any]:
    """The scheduler's identity with every worker, as ``Client.scheduler_info(-1)`` gives it.

    Parameters
    ----------
    client : distributed.Client
        A synchronous client (in a worker thread, ``get_client()`` is one).

    Returns
    -------
    dict
        ``id``, ``address``, ``workers`` (address -> info dict with ``name``, ``nthreads``,
        ``memory_limit`` (bytes), ``metrics``, ``resources``, ...), and the scheduler's
        other identity fields.
    """
    return dict(client.sync(client.scheduler.identity, n_workers=-1))


def workers_info(client) -> dict[str, dict[str, Any]]:
    """Worker address -> the scheduler's info on that worker (see :func:`scheduler_identity`)."""
    return dict(scheduler_identity(client).get("workers") or {})
