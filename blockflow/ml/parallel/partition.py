"""Splitting a model between workers: shard widths by free memory, stages by measured speed.

Plain functions of plain data (no cluster): :func:`shard_widths` for tensor parallelism;
:func:`partition_stages` (dynamic programming as PipeDream's planner) and the baselines
:func:`equal_stages` and :func:`parameter_stages` (DeepSpeed's) for pipeline stages.
"""

from __future__ import annotations

import itertools
import math
from typing import Mapping, Sequence

import numpy as np

from blockflow.errors import DeviceMemoryError

__all__ = ["check_fits", "equal_stages", "flush_makespan", "parameter_stages",
           "partition_stages", "shard_widths", "stage_times"]


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
        Weight bytes one column takes on its worker (all layer pairs together).
    memory_fraction : float, default 1.0
        Fraction (0-1) of each worker's free memory the weights may take.

    Returns
    -------
    dict of str to int
        Columns per worker (workers with none are left out); they sum to ``width``.

    Raises
    ------
    DeviceMemoryError
        If the weights do not fit the workers' free memory together.
    ValueError
        If ``free`` is empty or ``width`` < 1.

    Notes
    -----
    Method: blockflow heuristic (proportional shares, largest-remainder rounding, then
    moves off workers over budget).
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
    """Raise :class:`DeviceMemoryError` when ``need`` bytes exceed ``memory_fraction`` of
    the workers' free memory together."""
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


def _segments(costs: np.ndarray, sizes: np.ndarray | None, caps: Sequence[float] | None
              ) -> tuple[np.ndarray, np.ndarray]:
    """``seg[s, k, j]``: time of layers ``k:j`` on stage ``s``'s worker, and whether it fits."""
    p, n = costs.shape
    prefix = np.concatenate([np.zeros((p, 1)), np.cumsum(costs, axis=1)], axis=1)
    seg = prefix[:, None, :] - prefix[:, :, None]
    k, j = np.indices((n + 1, n + 1))
    ok = np.broadcast_to(k < j, seg.shape).copy()
    if sizes is not None:
        size_prefix = np.concatenate([[0.0], np.cumsum(sizes)])
        held = size_prefix[None, :] - size_prefix[:, None]
        ok &= held[None] <= np.asarray(caps, dtype=float)[:, None, None]
    return seg, ok


