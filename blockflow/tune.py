"""Public name ``blockflow.tune``: the tuner lives in :mod:`blockflow.ml.tune`."""

from blockflow.ml.tune import *  # noqa: F401,F403
from blockflow.ml.tune import __all__  # noqa: F401
