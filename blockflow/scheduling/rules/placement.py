"""Placement rules for a graph that just arrived: kernels' own requests, device working sets.

A kernel's request travels inside its task, so graph optimisation (which drops
``dask.annotate`` layer annotations when it fuses tasks) cannot lose it.
"""

from __future__ import annotations

from blockflow.scheduling.actions import Action, Decision, Record, Recorded
from blockflow.scheduling.rules.base import Rule, RuleContext, fmt_bytes

__all__ = ["KernelPlacementRule", "WorkingSetPlacementRule"]

#: Task states in which a restriction still takes effect.
_UNSCHEDULED = ("released", "waiting")


class KernelPlacementRule(Rule):
    """On ``"graph"``: one ``restrict`` decision for the new, unscheduled tasks whose kernels
    declared a placement; ``detail`` maps each key to its placement.
    """

    def run(self, snap, context: RuleContext) -> list[Decision]:
        if snap.event != "graph":
            return []
        placements = {t.key: t.placement for t in snap.new_tasks
                      if t.placement and t.state in _UNSCHEDULED}
        if not placements:
            return []
        return [Decision(Action.RESTRICT, "", f"{len(placements)} tasks restricted as their "
                         f"kernels asked (resources=, workers=)", {"tasks": len(placements)},
                         keys=tuple(placements), detail=placements)]


class WorkingSetPlacementRule(Rule):
    """On ``"graph"``: restrict tasks that declared a device working set
    (``map_blocks(working_set=)``) to the running workers whose free device memory holds it.

    Nothing is restricted when every worker fits or none reports device memory; when none fits
    the task runs and fails with :class:`~blockflow.DeviceMemoryError` (logged as ``keep``).
    """

    def run(self, snap, context: RuleContext) -> list[Decision]:
        if snap.event != "graph":
            return []
        running = {a: w for a, w in sorted(snap.workers.items()) if w.status == "running"}
        free = {a: w.metrics.gpu_memory_free for a, w in running.items()
                if w.metrics.gpu_memory_free is not None}
        if not free:
            return []
        groups: dict[tuple[frozenset, int], list] = {}
        nowhere: dict[int, list] = {}
        for t in snap.new_tasks:
            if (t.working_set is None or t.restricted
                    or t.state not in ("released", "waiting", "no-worker")):
                continue
            fits = frozenset(a for a, f in free.items() if f >= t.working_set)
            if not fits:
                nowhere.setdefault(t.working_set, []).append(t.key)
            elif fits != set(running):
                groups.setdefault((fits, t.working_set), []).append(t.key)
        seen = {"gpu_memory_free": {a: int(f) for a, f in free.items()}}
        out = []
        for (fits, ws), keys in groups.items():
            workers = tuple(sorted(fits))
            out.append(Decision(
                Action.PLACE, workers[0], f"{len(keys)} blocks with a {fmt_bytes(ws)} working "
                f"set placed on the {len(workers)} of {len(running)} workers whose free device "
                f"memory holds it", {**seen, "working_set": ws}, keys=tuple(keys),
                workers=workers))
        for ws, keys in nowhere.items():
            best = max(free, key=free.get)
            out.append(Record(
                Recorded.KEEP, best, f"{len(keys)} blocks need a {fmt_bytes(ws)} working set, "
                f"more than the free device memory of any worker (largest "
                f"{fmt_bytes(free[best])}): left to run and fail with DeviceMemoryError",
                {**seen, "working_set": ws}, keys=tuple(keys)))
        return out
