"""Tensor (model) parallelism for PyTorch: pairs of ``nn.Linear`` split across workers.

As in Megatron-LM (Shoeybi et al., 2019): the first layer of a pair split by columns, the
second by rows, partial outputs summed; attention split by heads. Shard widths follow free
device memory (:func:`~blockflow.parallel.partition.shard_widths`). Guide: docs/guide/ai.md.
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
from typing import Callable, Mapping, Sequence

import cloudpickle
import numpy as np

from blockflow import config
from blockflow.errors import WorkerLostError
from blockflow.ml.parallel._stage import _device, _here  # where a shard lives, its device
from blockflow.ml.parallel.partition import shard_widths
from blockflow.scheduling.view import worker_memory, workers_info
from blockflow.scheduling.wait import gather_as_done

__all__ = ["TensorParallel", "free_device_memory"]

logger = logging.getLogger(__name__)

_ELEMENTWISE = ("GELU", "ReLU", "Tanh", "SiLU", "Sigmoid", "Identity", "LeakyReLU", "ELU",
                "Mish", "Softplus")


def free_device_memory(client) -> dict[str, float]:
    """Free memory per worker in bytes, as the client's view of the cluster reads it.

    Reported device memory where a worker reports it, else host memory limit minus process
    memory, else ``math.inf`` (:attr:`blockflow.scheduling.view.WorkerMemory.free`).
    """
    return {a: float(m.free) for a, m in worker_memory(client).items()}


# --- worker side ---------------------------------------------------------------------------

#: (worker address, shard key) -> shard state
_SHARDS: dict[tuple[str, str], dict] = {}
_LOCK = threading.Lock()


def _install(key: str, payload: bytes, optimizer) -> int:
    module = cloudpickle.loads(payload).to(_device())
    opt = optimizer(list(module.parameters())) if optimizer is not None else None
    with _LOCK:
        _SHARDS[_here(), key] = {"module": module, "opt": opt, "stash": {}}
    return int(sum(p.numel() * p.element_size() for p in module.parameters()))


def _shard(key: str) -> dict:
    try:
        return _SHARDS[_here(), key]
    except KeyError:
        raise RuntimeError(f"blockflow: tensor-parallel shard {key} is not on worker "
                           f"{_here()}; build the TensorParallel again.") from None


def _forward(key: str, x, call: str | None, train: bool):
    """The shard's partial output; with ``call`` its input and graph are kept."""
    import torch

    sh = _shard(key)
    x = x.to(_device())
    sh["module"].train(train)
    if call is None:
        with torch.no_grad():
            return sh["module"](x).cpu()
    leaf = x.detach().requires_grad_(x.is_floating_point())
    y = sh["module"](leaf)
    with _LOCK:
        sh["stash"][call] = (leaf, y)
    return y.detach().cpu()


def _backward(key: str, call: str, dy):
    """Backward of the shard's output with ``dy``; returns its part of the input's gradient."""
    import torch

    sh = _shard(key)
    with _LOCK:
        leaf, y = sh["stash"].pop(call)
    torch.autograd.backward(y, dy.to(y.device))
    return None if leaf.grad is None else leaf.grad.cpu()


def _grads(key: str) -> dict:
    return {n: (None if p.grad is None else p.grad.detach().cpu().clone())
            for n, p in _shard(key)["module"].named_parameters()}


def _params(key: str) -> dict:
    return {n: p.detach().cpu().clone() for n, p in _shard(key)["module"].named_parameters()}


def _step(key: str) -> None:
    sh = _shard(key)
    if sh["opt"] is not None:
        sh["opt"].step()
    sh["module"].zero_grad(set_to_none=True)


def _zero(key: str) -> None:
    sh = _shard(key)
    sh["module"].zero_grad(set_to_none=True)
    sh["stash"].clear()


def _drop(key: str) -> None:
    with _LOCK:
        _SHARDS.pop((_here(), key), None)


def _mlp_shard(lin1, act, lin2, cols, with_bias: bool):
    """Columns ``cols`` of ``lin1`` and rows ``cols`` of ``lin2`` as one module."""
    import torch

    a = torch.nn.Linear(lin1.in_features, len(cols), bias=lin1.bias is not None,
                        dtype=lin1.weight.dtype)
    b = torch.nn.Linear(len(cols), lin2.out_features, bias=with_bias and lin2.bias is not None,
                        dtype=lin2.weight.dtype)
    with torch.no_grad():
        a.weight.copy_(lin1.weight[cols])
        if lin1.bias is not None:
            a.bias.copy_(lin1.bias[cols])
        b.weight.copy_(lin2.weight[:, cols])
        if b.bias is not None:
            b.bias.copy_(lin2.bias)
    return torch.nn.Sequential(a, act, b)


