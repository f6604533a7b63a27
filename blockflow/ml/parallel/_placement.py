"""Where a pipeline's stages go: the model's layers, their probe, the partition, the install.

:func:`measure` times every layer on every worker; :func:`place` turns that into one stage
per worker (:func:`~blockflow.parallel.partition.partition_stages`) and installs the stages.
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any, Sequence

import cloudpickle
import dask
from dask.utils import parse_bytes

from blockflow import config
from blockflow.ml.parallel import _stage
from blockflow.ml.parallel.partition import (
    equal_stages,
    parameter_stages,
    partition_stages,
    stage_times,
)
from blockflow.scheduling.view import worker_memory

__all__ = ["capacity", "measure", "modules_of", "mse", "place", "refuse_batch_norm",
           "stage_payload", "transfer"]

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


def stage_payload(pipe, s: int) -> bytes:
    """Stage ``s``'s layers as one pickled ``torch.nn.Sequential``."""
    import torch

    a, b = pipe.bounds[s], pipe.bounds[s + 1]
    seq = torch.nn.Sequential()
    for name, m in pipe._named[a:b]:
        seq.add_module(name, m)
    return cloudpickle.dumps(seq)


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


def place(pipe, sample, n_micro_batches: int | None = None) -> None:
    """Choose the stages' workers and bounds and install each stage on its worker.

    Raises
    ------
    ValueError
        For the ``"speed"`` partition without ``sample``.
    """
    p = pipe.n_stages
    if pipe.partition == "speed":
        if sample is None:
            raise ValueError("blockflow: the speed partition needs sample rows to time "
                             "the layers on; pass sample= or call run()/fit() first.")
        pipe.layer_times, pipe.layer_bytes = measure(pipe, sample)
        caps = capacity(pipe)
        # the step's time: m - 1 micro-batches at the slowest stage's pace, plus the
        # fill and drain (one micro-batch through every stage and back) and its hops
        m = n_micro_batches or p * int(config.get("parallel.micro-batches-per-stage"))
        order, bounds = partition_stages(pipe.layer_times, p, layer_bytes=pipe.layer_bytes,
                                         capacity=caps, n_micro_batches=m,
                                         transfer=transfer(pipe))
        pipe.predicted_stage_times = stage_times(pipe.layer_times, bounds, order)
    elif pipe.partition == "equal":
        order, bounds = equal_stages(len(pipe._named), pipe.workers[:p])
    elif pipe.partition == "parameters":
        counts = [sum(q.numel() for q in m.parameters()) for _, m in pipe._named]
        order, bounds = parameter_stages(counts, pipe.workers[:p])
    else:
        order, bounds = [str(w) for w in pipe.partition[0]], list(pipe.partition[1])
    pipe.stage_workers, pipe.bounds = list(order), [int(b) for b in bounds]
    pipe.n_stages = len(order)
    logger.info("blockflow: pipeline of %d layers in %d stages: layers %s on workers %s "
                "(partition %s; measured stage seconds %s)", len(pipe._named), len(order),
                [f"{a}:{b}" for a, b in zip(bounds, bounds[1:])], order,
                pipe.partition if isinstance(pipe.partition, str) else "given",
                None if pipe.predicted_stage_times is None
                else [round(t, 4) for t in pipe.predicted_stage_times])
    if not all(pipe.client.run(_stage.has_handler).values()):
        # the comm handler stages send activations and gradients to, on every worker
        # (and those that join later: a rebuilt stage's)
        pipe.client.register_plugin(_stage.PipePlugin(), name=_stage.PipePlugin.name)
    token = uuid.uuid4().hex[:10]
    pipe._keys = [f"stage-{s}-{token}" for s in range(len(order))]
    futs = [pipe.client.submit(_stage.install, pipe._keys[s], stage_payload(pipe, s),
                               pipe.optimizer, pipe.loss_fn, pipe.seed, s,
                               workers=[w], allow_other_workers=False, pure=False,
                               key=f"pipeline-install-{pipe._keys[s]}")
            for s, w in enumerate(order)]
    pipe._stage_bytes = pipe._gather(futs, needed=set(order), what="placing the stages")
