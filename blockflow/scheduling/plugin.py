"""blockflow's scheduler plugin: O(1) hooks on the scheduler and a control loop.

In the manner of distributed's stealing and Active Memory Manager extensions: each tick
(``blockflow.rebalancer.interval``) takes a
:class:`~blockflow.scheduling.policies.ClusterSnapshot`, runs the policy's rules and hands
what they yield to the :class:`~blockflow.scheduling.actuator.Actuator`. Guide:
:doc:`/guide/scheduling`.
"""

from __future__ import annotations

import gc
import itertools
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import dask.config
from dask.utils import parse_timedelta
from distributed.diagnostics.plugin import SchedulerPlugin

from blockflow import _distributed, config
from blockflow.pools import plan as cost
from blockflow.pools.pool import pools_of
from blockflow.pools.scaling import PoolScalingRule
from blockflow.scheduling.accounting import Accounting
from blockflow.scheduling.actions import PROBE_PREFIX, Action, Decision, Record, Recorded
from blockflow.scheduling.actuator import Actuator
from blockflow.scheduling.device_time import DeviceTime
from blockflow.scheduling.estimate import LinkBandwidth
from blockflow.scheduling.overhead import PluginCost, clock, cpu_clock
from blockflow.scheduling.policies import POLICIES, ClusterSnapshot, make_policy, policy_class
from blockflow.scheduling.status import Status

__all__ = ["POLICIES", "Rebalancer"]

#: Transitions of a tracked producer or consumer after which admission control looks again.
_ADMISSION_EVENTS = frozenset({"memory", "released", "forgotten", "erred"})