def _attention_shard(mha, heads: Sequence[int], with_bias: bool):
    """Heads ``heads`` of ``mha``: their Q, K, V rows and output-projection columns."""
    import torch

    E, H = mha.embed_dim, mha.num_heads
    hd = E // H
    rows = np.concatenate([np.arange(h * hd, (h + 1) * hd) for h in heads])
    W, b = mha.in_proj_weight, mha.in_proj_bias

    class AttentionShard(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n_heads, self.head_dim = len(heads), hd
            self.q = torch.nn.Linear(E, len(rows), bias=b is not None, dtype=W.dtype)
            self.k = torch.nn.Linear(E, len(rows), bias=b is not None, dtype=W.dtype)
            self.v = torch.nn.Linear(E, len(rows), bias=b is not None, dtype=W.dtype)
            self.out = torch.nn.Linear(len(rows), E, bias=with_bias and
                                       mha.out_proj.bias is not None, dtype=W.dtype)

        def forward(self, x):
            n, L, _ = x.shape

            def heads_of(t):
                return t.view(n, L, self.n_heads, self.head_dim).transpose(1, 2)

            q, k, v = heads_of(self.q(x)), heads_of(self.k(x)), heads_of(self.v(x))
            attn = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.head_dim), dim=-1)
            o = (attn @ v).transpose(1, 2).reshape(n, L, self.n_heads * self.head_dim)
            return self.out(o)

    shard = AttentionShard()
    idx = torch.as_tensor(rows)
    with torch.no_grad():
        for i, lin in enumerate((shard.q, shard.k, shard.v)):
            lin.weight.copy_(W[i * E:(i + 1) * E][idx])
            if b is not None:
                lin.bias.copy_(b[i * E:(i + 1) * E][idx])
        shard.out.weight.copy_(mha.out_proj.weight[:, idx])
        if shard.out.bias is not None:
            shard.out.bias.copy_(mha.out_proj.bias)
    return shard


# --- client side ---------------------------------------------------------------------------


def _split(units: int, widths: Mapping[str, int] | Sequence[int] | None, free, unit_bytes,
           fraction) -> dict[str, int]:
    if widths is None:
        return shard_widths(units, free, unit_bytes, memory_fraction=fraction)
    if not isinstance(widths, Mapping):
        widths = dict(zip(sorted(free), widths))
    widths = {w: int(c) for w, c in widths.items() if int(c) > 0}
    if sum(widths.values()) != units or set(widths) - set(free):
        raise ValueError(f"blockflow: widths {widths} must be workers of the cluster whose "
                         f"widths sum to {units}.")
    return widths


