"""Tensor (model) parallelism: a stack of linear layer pairs split across workers, Megatron-style.

Each *block* of the model is ``y = act(x @ A + a) @ B + b`` (two linear layers with an
element-wise activation between them, the MLP of a transformer layer). As in Megatron-LM
(Shoeybi et al., 2019), ``A`` is split by **columns** and ``B`` by **rows** into shards that
live on different workers: shard ``i`` computes ``act(x @ A_i + a_i) @ B_i`` on its own
worker, with no communication inside the block, and the partial outputs are summed (a
fan-in tree of futures). The backward pass mirrors it: each shard's gradients (``dA_i``,
``da_i``, ``dB_i``) are computed on the shard's worker from the activations it saved there,
and the input gradients ``dx_i`` are summed.

The weights are dask.array blocks pinned to workers (``client.persist(..., workers=[w])``
per block, generated or loaded there: a dask array input is never gathered to one place),
and each worker's shard width is proportional to its **free device memory** (the GPU
metrics workers report; host memory on CPU workers), so a model larger than any single
device runs when the devices together hold it. On workers with a GPU (CuPy installed, a
device visible) the shards are moved to device memory; elsewhere they stay NumPy.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Callable, Sequence

import numpy as np

from blockflow import _distributed, config
from blockflow.scheduling.client import gather_results, lost_roles, wait_for, worker_memory
from blockflow.ml.parallel.partition import check_fits, shard_widths

__all__ = ["TensorParallelMLP", "free_device_memory", "random_blocks"]

logger = logging.getLogger(__name__)

_ACTIVATIONS = ("tanh", "relu")


# --- worker-side functions (shipped by reference; no closures) -------------------------


def _xp_of(x):
    from blockflow.backends import array_module
    return array_module(x)


def _to_device(block):
    """A weight block in device memory on a GPU worker (CuPy), unchanged elsewhere."""
    from blockflow.backends import gpu_device_count, has_package
    if has_package("cupy") and gpu_device_count() > 0:
        import cupy
        return cupy.asarray(block)
    return np.asarray(block, dtype=np.float64)


def _to_host(x):
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


def _act(z, activation):
    xp = _xp_of(z)
    return xp.tanh(z) if activation == "tanh" else xp.maximum(z, 0)


def _act_grad(z, h, activation):
    return 1.0 - h * h if activation == "tanh" else (z > 0).astype(z.dtype)


def _shard_forward(A, a, B, x, activation):
    """Shard ``i``: ``(saved, partial)``; ``saved`` stays on the shard's worker."""
    xp = _xp_of(A)
    x = xp.asarray(x)
    z = x @ A + a
    h = _act(z, activation)
    return (x, z, h), h @ B


def _first(pair):
    return pair[0]


def _second(pair):
    return pair[1]


def _shard_backward(A, B, fwd, dy, activation):
    """Shard ``i``'s gradients ``{"A", "a", "B"}`` and its part of ``dx``."""
    (x, z, h), _ = fwd
    xp = _xp_of(A)
    dy = xp.asarray(dy)
    dh = dy @ B.T
    dz = dh * _act_grad(z, h, activation)
    return {"A": x.T @ dz, "a": dz.sum(axis=0), "B": h.T @ dy}, dz @ A.T


def _grad_part(result, name):
    return result[0][name]


def _add(*parts):
    out = parts[0]
    for p in parts[1:]:
        out = out + _xp_of(out).asarray(p)
    return out


def _add_bias(y, b):
    return _to_host(y + _xp_of(y).asarray(b))


def _bias_grad(dy):
    return _to_host(dy).sum(axis=0)


def _tree_sum(client, futures: list, split_every: int, worker: str | None):
    """Sum futures by a fan-in tree of ``split_every`` (the last add on ``worker``)."""
    while len(futures) > 1:
        groups = [futures[i:i + split_every] for i in range(0, len(futures), split_every)]
        last = len(groups) == 1
        futures = [g[0] if len(g) == 1 else client.submit(
            _add, *g, pure=False, workers=[worker] if last and worker else None)
            for g in groups]
    return futures[0]


