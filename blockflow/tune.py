"""Public name ``blockflow.tune``: the tuner lives in :mod:`blockflow.ml.tune`."""

from blockflow.ml.tune import (  # noqa: F401
    TuneResult,
    choice,
    loguniform,
    randint,
    sample_configs,
    tune,
    uniform,
)

__all__ = ["TuneResult", "choice", "loguniform", "randint", "sample_configs", "tune", "uniform"]
