"""The fan-in (``split_every``) of a tree reduction, sized to the smallest worker's memory.

:func:`choose_split_every` keeps ``split_every x block bytes`` under a fraction of the
smallest worker's memory (Dask's default fan-in ignores both). For device blocks on GPU
workers the fan-in is not clamped to ``max-split-every``: each combine task costs the worker's per-task overhead,
so fewer, wider combines are cheaper while they fit device memory. Method: blockflow
heuristic.
"""

from __future__ import annotations

import logging
import math

import dask.array as da
import numpy as np
from dask.utils import format_bytes, parse_bytes
from distributed import default_client

from blockflow import config
from blockflow.scheduling.view import worker_memory

__all__ = ["choose_split_every", "smallest_worker_memory"]

logger = logging.getLogger("blockflow.reduction")


def smallest_worker_memory(client=None) -> tuple[int, str]:
    """Memory of the smallest worker of the current cluster, in bytes.

    GPU workers count device memory; CPU workers their host ``memory_limit``.

    Parameters
    ----------
    client : distributed.Client, optional
        Default: the current default client, if any.

    Returns
    -------
    (int, str)
        Bytes, and the source: ``"device"``, ``"host"`` or ``"config"``
        (``blockflow.reduction.default-worker-memory``).
    """
    if client is None:
        try:
            client = default_client()
        except ValueError:
            client = None
    sizes: list[tuple[int, str]] = []
    if client is not None and client.status == "running":
        try:
            memory = worker_memory(client)
        except Exception:  # a client that cannot reach its scheduler: fall back to config
            memory = {}
        for m in memory.values():
            if m.total is not None:
                sizes.append((int(m.total[0]), m.total[1]))
    if not sizes:
        return parse_bytes(config.get("reduction.default-worker-memory")), "config"
    return min(sizes)


def choose_split_every(
    block_bytes: int,
    worker_memory: int,
    *,
    memory_fraction: float | None = None,
    min_split_every: int | None = None,
    max_split_every: int | None = None,
) -> int:
    """Fan-in of a tree reduction so that ``fan-in x block_bytes <= fraction x worker_memory``.

    A blockflow heuristic: a combine step holds ``split_every`` partials at once.

    Parameters
    ----------
    block_bytes : int
        Bytes of one block entering a combine step (an upper bound is fine).
    worker_memory : int
        Bytes of the smallest worker's memory (device memory on GPU workers).
    memory_fraction : float, optional
        Fraction 0-1; default ``blockflow.reduction.memory-fraction``.
    min_split_every, max_split_every : int, optional
        Clamp; defaults from ``blockflow.reduction.min-split-every`` / ``max-split-every``.
        ``max_split_every=math.inf``: no upper clamp (GPU workers).

    Returns
    -------
    int
        The fan-in, at least 2.
    """
    fraction = config.get("reduction.memory-fraction", memory_fraction)
    lo = max(2, int(config.get("reduction.min-split-every", min_split_every)))
    hi = config.get("reduction.max-split-every", max_split_every)
    hi = hi if hi == math.inf else max(lo, int(hi))
    fits = int(fraction * worker_memory // max(int(block_bytes), 1))
    return int(min(max(fits, lo), hi))


def _array_block_bytes(x: da.Array) -> int:
    itemsize = x.dtype.itemsize if x.dtype != object else 64
    return int(np.prod([max(c) for c in x.chunks])) * itemsize


def _check_split_every_dict(split_every: dict, ndim: int) -> dict[int, int]:
    """Dask's per-axis fan-in ``{axis: n}`` for arrays: axes in range, fan-ins >= 2."""
    out = {}
    for ax, n in split_every.items():
        if isinstance(ax, bool) or not isinstance(ax, (int, np.integer)) \
                or not -ndim <= ax < ndim:
            raise ValueError(
                f"blockflow.tree_reduce: split_every={split_every!r} names axis {ax!r}, which "
                f"the collection's {ndim} dimensions do not have; use axes from {-ndim} to "
                f"{ndim - 1}."
            )
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
            raise ValueError(
                f"blockflow.tree_reduce: split_every={split_every!r} gives axis {ax} a fan-in "
                f"of {n!r}; each must be an int >= 2."
            )
        out[int(ax) % ndim] = int(n)
    return out


def _resolve_split_every(split_every, block_bytes, what: str, device: bool = False) -> int:
    """``split_every`` checked, else sized from the smallest worker's memory; ``device``:
    the blocks are device arrays (CuPy, cuDF), whose fan-in on GPU workers is not clamped to
    ``max-split-every`` (host blocks keep the clamp: they reduce on the workers' CPUs, where
    a wider fan-in only costs parallelism)."""
    split_every = config.get("reduction.split-every", split_every)
    if split_every is not None:
        if isinstance(split_every, bool) or not isinstance(split_every, (int, np.integer)):
            raise TypeError(
                f"blockflow.tree_reduce: split_every must be an int >= 2 or None, got "
                f"{split_every!r}."
            )
        if split_every < 2:
            raise ValueError(
                f"blockflow.tree_reduce: split_every={split_every} is too small; a tree "
                f"reduction combines at least 2 blocks per step (use split_every >= 2, or "
                f"None to size it from worker memory)."
            )
        return int(split_every)
    memory, source = smallest_worker_memory()
    # device blocks on GPU workers: no max-split-every, few combine tasks (each costs the
    # per-task overhead)
    chosen = choose_split_every(block_bytes, memory, max_split_every=math.inf
                                if device and source == "device" else None)
    logger.info(
        "tree_reduce of %s: split_every=%d (%d x %s blocks within %.0f%% of the smallest "
        "worker's %s memory, %s)",
        what, chosen, chosen, format_bytes(block_bytes),
        100 * config.get("reduction.memory-fraction"), source, format_bytes(memory),
    )
    return chosen