def free_device_memory(client) -> dict[str, float]:
    """Free memory per worker in bytes, as the client's view of the cluster reads it.

    Reported device memory (``gpu-memory-total`` minus ``gpu_memory_used``) where a worker
    reports it, else its host memory limit minus its process memory, else ``math.inf``
    (unknown): :attr:`blockflow.scheduling.client.WorkerMemory.free`.
    """
    return {a: float(m.free) for a, m in worker_memory(client).items()}


def random_blocks(sizes: Sequence[int], hidden: int | Sequence[int], *, seed: int = 0,
                  chunk_columns: int = 64, scale: float | None = None) -> list[tuple]:
    """Random weights of a tensor-parallel MLP as lazy dask arrays (never materialised whole).

    Parameters
    ----------
    sizes : sequence of int
        Feature widths between blocks: block ``k`` maps ``sizes[k]`` to ``sizes[k+1]``.
    hidden : int or sequence of int
        Hidden width of each block (one for all).
    seed : int, default 0
    chunk_columns : int, default 64
        Columns (of ``A``; rows of ``B``) per generated chunk: the unit the shards are cut
        from, so no worker ever generates more than its shard plus one chunk.
    scale : float, optional
        Standard deviation; default ``1 / sqrt(fan_in)`` (LeCun initialisation).

    Returns
    -------
    list of (A, a, B, b) dask arrays
        ``A`` ``(sizes[k], h)``, ``a`` ``(h,)``, ``B`` ``(h, sizes[k+1])``, ``b``
        ``(sizes[k+1],)``, float64.
    """
    import dask.array as da

    n = len(sizes) - 1
    hs = [hidden] * n if isinstance(hidden, int) else list(hidden)
    rng = da.random.default_rng(seed)
    out = []
    for k in range(n):
        d_in, h, d_out = sizes[k], hs[k], sizes[k + 1]
        c = min(chunk_columns, h)
        sa = scale or 1 / math.sqrt(d_in)
        sb = scale or 1 / math.sqrt(h)
        out.append((rng.normal(0, sa, (d_in, h), chunks=(d_in, c)),
                    rng.normal(0, sa, (h,), chunks=(c,)),
                    rng.normal(0, sb, (h, d_out), chunks=(c, d_out)),
                    rng.normal(0, sb, (d_out,), chunks=(d_out,))))
    return out


