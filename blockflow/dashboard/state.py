"""The data behind the dashboard page and the JSON routes (:func:`dashboard_state`), read-only."""

from __future__ import annotations

import math
import time
from typing import Any

from blockflow import _distributed
from blockflow.scheduling.actions import Action
from blockflow.pools.pool import DEFAULT_POOL

__all__ = ["dashboard_state"]

REBALANCER = "blockflow-rebalancer"


def _finite(v):
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def dashboard_state(scheduler, *, since: float | None = None,
                    max_decisions: int = 500) -> dict[str, Any]:
    """JSON-serialisable snapshot of workers and rebalancer decisions.

    Parameters
    ----------
    scheduler : distributed.Scheduler
    since : float, optional
        Only decisions after this time (epoch seconds).
    max_decisions : int, default 500

    Returns
    -------
    dict
        ``time``, ``policy``, ``workers`` (per worker: device, GPU utilisation (percent) and
        memory (bytes; None without GPU metrics), ``device_seconds`` (cumulative busy seconds),
        ``device_busy`` / ``device_busy_total`` (device over wall seconds, 0-1, in this run /
        since the worker's first heartbeat; None without device seconds), threads, task
        counts, learned ``speed``,
        status, ``tasks_run`` this run, GPU sharing, resources), ``shared_gpus``, ``run`` (the
        run most recently given tasks, :mod:`blockflow.scheduling.runs`), ``run_started``,
        ``policy_description``, ``policies``, ``n_decisions``, ``decisions`` (oldest first),
        ``speculation`` (backup copies) and ``tuning`` (the latest :func:`blockflow.tune.tune`).
    """
    plugin = _distributed.scheduler_plugin(scheduler, REBALANCER)
    status = plugin.status() if plugin is not None and plugin.scheduler is not None else {}
    paused = status.get("paused", {})
    run_counts = status.get("run_counts", {})
    totals = status.get("task_counts", {})
    speeds = status.get("speeds", {})
    device_time = status.get("device_time") or {}
    device_run = device_time.get("workers") or {}
    device_all = device_time.get("cumulative") or {}
    workers = []
    views = _distributed.worker_views(scheduler)
    for addr, w in sorted(views.items()):
        m = w.metrics
        workers.append({
            "address": addr,
            "name": w.name,
            "device": "gpu" if m.has_gpu else "cpu",
            "gpu_utilization": _finite(m.gpu_utilization),
            "gpu_memory_used": _finite(m.gpu_memory_used),
            "gpu_memory_total": _finite(m.gpu_memory_total),
            # device seconds over wall seconds: this run, and since the first heartbeat
            "device_seconds": _finite(m.device_seconds),
            "device_busy": _finite((device_run.get(addr) or {}).get("device_busy")),
            "device_busy_total": _finite((device_all.get(addr) or {}).get("device_busy")),
            "nthreads": w.nthreads,
            "processing": w.processing,
            "executing": w.executing,
            "queued": max(w.processing - w.executing, 0),
            "speed": _finite(speeds.get(addr, 1.0)) if plugin else None,
            "status": w.status,
            "paused_by_blockflow": addr in paused,
            "paused_reason": paused.get(addr),
            "tasks_run": int(run_counts.get(addr, 0)),
            "tasks_total": int(totals.get(addr, 0)),
            "gpu_uuid": m.device_uuid,
            "shares_gpu_with": list(w.device_peers),
            "resources": dict(w.resources),
            "pool": (w.pool or {}).get("name", DEFAULT_POOL.name),
            "provider": (w.pool or {}).get("provider", DEFAULT_POOL.provider),
            "price": _finite((w.pool or {}).get("price")),
        })
    decisions = status.get("decisions", [])
    if since is not None:
        decisions = [d for d in decisions if d["time"] > since]
    decisions = [{k: (_finite(v) if isinstance(v, float) else v) for k, v in d.items()}
                 for d in (decisions[-max_decisions:] if max_decisions > 0 else [])]
    return {
        "time": time.time(),
        "policy": status.get("policy") if plugin else None,
        "policy_description": status.get("policy_description"),
        "policies": status.get("policies", []),
        "run": ({k: run[k] for k in ("id", "name", "started", "tasks", "finished")}
                if (run := status.get("run")) else None),
        "run_started": status.get("run_started"),
        "n_decisions": len(status.get("decisions", ())),
        "workers": workers,
        "shared_gpus": [{"uuid": u, "workers": list(a)}
                        for u, a in _distributed.shared_devices(views).items()],
        "decisions": decisions,
        "device_time": {"run": device_time.get("run"), "workers": device_run,
                        "cumulative": device_all},
        # the vocabulary the decisions use (blockflow.scheduling.actions.Action)
        "actions": [a.value for a in Action],
        "speculation": _speculation_summary(status.get("speculation")),
        "pools": _pools(status, workers),
        "objective": _objective(status),
        "scaling": status.get("scaling"),
        "tuning": _tuning(scheduler),
        "pipeline": _pipeline(scheduler),
    }


