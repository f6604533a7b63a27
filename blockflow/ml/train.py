"""Data-parallel training of a PyTorch module: torch DDP on ranks blockflow places.

Each rank is a Dask worker (:func:`blockflow.ml._group.run_group`) reading the row blocks
resident on it (:class:`blockflow.ml.ResidentShards`, shares proportional to learned speed);
torch's ``DistributedDataParallel`` all-reduces the gradients (FSDP2 ``fully_shard`` when
the model and its optimizer state do not fit the smallest chosen worker). Training runs in
segments of steps, each ending with a checkpoint, so a lost worker costs one segment.
Mini-batches are stratified and seeded by block (:func:`batch_schedule`): the same model on
any placement. Guide: docs/guide/ai.md.
"""

from __future__ import annotations

import copy
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
from dask.utils import parse_timedelta
from distributed import default_client

from blockflow import config
from blockflow.errors import BlockflowWarning, WorkerLostError, check_number, describe
from blockflow.ml._finite import FiniteCheck, column_names, drop_setting
from blockflow.ml._group import GroupLost, first_kept, keep_copies, run_group
from blockflow.ml._pickling import FIX_TRAIN, dumps_or_explain
from blockflow.ml._rows import as_row_blocks
from blockflow.ml._shards import ResidentShards
from blockflow.scheduling.view import memory_of, workers_info

__all__ = ["DataParallelTrainer", "batch_schedule"]

_FIRST_SEGMENT = 4  # steps of a fit's first segment while no speed is known


def _block_plan(r: int, j: int, steps: int, epoch: int, seed: int):
    """Block ``j``'s (``r`` rows) permutation and per-step cut points in one epoch."""
    rng = np.random.default_rng([seed, epoch, j])
    perm = rng.permutation(r)
    # the phase spreads a block smaller than the number of steps over the epoch
    u = rng.random()
    return perm, [min(max(math.ceil(k * r / steps - u), 0), r) for k in range(steps + 1)]


def _steps_per_epoch(block_rows, batch_size: int) -> int:
    return max(1, math.ceil(int(sum(block_rows)) / batch_size))


def batch_schedule(block_rows, batch_size: int, epoch: int, seed: int = 0
                   ) -> Iterator[list[np.ndarray]]:
    """The mini-batches of one epoch, stratified by block (independent of placement).

    Parameters
    ----------
    block_rows : sequence of int
        Rows per block.
    batch_size : int
        Samples per step (approximately: each block contributes its proportional share).
    epoch : int
    seed : int, default 0

    Yields
    ------
    list of numpy.ndarray
        Per block, the local row indices of this step (int64).

    Notes
    -----
    Stratified sampling by block, seeded by ``seed``, ``epoch`` and the block index; a
    blockflow heuristic. A rank computes its own blocks' part of it (:func:`_block_plan`).
    """
    steps = _steps_per_epoch(block_rows, batch_size)
    plans = [_block_plan(r, j, steps, epoch, seed) for j, r in enumerate(block_rows)]
    for k in range(steps):
        yield [p[c[k]:c[k + 1]] for p, c in plans]


@dataclass
class _Segment:
    """What every rank of a segment is given besides its blocks and the checkpoint."""

    steps: list  # (global step, epoch, step in epoch, rows in the global batch)
    block_rows: list
    batch_size: int
    seed: int
    loss_fn: Callable
    optimizer: Callable
    hook: Callable | None
    fsdp: bool
    path: str | None  # where rank 0 writes the checkpoint (atomically), or None


class _Timer:
    """A step's own compute time on a rank: from its forward to its last gradient bucket
    being ready (local backward done), before waiting on peers' gradients."""

    def __init__(self, hook):
        self.hook, self.t0, self.cpu0, self.rows, self.done = hook, 0.0, 0.0, 0, None

    def start(self, rows: int) -> None:
        self.t0, self.cpu0 = time.perf_counter(), time.thread_time()
        self.rows, self.done = rows, None

    def ready(self) -> None:
        if self.done is None:
            if self.hook is not None:  # a simulated slower device delays the rank here
                self.hook(time.perf_counter() - self.t0, time.thread_time() - self.cpu0,
                          self.rows)
            self.done = time.perf_counter()


def _timed_allreduce(timer: _Timer, bucket):
    """DDP's default allreduce comm hook, timestamping the last bucket (local backward
    done) first."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    if bucket.is_last():
        timer.ready()
    return allreduce_hook(None, bucket)


class _Opaque:
    """A module or a checkpoint's state dicts as one opaque object: pickled whole (torch's
    own pickling carries every dtype; distributed's tensor serialiser refuses bfloat16)."""

    def __init__(self, state):
        self.state = state


