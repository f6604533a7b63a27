"""PyTorch models and data the pipeline-parallel job, the tests and notebook 06 share; its module
classes are importable on workers, so models travel by reference."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["Embed", "MeanPool", "Residual", "conv_net", "digits", "sequence_task",
           "transformer"]


class Residual(torch.nn.Module):
    """``x + body(x)``."""

    def __init__(self, body: torch.nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


class Embed(torch.nn.Module):
    """Token embedding plus a learned position embedding: ``(n, L)`` int64 -> ``(n, L, d)``."""

    def __init__(self, vocab: int, length: int, d_model: int):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, d_model)
        self.positions = torch.nn.Parameter(torch.randn(length, d_model) * 0.02)

    def forward(self, x):
        return self.tokens(x.long()) + self.positions[: x.shape[1]]


class MeanPool(torch.nn.Module):
    """Mean over the sequence axis: ``(n, L, d)`` -> ``(n, d)``."""

    def forward(self, x):
        return x.mean(dim=1)


def conv_net(channels: int = 16, blocks: int = 2, *, seed: int = 0,
             dtype=torch.float32) -> torch.nn.Sequential:
    """A conv net for 8x8 digits (inputs ``(n, 64)`` in 0-1, 10 classes) as a
    ``torch.nn.Sequential`` with residual blocks."""
    torch.manual_seed(seed)
    layers = [torch.nn.Unflatten(1, (1, 8, 8)), torch.nn.Conv2d(1, channels, 3, padding=1),
              torch.nn.GELU()]
    for _ in range(blocks):
        layers.append(Residual(torch.nn.Sequential(
            torch.nn.Conv2d(channels, channels, 3, padding=1),
            torch.nn.LayerNorm([channels, 8, 8]), torch.nn.GELU())))
    layers += [torch.nn.Flatten(), torch.nn.Linear(channels * 64, 10)]
    return torch.nn.Sequential(*layers).to(dtype)


def transformer(vocab: int = 8, length: int = 9, d_model: int = 32, n_heads: int = 4,
                n_layers: int = 4, n_classes: int = 2, *, dropout: float = 0.0,
                seed: int = 0, dtype=torch.float32) -> torch.nn.Sequential:
    """A small transformer classifier: ``Embed -> n_layers x TransformerEncoderLayer -> MeanPool ->
    Linear``, as one ``torch.nn.Sequential`` (one stage boundary between any two of them)."""
    torch.manual_seed(seed)
    layers = [Embed(vocab, length, d_model)]
    layers += [torch.nn.TransformerEncoderLayer(d_model, n_heads, 2 * d_model, dropout=dropout,
                                                activation="gelu", batch_first=True)
               for _ in range(n_layers)]
    layers += [MeanPool(), torch.nn.Linear(d_model, n_classes)]
    return torch.nn.Sequential(*layers).to(dtype)


def sequence_task(n: int, *, vocab: int = 8, length: int = 9, seed: int = 0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)``: ``n`` int64 sequences of odd ``length`` over ``0..vocab-1`` and labels (1 where
    token 2 occurs more often than token 1)."""
    rng = np.random.default_rng(seed)
    X = rng.integers(0, vocab, size=(n, length))
    ones, twos = (X == 1).sum(1), (X == 2).sum(1)
    tie = ones == twos
    X[tie, 0] = np.where(rng.random(tie.sum()) < 0.5, 1, 2)  # break ties: one more of either
    y = ((X == 2).sum(1) > (X == 1).sum(1)).astype(np.int64)
    return X.astype(np.int64), y


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 digits: pixels scaled to 0-1 (float32) and labels (int64)."""
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    return (X / 16.0).astype(np.float32), y.astype(np.int64)
