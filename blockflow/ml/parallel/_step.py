"""One pipeline step, driven from the client: micro-batches in, one task per stage, results.

Each stage's task loops over its schedule on its worker
(:func:`blockflow.ml.parallel._stage.run`); a lost stage worker is rebuilt from its
checkpoint (:mod:`blockflow.ml.parallel._recovery`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import warnings

import dask.array as da
import numpy as np
from dask.utils import parse_timedelta
from distributed import futures_of

from blockflow import config
from blockflow.errors import BlockflowWarning, WorkerLostError
from blockflow.ml.parallel import _recovery, _stage
from blockflow.ml.parallel.schedule import PipelineResult, schedule_order, timeline

__all__ = ["METADATA_KEY", "RolledBack", "first", "micro_batches", "micro_slices", "step"]

logger = logging.getLogger("blockflow.ml.parallel.pipeline")

#: Scheduler metadata key under which the latest pipeline run publishes its timeline.
METADATA_KEY = ("blockflow", "pipeline")


def micro_batches(pipe, n_rows: int, n_micro_batches: int | None) -> int:
    """Micro-batches for a batch of ``n_rows``: ``n_micro_batches`` checked, or by default
    stages x ``blockflow.parallel.micro-batches-per-stage``, at most the rows.

    Raises
    ------
    ValueError
        If ``n_micro_batches`` is not an integer between 1 and ``n_rows``.
    """
    if n_micro_batches is None:
        p = pipe.n_stages
        return max(1, min(p * int(config.get("parallel.micro-batches-per-stage")), n_rows))
    m = n_micro_batches
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or not 1 <= m <= n_rows:
        # each micro-batch needs a row: fewer would run than asked, silently
        raise ValueError(f"blockflow: n_micro_batches={n_micro_batches!r} for a batch of "
                         f"{n_rows} rows; a micro-batch needs at least one row: pass "
                         f"n_micro_batches between 1 and {n_rows}.")
    return int(m)


def micro_slices(data, lo: int, rows: int, m: int) -> tuple[list, list[int]]:
    """``data[lo:lo + rows]`` cut into ``m`` micro-batches differing by at most one row,
    and their row counts."""
    sizes = [len(a) for a in np.array_split(np.arange(rows), m)]
    cuts = lo + np.concatenate([[0], np.cumsum(sizes)])
    return [data[cuts[j]:cuts[j + 1]] for j in range(m)], sizes


def _loss_weight(pipe, rows: int, total: int) -> float:
    """A micro-batch's share of the batch's loss: ``rows / total`` for a ``"mean"`` loss,
    1 for ``"sum"``; another reduction raises ``ValueError``."""
    reduction = getattr(pipe.loss_fn, "reduction", "mean")
    if reduction == "sum":
        return 1.0
    if reduction != "mean":
        raise ValueError(f"blockflow: the loss's reduction must be 'mean' or 'sum', got "
                         f"{reduction!r}.")
    return rows / total


def step(pipe, xs: list, ts: list | None, sizes: list[int], **kw) -> PipelineResult:
    """A step with recovery: a lost stage worker rebuilds and the step runs again."""
    if not pipe.stage_workers:
        pipe._place(first(xs[0]), len(xs))
    recovered: list[str] = []
    while True:
        try:
            result = _try_step(pipe, xs, ts, sizes, **kw)
            break
        except WorkerLostError as e:
            lost = set(e.lost) - pipe._alive() or set(pipe.stage_workers) - pipe._alive()
            if not lost:
                raise
            before = pipe.steps
            stages = _recovery.recover(pipe, lost, f"the pipeline step over {sum(sizes)} rows")
            recovered += stages
            pipe.recoveries.append({"step": before, "resumed_from": pipe.steps,
                                    "stages": stages, "lost": sorted(lost)})
            if pipe.steps < before:
                warnings.warn(
                    f"blockflow: the pipeline rolled back to the checkpoint of step "
                    f"{pipe.steps} after losing a stage's worker: steps {pipe.steps + 1}-"
                    f"{before} are undone (fit() replays them; checkpoint_every=1 loses "
                    f"none).", BlockflowWarning, stacklevel=3)
                raise RolledBack(before) from None
    result.recovered = recovered
    return result


def _try_step(pipe, xs, ts, sizes, *, return_grads, return_output, publish, name):
    """One try of a step: a task per stage running its schedule as a loop on its worker."""
    c, p, m = pipe.client, len(pipe.stage_workers), len(xs)
    gone = set(pipe.stage_workers) - pipe._alive()
    if gone:  # lost between steps: rebuild before sending it anything
        raise WorkerLostError(f"blockflow: workers lost: {sorted(gone)}", lost=gone)
    train = ts is not None
    token = uuid.uuid4().hex[:8]
    total = sum(sizes)
    try:
        inputs = _place_data(c, xs, pipe.stage_workers[0])
        targets = _place_data(c, ts, pipe.stage_workers[-1]) if train else None
    except Exception:
        gone = set(pipe.stage_workers) - pipe._alive()
        if gone:  # the worker left while the data went to it
            raise WorkerLostError(f"blockflow: workers lost: {sorted(gone)}",
                                  lost=gone) from None
        raise
    weights = [_loss_weight(pipe, n, total) for n in sizes] if train else None
    want_output = return_output or not train
    wait = parse_timedelta(config.get("parallel.stage-wait"))
    # one task per stage: the stage runs its schedule as a loop on its worker and
    # sends activations and gradients straight to its neighbours' workers
    futures = []
    for s, w in enumerate(pipe.stage_workers):
        order = (schedule_order(pipe.schedule, p, m, s) if train
                 else [("F", j) for j in range(m)])
        plan = {"train": train, "order": order, "name": pipe._stage_name(s),
                "prev": (pipe.stage_workers[s - 1], pipe._keys[s - 1]) if s else None,
                "next": ((pipe.stage_workers[s + 1], pipe._keys[s + 1]) if s < p - 1
                         else None),
                "weights": weights if s == p - 1 else None,
                "want_output": want_output and s == p - 1,
                "want_grads": return_grads, "step_optimizer": pipe.optimizer is not None,
                "wait": wait}
        futures.append(c.submit(
            _stage.run, pipe._keys[s], token, pipe.steps, plan,
            inputs if s == 0 else None, targets if s == p - 1 else None,
            workers=[w], allow_other_workers=False, pure=False,
            key=f"{name}-stage-{token}-{s}"))
    try:
        done = pipe._gather(futures, needed=set(pipe.stage_workers),
                            what="the pipeline step")
    except BaseException:
        _cancel_step(pipe, token, futures)
        raise
    output = None
    if want_output:
        output = np.concatenate([np.asarray(o) for o in done[-1]["outputs"]])
    loss = grads = None
    peaks: list[int] = []
    if train:
        loss = float(done[-1]["loss"])
        peaks = [int(f["peak_stash"]) for f in done]
        pipe._stage_bytes = [max(b, int(f["bytes"]))
                             for b, f in zip(pipe._stage_bytes, done)]
        if return_grads:
            grads = {k: (None if v is None else v.numpy()) for f in done
                     for k, v in f["grads"].items()}
        pipe.steps += 1
        if pipe.checkpoint_every and pipe.steps % pipe.checkpoint_every == 0:
            _recovery.checkpoint(pipe)
    # one host has one clock; across hosts each worker's offset to the scheduler's
    hosts = {_host(w) for w in pipe.stage_workers}
    tasks = timeline([[(ph, j, a + f["clock"], b + f["clock"]) for ph, j, a, b in
                       f["records"]] if len(hosts) > 1 else f["records"] for f in done],
                     pipe.stage_workers)
    makespan = float(tasks.stop.max()) if len(tasks) else 0.0
    result = PipelineResult(output=output, loss=loss, grads=grads, timeline=tasks,
                            makespan=makespan, n_micro_batches=m, n_stages=p,
                            rows=total, micro_batch_rows=list(sizes),
                            schedule=pipe.schedule if train else "gpipe",
                            peak_activations=peaks)
    if publish:
        _publish_timeline(pipe, result, name)
    return result


def _cancel_step(pipe, token: str, futures: list) -> None:
    """End a failed step's stage loops on the workers still there, then forget its tasks."""
    alive = pipe._alive()
    c = pipe.client

    async def send():
        calls = [asyncio.wait_for(getattr(c.rpc(w), _stage.HANDLER)(
            key=k, token=token, cancel=True), 10)
            for k, w in zip(pipe._keys, pipe.stage_workers) if w in alive]
        return await asyncio.gather(*calls, return_exceptions=True)

    try:
        c.sync(send)
    except Exception as e:  # the workers are gone too: nothing waits there
        logger.debug("blockflow: cancelling pipeline step %s: %s", token, e)
    c.cancel(futures)


