"""The scheduler plugin's read handlers: ``blockflow_status`` and ``blockflow_pool_targets``."""

from __future__ import annotations

import time
from typing import Any

from dask.utils import parse_timedelta

from blockflow import _distributed, config
from blockflow.pools import plan as cost
from blockflow.pools.pool import Pool, pools_of
from blockflow.pools.scaling import ScalingRequest
from blockflow.scheduling.actions import Record
from blockflow.scheduling.policies import POLICIES, policy_class

__all__ = ["Status"]


class Status:
    """The read handlers of :class:`~blockflow.scheduling.plugin.Rebalancer` (a base of it)."""

    def pool_targets(self, comm=None, *, pools: dict, bounds: dict,
                     starting: dict | None = None, threads: dict | None = None,
                     target_duration: float = 5.0, startup: float | dict = 5.0,
                     wait_count: int = 3, hold: float | None = None,
                     interval: float = 1.0) -> dict[str, Any]:
        """Per-pool worker targets for elastic scaling: the ``blockflow_pool_targets`` handler.

        :class:`blockflow.pools.adaptive.PoolAdaptive` asks it as ``Adaptive`` asks
        ``adaptive_target``. Runs :class:`~blockflow.pools.scaling.PoolScalingRule` on a fresh
        snapshot; arguments are the fields of :class:`~blockflow.pools.scaling.ScalingRequest`
        (``pools`` as :meth:`~blockflow.pools.pool.Pool.to_dict`, ``bounds`` as ``[minimum,
        maximum]``, ``startup`` seconds or pool -> seconds, ``hold`` None for
        ``blockflow.scaling.hold``), and become ``declared_pools``.

        Returns
        -------
        dict
            ``targets`` (pool -> workers), ``reasons`` (pool -> why), ``retiring`` (workers
            retired, not gone yet).
        """
        if self.scheduler is None or self.policy is None:
            return {"targets": {}, "reasons": {}, "retiring": []}
        request = ScalingRequest(
            pools={n: Pool.from_dict(d) for n, d in pools.items()},
            bounds={n: (int(b[0]), int(b[1])) for n, b in bounds.items()},
            starting=dict(starting or {}), threads=dict(threads or {}),
            target_duration=float(target_duration),
            startup=({n: float(v) for n, v in startup.items()} if isinstance(startup, dict)
                     else float(startup)),
            wait_count=int(wait_count),
            hold=parse_timedelta(config.get("scaling.hold", hold)), interval=float(interval))
        self.declared_pools.update(request.pools)
        snap = self.take_snapshot()
        run = self.runs.objective_run() or self.runs.run_of(self.runs.current)
        if run is not None and not snap.throughput:
            snap.throughput = self._throughput(snap.workers)
        reference = {}
        for g in (run.group_pending if run is not None else ()):
            seconds = _distributed.group_duration(self.scheduler, g)
            if seconds is not None:
                reference[g] = seconds
        spent = 0.0
        objective = self.policy.objective
        if run is not None and run.objective is not None and run.objective.budget is not None \
                and objective is not None:
            spent = objective.spent(run, snap)
        for d in self.scaling.run(snap, request, run, reference, spent,
                                  frozenset(self.retiring),
                                  _distributed.workers_holding_data(self.scheduler)):
            if isinstance(d, Record):
                self.record(d, snap)
            else:
                self.apply(d, snap)
        return {"targets": dict(self.scaling.targets), "reasons": dict(self.scaling.reasons),
                "retiring": sorted(self.retiring.values())}

    def _pool_status(self) -> dict[str, Any]:
        """Pools, throughput matrix, the current run's objective and cost, and every recent
        run's objective (``objectives``: run id -> each, its own plan, dispatch, spending
        and misses)."""
        if self.scheduler is None:
            return {"pools": {}, "throughput": {}, "objective": None, "objectives": {},
                    "run_cost": None}
        views = self._views()
        pools = pools_of(views)
        by_pool: dict[str, dict[str, Any]] = {}
        for a, p in sorted(pools.items()):
            by_pool.setdefault(p.name, {**p.to_dict(), "workers": []})["workers"].append(a)
        for name, p in self.declared_pools.items():
            by_pool.setdefault(name, {**p.to_dict(), "workers": []})
        run = self.runs.run_of(self.runs.current)
        run_cost = self._run_cost(run) if run is not None else None
        goals = [r for r in self.runs.runs.values() if r.objective is not None][-20:]
        return {"pools": by_pool,
                "scaling": {"targets": dict(self.scaling.targets),
                            "reasons": dict(self.scaling.reasons),
                            "retiring": dict(self.retiring)},
                "throughput": self._throughput(views),
                "objective": (self._objective_of(run, run_cost) if run is not None
                              and run.objective is not None else None),
                "objectives": {r.id: self._objective_of(r) for r in goals},
                "run_cost": run_cost}

    def _run_cost(self, run) -> dict[str, Any]:
        """:func:`blockflow.pools.plan.run_cost` of ``run`` (to its end, or now)."""
        end = run.ended if run.ended is not None and run.pending <= 0 else time.time()
        return cost.run_cost(self.lifetimes, (run.started, end),
                             first_use={a: s[0] for a, s in run.spans.items()},
                             busy=run.busy, busy_cost=run.busy_cost,
                             shared=run.shared,
                             crossings=[(a, b, n) for (a, b), n in run.crossings.items()])

    def _objective_of(self, run, run_cost: dict | None = None) -> dict[str, Any]:
        """``run``'s objective, plan, dispatch, spending and whether it was missed."""
        rule = self.policy.objective if self.policy is not None else None
        dispatch = rule.dispatch if rule is not None else None
        mine = dispatch.runs.get(run.id) if dispatch is not None else None
        run_cost = run_cost or self._run_cost(run)
        missed = [d["reason"] for d in self.decisions
                  if d["action"] == "objective" and d.get("seen_run") == run.id]
        return {**run.objective.as_dict(), "run": run.id, "name": run.name,
                "client": run.client, "deadline_at": run.deadline_at,
                "open": run.pending > 0,
                "plan": rule.plans.get(run.id) if rule is not None else None,
                "dispatch": mine.as_dict() if mine is not None else None,
                "spent": run_cost["compute_cost"] + run_cost["idle_cost"],
                "missed": missed[0] if missed else None}

    def _device_time(self) -> dict[str, Any]:
        """GPU workers' device seconds against wall time: ``run`` (the current run's id),
        ``workers`` (worker -> its figures in that run, so far while it goes on) and
        ``cumulative`` (worker -> since its first heartbeat);
        :mod:`blockflow.scheduling.device_time`."""
        run = self.runs.run_of(self.runs.current)
        return {"run": run.id if run is not None else None,
                "workers": self.device_time.run_figures(run) if run is not None else {},
                "cumulative": self.device_time.cumulative()}

    @property
    def snapshot_workers(self) -> dict[str, dict[str, Any]]:
        """Per worker, the metrics and state the last tick saw."""
        snap = self._last_snap
        if snap is None:
            return {}
        return {
            a: {**w.metrics.to_dict(), "nthreads": w.nthreads, "status": w.status,
                "paused_by_blockflow": a in self.paused, "speed": w.speed,
                "processing": w.processing, "projected_finish": w.projected_finish}
            for a, w in snap.workers.items()
        }

    def status(self, comm=None, since: float | None = None,
               task_log: bool = False, run: str | None = None,
               for_client: str | None = None) -> dict[str, Any]:
        """The plugin's state as plain data: the ``blockflow_status`` handler.

        Parameters
        ----------
        since : float, optional
            Only decisions and task-log entries after this time, seconds since the epoch.
        task_log : bool, default False
            Include ``(worker, start, stop)`` of finished tasks.
        run : str, optional
            A run id to include as ``requested_run`` (None if unknown).
        for_client : str, optional
            A client id: its latest run as ``client_run`` (with ``run_cost`` and
            ``objective``; None if it ran none).
        """
        decisions = list(self.decisions)
        if since is not None:
            decisions = [d for d in decisions if d["time"] > since]
        extra = {}
        if task_log:
            extra["task_log"] = [t for t in self.task_log if since is None or t[2] > since]
        if run is not None:
            extra["requested_run"] = self.runs.get(run)
        if for_client is not None:
            mine = self.runs.run_of(self.runs.latest_of(for_client))
            extra["client_run"] = None if mine is None else {
                **self.runs.get(mine.id), "run_cost": self._run_cost(mine),
                "objective_status": (self._objective_of(mine) if mine.objective is not None
                                     else None)}
        current = self.runs.current_run()
        addresses = _distributed.worker_addresses(self.scheduler) if self.scheduler else ()
        return {
            "policy": self.policy_name,
            "interval": self.interval,
            "ticks": self.ticks,
            "moves_requested": self.moves_requested,
            "cost": self.cost.as_dict(sum(self.task_counts.values())),
            "task_counts": dict(self.task_counts),
            "kernel_counts": dict(self.kernel_counts),
            "run": current,
            "run_counts": current["counts"] if current else {},
            "run_started": current["started"] if current else None,
            "speeds": {a: self.speeds.speed(a) for a in addresses},
            "speed_confidence": {a: self.speeds.confidence(a) for a in addresses},
            "balancing": self._stealing is not None,
            "policies": list(POLICIES),
            "policy_description": _summary(policy_class(self.policy_name)),
            "paused": dict(self.paused),
            "held": dict(self.held),
            "workers": self.snapshot_workers,
            "memory_peak": dict(self.memory_peak),
            "device_time": self._device_time(),
            "decisions": decisions,
            **self._pool_status(),
            "speculation": {**dict(self.speculation),
                            "running": {str(k): dict(v) for k, v in self.backups.items()}},
            "resources": {
                "unsatisfiable": self.unsatisfiable.status() if self.unsatisfiable else None,
                "admission": self.admission.status() if self.admission else None,
                "shared_gpus": {u: list(a) for u, a in _distributed.shared_devices(
                    self._views()).items()} if self.scheduler else {},
            },
            **extra,
        }


def _summary(cls) -> str:
    """First line of a policy's docstring (shown on the dashboard)."""
    return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else cls.name
