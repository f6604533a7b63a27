"""Scheduling policies: the rules one run of the scheduler plugin composes.

Modelled on distributed's Active Memory Manager: every policy derives from
:class:`RebalancePolicy`, reads a plain-data :class:`ClusterSnapshot` and yields commands
(:class:`~blockflow.scheduling.actions.Decision`) and records
(:class:`~blockflow.scheduling.actions.Record`); the plugin's actuator applies and logs them.
:data:`POLICIES` is the registry of built-in names (the plugin, the ``cluster.policy``
setting, the CLI and the dashboard read it); :func:`make_policy` also loads a
``RebalancePolicy`` subclass by dotted path (``mypkg.MyPolicy``), as distributed loads AMM
policies.

``dynamic``
    Keeps new work off hot or nearly-full GPUs, places blocks that declared a device working
    set where it fits and, once worker speeds are known to differ, moves waiting tasks to
    the workers that will be free soonest.
``memory``
    :class:`~blockflow.scheduling.device_memory.DeviceMemoryAMMPolicy` in distributed's
    Active Memory Manager: moves stored results off workers above the device-memory
    high-water mark.
``static-round-robin`` / ``static-capacity``
    Assign every blockflow block to a worker when the graph arrives: in turn, or in
    proportion to each worker's capacity (smooth weighted round robin).
``off``
    Observe only.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

from dask.utils import parse_timedelta
from distributed.utils import import_term

from blockflow import config
from blockflow._distributed import AMMPolicy, TaskView, WorkerView
from blockflow._distributed.speculation import SpeculationHandlers
from blockflow.pools.objective_rule import ObjectiveRule
from blockflow.scheduling.actions import Action, Decision, Record
from blockflow.scheduling.device_memory import DeviceMemoryAMMPolicy
from blockflow.scheduling.rules import (
    AdmissionRule,
    BackupRule,
    BalancingRule,
    HoldRule,
    KernelPlacementRule,
    MoveRule,
    PauseRule,
    RoundRobinAssignmentRule,
    Rule,
    RuleContext,
    UnsatisfiableRule,
    WorkingSetPlacementRule,
)
from blockflow.scheduling.rules.move import best_target

__all__ = [
    "POLICIES",
    "Action",
    "ClusterSnapshot",
    "ComposedPolicy",
    "Decision",
    "DeviceMemoryAMMPolicy",
    "DynamicPolicy",
    "MemoryPolicy",
    "ObservePolicy",
    "RebalancePolicy",
    "Record",
    "StaticCapacityPolicy",
    "StaticRoundRobinPolicy",
    "TaskView",
    "WorkerView",
    "make_policy",
    "policy_class",
]


@dataclass
class ClusterSnapshot:
    """What a policy sees: plain data, no scheduler objects.

    Attributes
    ----------
    time : float
        Seconds since the epoch.
    workers : dict of str to WorkerView
    queued : int
        Root tasks the scheduler holds back (not yet on a worker).
    event : {"tick", "graph", "held", "admit", "close"}
        A control-loop tick, a graph just arrived (``new_tasks``), or one of the admission
        rule's own (:class:`~blockflow.scheduling.rules.AdmissionRule`).
    waiting : mapping of str to iterable of TaskView
        Per worker, its tasks not started, lowest priority (last to run) first.
    new_tasks : list of TaskView
        On ``"graph"`` events, the tasks of the new graph.
    balancing : bool
        Whether worker speeds are known, with confidence, to differ.
    running : mapping of str to list of RunningTask
        Per worker, the tasks it runs now, with their elapsed time.
    backups : mapping
        Task key -> the worker running its backup copy now.
    bandwidth : float
        Worker-to-worker bandwidth estimate, bytes per second.
    held, stopped, parked : frozenset of str
        Workers blockflow holds back from the queue; workers that paused themselves (their
        tasks not started are all in ``waiting``); workers parked for the objective.
    speeds_differ, speeds_differ_weakly : bool
        The speed model's strict (1.3x at 0.1 %) and weak (1.15x at 10 %) tests.
    unsatisfiable : list of (key, dict)
        Tasks waiting for resources no connected worker declares.
    monotonic : float
        ``time.monotonic()`` when the snapshot was taken.
    feeders, feeder_states, client
        For the admission rule: a new graph's feeders, where each feeder stands, and the
        submitting client's id.
    changed : frozenset of str or None
        On ticks, the workers whose view changed since the previous one; None: all.
    run : Run, optional
        The run most recently given work, when it runs under a :func:`blockflow.objective`.
    declared_pools : mapping of str to Pool
        Pools known before any worker of theirs joined.
    throughput, inputs : mapping
        With ``run``: group -> pool name -> seconds per task
        (:func:`blockflow.pools.plan.throughput_matrix`); group -> provider -> input bytes
        per task read from there.
    """

    time: float
    workers: dict[str, WorkerView]
    queued: int = 0
    event: str = "tick"
    waiting: Mapping[str, Any] = field(default_factory=dict, repr=False)
    new_tasks: list[TaskView] = field(default_factory=list, repr=False)
    balancing: bool = True
    running: Mapping[str, Any] = field(default_factory=dict, repr=False)
    backups: Mapping[Any, str] = field(default_factory=dict)
    bandwidth: float = 100e6
    held: frozenset = frozenset()
    stopped: frozenset = frozenset()
    speeds_differ: bool = False
    speeds_differ_weakly: bool = False
    unsatisfiable: list = field(default_factory=list, repr=False)
    monotonic: float = 0.0
    feeders: list = field(default_factory=list, repr=False)
    feeder_states: Any = field(default=None, repr=False)
    client: str | None = None
    changed: frozenset | None = field(default=None, repr=False)
    run: Any = field(default=None, repr=False)
    parked: frozenset = frozenset()
    declared_pools: Mapping[str, Any] = field(default_factory=dict, repr=False)
    throughput: Mapping[str, Mapping[str, float]] = field(default_factory=dict, repr=False)
    inputs: Mapping[str, Mapping[str, float]] = field(default_factory=dict, repr=False)


class RebalancePolicy(abc.ABC):
    """Interface of a scheduling policy (in the manner of distributed's AMM policies).

    Subclasses set :attr:`name` and implement :meth:`run`, which the plugin calls on every
    control-loop tick (``snapshot.event == "tick"``) and when a graph arrives (``"graph"``).
    The policy also owns the rules the plugin runs at their own moments, under every
    policy: :attr:`kernel_placement` and :attr:`admission` on a new graph,
    :attr:`unsatisfiable`, :attr:`admission` and :attr:`balancing` on a tick, before
    :meth:`run`; and :attr:`objective`, the run objective's rule, or None.
    """

    #: Registry name (``blockflow.cluster.policy``).
    name: ClassVar[str] = ""
    #: Whether distributed's own (speed-blind) balancing loop should be suspended.
    replaces_work_stealing: ClassVar[bool] = False
    #: Whether admission control holds producers back under this policy.
    admits: ClassVar[bool] = True
    #: The rule that parks pools for a run objective (pools' cost, budgets), or None.
    objective: ObjectiveRule | None = None

    @abc.abstractmethod
    def run(self, snapshot: ClusterSnapshot) -> Iterator[Decision | Record]:
        """Yield the commands and records for this snapshot."""

    @cached_property
    def kernel_placement(self) -> KernelPlacementRule:
        """Restricts a new graph's tasks as their kernels asked."""
        return KernelPlacementRule()

    @cached_property
    def admission(self) -> AdmissionRule:
        """Holds producers back while their resource-bound consumers cannot keep up."""
        rule = AdmissionRule()
        rule.enabled = bool(self.admits)
        return rule

    @cached_property
    def unsatisfiable(self) -> UnsatisfiableRule:
        """Warns about, then fails, tasks no worker can run."""
        return UnsatisfiableRule()

    @cached_property
    def balancing(self) -> BalancingRule:
        """Suspends or restores distributed's work stealing."""
        return BalancingRule(hands_over=self.replaces_work_stealing)

    def amm_policies(self) -> list[AMMPolicy]:
        """Active Memory Manager policies to install beside this policy (default none)."""
        return []

    def worker_plugins(self) -> list:
        """Worker plugins every worker needs for this policy's commands (default none)."""
        return []


class ComposedPolicy(RebalancePolicy):
    """A policy that is its :attr:`rules`, run in order on every snapshot, sharing one
    :class:`~blockflow.scheduling.rules.RuleContext` per snapshot."""

    #: The rules, in the order they run.
    rules: list[Rule]

    def run(self, snapshot: ClusterSnapshot) -> Iterator[Decision | Record]:
        context = RuleContext()
        for rule in self.rules:
            yield from rule.run(snapshot, context)


class ObservePolicy(ComposedPolicy):
    """``off``: record metrics and decisions of others, change nothing (no rules)."""

    name = "off"
    admits = False  # observe only: never hold tasks back

    def __init__(self):
        self.rules = []


class DynamicPolicy(ComposedPolicy):
    """Pause hot / nearly-full GPUs and move queued tasks to the workers that will be free first.

    Parameters
    ----------
    memory_high, memory_low : float, optional
        Device-memory fractions (0-1) at which a worker is paused / resumed (hysteresis).
        Default ``blockflow.rebalancer.memory-high`` / ``memory-low``.
    hot_high, hot_low : float, optional
        GPU utilisation (percent) by *other* work at which a worker is paused / resumed.
    move_budget : int, optional
        Most tasks moved per tick.
    min_gain : str or float, optional
        Smallest gain in projected finish time (seconds) worth a move.
    speculation : bool, optional
        Start backup copies of straggling kernel tasks (``blockflow.speculation.enabled``).
    backup_slots : float, optional
        Most backup copies at once, as a fraction 0-1 of all worker threads, at least one
        (``blockflow.speculation.max-slots``).
    backup_ratio : float, optional
        A copy starts when the task's estimated time to end exceeds this many times the
        copy's own time (``blockflow.speculation.min-ratio``).
    backup_min_elapsed : float, optional
        Share 0-1 of its expected duration a task must have run before it may be copied
        (``blockflow.speculation.min-elapsed``).
    hold_slowdown : float, optional
        How many times slower than typical (> 1) a worker must evidently be before it is
        held back from the queue's last tasks (``blockflow.speculation.hold-slowdown``;
        see :class:`~blockflow.scheduling.rules.HoldRule`).

    Raises
    ------
    ValueError
        If a resume threshold is not below its pause threshold.

    Notes
    -----
    The policy is its rules, in order (:attr:`rules`): on a graph, the objective's refusals
    and placement by working set (:attr:`placement`); on a tick, pools parked for the
    objective, :attr:`pause`, :attr:`hold`, :attr:`move` (a greedy list-scheduling repair
    in the spirit of LPT, Graham 1969) and :attr:`backup` (LATE, Zaharia et al. OSDI 2008);
    see :mod:`blockflow.scheduling.rules` for each. A blockflow heuristic.
    """

    name = "dynamic"
    replaces_work_stealing = True
    #: Tasks remembered as moved (oldest forgotten first; ``MoveRule.moved_memory``).
    moved_memory = 10_000

    def __init__(self, memory_high=None, memory_low=None, hot_high=None, hot_low=None,
                 move_budget=None, min_gain=None, speculation=None, backup_slots=None,
                 backup_ratio=None, backup_min_elapsed=None, hold_slowdown=None):
        self.speculation = bool(config.get("speculation.enabled", speculation))
        self.backup_slots = float(config.get("speculation.max-slots", backup_slots))
        self.backup_ratio = float(config.get("speculation.min-ratio", backup_ratio))
        self.backup_min_elapsed = float(config.get("speculation.min-elapsed",
                                                   backup_min_elapsed))
        self.hold_slowdown = float(config.get("speculation.hold-slowdown", hold_slowdown))
        self.memory_high = float(config.get("rebalancer.memory-high", memory_high))
        self.memory_low = float(config.get("rebalancer.memory-low", memory_low))
        self.hot_high = float(config.get("rebalancer.hot-high", hot_high))
        self.hot_low = float(config.get("rebalancer.hot-low", hot_low))
        self.move_budget = int(config.get("rebalancer.move-budget", move_budget))
        self.min_gain = parse_timedelta(config.get("rebalancer.move-min-gain", min_gain))
        for low, high, lv, hv in (("memory_low", "memory_high", self.memory_low,
                                   self.memory_high),
                                  ("hot_low", "hot_high", self.hot_low, self.hot_high)):
            if not lv < hv:
                raise ValueError(
                    f"blockflow rebalancer: {low}={lv:g} must be below {high}={hv:g}: a "
                    f"worker paused at {high} resumes once it falls below {low}; lower "
                    f"{low} or raise {high} (settings blockflow.rebalancer."
                    f"{low.replace('_', '-')} / {high.replace('_', '-')})."
                )

        self.placement = WorkingSetPlacementRule()
        self.pause = PauseRule(self.memory_high, self.memory_low, self.hot_high, self.hot_low)
        self.hold = HoldRule(self.speculation, self.hold_slowdown)
        self.move = MoveRule(best_target, self.move_budget, self.min_gain,
                             slowed=self.hold.slowed_now if self.speculation else None,
                             moved_memory=self.moved_memory)
        self.backup = BackupRule(self.speculation, self.backup_slots, self.backup_ratio,
                                 self.backup_min_elapsed)
        self.objective = ObjectiveRule()
        # holds skip a worker just paused, moves a paused, parked or held one, copies a
        # move's target
        self.rules = [self.objective, self.placement, self.pause, self.hold, self.move,
                      self.backup]

    def worker_plugins(self) -> list:
        # every worker, present and future, can run and answer backup copies
        return [SpeculationHandlers()] if self.speculation else []


class MemoryPolicy(ComposedPolicy):
    """``memory``: move stored results off workers above the device-memory high-water mark.

    Installs :class:`DeviceMemoryAMMPolicy` into distributed's Active Memory Manager, which
    replicates results to the workers with most free device memory and then drops them from
    the full worker (two AMM cycles; each move logged as ``memory-move`` through the
    plugin). Its own rules: none (no tick or graph decisions).

    Parameters
    ----------
    memory_high, memory_low : float, optional
        See :class:`DeviceMemoryAMMPolicy`.
    """

    name = "memory"

    def __init__(self, memory_high=None, memory_low=None):
        self.memory_high = float(config.get("rebalancer.memory-high", memory_high))
        self.memory_low = float(config.get("rebalancer.memory-low", memory_low))
        self.rules = []

    def amm_policies(self) -> list[AMMPolicy]:
        return [DeviceMemoryAMMPolicy(self.memory_high, self.memory_low)]


class StaticRoundRobinPolicy(ComposedPolicy):
    """``static-round-robin``: blockflow blocks go to workers in turn, fixed up front.

    When a graph arrives, each blockflow kernel task that is not yet assigned and carries no
    user restriction is pinned to one running worker (strict restriction), in key order.
    Smooth weighted round robin (as in nginx) with equal weights: the policy is one
    :class:`~blockflow.scheduling.rules.RoundRobinAssignmentRule` weighted by
    :meth:`weight`.
    """

    name = "static-round-robin"

    def __init__(self):
        self.assignment = RoundRobinAssignmentRule(self.weight, self.name)
        self.rules = [self.assignment]

    def weight(self, w: WorkerView) -> float:
        """Relative share of blocks for ``w`` (1 for every worker here)."""
        return 1.0


class StaticCapacityPolicy(StaticRoundRobinPolicy):
    """``static-capacity``: blocks assigned up front in proportion to worker capacity.

    Capacity is the ``blockflow-capacity`` worker metric when a worker reports one (GPU
    workers report SM cores x clock; simulated devices their nominal speed), else the
    worker's thread count.
    """

    name = "static-capacity"

    def weight(self, w: WorkerView) -> float:
        return float(w.capacity) if w.capacity else float(max(w.nthreads, 1))


#: The one registry of policies: name -> class.
REGISTRY: dict[str, type[RebalancePolicy]] = {
    cls.name: cls for cls in (DynamicPolicy, MemoryPolicy, StaticRoundRobinPolicy,
                              StaticCapacityPolicy, ObservePolicy)
}
#: Policy names, in the order the CLI and docs list them.
POLICIES: tuple[str, ...] = tuple(REGISTRY)

#: What a policy named by dotted path looks like (``mypkg.MyPolicy``).
DOTTED_PATH = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$"

config.set_choices("cluster.policy", POLICIES, pattern=DOTTED_PATH)


def policy_class(name: str) -> type[RebalancePolicy]:
    """The policy class for a built-in name or the dotted path of a
    :class:`RebalancePolicy` subclass.

    Raises
    ------
    ValueError
        If ``name`` names neither; the message lists the built-in names.
    """
    cls = REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None and isinstance(name, str) and "." in name:
        try:
            cls = import_term(name)
        except (ImportError, AttributeError, ValueError):
            cls = None
        if not (isinstance(cls, type) and issubclass(cls, RebalancePolicy)):
            cls = None
    if cls is None:
        raise ValueError(
            f"Unknown blockflow policy {name!r}; choose one of {', '.join(POLICIES)}. A "
            f"dotted path to a RebalancePolicy subclass (mypkg.MyPolicy) works too.")
    return cls


def make_policy(name: str) -> RebalancePolicy:
    """The policy object for a built-in name or a dotted path (see :func:`policy_class`).

    Raises
    ------
    ValueError
        If ``name`` names no policy; the message lists the built-in names.
    """
    return policy_class(name)()
