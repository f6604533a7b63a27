"""Model parallelism and pipeline parallelism for PyTorch models: one model split across workers.

* :class:`TensorParallel` (:mod:`blockflow.parallel.tensor`): Megatron-style tensor
  parallelism of an MLP block or an attention layer, the first ``nn.Linear`` of each pair
  split by columns and the second by rows across workers, shard widths from their free
  device memory; a drop-in ``torch.nn.Module`` whose backward runs on the shards' workers;
* :class:`PipelineParallel` (:mod:`blockflow.parallel.pipeline`): a ``torch.nn.Sequential``
  cut into stages on different workers, micro-batches streamed through them on a GPipe or
  1F1B schedule, the stage partition chosen from measured layer times and free memory.

The planners (shard widths, stage partition) are in :mod:`blockflow.parallel.partition`.
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
    schedule_order,
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
    "schedule_order",
    "shard_widths",
]
