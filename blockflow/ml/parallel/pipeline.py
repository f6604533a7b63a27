"""Pipeline parallelism: layers in stages on different workers, micro-batches streaming through.

A model (a sequence of :mod:`blockflow.parallel.layers`) is cut into contiguous **stages**,
each held on one worker. A batch is split into ``m`` micro-batches that flow stage to stage
as futures on a **GPipe** schedule (Huang et al., 2019): every micro-batch's forward pass,
then every backward pass in reverse stage order, gradients accumulated over micro-batches on
the stage's worker; with ``p`` stages of equal time the idle ("bubble") fraction is
``(p - 1) / (m + p - 1)``. Each stage's forward and backward tasks run on its worker only, in
micro-batch order (one graph submitted at once, task priorities forward ``-j`` and backward
``-(m + j)``: a worker runs its ready tasks highest priority first), and a stage starts its
backward passes only after all its forward passes (GPipe's flush: a dependency on each of
them, on the same worker, no transfer; on the last one alone, an earlier micro-batch's
forward whose input arrived late could still follow a backward). Ordering by dependencies between a stage's tasks instead would
cost a scheduler round trip per task.

The **partition** is chosen from measured times, not equal layer counts: every layer's
forward+backward on a probe micro-batch is timed on every worker, and
:func:`~blockflow.parallel.partition.partition_stages` picks the worker order and the
contiguous cut that minimise the slowest stage. ``partition="equal"`` is the equal-layer
baseline.

The **timeline** (per stage and micro-batch: worker, phase, start and stop seconds, from
distributed's task stream) comes back as a DataFrame, is published in the scheduler's
metadata under ``("blockflow", "pipeline")`` for blockflow's dashboard page, and is read
into :func:`blockflow.run_report`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from blockflow import config
from blockflow.cluster.identity import workers_info
from blockflow.scheduling.client import gather_results, lost_roles
from blockflow.ml._pickling import FIX_TRAIN, dumps_or_explain
from blockflow.ml.parallel.layers import Layer, backward, forward
from blockflow.ml.parallel.partition import equal_stages, partition_stages, stage_times

__all__ = ["METADATA_KEY", "PipelineParallel", "PipelineResult", "bubble_fraction"]

logger = logging.getLogger(__name__)

#: Scheduler metadata key under which the latest pipeline run publishes its timeline.
METADATA_KEY = ("blockflow", "pipeline")


# --- worker-side functions ---------------------------------------------------------------


class _Stage:
    """The layers of one stage, shipped once to its worker and kept there, with the
    activations its forward passes saved for their backward passes (the *stash*, keyed by
    run and micro-batch) and the gradients accumulated over micro-batches."""

    def __init__(self, layers: Sequence[Layer]):
        self.layers = list(layers)
        self.stash: dict = {}
        self.grads: dict = {}
        self.loss: dict = {}


#: Guards the stash and the accumulated gradients on a worker with several threads.
_LOCK = threading.Lock()


def _stage_forward(stage: _Stage, x, run: str, j: int, keep: bool, last: bool):
    """Forward of micro-batch ``j``: the output; saves activations when ``keep``."""
    y, saved = forward(stage.layers, x)
    if keep:
        with _LOCK:
            stage.stash[run, j] = (saved, y if last else None)
    return y


def _stage_backward(stage: _Stage, dy, run: str, j: int, n_elements: int | None,
                    _after=None):
    """Backward of micro-batch ``j``; on the last stage ``dy`` is the target and the loss
    gradient (mean squared error over ``n_elements``) is formed here. Returns ``dx``."""
    with _LOCK:
        saved, y = stage.stash.pop((run, j))
    if n_elements is not None:
        diff = y - dy
        dy = 2.0 * diff / n_elements
        sq = float((diff * diff).sum())
    grads, dx = backward(stage.layers, saved, dy)
    with _LOCK:
        if n_elements is not None:
            stage.loss[run] = stage.loss.get(run, 0.0) + sq
        total = stage.grads.get(run)
        if total is None:
            stage.grads[run] = grads
        else:
            for t, g in zip(total, grads):
                for k in t:
                    t[k] = t[k] + g[k]
    return dx


def _collect(stage: _Stage, run: str, *_after):
    """The stage's accumulated gradients and squared-error sum of ``run`` (and forget them)."""
    with _LOCK:
        for key in [k for k in stage.stash if k[0] == run]:
            del stage.stash[key]
        return stage.grads.pop(run, None), stage.loss.pop(run, None)


