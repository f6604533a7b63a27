"""The scheduling vocabulary: every action blockflow's scheduler side takes or logs.

A rule (:mod:`blockflow.scheduling.rules`) yields :class:`Decision` objects; each names one
:class:`Action`. :meth:`blockflow.scheduling.plugin.Rebalancer._apply` holds one handler per
action and is the only code that acts on the scheduler or writes the decision log, so the
dashboard, :func:`blockflow.decisions` and run reports read the same closed list: a new
action has to be added here, with its drawing on the dashboard
(:data:`blockflow.dashboard.page.ACTION_STYLES`), before anything can take it.

Also the names shared with the kernel layer: :data:`KERNEL_PREFIX`, the prefix of every
blockflow kernel task's name (:mod:`blockflow.blockwise` imports it from here, so that the
scheduler side imports nothing from the kernel layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["KERNEL_PREFIX", "Action", "Decision"]

#: Prefix of the names of blockflow's kernel tasks (``map_blocks`` and reductions).
KERNEL_PREFIX = "blockflow-"


class Action(str, Enum):
    """What a decision does (a ``str``: JSON, the status handler and ``==`` with plain
    strings keep working; ``Action("move")`` looks one up, an unknown name raises
    ``ValueError``).

    The first group changes the scheduler; the second only records what happened.
    """

    #: Pause a hot or nearly-full worker on the scheduler: it finishes what it runs and is
    #: given nothing new (``set_worker_status``; re-applied each tick until resumed).
    PAUSE = "pause"
    #: Lift blockflow's pause of a worker below the resume thresholds; its learned speed is
    #: reset (it is judged on what it does from now on).
    RESUME = "resume"
    #: A resume left to the worker: blockflow drops its pause, but the worker stays paused
    #: because its host memory is over the worker's own pause threshold.
    HANDOVER = "handover"
    #: Hold a slowed worker back from the scheduler's queue while the others empty it
    #: (paused on the scheduler like ``pause``). With ``keys`` and no ``worker``: hold
    #: producers back from the scheduler (admission control; not logged: ``admit`` is).
    HOLD = "hold"
    #: Lift a hold (the queue is empty or the others no longer empty it first). With
    #: ``keys`` and no ``worker``: release held producers (admission control; not logged).
    RELEASE = "release"
    #: Move a waiting, not-yet-started task to another worker (``target``).
    MOVE = "move"
    #: Pin blocks to one worker up front (static policies: a strict restriction).
    ASSIGN = "assign"
    #: Restrict blocks to the workers whose free device memory holds their working set.
    PLACE = "place"
    #: Start a backup copy of a straggling kernel task on an idle worker (``target``).
    SPECULATE = "speculate"
    #: Restrict the tasks of a new graph as their kernels asked (``resources=``,
    #: ``workers=``).
    RESTRICT = "restrict"
    #: Producers that feed resource-bound consumers were held back (admission control);
    #: they are released as their outputs fit the budget. Logs the ``hold`` and
    #: ``release`` of those tasks.
    ADMIT = "admit"
    #: Fail tasks waiting for worker resources no worker declares, after the timeout
    #: (:class:`~blockflow.errors.ResourceError`).
    FAIL = "fail"
    #: Suspend distributed's work stealing: worker speeds are known to differ and blockflow
    #: balances on them.
    BALANCE = "balance"
    #: Hand balancing back to distributed's work stealing (speeds not known to differ).
    DEFER = "defer"
    #: Park a worker of a pool the run's objective does not need now (cheaper pools meet
    #: it): paused on the scheduler, it finishes what it runs and takes nothing new.
    PARK = "park"
    #: Unpark a worker: its pool is needed (the plan gives it work), or no objective is on.
    UNPARK = "unpark"
    #: Retire an idle worker of a pool its elastic scaling shrinks (``target``: the pool):
    #: paused on the scheduler at once, then retired (``retire_workers``). Never a worker
    #: running or holding queued tasks, never another pool's.
    RETIRE = "retire"

    #: A logged non-decision: a condition seen but not acted on (the last usable worker is
    #: hot; blocks whose working set fits no worker).
    KEEP = "keep"
    #: Tasks started waiting for resources no worker declares (a WARNING, then ``fail``).
    WAIT = "wait"
    #: The outcome of a backup copy (``backup-won``, ``original-won``, ``failed``...).
    BACKUP = "backup"
    #: A result moved off a worker above the device-memory high-water mark (distributed's
    #: Active Memory Manager applies it; logged by the AMM policy).
    MEMORY_MOVE = "memory-move"
    #: A worker joined the cluster.
    JOIN = "join"
    #: A worker left the cluster (its pause, hold and speeds are forgotten).
    FORGET = "forget"
    #: The run's objective (cost by a deadline, makespan within a budget) can no longer be
    #: met: the new projected finish or cost (a WARNING too); the run goes on.
    OBJECTIVE = "objective"
    #: A pool's worker target changed (elastic scaling, ``PoolCluster.adapt``): ``target``
    #: is the pool, ``seen`` the target, the workers it has and the numbers behind it. The
    #: cluster starts the workers; shrinking is done by ``retire``.
    SCALE = "scale"

    def __str__(self) -> str:  # "move", not "Action.MOVE", in messages and f-strings
        return self.value


@dataclass
class Decision:
    """One action of a rule: what to do, to which worker, and why.

    Attributes
    ----------
    action : Action
        What to do (a plain string naming an :class:`Action` is converted).
    worker : str
        The worker acted on (for moves: the one the task leaves; ``""`` for cluster-wide
        actions).
    reason : str
    seen : dict
        The metrics the decision was based on (logged as ``seen_<name>``).
    target : str, optional
        For moves and backup copies: the receiving worker.
    key : optional
        For moves and backup copies: the task's key.
    keys : tuple
        For ``assign``, ``place``, ``restrict``, ``fail``, and the ``hold`` and ``release`` of
        tasks: the keys acted on.
    workers : tuple
        For ``place``: the workers the keys are restricted to (``worker`` is the first).
    detail : optional
        Action-specific payload for the handler (``fail``: the error message;
        ``restrict``: the placements to apply; the ``release`` of tasks: its stimulus id
        and whether it counts as released). Never logged.

    Raises
    ------
    ValueError
        If ``action`` names no :class:`Action`.
    """

    action: Action
    worker: str
    reason: str
    seen: dict[str, Any] = field(default_factory=dict)
    target: str | None = None
    key: Any = None
    keys: tuple = ()
    workers: tuple = ()
    detail: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self.action = Action(self.action)