class Rebalancer(Accounting, Actuator, Status, SchedulerPlugin):
    """Scheduler plugin that places and moves tasks from GPU metrics and learned speed.

    Registered by :func:`blockflow.connect` or ``--preload blockflow.scheduling.preload``.

    Parameters
    ----------
    policy : str, optional
        A name of :data:`blockflow.scheduling.policies.POLICIES` or a dotted path; default
        ``blockflow.cluster.policy``.
    interval : str or float, optional
        Control loop period; default ``blockflow.rebalancer.interval``; 0 disables the loop.

    Raises
    ------
    ValueError
        If ``policy`` names no policy.
    """

    name = "blockflow-rebalancer"
    idempotent = True

    def __init__(self, policy: str | None = None, interval: str | float | None = None):
        policy = config.get("cluster.policy", policy)
        if "." not in str(policy):  # a built-in name fails here, before anything starts;
            policy_class(policy)  # a dotted path is checked where the scheduler runs
        self.policy_name = policy
        self.interval = parse_timedelta(config.get("rebalancer.interval", interval))
        self.decision_log_size = int(config.get("rebalancer.decision-log-size"))
        self._init_state()

    def _init_state(self) -> None:
        # Called on the scheduler too: the plugin travels pickled, state starts fresh.
        self.scheduler = None
        self.policy = None
        self._registered = False
        self._init_accounting()
        self.memory_peak: dict[str, float] = {}  # worker -> device bytes, highest seen
        self.paused: dict[str, str] = {}  # worker -> reason, for pauses this plugin made
        self.held: dict[str, str] = {}  # worker -> reason: held back from the queue
        self.retiring: dict[str, str] = {}  # worker -> its name, retired, not gone yet
        self.decisions: deque[dict[str, Any]] = deque(maxlen=self.decision_log_size)
        self.ticks = 0
        self.moves_requested = 0
        self._stealing = None
        self._host_pause_fraction: float | None = None
        self._worker_checked = False
        # the policy's rules the plugin runs at their own moments (set in start())
        self.stealing_rule = self.kernel_placement = self.unsatisfiable = self.admission = None
        self._placed_now: set = set()  # keys the last "restrict" command restricted
        self.backups: dict[Any, dict[str, Any]] = {}  # key -> backup copy running now
        self.speculation: Counter[str] = Counter(launched=0, duplicated_seconds=0.0,
                                                 saved_seconds=0.0)
        self._admission_kick = False  # an "admit" snapshot is scheduled
        self._dispatch_kick = False  # a plan dispatch is scheduled
        self.cost = PluginCost()  # the plugin's own time on the scheduler's event loop
        self._last_snap: ClusterSnapshot | None = None  # the last tick's (for status())
        self._view_cache = _distributed.WorkerViewCache()  # the ticks' worker views
        self._links: LinkBandwidth | None = None  # measured links, kept across ticks
        self.scaling = PoolScalingRule()
        self.declared_pools: dict = {}  # pool name -> Pool, declared by the cluster
        self.device_time = DeviceTime()  # GPU workers' device seconds against wall time

    def __getstate__(self):
        return {"policy_name": self.policy_name, "interval": self.interval,
                "decision_log_size": self.decision_log_size}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_state()

    async def start(self, scheduler) -> None:
        config.validate()  # settings are checked where they are used, never at import
        _distributed.check_scheduler(scheduler)
        self._worker_checked = bool(_distributed.worker_addresses(scheduler))
        self.scheduler = scheduler
        self.policy = policy = make_policy(self.policy_name)
        self.stealing_rule, self.kernel_placement = policy.stealing_rule, policy.kernel_placement
        self.unsatisfiable, self.admission = policy.unsatisfiable, policy.admission
        _distributed.add_handler(scheduler, "blockflow_status", self.status)
        _distributed.add_handler(scheduler, "blockflow_pool_targets", self.pool_targets)
        for amm_policy in policy.amm_policies():
            _distributed.add_amm_policy(scheduler, amm_policy)
        for worker_plugin in policy.worker_plugins():  # each worker bounded, one not answering named
            await _distributed.register_worker_plugin_on_scheduler(
                scheduler, worker_plugin, worker_plugin.name, idempotent=True,
                timeout=parse_timedelta(config.get("cluster.worker-call-timeout")))
        # A first tick now, so hot or full workers are paused before the first graph lands.
        self.run_once()
        # distributed registers a plugin right after its start(): later ticks check it still is
        self._registered = True
        if self.interval > 0:
            _distributed.add_periodic_callback(scheduler, self.name, self.run_once,
                                               self.interval)

    async def close(self) -> None:
        self.flush_finished()
        self._detach()

    def _detach(self) -> None:
        """Stop the loop and hand back what the plugin holds (stealing, held workers and
        producers): at close, or at the first tick after the plugin was unregistered."""
        if self.scheduler is None or self.policy is None:
            return
        _distributed.remove_periodic_callback(self.scheduler, self.name)
        # nothing stays suspended or held back without the plugin (not logged)
        snap = ClusterSnapshot(time=time.time(), workers=self._views())
        self.apply(Decision(Action.RESTORE_STEALING, "", "plugin closing"), snap, log=False)
        if self.admission is not None:
            self._run_admission("close", workers={})
        for addr in list(self.held):
            self.apply(Decision(Action.RELEASE, addr, "plugin closing"), snap, log=False)
            self.held.pop(addr, None)
        objective = self.policy.objective
        if objective is not None:  # a run's held tasks go back to distributed's placement
            for d in objective._release(objective.dispatch, "plugin closing"):
                self.apply(d, snap, log=False)
            objective.dispatch = None
        self.policy = None  # no tick acts any more

    def act(self, items: Iterable[Decision | Record], snap=None) -> list:
        """Apply the commands and log the records ``items`` yields; those that took effect."""
        done = []
        for d in items:
            if self.record(d, snap) if type(d) is Record else self.apply(d, snap):
                done.append(d)
        return done

    # --- hooks: keep them O(1) -----------------------------------------------------------

    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs) -> None:
        # Fast path, first: of a task's ~5 transitions only its end (processing -> memory),
        # its forgetting and, for the few keys admission control watches, the events that
        # free room in its budget need anything; the rest return here, untimed.
        if finish == "processing" or finish == "no-worker":
            self._started(key, finish)
            return
        if finish != "forgotten" and finish != "erred" and (finish != "memory"
                                                            or start != "processing"):
            admission = self.admission
            if admission is None or finish not in _ADMISSION_EVENTS \
                    or not admission.watches(key):
                return
        cost = self.cost
        if not cost.sampled():
            t0 = clock()
            try:
                self._transition(key, start, finish, kwargs)
            finally:
                cost.hooks += clock() - t0
        else:
            t0, c0 = clock(), cpu_clock()
            try:
                self._transition(key, start, finish, kwargs)
            finally:
                cost.hook_cpu_sampled += cpu_clock() - c0
                cost.hook_samples += 1
                cost.hooks += clock() - t0
        if len(self._finished) >= self.max_queued:  # bounded with the loop off (interval=0)
            self.flush_finished()

    def _transition(self, key, start, finish, kwargs) -> None:
        # Only what may be gone later is read here (the task's facts; where its inputs are);
        # the rest waits in the queue for flush_finished.
        if self.admission is not None and self.admission.watches(key) \
                and finish in _ADMISSION_EVENTS:
            self._kick_admission()
        dispatch = self._plan_dispatch()
        if dispatch is not None and finish in ("forgotten", "memory", "erred"):
            dispatch.forget(key)
            self._kick_dispatch()
        if finish == "forgotten" or finish == "erred":
            self._started_inputs.pop(key, None)
            self._finished.append((key, None) if finish == "forgotten"
                                  else (key, None, time.time()))
            return
        if start != "processing" or finish != "memory":
            return
        worker = kwargs.get("worker")
        if worker is None:
            return
        if self._multi_provider:
            self.record_inputs(key, worker)
        # one flat tuple of strings and numbers (not the message's dicts)
        self._finished.append(_distributed.finished_task_record(
            self.scheduler, key, worker, kwargs.get("startstops"), kwargs.get("metadata")))

    def _started(self, key, finish: str) -> None:
        """A task started processing (its inputs' crossings are counted) or, held for a plan,
        became ready (a dispatch is due)."""
        if finish == "processing":
            if self._multi_provider:
                self.note_inputs(key)
            return
        dispatch = self._plan_dispatch()
        if dispatch is not None and dispatch.became_ready(key):
            self._kick_dispatch()

    def _plan_dispatch(self):
        """The objective rule's :class:`~blockflow.pools.dispatch.PlanDispatch`, or None."""
        objective = self.policy.objective if self.policy is not None else None
        return objective.dispatch if objective is not None else None

    def _kick_dispatch(self) -> None:
        """Dispatch held tasks on the event loop soon, coalesced (hooks change no state)."""
        if self._dispatch_kick:
            return
        self._dispatch_kick = True

        def run():
            self._dispatch_kick = False
            self._dispatch()

        _distributed.call_soon(self.scheduler, run)

    def _dispatch(self) -> None:
        """Send the ready held tasks the plan places on the free threads now."""
        dispatch = self._plan_dispatch()
        if dispatch is None or not any(dispatch.ready.values()):
            return
        chosen = dispatch.choose(_distributed.free_slots(self.scheduler), self._pools,
                                 time.time())
        if chosen:
            self.apply(Decision(Action.DISPATCH, "", "tasks placed by the plan",
                                keys=tuple(chosen), detail=chosen), log=False)

    def update_graph(self, scheduler, *, client=None, keys=None, tasks=None, annotations=None,
                     **kwargs) -> None:
        self.flush_finished()  # runs.graph reads the runs' pending keys (timed itself)
        cost = self.cost
        t0, c0 = clock(), cpu_clock()
        w0, f0 = cost.flush_wall, cost.flush_cpu
        try:
            self._update_graph(scheduler, client, tasks, annotations)
        finally:
            # a flush inside (tasks finished meanwhile) timed itself: not counted twice
            cost.graph_cpu += cpu_clock() - c0 - (cost.flush_cpu - f0)
            cost.hooks += clock() - t0 - (cost.flush_wall - w0)

    def _update_graph(self, scheduler, client, tasks, annotations) -> None:
        if tasks and all(isinstance(k, str) and k.startswith(PROBE_PREFIX) for k in tasks):
            return  # blockflow's overhead probe: not a run of the user's, nothing to decide
        run = self.runs.graph(client=client,
                              states=_distributed.task_states(scheduler, tasks or ()),
                              annotations=annotations or {}, now=time.time())
        if self._group_inputs and run is not None and tasks:
            self.new_run_inputs(run.id, tasks)
        if self.policy is None or not tasks:
            return
        new_tasks = self._resources_on_graph(scheduler, list(tasks), client)
        views = self._views()
        run = run if run is not None and run.objective is not None else None  # its own run's
        snap = ClusterSnapshot(time=time.time(), workers=views, event="graph",
                               new_tasks=new_tasks, run=run,
                               declared_pools=dict(self.declared_pools),
                               throughput=self._throughput(views) if run else {})
        self.act(self.policy.run(snap), snap)

    def add_worker(self, scheduler, worker) -> None:
        if not self._worker_checked and self.scheduler is not None:
            # a scheduler started with --preload has no worker when the plugin starts
            self._worker_checked = True
            _distributed.check_scheduler(scheduler)
        self.worker_arrived(worker, time.time())  # billed, and kept its hold, from now
        self.record(Record(Recorded.JOIN, worker, "worker joined the cluster"))

    def remove_worker(self, scheduler, worker, *, stimulus_id=None, **kwargs) -> None:
        if self._last_snap is not None:
            self._last_snap.workers.pop(worker, None)
        self.speeds.forget(worker)
        self.scaling.forget(worker)
        self.device_time.forget(worker)
        self.retiring.pop(worker, None)
        self.worker_left(worker, time.time())
        dispatch = self._plan_dispatch()
        if dispatch is not None:  # its planned tasks wait for the plan again
            ready = _distributed.rehold_tasks(scheduler, dispatch.lost(worker))
            dispatch.hold(list(ready), ready)
            self._kick_dispatch()
        was_paused = self.paused.pop(worker, None)
        self.held.pop(worker, None)
        self.record(Record(Recorded.FORGET, worker, "worker left the cluster"
                           + (" (it was paused by blockflow)" if was_paused else "")))

    # --- worker resources: placement, unsatisfiable tasks, admission control ----------

    def _resources_on_graph(self, scheduler, keys: list, client=None) -> list:
        """New tasks: restrict them as their kernels asked, then hold back feeders of
        resource-restricted consumers (three snapshots: ``restrict``, ``hold``, ``release``).
        """
        views = _distributed.new_task_views(scheduler, keys)
        snap = ClusterSnapshot(time=time.time(), workers={}, event="graph", new_tasks=views)
        self._placed_now = set()
        self.act(self.kernel_placement.run(snap, None), snap)
        if self._placed_now:  # restricted here: the policy's rules leave them alone
            views = [replace(v, restricted=True)
                     if v.key in self._placed_now and not v.restricted else v for v in views]
        if self.admission.enabled and keys:
            feeders = _distributed.feeder_tasks(scheduler, keys,
                                                expect=self.admission.expected(client))
            graph = ClusterSnapshot(time=time.time(), workers={}, event="graph",
                                    new_tasks=views, feeders=feeders, client=client)
            self.act(self.admission.run(graph, None), graph)
            self._run_admission("held")
        return views

    def _run_admission(self, event: str, workers=None) -> None:
        """Run the admission rule on a ``"held"``, ``"admit"`` or ``"close"`` snapshot."""
        snap = ClusterSnapshot(time=time.time(),
                               workers=self._views() if workers is None else workers,
                               event=event,
                               feeder_states=_distributed.feeder_state_view(self.scheduler))
        self.act(self.admission.run(snap, None), snap)

    def _kick_admission(self) -> None:
        """Run the admission rule on the event loop soon, coalesced (hooks change no state)."""
        if self._admission_kick or not self.admission.holding:
            return
        self._admission_kick = True

        def run():
            self._admission_kick = False
            self._run_admission("admit")

        _distributed.call_soon(self.scheduler, run)

    # --- control loop -----------------------------------------------------------------

    def _views(self, previous=None):
        return _distributed.worker_views(self.scheduler, speed=self.speeds.speed,
                                         confidence=self.speeds.confidence,
                                         paused=self.paused,
                                         recent_speed=self.speeds.recent_speed,
                                         slow_for=self.speeds.slow_for,
                                         previous=previous)

    def _running(self, now: float) -> dict:
        """The running tasks, durations scaled by their size factor."""
        running = _distributed.running_tasks(self.scheduler, now)
        factor = self.speeds.size_factor
        for tasks in running.values():
            for i, t in enumerate(tasks):
                f = factor(t.group, t.size)
                if f != 1.0:
                    tasks[i] = replace(t, duration=t.duration * f)
        return running

    def take_snapshot(self) -> ClusterSnapshot:
        """The plugin's view of the cluster now (speeds updated first); plain data."""
        self.speeds.update()
        self._host_pause_fraction = dask.config.get("distributed.worker.memory.pause")
        views = self._views(self._view_cache)
        thieves = [a for a, w in views.items() if w.status == "running"]
        stopped = self._stopped(views)
        now = time.time()
        # moves price a task's inputs over the links they would cross, as measured
        if self._links is None:
            self._links = LinkBandwidth(_distributed.measured_bandwidth(self.scheduler),
                                        _distributed.bandwidth(self.scheduler))
        links = self._links
        links.default = _distributed.bandwidth(self.scheduler) or links.default
        # the balancing rule reads the strict test while it is off, the weak one while on
        active = self.stealing_rule is not None and self.stealing_rule.active
        snap = ClusterSnapshot(time=now, workers=views,
                               queued=_distributed.queued_count(self.scheduler),
                               waiting=_distributed.waiting_tasks(
                                   self.scheduler, thieves=thieves, stopped=stopped,
                                   links=links),
                               stopped=stopped,
                               running=self._running(now),
                               backups={k: b["target"] for k, b in self.backups.items()},
                               bandwidth=_distributed.bandwidth(self.scheduler),
                               held=frozenset(self.held),
                               speeds_differ=not active and self.speeds.heterogeneous(thieves),
                               speeds_differ_weakly=active and self.speeds.heterogeneous(
                                   thieves, min_ratio=1.15, z=1.64),
                               unsatisfiable=_distributed.unsatisfiable_tasks(self.scheduler),
                               monotonic=time.monotonic(),
                               changed=self._view_cache.changed)
        snap.balancing = (self.stealing_rule.judge(snap) if self.stealing_rule is not None
                          else snap.speeds_differ)
        self.set_pools(pools_of(views), now)
        snap.lifetimes = self.lifetimes
        snap.declared_pools = dict(self.declared_pools)
        snap.run = self._objective_run()
        if snap.run is not None:
            snap.throughput = self._throughput(views)
            snap.inputs = {g: {p: b / max(n, 1) for p, b in by.items()}
                           for g, (n, by, _) in self.group_inputs.items()}
            snap.inputs.update(self._ready_inputs())
        return snap

    def _ready_inputs(self, sample: int = 16) -> dict[str, dict[str, float]]:
        """Group -> sending pool -> input bytes per task, read off up to ``sample`` held
        tasks per group that are ready (their inputs exist: where they are is known before
        any of them runs)."""
        dispatch = self._plan_dispatch()
        if dispatch is None:
            return {}
        pools = self._pools
        out = {}
        for group, ready in dispatch.ready.items():
            keys = list(itertools.islice(ready, sample))
            if not keys:
                continue
            by: dict[str, float] = {}
            tasks = _distributed.input_sources(self.scheduler, keys)
            for inputs in tasks:
                for nbytes, holders in inputs:
                    src = [pools[h] for h in holders if h in pools]
                    if src:  # the cheapest sender
                        name = min(src, key=lambda p: (p.egress, p.name)).name
                        by[name] = by.get(name, 0.0) + nbytes
            if tasks:
                out[group] = {name: b / len(tasks) for name, b in by.items()}
        return out

    def _objective_run(self):
        """A run under an objective with work left (the latest), or None."""
        return self.runs.objective_run()

    def _throughput(self, views) -> dict[str, dict[str, float]]:
        """The throughput matrix (group -> pool -> seconds per task) from the speed model."""
        return cost.throughput_matrix(self.speeds.group_durations(), pools_of(views),
                                      {a: w.speed for a, w in views.items()})

    def _stopped(self, views) -> frozenset:
        """Workers that paused themselves (distributed's host-memory pause): they start nothing."""
        limit = self._host_pause_fraction
        out = set()
        for a, w in views.items():
            if w.status != "paused":
                continue
            hm = w.host_memory_fraction
            if (a not in self.paused and a not in self.held) or (
                    limit and hm is not None and hm >= limit):
                out.add(a)
        return frozenset(out)

    def run_once(self) -> list[Decision | Record]:
        """One control-loop tick; the commands applied and records logged."""
        if self.scheduler is None or self.policy is None:
            return []
        if self._registered and not _distributed.is_registered(self.scheduler, self.name, self):
            self._detach()  # unregistered: distributed does not call close() then
            return []
        self.flush_finished()  # timed as hook time: the cost of the tasks it folds in
        cost = self.cost
        full = gc.get_stats()[2]["collections"]
        t0, c0 = clock(), cpu_clock()
        w0, f0 = cost.flush_wall, cost.flush_cpu
        try:
            return self._tick()
        finally:
            cost.tick(clock() - t0 - (cost.flush_wall - w0),
                      cpu_clock() - c0 - (cost.flush_cpu - f0),
                      full_gc=gc.get_stats()[2]["collections"] != full)

    def _tick(self) -> list[Decision | Record]:
        self.ticks += 1
        snap = self.take_snapshot()
        self.act(self.unsatisfiable.run(snap, None), snap)
        tick = replace(snap, feeder_states=_distributed.feeder_state_view(self.scheduler))
        self.act(self.admission.run(tick, None), tick)
        self.act(self._reapply_pauses(snap), snap)
        self.act(self.stealing_rule.run(snap, None), snap)  # suspend or restore stealing
        applied = self.act(self.policy.run(snap), snap)
        self._dispatch()
        # device seconds from the heartbeats; a run that ended gets its device-time records
        self.device_time.sample(_distributed.device_seconds_samples(self.scheduler))
        self.act(self.device_time.records(self.runs, snap.time), snap)
        self._view_cache.changed = frozenset()  # the rules have seen them
        for a in (snap.workers if snap.changed is None else snap.changed):
            w = snap.workers.get(a)
            used = None if w is None else w.metrics.gpu_memory_used
            if used is not None and used > self.memory_peak.get(a, -1.0):
                self.memory_peak[a] = used
        self._last_snap = snap  # its worker table is built when status() asks
        return applied

    def _reapply_pauses(self, snap: ClusterSnapshot) -> list[Decision]:
        """``reapply`` commands for workers blockflow keeps paused or held whose own status
        message set them running again; forgets those gone.
        """
        out = []
        for kept, what in ((self.held, "rehold"), (self.paused, "repause")):
            for addr in list(kept):
                w = snap.workers.get(addr)
                if w is None:
                    kept.pop(addr)
                elif w.status == "running":
                    out.append(Decision(Action.REAPPLY, addr, what, detail=what))
                    w.status = "paused"
                    if snap.changed is not None:
                        snap.changed = snap.changed | {addr}
        return out
