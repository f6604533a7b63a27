"""Where a pipeline's stages go: the model's layers, their probe, the partition.

:func:`measure` times every layer on every worker (a plain task per worker); :func:`place`
turns that into contiguous stages in the worker order of least step time
(:func:`~blockflow.parallel.partition.partition_stages`), one rank per worker (several
virtual stages per rank for the interleaved schedule).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import dask
from dask.utils import parse_bytes

from blockflow import config
from blockflow.ml.parallel import _stage
from blockflow.ml.parallel.partition import (
    _best_bounds,
    equal_stages,
    parameter_stages,
    partition_stages,
    stage_times,
)
from blockflow.scheduling.view import worker_memory

__all__ = ["capacity", "measure", "modules_of", "mse", "place", "refuse_batch_norm",
           "transfer"]

logger = logging.getLogger("blockflow.ml.parallel.pipeline")


def modules_of(model) -> list[tuple[str, Any]]:
    """(name, module) of each layer: a Sequential's children, or a list's items."""
    import torch

    if isinstance(model, torch.nn.Sequential):
        return list(model.named_children())
    if isinstance(model, (list, tuple)) and all(isinstance(m, torch.nn.Module) for m in model):
        return [(str(i), m) for i, m in enumerate(model)]
    raise TypeError(f"blockflow: PipelineParallel takes a torch.nn.Sequential or a list of "
                    f"torch.nn.Module, got {type(model).__name__}; wrap the model's layers "
                    f"in torch.nn.Sequential(...).")


def refuse_batch_norm(named) -> None:
    """Raise ``ValueError`` naming the first BatchNorm layer of ``named``."""
    import torch

    norms = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d,
             torch.nn.SyncBatchNorm, torch.nn.LazyBatchNorm1d, torch.nn.LazyBatchNorm2d,
             torch.nn.LazyBatchNorm3d)
    for name, module in named:
        for sub, m in module.named_modules():
            if isinstance(m, norms):
                path = f"{name}.{sub}" if sub else name
                raise ValueError(
                    f"blockflow: layer {path} is a {type(m).__name__}: on micro-batches its "
                    f"statistics are each micro-batch's, not the batch's, so the pipelined "
                    f"model is not the same model; use LayerNorm or GroupNorm, or pass "
                    f"allow_batch_norm=True to accept per-micro-batch statistics.")


def mse():
    """The default loss, ``torch.nn.MSELoss()``."""
    import torch
    return torch.nn.MSELoss()


def measure(pipe, sample, workers: Sequence[str] | None = None
            ) -> tuple[dict[str, list[float]], list[int]]:
    """``PipelineParallel.measure``: each layer's seconds on each worker, and its bytes."""
    x = sample[: pipe.probe_rows]
    futs = {w: pipe.client.submit(_stage.probe, pipe._payloads, x, pipe.probe_repeats,
                                  pipe.optimizer, workers=[w], allow_other_workers=False,
                                  pure=False)
            for w in (workers or pipe.workers)}
    got = pipe._gather(list(futs.values()), needed=set(futs),
                       what="the pipeline's layer probe")
    times = {w: [float(t) for t in g[0]] for w, g in zip(futs, got)}
    pipe.layer_output_bytes = [int(b) for b in got[0][2]]
    return times, [int(b) for b in got[0][1]]


def capacity(pipe) -> dict[str, float]:
    """Bytes each worker may give its stages: ``memory_fraction`` of free (device) memory."""
    mem = worker_memory(pipe.client)
    return {w: pipe.memory_fraction * float(mem[w].free) if w in mem else math.inf
            for w in pipe.workers}


def transfer(pipe) -> list[float]:
    """Seconds to send each layer's output on and its gradient back."""
    bandwidth = dask.config.get("distributed.scheduler.bandwidth")
    bandwidth = float(parse_bytes(bandwidth) if isinstance(bandwidth, str) else bandwidth)
    return [2 * b / bandwidth for b in (pipe.layer_output_bytes or [])[:-1]]


