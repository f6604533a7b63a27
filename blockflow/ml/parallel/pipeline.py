"""Pipeline parallelism for PyTorch models on ``torch.distributed.pipelining``.

blockflow measures each layer on each worker, chooses the contiguous split and the worker
order of least step time (:func:`~blockflow.parallel.partition_stages`; ``"equal"`` and
``"parameters"``, DeepSpeed's, are baselines) and forms a torch.distributed group of one
rank per stage worker (:func:`blockflow.ml._group.run_group`); torch runs the schedule
(``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, Huang et al. 2019,
Narayanan et al. 2021) and sends activations and gradients point to point. Training runs
in segments of ``checkpoint_every`` steps, one group each. Guide: docs/guide/ai.md.
"""

from __future__ import annotations

import math
from concurrent.futures import CancelledError
from typing import Callable, Sequence

import dask.array as da
import numpy as np

from blockflow import config
from blockflow.ml._pickling import FIX_TRAIN, dumps_or_explain
from blockflow.ml.parallel import _placement, _stage, _step
from blockflow.ml.parallel._step import METADATA_KEY
from blockflow.ml.parallel.schedule import (
    SCHEDULES,
    PipelineResult,
    bubble_fraction,
)
from blockflow.errors import WorkerLostError
from blockflow.ml._group import first_kept, gone_workers, worker_processes
from blockflow.scheduling.view import workers_info
from blockflow.scheduling.wait import gather_as_done

