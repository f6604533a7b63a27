"""Search spaces: the distributions a configuration's parameters are drawn from (named as in
``scipy.stats`` and Optuna)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["choice", "loguniform", "randint", "sample_configs", "uniform"]


@dataclass(frozen=True)
class uniform:  # noqa: N801
    """A float drawn uniformly from ``[low, high)``."""

    low: float
    high: float

    def sample(self, rng: np.random.Generator) -> float:
        return float(rng.uniform(self.low, self.high))


@dataclass(frozen=True)
class loguniform:  # noqa: N801
    """A positive float whose logarithm is uniform on ``[log(low), log(high))`` (ValueError
    unless ``0 < low < high``)."""

    low: float
    high: float

    def __post_init__(self):
        if not 0 < self.low < self.high:
            raise ValueError(f"blockflow: loguniform needs 0 < low < high, got "
                             f"({self.low}, {self.high}).")

    def sample(self, rng: np.random.Generator) -> float:
        return float(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))


@dataclass(frozen=True)
class randint:  # noqa: N801
    """An integer drawn uniformly from ``[low, high)``."""

    low: int
    high: int

    def sample(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.low, self.high))


@dataclass(frozen=True)
class choice:  # noqa: N801
    """One of ``values``, each equally likely (a plain list in a space means the same)."""

    values: tuple

    def __init__(self, values: Sequence):
        if len(values) == 0:
            raise ValueError("blockflow: choice needs at least one value.")
        object.__setattr__(self, "values", tuple(values))

    def sample(self, rng: np.random.Generator) -> Any:
        v = self.values[int(rng.integers(len(self.values)))]
        return v.item() if isinstance(v, np.generic) else v


def sample_configs(space: Mapping[str, Any], n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` configurations drawn from ``space``, the same ones for the same seed.

    Parameters
    ----------
    space : mapping
        Parameter name to a distribution (anything with ``sample(rng)``), a list or tuple
        (a choice), or a fixed value.
    n : int
        Number of configurations.
    seed : int, default 0
        Seed of the NumPy generator; parameters are drawn in the order of ``space``.
    """
    rng = np.random.default_rng(seed)

    def draw(spec):
        if hasattr(spec, "sample"):
            return spec.sample(rng)
        if isinstance(spec, (list, tuple)):
            return choice(spec).sample(rng)
        return spec

    return [{name: draw(spec) for name, spec in space.items()} for _ in range(n)]
