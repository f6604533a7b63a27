"""Model parallelism and pipeline parallelism for PyTorch models: one model split across workers.

:class:`TensorParallel` (Megatron-style, :mod:`blockflow.parallel.tensor`),
:class:`PipelineParallel` (GPipe or 1F1B, :mod:`blockflow.parallel.pipeline`) and the
planners in :mod:`blockflow.parallel.partition`. Guide: docs/guide/ai.md.
"""

from blockflow.ml.parallel.partition import (
    equal_stages,
    flush_makespan,
    parameter_stages,
    partition_stages,
    shard_widths,
)
from blockflow.ml.parallel.pipeline import (
    PipelineParallel,
    PipelineResult,
    bubble_fraction,
)
from blockflow.ml.parallel.tensor import TensorParallel, free_device_memory

__all__ = [
    "PipelineParallel",
    "PipelineResult",
    "TensorParallel",
    "bubble_fraction",
    "equal_stages",
    "flush_makespan",
    "free_device_memory",
    "parameter_stages",
    "partition_stages",
    "shard_widths",
]
