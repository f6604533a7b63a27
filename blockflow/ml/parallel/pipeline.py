"""Pipeline parallelism for PyTorch models: contiguous stages on different workers.

Schedules (:func:`schedule_order`): ``"gpipe"`` (Huang et al., 2019) and ``"1f1b"``
(PipeDream-Flush, Narayanan et al., 2021). The ``"speed"`` partition
(:func:`~blockflow.parallel.partition_stages`) uses measured layer times and free device
memory; ``"equal"`` and ``"parameters"`` (DeepSpeed's) are baselines. Guide: docs/guide/ai.md.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import dask.array as da
import numpy as np

from blockflow import config
from blockflow.ml._pickling import FIX_TRAIN, dumps_or_explain
from blockflow.ml.parallel import _placement, _recovery, _stage, _step
from blockflow.ml.parallel._step import METADATA_KEY
from blockflow.ml.parallel.schedule import (
    SCHEDULES,
    PipelineResult,
    bubble_fraction,
    schedule_order,
)
from blockflow.scheduling.view import workers_info
from blockflow.scheduling.wait import gather_as_done

__all__ = ["METADATA_KEY", "PipelineParallel", "PipelineResult", "bubble_fraction",
           "schedule_order"]


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
        Workers that may hold stages, one stage each; default all, in address order.
    n_stages : int, optional
        Default: as many as workers (at most the number of layers).
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
        Steps between checkpoints (0: none after the first); default config
        ``blockflow.parallel.checkpoint-every``.
    memory_fraction : float, optional
        Fraction (0-1) of each worker's free device memory a stage may take; default config
        ``blockflow.parallel.memory-fraction``.
    seed : int, default 0
        Seeds dropout per ``(seed, step, micro-batch, stage)``, so runs repeat.
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
    recoveries : list of dict
        One per lost stage worker survived (``step``, ``resumed_from``, ``stages``, ``lost``).

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

    # --- placement -------------------------------------------------------------------

    def measure(self, sample, workers: Sequence[str] | None = None
                ) -> tuple[dict[str, list[float]], list[int]]:
        """Each layer's forward+backward seconds on each worker (on the first ``probe_rows``
        of ``sample``; ``workers`` default the pipeline's), and each layer's bytes of
        parameters, gradients and optimizer state: ``({worker: [seconds]}, [bytes])``."""
        return _placement.measure(self, sample, workers)

    def _place(self, sample, n_micro_batches: int | None = None) -> None:
        _placement.place(self, sample, n_micro_batches)
        _recovery.checkpoint(self)

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

    def run(self, X, target=None, *, n_micro_batches: int | None = None,
            return_grads: bool = False, return_output: bool = True, publish: bool = True,
            name: str = "pipeline") -> PipelineResult:
        """One step on the batch: forward, and with a target backward and the optimizer.

        Parameters
        ----------
        X : array or tensor, shape (n_samples, ...)
        target : array or tensor, shape (n_samples, ...), optional
            With a target the loss, backward pass and optimizer step run too.
        n_micro_batches : int, optional
            1 to the batch's rows; default ``stages x`` config
            ``blockflow.parallel.micro-batches-per-stage``.
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
            If a stage's worker was lost and the stage could not be rebuilt.
        """
        n = len(X)
        if n == 0:
            raise ValueError("blockflow: the pipeline got a batch of 0 rows; pass at least "
                             "one row.")
        m = _step.micro_batches(self, n, n_micro_batches)
        if target is not None and len(target) != n:
            raise ValueError(f"blockflow: target has {len(target)} rows but X has {n}; pass "
                             f"one target row per sample.")
        xs, sizes = _step.micro_slices(X, 0, n, m)
        ts = None if target is None else _step.micro_slices(target, 0, n, m)[0]
        return _step.step(self, xs, ts, sizes, return_grads=return_grads,
                          return_output=return_output, publish=publish, name=name)

    # --- training and inference --------------------------------------------------------

    def fit(self, X, y, *, epochs: int = 1, batch_size: int | None = None,
            n_micro_batches: int | None = None, shuffle: bool = True,
            callback: Callable | None = None) -> "PipelineParallel":
        """Train on ``(X, y)`` for ``epochs``, one pipeline step per batch.

        Parameters
        ----------
        X : dask.array.Array or array, shape (n_samples, ...)
            Batches are sliced on the cluster and sent to the first stage's worker.
        y : dask.array.Array or array, shape (n_samples, ...)
            Sent to the last stage's worker.
        epochs : int, default 1
        batch_size : int, optional
            Rows per step; default 256 (at most the rows).
        n_micro_batches : int, optional
            As for :meth:`run`.
        shuffle : bool, default True
            New batch order each epoch (seeded by ``seed``).
        callback : callable, optional
            ``callback(epoch, step, loss)`` after each step.

        Returns
        -------
        PipelineParallel
            ``self``; ``history_`` has one row per step (``epoch``, ``step``, ``loss``,
            ``seconds``, ``recovered``).

        Raises
        ------
        ValueError
            Without an optimizer, or for rows of ``X`` and ``y`` that differ.
        WorkerLostError
            When a stage's worker is lost and nothing can rebuild it.
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
        plan = [(e, b) for e in range(epochs)
                for b in (rng.permutation(starts) if shuffle else starts)]
        self.history_: list[dict] = []
        if not self.stage_workers:
            self._place(_step.first(X[: self.probe_rows]), _step.micro_batches(self, bs, n_micro_batches))
        if self._ckpt_step != self.steps:  # a rollback never reaches back before this fit
            _recovery.checkpoint(self)
        start_step = self.steps
        i = 0
        while i < len(plan):
            epoch, lo = plan[i]
            hi = min(lo + bs, n)
            rows = hi - lo
            m = _step.micro_batches(self, rows, n_micro_batches)
            xs, sizes = _step.micro_slices(X, lo, rows, m)
            ts = _step.micro_slices(y, lo, rows, m)[0]
            t0 = time.perf_counter()
            try:
                r = _step.step(self, xs, ts, sizes, return_grads=False, return_output=False,
                               publish=False, name="pipeline-fit")
            except _step.RolledBack:
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
        """The model's output on ``X`` as a NumPy array (evaluation mode, no gradients).

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
        outs = []
        for lo in range(0, n, bs):
            rows = min(bs, n - lo)
            m = _step.micro_batches(self, rows, n_micro_batches)
            xs, sizes = _step.micro_slices(X, lo, rows, m)
            outs.append(_step.step(self, xs, None, sizes, return_grads=False, return_output=True,
                                   publish=False, name="pipeline-predict").output)
        return np.concatenate(outs)

    def state_dict(self) -> dict:
        """The model's ``state_dict()`` reassembled from every stage (tensors on the CPU)."""
        futs = [self.client.submit(_stage.state, k, workers=[w], allow_other_workers=False,
                                   pure=False) for k, w in zip(self._keys, self.stage_workers)]
        out: dict = {}
        for part in self._gather(futs, needed=set(self.stage_workers), what="state_dict()"):
            out.update(part)
        return out

    def memory_peaks(self, reset: bool = False) -> dict[str, int]:
        """Per worker: peak bytes of parameters, gradients and optimizer state held."""
        return self.client.run(_stage.peaks, reset, workers=self.workers)

    def stage_bytes(self) -> list[int]:
        """Per stage: bytes of its parameters, gradients and optimizer state."""
        return list(self._stage_bytes)

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
