"""blockflow's scheduler plugin: observes workers and tasks, and runs the rebalancing loop.

The plugin lives on the scheduler. Its :meth:`Rebalancer.transition` hook (called on every
task transition) is O(1): it counts finished tasks per worker. A control loop
(:class:`tornado.ioloop.PeriodicCallback`, period ``blockflow.rebalancer.interval``) calls
:meth:`Rebalancer.run_once`, which snapshots worker metrics and records what it sees.

Clients read the plugin's state through one read-only scheduler handler,
``blockflow_status``; the plugin accepts no commands.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import Any

from dask.utils import key_split, parse_timedelta
from distributed.diagnostics.plugin import SchedulerPlugin
from tornado.ioloop import PeriodicCallback

from blockflow import config
from blockflow.blockwise import KERNEL_PREFIX
from blockflow.scheduling.metrics import read_metrics

__all__ = ["POLICIES", "Rebalancer"]

logger = logging.getLogger(__name__)

POLICIES = ("dynamic", "memory", "static-round-robin", "static-capacity", "off")


class Rebalancer(SchedulerPlugin):
    """Scheduler plugin recording per-worker metrics, task counts and decisions.

    Parameters
    ----------
    policy : str, optional
        One of ``"dynamic"``, ``"memory"``, ``"static-round-robin"``, ``"static-capacity"``,
        ``"off"``; default ``blockflow.cluster.policy``.
    interval : str or float, optional
        Period of the control loop (``"500ms"`` or seconds); default
        ``blockflow.rebalancer.interval``.

    Raises
    ------
    ValueError
        If ``policy`` is not one of the names above.
    """

    name = "blockflow-rebalancer"
    idempotent = True

    def __init__(self, policy: str | None = None, interval: str | float | None = None):
        policy = config.get("cluster.policy", policy)
        if policy not in POLICIES:
            raise ValueError(
                f"Unknown blockflow policy {policy!r}; choose one of {', '.join(POLICIES)}."
            )
        self.policy = policy
        self.interval = parse_timedelta(config.get("rebalancer.interval", interval))
        self.scheduler = None
        self.task_counts: Counter[str] = Counter()
        self.kernel_counts: Counter[str] = Counter()
        self.snapshot: dict[str, dict[str, Any]] = {}
        self.decisions: deque[dict[str, Any]] = deque(
            maxlen=int(config.get("rebalancer.decision-log-size"))
        )
        self.ticks = 0

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers["blockflow_status"] = self.status
        pc = PeriodicCallback(self.run_once, self.interval * 1000)
        scheduler.periodic_callbacks[self.name] = pc
        pc.start()

    # --- hooks: keep them O(1) -----------------------------------------------------------

    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs) -> None:
        if start == "processing" and finish == "memory":
            worker = kwargs.get("worker")
            if worker is None:
                return
            self.task_counts[worker] += 1
            if key_split(key).startswith(KERNEL_PREFIX):
                self.kernel_counts[worker] += 1

    def remove_worker(self, scheduler, worker, *, stimulus_id=None, **kwargs) -> None:
        self.snapshot.pop(worker, None)
        self.log_decision("forget", worker, "worker left the cluster", {})

    # --- control loop -----------------------------------------------------------------

    def run_once(self) -> None:
        """One tick of the control loop: snapshot every worker's metrics."""
        if self.scheduler is None:
            return
        self.ticks += 1
        snap = {}
        for addr, ws in self.scheduler.workers.items():
            m = read_metrics(ws.metrics)
            snap[addr] = {
                **m.to_dict(),
                "nthreads": ws.nthreads,
                "processing": len(ws.processing),
                "status": ws.status.name,
            }
        self.snapshot = snap

    def log_decision(self, action: str, worker: str, reason: str, seen: dict) -> None:
        """Append a decision to the bounded log (time in seconds since the epoch)."""
        self.decisions.append(
            {"time": time.time(), "action": action, "worker": worker, "reason": reason,
             "policy": self.policy, **{f"seen_{k}": v for k, v in seen.items()}}
        )

    # --- read-only handler ------------------------------------------------------------

    def status(self, comm=None) -> dict[str, Any]:
        """Plain-data view of the plugin's state, served as the ``blockflow_status`` handler."""
        return {
            "policy": self.policy,
            "interval": self.interval,
            "ticks": self.ticks,
            "task_counts": dict(self.task_counts),
            "kernel_counts": dict(self.kernel_counts),
            "workers": self.snapshot,
            "decisions": list(self.decisions),
        }