def _best_bounds(costs: np.ndarray, sizes: np.ndarray | None = None,
                 caps: Sequence[float] | None = None) -> tuple[float, list[int]]:
    """Min-max contiguous partition of layers over stages within ``caps`` (bytes per stage);
    ``costs[s, l]`` is layer ``l``'s time on stage ``s``'s worker."""
    p, n = costs.shape
    seg, ok = _segments(costs, sizes, caps)
    best = np.full((p + 1, n + 1), np.inf)
    cut = np.zeros((p + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for s in range(1, p + 1):
        vals = np.where(ok[s - 1], np.maximum(best[s - 1][:, None], seg[s - 1]), np.inf)
        cut[s] = np.argmin(vals, axis=0)
        best[s] = vals[cut[s], np.arange(n + 1)]
    if not np.isfinite(best[p, n]):
        return math.inf, []
    bounds = [n]
    for s in range(p, 0, -1):
        bounds.append(int(cut[s, bounds[-1]]))
    return float(best[p, n]), bounds[::-1]


def _min_sum_bounds(costs: np.ndarray, limit: float, sizes: np.ndarray | None = None,
                    caps: Sequence[float] | None = None,
                    transfer: np.ndarray | None = None, segments=None
                    ) -> tuple[float, float, list[int]]:
    """Least-total-time contiguous partition whose every stage takes at most ``limit``:
    (slowest stage, total, bounds); ``inf`` total when none fits."""
    p, n = costs.shape
    seg, ok = segments if segments is not None else _segments(costs, sizes, caps)
    cross = np.zeros(n + 1) if transfer is None else np.concatenate([[0.0], transfer, [0.0]])
    within = ok & (seg <= limit * (1 + 1e-12) + 1e-15)
    total = np.full((p + 1, n + 1), np.inf)
    worst = np.full((p + 1, n + 1), np.inf)
    cut = np.zeros((p + 1, n + 1), dtype=int)
    total[0, 0] = worst[0, 0] = 0.0
    cols = np.arange(n + 1)
    for s in range(1, p + 1):
        vals = np.where(within[s - 1], (total[s - 1] + cross)[:, None] + seg[s - 1], np.inf)
        cut[s] = np.argmin(vals, axis=0)
        total[s] = vals[cut[s], cols]
        worst[s] = np.maximum(worst[s - 1][cut[s]], seg[s - 1][cut[s], cols])
    if not np.isfinite(total[p, n]):
        return math.inf, math.inf, []
    bounds = [n]
    for s in range(p, 0, -1):
        bounds.append(int(cut[s, bounds[-1]]))
    return float(worst[p, n]), float(total[p, n]), bounds[::-1]


def flush_makespan(stage_seconds: Sequence[float], n_micro_batches: int,
                   transfer: float = 0.0) -> float:
    """Seconds of a GPipe or 1F1B step of ``n_micro_batches``: the fill and drain of one
    micro-batch (plus ``transfer``), and ``m - 1`` more at the slowest stage's pace."""
    return (n_micro_batches - 1) * max(stage_seconds) + sum(stage_seconds) + transfer


def partition_stages(layer_times: Mapping[str, Sequence[float]], n_stages: int | None = None,
                     *, layer_bytes: Sequence[float] | None = None,
                     capacity: Mapping[str, float] | None = None,
                     n_micro_batches: int | None = None,
                     transfer: Sequence[float] | None = None,
                     ) -> tuple[list[str], list[int]]:
    """Group layers into contiguous stages on workers, minimising the step's time.

    Parameters
    ----------
    layer_times : mapping of str to sequence of float
        For each worker, each layer's forward+backward seconds for one micro-batch.
    n_stages : int, optional
        Number of stages; default ``min(workers, layers)``, on the fastest workers.
    layer_bytes : sequence of float, optional
        Bytes each layer takes on its worker (parameters, gradients, optimizer state).
    capacity : mapping of str to float, optional
        Bytes each worker may hold; with ``layer_bytes`` no stage exceeds its worker's.
    n_micro_batches : int, optional
        With it, minimise :func:`flush_makespan`; without, the slowest stage.
    transfer : sequence of float, optional
        Seconds to send layer ``k``'s output on and its gradient back, paid at each cut.

    Returns
    -------
    (list of str, list of int)
        The worker of each stage in pipeline order, and bounds: stage ``s`` holds layers
        ``bounds[s]:bounds[s+1]``.

    Notes
    -----
    Method: dynamic programming over contiguous partitions, as PipeDream's planner
    (Narayanan et al., SOSP 2019), with one worker per stage; worker orders tried
    exhaustively up to 6 stages, else fastest-first.

    Raises
    ------
    DeviceMemoryError
        If no contiguous partition fits the workers' capacity.
    """
    workers = sorted(layer_times, key=lambda w: (sum(layer_times[w]), w))
    n_layers = len(next(iter(layer_times.values())))
    p = min(n_stages or len(workers), len(workers), n_layers)
    if p < 1:
        raise ValueError("blockflow: need at least one worker and one layer to make stages.")
    if transfer is not None and len(transfer) != n_layers - 1:
        raise ValueError(f"blockflow: transfer needs one value per cut ({n_layers - 1}), got "
                         f"{len(transfer)}.")
    cross = None if transfer is None else np.asarray(transfer, dtype=float)
    m = n_micro_batches
    chosen = workers[:p]
    orders = list(itertools.permutations(chosen)) if p <= 6 else [tuple(chosen)]
    sizes = None if layer_bytes is None or capacity is None else np.asarray(layer_bytes, float)
    plans = []
    for order in orders:
        costs = np.array([layer_times[w] for w in order], dtype=float)
        caps = None if sizes is None else [float(capacity[w]) for w in order]
        value, _ = _best_bounds(costs, sizes, caps)
        if math.isfinite(value):
            plans.append((value, order, costs, caps))
    if not plans:
        need = float(np.sum(sizes))
        raise DeviceMemoryError(
            f"blockflow: no split of the model's {n_layers} layers ({int(need):,} bytes of "
            f"parameters, gradients and optimizer state) into {p} stages fits the workers' "
            f"free device memory ({int(sum(capacity[w] for w in chosen)):,} bytes usable, "
            f"largest layer {int(max(sizes)):,}); add workers or devices, or use a smaller "
            f"model.", working_set=int(need), largest_free=int(max(capacity.values())))
    plans.sort(key=lambda t: t[0])
    floor = plans[0][0]
    best = (math.inf, math.inf, None, None)  # (objective, tie-break, order, bounds)
    for value, order, costs, caps in plans:
        if m is None:  # the slowest stage first, then the way through
            if value > floor * (1 + 1e-9) + 1e-15:
                break
            worst, total, bounds = _min_sum_bounds(costs, value, sizes, caps, cross)
            key = (worst, total)
        else:
            if (m - 1) * value >= best[0]:
                break  # this order's slowest stage alone exceeds the best step found
            # (orders come in rising min-max: every later one too)
            key, bounds = _best_flush(costs, value, m, sizes, caps, cross, best[0])
        if bounds and key < best[:2]:
            best = (*key, list(order), bounds)
    return best[2], best[3]


def _best_flush(costs, floor: float, m: int, sizes, caps, cross, incumbent: float,
                max_limits: int = 64) -> tuple[tuple[float, float], list[int]]:
    """For one worker order: the split of least :func:`flush_makespan`."""
    segments = _segments(costs, sizes, caps)
    segs = np.unique(segments[0][segments[1]])
    limits = segs[segs >= floor * (1 - 1e-12)]
    least = _min_sum_bounds(costs, math.inf, transfer=cross, segments=segments)[1]
    best, bounds_best = (math.inf, math.inf), []
    for limit in limits[:max_limits]:
        if (m - 1) * limit + least >= min(incumbent, best[0]):
            break  # no split under a looser bound can beat the best
        worst, total, bounds = _min_sum_bounds(costs, float(limit), transfer=cross,
                                               segments=segments)
        if not bounds:
            continue
        value = (m - 1) * worst + total
        if (value, total) < best:
            best, bounds_best = (value, total), bounds
    return best, bounds_best


def equal_stages(n_layers: int, workers: Sequence[str]) -> tuple[list[str], list[int]]:
    """The baseline: ``workers`` in the order given, equal layer counts (the first stages
    take one more layer when they do not divide evenly)."""
    p = min(len(workers), n_layers)
    sizes = [n_layers // p + (1 if s < n_layers % p else 0) for s in range(p)]
    return list(workers[:p]), [0, *itertools.accumulate(sizes)]


def parameter_stages(n_params: Sequence[int], workers: Sequence[str]
                     ) -> tuple[list[str], list[int]]:
    """DeepSpeed's ``partition_method="parameters"`` baseline: contiguous stages of about
    equal parameter counts on ``workers`` in the order given.

    Parameters
    ----------
    n_params : sequence of int
        Parameters of each layer (0 counts as one).
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
