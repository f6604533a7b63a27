"""The data behind the dashboard page and the JSON routes, read from the scheduler.

One function, :func:`dashboard_state`, builds a plain-data snapshot: one row per worker and
the rebalancer's recent decisions. Read-only: nothing here changes the scheduler.
"""

from __future__ import annotations

import math
import time
from typing import Any

from blockflow.metrics import read_metrics

__all__ = ["dashboard_state"]

REBALANCER = "blockflow-rebalancer"


def _finite(v):
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def dashboard_state(scheduler, *, since: float | None = None,
                    max_decisions: int = 500) -> dict[str, Any]:
    """Plain-data snapshot of workers and rebalancer decisions (JSON-serialisable).

    Parameters
    ----------
    scheduler : distributed.Scheduler
    since : float, optional
        Only decisions after this time (seconds since the epoch).
    max_decisions : int, default 500
        Most recent decisions returned.

    Returns
    -------
    dict
        ``time`` (s since the epoch), ``policy`` (None without the rebalancer), ``workers``
        (list of dicts: ``address``, ``name``, ``device`` "gpu"/"cpu", ``gpu_utilization``
        percent, ``gpu_memory_used`` / ``gpu_memory_total`` bytes - None when the worker
        reports no GPU metrics, never 0 - ``nthreads``, ``processing``, ``executing``,
        ``queued`` (processing minus executing), ``speed`` (learned, 1.0 typical),
        ``status``, ``paused_by_blockflow``, ``paused_reason``, ``tasks_run`` (current
        computation), ``tasks_total``), ``run_started`` and ``decisions`` (oldest first).
    """
    plugin = scheduler.plugins.get(REBALANCER)
    paused = getattr(plugin, "paused", {}) if plugin else {}
    run_counts = getattr(plugin, "run_counts", {}) if plugin else {}
    totals = getattr(plugin, "task_counts", {}) if plugin else {}
    workers = []
    for addr, ws in sorted(scheduler.workers.items()):
        m = read_metrics(ws.metrics)
        executing = len(ws.executing)
        workers.append({
            "address": addr,
            "name": str(ws.name),
            "device": "gpu" if m.has_gpu else "cpu",
            "gpu_utilization": _finite(m.gpu_utilization),
            "gpu_memory_used": _finite(m.gpu_memory_used),
            "gpu_memory_total": _finite(m.gpu_memory_total),
            "nthreads": ws.nthreads,
            "processing": len(ws.processing),
            "executing": executing,
            "queued": max(len(ws.processing) - executing, 0),
            "speed": _finite(plugin.speeds.speed(addr)) if plugin else None,
            "status": ws.status.name,
            "paused_by_blockflow": addr in paused,
            "paused_reason": paused.get(addr),
            "tasks_run": int(run_counts.get(addr, 0)),
            "tasks_total": int(totals.get(addr, 0)),
        })
    decisions = list(plugin.decisions) if plugin else []
    if since is not None:
        decisions = [d for d in decisions if d["time"] > since]
    decisions = [{k: (_finite(v) if isinstance(v, float) else v) for k, v in d.items()}
                 for d in (decisions[-max_decisions:] if max_decisions > 0 else [])]
    return {
        "time": time.time(),
        "policy": plugin.policy_name if plugin else None,
        "run_started": getattr(plugin, "run_started", None) if plugin else None,
        "workers": workers,
        "decisions": decisions,
    }
