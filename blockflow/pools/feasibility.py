"""What the objective rule reads off a snapshot, and whether an objective can be met at all."""

from __future__ import annotations

from blockflow.pools import plan as cost
from blockflow.pools.pool import Pool

__all__ = ["capacity", "check_objective", "egress", "seconds"]

_GB = 1e9


def seconds(snap, pools: dict[str, Pool], groups) -> dict[str, dict[str, float]]:
    """Seconds per task of ``groups`` on each pool: the throughput matrix's rows."""
    matrix = snap.throughput or {}
    names = {p.name for p in pools.values()}
    return {g: {p: t for p, t in matrix[g].items() if p in names}
            for g in groups if g in matrix}


def egress(snap, pools: dict[str, Pool], groups) -> dict[str, dict[str, float]]:
    """Group -> pool name -> dollars per task for inputs sent to it from another provider
    (``snap.inputs``: group -> sending pool -> input bytes per task), priced by the sender."""
    by_name = {p.name: p for p in pools.values()}
    out = {}
    for g in groups:
        by_sender = (snap.inputs or {}).get(g)
        if not by_sender:
            continue
        out[g] = {p.name: sum(b / _GB * by_name[src].egress for src, b in by_sender.items()
                              if src in by_name and by_name[src].provider != p.provider)
                  for p in by_name.values()}
    return out


def capacity(snap, pools: dict[str, Pool]) -> tuple[dict, dict]:
    """Pool name -> running workers, and threads per worker (the median)."""
    workers: dict[str, int] = {}
    threads: dict[str, list[int]] = {}
    for a, w in snap.workers.items():
        if w.status != "running":
            continue
        name = pools[a].name
        workers[name] = workers.get(name, 0) + 1
        threads.setdefault(name, []).append(max(w.nthreads, 1))
    return workers, {p: max(sorted(t)[len(t) // 2], 1) for p, t in threads.items()}


def check_objective(objective, pools: dict[str, Pool], work: dict[str, float],
                    seconds: dict[str, dict[str, float]], workers: dict[str, int],
                    threads: dict[str, int]) -> str:
    """Why ``objective`` cannot be met, one line; ``""`` if it can or too little is known.

    Checks a price for every pool when prices matter, a deadline some pool sizes meet, a budget
    at least the cheapest run.
    """
    if objective is None:
        return ""
    by_name = {p.name: p for p in pools.values()}
    if objective.needs_prices:
        for p in sorted(by_name.values(), key=lambda p: p.name):
            if p.price is None:
                what = ("the cost objective" if objective.kind == "cost"
                        else "a budget")
                return (f"blockflow.objective: pool {p.name!r} has no price, which {what} "
                        f"needs; give it one (Pool({p.name!r}, price=<dollars per "
                        f"worker-hour>), or `--preload blockflow.pools.preload --pool {p.name} "
                        f"--price ...`)")
    known = {g: n for g, n in work.items() if g in seconds}
    if not known:
        return ""
    if objective.deadline is not None:
        plan = cost.plan(known, seconds, by_name, workers, threads=threads,
                         deadline=objective.deadline)
        if not plan.feasible:
            return f"blockflow.objective: {plan.shortfall}"
    if objective.budget is not None:
        plan = cost.plan(known, seconds, by_name, workers, threads=threads,
                         budget=objective.budget)
        if not plan.feasible:
            return f"blockflow.objective: {plan.shortfall}"
    return ""