class TensorParallelMLP:
    """A stack of MLP blocks whose weights are split across workers (Megatron-LM style).

    Block ``k`` computes ``y = act(x @ A_k + a_k) @ B_k + b_k``. ``A_k`` is split by columns,
    ``a_k`` with it, ``B_k`` by rows; shard ``i`` of every block lives on worker ``i``, its
    width proportional to that worker's free device memory.

    Parameters
    ----------
    client : distributed.Client
    blocks : sequence of (A, a, B, b)
        Per block: ``A`` ``(d_in, h)``, ``a`` ``(h,)``, ``B`` ``(h, d_out)``, ``b`` ``(d_out,)``;
        NumPy or dask arrays (dask arrays are computed shard by shard on the shard's worker,
        see :func:`random_blocks`). float64.
    activation : {"tanh", "relu"}, default "tanh"
    workers : sequence of str, optional
        Worker addresses to shard over; default all.
    memory_fraction : float, optional
        Fraction (0-1) of each worker's free device memory the weights may take; default
        config ``blockflow.parallel.memory-fraction``.
    split_every : int, default 4
        Fan-in of the sums of partial outputs and input gradients.
    kernel : callable, optional
        Decorator applied to the shard functions on the workers (e.g.
        ``blockflow.testing.slowed_to_device_speed`` for simulated devices).

    Attributes
    ----------
    widths : dict of str to int
        Hidden columns per worker, all blocks together (each block is split in the same
        proportions).
    weights : list of dict of str to dask.array.Array
        Per block ``{"A", "a", "B", "b"}`` as dask arrays whose blocks are the pinned shards.
    shard_bytes : dict of str to int
        Weight bytes planned on each worker.

    Raises
    ------
    DeviceMemoryError
        If the weights do not fit the workers' free device memory together (the message
        names the shortfall in bytes).
    ValueError
        For shapes that do not chain, or an unknown activation.
    """

    def __init__(self, client, blocks: Sequence[tuple], *, activation: str = "tanh",
                 workers: Sequence[str] | None = None, memory_fraction: float | None = None,
                 split_every: int = 4, kernel: Callable | None = None):
        import dask.array as da

        if activation not in _ACTIVATIONS:
            raise ValueError(f"blockflow: activation must be one of {_ACTIVATIONS}, got "
                             f"{activation!r}.")
        self.client, self.activation, self.split_every = client, activation, split_every
        self.memory_fraction = float(config.get("parallel.memory-fraction", memory_fraction))
        self._fwd = kernel(_shard_forward) if kernel else _shard_forward
        self._bwd = kernel(_shard_backward) if kernel else _shard_backward
        blocks = [tuple(a if isinstance(a, da.Array) else np.asarray(a, dtype=np.float64)
                        for a in blk) for blk in blocks]
        self._check_shapes(blocks)
        free = free_device_memory(client)
        if workers is not None:
            missing = sorted(set(workers) - set(free))
            if missing:
                raise ValueError(f"blockflow: workers {missing} are not in the cluster.")
            free = {w: free[w] for w in workers}
        if not free:
            raise RuntimeError("blockflow: the cluster has no workers; start some first.")
        # One split for all blocks: a fraction of every block's columns per worker.
        total_h = sum(A.shape[1] for A, *_ in blocks)
        col_bytes = sum((A.shape[0] + 1 + B.shape[1]) * 8 * A.shape[1]
                        for A, _, B, _ in blocks) / total_h
        bias_bytes = sum(b.shape[0] * 8 for *_, b in blocks)
        check_fits(math.ceil(col_bytes * total_h) + bias_bytes, free, self.memory_fraction)
        first = sorted(free)[0]  # holds the output biases
        room = {w: f - (bias_bytes / self.memory_fraction if w == first else 0)
                for w, f in free.items()}
        frac = shard_widths(total_h, room, math.ceil(col_bytes),
                            memory_fraction=self.memory_fraction)
        self.workers = sorted(frac)
        self.head = first  # holds the output biases and sums the partial outputs
        self.widths = frac
        logger.info("blockflow: tensor-parallel shards of %d hidden columns: %s, from free "
                    "memory %s bytes (fraction %g)", total_h, frac,
                    {w: free[w] for w in frac}, self.memory_fraction)
        self._place(blocks)

    @staticmethod
    def _check_shapes(blocks):
        if not blocks:
            raise ValueError("blockflow: a TensorParallelMLP needs at least one block.")
        for k, (A, a, B, b) in enumerate(blocks):
            if (A.ndim, a.ndim, B.ndim, b.ndim) != (2, 1, 2, 1) or a.shape[0] != A.shape[1] \
                    or B.shape[0] != A.shape[1] or b.shape[0] != B.shape[1]:
                raise ValueError(f"blockflow: block {k} needs A (d_in, h), a (h,), B (h, d_out), "
                                 f"b (d_out,); got {A.shape}, {a.shape}, {B.shape}, {b.shape}.")
            if k and A.shape[0] != blocks[k - 1][2].shape[1]:
                raise ValueError(f"blockflow: block {k} takes {A.shape[0]} features but block "
                                 f"{k - 1} gives {blocks[k - 1][2].shape[1]}.")

    def _split(self, h: int) -> list[int]:
        """This block's hidden columns per worker, in the workers' proportions."""
        total = sum(self.widths.values())
        exact = np.array([h * self.widths[w] / total for w in self.workers])
        cols = np.floor(exact).astype(int)
        for i in np.argsort(-(exact - cols), kind="stable")[: h - cols.sum()]:
            cols[i] += 1
        return [int(c) for c in cols]

    def _pin(self, piece, worker: str):
        """One weight block as a future held on ``worker`` (in its device memory on a GPU
        worker): NumPy slices are sent straight there, dask pieces computed there."""
        from distributed import futures_of

        on = dict(workers=[worker], allow_other_workers=False)
        if isinstance(piece, np.ndarray):
            src = self.client.scatter(piece, workers=[worker], hash=False)
            return self.client.submit(_to_device, src, pure=False, **on)
        (pinned,) = self.client.persist(
            [piece.rechunk(-1).map_blocks(_to_device, dtype=np.float64)], **on)
        return futures_of(pinned)[0]

    def _place(self, blocks) -> None:
        import dask.array as da

        self.shards: list[list[dict | None]] = []  # per block, per worker: futures A, a, B
        self.bias: list = []
        self.weights: list[dict] = []
        self.shard_bytes = dict.fromkeys([*self.workers, self.head], 0)
        pending = []
        for A, a, B, b in blocks:
            cols = self._split(A.shape[1])
            bounds = np.concatenate([[0], np.cumsum(cols)]).astype(int)
            parts, views = [], {"A": [], "a": [], "B": []}
            for i, w in enumerate(self.workers):
                lo, hi = int(bounds[i]), int(bounds[i + 1])
                if hi == lo:
                    parts.append(None)
                    continue
                pieces = (A[:, lo:hi], a[lo:hi], B[lo:hi, :])
                futs = [self._pin(p, w) for p in pieces]
                pending += futs
                parts.append(dict(zip("AaB", futs), worker=w))
                for name, p, f in zip("AaB", pieces, futs):
                    views[name].append(da.from_delayed(f, p.shape, dtype=np.float64))
                self.shard_bytes[w] += sum(int(p.nbytes) for p in pieces)
            bias = self._pin(b, self.head)
            pending.append(bias)
            self.shard_bytes[self.head] += int(b.nbytes)
            self.shards.append(parts)
            self.bias.append(bias)
            self.weights.append({"A": da.concatenate(views["A"], axis=1),
                                 "a": da.concatenate(views["a"]),
                                 "B": da.concatenate(views["B"], axis=0),
                                 "b": da.from_delayed(bias, b.shape, dtype=np.float64)})
        self._weight_futures = pending
        wait_for(self.client, pending, what="placing the weight shards")

    # --- passes ----------------------------------------------------------------------

    def forward(self, X) -> np.ndarray:
        """Run the model on ``X`` and keep each shard's activations for :meth:`backward`.

        Parameters
        ----------
        X : array, shape (n_samples, d_in)
            NumPy array (scattered once to the shard workers).

        Returns
        -------
        numpy.ndarray, shape (n_samples, d_out)
        """
        x = self.client.scatter(np.asarray(X, dtype=np.float64), broadcast=True,
                                workers=self.workers, hash=False)
        self._inputs, self._saved = [], []
        for parts, bias in zip(self.shards, self.bias):
            self._inputs.append(x)
            saved, partial = [], []
            for p in parts:
                if p is None:
                    saved.append(None)
                    continue
                f = self.client.submit(self._fwd, p["A"], p["a"], p["B"], x, self.activation,
                                       workers=[p["worker"]], allow_other_workers=False,
                                       pure=False)
                saved.append(f)
                partial.append(self.client.submit(_second, f, workers=[p["worker"]],
                                                  allow_other_workers=False, pure=False))
            total = _tree_sum(self.client, partial, self.split_every, self.head)
            x = self.client.submit(_add_bias, total, bias, workers=[self.head],
                                   pure=False)
            self._saved.append(saved)
        self._output = x
        try:
            return gather_results(self.client, x, what="the tensor-parallel forward pass")
        except Exception:
            # a shard's worker left: say which layers' shards, not the keys
            lost = lost_roles(
                self.client, f"the tensor-parallel forward pass over {len(X)} rows",
                self._shard_roles(),
                "its weight shards went with it: build the TensorParallelMLP again on the "
                "workers left and run the pass again.")
            if lost is None:
                raise
            raise lost from None

    def _shard_roles(self) -> dict[str, str]:
        """Worker to the weight shards it holds, as errors name them."""
        held: dict[str, list[int]] = {}
        for k, parts in enumerate(self.shards):
            for p in parts:
                if p is not None:
                    held.setdefault(p["worker"], []).append(k)
        return {w: f"the weight shards of layer{'s' if len(ks) > 1 else ''} "
                   f"{', '.join(map(str, ks))}" for w, ks in held.items()}

    def backward(self, grad_output) -> list[dict]:
        """Gradients of every weight from ``d loss / d output`` (after :meth:`forward`).

        Parameters
        ----------
        grad_output : array, shape (n_samples, d_out)

        Returns
        -------
        list of dict of str to dask.array.Array
            Per block ``{"A", "a", "B", "b"}``: gradients with the weights' shapes and
            sharding; the blocks of ``A``, ``a``, ``B`` are computed and held on the shard's
            worker (``.compute()`` gathers them).
        """
        import dask.array as da

        if not getattr(self, "_saved", None):
            raise RuntimeError("blockflow: call forward(X) before backward(grad_output).")
        dy = self.client.scatter(np.asarray(grad_output, dtype=np.float64), broadcast=True,
                                 workers=sorted({*self.workers, self.head}), hash=False)
        grads: list[dict] = [None] * len(self.shards)
        for k in range(len(self.shards) - 1, -1, -1):
            parts, saved = self.shards[k], self._saved[k]
            A, _, B, b = (self.weights[k][n] for n in "AaBb")
            g = {"A": [], "a": [], "B": []}
            dxs = []
            for p, s in zip(parts, saved):
                if p is None:
                    continue
                on = dict(workers=[p["worker"]], allow_other_workers=False, pure=False)
                r = self.client.submit(self._bwd, p["A"], p["B"], s, dy, self.activation, **on)
                for name in g:
                    g[name].append(self.client.submit(_grad_part, r, name, **on))
                dxs.append(self.client.submit(_second, r, **on))
            cols = [c for c in self._split(A.shape[1]) if c]
            db = self.client.submit(_bias_grad, dy, workers=[self.head], pure=False)
            grads[k] = {
                "A": da.concatenate([da.from_delayed(f, (A.shape[0], c), dtype=np.float64)
                                     for f, c in zip(g["A"], cols)], axis=1),
                "a": da.concatenate([da.from_delayed(f, (c,), dtype=np.float64)
                                     for f, c in zip(g["a"], cols)]),
                "B": da.concatenate([da.from_delayed(f, (c, B.shape[1]), dtype=np.float64)
                                     for f, c in zip(g["B"], cols)], axis=0),
                "b": da.from_delayed(db, (b.shape[0],), dtype=np.float64),
            }
            if k:
                dy = _tree_sum(self.client, dxs, self.split_every, self.head)
        return grads

    # --- memory ----------------------------------------------------------------------

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of weight blocks each worker holds now (``client.who_has`` x ``nbytes``):
        replicas included, so a worker holding more than its shard shows here."""
        keys = [f.key for f in self._weight_futures]
        who = _distributed.data_holders(self.client, self._weight_futures)
        nbytes = self.client.nbytes(keys, summary=False)
        out = dict.fromkeys(self.workers, 0)
        for k in keys:
            for w in who.get(k, ()):
                out[w] = out.get(w, 0) + int(nbytes.get(k, 0))
        return out

    def track_weight_bytes(self, interval: float = 0.05) -> "_PeakTracker":
        """Context manager sampling :meth:`weight_bytes` every ``interval`` seconds; its
        ``peak`` is the most bytes each worker held while it ran."""
        return _PeakTracker(self, interval)

    def close(self) -> None:
        """Release the weights and saved activations on the workers."""
        self._saved, self._inputs, self.shards, self.bias = [], [], [], []
        self.weights, self._weight_futures, self._output = [], [], None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class _PeakTracker:
    def __init__(self, model: TensorParallelMLP, interval: float):
        self.model, self.interval = model, interval
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()

    def _sample(self) -> None:
        for w, n in self.model.weight_bytes().items():
            self.peak[w] = max(self.peak.get(w, 0), n)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self):
        self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()
        return False
