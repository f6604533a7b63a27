"""Model parallelism and pipeline parallelism: one model split across workers.

* :class:`TensorParallelMLP` (:mod:`blockflow.parallel.tensor`): Megatron-style tensor
  parallelism, weights split column-then-row across workers in proportion to their free
  device memory;
* :class:`PipelineParallel` (:mod:`blockflow.parallel.pipeline`): layers grouped into stages
  on different workers, micro-batches streamed through them on a GPipe schedule, the stage
  partition chosen from measured layer times on each worker.

Layers with explicit forward/backward passes are in :mod:`blockflow.parallel.layers`; the
planners (shard widths, stage partition) in :mod:`blockflow.parallel.partition`.
"""

from blockflow.ml.parallel.layers import Linear, ReLU, Tanh
from blockflow.ml.parallel.partition import equal_stages, partition_stages, shard_widths
from blockflow.ml.parallel.pipeline import PipelineParallel, PipelineResult, bubble_fraction
from blockflow.ml.parallel.tensor import TensorParallelMLP, free_device_memory, random_blocks

__all__ = [
    "Linear",
    "PipelineParallel",
    "PipelineResult",
    "ReLU",
    "Tanh",
    "TensorParallelMLP",
    "bubble_fraction",
    "equal_stages",
    "free_device_memory",
    "partition_stages",
    "random_blocks",
    "shard_widths",
]
