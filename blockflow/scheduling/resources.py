"""Worker resources on the scheduler: kernels' placement, and tasks no worker can run.

Two jobs of blockflow's scheduler plugin, kept apart from its balancing loop:

- :func:`apply_placements` restricts the tasks of a graph that just arrived as their kernels
  asked (``map_blocks(resources=, workers=, allow_other_workers=)``, same for
  :func:`~blockflow.tree_reduce`). The request travels inside each task (on the kernel
  object), so Dask's graph optimisation, which drops ``dask.annotate(...)`` layer
  annotations when it fuses tasks, cannot lose it.
- :class:`UnsatisfiableWatch` notices tasks that wait for resources no worker declares
  (``resources={"GPU": 1}`` on a CPU-only cluster; distributed lets them wait silently,
  forever), logs a WARNING when they start waiting, and fails them with
  :class:`~blockflow.errors.ResourceError` after ``blockflow.resources.unsatisfiable-timeout``
  unless such a worker joins meanwhile.

Both act only through :mod:`blockflow._distributed`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from dask.utils import parse_timedelta

from blockflow import _distributed, config
from blockflow.errors import ResourceError

__all__ = ["UnsatisfiableWatch", "apply_placements", "describe_worker_resources"]

logger = logging.getLogger(__name__)


def apply_placements(scheduler, views: list) -> tuple[list, int]:
    """Restrict the new tasks whose kernels declared a placement.

    Parameters
    ----------
    scheduler : distributed.Scheduler
    views : list of TaskView
        The new tasks (:func:`blockflow._distributed.new_task_views`).

    Returns
    -------
    (list of TaskView, int)
        The views with ``restricted`` set on the tasks restricted here (so that policies
        leave them alone), and how many were restricted.
    """
    out, n = [], 0
    for v in views:
        if v.placement and _distributed.set_task_placement(scheduler, v.key, v.placement):
            n += 1
            if not v.restricted:
                v = _replace(v, restricted=True)
        out.append(v)
    return out, n


def _replace(view, **changes):
    from dataclasses import replace

    return replace(view, **changes)


def describe_worker_resources(workers: Mapping[str, Any], limit: int = 4) -> str:
    """What the workers declare, for messages: ``"none (4 workers)"``,
    ``"{'FPGA': 1} (tcp://10.0.0.5:40000), none (3 workers)"``; ``"no worker"`` for none."""
    if not workers:
        return "no worker is connected"
    groups: dict[str, list[str]] = {}
    for addr, w in sorted(workers.items()):
        res = dict(getattr(w, "resources", w) or {})
        groups.setdefault(repr(res) if res else "none", []).append(addr)
    parts = []
    for what, addrs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        who = (", ".join(addrs[:limit]) + (f" and {len(addrs) - limit} more"
                                           if len(addrs) > limit else "")
               if what != "none" or len(addrs) == 1 else f"{len(addrs)} workers")
        parts.append(f"{what} ({who})")
    return "; ".join(parts)


class UnsatisfiableWatch:
    """Warn about, then fail, tasks waiting for worker resources no worker declares.

    Called on every tick of the scheduler plugin (:meth:`check`). A task counts from the
    first tick that finds it waiting (distributed's ``no-worker`` state) with resources no
    connected worker declares; a WARNING is logged then, once per kind of resources. After
    ``timeout`` seconds it fails with :class:`~blockflow.errors.ResourceError`, naming the
    resources and what the workers declare; a worker that declares them joining in time lets
    it run. A cluster with no worker at all is left to distributed and blockflow's
    ``worker-loss-timeout``.

    Parameters
    ----------
    timeout : str or float, optional
        Default ``blockflow.resources.unsatisfiable-timeout``.
    """

    def __init__(self, timeout: str | float | None = None):
        self.timeout = parse_timedelta(config.get("resources.unsatisfiable-timeout", timeout))
        self.since: dict[Any, float] = {}  # key -> monotonic time first seen waiting
        self.failed = 0

    def check(self, scheduler, workers: Mapping[str, Any], log_decision=None,
              now: float | None = None) -> int:
        """One look at the waiting tasks; returns how many were failed now.

        Parameters
        ----------
        scheduler : distributed.Scheduler
        workers : mapping of str to WorkerView
            The workers now (for the messages).
        log_decision : callable, optional
            ``log_decision(action, worker, reason, seen)`` of the plugin's decision log.
        now : float, optional
            ``time.monotonic()``.
        """
        now = time.monotonic() if now is None else now
        waiting = _distributed.unsatisfiable_tasks(scheduler)
        if not waiting and not self.since:
            return 0
        current = {key for key, _ in waiting}
        for key in list(self.since):
            if key not in current:
                del self.since[key]  # it ran, failed or was released meanwhile
        started: dict[str, list] = {}
        due: dict[str, tuple[dict, list]] = {}
        for key, need in waiting:
            sig = repr(sorted(need.items()))
            if key not in self.since:
                self.since[key] = now
                started.setdefault(sig, [need, []])[1].append(key)
            elif now - self.since[key] >= self.timeout:
                due.setdefault(sig, (need, []))[1].append(key)
        have = describe_worker_resources(workers)
        for need, keys in started.values():
            msg = (f"blockflow: {len(keys)} task{'s' if len(keys) != 1 else ''} (e.g. "
                   f"{keys[0]!r}) need{'s' if len(keys) == 1 else ''} resources {need}, which "
                   f"no worker declares (workers declare: {have}); they fail in "
                   f"{self.timeout:g} s unless such a worker joins")
            logger.warning(msg)
            if log_decision is not None:
                log_decision("wait", "", msg, {"resources": need, "tasks": len(keys)})
        n = 0
        for need, keys in due.values():
            waited = max(now - min(self.since[k] for k in keys), self.timeout)
            exc = ResourceError(
                f"blockflow: task {keys[0]!r} needs resources {need}, which no worker of the "
                f"cluster declares (waited {waited:.0f} s); the workers declare: {have}. "
                f"Start workers that declare them (dask worker <scheduler> --resources "
                f"{','.join(f'{r}={q:g}' for r, q in need.items())}; blockflow.connect() "
                f"declares GPU=1 on each GPU worker it starts), or drop resources= from the "
                f"kernel. (blockflow.resources.unsatisfiable-timeout sets how long to wait.)")
            failed = _distributed.fail_tasks(scheduler, keys, exc,
                                             f"blockflow-unsatisfiable-{time.time()}")
            for k in keys:
                self.since.pop(k, None)
            if failed:
                n += failed
                logger.error("blockflow: failed %d tasks needing resources %s after %g s: no "
                             "worker declares them", failed, need, self.timeout)
                if log_decision is not None:
                    log_decision("fail", "", f"{failed} tasks needing resources {need} failed "
                                 f"after {self.timeout:g} s: no worker declares them",
                                 {"resources": need, "tasks": failed})
        self.failed += n
        return n

    def status(self) -> dict[str, Any]:
        """Plain data: tasks waiting for resources no worker has, and failed so far."""
        return {"waiting": len(self.since), "failed": self.failed, "timeout": self.timeout}
