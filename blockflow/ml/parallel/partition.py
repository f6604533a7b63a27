"""Splitting a model between workers: shard widths by free memory, stages by measured speed.

Both are plain functions of plain data (no cluster), so they are tested exhaustively:

* :func:`shard_widths`: the hidden width of a tensor-parallel layer pair split in proportion
  to each worker's free device memory (largest-remainder rounding), each shard within its
  worker's budget;
* :func:`partition_stages`: layers grouped into contiguous pipeline stages, one per worker,
  minimising the slowest stage's time from each layer's *measured* time on each worker
  (a min-max contiguous partition by dynamic programming, as PipeDream's planner does; the
  worker order is searched too, exhaustively up to 6 stages);
* :func:`equal_stages`: the equal-layer-count baseline;
* :func:`parameter_stages`: DeepSpeed's ``partition_method="parameters"`` baseline (stages
  of about equal parameter counts, whatever the devices).
"""

from __future__ import annotations

import itertools
import math
from typing import Mapping, Sequence

import numpy as np

from blockflow.errors import DeviceMemoryError

__all__ = ["check_fits", "equal_stages", "parameter_stages", "partition_stages", "shard_widths",
           "stage_times"]


def shard_widths(width: int, free: Mapping[str, float], bytes_per_column: int, *,
                 memory_fraction: float = 1.0) -> dict[str, int]:
    """Split ``width`` columns between workers in proportion to their free device memory.

    Parameters
    ----------
    width : int
        Columns to split (the hidden width of a Megatron-style layer pair).
    free : mapping of str to float
        Free device memory per worker, bytes (``math.inf`` where unknown and unlimited).
    bytes_per_column : int
        Weight bytes one column of the split takes on its worker (all layer pairs together).
    memory_fraction : float, default 1.0
        Fraction (0-1) of each worker's free memory the weights may take.

    Returns
    -------
    dict of str to int
        Columns per worker (workers with none are left out); they sum to ``width``.

    Raises
    ------
    DeviceMemoryError
        If the weights do not fit the workers' free memory together; the message names the
        shortfall in bytes.
    ValueError
        If ``free`` is empty or ``width`` < 1.

    Notes
    -----
    Method: blockflow heuristic (proportional shares, largest-remainder rounding, then
    columns moved off any worker over its budget to the one with the most room left).
    """
    if width < 1 or not free:
        raise ValueError(f"blockflow: need width >= 1 and at least one worker, got width "
                         f"{width} and {len(free)} workers.")
    budget = {w: memory_fraction * max(float(f), 0.0) for w, f in free.items()}
    check_fits(width * bytes_per_column, free, memory_fraction)
    workers = sorted(free)
    if any(math.isinf(budget[w]) for w in workers):  # unknown memory: equal shares
        share = np.array([1.0 for _ in workers])
    else:
        share = np.array([budget[w] for w in workers])
    exact = width * share / share.sum()
    cols = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - cols), kind="stable")[: width - cols.sum()]:
        cols[i] += 1
    cap = {w: int(budget[w] // bytes_per_column) if bytes_per_column else width
           for w in workers}
    out = dict(zip(workers, (int(c) for c in cols)))
    for w in workers:  # rounding may push a worker past its budget by a column
        while out[w] > cap[w]:
            room = max(workers, key=lambda v: cap[v] - out[v])
            out[w] -= 1
            out[room] += 1
    return {w: c for w, c in out.items() if c > 0}


def check_fits(need: int, free: Mapping[str, float], memory_fraction: float = 1.0) -> None:
    """Raise :class:`DeviceMemoryError` naming the shortfall when ``need`` bytes exceed
    ``memory_fraction`` of the workers' free memory together (bytes per worker in ``free``)."""
    total = sum(memory_fraction * max(float(f), 0.0) for f in free.values())
    if need > total:
        finite = all(map(math.isfinite, free.values()))
        raise DeviceMemoryError(
            f"blockflow: the model's weights take {int(need):,} bytes but the {len(free)} "
            f"workers' free device memory allows {int(total):,} (memory fraction "
            f"{memory_fraction:g}): short by {int(need - total):,} bytes; add workers or "
            f"devices, or use a smaller model.", working_set=int(need),
            largest_free=int(max(free.values())) if finite and free else None)


def stage_times(layer_times: Mapping[str, Sequence[float]], bounds: Sequence[int],
                order: Sequence[str]) -> list[float]:
    """Seconds of each stage: the layers ``bounds[s]:bounds[s+1]`` on worker ``order[s]``."""
    return [float(sum(layer_times[w][bounds[s]:bounds[s + 1]])) for s, w in enumerate(order)]


def _best_bounds(costs: np.ndarray, sizes: np.ndarray | None = None,
                 caps: Sequence[float] | None = None) -> tuple[float, list[int]]:
    """Min-max contiguous partition of layers over stages; ``costs[s, l]`` is layer ``l``'s
    time on stage ``s``'s worker. Every stage gets at least one layer; with ``sizes`` (bytes
    per layer) and ``caps`` (bytes per stage), no stage holds more than its cap."""
    p, n = costs.shape
    prefix = np.concatenate([np.zeros((p, 1)), np.cumsum(costs, axis=1)], axis=1)
    size_prefix = None if sizes is None else np.concatenate([[0.0], np.cumsum(sizes)])
    best = np.full((p + 1, n + 1), np.inf)
    cut = np.zeros((p + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for s in range(1, p + 1):
        for j in range(s, n - (p - s) + 1):
            for k in range(s - 1, j):
                if size_prefix is not None and \
                        size_prefix[j] - size_prefix[k] > caps[s - 1]:
                    continue
                v = max(best[s - 1, k], prefix[s - 1, j] - prefix[s - 1, k])
                if v < best[s, j]:
                    best[s, j], cut[s, j] = v, k
    bounds = [n]
    for s in range(p, 0, -1):
        bounds.append(int(cut[s, bounds[-1]]))
    return float(best[p, n]), bounds[::-1]


def partition_stages(layer_times: Mapping[str, Sequence[float]], n_stages: int | None = None,
                     *, layer_bytes: Sequence[float] | None = None,
                     capacity: Mapping[str, float] | None = None
                     ) -> tuple[list[str], list[int]]:
    """Group layers into contiguous stages on workers, minimising the slowest stage's time.

    Parameters
    ----------
    layer_times : mapping of str to sequence of float
        For each worker, each layer's measured time there (seconds; forward and backward of
        one micro-batch).
    n_stages : int, optional
        Number of stages (at most the number of workers and of layers); default
        ``min(workers, layers)``. The fastest workers (least total time) are used.
    layer_bytes : sequence of float, optional
        Bytes each layer takes on its worker (parameters, gradients, optimizer state).
    capacity : mapping of str to float, optional
        Bytes each worker may hold (free device memory x a fraction); with ``layer_bytes``,
        no stage exceeds its worker's.

    Returns
    -------
    (list of str, list of int)
        The worker of each stage, in pipeline order, and the stage bounds: stage ``s`` holds
        layers ``bounds[s]:bounds[s+1]`` (``bounds[0] == 0``, ``bounds[-1] ==`` layers).

    Notes
    -----
    Method: dynamic programming over contiguous partitions (min-max), as in PipeDream's
    planner (Narayanan et al., SOSP 2019) with one worker per stage; worker orders are tried
    exhaustively up to 6 stages, beyond that fastest-first.

    Raises
    ------
    DeviceMemoryError
        If no contiguous partition fits the workers' capacity (the message names the bytes).
    """
    workers = sorted(layer_times, key=lambda w: (sum(layer_times[w]), w))
    n_layers = len(next(iter(layer_times.values())))
    p = min(n_stages or len(workers), len(workers), n_layers)
    if p < 1:
        raise ValueError("blockflow: need at least one worker and one layer to make stages.")
    chosen = workers[:p]
    orders = itertools.permutations(chosen) if p <= 6 else [tuple(chosen)]
    best = (math.inf, None, None)
    sizes = None if layer_bytes is None or capacity is None else np.asarray(layer_bytes, float)
    for order in orders:
        costs = np.array([layer_times[w] for w in order], dtype=float)
        caps = None if sizes is None else [float(capacity[w]) for w in order]
        value, bounds = _best_bounds(costs, sizes, caps)
        if value < best[0] - 1e-12:
            best = (value, list(order), bounds)
    if best[1] is None:
        need = float(np.sum(sizes))
        raise DeviceMemoryError(
            f"blockflow: no split of the model's {n_layers} layers ({int(need):,} bytes of "
            f"parameters, gradients and optimizer state) into {p} stages fits the workers' "
            f"free device memory ({int(sum(capacity[w] for w in chosen)):,} bytes usable, "
            f"largest layer {int(max(sizes)):,}); add workers or devices, or use a smaller "
            f"model.", working_set=int(need), largest_free=int(max(capacity.values())))
    return best[1], best[2]


def equal_stages(n_layers: int, workers: Sequence[str]) -> tuple[list[str], list[int]]:
    """The baseline: ``workers`` in the order given, equal layer counts (the first stages
    take one more layer when they do not divide evenly)."""
    p = min(len(workers), n_layers)
    sizes = [n_layers // p + (1 if s < n_layers % p else 0) for s in range(p)]
    return list(workers[:p]), [0, *itertools.accumulate(sizes)]


def parameter_stages(n_params: Sequence[int], workers: Sequence[str]
                     ) -> tuple[list[str], list[int]]:
    """DeepSpeed's ``partition_method="parameters"`` baseline: contiguous stages of about
    equal parameter counts (min-max by :func:`partition_stages`' dynamic programme), on
    ``workers`` in the order given, whatever their speed or memory.

    Parameters
    ----------
    n_params : sequence of int
        Parameters of each layer (layers without any count as one, so each stage gets one).
    workers : sequence of str

    Returns
    -------
    (list of str, list of int)
        As :func:`partition_stages`.
    """
    p = min(len(workers), len(n_params))
    costs = np.tile(np.maximum(np.asarray(n_params, dtype=float), 1.0), (p, 1))
    _, bounds = _best_bounds(costs)
    return list(workers[:p]), bounds
