"""Layers with explicit forward and backward passes, in NumPy float64.

Model and pipeline parallelism (:mod:`blockflow.parallel.tensor`,
:mod:`blockflow.parallel.pipeline`) run parts of a model on different workers and must
compute the backward pass of each part where that part lives. These layers give each part a
forward pass that returns what its backward pass needs (the saved activations) and a
backward pass that returns the parameter gradients and the gradient of the input, so a part
is a plain picklable object with no autograd graph to ship. Their gradients are checked
against PyTorch's autograd in the tests (float64, 1e-6 relative).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["Layer", "Linear", "ReLU", "Tanh", "forward", "backward", "to_torch"]


class Layer:
    """One layer: ``forward(x) -> (y, saved)``, ``backward(saved, dy) -> (grads, dx)``.

    ``params`` is a dict of NumPy arrays (empty for activations); ``grads`` has the same keys
    and shapes. ``cost`` is reference-seconds per row used by simulated benchmarks (0: none).
    """

    params: dict[str, np.ndarray]

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        raise NotImplementedError

    def backward(self, saved: Any, dy: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes of the layer's parameters."""
        return int(sum(p.nbytes for p in self.params.values()))


class Linear(Layer):
    """``y = x @ W + b``; ``W`` of shape ``(in, out)`` (PyTorch's ``weight.T``), ``b`` ``(out,)``.

    Parameters
    ----------
    W : array, shape (in_features, out_features)
    b : array, shape (out_features,), optional
        Zeros when omitted.
    """

    def __init__(self, W, b=None):
        W = np.asarray(W, dtype=np.float64)
        b = np.zeros(W.shape[1]) if b is None else np.asarray(b, dtype=np.float64)
        if W.ndim != 2 or b.shape != (W.shape[1],):
            raise ValueError(f"blockflow: Linear needs W of shape (in, out) and b of shape "
                             f"(out,), got {W.shape} and {b.shape}.")
        self.params = {"W": W, "b": b}

    def __repr__(self) -> str:
        return f"Linear({self.params['W'].shape[0]}, {self.params['W'].shape[1]})"

    def forward(self, x):
        return x @ self.params["W"] + self.params["b"], x

    def backward(self, saved, dy):
        x = saved
        return {"W": x.T @ dy, "b": dy.sum(axis=0)}, dy @ self.params["W"].T


class Tanh(Layer):
    """Element-wise ``tanh``."""

    params: dict[str, np.ndarray] = {}

    def __repr__(self) -> str:
        return "Tanh()"

    def forward(self, x):
        y = np.tanh(x)
        return y, y

    def backward(self, saved, dy):
        return {}, dy * (1.0 - saved * saved)


class ReLU(Layer):
    """Element-wise ``max(x, 0)``."""

    params: dict[str, np.ndarray] = {}

    def __repr__(self) -> str:
        return "ReLU()"

    def forward(self, x):
        mask = x > 0
        return x * mask, mask

    def backward(self, saved, dy):
        return {}, dy * saved


def forward(layers: Sequence[Layer], x: np.ndarray) -> tuple[np.ndarray, list]:
    """Run ``layers`` in order; returns the output and each layer's saved activations."""
    saved = []
    for layer in layers:
        x, s = layer.forward(x)
        saved.append(s)
    return x, saved


def backward(layers: Sequence[Layer], saved: list, dy: np.ndarray
             ) -> tuple[list[dict], np.ndarray]:
    """Backward through ``layers`` (reverse order); returns per-layer gradients and ``dx``."""
    grads: list[dict] = [{} for _ in layers]
    for i in range(len(layers) - 1, -1, -1):
        grads[i], dy = layers[i].backward(saved[i], dy)
    return grads, dy


def to_torch(layers: Sequence[Layer]):
    """The same model as a float64 ``torch.nn.Sequential`` (single-device reference)."""
    import torch

    mods = []
    for layer in layers:
        if isinstance(layer, Linear):
            W, b = layer.params["W"], layer.params["b"]
            lin = torch.nn.Linear(W.shape[0], W.shape[1], dtype=torch.float64)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(W.T.copy()))
                lin.bias.copy_(torch.from_numpy(b))
            mods.append(lin)
        elif isinstance(layer, Tanh):
            mods.append(torch.nn.Tanh())
        elif isinstance(layer, ReLU):
            mods.append(torch.nn.ReLU())
        else:
            raise TypeError(f"blockflow: no PyTorch equivalent for {layer!r}.")
    return torch.nn.Sequential(*mods)
