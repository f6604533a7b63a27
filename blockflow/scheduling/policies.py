"""Scheduling policies: small classes that read a plain-data snapshot and yield decisions.

Modelled on distributed's Active Memory Manager: every policy derives from
:class:`RebalancePolicy` and has one entry point, :meth:`RebalancePolicy.run`, which takes a
:class:`ClusterSnapshot` (plain data: worker views, waiting tasks, the tasks of a graph that
just arrived) and yields :class:`Decision` objects. A policy never touches a scheduler object;
:class:`~blockflow.scheduling.plugin.Rebalancer` applies the decisions (through
:mod:`blockflow._distributed`) and logs each one with its reason and the metrics it saw.
:data:`POLICIES` is the one registry of policy names: the plugin, the ``cluster.policy``
setting's allowed values, the CLI's ``--policy`` choices and the dashboard read it.

``dynamic``
    Keeps new work off hot or nearly-full GPUs (scheduler-side pause with hysteresis), places
    blocks that declared a device working set only where it fits, and, once worker speeds
    are known to differ, moves queued, not-yet-started tasks from the workers that will
    finish last to those that will be free soonest, when the gain beats the cost of moving
    the inputs.
``memory``
    :class:`DeviceMemoryAMMPolicy` in distributed's Active Memory Manager: moves stored
    results off workers above the device-memory high-water mark. It can also be named on its
    own in ``distributed.scheduler.active-memory-manager.policies`` as
    ``blockflow.scheduling.policies.DeviceMemoryAMMPolicy``.
``static-round-robin`` / ``static-capacity``
    Assign every blockflow block to a worker when the graph arrives: in turn, or in
    proportion to each worker's capacity (smooth weighted round robin).
``off``
    Observe only.
"""

from __future__ import annotations

import abc
import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from statistics import median
from typing import Any, ClassVar

from dask.utils import parse_timedelta

from blockflow import config
from blockflow._distributed import (
    AMMPolicy,
    HeldResult,
    MemorySuggestion,
    TaskView,
    WorkerView,
)
from blockflow.blockwise import KERNEL_PREFIX