class TensorParallel:
    """One block of a PyTorch model split across workers, Megatron-LM style.

    Parameters
    ----------
    client : distributed.Client
    module : torch.nn.Sequential or torch.nn.MultiheadAttention
        An MLP block ``Sequential(Linear(d, h), <element-wise activation>, Linear(h, d_out))``,
        or a self-attention layer (``batch_first=True``, no masks).
    workers : sequence of str, optional
        Workers to shard over; default all.
    widths : mapping of str to int or sequence of int, optional
        Hidden columns (or heads) per worker; default by free device memory.
    memory_fraction : float, optional
        Fraction (0-1) of each worker's free device memory the shards may take; default
        config ``blockflow.parallel.memory-fraction``.
    optimizer : callable, optional
        ``optimizer(params)`` built on each shard's worker; :meth:`step` steps it.

    Attributes
    ----------
    widths : dict of str to int
        Hidden columns (MLP) or heads (attention) per worker.
    kind : {"mlp", "attention"}

    Raises
    ------
    TypeError
        For a module of another kind.
    DeviceMemoryError
        If the weights do not fit the workers' free device memory together.

    Notes
    -----
    Put ``tp.as_module()`` in a model (``model[2] = tp.as_module()``).
    """

    def __init__(self, client, module, *, workers: Sequence[str] | None = None,
                 widths=None, memory_fraction: float | None = None,
                 optimizer: Callable | None = None):
        import torch

        self.client = client
        self.memory_fraction = float(config.get("parallel.memory-fraction", memory_fraction))
        free = free_device_memory(client)
        if workers is not None:
            missing = sorted(set(workers) - set(free))
            if missing:
                raise ValueError(f"blockflow: workers {missing} are not in the cluster.")
            free = {w: free[w] for w in workers}
        if not free:
            raise RuntimeError("blockflow: the cluster has no workers; start some first.")
        self._names = [n for n, _ in module.named_parameters()]
        self._shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
        if isinstance(module, torch.nn.MultiheadAttention):
            self.kind = "attention"
            if not module.batch_first or not module._qkv_same_embed_dim or \
                    module.bias_k is not None or module.dropout:
                raise TypeError("blockflow: TensorParallel splits self-attention with "
                                "batch_first=True, one embedding size for Q, K and V, no "
                                "add_bias_kv and dropout=0.")
            E, H = module.embed_dim, module.num_heads
            per_head = (3 * (E * (E // H) + E // H) + E * (E // H)) * module.in_proj_weight \
                .element_size()
            self.widths = _split(H, widths, free, per_head, self.memory_fraction)
            self.batch_first = True
        else:
            kids = list(module.children()) if isinstance(module, torch.nn.Sequential) else []
            if len(kids) < 2 or not isinstance(kids[0], torch.nn.Linear) or not isinstance(
                    kids[-1], torch.nn.Linear) or any(type(k).__name__ not in _ELEMENTWISE
                                                      for k in kids[1:-1]):
                raise TypeError(f"blockflow: TensorParallel splits an MLP block "
                                f"Sequential(Linear, <element-wise activation>, Linear) or "
                                f"an nn.MultiheadAttention, got {type(module).__name__}.")
            lin1, lin2 = kids[0], kids[-1]
            if lin1.out_features != lin2.in_features:
                raise ValueError(f"blockflow: the MLP block's first layer gives "
                                 f"{lin1.out_features} features but the second takes "
                                 f"{lin2.in_features}.")
            self.kind = "mlp"
            h = lin1.out_features
            per_col = (lin1.in_features + 1 + lin2.out_features) * lin1.weight.element_size()
            self.widths = _split(h, widths, free, per_col, self.memory_fraction)
        self.workers = list(self.widths)
        self._module = module
        token = uuid.uuid4().hex[:10]
        self._keys, self._units, futs = [], [], []
        start = 0
        for i, w in enumerate(self.workers):
            units = list(range(start, start + self.widths[w]))
            start += self.widths[w]
            if self.kind == "mlp":
                act = torch.nn.Sequential(*kids[1:-1])
                shard = _mlp_shard(lin1, act, lin2, units, with_bias=i == 0)
            else:
                shard = _attention_shard(module, units, with_bias=i == 0)
            key = f"tp-{token}-{i}"
            self._keys.append(key)
            self._units.append(units)
            futs.append(client.submit(_install, key, cloudpickle.dumps(shard), optimizer,
                                      workers=[w], allow_other_workers=False, pure=False))
        self.shard_bytes = dict(zip(self.workers, self._gather(futs, "placing the shards")))
        logger.info("blockflow: tensor-parallel %s split %s across workers (free memory %s "
                    "bytes, fraction %g)", self.kind, self.widths,
                    {w: free[w] for w in self.workers}, self.memory_fraction)

    # --- passes --------------------------------------------------------------------------

    def _alive(self):
        return set(workers_info(self.client))

    def _gather(self, futures: list, what: str) -> list:
        index = {f.key: i for i, f in enumerate(futures)}
        out: list = [None] * len(futures)

        def get(f):
            out[index[f.key]] = f.result()

        try:
            gather_as_done(futures, alive=self._alive, needed=set(self.workers), get=get)
        except WorkerLostError as e:
            roles = {w: f"the shard of {self.kind} {'columns' if self.kind == 'mlp' else 'heads'}"
                        f" {u[0]}-{u[-1]}" for w, u in zip(self.workers, self._units)}
            lost = sorted(set(e.lost) & set(roles))
            raise WorkerLostError(
                f"blockflow: {what} failed: lost "
                f"{'; '.join(f'{roles[w]} on worker {w}' for w in lost)}, which left the "
                f"cluster; build the TensorParallel again on the workers left.",
                lost=lost) from None
        return out

    def _each(self, fn, *args, what: str) -> list:
        futs = [self.client.submit(fn, k, *args, workers=[w], allow_other_workers=False,
                                   pure=False) for k, w in zip(self._keys, self.workers)]
        return self._gather(futs, what)

    def forward_remote(self, x, call: str | None, train: bool):
        """The block's output for ``x`` (a CPU tensor), shard outputs summed."""
        xf = self.client.scatter(x, workers=self.workers, broadcast=True, hash=False)
        parts = self._each(_forward, xf, call, train, what="the tensor-parallel forward pass")
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    def backward_remote(self, call: str, dy):
        """The input's gradient for the output's gradient ``dy``, shard parts summed."""
        dyf = self.client.scatter(dy, workers=self.workers, broadcast=True, hash=False)
        parts = [p for p in self._each(_backward, call, dyf,
                                       what="the tensor-parallel backward pass")
                 if p is not None]
        if not parts:
            return None
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    def as_module(self):
        """A drop-in ``torch.nn.Module`` running this block on its shards."""
        return _TensorParallelModule(self)

    def __call__(self, *args, **kwargs):
        return self.as_module()(*args, **kwargs)

    # --- parameters ------------------------------------------------------------------------

    def _assemble(self, parts: list[dict]) -> dict:
        """Full-size tensors, named as in the original module, from each shard's."""
        import torch

        out = {}
        if self.kind == "mlp":
            first, last = self._mlp_names()
            for name in self._names:
                if name == f"{first}.weight":
                    out[name] = torch.cat([p["0.weight"] for p in parts], 0)
                elif name == f"{first}.bias":
                    out[name] = torch.cat([p["0.bias"] for p in parts], 0)
                elif name == f"{last}.weight":
                    out[name] = torch.cat([p["2.weight"] for p in parts], 1)
                elif name == f"{last}.bias":
                    out[name] = parts[0]["2.bias"]
            return out
        E = self._module.embed_dim
        w = [torch.cat([p[f"{x}.weight"] for p in parts], 0) for x in "qkv"]
        out["in_proj_weight"] = torch.cat(w, 0)
        if "in_proj_bias" in self._names:
            out["in_proj_bias"] = torch.cat([torch.cat([p[f"{x}.bias"] for p in parts], 0)
                                             for x in "qkv"], 0)
        out["out_proj.weight"] = torch.cat([p["out.weight"] for p in parts], 1)
        if "out_proj.bias" in self._names:
            out["out_proj.bias"] = parts[0]["out.bias"]
        assert out["in_proj_weight"].shape == (3 * E, E)
        return out

    def _mlp_names(self) -> tuple[str, str]:
        kids = [n for n, _ in self._module.named_children()]
        return kids[0], kids[-1]

    def grads(self) -> dict:
        """Gradients of the original module's parameters (by name), reassembled."""
        parts = self._each(_grads, what="gathering the gradients")
        return self._assemble(parts)

    def state_dict(self) -> dict:
        """The original module's parameters (by name), reassembled on the client."""
        parts = self._each(_params, what="state_dict()")
        return self._assemble(parts)

    def step(self) -> None:
        """Step each shard's optimizer on its worker, then zero the gradients."""
        self._each(_step, what="the optimizer step")

    def zero_grad(self) -> None:
        """Zero the shards' gradients and drop any kept activations."""
        self._each(_zero, what="zeroing the gradients")

    def close(self) -> None:
        """Drop the shards from their workers."""
        alive = self._alive()
        for k, w in zip(self._keys, self.workers):
            if w in alive:
                self.client.submit(_drop, k, workers=[w], pure=False)
        self._keys = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _function():
    import torch

    class _Remote(torch.autograd.Function):
        @staticmethod
        def forward(ctx, anchor, x, tp, call):
            ctx.tp, ctx.call = tp, call
            ctx.x_dtype = x.dtype
            return tp.forward_remote(x.detach().cpu(), call, True)

        @staticmethod
        def backward(ctx, dy):
            dx = ctx.tp.backward_remote(ctx.call, dy.detach().cpu().contiguous())
            return None, dx, None, None

    return _Remote


def _make_module_class():
    import torch

    class TensorParallelModule(torch.nn.Module):
        """``torch.nn.Module`` face of a :class:`TensorParallel` block."""

        def __init__(self, tp: TensorParallel):
            super().__init__()
            self.tp = tp
            self.batch_first = True

        def forward(self, x, key=None, value=None, attn_mask=None, key_padding_mask=None,
                    need_weights=False, is_causal=False, **_):
            if self.tp.kind == "attention":
                if (key is not None and key is not x) or (value is not None and value is not x) \
                        or attn_mask is not None or key_padding_mask is not None or is_causal:
                    raise ValueError("blockflow: the tensor-parallel attention is "
                                     "self-attention without masks: call it as tp(x).")
            if torch.is_grad_enabled() and self.training:
                anchor = torch.zeros((), requires_grad=True)
                out = _function().apply(anchor, x, self.tp, uuid.uuid4().hex)
            else:
                out = self.tp.forward_remote(x.detach().cpu(), None, False)
            out = out.to(x.device)
            return (out, None) if self.tp.kind == "attention" and key is not None else out

    return TensorParallelModule


_MODULE_CLASS: list = []


def _TensorParallelModule(tp: TensorParallel):
    if not _MODULE_CLASS:
        _MODULE_CLASS.append(_make_module_class())
    return _MODULE_CLASS[0](tp)

