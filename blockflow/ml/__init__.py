"""The AI uses of blockflow: data-parallel training and generalised linear models
(:mod:`~blockflow.ml.train`, :mod:`~blockflow.ml.glm`), hyperparameter tuning
(:mod:`~blockflow.ml.tune`), batch inference and request routing (:mod:`~blockflow.ml.inference`,
:mod:`~blockflow.ml.routing`), model and pipeline parallelism (:mod:`blockflow.ml.parallel`).

PyTorch, scikit-learn and SciPy come with the ``ai`` extra (``pip install "blockflow[ai]"``)
and are imported only when used.
"""

from blockflow.ml._rows import as_row_blocks
from blockflow.ml._shards import ResidentShards
from blockflow.ml.glm import LinearRegression, LogisticRegression, PoissonRegression
from blockflow.ml.train import DataParallelTrainer, batch_schedule

__all__ = [
    "DataParallelTrainer",
    "LinearRegression",
    "LogisticRegression",
    "PoissonRegression",
    "ResidentShards",
    "as_row_blocks",
    "batch_schedule",
]
