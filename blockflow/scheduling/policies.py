"""Scheduling policies: small classes that read a snapshot of the cluster and return decisions.

Modelled on distributed's Active Memory Manager policies: a policy never changes the
scheduler itself; :class:`~blockflow.scheduling.plugin.Rebalancer` applies what it returns
(through :mod:`blockflow._distributed`) and logs every decision with its reason and
the metrics it saw.

``dynamic``
    Keeps new work off hot or nearly-full GPUs (scheduler-side pause with hysteresis) and
    moves queued, not-yet-started tasks from the workers that will finish last to those that
    will be free soonest, when the gain beats the cost of moving the inputs.
``memory``
    An Active Memory Manager policy moving stored results off workers above the
    device-memory high-water mark.
``static-round-robin`` / ``static-capacity``
    Assign every blockflow block to a worker when the graph arrives: in turn, or in
    proportion to each worker's capacity (smooth weighted round robin).
``off``
    Observe only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator

from dask.utils import parse_timedelta

from blockflow import config
from blockflow import _distributed as adapter
from blockflow.metrics import CAPACITY_METRIC, WorkerMetrics, clean_number

__all__ = [
    "ClusterSnapshot",
    "Decision",
    "DynamicPolicy",
    "MemoryPolicy",
    "ObservePolicy",
    "RebalancePolicy",
    "StaticCapacityPolicy",
    "StaticRoundRobinPolicy",
    "WorkerView",
    "make_policy",
]


@dataclass
class WorkerView:
    """What the rebalancer knows about one worker at one tick.

    Attributes
    ----------
    address : str
    nthreads : int
    status : str
        Scheduler-side status name (``"running"``, ``"paused"``, ...).
    paused_by_blockflow : bool
        Paused by this plugin (it only ever resumes those).
    metrics : WorkerMetrics
        GPU utilisation (percent), device memory (bytes); None when unknown.
    speed : float
        Learned relative speed (1.0 = typical worker).
    processing : int
        Tasks assigned to the worker (running or waiting there).
    executing : int
        Tasks the worker reported running at its last heartbeat.
    occupancy : float
        Seconds of assigned work at the typical worker's speed (distributed's estimate,
        including moves in flight).
    host_memory_fraction : float or None
        Process memory / memory limit, 0-1.
    """

    address: str
    nthreads: int
    status: str
    paused_by_blockflow: bool
    metrics: WorkerMetrics
    speed: float
    processing: int
    executing: int
    occupancy: float
    host_memory_fraction: float | None = None
    ws: Any = field(default=None, repr=False, compare=False)

    @property
    def projected_finish(self) -> float:
        """Seconds until the worker finishes its assigned work at its learned speed."""
        return self.occupancy / (max(self.speed, 1e-6) * max(self.nthreads, 1))

    @property
    def others_utilization(self) -> float | None:
        """GPU utilisation (percent) taken by work other than this worker's own tasks.

        Utilisation minus the worker's own share: measured when the worker reports
        ``blockflow-gpu-own-utilization``; else, while it runs tasks, the share of its threads
        executing (a lower bound of others' load); exact when it is idle. None when
        utilisation is unknown.
        """
        util = self.metrics.gpu_utilization
        if util is None:
            return None
        own = self.metrics.own_utilization
        if own is None:
            busy = min(max(self.executing, 1 if self.processing else 0), self.nthreads)
            own = 100.0 * busy / max(self.nthreads, 1)
        return max(util - own, 0.0)

    def seen(self) -> dict[str, Any]:
        """The metrics a decision about this worker was based on (for the decision log)."""
        m = self.metrics
        return {
            "gpu_utilization": m.gpu_utilization,
            "gpu_memory_fraction": m.gpu_memory_fraction,
            "speed": round(self.speed, 4),
            "processing": self.processing,
            "projected_finish": round(self.projected_finish, 4),
        }


@dataclass
class ClusterSnapshot:
    """A tick's view of the cluster: workers and the scheduler's queue."""

    time: float
    workers: dict[str, WorkerView]
    queued: int
    scheduler: Any = field(default=None, repr=False)


@dataclass
class Decision:
    """One action of a policy. ``ts`` is the TaskState for moves (not logged)."""

    action: str  # "pause", "resume", "move", "memory-move", "assign", "keep"
    worker: str
    reason: str
    seen: dict[str, Any] = field(default_factory=dict)
    target: str | None = None
    key: str | None = None
    ts: Any = field(default=None, repr=False)


class RebalancePolicy:
    """Interface of a scheduling policy.

    ``decide`` runs every control-loop tick; ``assign`` runs when a graph arrives
    (``SchedulerPlugin.update_graph``), before its tasks are placed.
    """

    name = "base"
    #: Whether distributed's own (speed-blind) balancing loop should be suspended.
    replaces_work_stealing = False

    def decide(self, snapshot: ClusterSnapshot) -> list[Decision]:
        return []

    def assign(self, scheduler, keys: list, workers: dict[str, WorkerView]) -> list[Decision]:
        return []


class ObservePolicy(RebalancePolicy):
    """``off``: record metrics and decisions of others, change nothing."""

    name = "off"


class DynamicPolicy(RebalancePolicy):
    """Pause hot / nearly-full GPUs and move queued tasks to the workers that will be free first.

    Parameters
    ----------
    memory_high, memory_low : float, optional
        Device-memory fractions (0-1) at which a worker is paused / resumed (hysteresis).
    hot_high, hot_low : float, optional
        GPU utilisation (percent) by *other* work at which a worker is paused / resumed.
    move_budget : int, optional
        Most tasks moved per tick.
    min_gain : str or float, optional
        Smallest gain in projected finish time (seconds) worth a move.

    Notes
    -----
    Moves are a greedy list-scheduling repair (in the spirit of LPT, Graham 1969): take the
    worker whose projected finish ``occupancy / (speed x threads)`` is latest, offer its
    lowest-priority waiting task to the worker that would finish it soonest (including the
    time to move its inputs, bytes / measured bandwidth), and move it when that finishes
    earlier. While the scheduler still queues root tasks, every worker pulls more work as it
    frees up, so only tasks stuck on paused workers move. A task is never moved back to a
    worker it was moved off (unless it now sits on a paused worker): projected finishes are
    estimates that shift after every move, and without that rule a task on the margin
    bounces between two workers. A blockflow heuristic.
    """

    name = "dynamic"
    replaces_work_stealing = True

    def __init__(self, memory_high=None, memory_low=None, hot_high=None, hot_low=None,
                 move_budget=None, min_gain=None):
        self.memory_high = float(config.get("rebalancer.memory-high", memory_high))
        self.memory_low = float(config.get("rebalancer.memory-low", memory_low))
        self.hot_high = float(config.get("rebalancer.hot-high", hot_high))
        self.hot_low = float(config.get("rebalancer.hot-low", hot_low))
        self.move_budget = int(config.get("rebalancer.move-budget", move_budget))
        self.min_gain = parse_timedelta(config.get("rebalancer.move-min-gain", min_gain))
        # key -> workers the task was moved off; pruned of forgotten tasks as it grows
        self._moved_off: dict[Any, set[str]] = {}
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
        sched = snap.scheduler
        views = snap.workers
        thieves = [w for w in views.values()
                   if w.status == "running" and w.address not in paused_now]
        if not thieves or sched is None:
            return []
        blocked = {a for a, w in views.items() if w.status != "running" or a in paused_now}
        finish = {a: (math.inf if a in blocked else w.projected_finish)
                  for a, w in views.items()}
        rate = {a: max(w.speed, 1e-6) * max(w.nthreads, 1) for a, w in views.items()}
        if snap.queued:
            victims = [views[a] for a in blocked]  # the rest pull from the queue anyway
        else:
            victims = list(views.values())
        candidates: dict[str, Iterator] = {}
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
                it = candidates[v.address] = _waiting_tasks(v, sched)
            ts = next(it, None)
            if ts is None:
                exhausted.add(v.address)
                continue
            d = adapter.expected_duration(sched, ts)
            valid = adapter.valid_workers(sched, ts)
            left = () if v.address in blocked else self._moved_off.get(ts.key, ())
            best, best_finish = None, math.inf
            for t in thieves:
                if t is v or (valid is not None and t.ws not in valid) or t.address in left:
                    continue
                f = finish[t.address] + d / rate[t.address] + adapter.comm_cost(sched, ts, t.ws)
                if f < best_finish:
                    best, best_finish = t, f
            stay = finish[v.address]
            if best is None:
                continue
            gain = stay - best_finish
            if not gain > max(self.min_gain, 0.1 * d / rate[v.address]):
                exhausted.add(v.address)  # later tasks on this worker gain even less
                continue
            seen = v.seen()
            seen["input_bytes"] = sum(dts.nbytes for dts in ts.dependencies if dts.nbytes > 0)
            out.append(Decision(
                "move", v.address,
                f"projected finish {_fmt(stay)} here vs {_fmt(best_finish)} on target",
                seen, target=best.address, key=str(ts.key), ts=ts))
            self._moved_off.setdefault(ts.key, set()).add(v.address)
            if not math.isinf(finish[v.address]):
                finish[v.address] -= d / rate[v.address]
            finish[best.address] = best_finish
        if len(self._moved_off) > 10_000:
            self._moved_off = {k: w for k, w in self._moved_off.items() if k in sched.tasks}
        return out

    def decide(self, snapshot: ClusterSnapshot) -> list[Decision]:
        pauses = self.pauses(snapshot)
        paused_now = {d.worker for d in pauses if d.action == "pause"}
        return pauses + self.moves(snapshot, paused_now)


def _fmt(seconds: float) -> str:
    return "never (paused)" if math.isinf(seconds) else f"{seconds:.3f}s"


def _waiting_tasks(v: WorkerView, scheduler) -> Iterator:
    """Tasks on ``v`` that have not started, lowest priority (last to run) first."""
    ws = v.ws
    executing = ws.executing
    ordered = sorted(ws.processing, key=lambda ts: ts.priority or ())
    for ts in reversed(ordered[v.nthreads:]):
        if ts in executing or ts.actor or adapter.is_move_in_flight(scheduler, ts):
            continue
        if ts.processing_on is not ws:
            continue
        yield ts


class MemoryPolicy(RebalancePolicy):
    """``memory``: move stored results off workers above the device-memory high-water mark.

    Installs :class:`DeviceMemoryAMMPolicy` into distributed's Active Memory Manager, which
    replicates results to the workers with most free device memory and then drops them from
    the full worker (two AMM cycles). Tick decisions: none.
    """

    name = "memory"

    def __init__(self, memory_high=None, memory_low=None):
        self.memory_high = float(config.get("rebalancer.memory-high", memory_high))
        self.memory_low = float(config.get("rebalancer.memory-low", memory_low))


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


class StaticRoundRobinPolicy(RebalancePolicy):
    """``static-round-robin``: blockflow blocks go to workers in turn, fixed up front."""

    name = "static-round-robin"

    def weight(self, w: WorkerView) -> float:
        return 1.0

    def assign(self, scheduler, keys, workers):
        from dask.utils import key_split

        from blockflow.blockwise import KERNEL_PREFIX

        running = {a: w for a, w in sorted(workers.items()) if w.status == "running"}
        if not running:
            return []
        tasks = []
        for key in keys:
            ts = scheduler.tasks.get(key)
            if (ts is None or ts.state not in ("released", "waiting", "no-worker")
                    or ts.worker_restrictions or ts.host_restrictions
                    or ts.resource_restrictions or not ts.run_spec
                    or not key_split(key).startswith(KERNEL_PREFIX)):
                continue
            tasks.append(ts)
        if not tasks:
            return []
        rr = _SmoothWeightedRoundRobin({a: self.weight(w) for a, w in running.items()})
        counts: dict[str, int] = {}
        for ts in sorted(tasks, key=lambda t: _sort_key(t.key)):
            addr = next(rr)
            ts.worker_restrictions = {addr}
            ts.loose_restrictions = False
            counts[addr] = counts.get(addr, 0) + 1
        weights = {a: round(self.weight(w), 3) for a, w in running.items()}
        return [Decision("assign", a, f"{n} blocks assigned up front ({self.name}, weights "
                                      f"{weights})", {"weight": weights[a]})
                for a, n in counts.items()]


def _sort_key(key):
    return (key[0], *key[1:]) if isinstance(key, tuple) else (str(key),)


class StaticCapacityPolicy(StaticRoundRobinPolicy):
    """``static-capacity``: blocks assigned up front in proportion to worker capacity.

    Capacity is the ``blockflow-capacity`` worker metric when a worker reports one
    (simulated devices report their nominal speed), else the worker's thread count.
    """

    name = "static-capacity"

    def weight(self, w: WorkerView) -> float:
        metrics = getattr(w.ws, "metrics", None)
        cap = clean_number(metrics.get(CAPACITY_METRIC)) if isinstance(metrics, dict) else None
        return float(cap) if cap else float(max(w.nthreads, 1))


_POLICIES = {
    "dynamic": DynamicPolicy,
    "memory": MemoryPolicy,
    "static-round-robin": StaticRoundRobinPolicy,
    "static-capacity": StaticCapacityPolicy,
    "off": ObservePolicy,
}


def make_policy(name: str) -> RebalancePolicy:
    """The policy object for a policy name.

    Raises
    ------
    ValueError
        If ``name`` is unknown; the message lists the known names.
    """
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"Unknown blockflow policy {name!r}; choose one of {', '.join(_POLICIES)}."
        ) from None


def device_memory_amm_policy(memory_high: float, memory_low: float, log):
    """Build the Active Memory Manager policy used by ``memory`` (imported lazily).

    Parameters
    ----------
    memory_high, memory_low : float
        Device-memory fractions 0-1: act on workers at or above ``memory_high`` until they are
        projected below ``memory_low``.
    log : callable
        ``log(action, worker, reason, seen, key=None, target=None)`` for the decision log.
    """
    from distributed.active_memory_manager import ActiveMemoryManagerPolicy, Suggestion

    from blockflow.metrics import read_metrics

    class DeviceMemoryAMMPolicy(ActiveMemoryManagerPolicy):
        """Move stored results off workers above the device-memory high-water mark.

        Each AMM cycle: results on a full worker that already have a copy elsewhere are
        dropped from it; the others are replicated to workers below the low-water mark, to be
        dropped in the next cycle. Largest results first.
        """

        def run(self):
            workers = list(self.manager.scheduler.workers.values())
            views = {ws: read_metrics(ws.metrics) for ws in workers}
            roomy = {ws for ws, m in views.items() if ws.status.name == "running"
                     and m.gpu_memory_fraction is not None
                     and m.gpu_memory_fraction < memory_low}
            for ws, m in views.items():
                frac = m.gpu_memory_fraction
                if frac is None or frac < memory_high or not roomy:
                    continue
                to_free = m.gpu_memory_used - memory_low * m.gpu_memory_total
                seen = {"gpu_memory_fraction": frac}
                for ts in sorted(ws.has_what, key=lambda t: t.nbytes, reverse=True):
                    if to_free <= 0:
                        break
                    if any(other in roomy for other in ts.who_has if other is not ws):
                        choice = yield Suggestion("drop", ts, {ws})
                        if choice is not None:
                            to_free -= ts.nbytes
                            log("memory-move", ws.address, f"drop {ts.nbytes} B result now "
                                f"held elsewhere (device memory {frac:.0%})", seen,
                                key=str(ts.key))
                    else:
                        choice = yield Suggestion("replicate", ts, roomy - {ws})
                        if choice is not None:
                            to_free -= ts.nbytes
                            log("memory-move", ws.address, f"copy {ts.nbytes} B result off "
                                f"(device memory {frac:.0%} >= {memory_high:.0%})", seen,
                                key=str(ts.key), target=choice.address)

    return DeviceMemoryAMMPolicy()
