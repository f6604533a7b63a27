"""Tensor (model) parallelism for PyTorch on torch's tensor-parallel API, placed by blockflow.

As in Megatron-LM (Shoeybi et al., 2019): in an MLP block ``Sequential(Linear, act, Linear)``
the first layer is split by columns and the second by rows; ``nn.MultiheadAttention`` is
split by heads. torch does the sharding and the communication
(``torch.distributed.device_mesh.init_device_mesh`` and
``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel`` and
``RowwiseParallel``): one rank per chosen worker, in a group that
:func:`blockflow.ml._group.run_group` forms on the workers. blockflow chooses the workers (free
device memory, one per worker process) and keeps the model between calls as a checkpoint on
the workers. torch's DTensor shards evenly, so every rank holds the same width.
Guide: docs/guide/ai.md.
"""

from __future__ import annotations

import copy
import functools
import io
import logging
import math
import operator
import time
import warnings
from typing import Callable, Sequence

import numpy as np
from distributed import wait

from blockflow import config
from blockflow.errors import BlockflowWarning, DeviceMemoryError, WorkerLostError
from blockflow.ml._group import GroupLost, RankFailed, first_kept, gone_workers, keep_copies
from blockflow.ml._group import run_group, worker_processes
from blockflow.ml._pickling import FIX_TRAIN, dumps_or_explain
from blockflow.scheduling.view import worker_memory, workers_info

__all__ = ["TensorParallel", "free_device_memory"]

logger = logging.getLogger(__name__)

_ELEMENTWISE = ("GELU", "ReLU", "Tanh", "SiLU", "Sigmoid", "Identity", "LeakyReLU", "ELU",
                "Mish", "Softplus")
_REFUSED = ("blockflow: TensorParallel splits an MLP block Sequential(Linear, <element-wise "
            "activation>, Linear) or an nn.MultiheadAttention")


def free_device_memory(client) -> dict[str, float]:
    """Free memory per worker in bytes, as the client's view of the cluster reads it.

    Reported device memory where a worker reports it, else host memory limit minus process
    memory, else ``math.inf`` (:attr:`blockflow.scheduling.view.WorkerMemory.free`).
    """
    return {a: float(m.free) for a, m in worker_memory(client).items()}


# --- the model as torch shards it -------------------------------------------------------------

_ATTENTION: list = []


def _attention_class():
    """``nn.MultiheadAttention`` with separate Q, K, V projections (torch shards each by
    columns, the output projection by rows); built once, shipped by value."""
    if _ATTENTION:
        return _ATTENTION[0]
    import torch

    class ShardableAttention(torch.nn.Module):
        """Self-attention, ``batch_first``, no masks; heads taken from the local width."""

        batch_first, _qkv_same_embed_dim, in_proj_bias = True, False, None  # no fast path

        def __init__(self, mha):
            super().__init__()
            E, H = mha.embed_dim, mha.num_heads
            self.embed_dim, self.num_heads, self.head_dim = E, H, E // H
            bias = mha.in_proj_bias is not None
            kw = dict(dtype=mha.in_proj_weight.dtype, device=mha.in_proj_weight.device)
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(E, E, bias=bias, **kw)
                                                     for _ in range(3))
            self.out_proj = torch.nn.Linear(E, E, bias=mha.out_proj.bias is not None, **kw)
            with torch.no_grad():
                for i, lin in enumerate((self.q_proj, self.k_proj, self.v_proj)):
                    lin.weight.copy_(mha.in_proj_weight[i * E:(i + 1) * E])
                    if bias:
                        lin.bias.copy_(mha.in_proj_bias[i * E:(i + 1) * E])
                self.out_proj.weight.copy_(mha.out_proj.weight)
                if self.out_proj.bias is not None:
                    self.out_proj.bias.copy_(mha.out_proj.bias)

        def forward(self, query, key=None, value=None, key_padding_mask=None,
                    need_weights=False, attn_mask=None, average_attn_weights=True,
                    is_causal=False):
            if (key is not None and key is not query) or (value is not None and value is
                                                          not query) or \
                    key_padding_mask is not None or attn_mask is not None or is_causal:
                raise ValueError("blockflow: the tensor-parallel attention is self-attention "
                                 "without masks: call it as attn(x, x, x).")
            n, L, _ = query.shape

            def heads(t):  # the local heads: the rank's columns of Q, K and V
                return t.reshape(n, L, -1, self.head_dim).transpose(1, 2)

            q, k, v = (heads(f(query)) for f in (self.q_proj, self.k_proj, self.v_proj))
            attn = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.head_dim), dim=-1)
            out = self.out_proj((attn @ v).transpose(1, 2).reshape(n, L, -1))
            return out, None

    _ATTENTION.append(ShardableAttention)
    return ShardableAttention


