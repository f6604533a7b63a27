"""Scheduling policies: the rules one run of the scheduler plugin composes.

Modelled on distributed's Active Memory Manager: a :class:`RebalancePolicy` reads a
:class:`ClusterSnapshot` and yields :class:`~blockflow.scheduling.actions.Decision` and
:class:`~blockflow.scheduling.actions.Record` objects. :data:`POLICIES` names the built-in
ones (``dynamic``, ``memory``, ``static-round-robin``, ``static-capacity``, ``off``);
:func:`make_policy` also loads a subclass by dotted path. Guide: :doc:`/guide/scheduling`.
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
from blockflow.scheduling.speculation import SpeculationHandlers
from blockflow.pools.objective_rule import ObjectiveRule
from blockflow.scheduling.actions import Action, Decision, Record
from blockflow.scheduling.device_memory import DeviceMemoryAMMPolicy
from blockflow.scheduling.rules import (
    AdmissionRule,
    BackupRule,
    StealingRule,
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
    """What a policy sees: plain data, no scheduler objects. Times in seconds.

    Attributes
    ----------
    time, monotonic : float
        ``time.time()`` and ``time.monotonic()`` at the snapshot.
    workers : dict of str to WorkerView
    event : {"tick", "graph", "held", "admit", "close"}
        A tick, a new graph (``new_tasks``), or an admission event.
    queued : int
        Root tasks the scheduler holds back.
    waiting, running : mapping of str to list
        Per worker, its tasks not started (last to run first) and running (with elapsed time).
    new_tasks : list of TaskView
    backups : mapping
        Task key -> worker running its backup copy.
    bandwidth : float
        Worker-to-worker estimate, bytes per second.
    held, stopped : frozenset of str
        Workers held back from the queue; paused by themselves.
    balancing, speeds_differ, speeds_differ_weakly : bool
        Whether blockflow balances; the speed model's strict and weak tests.
    unsatisfiable : list of (key, dict)
        Tasks waiting for resources no connected worker declares.
    feeders, feeder_states, client
        For the admission rule.
    changed : frozenset of str or None
        On ticks, workers whose view changed; None: all.
    run, declared_pools, throughput, inputs, lifetimes
        For the objective rule: the run under a :func:`blockflow.objective`, pools known
        before their workers, group -> pool -> seconds per task
        (:func:`blockflow.pools.plan.throughput_matrix`), group -> sending pool -> input bytes
        per task, worker -> ``(pool, arrival, departure)`` (billing).
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
    lifetimes: Mapping[str, tuple] = field(default_factory=dict, repr=False)
    declared_pools: Mapping[str, Any] = field(default_factory=dict, repr=False)
    throughput: Mapping[str, Mapping[str, float]] = field(default_factory=dict, repr=False)
    inputs: Mapping[str, Mapping[str, float]] = field(default_factory=dict, repr=False)


class RebalancePolicy(abc.ABC):
    """Interface of a scheduling policy (in the manner of distributed's AMM policies).

    Subclasses set :attr:`name` and implement :meth:`run`, called on every tick and new graph;
    the rules run under every policy are attributes.
    """

    #: Registry name (``blockflow.cluster.policy``).
    name: ClassVar[str] = ""
    #: Whether distributed's own (speed-blind) balancing loop should be suspended.
    replaces_work_stealing: ClassVar[bool] = False
    #: Whether admission control holds producers back under this policy.
    admits: ClassVar[bool] = True
    #: The rule that plans a run under a cost objective or a budget, or None.
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
    def stealing_rule(self) -> StealingRule:
        """Suspends or restores distributed's work stealing."""
        return StealingRule(hands_over=self.replaces_work_stealing)

    def amm_policies(self) -> list[AMMPolicy]:
        """Active Memory Manager policies to install beside this policy (default none)."""
        return []

    def worker_plugins(self) -> list:
        """Worker plugins every worker needs for this policy's commands (default none)."""
        return []


class ComposedPolicy(RebalancePolicy):
    """A policy that runs its :attr:`rules` in order, sharing one
    :class:`~blockflow.scheduling.rules.RuleContext` per snapshot.
    """

    #: The rules, in the order they run.
    rules: list[Rule]

    def run(self, snapshot: ClusterSnapshot) -> Iterator[Decision | Record]:
        context = RuleContext()
        for rule in self.rules:
            yield from rule.run(snapshot, context)


class ObservePolicy(ComposedPolicy):
    """``off``: record metrics, change nothing."""

    name = "off"
    admits = False  # observe only: never hold tasks back

    def __init__(self):
        self.rules = []


