"""Data-parallel training of a PyTorch module over row-chunked Dask collections.

Synchronous data parallelism (as PyTorch DDP) on speed-weighted resident shards
(:class:`blockflow.ml.ResidentShards`); mini-batches stratified and seeded by block
(:func:`batch_schedule`), so a run is deterministic on any number of workers. Guide:
docs/guide/ai.md.
"""

from __future__ import annotations

import copy
import math
import threading
import time
import uuid
from collections import defaultdict
from typing import Any, Callable, Iterator

import numpy as np
from distributed import default_client

from blockflow import config
from blockflow.errors import check_number, describe
from blockflow.ml._finite import FiniteCheck, column_names, drop_setting
from blockflow.ml._pickling import FIX_TRAIN, dumps_or_explain
from blockflow.ml._post import POSTED
from blockflow.ml._rows import as_row_blocks
from blockflow.ml._shards import ResidentShards

__all__ = ["DataParallelTrainer", "batch_schedule"]


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
    blockflow heuristic.
    """
    n = int(sum(block_rows))
    steps = max(1, math.ceil(n / batch_size))
    perms, cuts = [], []
    for j, r in enumerate(block_rows):
        rng = np.random.default_rng([seed, epoch, j])
        perms.append(rng.permutation(r))
        # the phase spreads a block smaller than the number of steps over the epoch
        u = rng.random()
        cuts.append([min(max(math.ceil(k * r / steps - u), 0), r) for k in range(steps + 1)])
    for k in range(steps):
        yield [p[c[k]:c[k + 1]] for p, c in zip(perms, cuts)]


def _probe_split(rows: list[np.ndarray], fraction: float,
                 placement: dict[int, str] | None = None) -> list[list[np.ndarray]]:
    """A step's rows as (probe, rest): ``fraction`` of every worker's rows (at least one),
    or one pass when the probe would be the whole step."""
    by_worker: dict[Any, list[int]] = {}
    for j in range(len(rows)):
        by_worker.setdefault(None if placement is None else placement.get(j), []).append(j)
    cut = [0] * len(rows)
    for js in by_worker.values():
        left = math.ceil(fraction * sum(len(rows[j]) for j in js) - 1e-9)  # 0.07 x 100
        while left > 0:
            took = False
            for j in js:
                if left > 0 and cut[j] < len(rows[j]):
                    cut[j] += 1
                    left -= 1
                    took = True
            if not took:
                break
    if not any(cut) or all(c == len(r) for c, r in zip(cut, rows)):
        return [rows]
    return [[r[:c] for r, c in zip(rows, cut)], [r[c:] for r, c in zip(rows, cut)]]


def _one_row_per_worker(shards, rows: list[np.ndarray]) -> list[np.ndarray]:
    """The first row of each worker's first block with rows in this step; none elsewhere."""
    out = [r[:0] for r in rows]
    seen = set()
    for j in sorted(shards.placement):
        a = shards.placement[j]
        if a not in seen and len(rows[j]):
            out[j] = rows[j][:1]
            seen.add(a)
    return out


_CACHE: dict[tuple, Any] = {}
_CACHE_LOCK = threading.Lock()


def _local_model(model, token: str):
    """A private copy of the model per (run, worker thread), so threads do not race."""
    key = (token, threading.get_ident())
    with _CACHE_LOCK:
        m = _CACHE.get(key)
        if m is None:
            for k in [k for k in _CACHE if k[0] != token]:
                del _CACHE[k]
            m = _CACHE[key] = copy.deepcopy(model)
    return m


def _shard_gradient(blocks, rows, model, token, theta, loss_fn, hook):
    """On a worker: (sum of per-sample gradients, sum of losses, samples) over its rows."""
    import torch

    t0, cpu0 = time.perf_counter(), time.thread_time()
    m = _local_model(model, token)
    params = [p for p in m.parameters() if p.requires_grad]
    torch.nn.utils.vector_to_parameters(torch.as_tensor(theta).to(params[0]), params)
    xs, ys = [], []
    for (xb, yb), r in zip(blocks, rows):
        xs.append(xb[r] if r is not None else xb)
        ys.append(yb[r] if r is not None else yb)
    x = torch.as_tensor(np.concatenate(xs)) if isinstance(xs[0], np.ndarray) else \
        torch.cat([torch.as_tensor(v) for v in xs])
    y = torch.as_tensor(np.concatenate(ys)) if isinstance(ys[0], np.ndarray) else \
        torch.cat([torch.as_tensor(v) for v in ys])
    x = x.to(device=params[0].device, dtype=params[0].dtype)
    y = y.to(params[0].device)
    n = len(x)
    m.zero_grad(set_to_none=False)
    loss = loss_fn(m(x), y) * n  # mean loss x n = sum of per-sample losses
    loss.backward()
    grad = torch.nn.utils.parameters_to_vector([p.grad for p in params])
    out = (grad.detach().to("cpu", torch.float64).numpy(), float(loss.detach()), n)
    if hook is not None:
        hook(time.perf_counter() - t0, time.thread_time() - cpu0, n)
    return out


