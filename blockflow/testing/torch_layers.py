"""PyTorch layers that keep a simulated device busy, for pipeline tests and benchmarks."""

from __future__ import annotations

import torch

from blockflow.testing.simulated import simulated_kernel

__all__ = ["SimulatedLinear"]


class _Busy:
    def __init__(self, work: float):
        self.work = work

    def __call__(self, grad):
        simulated_kernel(op=lambda: None, work=self.work)
        return grad


class SimulatedLinear(torch.nn.Linear):
    """``nn.Linear`` taking ``work`` reference-seconds forward (default 0.02) and twice that
    backward on the worker's simulated device; ``**kwargs`` go to ``torch.nn.Linear``."""

    def __init__(self, in_features: int, out_features: int, work: float = 0.02, **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        self.work = float(work)

    def forward(self, x):
        simulated_kernel(op=lambda: None, work=self.work)
        y = super().forward(x)
        if y.requires_grad:
            y.register_hook(_Busy(2 * self.work))
        return y