def _pick(result: dict, key: str):
    return result.get(key)


def _model_state(result: dict) -> _Opaque:
    """Rank 0's model state dict alone (the optimizer's stays on the workers)."""
    return _Opaque(result["state"].state["model"])


def _rank_segment(rank, model, state, blocks, ids, seg: _Segment) -> dict:
    """On a worker, as one rank: the segment's steps over its blocks' rows, under DDP (or
    FSDP2); returns per-step (loss sum, rows, own seconds) and, on rank 0, the checkpoint."""
    import torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
        set_optimizer_state_dict)
    from torch.nn.parallel import DistributedDataParallel

    from blockflow._distributed import add_task_wait

    if isinstance(state, str):  # a checkpoint file
        state = torch.load(state, weights_only=False)
    elif state is not None:  # rank 0's result of the segment before
        state = state["state"].state
    model = copy.deepcopy(model.state)  # the scattered module is shared by this worker's tasks
    if state is not None:
        model.load_state_dict(state["model"])
    model.to(rank.device)
    dtype = next(p for p in model.parameters() if p.requires_grad).dtype
    timer = _Timer(seg.hook)
    if seg.fsdp:
        from torch.distributed.fsdp import fully_shard
        net = fully_shard(model)
    else:
        net = DistributedDataParallel(model, device_ids=None if rank.device.type == "cpu"
                                      else [rank.device])
        net.register_comm_hook(timer, _timed_allreduce)
    opt = seg.optimizer([p for p in model.parameters() if p.requires_grad])
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if state is not None:
        if seg.fsdp:
            set_optimizer_state_dict(model, opt, state["optim"],
                                     options=StateDictOptions(full_state_dict=True))
        else:  # a copy: the optimizer updates its state in place, and the checkpoint
            # may live in this process's memory (the last one, kept for a recovery)
            opt.load_state_dict(copy.deepcopy(state["optim"]))
    xs, ys = [], []
    for xb, yb in blocks:
        xs.append(torch.as_tensor(xb))
        ys.append(torch.as_tensor(yb))
    # the rank's rows as one tensor on its device, once per segment: a step indexes it once
    X, Y = torch.cat(xs), torch.cat(ys).to(rank.device)
    X = X.to(rank.device, dtype) if X.is_floating_point() else X.to(rank.device)
    starts = np.concatenate([[0], np.cumsum([len(x) for x in xs])])
    del xs, ys
    steps_per_epoch = _steps_per_epoch(seg.block_rows, seg.batch_size)
    plans, out, wait, world = {}, [], 0.0, rank.world_size
    for g, epoch, k, n_global in seg.steps:
        if epoch not in plans:
            plans = {epoch: [_block_plan(seg.block_rows[j], j, steps_per_epoch, epoch,
                                         seg.seed) for j in ids]}
        idx = torch.as_tensor(np.concatenate(
            [s + p[c[k]:c[k + 1]] for s, (p, c) in zip(starts, plans[epoch])]))
        n = len(idx)
        started, t0 = time.time(), time.perf_counter()
        timer.start(n)
        if n:
            x, y = X[idx], Y[idx]
        else:  # no rows this step: an empty batch keeps the collectives matched
            x, y = X[:0], None
        result = net(x)
        if n:
            loss = seg.loss_fn(result, y)
            # DDP averages over ranks: this weight makes the update the global batch's mean
            (loss * (n * world / n_global)).backward()
            loss_sum = float(loss.detach()) * n
        else:
            (result.sum() * 0).backward()
            loss_sum = 0.0
        back = time.perf_counter()
        timer.ready()  # FSDP2 (no comm hook): own time includes its collectives
        wait += back - timer.done
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((g, loss_sum, n, timer.done - t0, time.perf_counter() - t0, started))
    add_task_wait(wait)  # blocked in collectives: waiting, not work, for the speed model
    result = {"steps": out}
    if seg.fsdp:
        msd = get_model_state_dict(model, options=full)
        osd = get_optimizer_state_dict(model, opt, options=full)
    elif rank.rank == 0:
        msd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        osd = _to_cpu(opt.state_dict())  # a peer without that device can hold it
    if rank.rank == 0:
        state = {"model": msd, "optim": osd, "step": seg.steps[-1][0] + 1}
        result["state"] = _Opaque(state)
        if seg.path:
            tmp = f"{seg.path}.tmp-{os.getpid()}"
            torch.save(state, tmp)
            os.replace(tmp, seg.path)
    return result


