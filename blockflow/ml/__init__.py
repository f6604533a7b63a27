"""The AI uses of blockflow: training, GLMs, tuning, inference, routing and model parallelism.

Needs the ``ai`` extra (``pip install "blockflow[ai]"``); imported only when used. Guide:
docs/guide/ai.md.
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
