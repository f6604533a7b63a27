"""Public name ``blockflow.parallel``: model and pipeline parallelism live in
:mod:`blockflow.ml.parallel`."""

from blockflow.ml.parallel import *  # noqa: F401,F403
from blockflow.ml.parallel import __all__  # noqa: F401