class DataParallelTrainer:
    """Train a PyTorch ``nn.Module`` on row-chunked Dask data with speed-weighted shards.

    Parameters
    ----------
    model : torch.nn.Module
        Trained in place on the client (its parameters are the run's state).
    loss_fn : callable
        ``loss_fn(output, target)`` returning the *mean* loss over the rows, e.g.
        ``torch.nn.CrossEntropyLoss()``.
    optimizer : callable, optional
        ``optimizer(params) -> torch.optim.Optimizer``; default SGD with lr 0.1.
    batch_size : int, default 256
        Samples per step (stratified over blocks, see :func:`batch_schedule`).
    epochs : int, default 1
    seed : int, default 0
        Seeds the batch schedule; seed the model's initialisation yourself.
    sharding : {"speed", "equal"}, default "speed"
        Rows per worker proportional to learned speed, or equal shards.
    client : distributed.Client, optional
        Default: the current client.
    split_every : int, optional
        Fan-in of the gradient sum.
    memory_fraction : float, default 0.5
        Fraction 0-1 of a worker's free memory its resident blocks may take.
    rebalance_every : int, default 10
        Steps between checks whether blocks should move to follow measured speeds.
    block_hook : callable, optional
        ``block_hook(seconds, cpu_seconds, rows)`` called on the worker after each gradient
        call.
    callback : callable, optional
        ``callback(trainer, record) -> bool`` after each step; True stops training.
    probe_fraction : float, default 0.1
        With ``sharding="speed"`` and no speeds known, the first step times this fraction
        (0-1) of every worker's rows on equal shards first. A blockflow heuristic.
    steal : bool, optional
        Work stealing inside each step (:mod:`blockflow.ml._steal`); default
        ``blockflow.ml.steal`` with ``sharding="speed"``, off with ``"equal"``.
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
        Per step: ``epoch``, ``step``, ``loss`` (mean, before the update), ``samples``,
        ``started``, ``seconds``, ``worker_seconds``, ``worker_rows``, ``worker_stolen``
        and ``ahead``.
    shards_ : ResidentShards
        The placement (``rows_per_worker()``, ``recoveries``, ``moves``).
    """

    def __init__(self, model, loss_fn: Callable, optimizer: Callable | None = None, *,
                 batch_size: int = 256, epochs: int = 1, seed: int = 0,
                 sharding: str = "speed", client=None, split_every: int | None = None,
                 memory_fraction: float = 0.5, rebalance_every: int = 10,
                 block_hook: Callable | None = None, callback: Callable | None = None,
                 probe_fraction: float = 0.1, steal: bool | None = None,
                 drop_nonfinite: bool | None = None):
        f = "blockflow.ml.DataParallelTrainer"
        # every argument is checked here, before any work
        batch_size = check_number(batch_size, "batch_size", f, "samples per step",
                                  integer=True, low=1)
        epochs = check_number(epochs, "epochs", f, "passes over the rows", integer=True,
                              low=1)
        seed = check_number(seed, "seed", f, "seed of the batch schedule", integer=True,
                            low=0)
        split_every = check_number(split_every, "split_every", f,
                                   "fan-in of the gradient sum", integer=True, low=2,
                                   none=True)
        memory_fraction = check_number(memory_fraction, "memory_fraction", f,
                                       "fraction of a worker's free memory its blocks may "
                                       "take", low=0, low_open=True, high=1)
        rebalance_every = check_number(rebalance_every, "rebalance_every", f,
                                       "steps between rebalancing checks", integer=True,
                                       low=1)
        probe_fraction = check_number(probe_fraction, "probe_fraction", f,
                                      "fraction of the first step's rows that times the "
                                      "workers", low=0, low_open=True, high=1, high_open=True)
        if sharding not in ("speed", "equal"):
            raise ValueError(f"{f}: sharding must be 'speed' or 'equal', got {sharding!r}.")
        for name, value in (("loss_fn", loss_fn), ("optimizer", optimizer),
                            ("block_hook", block_hook), ("callback", callback)):
            if value is not None and not callable(value):
                raise TypeError(f"{f}: {name} must be callable, got {describe(value)}.")
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.batch_size, self.epochs, self.seed = batch_size, epochs, seed
        self.sharding, self.client, self.split_every = sharding, client, split_every
        self.memory_fraction, self.rebalance_every = memory_fraction, rebalance_every
        self.block_hook, self.callback = block_hook, callback
        self.probe_fraction = probe_fraction
        self.steal = steal
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
        """
        import torch

        # the module travels to every worker (scatter): refuse one that cannot, before
        # anything is scheduled, as blockflow.predict and Router do
        dumps_or_explain(self.model, "blockflow.ml.DataParallelTrainer.fit", fix=FIX_TRAIN)
        client = self.client or default_client()
        check = FiniteCheck(drop=drop_setting(self.drop_nonfinite), columns=column_names(X))
        X, y = as_row_blocks(X, y)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("blockflow: the model has no trainable parameters; unfreeze "
                             "some before training.")
        opt = (self.optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.1)))(params)
        token = uuid.uuid4().hex
        steal = (bool(config.get("ml.steal")) and self.sharding == "speed"
                 if self.steal is None else bool(self.steal))
        [model_future] = client.scatter([self.model], broadcast=True, hash=False)
        self.shards_ = shards = ResidentShards(
            client, X, y, sharding=self.sharding, memory_fraction=self.memory_fraction,
            split_every=self.split_every, check=check)
        self.history_ = []
        step = 0
        # the steps ahead, one at a time: the next step's pass is submitted while this one
        # runs (ResidentShards.prepare), its parameters posted once the optimizer has them
        steps = ((epoch, rows) for epoch in range(self.epochs)
                 for rows in batch_schedule(shards.block_rows, self.batch_size, epoch,
                                            self.seed)
                 if any(len(r) for r in rows))  # a tiny epoch's empty step: no update
        args = (model_future, token, POSTED, self.loss_fn, self.block_hook)
        following = next(steps, None)
        ahead = None
        try:
            while following is not None:
                (epoch, rows), following = following, next(steps, None)
                t0, started = time.perf_counter(), time.time()
                theta = torch.nn.utils.parameters_to_vector(params).detach().cpu().numpy()
                passes = [rows]
                if step == 0 and self.sharding == "speed" and not shards.knows_speeds():
                    passes = _probe_split(rows, self.probe_fraction, shards.placement)
                    if len(passes) > 1:
                        # a warm-up pass of one row per worker first (its model copy,
                        # first allocations, a GPU's context): the probe then times warm
                        # workers; its result is dropped
                        shards.map_sum(_shard_gradient, _one_row_per_worker(shards, rows),
                                       args, measure=False, posted=theta)
                grad, loss, n = 0, 0.0, 0
                seconds: dict[str, float] = defaultdict(float)
                worker_rows: dict[str, int] = defaultdict(int)
                worker_stolen: dict[str, int] = defaultdict(int)
                prepared = []

                def prepare_next():
                    if following is not None:
                        prepared.append(shards.prepare(_shard_gradient, following[1], args,
                                                       steal=steal))

                for i, part in enumerate(passes):
                    if i:  # after the probe: shares follow its speeds for the rest
                        shards.rebalance()
                    ran_ahead = False
                    last = i == len(passes) - 1
                    g_, l_, n_ = shards.map_sum(
                        _shard_gradient, part, args, steal=steal, posted=theta,
                        ahead=ahead if len(passes) == 1 else None,
                        then=prepare_next if last else None)
                    grad, loss, n = grad + g_, loss + l_, n + n_
                    ran_ahead = shards.last_ahead
                    for a, v in shards.last_seconds.items():
                        seconds[a] += v
                    for a, v in shards.last_rows.items():
                        worker_rows[a] += v
                    for a, v in shards.last_stolen.items():
                        worker_stolen[a] += v
                ahead = prepared[0] if prepared else None
                opt.zero_grad()
                g = torch.as_tensor(grad / n)
                offset = 0
                for p in params:
                    p.grad = g[offset:offset + p.numel()].view_as(p).to(p)
                    offset += p.numel()
                opt.step()
                record = {"epoch": epoch, "step": step, "loss": loss / n, "samples": n,
                          "started": started, "seconds": time.perf_counter() - t0,
                          "worker_seconds": dict(seconds),
                          "worker_rows": dict(worker_rows),
                          "worker_stolen": dict(worker_stolen), "ahead": ran_ahead}
                self.history_.append(record)
                step += 1
                if self.callback is not None and self.callback(self, record):
                    return self
                # shares follow the first measurements at once (steps 1-3: the median
                # of 3 passes outvotes a cold first one), then every rebalance_every
                # (blocks that move cancel the pass prepared for the next step)
                if self.sharding == "speed" and (
                        step <= 3 or step % self.rebalance_every == 0):
                    shards.rebalance()
        finally:
            shards.close()  # cancels a pass prepared for a step that will not run
            del model_future
        return self

    def loss_curve(self) -> np.ndarray:
        """Mean batch loss per step (before each update)."""
        return np.array([r["loss"] for r in self.history_])