def _prepare(module):
    """A copy of ``module`` torch can shard, and its blocks: ``[(name, kind, units,
    unit_bytes)]`` (kind "mlp": hidden columns; "attention": heads)."""
    import torch

    model = copy.deepcopy(module)
    blocks = []
    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.MultiheadAttention):
            if not m.batch_first or not m._qkv_same_embed_dim or m.bias_k is not None or \
                    m.dropout:
                raise TypeError(f"blockflow: TensorParallel splits self-attention with "
                                f"batch_first=True, one embedding size for Q, K and V, no "
                                f"add_bias_kv and dropout=0 (attention {name or 'module'!r}).")
            E, H = m.embed_dim, m.num_heads
            per_head = (4 * E * (E // H) + 3 * (E // H)) * m.in_proj_weight.element_size()
            blocks.append((name, "attention", H, per_head))
            if name:
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf, _attention_class()(m))
            else:
                model = _attention_class()(m)
        elif isinstance(m, torch.nn.Sequential) and not any(name.startswith(b + ".") or
                                                            not b for b, *_ in blocks):
            kids = list(m.children())
            if len(kids) >= 3 and isinstance(kids[0], torch.nn.Linear) and isinstance(
                    kids[-1], torch.nn.Linear) and all(type(k).__name__ in _ELEMENTWISE
                                                       for k in kids[1:-1]):
                if kids[0].out_features != kids[-1].in_features:
                    raise ValueError(f"blockflow: the MLP block {name or 'module'!r}'s first "
                                     f"layer gives {kids[0].out_features} features but its "
                                     f"last takes {kids[-1].in_features}.")
                per_col = (kids[0].in_features + 1 + kids[-1].out_features) * \
                    kids[0].weight.element_size()
                blocks.append((name, "mlp", kids[0].out_features, per_col))
    if not blocks:
        raise TypeError(f"{_REFUSED}, or a model holding them; got {type(module).__name__} "
                        f"with none.")
    return model, blocks


def _plan(model, blocks) -> dict[str, str]:
    """Submodule name -> "colwise" or "rowwise" for ``parallelize_module``."""
    plan = {}
    for name, kind, *_ in blocks:
        pre = f"{name}." if name else ""
        if kind == "attention":
            plan.update({f"{pre}{p}_proj": "colwise" for p in "qkv"})
            plan[f"{pre}out_proj"] = "rowwise"
        else:
            kids = [n for n, _ in model.get_submodule(name).named_children()]
            plan[pre + kids[0]], plan[pre + kids[-1]] = "colwise", "rowwise"
    return plan


def _external(state: dict, blocks) -> dict:
    """Full tensors named as in the user's module, from the shardable copy's."""
    import torch

    out = dict(state)
    for name, kind, *_ in blocks:
        pre = f"{name}." if name else ""
        for part in ("weight", "bias") if kind == "attention" else ():
            if f"{pre}q_proj.{part}" in out:
                out[f"{pre}in_proj_{part}"] = torch.cat([out.pop(f"{pre}{p}_proj.{part}")
                                                         for p in "qkv"])
    return out


# --- on the workers: one rank ---------------------------------------------------------------


def _pack(obj) -> bytes:
    """``torch.save`` bytes: every dtype travels (distributed's tensor serialiser does not
    take bfloat16, issue 39)."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes):
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _rank(rank, model: bytes, plan: dict, state, job: dict, data: tuple):
    """Rank ``rank.rank``'s part of one call: build the sharded model (from the checkpoint
    ``state``, ``_pack`` bytes), run ``job``, and return rank 0's result as ``_pack`` bytes
    (the others return None)."""
    import cloudpickle
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    def _full(t):  # a collective: every rank calls it, in the same order
        return t.full_tensor() if isinstance(t, DTensor) else t

    torch.manual_seed(job["seed"])
    model = cloudpickle.loads(model).to(rank.device)
    if state is not None:
        model.load_state_dict((state := _unpack(state))["model"])
    mesh = init_device_mesh(rank.device.type, (rank.world_size,))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh, {n: styles[s]() for n, s in plan.items()})
    params = list(model.parameters())
    dtype = params[0].dtype

    def tensor(a):
        t = torch.as_tensor(np.asarray(a)).to(rank.device)
        return t.to(dtype) if t.is_floating_point() else t

    out, kind = {}, job["kind"]
    if kind == "forward":
        model.eval()
        with torch.no_grad():
            y = model(tensor(data[0]))
        out["output"] = (y[0] if isinstance(y, tuple) else y).detach().cpu().clone()
    elif kind == "gradients":
        model.train()
        y = model(tensor(data[0]))
        loss = job["loss"](y[0] if isinstance(y, tuple) else y, tensor(data[1]))
        loss.backward()
        out["loss"] = float(loss.detach())
        out["grads"] = {n: _full(p.grad).detach().cpu().clone()
                        for n, p in model.named_parameters() if p.grad is not None}
    else:  # fit
        opt = job["optimizer"](params)
        if state is not None and state.get("optim") is not None and not job["fresh"]:
            saved = state["optim"]  # full tensors: each rank takes its part, no comms
            for i, s in saved["state"].items():
                p = params[i]
                saved["state"][i] = {k: distribute_tensor(v.to(rank.device), p.device_mesh,
                                                          p.placements, src_data_rank=None)
                                     if isinstance(p, DTensor) and torch.is_tensor(v) and
                                     v.shape == p.shape else v for k, v in s.items()}
            opt.load_state_dict(saved)
        X, Y = tensor(data[0]), tensor(data[1])
        rows, size = X.shape[0], job["batch_size"] or X.shape[0]
        losses, seconds = [], []
        model.train()
        g = torch.Generator().manual_seed(job["seed"] * 1_000_003 + job["epoch0"])
        order = (torch.randperm(rows, generator=g) if job["shuffle"] else
                 torch.arange(rows)).to(rank.device)
        for start in range(0, rows, size):  # one epoch
            idx = order[start:start + size]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            y = model(X[idx])
            loss = job["loss"](y[0] if isinstance(y, tuple) else y, Y[idx])
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            seconds.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
        osd = opt.state_dict()
        osd["state"] = {i: {k: _full(v).detach().cpu().clone() if torch.is_tensor(v) else v
                            for k, v in s.items()} for i, s in osd["state"].items()}
        msd = {n: _full(t).detach().cpu().clone() for n, t in model.state_dict().items()}
        out = {"losses": losses, "seconds": seconds, "state": _pack({"model": msd, "optim": osd})}
    return (out if kind == "fit" else _pack(out)) if rank.rank == 0 else None


# --- the client's handle ----------------------------------------------------------------------


class TensorParallel:
    """A PyTorch model whose MLP blocks and attention layers torch shards across workers.

    Parameters
    ----------
    client : distributed.Client
    module : torch.nn.Module
        An MLP block ``Sequential(Linear(d, h), <element-wise activation>, Linear(h, d_out))``,
        an ``nn.MultiheadAttention`` (self-attention, ``batch_first=True``, no masks), or a
        model holding them: every such block is sharded, every other parameter replicated.
    workers : sequence of str, optional
        Workers to choose among; default all (one per worker process).
    memory_fraction : float, optional
        Fraction (0-1) of each worker's free device memory a rank's parameters may take;
        default config ``blockflow.parallel.memory-fraction``.
    optimizer : callable, optional
        ``optimizer(params) -> torch.optim.Optimizer``, built on every rank; default SGD with
        lr 0.01. Its state is carried between :meth:`fit` calls.
    loss : callable, optional
        ``loss(output, target)``, default mean squared error.
    seed : int, default 0
        Seeds each call's ranks and the batch order under ``shuffle``.

    Attributes
    ----------
    workers : list of str
        The ranks' workers, in rank order.
    widths : dict of str to dict of str to int
        Per worker, per sharded block (its name in ``module``, ``""`` for the module
        itself): its hidden columns (MLP) or heads (attention); the same on every worker
        (torch shards evenly).
    blocks : dict of str to str
        Each sharded block's kind, ``"mlp"`` or ``"attention"``.
    shard_bytes : int
        Parameter bytes each rank holds (its shards and the replicated parameters).
    history_ : list of float
        The loss of every training step so far.
    step_seconds_ : list of float
        Wall seconds of every training step so far on rank 0 (forward, backward with
        torch's collectives, optimizer step).
    steps_ : int
    recoveries : list of dict
        Per rank's worker lost during a call: ``step`` and ``resumed_from`` (the checkpoint's
        step), ``lost`` (workers), ``redone`` (the segment's steps run again).

    Raises
    ------
    TypeError
        For a module with no MLP block or attention layer, an attention layer with masks,
        dropout or bias_kv, or a module that cannot be pickled.
    DeviceMemoryError
        If no even split over the workers fits their free device memory (names the
        shortfall).

    Notes
    -----
    Each call (:meth:`forward`, :meth:`gradients`, each epoch of :meth:`fit`) is one torch
    process group over the chosen workers; the model and optimizer state are a checkpoint
    (full tensors) kept in the workers' memory (two copies) between them. A rank's worker
    lost: one warning line names its shard, the model is re-placed on the workers left and
    the segment runs again from the checkpoint. torch's DTensor shards a
    dimension evenly, so blockflow keeps the workers whose free memory fits the even shard
    and takes as many of them as divide every block's width (uneven shards by free memory,
    :func:`~blockflow.parallel.partition.shard_widths`, are no longer used here).
    Method: Megatron-LM (Shoeybi et al., 2019) through ``torch.distributed.tensor.parallel``.
    """

    def __init__(self, client, module, *, workers: Sequence[str] | None = None,
                 memory_fraction: float | None = None, optimizer: Callable | None = None,
                 loss: Callable | None = None, seed: int = 0):
        import torch

        self.client = client
        self.memory_fraction = float(config.get("parallel.memory-fraction", memory_fraction))
        self._model, self._blocks = _prepare(module)
        self._payload = dumps_or_explain(self._model, "blockflow: TensorParallel",
                                         fix=FIX_TRAIN)
        self.blocks = {name: kind for name, kind, *_ in self._blocks}
        self._plan = _plan(self._model, self._blocks)
        self._choices = None if workers is None else list(workers)
        self.optimizer = optimizer or functools.partial(torch.optim.SGD, lr=0.01)
        self.loss = loss or torch.nn.MSELoss()
        self.seed = int(seed)
        self.history_, self.step_seconds_, self.recoveries = [], [], []
        self.steps_, self._epochs, self._fresh_optimizer = 0, 0, True
        self._state = self._model_future = None  # futures: the checkpoint's _pack bytes, model
        self._place()

    # --- placement -----------------------------------------------------------------------

    def _place(self, exclude: Sequence[str] = ()) -> None:
        """Choose the ranks' workers: the most that divide every block's width and whose
        free memory fits the even shard."""
        free = free_device_memory(self.client)
        choices = [w for w in (self._choices or sorted(free)) if w not in exclude and
                   (w in free or not exclude)]  # re-placing: the chosen workers left
        missing = sorted(set(choices) - set(free))
        if missing:
            raise ValueError(f"blockflow: TensorParallel: workers {missing} are not in the "
                             f"cluster; choose among {sorted(free)}.")
        if not choices:
            raise RuntimeError("blockflow: TensorParallel: no workers to place the model on.")
        choices = sorted(worker_processes(self.client, choices),
                         key=lambda w: (-free[w], w))
        total = sum(p.numel() * p.element_size() for p in self._model.parameters())
        sharded = sum(units * b for _, _, units, b in self._blocks)
        smallest = None
        for n in range(len(choices), 0, -1):
            if any(units % n for _, _, units, _ in self._blocks):
                continue
            need = total - sharded + sharded // n
            smallest = smallest or (n, need)
            fits = [w for w in choices if self.memory_fraction * free[w] >= need]
            if len(fits) >= n:
                self.workers, self.shard_bytes = sorted(fits[:n]), int(need)
                self.widths = {w: {name: units // n for name, _, units, _ in self._blocks}
                               for w in self.workers}
                logger.info("blockflow: tensor parallelism over %d workers: %s", n,
                            self.widths)
                return
        (n, need), best = smallest, choices[0]
        room = self.memory_fraction * free[best]
        short = (f"short by {int(need - room):,} bytes" if need > room else
                 f"only {sum(self.memory_fraction * free[w] >= need for w in choices)} of "
                 f"the {n} workers it needs have that much")
        raise DeviceMemoryError(
            f"blockflow: TensorParallel: an even shard over {n} worker(s) takes {int(need):,} "
            f"bytes of parameters but the most free device memory is {int(free[best]):,} "
            f"bytes on {best} (memory fraction {self.memory_fraction:g}): {short}; add "
            f"workers or devices, or use a smaller model.", working_set=int(need),
            largest_free=int(free[best]) if math.isfinite(free[best]) else None)

    def _shard(self, worker: str) -> str:
        """Which shard ``worker`` holds, in words."""
        r = self.workers.index(worker)
        parts = []
        for name, kind, units, _ in self._blocks:
            w = units // len(self.workers)
            what = "heads" if kind == "attention" else "hidden columns"
            parts.append(f"{what} {r * w}-{(r + 1) * w - 1} of {name or 'the module'}")
        return f"rank {r}'s shard ({', '.join(parts)}) on worker {worker}"

    def _ready(self, what: str) -> bool:
        """Re-place on the workers left, from the checkpoint, if a rank's worker left."""
        gone = [w for w in self.workers if w not in set(workers_info(self.client))]
        if not gone:
            return False
        lost = "; ".join(map(self._shard, gone))
        if self._state is not None and first_kept(self._state) is None:
            raise WorkerLostError(
                f"blockflow: TensorParallel {what}: lost {lost} and both copies of the "
                f"checkpoint of step {self.steps_}; build the TensorParallel again.", lost=gone)
        try:
            self._place(exclude=gone)
        except (DeviceMemoryError, RuntimeError) as e:
            raise WorkerLostError(
                f"blockflow: TensorParallel {what}: lost {lost}, and the workers left cannot "
                f"take the model: {str(e).removeprefix('blockflow: TensorParallel: ')}",
                lost=gone) from None
        warnings.warn(f"blockflow: TensorParallel {what}: lost {lost}; re-placed on "
                      f"{len(self.workers)} worker(s) from the checkpoint of step "
                      f"{self.steps_}.", BlockflowWarning, stacklevel=4)
        self._model_future = None
        return True

    def _scatter(self, value, what: str):
        while True:
            try:
                return self.client.scatter(value, workers=self.workers, broadcast=True,
                                           hash=False)
            except (KeyError, OSError):  # a worker left between the check and the scatter
                pass
            if not self._ready(what) and not gone_workers(self.client, self.workers):
                raise RuntimeError(f"blockflow: TensorParallel {what}: could not send the "
                                   f"model or data to workers {self.workers}.")

    def _ship(self, data: tuple, what: str) -> tuple:
        """The call's arrays as futures on the ranks' workers (dask arrays computed there)."""
        return tuple(self.client.compute(d) if hasattr(d, "dask") else
                     self._scatter(_host(d), what) for d in data)

    def _call(self, job: dict, data: tuple, what: str, gather: bool = True):
        """One group running ``job``; a rank's worker lost: re-placed, the job run again."""
        while True:
            self._ready(what)
            if self._model_future is None:
                self._model_future = self._scatter(self._payload, what)
            state = None if self._state is None else first_kept(self._state)
            args = [(self._model_future, self._plan, state, job, data)] * \
                len(self.workers)
            try:
                return run_group(self.client, self.workers, _rank, args, gather=gather,
                                 name="tensor-parallel", what=f"tensor-parallel {what}")
            except (GroupLost, RankFailed) as e:
                # a peer's collective may fail before the scheduler drops the worker
                gone = set(e.lost) if isinstance(e, GroupLost) else \
                    gone_workers(self.client, self.workers)
                if not gone:
                    raise RuntimeError(f"blockflow: TensorParallel {what} failed: {e}"
                                       ) from None
                self.recoveries.append(dict(step=self.steps_, resumed_from=self.steps_,
                                            lost=sorted(gone), redone=job.get("steps", 0)))

    # --- calls ---------------------------------------------------------------------------

    def fit(self, X, y, *, epochs: int = 1, batch_size: int | None = None,
            optimizer: Callable | None = None, loss: Callable | None = None,
            shuffle: bool = False) -> "TensorParallel":
        """Train on ``X``, ``y`` (NumPy, torch or dask arrays): a group per epoch.

        Every rank runs every batch (tensor parallelism splits the model, not the data);
        batches are rows ``[i*batch_size, (i+1)*batch_size)`` of each epoch's order (the rows'
        order, or under ``shuffle`` a permutation seeded by ``seed`` and the epoch). Floating
        inputs are cast to the model's dtype. The model and optimizer state after the call
        stay on the workers (two copies). ``optimizer=`` other than the current one starts
        a fresh optimizer state; ``loss=`` replaces the loss.

        Raises
        ------
        ValueError
            For rows of ``X`` and ``y`` that differ, non-finite values, or epochs or
            batch_size below 1.
        WorkerLostError
            One line naming the lost shard's worker where the workers left cannot take the
            model or the checkpoint's copies went with it.
        """
        if int(epochs) < 1 or (batch_size is not None and int(batch_size) < 1):
            raise ValueError(f"blockflow: TensorParallel.fit needs epochs >= 1 and "
                             f"batch_size >= 1, got epochs={epochs}, batch_size={batch_size}.")
        _check(X=X, y=y)
        if len(X) != len(y):
            raise ValueError(f"blockflow: TensorParallel.fit: X has {len(X)} rows but y has "
                             f"{len(y)}.")
        if optimizer is not None and optimizer is not self.optimizer:
            self.optimizer, self._fresh_optimizer = optimizer, True
        if loss is not None:
            self.loss = loss
        data = self._ship((X, y), "training")
        for _ in range(int(epochs)):  # a segment per epoch, each ending in a checkpoint
            job = dict(kind="fit", batch_size=batch_size, shuffle=shuffle,
                       seed=self.seed, epoch0=self._epochs, optimizer=self.optimizer,
                       loss=self.loss, fresh=self._fresh_optimizer,
                       steps=-(-len(X) // (batch_size or len(X))))
            rank0 = self._call(job, data, "training", gather=False)[0]
            losses, seconds = self.client.submit(operator.itemgetter("losses", "seconds"),
                                                 rank0, pure=False).result()
            state = self.client.submit(operator.getitem, rank0, "state", pure=False)
            wait(state)  # kept on the worker, and a copy on another
            [kept] = keep_copies(self.client, [state], sorted(workers_info(self.client)),
                                 [self.workers[0]])
            self._state, self._fresh_optimizer = kept, False
            self.history_ += losses
            self.step_seconds_ += seconds
            self.steps_ += len(losses)
            self._epochs += 1
        return self

    def forward(self, x):
        """The model's output for ``x`` (evaluation mode, no gradients), a CPU tensor."""
        _check(x=x)
        out = self._call(dict(kind="forward", seed=self.seed),
                         self._ship((x,), "forward pass"), "forward pass")[0]
        return _unpack(out)["output"]

    def predict(self, X) -> np.ndarray:
        """:meth:`forward` as a NumPy array (float32 for a bfloat16 or float16 model)."""
        out = self.forward(X)
        return (out.float() if out.is_floating_point() and out.dtype.itemsize < 4 else
                out).numpy()

    def gradients(self, X, y, loss: Callable | None = None) -> dict:
        """Loss and full gradients (by the module's parameter names) of one batch, without
        an update: ``{"loss": float, "grads": {name: tensor}}``."""
        _check(X=X, y=y)
        job = dict(kind="gradients", seed=self.seed, loss=loss or self.loss)
        what = "gradient pass"
        out = _unpack(self._call(job, self._ship((X, y), what), what)[0])
        return {"loss": out["loss"], "grads": _external(out["grads"], self._blocks)}

    def state_dict(self) -> dict:
        """The module's parameters and buffers as full tensors, named as in ``module``
        (from the checkpoint on the workers; no group is formed)."""
        if self._state is None:
            return _external(self._model.state_dict(), self._blocks)
        try:
            state = _unpack(first_kept(self._state).result())["model"]
        except Exception:
            raise WorkerLostError(f"blockflow: TensorParallel.state_dict: the checkpoint of "
                                  f"step {self.steps_} was lost with its workers.") from None
        return _external(state, self._blocks)

    def close(self) -> None:
        """Drop the checkpoint and the shipped model from the workers."""
        self._state = self._model_future = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _host(a) -> np.ndarray:
    """A host array to ship (half-precision tensors as float32: cast back on the rank)."""
    if hasattr(a, "detach"):
        a = a.detach().cpu()
        return (a.float() if a.dtype.is_floating_point and a.dtype.itemsize < 4 else a).numpy()
    return np.asarray(a)


def _check(**arrays) -> None:
    """Non-finite values refused naming the argument (dask arrays are checked on use)."""
    for what, a in arrays.items():
        bad = 0 if hasattr(a, "dask") or (arr := _host(a)).dtype.kind != "f" else \
            int((~np.isfinite(arr)).sum())
        if bad:
            raise ValueError(f"blockflow: TensorParallel: {what} has {bad} non-finite "
                             f"values (NaN or inf).")