__all__ = ["METADATA_KEY", "PipelineParallel", "PipelineResult", "bubble_fraction"]


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
    schedule : {"gpipe", "1f1b", "interleaved1f1b"}, default "gpipe"
        torch's ``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B`` (several
        virtual stages per rank: ``n_stages`` a multiple of the ranks).
    workers : sequence of str, optional
        Workers that may hold stages, one rank each (one per worker process); default
        all, in address order.
    n_stages : int, optional
        Default: as many as workers (at most the number of layers); for
        ``"interleaved1f1b"`` twice that.
    partition : {"speed", "equal", "parameters"} or (list of str, list of int), default "speed"
        Measured layer times and memory, equal layer counts, about equal parameter counts,
        or ``(workers in stage order, bounds)``.
    sample : array or tensor, optional
        Input rows the layers are timed on; default the first micro-batch of the first run.
    probe_rows : int, default 32
        Rows of ``sample`` used by the probe.
    probe_repeats : int, default 2
        Timed passes per worker (the least counts), after a warm-up.
    checkpoint_every : int, optional
        Steps per segment: one torch.distributed group runs them and ends with every
        stage's checkpoint (model and optimizer state) kept in worker memory on two
        workers; 0 a whole ``fit`` in one segment. Default config
        ``blockflow.ml.checkpoint-every``; when that is null too, segments of about
        ``blockflow.ml.checkpoint-seconds`` from the measured step time (the first runs
        the steps that fit in it, timed on the ranks after two).
    memory_fraction : float, optional
        Fraction (0-1) of each worker's free device memory a stage may take; default config
        ``blockflow.parallel.memory-fraction``.
    seed : int, default 0
        Seeds dropout per ``(seed, step, micro-batch, stage)``, so runs repeat whatever
        the placement.
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
        Measured bytes of each layer's output on the probe's rows.
    predicted_stage_times : list of float or None
        Per stage, the measured seconds of its layers on its worker.
    steps : int
        Optimizer steps taken.
    ranks : list of str
        The group's workers in rank order (stage ``s`` runs on rank ``s % len(ranks)``).
    recoveries : list of dict
        One per lost worker survived: ``step`` (reached when lost), ``resumed_from`` (the
        checkpoint's step), ``redone`` (steps run again), ``stages``, ``lost``.

    Raises
    ------
    TypeError
        If ``model`` is not a Sequential or a list of modules, or cannot be pickled.
    ValueError
        For BatchNorm (without ``allow_batch_norm``), no layers, unknown workers, schedule
        or partition, or bounds that do not give one non-empty stage per worker.
    """

    def __init__(self, client, model, *, optimizer: Callable | None = None,
                 loss: Callable | None = None, schedule: str = "gpipe",
                 workers: Sequence[str] | None = None, n_stages: int | None = None,
                 partition="speed", sample=None, probe_rows: int = 32,
                 probe_repeats: int = 2, checkpoint_every: int | None = None,
                 memory_fraction: float | None = None, seed: int = 0,
                 allow_batch_norm: bool = False):
        self._named = _placement.modules_of(model)
        if not self._named:
            raise ValueError("blockflow: a pipeline needs at least one layer.")
        if not allow_batch_norm:
            _placement.refuse_batch_norm(self._named)
        if schedule not in SCHEDULES:
            raise ValueError(f"blockflow: schedule must be one of {SCHEDULES}, got "
                             f"{schedule!r}.")
        # the layers travel to their stage's worker: refuse any that cannot, before anything
        # runs, as predict, Router and DataParallelTrainer do
        self._payloads = [dumps_or_explain(m, "blockflow.parallel.PipelineParallel",
                                           root=f"model[{name!r}]", fix=FIX_TRAIN)
                          for name, m in self._named]
        self.client, self.schedule = client, schedule
        self.optimizer, self.loss_fn = optimizer, loss if loss is not None else _placement.mse()
        self.seed, self.probe_rows, self.probe_repeats = int(seed), probe_rows, probe_repeats
        every = config.get("ml.checkpoint-every", checkpoint_every)
        self.checkpoint_every = None if every is None else int(every)
        self.memory_fraction = float(config.get("parallel.memory-fraction", memory_fraction))
        available = sorted(workers_info(client))
        # the order given is the device order (stage s on the s-th worker, as ranks in
        # torch.distributed.pipelining) for the equal and parameters baselines
        workers = [str(w) for w in workers] if workers is not None else available
        missing = sorted(set(workers) - set(available))
        if missing:
            raise ValueError(f"blockflow: workers {missing} are not in the cluster.")
        if len(set(workers)) != len(workers):
            raise ValueError(f"blockflow: workers lists a worker twice ({workers}); one rank "
                             f"per worker: name each once.")
        if not workers:
            raise RuntimeError("blockflow: the cluster has no workers; start some first.")
        # a worker process holds one torch.distributed rank
        self.workers = worker_processes(client, workers)
        self.virtual = 2 if schedule == "interleaved1f1b" else 1
        if n_stages is not None and schedule == "interleaved1f1b":
            ranks = min(len(self.workers), max(1, int(n_stages) // 2))
            if int(n_stages) % ranks:
                raise ValueError(f"blockflow: the interleaved 1F1B schedule needs n_stages a "
                                 f"multiple of its ranks ({ranks}), got {n_stages}.")
            self.virtual = max(1, int(n_stages) // ranks)
        self.requested_stages = int(n_stages or len(self.workers) * self.virtual)
        self.n_stages = min(self.requested_stages, len(self.workers) * self.virtual,
                            len(self._named))
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
        self.ranks: list[str] = []
        self.bounds: list[int] = []
        self.steps = 0
        self.recoveries: list[dict] = []
        self._stage_bytes: list[int] = []
        self._layer_futs: list = []
        self._ckpt: list[tuple] = []  # per stage: (first layer, end layer, state future)
        if partition != "speed" or sample is not None:
            self._place(sample)

    # --- placement -------------------------------------------------------------------

    def measure(self, sample, workers: Sequence[str] | None = None
                ) -> tuple[dict[str, list[float]], list[int]]:
        """Each layer's forward+backward seconds on each worker (on the first ``probe_rows``
        of ``sample``; ``workers`` default the pipeline's), and each layer's bytes of
        parameters, gradients and optimizer state: ``({worker: [seconds]}, [bytes])``."""
        return _placement.measure(self, sample, workers)

    def _place(self, sample, n_micro_batches: int | None = None) -> None:
        _placement.place(self, sample, n_micro_batches)

    def _stage_name(self, s: int) -> str:
        a, b = self.bounds[s], self.bounds[s + 1] - 1
        names = [n for n, _ in self._named]
        return f"stage {s} (layers {names[a]}-{names[b]})" if b > a else \
            f"stage {s} (layer {names[a]})"

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

    def _batches(self, X, target, lo: int, rows: int, m: int) -> tuple:
        sizes = _step.micro_sizes(rows, m)
        return (X[lo:lo + rows], None if target is None else target[lo:lo + rows], sizes)

    # --- training and inference --------------------------------------------------------

    def run(self, X, target=None, *, n_micro_batches: int | None = None,
            return_grads: bool = False, return_output: bool = True, publish: bool = True,
            name: str = "pipeline") -> PipelineResult:
        """One step on the batch: forward, and with a target backward and the optimizer.

        One short segment: a torch.distributed group of the stage workers runs the step
        from the last checkpoint and leaves the new one on the workers.

        Parameters
        ----------
        X : array or tensor, shape (n_samples, ...)
        target : array or tensor, shape (n_samples, ...), optional
            With a target the loss, backward pass and optimizer step run too.
        n_micro_batches : int, optional
            1 to the batch's rows; default ``stages x`` config
            ``blockflow.parallel.micro-batches-per-stage``. Micro-batches differ by at
            most one row (shorter ones are padded for torch and the padding ignored).
        return_grads : bool, default False
            Gather the gradients (before the optimizer step) into ``result.grads``.
        return_output : bool, default True
            Gather the model's output into ``result.output``.
        publish : bool, default True
            Publish the timeline in the scheduler's metadata.
        name : str, default "pipeline"
            Label of the run on the dashboard.

        Returns
        -------
        PipelineResult

        Raises
        ------
        ValueError
            If ``n_micro_batches`` is out of range, the batch is empty, or ``target``'s rows
            differ from ``X``'s.
        WorkerLostError
            If a stage's worker was lost and nothing could take its layers.
        """
        n = len(X)
        if n == 0:
            raise ValueError("blockflow: the pipeline got a batch of 0 rows; pass at least "
                             "one row.")
        if target is not None and len(target) != n:
            raise ValueError(f"blockflow: target has {len(target)} rows but X has {n}; pass "
                             f"one target row per sample.")
        m = _step.micro_batches(self, n, n_micro_batches)
        if not self.stage_workers:
            self._place(_step.first(X[: self.probe_rows]), m)
            m = _step.micro_batches(self, n, n_micro_batches)
        train = target is not None
        batch = self._batches(X, target, 0, n, m)
        seg = _step.run_steps(self, [batch], train=train, want_grads=return_grads,
                              want_output=return_output or not train,
                              what=f"the pipeline step over {n} rows")[-1]
        result = _step.result_of(self, seg, batch[2], train, self.schedule)
        if publish:
            _step.publish_timeline(self, result, name)
        return result

    def fit(self, X, y, *, epochs: int = 1, batch_size: int | None = None,
            n_micro_batches: int | None = None, shuffle: bool = True,
            callback: Callable | None = None) -> "PipelineParallel":
        """Train on ``(X, y)`` for ``epochs``, one pipeline step per batch.

        Steps run in segments of ``checkpoint_every``: one torch.distributed group per
        segment, the first stage's rank reading the batches and the last stage's rank the
        targets from Dask futures placed on their workers.

        Parameters
        ----------
        X : dask.array.Array or array, shape (n_samples, ...)
            Batches are sliced on the cluster and computed on the first stage's worker.
        y : dask.array.Array or array, shape (n_samples, ...)
            Computed on the last stage's worker.
        epochs : int, default 1
        batch_size : int, optional
            Rows per step; default 256 (at most the rows).
        n_micro_batches : int, optional
            As for :meth:`run`.
        shuffle : bool, default True
            New batch order each epoch (seeded by ``seed``).
        callback : callable, optional
            ``callback(epoch, step, loss)`` after each step (called as each segment ends).

        Returns
        -------
        PipelineParallel
            ``self``; ``history_`` has one row per step (``epoch``, ``step``, ``loss``,
            ``seconds``: the step's time on the last stage's rank).

        Raises
        ------
        ValueError
            Without an optimizer, or for rows of ``X`` and ``y`` that differ.
        WorkerLostError
            When a stage's worker is lost and nothing can take its layers.
        """
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
        plan = [(e, int(b)) for e in range(epochs)
                for b in (rng.permutation(starts) if shuffle else starts)]
        if not self.stage_workers:
            self._place(_step.first(X[: self.probe_rows]),
                        _step.micro_batches(self, bs, n_micro_batches))
        batches = []
        for _, lo in plan:
            rows = min(lo + bs, n) - lo
            batches.append(self._batches(X, y, lo, rows,
                                         _step.micro_batches(self, rows, n_micro_batches)))
        self.history_: list[dict] = []
        first_step = self.steps

        def done(i, summaries):
            last = next(s for s in summaries if self.n_stages - 1 in s["stages"])
            for k, (loss, sec) in enumerate(zip(last["losses"], last["seconds"])):
                epoch = plan[i + k][0]
                self.history_.append({"epoch": epoch, "step": first_step + i + k + 1,
                                      "loss": loss, "seconds": sec})
                if callback is not None:
                    callback(epoch, first_step + i + k + 1, loss)

        _step.run_steps(self, batches, train=True, callback=done,
                        what=f"fit() over {n} rows")
        return self

    def predict(self, X, *, n_micro_batches: int | None = None,
                batch_size: int | None = None) -> np.ndarray:
        """The model's output on ``X`` as a NumPy array (evaluation mode, no gradients),
        one group over every batch.

        Parameters
        ----------
        X : dask.array.Array or array, shape (n_samples, ...)
        n_micro_batches : int, optional
            Per batch, as for :meth:`run`.
        batch_size : int, optional
            Rows per pass; default 1024.
        """
        n = X.shape[0]
        if isinstance(X, da.Array):
            X = self.client.persist(X)
        bs = min(int(batch_size or 1024), n)
        if not self.stage_workers:
            self._place(_step.first(X[: self.probe_rows]))
        batches = [self._batches(X, None, lo, min(bs, n - lo),
                                 _step.micro_batches(self, min(bs, n - lo), n_micro_batches))
                   for lo in range(0, n, bs)]
        segs = _step.run_steps(self, batches, train=False, want_output=True,
                               what=f"predict() over {n} rows")
        outs = []
        for seg in segs:
            last = next(s for s in seg["summaries"] if self.n_stages - 1 in s["stages"])
            outs += [o.float().numpy() if str(o.dtype) in ("torch.bfloat16", "torch.float16")
                     else o.numpy() for o in last["outputs"]]
        return np.concatenate(outs)

    def state_dict(self) -> dict:
        """The model's ``state_dict()`` reassembled from every stage's checkpoint (tensors
        on the CPU); before any step, the model as given."""
        if not self._ckpt:
            import torch

            return {f"{name}.{k}": v for name, m in self._named
                    for k, v in m.state_dict().items()} if self._named else \
                torch.nn.Sequential().state_dict()
        for _ in range(2):  # a copy whose worker just died: the other, once known lost
            kept = [first_kept(k) for _, _, k in self._ckpt]
            if any(k is None for k in kept):
                break
            futs = [self.client.submit(_stage.model_state, k, pure=False) for k in kept]
            try:
                parts = self.client.gather(futs)
            except (CancelledError, OSError):
                gone_workers(self.client, self.ranks)
                continue
            out: dict = {}
            for part in parts:
                out.update(_stage._loads(part))
            return out
        raise WorkerLostError(f"blockflow: PipelineParallel.state_dict: the checkpoint of "
                              f"step {self.steps} was lost with its workers (both copies); "
                              f"build the PipelineParallel again.", lost=[])

    def stage_bytes(self) -> list[int]:
        """Per stage: bytes of its parameters, gradients and optimizer state (last step)."""
        return list(self._stage_bytes)

    def close(self) -> None:
        """Forget the checkpoints and layers kept on the workers."""
        self._ckpt, self._layer_futs = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