def _to_cpu(value):
    """``value`` with every tensor inside (dicts, lists, tuples) on the CPU."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _state_bytes(model, opt) -> int:
    """Parameters, gradients and optimizer state in bytes: 4x the parameters for Adam-like
    optimizers (two moments), 3x with momentum, else 2x (a blockflow estimate)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    d = getattr(opt, "defaults", {})
    factor = 4 if "betas" in d else 3 if d.get("momentum") else 2
    return factor * params


class DataParallelTrainer:
    """Train a PyTorch ``nn.Module`` on row-chunked Dask data: torch DDP on blockflow's ranks.

    Parameters
    ----------
    model : torch.nn.Module
        Trained in place: the client's module holds the final parameters.
    loss_fn : callable
        ``loss_fn(output, target)`` returning the *mean* loss over the rows, e.g.
        ``torch.nn.CrossEntropyLoss()``.
    optimizer : callable, optional
        ``optimizer(params) -> torch.optim.Optimizer``; default SGD with lr 0.1.
    batch_size : int, default 256
        Samples per step, the global batch (stratified over blocks, :func:`batch_schedule`).
    epochs : int, default 1
    seed : int, default 0
        Seeds the batch schedule; seed the model's initialisation yourself.
    sharding : {"speed", "equal"}, default "speed"
        Rows per worker (and so each rank's local batch) proportional to learned speed, or
        equal shards (DDP's equal local batches).
    client : distributed.Client, optional
        Default: the current client.
    memory_fraction : float, default 0.5
        Fraction 0-1 of a worker's free (device) memory its resident blocks may take; also
        the fraction the model's parameters, gradients and optimizer state may take before
        FSDP2 shards them.
    checkpoint_every : int, optional
        Steps per segment (one torch.distributed group, ending with a checkpoint of the model
        and optimizer kept on two workers); shares are rebalanced between segments and a
        lost worker redoes at most one. Default ``blockflow.ml.checkpoint-every``; when that
        is null too, segments of about ``blockflow.ml.checkpoint-seconds`` from the measured
        step time.
    checkpoint_path : str, optional
        Also write each checkpoint there (atomically, ``torch.save``), from rank 0's worker.
    fsdp : bool, optional
        Shard parameters with FSDP2 (True), replicate them with DDP (False); default: FSDP2
        when the estimate of :func:`_state_bytes` exceeds ``memory_fraction`` of the
        smallest rank's free (device) memory.
    block_hook : callable, optional
        ``block_hook(seconds, cpu_seconds, rows)`` on a rank after each step's local forward
        and backward (before it waits on its peers): a simulated device's slow-down.
    callback : callable, optional
        ``callback(trainer, record) -> bool`` per step, after its segment; True stops
        training at the end of that segment.
    drop_nonfinite : bool, optional
        Drop rows holding a NaN or infinity instead of raising; default
        ``blockflow.ml.drop-nonfinite``.

    Raises
    ------
    ValueError
        If a numeric argument is out of range or ``sharding`` is unknown.
    TypeError
        If ``loss_fn``, ``optimizer``, ``block_hook`` or ``callback`` is not callable.

    Attributes
    ----------
    history_ : list of dict
        Per step: ``epoch``, ``step``, ``segment``, ``loss`` (mean, before the update),
        ``samples``, ``started`` (rank 0's clock), ``seconds`` (rank 0's step),
        ``worker_seconds`` (each rank's own compute, waits on peers excluded) and
        ``worker_rows``.
    recoveries_ : list of dict
        Per lost group: ``step`` (the first step of the segment lost), ``resumed_from``
        (the checkpoint's step), ``lost`` (workers) and ``redone`` (steps run again).
    shards_ : ResidentShards
        The placement (``rows_per_worker()``, ``moves``).
    fsdp_ : bool
        Whether FSDP2 sharded the model.
    """

    def __init__(self, model, loss_fn: Callable, optimizer: Callable | None = None, *,
                 batch_size: int = 256, epochs: int = 1, seed: int = 0,
                 sharding: str = "speed", client=None, memory_fraction: float = 0.5,
                 checkpoint_every: int | None = None, checkpoint_path: str | None = None,
                 fsdp: bool | None = None, block_hook: Callable | None = None,
                 callback: Callable | None = None, drop_nonfinite: bool | None = None):
        f = "blockflow.ml.DataParallelTrainer"
        # every argument is checked here, before any work
        batch_size = check_number(batch_size, "batch_size", f, "samples per step",
                                  integer=True, low=1)
        epochs = check_number(epochs, "epochs", f, "passes over the rows", integer=True,
                              low=1)
        seed = check_number(seed, "seed", f, "seed of the batch schedule", integer=True,
                            low=0)
        memory_fraction = check_number(memory_fraction, "memory_fraction", f,
                                       "fraction of a worker's free memory its blocks may "
                                       "take", low=0, low_open=True, high=1)
        checkpoint_every = check_number(
            config.get("ml.checkpoint-every", checkpoint_every), "checkpoint_every", f,
            "steps between checkpoints", integer=True, low=1, none=True)
        if sharding not in ("speed", "equal"):
            raise ValueError(f"{f}: sharding must be 'speed' or 'equal', got {sharding!r}.")
        if fsdp not in (None, True, False):
            raise ValueError(f"{f}: fsdp must be True, False or None (automatic), got "
                             f"{fsdp!r}.")
        if checkpoint_path is not None and not isinstance(checkpoint_path, (str, os.PathLike)):
            raise TypeError(f"{f}: checkpoint_path must be a file path, got "
                            f"{describe(checkpoint_path)}.")
        for name, value in (("loss_fn", loss_fn), ("optimizer", optimizer),
                            ("block_hook", block_hook), ("callback", callback)):
            if value is not None and not callable(value):
                raise TypeError(f"{f}: {name} must be callable, got {describe(value)}.")
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.batch_size, self.epochs, self.seed = batch_size, epochs, seed
        self.sharding, self.client = sharding, client
        self.memory_fraction, self.checkpoint_every = memory_fraction, checkpoint_every
        self.checkpoint_path = None if checkpoint_path is None else os.fspath(checkpoint_path)
        self.fsdp, self.block_hook, self.callback = fsdp, block_hook, callback
        self.drop_nonfinite = drop_nonfinite

    def fit(self, X, y) -> DataParallelTrainer:
        """Train on ``X`` (features, rows chunked) and ``y`` (labels, same rows).

        Parameters
        ----------
        X : dask.array.Array or dask.dataframe.DataFrame, shape (n_samples, n_features)
        y : dask.array.Array or dask.dataframe.Series, shape (n_samples,) or (n, k)

        Raises
        ------
        ValueError
            If shapes disagree, the model has no trainable parameters, or ``X``/``y``
            hold a NaN or an infinity (unless ``drop_nonfinite``).
        blockflow.errors.WorkerLostError
            If every worker holding a rank was lost, or the checkpoint with them.
        """
        import torch

        # the module travels to every worker: refuse one that cannot, before anything is
        # scheduled, as blockflow.predict and Router do
        dumps_or_explain(self.model, "blockflow.ml.DataParallelTrainer.fit", fix=FIX_TRAIN)
        client = self.client or default_client()
        check = FiniteCheck(drop=drop_setting(self.drop_nonfinite), columns=column_names(X))
        X, y = as_row_blocks(X, y)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("blockflow: the model has no trainable parameters; unfreeze "
                             "some before training.")
        optimizer = self.optimizer or _sgd
        probe = optimizer(params)  # on the client: a bad factory fails here, not on a rank
        self.shards_ = shards = ResidentShards(
            client, X, y, sharding=self.sharding, memory_fraction=self.memory_fraction,
            check=check, one_per_process=True)
        self.fsdp_ = self.fsdp if self.fsdp is not None else self._needs_fsdp(
            client, shards, probe)
        del probe
        steps = self._steps(shards.block_rows)
        [model_future] = client.scatter([_Opaque(self.model)], broadcast=True, hash=False)
        self.history_, self.recoveries_ = [], []
        ckpt, done, segment = None, 0, 0
        interval = float(parse_timedelta(config.get("ml.checkpoint-seconds")))
        try:
            while done < len(steps):
                length = self.checkpoint_every or _FIRST_SEGMENT
                if self.checkpoint_every is None and self.history_:  # about `interval`
                    per = float(np.median([r["seconds"] for r in self.history_[-20:]]))
                    length = max(1, int(interval / max(per, 1e-6)))
                if (self.sharding == "speed" and not shards.knows_speeds()):
                    length = min(length, _FIRST_SEGMENT)  # shares follow speeds early
                seg = _Segment(steps[done:done + length], shards.block_rows, self.batch_size,
                               self.seed, self.loss_fn, optimizer, self.block_hook,
                               self.fsdp_, self.checkpoint_path)
                try:
                    futures, ranks = self._run_segment(client, shards, model_future, ckpt,
                                                       seg)
                except GroupLost as e:
                    lost = e
                else:
                    lost = None
                if lost is not None:  # out of the except: no internal error chained
                    ckpt = self._recover(client, shards, lost, ckpt, seg)
                    continue
                stats = client.gather([client.submit(_pick, f, "steps", workers=[w],
                                                     pure=False)
                                       for f, w in zip(futures, ranks)])
                ckpt = [futures[0]]
                if done + len(seg.steps) < len(steps):  # kept in a peer's memory too
                    [ckpt] = keep_copies(client, ckpt, ranks, [ranks[0]])
                del futures
                stop = self._record(shards, stats, ranks, seg, segment)
                done += len(seg.steps)
                segment += 1
                if stop:
                    break
                if self.sharding == "speed" and done < len(steps):
                    shards.rebalance()
            if ckpt is not None:
                sd = client.submit(_model_state, first_kept(ckpt), pure=False).result().state
                with torch.no_grad():
                    self.model.load_state_dict(sd)
        finally:
            shards.close()
            del model_future, ckpt
        return self

    # --- the pieces of fit -----------------------------------------------------------------

    def _steps(self, block_rows) -> list[tuple]:
        """(global step, epoch, step in epoch, global batch rows) of every step with rows."""
        out = []
        for epoch in range(self.epochs):
            for k, rows in enumerate(batch_schedule(block_rows, self.batch_size, epoch,
                                                    self.seed)):
                n = int(sum(len(r) for r in rows))
                if n:  # a tiny epoch's empty step: no update
                    out.append((len(out), epoch, k, n))
        return out

    def _needs_fsdp(self, client, shards, opt) -> bool:
        need = _state_bytes(self.model, opt)
        info = workers_info(client)
        free = min(memory_of(info[a]).free for a in shards.rows_per_worker() if a in info)
        return need > self.memory_fraction * free

    def _run_segment(self, client, shards, model_future, ckpt, seg: _Segment):
        """One group over the workers holding blocks, each rank given its own blocks."""
        ranks = sorted(shards.rows_per_worker())
        mine = {a: sorted(j for j, w in shards.placement.items() if w == a) for a in ranks}
        state = None if ckpt is None else first_kept(ckpt)
        if ckpt is not None and state is None:
            if seg.path and os.path.exists(seg.path):
                state = seg.path
            else:
                raise WorkerLostError("blockflow: training: the checkpoint was lost with "
                                      "its workers; pass checkpoint_path= to resume from a "
                                      "file.", lost=[])
        args = [(model_future, state, [shards.futures[j] for j in mine[a]], mine[a], seg)
                for a in ranks]
        futures = run_group(client, ranks, _rank_segment, args, name="train-rank",
                            what="training", gather=False)
        return futures, ranks

    def _recover(self, client, shards, e: GroupLost, ckpt, seg: _Segment):
        """A lost worker: one warning line, blocks recovered, the segment redone."""
        lost = sorted(e.lost)
        if not lost:  # ranks cancelled: their blocks' source went with a worker
            shards.refuse_lost_sources(sorted(shards.futures), settle=True)
            raise WorkerLostError(str(e), lost=e.lost).with_traceback(None)
        first, last = seg.steps[0][0], seg.steps[-1][0]
        resumed = first  # the checkpoint is the segment's start
        warnings.warn(f"blockflow: training lost worker(s) {', '.join(lost)} during steps "
                      f"{first}-{last}; resuming from the checkpoint at step {resumed} on "
                      f"the survivors (redoing up to {last - resumed + 1} steps).",
                      BlockflowWarning, stacklevel=3)
        self.recoveries_.append({"step": first, "resumed_from": resumed, "lost": lost,
                                 "redone": last - resumed + 1})
        shards._recover(set(lost))
        return ckpt

    def _record(self, shards, stats, ranks, seg: _Segment, segment: int) -> bool:
        """history_ records of a segment; speeds fed to the shards' model. True: stop."""
        stop = False
        for i, (g, epoch, _k, n_global) in enumerate(seg.steps):
            per = [s[i] for s in stats]
            rec = {"epoch": epoch, "step": g, "segment": segment,
                   "loss": sum(p[1] for p in per) / n_global, "samples": n_global,
                   "started": per[0][5], "seconds": per[0][4],
                   "worker_seconds": {a: p[3] for a, p in zip(ranks, per)},
                   "worker_rows": {a: p[2] for a, p in zip(ranks, per)}}
            if i:  # a segment's first step is cold (the group, the model, allocations)
                for a, p in zip(ranks, per):
                    shards.observe(a, p[2], p[3])
            self.history_.append(rec)
            if self.callback is not None and self.callback(self, rec):
                stop = True
        return stop

    def loss_curve(self) -> np.ndarray:
        """Mean batch loss per step (before each update)."""
        return np.array([r["loss"] for r in self.history_])


def _sgd(params):
    import torch
    return torch.optim.SGD(params, lr=0.1)