def _layer_times(layers: Sequence[Layer], x, repeats: int, fn: Callable):
    """Seconds of each layer's forward+backward on ``x`` on this worker: the least of
    ``repeats`` timed passes after one warm-up."""
    best = [float("inf")] * len(layers)
    for r in range(repeats + 1):
        h = x
        for i, layer in enumerate(layers):
            start = time.perf_counter()
            y = fn(layer, h)
            if r:
                best[i] = min(best[i], time.perf_counter() - start)
            h = y
    return best


def _one_layer(layer: Layer, x):
    y, saved = layer.forward(x)
    layer.backward(saved, np.ones_like(y))
    return y


# --- results -----------------------------------------------------------------------------


def bubble_fraction(timeline: pd.DataFrame) -> float:
    """Idle fraction of a pipeline run: ``1 - busy / (stages x span)``.

    Parameters
    ----------
    timeline : pandas.DataFrame
        With columns ``stage``, ``start``, ``stop`` (seconds), one row per task.

    Returns
    -------
    float
        Fraction 0-1 of the stages' time between the first start and the last stop spent
        idle (GPipe's bubble, plus any scheduling gaps).
    """
    if timeline.empty:
        return 0.0
    span = float(timeline.stop.max() - timeline.start.min())
    busy = float((timeline.stop - timeline.start).sum())
    p = timeline.stage.nunique()
    return max(0.0, 1.0 - busy / (p * span)) if span > 0 else 0.0


@dataclass
class PipelineResult:
    """What one pipeline pass gave (see :meth:`PipelineParallel.run`).

    Attributes
    ----------
    output : numpy.ndarray
        The model's output for the whole batch (micro-batches concatenated in order).
    loss : float or None
        Mean squared error against the target, when one was given.
    grads : list of dict or None
        Per layer, gradients of its parameters (``{}`` for activations), summed over
        micro-batches; None without a backward pass.
    timeline : pandas.DataFrame
        One row per stage task: ``stage``, ``worker``, ``micro_batch``, ``phase``
        (``"forward"``/``"backward"``), ``start``, ``stop`` (seconds since the first start).
    makespan : float
        Seconds from the first task start to the last stop.
    n_micro_batches, n_stages : int
    rows : int
        Rows of the batch.
    """

    output: np.ndarray
    loss: float | None
    grads: list[dict] | None
    timeline: pd.DataFrame = field(repr=False)
    makespan: float
    n_micro_batches: int
    n_stages: int
    rows: int

    @property
    def bubble(self) -> float:
        """Measured idle fraction 0-1 (:func:`bubble_fraction` of the timeline)."""
        return bubble_fraction(self.timeline)

    @property
    def ideal_bubble(self) -> float:
        """GPipe's bubble for equal stages, ``(p - 1) / (m + p - 1)``."""
        p, m = self.n_stages, self.n_micro_batches
        return (p - 1) / (m + p - 1)

    @property
    def throughput(self) -> float:
        """Rows per second through the pipeline (forward and backward when both ran)."""
        return self.rows / self.makespan if self.makespan > 0 else float("inf")

    def plot(self):
        """Bokeh Gantt chart of the timeline: one row per stage, a bar per task."""
        from bokeh.models import ColumnDataSource, HoverTool
        from bokeh.plotting import figure

        t = self.timeline.assign(
            y=lambda d: [f"stage {s}" for s in d.stage],
            color=lambda d: np.where(d.phase == "forward", "#1f77b4", "#ff7f0e"))
        stages = [f"stage {s}" for s in sorted(t.stage.unique(), reverse=True)]
        fig = figure(y_range=stages, height=60 + 40 * len(stages), width=700,
                     title=f"Pipeline: {self.n_stages} stages, {self.n_micro_batches} "
                           f"micro-batches, bubble {self.bubble:.1%}",
                     x_axis_label="seconds")
        fig.hbar(y="y", left="start", right="stop", height=0.7, color="color",
                 source=ColumnDataSource(t), line_color="white")
        fig.add_tools(HoverTool(tooltips=[("phase", "@phase"), ("micro-batch", "@micro_batch"),
                                          ("worker", "@worker")]))
        return fig