def _interleaved(layer_times: dict, ranks: int, n_stages: int) -> tuple[list, list]:
    """Stages ``s`` on ``order[s % ranks]``: the worker order and bounds whose busiest
    worker (its stages together) is least."""
    import itertools

    import numpy as np

    workers = sorted(layer_times, key=lambda w: (sum(layer_times[w]), w))[:ranks]
    orders = list(itertools.permutations(workers)) if ranks <= 5 else [tuple(workers)]
    best = (math.inf, None, None)
    for order in orders:
        costs = np.array([layer_times[order[s % ranks]] for s in range(n_stages)], float)
        _, bounds = _best_bounds(costs)
        if not bounds:
            continue
        load = [0.0] * ranks
        for s in range(n_stages):
            load[s % ranks] += float(costs[s, bounds[s]:bounds[s + 1]].sum())
        if max(load) < best[0]:
            best = (max(load), list(order), bounds)
    return [best[1][s % ranks] for s in range(n_stages)], best[2]


def place(pipe, sample, n_micro_batches: int | None = None, *, keep_probe: bool = False
          ) -> None:
    """Choose the stages' workers and bounds (``pipe.stage_workers``, ``pipe.bounds``,
    ``pipe.ranks``) and put each stage's layers on its worker.

    Raises
    ------
    ValueError
        For the ``"speed"`` partition without ``sample``.
    DeviceMemoryError
        If no split fits the workers' free memory.
    """
    workers = list(pipe.workers)
    v = pipe.virtual
    ranks = min(len(workers), max(1, pipe.requested_stages // v))
    p = min(ranks * v, len(pipe._named))
    if pipe.schedule == "interleaved1f1b":
        ranks = max(1, p // v) if p >= v else 1
        p = ranks * v if ranks * v <= len(pipe._named) else ranks
    partition = pipe.partition
    if not isinstance(partition, str) and keep_probe:  # a given split after a loss
        partition = "speed" if pipe.layer_times else "equal"
    if partition == "speed":
        if pipe.layer_times is None or not keep_probe:
            if sample is None:
                raise ValueError("blockflow: the speed partition needs sample rows to time "
                                 "the layers on; pass sample= or call run()/fit() first.")
            pipe.layer_times, pipe.layer_bytes = measure(pipe, sample)
        times = {w: t for w, t in pipe.layer_times.items() if w in workers}
        if pipe.schedule == "interleaved1f1b" and p > ranks:
            order, bounds = _interleaved(times, ranks, p)
        else:
            caps = capacity(pipe)
            m = n_micro_batches or p * int(config.get("parallel.micro-batches-per-stage"))
            # the step's time: m - 1 micro-batches at the slowest stage's pace, plus the
            # fill and drain (one micro-batch through every stage and back) and its hops
            order, bounds = partition_stages(times, p, layer_bytes=pipe.layer_bytes,
                                             capacity=caps, n_micro_batches=m,
                                             transfer=transfer(pipe))
        pipe.predicted_stage_times = stage_times(pipe.layer_times, bounds, order)
    elif partition == "equal":
        _, bounds = equal_stages(len(pipe._named), list(range(p)))
        order = [workers[s % ranks] for s in range(len(bounds) - 1)]
    elif partition == "parameters":
        counts = [sum(q.numel() for q in m.parameters()) for _, m in pipe._named]
        _, bounds = parameter_stages(counts, list(range(p)))
        order = [workers[s % ranks] for s in range(len(bounds) - 1)]
    else:
        order, bounds = [str(w) for w in partition[0]], list(partition[1])
    pipe.stage_workers, pipe.bounds = list(order), [int(b) for b in bounds]
    pipe.ranks = list(dict.fromkeys(order))
    pipe.n_stages = len(order)
    logger.info("blockflow: pipeline of %d layers in %d stages: layers %s on workers %s "
                "(partition %s; measured stage seconds %s)", len(pipe._named), len(order),
                [f"{a}:{b}" for a, b in zip(bounds, bounds[1:])], order,
                partition if isinstance(partition, str) else "given",
                None if pipe.predicted_stage_times is None
                else [round(t, 4) for t in pipe.predicted_stage_times])
    # each layer's pickled module on the worker of its stage (scattered data is not
    # recomputed: placed again after a loss)
    futs = {}
    for s, w in enumerate(order):
        idx = list(range(bounds[s], bounds[s + 1]))
        for k, f in zip(idx, pipe.client.scatter([pipe._payloads[k] for k in idx],
                                                  workers=[w], hash=False)):
            futs[k] = f
    pipe._layer_futs = [futs[k] for k in range(len(pipe._named))]
