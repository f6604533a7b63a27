"""Scheduling: blockflow's scheduler plugin, its policies and the speed model.

A policy of one's own subclasses :class:`ComposedPolicy`, runs :class:`Rule` objects over a
:class:`ClusterSnapshot` that yield :class:`Decision` commands and :class:`Record` records, and
is named by dotted path in ``blockflow.cluster.policy``.

Names load on first use, so importing one small module does not load the plugin.
Pools and cost: :mod:`blockflow.pools`. Guide: :doc:`/guide/scheduling`.
"""

import importlib

_LAZY = {
    "Action": "blockflow.scheduling.actions",
    "ClusterSnapshot": "blockflow.scheduling.policies",
    "ComposedPolicy": "blockflow.scheduling.policies",
    "Decision": "blockflow.scheduling.actions",
    "DeviceMemoryAMMPolicy": "blockflow.scheduling.device_memory",
    "Record": "blockflow.scheduling.actions",
    "Recorded": "blockflow.scheduling.actions",
    "Rule": "blockflow.scheduling.rules.base",
    "RuleContext": "blockflow.scheduling.rules.base",
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
