"""Scheduling: blockflow's scheduler plugin, its policies and the speed model.

:class:`Rebalancer` is the scheduler plugin; :data:`POLICIES` the registry of policy names;
:class:`DeviceMemoryAMMPolicy` can be named in distributed's Active Memory Manager
configuration. Pools, objectives and cost are in
:mod:`blockflow.pools`. Worker metrics are parsed by :mod:`blockflow._distributed.metrics`.

Names load on first use (as :mod:`blockflow` does), so importing one small module, say
:mod:`blockflow.scheduling.actions`, does not load the plugin and every rule.
"""

import importlib

_LAZY = {
    "DeviceMemoryAMMPolicy": "blockflow.scheduling.device_memory",
    "POLICIES": "blockflow.scheduling.policies",
    "Rebalancer": "blockflow.scheduling.plugin",
    "RebalancePolicy": "blockflow.scheduling.policies",
    "WorkerMetrics": "blockflow._distributed.metrics",
    "read_metrics": "blockflow._distributed.metrics",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
