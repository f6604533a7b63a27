"""Scheduling: blockflow's scheduler plugin, its policies and the speed model.

:class:`Rebalancer` is the scheduler plugin; :data:`POLICIES` the one registry of policy
names; :class:`DeviceMemoryAMMPolicy` and :class:`DeviceMemoryBalancePolicy` can be named in
distributed's Active Memory Manager configuration. Worker metrics are parsed by :mod:`blockflow._distributed.metrics` (re-exported here).
"""

from blockflow._distributed.metrics import WorkerMetrics, read_metrics
from blockflow.scheduling.plugin import Rebalancer
from blockflow.scheduling.balance import DeviceMemoryBalancePolicy
from blockflow.scheduling.policies import POLICIES, DeviceMemoryAMMPolicy, RebalancePolicy

__all__ = ["POLICIES", "DeviceMemoryAMMPolicy", "DeviceMemoryBalancePolicy", "RebalancePolicy",
           "Rebalancer", "WorkerMetrics", "read_metrics"]
