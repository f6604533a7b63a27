"""blockflow: spread chunked data and AI workloads over many CPUs and GPUs with Dask.

Importing blockflow has one side effect: it loads blockflow's configuration defaults into
``dask.config`` (namespace ``blockflow.``).
"""

from blockflow import config as _config  # noqa: F401  (loads the defaults)

#: Public name -> the module that defines it, imported on first use (SPEC 1 lazy loading:
#: ``import blockflow`` and ``blockflow --help`` stay quick, and a Ctrl-C pressed while a
#: command starts reaches the command's own handler instead of an import's traceback).
_LAZY = {
    "BlockKernelError": "blockflow.errors",
    "BlockResize": "blockflow.decompose",
    "BlockSizeWarning": "blockflow.errors",
    "DeviceBlockTarget": "blockflow.device_blocks",
    "BlockflowWarning": "blockflow.errors",
    "ClusterStartError": "blockflow.errors",
    "ConvergenceWarning": "blockflow.errors",
    "DeviceMemoryError": "blockflow.errors",
    "EmptyCollectionError": "blockflow.errors",
    "NonFiniteError": "blockflow.errors",
    "ObjectiveError": "blockflow.errors",
    "GPUUnavailableError": "blockflow.backends",
    "Inventory": "blockflow.cluster.inventory",
    "PipelineParallel": "blockflow.ml.parallel",
    "Pool": "blockflow.pools.pool",
    "PoolCluster": "blockflow.pools.cluster",
    "ResourceError": "blockflow.errors",
    "Router": "blockflow.ml.routing",
    "RunReport": "blockflow.cluster.report",
    "TensorParallel": "blockflow.ml.parallel",
    "WorkerLostError": "blockflow.errors",
    "array_module": "blockflow.backends",
    "choose_split_every": "blockflow.reduction",
    "connect": "blockflow.cluster.connection",
    "dataframe_module": "blockflow.backends",
    "decisions": "blockflow.scheduling.view",
    "device_block_target": "blockflow.device_blocks",
    "fit_blocks": "blockflow.block_sizing",
    "inventory": "blockflow.cluster.inventory",
    "map_blocks": "blockflow.blockwise",
    "objective": "blockflow.pools.objective",
    "plugin_status": "blockflow.scheduling.view",
    "predict": "blockflow.ml.inference",
    "rebalance": "blockflow.cluster.rebalance",
    "run_report": "blockflow.cluster.report",
    "split_skewed": "blockflow.decompose",
    "task_counts": "blockflow.scheduling.view",
    "throughput": "blockflow.scheduling.view",
    "to_device": "blockflow.device_blocks",
    "to_host": "blockflow.backends",
    "tree_reduce": "blockflow.reduction",
}

__version__ = "0.1.0"

__all__ = [
    "BlockKernelError",
    "BlockResize",
    "BlockSizeWarning",
    "BlockflowWarning",
    "ClusterStartError",
    "ConvergenceWarning",
    "DeviceBlockTarget",
    "DeviceMemoryError",
    "EmptyCollectionError",
    "GPUUnavailableError",
    "Inventory",
    "NonFiniteError",
    "ObjectiveError",
    "PipelineParallel",
    "Pool",
    "PoolCluster",
    "ResourceError",
    "Router",
    "RunReport",
    "TensorParallel",
    "WorkerLostError",
    "array_module",
    "choose_split_every",
    "connect",
    "dataframe_module",
    "decisions",
    "device_block_target",
    "fit_blocks",
    "inventory",
    "map_blocks",
    "objective",
    "plugin_status",
    "predict",
    "rebalance",
    "run_report",
    "split_skewed",
    "task_counts",
    "throughput",
    "to_device",
    "to_host",
    "tree_reduce",
]


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        try:  # a subpackage or module: blockflow.ml, blockflow.scheduling, ...
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
