"""blockflow: spread chunked data and AI workloads over many CPUs and GPUs with Dask.

Importing blockflow has one side effect: it loads blockflow's configuration defaults into
``dask.config`` (namespace ``blockflow.``).
"""

from blockflow import config as _config  # noqa: F401  (loads the defaults)
from blockflow.backends import (
    GPUUnavailableError,
    array_module,
    dataframe_module,
    to_device,
    to_host,
)
from blockflow.blockwise import map_blocks
from blockflow.cluster.connection import connect
from blockflow.decompose import BlockResize, fit_blocks, split_skewed
from blockflow.errors import (
    BlockflowWarning,
    BlockKernelError,
    ConvergenceWarning,
    DeviceMemoryError,
    EmptyCollectionError,
    ResourceError,
    WorkerLostError,
)
from blockflow.ml.inference import predict
from blockflow.cluster.inventory import Inventory, inventory
from blockflow.ml.parallel import PipelineParallel, TensorParallelMLP
from blockflow.cluster.rebalance import rebalance
from blockflow.reduction import choose_split_every, tree_reduce
from blockflow.cluster.report import RunReport, run_report
from blockflow.ml.routing import Router
from blockflow.scheduling.client import decisions, plugin_status, task_counts
from blockflow import scheduling  # noqa: F401  (blockflow.scheduling: the plugin and its policies)

__version__ = "0.1.0"

__all__ = [
    "BlockKernelError",
    "BlockResize",
    "BlockflowWarning",
    "ConvergenceWarning",
    "DeviceMemoryError",
    "EmptyCollectionError",
    "GPUUnavailableError",
    "Inventory",
    "PipelineParallel",
    "ResourceError",
    "Router",
    "RunReport",
    "TensorParallelMLP",
    "WorkerLostError",
    "array_module",
    "choose_split_every",
    "connect",
    "dataframe_module",
    "decisions",
    "fit_blocks",
    "inventory",
    "map_blocks",
    "plugin_status",
    "predict",
    "rebalance",
    "run_report",
    "split_skewed",
    "task_counts",
    "to_device",
    "to_host",
    "tree_reduce",
]
