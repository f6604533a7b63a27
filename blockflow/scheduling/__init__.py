"""Scheduling: blockflow's scheduler plugin, its policies and worker metrics."""

from blockflow.metrics import WorkerMetrics, read_metrics
from blockflow.scheduling.plugin import POLICIES, Rebalancer

__all__ = ["POLICIES", "Rebalancer", "WorkerMetrics", "read_metrics"]
