"""The stealing hand-over: blockflow balances on known speeds, or distributed's work stealing does."""

from __future__ import annotations

from blockflow.scheduling.actions import Action, Decision
from blockflow.scheduling.rules.base import Rule, RuleContext

__all__ = ["StealingRule"]


class StealingRule(Rule):
    """Suspend distributed's stealing while blockflow balances on known speeds; hand it back when
    blockflow knows too little.

    Starts on the speed model's strict test (1.3x at 0.1 %), stops after :attr:`calm_ticks`
    snapshots without the weak one (1.15x at 10 %): hysteresis. Yields ``suspend-stealing`` /
    ``restore-stealing``; nothing with ``hands_over`` false. :attr:`active`: balancing now.
    """

    #: Snapshots in a row without a speed difference before balancing goes back to
    #: distributed.
    calm_ticks = 10

    def __init__(self, hands_over: bool):
        self.hands_over = hands_over
        self.active = False
        self.calm = 0

    def judge(self, snap) -> bool:
        """The snapshot's ``balancing`` flag from its speed tests (counts calm snapshots)."""
        if not self.active:
            return bool(snap.speeds_differ)
        if snap.speeds_differ_weakly:
            self.calm = 0
            return True
        self.calm += 1
        return self.calm < self.calm_ticks

    def run(self, snap, context: RuleContext | None = None) -> list[Decision]:
        if not self.hands_over or snap.event != "tick" or bool(snap.balancing) == self.active:
            return []  # (no change: no worker is looked at)
        seen = {"speeds": {a: round(w.speed, 3) for a, w in snap.workers.items()},
                "confidence": {a: round(w.speed_confidence, 2)
                               for a, w in snap.workers.items()}}
        if snap.balancing:
            self.active, self.calm = True, 0
            return [Decision(Action.SUSPEND_STEALING, "", "worker speeds known to differ: blockflow "
                             "balances on them; distributed's work stealing paused", seen)]
        self.active = False
        return [Decision(Action.RESTORE_STEALING, "", "worker speeds not known to differ: balancing "
                         "handed back to distributed's work stealing", seen)]