__all__ = [
    "POLICIES",
    "ClusterSnapshot",
    "Decision",
    "DeviceMemoryAMMPolicy",
    "DynamicPolicy",
    "MemoryPolicy",
    "ObservePolicy",
    "RebalancePolicy",
    "StaticCapacityPolicy",
    "StaticRoundRobinPolicy",
    "TaskView",
    "WorkerView",
    "make_policy",
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
    event : {"tick", "graph"}
        ``"tick"``: a control-loop tick; ``"graph"``: a graph just arrived (``new_tasks``).
    waiting : mapping of str to iterable of TaskView
        Per worker, its tasks that have not started, lowest priority (last to run) first.
    new_tasks : list of TaskView
        On ``"graph"`` events, the tasks of the new graph.
    balancing : bool
        Whether worker speeds are known, with confidence, to differ: only then may a policy
        move work for speed (distributed's stealing balances otherwise).
    running : mapping of str to list of RunningTask
        Per worker, the tasks it runs now, with their elapsed time (from heartbeats).
    backups : mapping
        Task key -> the worker running its backup copy, for copies running now.
    bandwidth : float
        Worker-to-worker bandwidth estimate, bytes per second.
    held : frozenset of str
        Workers blockflow holds back from the scheduler's queue (see
        :meth:`DynamicPolicy.holds`).
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


@dataclass
class Decision:
    """One action of a policy.

    Attributes
    ----------
    action : str
        ``"pause"``, ``"resume"``, ``"move"``, ``"assign"``, ``"keep"`` (a logged
        non-decision), ``"memory-move"`` (logged by the AMM policy).
    worker : str
        The worker acted on (for moves: the one the task leaves).
    reason : str
    seen : dict
        The metrics the decision was based on (logged as ``seen_<name>``).
    target : str, optional
        For moves: the receiving worker.
    key : optional
        For moves: the task's key.
    keys : tuple
        For ``"assign"`` and ``"place"``: the keys pinned.
    workers : tuple
        For ``"place"``: the workers the keys are restricted to (``worker`` is the first).
    """

    action: str
    worker: str
    reason: str
    seen: dict[str, Any] = field(default_factory=dict)
    target: str | None = None
    key: Any = None
    keys: tuple = ()
    workers: tuple = ()


class RebalancePolicy(abc.ABC):
    """Interface of a scheduling policy (in the manner of distributed's AMM policies).

    Subclasses set :attr:`name` and implement :meth:`run`. The plugin calls ``run`` on every
    control-loop tick (``snapshot.event == "tick"``) and when a graph arrives
    (``"graph"``, before its tasks are placed) and applies what it yields.
    """

    #: Registry name (``blockflow.cluster.policy``).
    name: ClassVar[str] = ""
    #: Whether distributed's own (speed-blind) balancing loop should be suspended.
    replaces_work_stealing: ClassVar[bool] = False

    @abc.abstractmethod
    def run(self, snapshot: ClusterSnapshot) -> Iterator[Decision]:
        """Yield the decisions for this snapshot."""

    def amm_policies(self) -> list[AMMPolicy]:
        """Active Memory Manager policies to install beside this policy (default none)."""
        return []


class ObservePolicy(RebalancePolicy):
    """``off``: record metrics and decisions of others, change nothing."""

    name = "off"

    def run(self, snapshot: ClusterSnapshot) -> Iterator[Decision]:
        return iter(())


def _bytes(n: float) -> str:
    from dask.utils import format_bytes

    return format_bytes(int(n))


def _fmt(seconds: float) -> str:
    return "never (paused)" if math.isinf(seconds) else f"{seconds:.3f}s"


class DynamicPolicy(RebalancePolicy):
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
        see :meth:`holds`).

    Raises
    ------
    ValueError
        If a resume threshold is not below its pause threshold.

    Notes
    -----
    Moves are a greedy list-scheduling repair (in the spirit of LPT, Graham 1969): take the
    worker whose projected finish ``occupancy / (speed x threads)`` is latest, offer its
    lowest-priority waiting task to the worker that would finish it soonest (including the
    time to move its inputs, bytes / measured bandwidth), and move it when that finishes
    earlier. While the scheduler still queues root tasks, every worker pulls more work as it
    frees up: only tasks stuck on paused workers move. While worker speeds are not known
    with confidence to differ (``snapshot.balancing`` false), distributed's own stealing
    balances, and blockflow only fills the free threads of idle workers with tasks whose
    duration has been measured and whose inputs take at most
    :attr:`max_fill_transfer_share` of its compute to send (a cold start: inputs made on one
    worker), one task per free thread per tick. Speeds come shrunk by their confidence
    (:class:`~blockflow.scheduling.speed.SpeedModel`), so moves grow with what was measured.
    A balancing move must also be worth its data: its inputs' transfer time may be at most
    :attr:`max_transfer_share` of its compute time, and the gain must exceed twice that
    transfer, so data-heavy tasks on workers of the same speed stay with their data.

    Stragglers (:meth:`backups`): a task that already *runs* on a slow device cannot be
    moved; when a fast worker is idle, the running blockflow kernel task with the longest
    estimated time to end gets a backup copy there if that time exceeds
    :attr:`backup_ratio` times the copy's own (LATE, Zaharia et al. OSDI 2008, with
    blockflow's learned speeds in place of Hadoop's progress scores; see
    :mod:`blockflow.core.speculation` for how the first result wins).
    A task moves once between busy workers: projected finishes are estimates that shift
    after every move, and later ticks would otherwise chase a task from worker to worker (or
    bounce it between two). It moves again only to a worker with a free thread that it was
    never moved off (work stealing's rule: an idle thread gains for sure), or off a paused
    worker: a task moved early, onto a worker then believed fast, is not stranded there
    while the others idle. A blockflow heuristic.
    """

    name = "dynamic"
    replaces_work_stealing = True
    #: Tasks remembered as moved (oldest forgotten first).
    moved_memory = 10_000
    #: A balancing move's input transfer may take at most this share of the task's compute
    #: time on the target (distributed's stealing weighs transfer against compute the same
    #: way); tasks stuck on paused workers move whatever their inputs.
    max_transfer_share = 0.25
    #: The same bound while speeds are not known to differ (filling idle threads): only
    #: tasks whose inputs are cheap to send move then.
    max_fill_transfer_share = 0.05

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
        # median duration of the kernels running while root tasks are queued, since the
        # last graph arrived (see holds)
        self._hold_duration: float | None = None
        # key -> workers the task was moved off (bounded, oldest first out)
        self._moved_off: OrderedDict[Any, set[str]] = OrderedDict()
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

    def run(self, snapshot: ClusterSnapshot) -> Iterator[Decision]:
        if snapshot.event == "graph":
            self._hold_duration = None  # a new stage's kernels are measured afresh
            yield from self.placements(snapshot)
            return
        pauses = self.pauses(snapshot)
        yield from pauses
        paused_now = {d.worker for d in pauses if d.action == "pause"}
        holds = self.holds(snapshot, paused_now)
        yield from holds
        paused_now |= {d.worker for d in holds if d.action == "hold"}
        moves = self.moves(snapshot, paused_now)
        yield from moves
        # a thread a waiting task moves to this tick is not free for a copy
        yield from self.backups(snapshot, paused_now,
                                taken=frozenset(d.target for d in moves))

    # --- placement by working set -----------------------------------------------------

    def placements(self, snap: ClusterSnapshot) -> list[Decision]:
        """Restrict new tasks that declared a device working set to the running workers whose
        free device memory holds it (``map_blocks(working_set=)``).

        Nothing is restricted when every running worker fits, or when no worker reports
        device memory; when none fits, the task is left to run and fail with
        :class:`~blockflow.DeviceMemoryError` (logged as ``"keep"``). Workers that report no
        device memory are not counted as fitting once any worker reports it.
        """
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
                "place", workers[0], f"{len(keys)} blocks with a {_bytes(ws)} working set "
                f"placed on the {len(workers)} of {len(running)} workers whose free device "
                f"memory holds it", {**seen, "working_set": ws}, keys=tuple(keys),
                workers=workers))
        for ws, keys in nowhere.items():
            best = max(free, key=free.get)
            out.append(Decision(
                "keep", best, f"{len(keys)} blocks need a {_bytes(ws)} working set, more than "
                f"the free device memory of any worker (largest {_bytes(free[best])}): left "
                f"to run and fail with DeviceMemoryError", {**seen, "working_set": ws},
                keys=tuple(keys)))
        return out

    # --- pause / resume --------------------------------------------------------------

    def _pause_reason(self, w: WorkerView) -> str | None:
        mem = w.metrics.gpu_memory_fraction
        if mem is not None and mem >= self.memory_high:
            return f"device memory {mem:.0%} >= high-water {self.memory_high:.0%}"
        others = w.others_utilization
        if others is not None and others >= self.hot_high:
            return f"GPU {others:.0f}% busy with other work >= {self.hot_high:.0f}%"
        return None

    def _still_hot(self, w: WorkerView) -> bool:
        mem = w.metrics.gpu_memory_fraction
        others = w.others_utilization
        return (mem is not None and mem > self.memory_low) or (
            others is not None and others > self.hot_low)

    def pauses(self, snap: ClusterSnapshot) -> list[Decision]:
        """Pause and resume decisions (hysteresis; never the last usable worker)."""
        out = []
        usable = sum(w.status == "running" for w in snap.workers.values())
        for w in snap.workers.values():
            if w.paused_by_blockflow:
                if not self._still_hot(w):
                    mem, others = w.metrics.gpu_memory_fraction, w.others_utilization
                    out.append(Decision(
                        "resume", w.address,
                        f"below resume thresholds (device memory "
                        f"{'n/a' if mem is None else f'{mem:.0%}'} <= {self.memory_low:.0%}, "
                        f"other GPU work {'n/a' if others is None else f'{others:.0f}%'} "
                        f"<= {self.hot_low:.0f}%)", w.seen()))
                continue
            if w.status != "running":
                continue  # paused by the worker itself or closing: not ours to touch
            reason = self._pause_reason(w)
            if reason is None:
                continue
            if usable <= 1:
                out.append(Decision("keep", w.address,
                                    f"{reason}, but it is the last usable worker", w.seen()))
                continue
            usable -= 1
            out.append(Decision("pause", w.address, reason, w.seen()))
        return out

    # --- moves -----------------------------------------------------------------------

    def moves(self, snap: ClusterSnapshot, paused_now: set[str]) -> list[Decision]:
        """Moves of waiting tasks, latest projected finish first (see the class notes)."""
        views = snap.workers
        # a worker evidently slowed right now (see holds) takes no moved work
        thieves = [w for w in views.values()
                   if w.status == "running" and w.address not in paused_now
                   and not (self.speculation and self._slowed_now(snap, w.address))]
        if not thieves:
            return []
        blocked = {a for a, w in views.items() if w.status != "running" or a in paused_now}
        finish = {a: (math.inf if a in blocked else w.projected_finish)
                  for a, w in views.items()}
        rate = {a: max(w.speed, 1e-6) * max(w.nthreads, 1) for a, w in views.items()}
        # A backup copy runs outside the scheduler's count: its worker is busy for it.
        copying = set(snap.backups.values())
        for t in (t for tasks in snap.running.values() for t in tasks if t.key in snap.backups):
            target = snap.backups[t.key]
            if target in finish:
                finish[target] += t.duration / rate[target]
        # threads with nothing to run, as this tick's moves fill them
        free = {t.address: t.nthreads - t.processing for t in thieves
                if t.processing < t.nthreads and t.address not in copying}
        # Free thread slots of idle workers, filled while speeds are not known to differ.
        fill: dict[str, int] | None = None
        if snap.queued:
            victims = [views[a] for a in blocked]  # the rest pull from the queue
        elif snap.balancing:
            victims = list(views.values())
        else:
            # distributed's stealing balances; blockflow only hands measured work to idle
            # workers (stealing does too, but slowly: cold starts)
            victims = list(views.values())
            fill = dict(free)
        candidates: dict[str, Iterator[TaskView]] = {}
        out: list[Decision] = []
        exhausted: set[str] = set()
        while len(out) < self.move_budget:
            live = [v for v in victims if v.address not in exhausted
                    and v.processing > v.nthreads]
            if not live:
                break
            v = max(live, key=lambda w: finish[w.address])
            it = candidates.get(v.address)
            if it is None:
                it = candidates[v.address] = iter(snap.waiting.get(v.address, ()))
            task = next(it, None)
            if task is None:
                exhausted.add(v.address)
                continue
            d = task.duration
            rescue = v.address in blocked
            # moved before: estimates shift after every move, and chasing a task from busy
            # worker to busy worker only churns; it moves again only to a worker with a
            # free thread that it was never moved off (an idle thread gains for sure)
            moved_off = None if rescue else self._moved_off.get(task.key)
            if moved_off is not None and not any(
                    n > 0 and a not in moved_off for a, n in free.items()):
                continue
            if not rescue and fill is not None and not (task.duration_measured and fill):
                exhausted.add(v.address)  # nothing measured to hand out, or nobody idle
                continue
            best, best_finish = None, math.inf
            for t in thieves:
                if t is v or (
                        task.allowed_workers is not None and t.address not in task.allowed_workers):
                    continue
                if not rescue and fill is not None and t.address not in fill:
                    continue
                if moved_off is not None and (free.get(t.address, 0) <= 0
                                              or t.address in moved_off):
                    continue
                comm = task.comm_cost.get(t.address, 0.0)
                share = self.max_transfer_share if fill is None else self.max_fill_transfer_share
                if not rescue and comm > share * d / max(t.speed, 1e-6):
                    continue  # data-bound: balance by moving compute, not data
                f = finish[t.address] + d / rate[t.address] + task.comm_cost.get(t.address, 0.0)
                if f < best_finish:
                    best, best_finish = t, f
            stay = finish[v.address]
            if best is None:
                continue
            gain = stay - best_finish
            margin = max(self.min_gain, 0.1 * d / rate[v.address])
            if not rescue:  # the transfer must pay for itself twice over
                margin = max(margin, 2 * task.comm_cost.get(best.address, 0.0))
            if not gain > margin:
                exhausted.add(v.address)  # later tasks on this worker gain even less
                continue
            seen = v.seen()
            seen["input_bytes"] = task.input_bytes
            out.append(Decision(
                "move", v.address,
                f"projected finish {_fmt(stay)} here vs {_fmt(best_finish)} on target",
                seen, target=best.address, key=task.key))
            self._moved_off.setdefault(task.key, set()).add(v.address)
            self._moved_off.move_to_end(task.key)
            while len(self._moved_off) > self.moved_memory:
                self._moved_off.popitem(last=False)
            if not math.isinf(finish[v.address]):
                finish[v.address] -= d / rate[v.address]
            finish[best.address] = best_finish
            if best.address in free:
                free[best.address] -= 1
            if fill is not None and best.address in fill:
                fill[best.address] -= 1
                if fill[best.address] <= 0:
                    del fill[best.address]
        return out

    # --- holding slow workers back from the queue's last tasks ---------------------------

    def holds(self, snap: ClusterSnapshot, paused_now: set[str] = frozenset()
              ) -> list[Decision]:
        """Hold a slow worker back from the scheduler's queue while the others empty it.

        While root tasks are queued, distributed hands the next one to whichever thread
        frees first, the slowest worker's included: near the end of a stage, a slowed
        device then pulls a task it needs ``duration / speed`` for, long after the other
        workers have emptied the queue, and the stage waits for it. A running worker whose
        pessimistic speed (the lower of its learned speed, when its confidence is at least
        0.5, and the speed its latest task showed) is below ``1 /`` :attr:`hold_slowdown`
        (or one of its kernel tasks has run ``duration / elapsed`` times too long: a
        bound on its speed now) is held (paused on the scheduler: it finishes what it runs
        and takes nothing new) when its next task would end later than the other workers
        would finish the queue with that task added: ``busy + duration / speed > (queued + 1 +
        waiting) x duration / (their total speed)``, ``busy`` what its running kernel has
        left at that speed, ``waiting`` the tasks the others hold but have not started (with
        two tasks per thread on each worker, the queue alone undercounts their work: a
        worker was held two blocks too early, and the others ran one extra block each). It
        is released when the queue is empty or the condition no longer holds;
        its speed is not reset (it ran the same work). With backup copies off, nothing is
        held. LATE's rule of not launching work on slow nodes (Zaharia et al., OSDI 2008),
        applied to Dask's queue; a blockflow heuristic.
        """
        if not self.speculation:
            return []
        views = snap.workers
        out: list[Decision] = []
        durations = [t.duration for tasks in snap.running.values() for t in tasks
                     if t.kernel and t.duration_measured and t.duration > 0]
        # Between two kernels no worker may run one at a tick (short kernels, or their
        # input tasks running): the stage's kernel duration is kept while the queue lasts,
        # or a held worker would be released with the queue still full.
        if durations:
            self._hold_duration = median(durations)
        elif not snap.queued:
            self._hold_duration = None
        d = self._hold_duration
        for addr in sorted(snap.held):
            w = views.get(addr)
            if w is None:
                continue
            keep, seen = self._hold_condition(snap, addr, d, paused_now)
            if not keep:
                out.append(Decision("release", addr, "the queue is empty or the others no "
                                    "longer empty it before this worker's next task would "
                                    "end", seen))
        if not snap.queued or d is None:
            return out
        for addr, w in views.items():
            if addr in snap.held or addr in paused_now or w.status != "running":
                continue
            hold, seen = self._hold_condition(snap, addr, d, paused_now)
            if hold:
                out.append(Decision(
                    "hold", addr, f"its next task would take {_fmt(seen['own_time'])} here; "
                    f"the other workers empty the queue of {snap.queued} with it in "
                    f"{_fmt(seen['others_time'])}", seen))
        return out

    def _pessimistic_speed(self, snap: ClusterSnapshot, addr: str) -> float:
        """The lower of the learned speed (when confident), the speed of the latest task and
        the bound ``duration / elapsed`` of a kernel task overrunning its duration now."""
        w = snap.workers[addr]
        speed = w.speed if w.speed_confidence >= 0.5 else 1.0
        if w.recent_speed is not None:
            speed = min(speed, w.recent_speed)
        for t in snap.running.get(addr, ()):
            if t.kernel and t.duration_measured and t.elapsed > t.duration > 0:
                speed = min(speed, t.duration / t.elapsed)
        return speed

    def _slowed_now(self, snap: ClusterSnapshot, addr: str) -> bool:
        """Whether ``addr`` is evidently :attr:`hold_slowdown` times slower than typical
        now, by its pessimistic speed."""
        return self._pessimistic_speed(snap, addr) * self.hold_slowdown <= 1.0

    def _hold_condition(self, snap: ClusterSnapshot, addr: str, d: float | None,
                        paused_now) -> tuple[bool, dict]:
        w = snap.workers[addr]
        speed = self._pessimistic_speed(snap, addr)
        seen = w.seen()
        seen.update({"pessimistic_speed": round(speed, 4), "queued": snap.queued})
        if not snap.queued or d is None or speed * self.hold_slowdown > 1.0:
            return False, seen
        pool = [f for a, f in snap.workers.items()
                if a != addr and f.status == "running" and a not in paused_now
                and a not in snap.held and a not in w.device_peers]
        others = sum(max(f.speed, 1e-6) * max(f.nthreads, 1) for f in pool)
        if others <= 0:
            return False, seen
        # it takes its next task once its running kernel ends (at its speed now) ...
        busy = max((max(t.duration / max(speed, 1e-6) - t.elapsed, 0.0)
                    for t in snap.running.get(addr, ()) if t.kernel and t.duration_measured),
                   default=0.0)
        own = busy + d / max(speed, 1e-6)
        # ... while the others also run the tasks they hold but have not started
        waiting = sum(max(f.processing - f.executing, 0) for f in pool)
        theirs = (snap.queued + 1 + waiting) * d / others
        seen.update({"own_time": round(own, 4), "others_time": round(theirs, 4)})
        return own > theirs, seen

    # --- speculative backup copies ------------------------------------------------------

    def backups(self, snap: ClusterSnapshot, paused_now: set[str] = frozenset(),
                taken: frozenset = frozenset()) -> list[Decision]:
        """Backup copies of straggling kernel tasks on idle fast workers (LATE-style).

        A running blockflow kernel task on worker ``w`` is expected to take ``duration /
        speed(w)`` seconds (its group's measured duration at speed 1, and the lower of the
        worker's learned speed, shrunk by its confidence, and the speed its latest task
        showed: a device that just slowed is judged by what it just did, as LATE judges a
        task by its own progress); its estimated time to end is what remains of that, or,
        once it overran it, as long again as it has run (a heavy-tailed guess: the worker
        is slower than believed). The tasks with the longest times to end come first;
        copies start only once the scheduler holds no task back for a free thread (nothing
        queued: while it does, :meth:`holds` keeps a slowed worker from pulling the
        queue's last tasks), and never on a worker a waiting task moves to in the same tick
        (``taken``: new work before copies, as in LATE). Each task may get one copy, on the
        idle worker (a free thread, nothing waiting there) that would finish it soonest:
        its compute there plus sending inputs and result (bytes / bandwidth). A task
        waiting behind the straggler on its own worker does not hold a copy back: no idle
        worker would take it (stealing and moves leave tasks where their data is). The copy
        starts when the time to end exceeds :attr:`backup_ratio` times that, the task has
        run at least :attr:`backup_min_elapsed` of its group's duration, and fewer than
        :attr:`backup_slots` of all threads run copies. Knowing nothing (no measured
        duration), nothing is copied. A blockflow heuristic after LATE (Zaharia et al.,
        OSDI 2008) and MapReduce's backup tasks (Dean & Ghemawat, OSDI 2004).
        """
        if not self.speculation or not snap.running or snap.queued:
            return []
        views = snap.workers
        usable = {a: w for a, w in views.items()
                  if w.status == "running" and a not in paused_now}
        threads = sum(max(w.nthreads, 1) for w in usable.values())
        budget = max(1, int(self.backup_slots * threads)) - len(snap.backups)
        busy = set(snap.backups.values())  # running a copy, outside the scheduler's count
        idle = {a: w for a, w in usable.items()
                if w.processing < max(w.nthreads, 1) and a not in busy and a not in taken}
        if budget <= 0 or not idle:
            return []
        candidates = []
        for addr, tasks in snap.running.items():
            w = views.get(addr)
            if w is None:
                continue
            speed = w.speed if w.recent_speed is None else min(w.speed, w.recent_speed)
            for t in tasks:
                if not t.kernel or t.key in snap.backups or not t.duration_measured \
                        or t.duration <= 0 or t.elapsed < self.backup_min_elapsed * t.duration:
                    continue
                expected = t.duration / max(speed, 1e-6)
                left = expected - t.elapsed if t.elapsed < expected else t.elapsed
                candidates.append((left, expected, addr, t))
        out: list[Decision] = []
        for left, expected, addr, t in sorted(candidates, key=lambda c: -c[0]):
            if budget <= 0 or not idle:
                break
            peers = set(views[addr].device_peers) | {addr}
            best, best_time = None, math.inf
            for a, f in idle.items():
                if a in peers:
                    continue
                took = t.duration / max(f.speed, 1e-6) + 2 * t.input_bytes / max(
                    snap.bandwidth, 1.0)
                if took < best_time:
                    best, best_time = a, took
            if best is None or not left > self.backup_ratio * best_time:
                continue
            seen = views[addr].seen()
            seen.update({"elapsed": round(t.elapsed, 4), "expected": round(expected, 4),
                         "time_to_end": round(left, 4), "backup_time": round(best_time, 4),
                         "input_bytes": t.input_bytes})
            out.append(Decision(
                "speculate", addr, f"running {t.elapsed:.3f}s, estimated {_fmt(left)} to end "
                f"here vs {_fmt(best_time)} for a copy on the idle target", seen,
                target=best, key=t.key))
            del idle[best]
            budget -= 1
        return out


class DeviceMemoryAMMPolicy(AMMPolicy):
    """Active Memory Manager policy: move stored results off workers above the device-memory
    high-water mark.

    Each AMM cycle, results on a full worker that already have a copy on a roomy worker are
    dropped from it; the others are replicated to workers below the low-water mark, to be
    dropped in the next cycle. Largest results first. A blockflow heuristic on distributed's
    AMM (``distributed.active_memory_manager``).

    Parameters
    ----------
    memory_high, memory_low : float, optional
        Device-memory fractions 0-1: act on workers at or above ``memory_high`` until they are
        projected below ``memory_low``. Default ``blockflow.rebalancer.memory-high`` /
        ``memory-low``.

    Notes
    -----
    Installed by the ``memory`` policy, or on its own through distributed's configuration::

        distributed:
          scheduler:
            active-memory-manager:
              policies:
              - class: blockflow.scheduling.policies.DeviceMemoryAMMPolicy
    """

    def __init__(self, memory_high: float | None = None, memory_low: float | None = None):
        self.memory_high = float(config.get("rebalancer.memory-high", memory_high))
        self.memory_low = float(config.get("rebalancer.memory-low", memory_low))

    def __repr__(self) -> str:
        return f"DeviceMemoryAMMPolicy(memory_high={self.memory_high}, " \
               f"memory_low={self.memory_low})"

    def plan(self, workers: dict[str, WorkerView], held: Mapping[str, list[HeldResult]]):
        roomy = {a for a, w in workers.items() if w.status == "running"
                 and w.metrics.gpu_memory_fraction is not None
                 and w.metrics.gpu_memory_fraction < self.memory_low}
        for addr, w in workers.items():
            m = w.metrics
            frac = m.gpu_memory_fraction
            if frac is None or frac < self.memory_high or not roomy - {addr}:
                continue
            to_free = m.gpu_memory_used - self.memory_low * m.gpu_memory_total
            seen = {"gpu_memory_fraction": frac}
            for r in held.get(addr, ()):
                if to_free <= 0:
                    break
                if any(other in roomy for other in r.holders if other != addr):
                    chosen = yield MemorySuggestion("drop", r.key, frozenset({addr}))
                    if chosen is not None:
                        to_free -= r.nbytes
                        self.log("memory-move", addr, f"drop {r.nbytes} B result now held "
                                 f"elsewhere (device memory {frac:.0%})", seen, key=str(r.key))
                else:
                    chosen = yield MemorySuggestion("replicate", r.key, frozenset(roomy - {addr}))
                    if chosen is not None:
                        to_free -= r.nbytes
                        self.log("memory-move", addr, f"copy {r.nbytes} B result off (device "
                                 f"memory {frac:.0%} >= {self.memory_high:.0%})", seen,
                                 key=str(r.key), target=chosen)


class MemoryPolicy(RebalancePolicy):
    """``memory``: move stored results off workers above the device-memory high-water mark.

    Installs :class:`DeviceMemoryAMMPolicy` into distributed's Active Memory Manager, which
    replicates results to the workers with most free device memory and then drops them from
    the full worker (two AMM cycles). Tick decisions: none.

    Parameters
    ----------
    memory_high, memory_low : float, optional
        See :class:`DeviceMemoryAMMPolicy`.
    """

    name = "memory"

    def __init__(self, memory_high=None, memory_low=None):
        self.memory_high = float(config.get("rebalancer.memory-high", memory_high))
        self.memory_low = float(config.get("rebalancer.memory-low", memory_low))

    def run(self, snapshot: ClusterSnapshot) -> Iterator[Decision]:
        return iter(())

    def amm_policies(self) -> list[AMMPolicy]:
        return [DeviceMemoryAMMPolicy(self.memory_high, self.memory_low)]


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


class StaticRoundRobinPolicy(RebalancePolicy):
    """``static-round-robin``: blockflow blocks go to workers in turn, fixed up front.

    When a graph arrives, each blockflow kernel task that is not yet assigned and carries no
    user restriction is pinned to one running worker (strict restriction), in key order.
    Smooth weighted round robin (as in nginx) with equal weights.
    """

    name = "static-round-robin"

    def weight(self, w: WorkerView) -> float:
        """Relative share of blocks for ``w`` (1 for every worker here)."""
        return 1.0

    def run(self, snapshot: ClusterSnapshot) -> Iterator[Decision]:
        if snapshot.event != "graph":
            return
        running = {a: w for a, w in sorted(snapshot.workers.items()) if w.status == "running"}
        tasks = [t for t in snapshot.new_tasks
                 if t.state in ("released", "waiting", "no-worker") and not t.restricted
                 and t.runnable and t.group.startswith(KERNEL_PREFIX)]
        if not running or not tasks:
            return
        rr = _SmoothWeightedRoundRobin({a: self.weight(w) for a, w in running.items()})
        assigned: dict[str, list] = {}
        for t in sorted(tasks, key=lambda t: _sort_key(t.key)):
            assigned.setdefault(next(rr), []).append(t.key)
        weights = {a: round(self.weight(w), 3) for a, w in running.items()}
        for a, keys in assigned.items():
            yield Decision("assign", a, f"{len(keys)} blocks assigned up front ({self.name}, "
                                        f"weights {weights})", {"weight": weights[a]},
                           keys=tuple(keys))


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

config.set_choices("cluster.policy", POLICIES)


def make_policy(name: str) -> RebalancePolicy:
    """The policy object for a policy name.

    Raises
    ------
    ValueError
        If ``name`` is unknown; the message lists the known names.
    """
    try:
        cls = REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown blockflow policy {name!r}; choose one of {', '.join(POLICIES)}."
        ) from None
    return cls()