class RolledBack(Exception):
    """A step lost a stage and the pipeline rolled back to an earlier checkpoint."""


def _host(address: str) -> str:
    """The host part of a worker's address (``tcp://10.0.0.1:4567`` -> ``10.0.0.1``)."""
    return address.split("://")[-1].rsplit(":", 1)[0]


def first(x):
    """``x`` computed if it is a dask array."""
    return x.compute() if isinstance(x, da.Array) else x


def _place_data(client, parts: list, worker: str) -> list:
    """Futures of ``parts`` on ``worker``: dask slices computed there, the rest scattered."""
    # loose: the slices' keys are deterministic, so a later step (or the step replayed after
    # a recovery) reuses tasks placed before; pinned to a worker that has since left, they
    # would wait in "no-worker" for ever. Loose, they are recomputed on a survivor.
    on = dict(workers=[worker], allow_other_workers=True)
    if all(isinstance(a, da.Array) for a in parts):
        done = client.persist([a.rechunk(-1) for a in parts], **on)
        return [futures_of(d)[0] for d in done]
    return client.scatter(list(parts), workers=[worker], hash=False)


def _publish_timeline(pipe, result: PipelineResult, name: str) -> None:
    """Put a step's timeline in the scheduler's metadata under :data:`METADATA_KEY`."""
    t = result.timeline
    pipe.client.set_metadata(list(METADATA_KEY), {
        "name": name, "time": time.time(), "stages": result.n_stages,
        "micro_batches": result.n_micro_batches, "makespan": result.makespan,
        "bubble": result.bubble, "ideal_bubble": result.ideal_bubble,
        "workers": list(pipe.stage_workers), "bounds": list(pipe.bounds),
        "timeline": {k: t[k].tolist() for k in t.columns},
    })
