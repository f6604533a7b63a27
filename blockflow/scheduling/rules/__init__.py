"""Scheduling rules: small classes with one entry point, ``run(snapshot, context)``, yielding
commands and records (:mod:`blockflow.scheduling.actions`); a policy composes them.

=========================  ==========================================================
:class:`KernelPlacementRule`  restrict new tasks as their kernels asked (``restrict``)
:class:`WorkingSetPlacementRule`  device working sets onto workers that hold them (``place``)
:class:`UnsatisfiableRule`   warn about, then fail, tasks no worker can run (``wait``, ``fail``)
:class:`StealingRule`        blockflow or distributed's stealing balances (``suspend-stealing``, ``restore-stealing``)
:class:`PauseRule`           hot or full GPUs take no new work (``pause``, ``resume``)
:class:`HoldRule`            slowed workers skip the queue's last tasks (``hold``, ``release``)
:class:`MoveRule`            waiting tasks to the workers free soonest (``move``)
:class:`BackupRule`          copies of stragglers on idle workers (``speculate``)
:class:`RoundRobinAssignmentRule`  blocks pinned up front by worker weight (``assign``)
:class:`AdmissionRule`       producers feeding GPU consumers within a budget (``hold``, ``release``, ``admit``)
:class:`~blockflow.pools.objective_rule.ObjectiveRule`  a priced run held and planned (``hold``, ``release``, ``objective``, ``fail``)
=========================  ==========================================================
"""

from blockflow.scheduling.rules.admission import AdmissionRule, default_budget
from blockflow.scheduling.rules.assignment import RoundRobinAssignmentRule
from blockflow.scheduling.rules.backup import BackupRule
from blockflow.scheduling.rules.stealing import StealingRule
from blockflow.scheduling.rules.base import Rule, RuleContext
from blockflow.scheduling.rules.hold import HoldRule, pessimistic_speed
from blockflow.scheduling.rules.move import MoveRule
from blockflow.scheduling.rules.pause import PauseRule
from blockflow.scheduling.rules.placement import KernelPlacementRule, WorkingSetPlacementRule
from blockflow.scheduling.rules.unsatisfiable import UnsatisfiableRule

__all__ = ["AdmissionRule", "BackupRule", "StealingRule", "HoldRule", "KernelPlacementRule",
           "MoveRule", "PauseRule", "RoundRobinAssignmentRule", "Rule", "RuleContext", "UnsatisfiableRule",
           "WorkingSetPlacementRule", "default_budget", "pessimistic_speed"]
