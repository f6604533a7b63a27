"""PyTorch layers that keep a simulated device busy, for pipeline tests and benchmarks.

:class:`SimulatedLinear` is an ``nn.Linear`` whose forward pass also takes ``work``
reference-seconds on the worker's simulated device (``work / speed`` seconds, see
:func:`blockflow.testing.simulated_kernel`) and whose backward pass takes twice that (a
gradient hook on its output), so stage times follow the simulated speeds rather than this
machine's load. Its gradients are ``nn.Linear``'s, by PyTorch's autograd.
"""

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
    """``nn.Linear`` taking ``work`` reference-seconds forward and ``2 x work`` backward on
    the simulated device of the worker it runs on.

    Parameters
    ----------
    in_features, out_features : int
    work : float, default 0.02
        Reference-seconds of the forward pass.
    **kwargs
        Passed to ``torch.nn.Linear`` (``bias``, ``dtype``).
    """

    def __init__(self, in_features: int, out_features: int, work: float = 0.02, **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        self.work = float(work)

    def forward(self, x):
        simulated_kernel(op=lambda: None, work=self.work)
        y = super().forward(x)
        if y.requires_grad:
            y.register_hook(_Busy(2 * self.work))
        return y