class DynamicPolicy(ComposedPolicy):
    """Pause hot / nearly-full GPUs and move queued tasks to the workers that will be free first.

    Rules: objective, working-set placement, :attr:`pause`, :attr:`hold`, :attr:`move` (after
    LPT, Graham 1969) and :attr:`backup` (LATE, Zaharia et al. OSDI 2008); see
    :mod:`blockflow.scheduling.rules`. A blockflow heuristic. Each default comes from the
    setting named.

    Parameters
    ----------
    memory_high, memory_low : float, optional
        Device-memory fractions 0-1 to pause / resume (``blockflow.rebalancer.memory-high``,
        ``memory-low``).
    hot_high, hot_low : float, optional
        GPU utilisation by other work, percent, to pause / resume (``rebalancer.hot-high``,
        ``hot-low``).
    move_budget : int, optional
        Most tasks moved per tick (``rebalancer.move-budget``).
    min_gain : str or float, optional
        Smallest gain in finish time worth a move, seconds (``rebalancer.move-min-gain``).
    speculation : bool, optional
        Backup copies of stragglers (``blockflow.speculation.enabled``).
    backup_slots : float, optional
        Most copies at once, fraction 0-1 of threads (``speculation.max-slots``).
    backup_ratio : float, optional
        Copy when the time to end exceeds this many times the copy's (``speculation.min-ratio``).
    backup_min_elapsed : float, optional
        Fraction 0-1 of its duration a task must have run (``speculation.min-elapsed``).
    hold_slowdown : float, optional
        Slowdown (> 1) past which a worker is held back (``speculation.hold-slowdown``).

    Raises
    ------
    ValueError
        If a resume threshold is not below its pause threshold.
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
        # holds skip a worker just paused, moves a paused or held one, copies a
        # move's target
        self.rules = [self.objective, self.placement, self.pause, self.hold, self.move,
                      self.backup]

    def worker_plugins(self) -> list:
        # every worker, present and future, can run and answer backup copies
        return [SpeculationHandlers()] if self.speculation else []


class MemoryPolicy(ComposedPolicy):
    """``memory``: move stored results off workers above the device-memory high-water mark.

    Installs :class:`DeviceMemoryAMMPolicy` (``memory_high``, ``memory_low``) into
    distributed's Active Memory Manager; no rules of its own.
    """

    name = "memory"

    def __init__(self, memory_high=None, memory_low=None):
        self.memory_high = float(config.get("rebalancer.memory-high", memory_high))
        self.memory_low = float(config.get("rebalancer.memory-low", memory_low))
        self.rules = []

    def amm_policies(self) -> list[AMMPolicy]:
        return [DeviceMemoryAMMPolicy(self.memory_high, self.memory_low)]


class StaticRoundRobinPolicy(ComposedPolicy):
    """``static-round-robin``: each new blockflow block pinned to a worker in turn, in key order.

    Smooth weighted round robin (as in nginx) by :meth:`weight`, through
    :class:`~blockflow.scheduling.rules.RoundRobinAssignmentRule`.
    """

    name = "static-round-robin"

    def __init__(self):
        self.assignment = RoundRobinAssignmentRule(self.weight, self.name)
        self.rules = [self.assignment]

    def weight(self, w: WorkerView) -> float:
        """Relative share of blocks for ``w`` (1 for every worker here)."""
        return 1.0


class StaticCapacityPolicy(StaticRoundRobinPolicy):
    """``static-capacity``: blocks assigned up front in proportion to the ``blockflow-capacity``
    worker metric, else the thread count.
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
    """The policy class for a built-in name or the dotted path of a :class:`RebalancePolicy`
    (imported with :func:`dask.utils.import_term`, as distributed's AMM loads policies).

    Raises
    ------
    ValueError
        If ``name`` names neither, in one line: the built-in names, or why the dotted path
        did not give a policy class (its import error, or what it is instead).
    """
    cls = REGISTRY.get(name) if isinstance(name, str) else None
    if cls is not None:
        return cls
    why = ""
    if isinstance(name, str) and "." in name:
        try:
            cls = import_term(name)
        except Exception as e:  # noqa: BLE001 - any import failure of the user's module
            why = f": cannot import it here ({type(e).__name__}: {e})"
        else:
            if isinstance(cls, type) and issubclass(cls, RebalancePolicy):
                return cls
            why = f": it is {cls!r}, not a RebalancePolicy subclass"
    raise ValueError(
        f"Unknown blockflow policy {name!r}{why}; choose one of {', '.join(POLICIES)}. A "
        f"dotted path to a RebalancePolicy subclass (mypkg.MyPolicy), importable where the "
        f"scheduler runs, works too.")


def make_policy(name: str) -> RebalancePolicy:
    """The policy object for a built-in name or a dotted path (see :func:`policy_class`).

    Raises
    ------
    ValueError
        If ``name`` names no policy, or its class cannot be built without arguments.
    """
    cls = policy_class(name)
    try:
        return cls()
    except Exception as e:  # noqa: BLE001 - a user's policy whose constructor fails
        raise ValueError(f"blockflow policy {name!r} could not be built: "
                         f"{type(e).__name__}: {e}") from None


def policy_error(name: str, dask_scheduler=None) -> str | None:
    """Why ``name`` gives no policy where this runs (the message of :func:`make_policy`'s
    ``ValueError``), or None: run on the scheduler (``client.run_on_scheduler``) before the
    plugin is registered, so that a dotted path the scheduler cannot import is one line."""
    try:
        make_policy(name)
    except ValueError as e:
        return str(e)
    return None
