"""The assignment rule: blockflow blocks pinned to workers up front, in proportion to weights."""

from __future__ import annotations

from collections.abc import Callable

from blockflow.scheduling.actions import KERNEL_PREFIX, Action, Decision
from blockflow.scheduling.rules.base import Rule, RuleContext

__all__ = ["RoundRobinAssignmentRule"]


class _SmoothWeightedRoundRobin:
    """Nginx's smooth weighted round robin: spreads picks in proportion to weights."""

    def __init__(self, weights: dict[str, float]):
        self.weights = {k: v for k, v in weights.items() if v > 0} or dict.fromkeys(weights, 1)
        self.current = dict.fromkeys(self.weights, 0.0)
        self.total = sum(self.weights.values())

    def __next__(self) -> str:
        for k, w in self.weights.items():
            self.current[k] += w
        best = max(self.current, key=self.current.get)
        self.current[best] -= self.total
        return best


def _sort_key(key):
    return (key[0], *key[1:]) if isinstance(key, tuple) else (str(key),)


class RoundRobinAssignmentRule(Rule):
    """On ``"graph"``: pin each new, unassigned, unrestricted kernel task to a running worker, in
    key order, by smooth weighted round robin (nginx); one ``assign`` decision per worker.

    Parameters
    ----------
    weight : callable
        ``weight(WorkerView) -> float``: relative share of blocks (all 0: equal shares).
    name : str
        The policy's name, in the reasons.
    """

    def __init__(self, weight: Callable, name: str):
        self.weight = weight
        self.name = name

    def run(self, snap, context: RuleContext | None = None) -> list[Decision]:
        if snap.event != "graph":
            return []
        running = {a: w for a, w in sorted(snap.workers.items()) if w.status == "running"}
        tasks = [t for t in snap.new_tasks
                 if t.state in ("released", "waiting", "no-worker") and not t.restricted
                 and t.runnable and t.group.startswith(KERNEL_PREFIX)]
        if not running or not tasks:
            return []
        rr = _SmoothWeightedRoundRobin({a: self.weight(w) for a, w in running.items()})
        assigned: dict[str, list] = {}
        for t in sorted(tasks, key=lambda t: _sort_key(t.key)):
            assigned.setdefault(next(rr), []).append(t.key)
        weights = {a: round(self.weight(w), 3) for a, w in running.items()}
        return [Decision(Action.ASSIGN, a, f"{len(keys)} blocks assigned up front "
                         f"({self.name}, weights {weights})", {"weight": weights[a]},
                         keys=tuple(keys))
                for a, keys in assigned.items()]
