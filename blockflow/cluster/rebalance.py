"""Evening out device memory on request (:func:`rebalance`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dask.utils import parse_bytes
from distributed import futures_of

from blockflow import _distributed
from blockflow.scheduling.device_memory import DeviceMemoryAMMPolicy

__all__ = ["rebalance"]


def rebalance(client, futures=None, *, workers: Iterable[str] | None = None,
              tolerance: int | str | None = None, cycles: int = 10,
              timeout: float = 30.0):
    """Move results held on devices until each device worker holds its capacity-weighted share of
    their bytes (by ``gpu-memory-total``), within one block.

    The device-memory counterpart of ``client.rebalance()``; runs
    :class:`~blockflow.scheduling.device_memory.DeviceMemoryAMMPolicy` (``even=True``) in a
    dedicated Active Memory Manager, logging ``memory-move`` decisions when blockflow's plugin
    is registered.

    Parameters
    ----------
    client : distributed.Client
        Synchronous or asynchronous (then ``await`` the call).
    futures : future, list of futures or persisted Dask collection, optional
        Default every result on a device worker (pass them when workers also hold host results).
    workers : iterable of str, optional
        Default every running worker reporting device memory.
    tolerance : int or str, optional
        Bytes (``"512MiB"``) a worker may be off its target; default half the largest block.
    cycles : int, default 10
        At most this many AMM cycles (a move takes two).
    timeout : float, default 30.0
        Seconds a cycle waits for its copies (each receiving worker gathers them at once,
        as ``client.rebalance()`` does, not after the fetches of work running there).

    Returns
    -------
    dict
        ``before`` / ``after`` / ``target`` (address -> bytes), ``moves``, ``bytes_moved``,
        ``largest_block``, ``tolerance``, ``max_deviation`` (bytes), ``within_one_block``,
        ``cycles``, ``skipped`` (keys of blocks not moved: their copy failed or was still
        landing at the timeout; their source keeps them).

    Raises
    ------
    ValueError
        Unknown ``workers``, fewer than two reporting device memory, a bad ``tolerance`` or
        ``cycles < 1``.

    See Also
    --------
    distributed.Client.rebalance : the same for host memory.

    Examples
    --------
    >>> summary = blockflow.rebalance(client, x.persist())  # doctest: +SKIP
    """
    if tolerance is not None:
        try:
            tol = parse_bytes(tolerance)
        except (TypeError, ValueError):
            raise ValueError(f"blockflow.rebalance: tolerance must be bytes (an int or a size "
                             f"like '512MiB'), got {tolerance!r}.") from None
        if tol < 0:
            raise ValueError(f"blockflow.rebalance: tolerance must be >= 0 bytes, got "
                             f"{tolerance!r}.")
        tolerance = tol
    if int(cycles) < 1:
        raise ValueError(f"blockflow.rebalance: cycles must be >= 1, got {cycles!r}.")
    keys = None
    if futures is not None:
        found = futures_of(futures)
        if not found:
            raise ValueError("blockflow.rebalance: futures holds no futures; pass futures or "
                             "a persisted collection (x.persist()), or None for every result.")
        keys = [f.key for f in found]
    if isinstance(workers, str):
        workers = [workers]
    workers = None if workers is None else list(workers)
    return client.sync(_rebalance, client, keys, workers, tolerance, int(cycles),
                       float(timeout))


async def _rebalance(client, keys, workers, tolerance, cycles, timeout):
    out = await client.run_on_scheduler(_on_scheduler, keys, workers, tolerance, cycles,
                                        timeout)
    if "error" in out:
        raise ValueError(out["error"])
    return out


async def _on_scheduler(keys, workers, tolerance, cycles, timeout,
                        dask_scheduler=None) -> dict[str, Any]:
    """The scheduler side of :func:`rebalance`: check, measure, run the policy, measure."""
    views = _distributed.worker_views(dask_scheduler)
    if workers is not None:
        unknown = sorted(set(workers) - set(views))
        if unknown:
            return {"error": f"blockflow.rebalance: workers {unknown} are not in the cluster; "
                             f"pass addresses from client.scheduler_info()['workers']."}
    policy = DeviceMemoryAMMPolicy(even=True, keys=keys, workers=workers, tolerance=tolerance)
    caps = policy.capacities(views)
    if not caps and workers is None:
        return {"error": "blockflow.rebalance: no running worker reports device memory "
                         "(gpu-memory-total); use client.rebalance() for host memory."}
    if len(caps) < 2 and workers is not None:
        return {"error": f"blockflow.rebalance: {len(caps)} of workers {sorted(workers)} "
                         f"run and report device memory; name at least two device workers."}
    before = policy.device_bytes(views, _distributed.held_results(dask_scheduler))
    acted, missed = await _distributed.run_amm_policy(dask_scheduler, policy, cycles=cycles,
                                                      timeout=timeout)
    moved = {m["key"] for m in policy.moves}
    after = policy.device_bytes(_distributed.worker_views(dask_scheduler),
                                _distributed.held_results(dask_scheduler))
    return {
        "before": dict(before.held),
        "after": dict(after.held),
        "target": {a: round(t) for a, t in after.target.items()},
        "moves": list(policy.moves),
        "bytes_moved": sum(m["nbytes"] for m in policy.moves),
        "largest_block": after.largest_block,
        "tolerance": after.tolerance,
        "max_deviation": round(after.max_deviation),
        "within_one_block": after.within_one_block,
        "cycles": acted,
        "skipped": sorted({k for k in missed if k not in moved}, key=str),
    }