class PipelineParallel:
    """A model cut into stages on different workers, trained or run on micro-batches.

    Parameters
    ----------
    client : distributed.Client
    layers : sequence of Layer
        The model, in order (:class:`~blockflow.parallel.layers.Linear`,
        :class:`~blockflow.parallel.layers.Tanh`, ... or any :class:`Layer`).
    workers : sequence of str, optional
        Workers that may hold stages; default all. One stage per worker.
    n_stages : int, optional
        Default: as many as workers (at most the number of layers).
    partition : {"speed", "equal"} or (list of str, list of int), default "speed"
        ``"speed"``: from each layer's measured time on each worker (see the module
        docstring); ``"equal"``: equal layer counts on the workers in address order; or an
        explicit ``(workers in stage order, bounds)``.
    probe_rows : int, default 32
        Rows of the probe micro-batch the layers are timed on.
    probe_repeats : int, default 2
        Timed passes per worker (the least counts), after a warm-up.

    Attributes
    ----------
    stage_workers : list of str
        The worker of each stage, in pipeline order.
    bounds : list of int
        Stage ``s`` holds ``layers[bounds[s]:bounds[s+1]]``.
    layer_times : dict of str to list of float or None
        The measured seconds of each layer on each worker (``"speed"`` partition).
    predicted_stage_times : list of float or None
        Per stage, the measured seconds of its layers on its worker.

    Raises
    ------
    ValueError
        For no layers, workers not in the cluster, an unknown partition or bounds that do
        not cut the layers into one non-empty stage per worker.
    RuntimeError
        If the cluster has no workers.
    """

    def __init__(self, client, layers: Sequence[Layer], *, workers: Sequence[str] | None = None,
                 n_stages: int | None = None, partition="speed", probe_rows: int = 32,
                 probe_repeats: int = 2):
        self.client, self.layers = client, list(layers)
        if not self.layers:
            raise ValueError("blockflow: a pipeline needs at least one layer.")
        # the layers travel to their stage's worker: refuse any that cannot, before anything
        # runs, as predict, Router and DataParallelTrainer do
        dumps_or_explain(self.layers, "blockflow.parallel.PipelineParallel", root="layers",
                         fix=FIX_TRAIN)
        available = sorted(workers_info(client))
        workers = sorted(workers) if workers is not None else available
        missing = sorted(set(workers) - set(available))
        if missing:
            raise ValueError(f"blockflow: workers {missing} are not in the cluster.")
        if not workers:
            raise RuntimeError("blockflow: the cluster has no workers; start some first.")
        p = min(n_stages or len(workers), len(workers), len(self.layers))
        self.layer_times: dict[str, list[float]] | None = None
        self.predicted_stage_times: list[float] | None = None
        if partition == "speed":
            self.layer_times = self.measure(workers, probe_rows, probe_repeats)
            order, bounds = partition_stages(self.layer_times, p)
            self.predicted_stage_times = stage_times(self.layer_times, bounds, order)
        elif partition == "equal":
            order, bounds = equal_stages(len(self.layers), workers[:p])
        elif isinstance(partition, str):
            raise ValueError(f"blockflow: partition must be 'speed', 'equal' or (workers, "
                             f"bounds), got {partition!r}.")
        else:
            order, bounds = partition
            order, bounds = list(order), [int(b) for b in bounds]
            if len(bounds) != len(order) + 1 or bounds[0] != 0 or bounds[-1] != len(
                    self.layers) or any(b <= a for a, b in zip(bounds, bounds[1:])):
                raise ValueError(f"blockflow: partition bounds must rise from 0 to "
                                 f"{len(self.layers)} with one stage per worker, got {bounds} "
                                 f"for {len(order)} workers.")
        self.stage_workers, self.bounds = order, bounds
        logger.info("blockflow: pipeline of %d layers in %d stages: layers %s on workers %s "
                    "(partition %s; measured stage seconds %s)", len(self.layers), len(order),
                    [f"{a}:{b}" for a, b in zip(bounds, bounds[1:])], order,
                    partition if isinstance(partition, str) else "given",
                    None if self.predicted_stage_times is None
                    else [round(t, 4) for t in self.predicted_stage_times])
        self._stages = [
            client.scatter(_Stage(self.layers[bounds[s]:bounds[s + 1]]), workers=[w],
                           hash=False)
            for s, w in enumerate(order)]

    def _input_width(self) -> int:
        for layer in self.layers:
            W = getattr(layer, "params", {}).get("W")
            if W is not None:
                return int(W.shape[0])
        raise ValueError("blockflow: cannot tell the model's input width (no layer with a "
                         "weight W); pass partition='equal' or an explicit partition.")

    def measure(self, workers: Sequence[str], rows: int = 32, repeats: int = 2
                ) -> dict[str, list[float]]:
        """Each layer's forward+backward seconds on each worker, on a probe micro-batch.

        Returns
        -------
        dict of str to list of float
            Worker address -> seconds per layer.

        Notes
        -----
        The probe sends every layer to every worker once (one task each, in parallel), so
        each worker must hold the whole model's parameters for a moment; for a model too
        large for that, pass an explicit ``partition``.
        """
        x = np.random.default_rng(0).standard_normal((rows, self._input_width()))
        futs = {w: self.client.submit(_layer_times, self.layers, x, repeats, _one_layer,
                                      workers=[w], allow_other_workers=False, pure=False)
                for w in workers}
        times = gather_results(self.client, futs, what="the pipeline's layer probe")
        return {w: [float(t) for t in times[w]] for w in futs}

    def run(self, X, target=None, *, n_micro_batches: int | None = None,
            publish: bool = True, name: str = "pipeline") -> PipelineResult:
        """One pass of the batch through the pipeline: forward, and backward with a target.

        Parameters
        ----------
        X : array, shape (n_samples, d_in)
        target : array, shape (n_samples, d_out), optional
            With a target, the loss is the mean squared error over all elements and the
            backward pass runs (GPipe: all forwards, then all backwards), accumulating each
            stage's gradients over micro-batches on its worker.
        n_micro_batches : int, optional
            Between 1 and the batch's rows (each micro-batch gets at least one row).
            Default ``stages x`` config ``blockflow.parallel.micro-batches-per-stage``,
            at most the rows.
        publish : bool, default True
            Publish the timeline in the scheduler's metadata (dashboard, run report).
        name : str, default "pipeline"
            Label of the run on the dashboard.

        Returns
        -------
        PipelineResult

        Raises
        ------
        ValueError
            If ``n_micro_batches`` is below 1 or above the rows (before anything runs),
            the batch is empty, or ``target``'s rows differ from ``X``'s.
        """
        import dask
        from dask import delayed
        from distributed import get_task_stream

        X = np.asarray(X, dtype=np.float64)
        p = len(self.stage_workers)
        if len(X) == 0:
            raise ValueError("blockflow: the pipeline got a batch of 0 rows; pass at least "
                             "one row.")
        if n_micro_batches is not None:
            m = int(n_micro_batches)
            if not 1 <= m <= len(X):
                # each micro-batch needs a row: fewer would run than asked, silently
                raise ValueError(f"blockflow: n_micro_batches={n_micro_batches!r} for a "
                                 f"batch of {len(X)} rows; a micro-batch needs at least "
                                 f"one row: pass n_micro_batches between 1 and {len(X)}.")
        else:  # the configured default follows the stages, at most one per row
            m = max(1, min(p * int(config.get("parallel.micro-batches-per-stage")), len(X)))
        token = uuid.uuid4().hex[:8]
        c = self.client
        mbs = np.array_split(X, m)
        on = [dict(workers=[w], allow_other_workers=False) for w in self.stage_workers]
        train = target is not None
        if train:
            T = np.asarray(target, dtype=np.float64)
            if T.shape[0] != X.shape[0]:
                raise ValueError(f"blockflow: target has {T.shape[0]} rows but X has "
                                 f"{X.shape[0]}; pass one target row per sample.")
        with get_task_stream(c) as stream:
            inputs = c.scatter(mbs, workers=[self.stage_workers[0]], hash=False)
            targets = c.scatter(np.array_split(T, m), workers=[self.stage_workers[-1]],
                                hash=False) if train else None
            # One graph, one submission: the scheduler sees every task and its priority at
            # once (separate submits may reach a worker out of order).
            fwd = [[None] * m for _ in range(p)]
            for j in range(m):
                x = inputs[j]
                for s in range(p):
                    with dask.annotate(priority=-j, **on[s]):
                        x = fwd[s][j] = delayed(_stage_forward, pure=False)(
                            self._stages[s], x, token, j, train, s == p - 1,
                            dask_key_name=f"{name}-forward-{token}-{s}-{j}")
            wanted = [fwd[p - 1][j] for j in range(m)]
            if train:
                bwd = [[] for _ in range(p)]
                for j in range(m):
                    dy = targets[j]
                    for s in range(p - 1, -1, -1):
                        # after every forward of the stage (GPipe's flush): its last
                        # micro-batch's forward alone is not enough, as the forwards of
                        # earlier ones may finish after it when their inputs arrive late
                        # (seen in CI); same worker, no transfer
                        after = fwd[s]
                        with dask.annotate(priority=-(m + j), **on[s]):
                            dy = delayed(_stage_backward, pure=False)(
                                self._stages[s], dy, token, j,
                                T.size if s == p - 1 else None, after,
                                dask_key_name=f"{name}-backward-{token}-{s}-{j}")
                        bwd[s].append(dy)
                for s in range(p):
                    with dask.annotate(**on[s]):
                        wanted.append(delayed(_collect, pure=False)(
                            self._stages[s], token, *bwd[s],
                            dask_key_name=f"{name}-collect-{token}-{s}"))
            try:
                futures = c.compute(wanted, optimize_graph=False)
                done = gather_results(c, futures, what="the pipeline pass")
            except Exception:
                # a stage's worker left: say which stage, worker and rows, not the keys
                lost = lost_roles(
                    c, f"the pipeline pass over rows 0-{len(X) - 1} ({m} micro-batches)",
                    self._stage_roles(),
                    "the stage's layers and their state went with it: build the "
                    "PipelineParallel again on the workers left and run the pass again.")
                if lost is None:
                    raise
                raise lost from None
            output = np.concatenate(done[:m])
            loss, grads = None, None
            if train:
                collected = done[m:]
                loss = collected[-1][1] / T.size
                grads = [g for stage_grads, _ in collected for g in stage_grads]
        timeline = _timeline(stream.data, name, token, self.stage_workers)
        makespan = float(timeline.stop.max()) if len(timeline) else 0.0
        result = PipelineResult(output=output, loss=loss, grads=grads, timeline=timeline,
                                makespan=makespan, n_micro_batches=m, n_stages=p, rows=len(X))
        if publish:
            self._publish(result, name)
        return result

    def _stage_roles(self) -> dict[str, str]:
        """Worker to the stage it holds, as errors name it (``"stage 1 (layers 2-3)"``)."""
        return {w: f"stage {s} (layers {self.bounds[s]}-{self.bounds[s + 1] - 1})"
                for s, w in enumerate(self.stage_workers)}

    def close(self) -> None:
        """Release the stages held on the workers."""
        self._stages = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _publish(self, result: PipelineResult, name: str) -> None:
        t = result.timeline
        self.client.set_metadata(list(METADATA_KEY), {
            "name": name, "time": time.time(), "stages": result.n_stages,
            "micro_batches": result.n_micro_batches, "makespan": result.makespan,
            "bubble": result.bubble, "ideal_bubble": result.ideal_bubble,
            "workers": list(self.stage_workers), "bounds": list(self.bounds),
            "timeline": {k: t[k].tolist() for k in t.columns},
        })


def _timeline(stream: list[dict], name: str, token: str, workers: list[str]) -> pd.DataFrame:
    """Rows of the pipeline's stage tasks from distributed's task stream records."""
    rows = []
    for rec in stream:
        key = rec.get("key")
        key = key if isinstance(key, str) else str(key)
        for phase in ("forward", "backward"):
            prefix = f"{name}-{phase}-{token}-"
            if key.startswith(prefix):
                s, j = (int(v) for v in key[len(prefix):].split("-"))
                compute = [ss for ss in rec.get("startstops", ()) if ss["action"] == "compute"]
                if compute:
                    rows.append({"stage": s, "worker": workers[s], "micro_batch": j,
                                 "phase": phase, "start": compute[0]["start"],
                                 "stop": compute[0]["stop"]})
    df = pd.DataFrame(rows, columns=["stage", "worker", "micro_batch", "phase", "start",
                                     "stop"])
    if len(df):
        t0 = df.start.min()
        df = df.assign(start=df.start - t0, stop=df.stop - t0).sort_values(
            ["stage", "start"]).reset_index(drop=True)
    return df
