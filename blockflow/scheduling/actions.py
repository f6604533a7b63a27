"""The scheduling vocabulary: commands that act on the scheduler, records of what happened.

Rules yield :class:`Decision` (one :class:`Action`) and :class:`Record` (one
:class:`Recorded`); only the actuator (:mod:`blockflow.scheduling.actuator`) acts, and
records are only logged. Guide: :doc:`/guide/scheduling`, "Decisions".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["KERNEL_PREFIX", "PROBE_PREFIX", "Action", "Decision", "Record", "Recorded"]

#: Prefix of the names of blockflow's kernel tasks (``map_blocks`` and reductions).
KERNEL_PREFIX = "blockflow-"
#: Prefix of the keys of blockflow's per-task overhead probe
#: (:func:`blockflow.scheduling.view.task_overheads`): blockflow's own no-op tasks, never
#: counted as the user's (no run, task count, speed or billed time).
PROBE_PREFIX = "overhead-probe"


class Action(str, Enum):
    """A command: what a :class:`Decision` makes the scheduler do.

    A ``str``; ``Action("move")`` looks one up, an unknown name raises ``ValueError``.
    """

    #: Pause a hot or nearly-full worker on the scheduler (re-applied each tick until
    #: resumed).
    PAUSE = "pause"
    #: Lift blockflow's pause of a worker; its learned speed is reset.
    RESUME = "resume"
    #: Hold a slowed worker back from the queue (paused on the scheduler). With ``keys``
    #: and no ``worker``: hold producers back (admission control; not logged).
    HOLD = "hold"
    #: Lift a hold. With ``keys`` and no ``worker``: release held producers (not logged).
    RELEASE = "release"
    #: Move a waiting, not-yet-started task to another worker (``target``).
    MOVE = "move"
    #: Pin blocks to one worker up front (static policies: a strict restriction).
    ASSIGN = "assign"
    #: Restrict blocks to the workers whose free device memory holds their working set.
    PLACE = "place"
    #: Start a backup copy of a straggling kernel task on an idle worker (``target``).
    SPECULATE = "speculate"
    #: Restrict the tasks of a new graph as their kernels asked (``resources=``, ``workers=``).
    RESTRICT = "restrict"
    #: Fail tasks no worker can run (:class:`~blockflow.errors.ResourceError`) or that an
    #: objective refuses.
    FAIL = "fail"
    #: Suspend distributed's work-stealing loop: worker speeds are known to differ.
    SUSPEND_STEALING = "suspend-stealing"
    #: Restore distributed's work-stealing loop (speeds not known to differ).
    RESTORE_STEALING = "restore-stealing"
    #: Send held tasks to the workers a run's plan chose (``detail``: key -> worker; not
    #: logged).
    DISPATCH = "dispatch"
    #: Retire an idle worker of a pool its elastic scaling shrinks (``target``: the pool).
    RETIRE = "retire"
    #: Pause again a worker blockflow paused or held whose own status message set
    #: it running (not logged).
    REAPPLY = "reapply"

    def __str__(self) -> str:  # "move", not "Action.MOVE"
        return self.value


class Recorded(str, Enum):
    """What a :class:`Record` says happened: logged and drawn, never acted on."""

    #: A resume left to the worker: its host memory is over its own pause threshold.
    HANDOVER = "handover"
    #: Producers feeding resource-bound consumers were held back (admission control).
    ADMIT = "admit"
    #: A condition seen but not acted on (the last usable worker is hot; blocks whose
    #: working set fits no worker; a move refused for its transfer).
    KEEP = "keep"
    #: Tasks started waiting for resources no worker declares (a WARNING, then ``fail``).
    WAIT = "wait"
    #: The outcome of a backup copy (``backup-won``, ``original-won``, ``failed``...).
    BACKUP = "backup"
    #: A result copied or dropped by the device-memory AMM policy (distributed's Active
    #: Memory Manager applies it).
    MEMORY_MOVE = "memory-move"
    #: A worker joined the cluster.
    JOIN = "join"
    #: A worker left the cluster (its pause, hold and speeds are forgotten).
    FORGET = "forget"
    #: The run's objective can no longer be met (a WARNING too); the run goes on.
    OBJECTIVE = "objective"
    #: A pool's worker target changed (elastic scaling): ``target`` is the pool.
    SCALE = "scale"
    #: A run ended: its device seconds on a GPU worker against its wall time and task
    #: compute time there (:mod:`blockflow.scheduling.device_time`).
    DEVICE_TIME = "device-time"

    def __str__(self) -> str:
        return self.value


@dataclass
class _Entry:
    action: Any
    worker: str
    reason: str
    seen: dict[str, Any] = field(default_factory=dict)
    target: str | None = None
    key: Any = None
    keys: tuple = ()
    workers: tuple = ()
    detail: Any = field(default=None, repr=False, compare=False)


@dataclass
class Decision(_Entry):
    """A command of a rule: what to do, to which worker, and why.

    Attributes
    ----------
    action : Action
        What to do (a plain string is converted).
    worker : str
        The worker acted on (a move's source; ``""`` cluster-wide).
    reason : str
    seen : dict
        The metrics it was based on (logged as ``seen_<name>``).
    target, key : optional
        Moves and backup copies: the receiving worker and the task's key.
    keys, workers : tuple
        The keys acted on; for ``place``, the workers they are restricted to.
    detail : optional
        Payload for the handler; never logged.

    Raises
    ------
    ValueError
        If ``action`` names no :class:`Action`.
    """

    def __post_init__(self):
        self.action = Action(self.action)


@dataclass
class Record(_Entry):
    """What happened, for the decision log only; fields as :class:`Decision`
    (``detail={"warning": True}`` on ``objective`` logs a WARNING).

    Raises
    ------
    ValueError
        If ``action`` names no :class:`Recorded`.
    """

    def __post_init__(self):
        self.action = Recorded(self.action)
