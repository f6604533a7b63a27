"""Scheduling: blockflow's scheduler plugin, its policies and the speed model.

:class:`Rebalancer` is the scheduler plugin; :data:`POLICIES` the one registry of policy
names; :class:`DeviceMemoryAMMPolicy` and :class:`DeviceMemoryBalancePolicy` can be named in
distributed's Active Memory Manager configuration. Pools, objectives and cost:
:class:`PoolMember`, :class:`Objective`, :func:`throughput_matrix`, :func:`plan` (the LP),
:func:`run_cost`. Worker metrics are parsed by :mod:`blockflow._distributed.metrics` (re-exported here).
"""

from blockflow._distributed.metrics import WorkerMetrics, read_metrics
from blockflow.scheduling.plugin import Rebalancer
from blockflow.scheduling.balance import DeviceMemoryBalancePolicy
from blockflow.scheduling.policies import POLICIES, DeviceMemoryAMMPolicy, RebalancePolicy
from blockflow.scheduling.cost import Plan, plan, run_cost, throughput_matrix
from blockflow.scheduling.objective import Objective
from blockflow.scheduling.pools import PoolMember

__all__ = ["POLICIES", "DeviceMemoryAMMPolicy", "DeviceMemoryBalancePolicy", "Objective",
           "Plan", "PoolMember", "RebalancePolicy", "Rebalancer", "WorkerMetrics", "plan",
           "read_metrics", "run_cost", "throughput_matrix"]
