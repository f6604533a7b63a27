"""Pipeline parallelism for PyTorch models: contiguous stages on different workers.

A ``torch.nn.Sequential`` (or a list of modules) is cut into contiguous **stages**, one per
worker. Each stage's modules are shipped once and live on their worker
(:mod:`blockflow.ml.parallel._stage`): a micro-batch's forward pass stashes its input,
output and autograd graph there, and its backward pass runs ``torch.autograd.backward``
with the gradient the next stage sent back; each stage steps its own optimizer (any
``torch.optim`` factory) on its worker. A step is one task per stage, pinned to its
worker, that runs the stage's schedule as a loop there; each micro-batch's activation
(forward) and input gradient (backward) goes straight from the stage's worker to the
next (previous) stage's worker, with no scheduler or client round trip per micro-batch;
parameters travel only in checkpoints and :meth:`state_dict`.

Schedules (the order each stage's loop runs its passes in, :func:`schedule_order`):

* ``"gpipe"`` (Huang et al., 2019): every forward, then every backward (the flush), so a
  stage stashes all ``m`` micro-batches; the bubble of equal stages is
  ``(p - 1) / (m + p - 1)``;
* ``"1f1b"`` (PipeDream-Flush, Narayanan et al., 2021; ``torch.distributed.pipelining``'s
  ``Schedule1F1B``): after ``p - s - 1`` warm-up forwards stage ``s`` alternates one forward
  and one backward, so it stashes at most ``p - s <= p`` micro-batches (measured:
  ``result.peak_activations``).

The **partition** comes from measurements: every module's forward+backward is timed on every
worker on a probe micro-batch, one module at a time (a probe never holds more than one
module's parameters), with its bytes of parameters, gradients and optimizer state after one
step; :func:`~blockflow.parallel.partition.partition_stages` picks the worker order and the
contiguous cut minimising the step's time (``m - 1`` micro-batches at the slowest stage's
pace, plus the bubble's fill and drain and the hops between stages at distributed's
bandwidth estimate), within each worker's free device memory
(``blockflow.parallel.memory-fraction`` of it). ``partition="equal"`` and
``partition="parameters"`` (DeepSpeed's ``partition_method``) are the baselines.

**Faults**: every ``checkpoint_every`` steps each stage's state is checkpointed, one copy on
its own worker and one on another (a spare worker when there is one). When a stage's worker
is lost mid-step, the stage is rebuilt on a survivor from its copy, every other stage rolls
back to the same checkpoint, and :meth:`PipelineParallel.fit` resumes from that step; where
no survivor has room (or the copy went too), one :class:`~blockflow.errors.WorkerLostError`
names the stage. Waits go through :func:`~blockflow.scheduling.wait.gather_as_done`,
which fails as soon as a needed worker leaves: never a hang.

The **timeline** (per stage and micro-batch: worker, phase, start and stop seconds of the
pass's compute, measured on the stage's worker; workers on other hosts are brought to the
scheduler's clock) is published in
the scheduler's metadata under ``("blockflow", "pipeline")`` for blockflow's dashboard page and :func:`blockflow.run_report`.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
import warnings
from typing import Any, Callable, Sequence

import numpy as np
from dask.utils import parse_timedelta

from blockflow import config
from blockflow.scheduling.view import workers_info
from blockflow.errors import BlockflowWarning, WorkerLostError
from blockflow.ml._pickling import FIX_TRAIN, dumps_or_explain
from blockflow.ml.parallel import _recovery, _stage
from blockflow.ml.parallel.partition import (
    equal_stages,
    parameter_stages,
    partition_stages,
    stage_times,
)
from blockflow.ml.parallel.schedule import (
    SCHEDULES,
    PipelineResult,
    bubble_fraction,
    schedule_order,
    timeline,
)
from blockflow.scheduling.view import worker_memory
from blockflow.scheduling.wait import gather_as_done

__all__ = ["METADATA_KEY", "PipelineParallel", "PipelineResult", "bubble_fraction",
           "schedule_order"]

logger = logging.getLogger(__name__)

#: Scheduler metadata key under which the latest pipeline run publishes its timeline.
METADATA_KEY = ("blockflow", "pipeline")

def _modules_of(model) -> list[tuple[str, Any]]:
    """(name, module) of each layer: a Sequential's children, or a list's items."""
    import torch

    if isinstance(model, torch.nn.Sequential):
        return list(model.named_children())
    if isinstance(model, (list, tuple)) and all(isinstance(m, torch.nn.Module) for m in model):
        return [(str(i), m) for i, m in enumerate(model)]
    raise TypeError(f"blockflow: PipelineParallel takes a torch.nn.Sequential or a list of "
                    f"torch.nn.Module, got {type(model).__name__}; wrap the model's layers "
                    f"in torch.nn.Sequential(...).")


def _refuse_batch_norm(named) -> None:
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


def _mse():
    import torch
    return torch.nn.MSELoss()


class PipelineParallel:
    """A PyTorch model cut into stages on different workers, trained on micro-batches.

    Parameters
    ----------
    client : distributed.Client
    model : torch.nn.Sequential or list of torch.nn.Module
        The model, in order; the output of each layer is the next one's input (one tensor).
    optimizer : callable, optional
        ``optimizer(params) -> torch.optim.Optimizer``, built on each stage's worker for its
        parameters (``torch.optim.Adam``, ``functools.partial(torch.optim.SGD, lr=0.1)``).
        Without one, :meth:`run` computes gradients and steps nothing.
    loss : callable, optional
        ``loss(output, target) -> scalar tensor``, any torch loss with ``reduction="mean"``
        over rows or ``"sum"``; default ``torch.nn.MSELoss()``.
    schedule : {"gpipe", "1f1b"}, default "gpipe"
    workers : sequence of str, optional
        Workers that may hold stages; default all, in address order. One stage per worker.
        ``"equal"`` and ``"parameters"`` put stage ``s`` on the ``s``-th of them (the device
        order, as ranks do in ``torch.distributed.pipelining``); ``"speed"`` picks the
        order.
    n_stages : int, optional
        Default: as many as workers (at most the number of layers).
    partition : {"speed", "equal", "parameters"} or (list of str, list of int), default "speed"
        ``"speed"``: from each layer's measured time on each worker and free device memory
        (see the module docstring); ``"equal"``: equal layer counts; ``"parameters"``: about
        equal parameter counts (DeepSpeed's); or ``(workers in stage order, bounds)``.
    sample : array or tensor, optional
        Input rows the layers are timed on (``"speed"``); default: the first micro-batch of
        the first :meth:`run` or :meth:`fit`, when the stages are then placed.
    probe_rows : int, default 32
        Rows of ``sample`` used by the probe.
    probe_repeats : int, default 2
        Timed passes per worker (the least counts), after a warm-up.
    checkpoint_every : int, optional
        Steps between checkpoints (0: none after the first); default config
        ``blockflow.parallel.checkpoint-every``.
    memory_fraction : float, optional
        Fraction (0-1) of each worker's free device memory a stage may take; default config
        ``blockflow.parallel.memory-fraction``.
    seed : int, default 0
        Seeds dropout: micro-batch ``j`` of step ``k`` on stage ``s`` draws from a generator
        seeded from ``(seed, k, j, s)``, so runs repeat.
    allow_batch_norm : bool, default False
        BatchNorm is refused (per-micro-batch statistics change the model) unless True.

    Attributes
    ----------
    stage_workers : list of str
        The worker of each stage, in pipeline order (after placement).
    bounds : list of int
        Stage ``s`` holds layers ``bounds[s]:bounds[s+1]``.
    layer_times : dict of str to list of float or None
        The measured seconds of each layer on each worker (``"speed"`` partition).
    layer_bytes : list of int or None
        Measured bytes of each layer's parameters, gradients and optimizer state.
    layer_output_bytes : list of int or None
        Measured bytes of each layer's output on the probe's rows (what a cut after it
        sends, and its gradient back).
    predicted_stage_times : list of float or None
        Per stage, the measured seconds of its layers on its worker.
    steps : int
        Optimizer steps taken.
    recoveries : list of dict
        One per lost stage worker survived: ``step`` (when), ``resumed_from`` (the
        checkpoint's step), ``stages`` (rebuilt), ``lost`` (workers).

    Raises
    ------
    TypeError
        If ``model`` is not a Sequential or a list of modules, or cannot be pickled.
    ValueError
        For BatchNorm (without ``allow_batch_norm``), no layers, workers not in the cluster,
        an unknown schedule or partition, or bounds that do not cut the layers into one
        non-empty stage per worker.
    """

    def __init__(self, client, model, *, optimizer: Callable | None = None,
                 loss: Callable | None = None, schedule: str = "gpipe",
                 workers: Sequence[str] | None = None, n_stages: int | None = None,
                 partition="speed", sample=None, probe_rows: int = 32,
                 probe_repeats: int = 2, checkpoint_every: int | None = None,
                 memory_fraction: float | None = None, seed: int = 0,
                 allow_batch_norm: bool = False):
        self._named = _modules_of(model)
        if not self._named:
            raise ValueError("blockflow: a pipeline needs at least one layer.")
        if not allow_batch_norm:
            _refuse_batch_norm(self._named)
        if schedule not in SCHEDULES:
            raise ValueError(f"blockflow: schedule must be one of {SCHEDULES}, got "
                             f"{schedule!r}.")
        # the layers travel to their stage's worker: refuse any that cannot, before anything
        # runs, as predict, Router and DataParallelTrainer do
        self._payloads = [dumps_or_explain(m, "blockflow.parallel.PipelineParallel",
                                           root=f"model[{name!r}]", fix=FIX_TRAIN)
                          for name, m in self._named]
        self.client, self.schedule = client, schedule
        self.optimizer, self.loss_fn = optimizer, loss if loss is not None else _mse()
        self.seed, self.probe_rows, self.probe_repeats = int(seed), probe_rows, probe_repeats
        self.checkpoint_every = int(config.get("parallel.checkpoint-every", checkpoint_every))
        self.memory_fraction = float(config.get("parallel.memory-fraction", memory_fraction))
        available = sorted(workers_info(client))
        # the order given is the device order (stage s on the s-th worker, as ranks in
        # torch.distributed.pipelining) for the equal and parameters baselines
        workers = [str(w) for w in workers] if workers is not None else available
        missing = sorted(set(workers) - set(available))
        if missing:
            raise ValueError(f"blockflow: workers {missing} are not in the cluster.")
        if len(set(workers)) != len(workers):
            raise ValueError(f"blockflow: workers lists a worker twice ({workers}); one stage "
                             f"per worker: name each once.")
        if not workers:
            raise RuntimeError("blockflow: the cluster has no workers; start some first.")
        self.workers = workers
        self.n_stages = min(n_stages or len(workers), len(workers), len(self._named))
        if isinstance(partition, str) and partition not in ("speed", "equal", "parameters"):
            raise ValueError(f"blockflow: partition must be 'speed', 'equal', 'parameters' "
                             f"or (workers, bounds), got {partition!r}.")
        if not isinstance(partition, str):
            order, bounds = list(partition[0]), [int(b) for b in partition[1]]
            n = len(self._named)
            if len(bounds) != len(order) + 1 or bounds[0] != 0 or bounds[-1] != n or any(
                    b <= a for a, b in zip(bounds, bounds[1:])):
                raise ValueError(f"blockflow: partition bounds must rise from 0 to {n} with "
                                 f"one stage per worker, got {bounds} for {len(order)} "
                                 f"workers.")
        self.partition = partition
        self.layer_times: dict[str, list[float]] | None = None
        self.layer_bytes: list[int] | None = None
        self.layer_output_bytes: list[int] | None = None
        self.predicted_stage_times: list[float] | None = None
        self.stage_workers: list[str] = []
        self.bounds: list[int] = []
        self.steps = 0
        self.recoveries: list[dict] = []
        self._keys: list[str] = []
        self._stage_bytes: list[int] = []
        self._ckpt: list[tuple] = []  # per stage: (own future, copy future or None)
        self._ckpt_step = 0
        if partition != "speed" or sample is not None:
            self._place(sample)

    # --- placement ---------------------------------------------------------------------

    def _stage_payload(self, s: int) -> bytes:
        import cloudpickle
        import torch

        a, b = self.bounds[s], self.bounds[s + 1]
        seq = torch.nn.Sequential()
        for name, m in self._named[a:b]:
            seq.add_module(name, m)
        return cloudpickle.dumps(seq)

    def measure(self, sample, workers: Sequence[str] | None = None
                ) -> tuple[dict[str, list[float]], list[int]]:
        """Each layer's forward+backward seconds on each worker, and its bytes.

        Parameters
        ----------
        sample : array or tensor
            Input rows (the first ``probe_rows`` are used).
        workers : sequence of str, optional
            Default: the pipeline's workers.

        Returns
        -------
        (dict of str to list of float, list of int)
            Worker address -> seconds per layer; bytes of each layer's parameters,
            gradients and optimizer state after one step (from the first worker).
        """
        x = sample[: self.probe_rows]
        futs = {w: self.client.submit(_stage.probe, self._payloads, x, self.probe_repeats,
                                      self.optimizer, workers=[w], allow_other_workers=False,
                                      pure=False)
                for w in (workers or self.workers)}
        got = self._gather(list(futs.values()), needed=set(futs),
                           what="the pipeline's layer probe")
        times = {w: [float(t) for t in g[0]] for w, g in zip(futs, got)}
        self.layer_output_bytes = [int(b) for b in got[0][2]]
        return times, [int(b) for b in got[0][1]]

    def _capacity(self) -> dict[str, float]:
        mem = worker_memory(self.client)
        return {w: self.memory_fraction * float(mem[w].free) if w in mem else math.inf
                for w in self.workers}

    def _transfer(self) -> list[float]:
        """Seconds to send each layer's output (on the probe's rows) to the next stage and
        its gradient back, at distributed's bandwidth estimate."""
        import dask
        from dask.utils import parse_bytes

        bandwidth = dask.config.get("distributed.scheduler.bandwidth")
        bandwidth = float(parse_bytes(bandwidth) if isinstance(bandwidth, str) else bandwidth)
        return [2 * b / bandwidth for b in (self.layer_output_bytes or [])[:-1]]

    def _place(self, sample, n_micro_batches: int | None = None) -> None:
        p = self.n_stages
        if self.partition == "speed":
            if sample is None:
                raise ValueError("blockflow: the speed partition needs sample rows to time "
                                 "the layers on; pass sample= or call run()/fit() first.")
            self.layer_times, self.layer_bytes = self.measure(sample)
            capacity = self._capacity()
            # the step's time: m - 1 micro-batches at the slowest stage's pace, plus the
            # fill and drain (one micro-batch through every stage and back) and its hops
            m = n_micro_batches or p * int(config.get("parallel.micro-batches-per-stage"))
            order, bounds = partition_stages(self.layer_times, p, layer_bytes=self.layer_bytes,
                                             capacity=capacity, n_micro_batches=m,
                                             transfer=self._transfer())
            self.predicted_stage_times = stage_times(self.layer_times, bounds, order)
        elif self.partition == "equal":
            order, bounds = equal_stages(len(self._named), self.workers[:p])
        elif self.partition == "parameters":
            counts = [sum(q.numel() for q in m.parameters()) for _, m in self._named]
            order, bounds = parameter_stages(counts, self.workers[:p])
        else:
            order, bounds = [str(w) for w in self.partition[0]], list(self.partition[1])
        self.stage_workers, self.bounds = list(order), [int(b) for b in bounds]
        self.n_stages = len(order)
        logger.info("blockflow: pipeline of %d layers in %d stages: layers %s on workers %s "
                    "(partition %s; measured stage seconds %s)", len(self._named), len(order),
                    [f"{a}:{b}" for a, b in zip(bounds, bounds[1:])], order,
                    self.partition if isinstance(self.partition, str) else "given",
                    None if self.predicted_stage_times is None
                    else [round(t, 4) for t in self.predicted_stage_times])
        if not all(self.client.run(_stage.has_handler).values()):
            # the comm handler stages send activations and gradients to, on every worker
            # (and those that join later: a rebuilt stage's)
            self.client.register_plugin(_stage.PipePlugin(), name=_stage.PipePlugin.name)
        token = uuid.uuid4().hex[:10]
        self._keys = [f"stage-{s}-{token}" for s in range(len(order))]
        futs = [self.client.submit(_stage.install, self._keys[s], self._stage_payload(s),
                                   self.optimizer, self.loss_fn, self.seed, s,
                                   workers=[w], allow_other_workers=False, pure=False,
                                   key=f"pipeline-install-{self._keys[s]}")
                for s, w in enumerate(order)]
        self._stage_bytes = self._gather(futs, needed=set(order), what="placing the stages")
        self._checkpoint()

    def _stage_name(self, s: int) -> str:
        a, b = self.bounds[s], self.bounds[s + 1] - 1
        names = [n for n, _ in self._named]
        return f"stage {s} (layers {names[a]}-{names[b]})" if b > a else \
            f"stage {s} (layer {names[a]})"

    # --- waiting -----------------------------------------------------------------------

    def _alive(self) -> set[str]:
        return set(workers_info(self.client))

    def _gather(self, futures: list, *, needed: set, what: str) -> list:
        """Results in order; a lost needed worker raises WorkerLostError at once."""
        index = {f.key: i for i, f in enumerate(futures)}
        out: list = [None] * len(futures)

        def get(f):
            out[index[f.key]] = f.result()
            return None

        gather_as_done(futures, alive=self._alive, needed=needed, get=get)
        return out

    # --- checkpoints and recovery (blockflow.ml.parallel._recovery) -------------------

    def _checkpoint(self) -> None:
        _recovery.checkpoint(self)

    def _recover(self, lost: set[str], what: str) -> list[str]:
        return _recovery.recover(self, lost, what)

    # --- a step ------------------------------------------------------------------------

    def _micro_batches(self, n_rows: int, n_micro_batches: int | None) -> int:
        if n_micro_batches is None:
            p = self.n_stages
            return max(1, min(p * int(config.get("parallel.micro-batches-per-stage")), n_rows))
        m = n_micro_batches
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or not 1 <= m <= n_rows:
            # each micro-batch needs a row: fewer would run than asked, silently
            raise ValueError(f"blockflow: n_micro_batches={n_micro_batches!r} for a batch of "
                             f"{n_rows} rows; a micro-batch needs at least one row: pass "
                             f"n_micro_batches between 1 and {n_rows}.")
        return int(m)

    def _weight(self, rows: int, total: int) -> float:
        reduction = getattr(self.loss_fn, "reduction", "mean")
        if reduction == "sum":
            return 1.0
        if reduction != "mean":
            raise ValueError(f"blockflow: the loss's reduction must be 'mean' or 'sum', got "
                             f"{reduction!r}.")
        return rows / total

    def run(self, X, target=None, *, n_micro_batches: int | None = None,
            return_grads: bool = False, return_output: bool = True, publish: bool = True,
            name: str = "pipeline") -> PipelineResult:
        """One step on the batch: forward, and with a target backward and the optimizer.

        Parameters
        ----------
        X : array or tensor, shape (n_samples, ...)
        target : array or tensor, shape (n_samples, ...), optional
            With a target the loss is formed on the last stage, the backward pass runs and
            each stage's optimizer (if any) steps.
        n_micro_batches : int, optional
            Between 1 and the batch's rows; micro-batches differ by at most one row when
            the count does not divide the batch (8 rows in 3: 3, 3, 2). Default ``stages x``
            config ``blockflow.parallel.micro-batches-per-stage``, at most the rows.
        return_grads : bool, default False
            Gather the gradients (before the optimizer step) into ``result.grads``.
        return_output : bool, default True
            Gather the model's output into ``result.output``.
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
            If ``n_micro_batches`` is below 1 or above the rows (before anything runs), the
            batch is empty, or ``target``'s rows differ from ``X``'s.
        WorkerLostError
            If a stage's worker was lost and nothing could rebuild the stage (the message
            names it).
        """
        n = len(X)
        if n == 0:
            raise ValueError("blockflow: the pipeline got a batch of 0 rows; pass at least "
                             "one row.")
        m = self._micro_batches(n, n_micro_batches)
        if target is not None and len(target) != n:
            raise ValueError(f"blockflow: target has {len(target)} rows but X has {n}; pass "
                             f"one target row per sample.")
        sizes = [len(a) for a in np.array_split(np.arange(n), m)]
        cuts = np.concatenate([[0], np.cumsum(sizes)])
        xs = [X[cuts[j]:cuts[j + 1]] for j in range(m)]
        ts = None if target is None else [target[cuts[j]:cuts[j + 1]] for j in range(m)]
        return self._step(xs, ts, sizes, return_grads=return_grads,
                          return_output=return_output, publish=publish, name=name)

    def _step(self, xs: list, ts: list | None, sizes: list[int], **kw) -> PipelineResult:
        """A step with recovery: a lost stage worker rebuilds and the step runs again."""
        if not self.stage_workers:
            self._place(_first(xs[0]), len(xs))
        recovered: list[str] = []
        while True:
            try:
                result = self._try_step(xs, ts, sizes, **kw)
                break
            except WorkerLostError as e:
                lost = set(e.lost) - self._alive() or set(self.stage_workers) - self._alive()
                if not lost:
                    raise
                before = self.steps
                stages = self._recover(lost, f"the pipeline step over {sum(sizes)} rows")
                recovered += stages
                self.recoveries.append({"step": before, "resumed_from": self.steps,
                                        "stages": stages, "lost": sorted(lost)})
                if self.steps < before:
                    warnings.warn(
                        f"blockflow: the pipeline rolled back to the checkpoint of step "
                        f"{self.steps} after losing a stage's worker: steps {self.steps + 1}-"
                        f"{before} are undone (fit() replays them; checkpoint_every=1 loses "
                        f"none).", BlockflowWarning, stacklevel=3)
                    raise _RolledBack(before) from None
        result.recovered = recovered
        return result

    def _try_step(self, xs, ts, sizes, *, return_grads, return_output, publish, name):
        c, p, m = self.client, len(self.stage_workers), len(xs)
        gone = set(self.stage_workers) - self._alive()
        if gone:  # lost between steps: rebuild before sending it anything
            raise WorkerLostError(f"blockflow: workers lost: {sorted(gone)}", lost=gone)
        train = ts is not None
        token = uuid.uuid4().hex[:8]
        total = sum(sizes)
        try:
            inputs = _place_data(c, xs, self.stage_workers[0])
            targets = _place_data(c, ts, self.stage_workers[-1]) if train else None
        except Exception:
            gone = set(self.stage_workers) - self._alive()
            if gone:  # the worker left while the data went to it
                raise WorkerLostError(f"blockflow: workers lost: {sorted(gone)}",
                                      lost=gone) from None
            raise
        weights = [self._weight(n, total) for n in sizes] if train else None
        want_output = return_output or not train
        wait = parse_timedelta(config.get("parallel.stage-wait"))
        # one task per stage: the stage runs its schedule as a loop on its worker and
        # sends activations and gradients straight to its neighbours' workers
        futures = []
        for s, w in enumerate(self.stage_workers):
            order = (schedule_order(self.schedule, p, m, s) if train
                     else [("F", j) for j in range(m)])
            plan = {"train": train, "order": order, "name": self._stage_name(s),
                    "prev": (self.stage_workers[s - 1], self._keys[s - 1]) if s else None,
                    "next": ((self.stage_workers[s + 1], self._keys[s + 1]) if s < p - 1
                             else None),
                    "weights": weights if s == p - 1 else None,
                    "want_output": want_output and s == p - 1,
                    "want_grads": return_grads, "step_optimizer": self.optimizer is not None,
                    "wait": wait}
            futures.append(c.submit(
                _stage.run, self._keys[s], token, self.steps, plan,
                inputs if s == 0 else None, targets if s == p - 1 else None,
                workers=[w], allow_other_workers=False, pure=False,
                key=f"{name}-stage-{token}-{s}"))
        try:
            done = self._gather(futures, needed=set(self.stage_workers),
                                what="the pipeline step")
        except BaseException:
            self._cancel_step(token, futures)
            raise
        output = None
        if want_output:
            output = np.concatenate([np.asarray(o) for o in done[-1]["outputs"]])
        loss = grads = None
        peaks: list[int] = []
        if train:
            loss = float(done[-1]["loss"])
            peaks = [int(f["peak_stash"]) for f in done]
            self._stage_bytes = [max(b, int(f["bytes"]))
                                 for b, f in zip(self._stage_bytes, done)]
            if return_grads:
                grads = {k: (None if v is None else v.numpy()) for f in done
                         for k, v in f["grads"].items()}
            self.steps += 1
            if self.checkpoint_every and self.steps % self.checkpoint_every == 0:
                self._checkpoint()
        # one host has one clock; across hosts each worker's offset to the scheduler's
        hosts = {_host(w) for w in self.stage_workers}
        tasks = timeline([[(ph, j, a + f["clock"], b + f["clock"]) for ph, j, a, b in
                           f["records"]] if len(hosts) > 1 else f["records"] for f in done],
                         self.stage_workers)
        makespan = float(tasks.stop.max()) if len(tasks) else 0.0
        result = PipelineResult(output=output, loss=loss, grads=grads, timeline=tasks,
                                makespan=makespan, n_micro_batches=m, n_stages=p,
                                rows=total, micro_batch_rows=list(sizes),
                                schedule=self.schedule if train else "gpipe",
                                peak_activations=peaks)
        if publish:
            self._publish(result, name)
        return result

    def _cancel_step(self, token: str, futures: list) -> None:
        """End a failed step's stage loops on the workers still there (they would wait for
        a lost neighbour), then forget its tasks."""
        alive = self._alive()
        c = self.client

        async def send():
            import asyncio
            calls = [asyncio.wait_for(getattr(c.rpc(w), _stage.HANDLER)(
                key=k, token=token, cancel=True), 10)
                for k, w in zip(self._keys, self.stage_workers) if w in alive]
            return await asyncio.gather(*calls, return_exceptions=True)

        try:
            c.sync(send)
        except Exception as e:  # the workers are gone too: nothing waits there
            logger.debug("blockflow: cancelling pipeline step %s: %s", token, e)
        c.cancel(futures)

    # --- training and inference --------------------------------------------------------

    def fit(self, X, y, *, epochs: int = 1, batch_size: int | None = None,
            n_micro_batches: int | None = None, shuffle: bool = True,
            callback: Callable | None = None) -> "PipelineParallel":
        """Train on ``(X, y)`` for ``epochs``, one pipeline step per batch.

        Parameters
        ----------
        X : dask.array.Array or array, shape (n_samples, ...)
            Batches are sliced from it on the cluster and sent to the first stage's worker;
            the data never pass through the client when ``X`` is a dask array.
        y : dask.array.Array or array, shape (n_samples, ...)
            Sent to the last stage's worker.
        epochs : int, default 1
        batch_size : int, optional
            Rows per step; default 256 (at most the rows).
        n_micro_batches : int, optional
            As for :meth:`run`.
        shuffle : bool, default True
            Visit the batches in a new order each epoch (seeded by ``seed``); rows within a
            batch stay contiguous.
        callback : callable, optional
            ``callback(epoch, step, loss)`` after each step.

        Returns
        -------
        PipelineParallel
            ``self``; ``history_`` holds one row per step (``epoch``, ``step``, ``loss``,
            ``seconds``, ``recovered``).

        Raises
        ------
        ValueError
            Without an optimizer, or for rows of ``X`` and ``y`` that differ.
        WorkerLostError
            When a stage's worker is lost and nothing can rebuild it.
        """
        import dask.array as da

        if self.optimizer is None:
            raise ValueError("blockflow: fit() needs an optimizer: pass optimizer= to "
                             "PipelineParallel (e.g. torch.optim.Adam).")
        X = X if isinstance(X, da.Array) else da.from_array(np.asarray(X), chunks=(
            max(1, math.ceil(len(X) / 8)),) + np.shape(X)[1:])
        y = y if isinstance(y, da.Array) else da.from_array(np.asarray(y), chunks=(
            X.chunks[0],) + np.shape(y)[1:])
        if X.shape[0] != y.shape[0]:
            raise ValueError(f"blockflow: X has {X.shape[0]} rows but y has {y.shape[0]}; "
                             f"pass labels for every sample.")
        X, y = self.client.persist([X, y])
        n = X.shape[0]
        bs = min(int(batch_size or 256), n)
        starts = list(range(0, n, bs))
        rng = np.random.default_rng(self.seed)
        plan = [(e, b) for e in range(epochs)
                for b in (rng.permutation(starts) if shuffle else starts)]
        self.history_: list[dict] = []
        if not self.stage_workers:
            self._place(_first(X[: self.probe_rows]), self._micro_batches(bs, n_micro_batches))
        if self._ckpt_step != self.steps:  # a rollback never reaches back before this fit
            self._checkpoint()
        start_step = self.steps
        i = 0
        while i < len(plan):
            epoch, lo = plan[i]
            hi = min(lo + bs, n)
            rows = hi - lo
            m = self._micro_batches(rows, n_micro_batches)
            sizes = [len(a) for a in np.array_split(np.arange(rows), m)]
            cuts = lo + np.concatenate([[0], np.cumsum(sizes)])
            xs = [X[cuts[j]:cuts[j + 1]] for j in range(m)]
            ts = [y[cuts[j]:cuts[j + 1]] for j in range(m)]
            t0 = time.perf_counter()
            try:
                r = self._step(xs, ts, sizes, return_grads=False, return_output=False,
                               publish=False, name="pipeline-fit")
            except _RolledBack:
                i = self.steps - start_step  # replay from the checkpoint's step
                self.history_ = self.history_[:i]
                continue
            self.history_.append({"epoch": epoch, "step": self.steps, "loss": r.loss,
                                  "seconds": time.perf_counter() - t0,
                                  "recovered": r.recovered})
            if callback is not None:
                callback(epoch, self.steps, r.loss)
            i += 1
        return self

    def predict(self, X, *, n_micro_batches: int | None = None,
                batch_size: int | None = None) -> np.ndarray:
        """The model's output on ``X`` (evaluation mode, no gradients).

        Parameters
        ----------
        X : dask.array.Array or array, shape (n_samples, ...)
        n_micro_batches : int, optional
            Per batch, as for :meth:`run`.
        batch_size : int, optional
            Rows per pass; default 1024.

        Returns
        -------
        numpy.ndarray
        """
        import dask.array as da

        n = X.shape[0]
        if isinstance(X, da.Array):
            X = self.client.persist(X)
        bs = min(int(batch_size or 1024), n)
        outs = []
        for lo in range(0, n, bs):
            rows = min(bs, n - lo)
            m = self._micro_batches(rows, n_micro_batches)
            sizes = [len(a) for a in np.array_split(np.arange(rows), m)]
            cuts = lo + np.concatenate([[0], np.cumsum(sizes)])
            xs = [X[cuts[j]:cuts[j + 1]] for j in range(m)]
            outs.append(self._step(xs, None, sizes, return_grads=False, return_output=True,
                                   publish=False, name="pipeline-predict").output)
        return np.concatenate(outs)

    def state_dict(self) -> dict:
        """The model's ``state_dict()``, reassembled on the client from every stage (keys as
        in the original model's; tensors on the CPU)."""
        futs = [self.client.submit(_stage.state, k, workers=[w], allow_other_workers=False,
                                   pure=False) for k, w in zip(self._keys, self.stage_workers)]
        out: dict = {}
        for part in self._gather(futs, needed=set(self.stage_workers), what="state_dict()"):
            out.update(part)
        return out

    def memory_peaks(self, reset: bool = False) -> dict[str, int]:
        """Per worker: the most bytes of parameters, gradients and optimizer state it held
        at once (its stages, and the probe's one layer at a time), measured on the worker."""
        return self.client.run(_stage.peaks, reset, workers=self.workers)

    def stage_bytes(self) -> list[int]:
        """Per stage: bytes of its parameters, gradients and optimizer state (the most seen
        at the end of a step)."""
        return list(self._stage_bytes)

    def _stage_roles(self) -> dict[str, str]:
        return {w: self._stage_name(s) for s, w in enumerate(self.stage_workers)}

    def close(self) -> None:
        """Drop the stages and their checkpoints from the workers."""
        alive = self._alive()
        futs = [self.client.submit(_stage.drop, k, workers=[w], allow_other_workers=False,
                                   pure=False)
                for k, w in zip(self._keys, self.stage_workers) if w in alive]
        self._ckpt, self._keys = [], []
        if futs:
            self._gather(futs, needed={f"{w}" for w in self.stage_workers if w in alive},
                         what="dropping the stages")

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


class _RolledBack(Exception):
    """A step lost a stage and the pipeline rolled back to an earlier checkpoint."""


def _host(address: str) -> str:
    """The host part of a worker's address (``tcp://10.0.0.1:4567`` -> ``10.0.0.1``)."""
    return address.split("://")[-1].rsplit(":", 1)[0]


def _first(x):
    import dask.array as da
    return x.compute() if isinstance(x, da.Array) else x


def _place_data(client, parts: list, worker: str) -> list:
    """Futures of ``parts`` on ``worker``: dask slices computed there, the rest scattered."""
    import dask.array as da
    from distributed import futures_of

    # loose: the slices' keys are deterministic, so a later step (or the step replayed after
    # a recovery) reuses tasks placed before; pinned to a worker that has since left, they
    # would wait in "no-worker" for ever. Loose, they are recomputed on a survivor.
    on = dict(workers=[worker], allow_other_workers=True)
    if all(isinstance(a, da.Array) for a in parts):
        done = client.persist([a.rechunk(-1) for a in parts], **on)
        return [futures_of(d)[0] for d in done]
    return client.scatter(list(parts), workers=[worker], hash=False)