def _pools(status: dict, workers: list[dict]) -> list[dict[str, Any]]:
    """One entry per pool: its prices, its workers (names), what it cost so far in the
    current run, and the LP bound of what the work left will cost on it."""
    declared = status.get("pools") or {}
    names = sorted({w["pool"] for w in workers} | set(declared))
    spent = ((status.get("run_cost") or {}).get("pools") or {})
    objective = status.get("objective") or {}
    plan = (objective.get("plan") or {}).get("plan") or {}
    targets = (status.get("scaling") or {}).get("targets") or {}
    out = []
    for name in names:
        info = declared.get(name) or {}
        members = [w for w in workers if w["pool"] == name]
        first = members[0] if members else {}
        price = _finite(info.get("price", first.get("price")))
        busy = (plan.get("busy") or {}).get(name)
        out.append({
            "name": name,
            "provider": info.get("provider", first.get("provider", "local")),
            "region": info.get("region", ""),
            "price": price,
            "egress": _finite(info.get("egress")),
            "speed": _finite(info.get("speed")),
            "workers": [str(w["name"]) for w in members],
            "addresses": [w["address"] for w in members],
            "cost_so_far": _finite((spent.get(name) or {}).get("cost")),
            "bound_left": (None if busy is None or price is None
                           else _finite(busy * price / 3600.0)),
            "target": targets.get(name),
        })
    return out


def _objective(status: dict) -> dict[str, Any] | None:
    """The current run's objective, the cost so far and the projected finish (the plan's
    makespan from when it was solved); None without an objective."""
    obj = status.get("objective")
    if not obj:
        return None
    entry = obj.get("plan") or {}
    plan = entry.get("plan") or {}
    run_cost = status.get("run_cost") or {}
    projected = (entry["time"] + plan["makespan"]
                 if plan.get("feasible") and "time" in entry else None)
    spent = _finite(run_cost.get("total_cost"))
    return {"kind": obj.get("kind"), "deadline": obj.get("deadline"),
            "budget": obj.get("budget"), "deadline_at": obj.get("deadline_at"),
            "run": obj.get("run"), "cost_so_far": spent,
            "bound_left": _finite(plan.get("cost")),
            "projected_finish": _finite(projected),
            "feasible": plan.get("feasible")}


def _pipeline(scheduler) -> dict[str, Any] | None:
    """The latest :class:`blockflow.PipelineParallel` timeline, or None."""
    meta = _distributed.scheduler_metadata(scheduler, ("blockflow", "pipeline"))
    return meta if isinstance(meta, dict) else None


def _tuning(scheduler) -> dict[str, Any] | None:
    """What a running :func:`blockflow.tune.tune` published, or None."""
    meta = _distributed.scheduler_metadata(scheduler, ("blockflow", "tune"))
    return meta if isinstance(meta, dict) else None


def _speculation_summary(spec) -> dict[str, Any] | None:
    """The backup-copy counters of the rebalancer's status, JSON-ready."""
    if not spec:
        return None
    return {"launched": int(spec.get("launched", 0)), "won": int(spec.get("backup-won", 0)),
            "lost": int(spec.get("original-won", 0) + spec.get("finished-first", 0)),
            "failed": int(spec.get("failed", 0) + spec.get("declined", 0)),
            "running": len(spec.get("running") or {}),
            "duplicated_seconds": float(spec.get("duplicated_seconds", 0.0))}
