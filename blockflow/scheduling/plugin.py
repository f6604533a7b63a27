"""blockflow's scheduler plugin: observes workers and tasks, and runs the rebalancing loop.

The plugin lives on the scheduler. Its :meth:`Rebalancer.transition` hook (called on every
task transition) is O(1): it queues each finished (or forgotten) task with what may be
gone later (its worker, timings and facts); the queue is folded in, in order, before anything
reads what it feeds (each tick, each graph, each read of the counts, the runs, the task log
or the speed model): tasks counted per worker and per run (one run is everything one job or
one ``compute()`` submitted: :mod:`blockflow.scheduling.runs`), compute times for the speed
model. Batched, this per-task work runs with warm caches; its time counts as the hooks'
(:mod:`blockflow.scheduling.overhead`). A control loop
(:class:`tornado.ioloop.PeriodicCallback`, period ``blockflow.rebalancer.interval``) calls
:meth:`Rebalancer.run_once`: fold in the new durations, take a
:class:`~blockflow.scheduling.policies.ClusterSnapshot`, ask the policy for decisions, apply
them through :mod:`blockflow._distributed`, and log each one.

:meth:`Rebalancer._apply` is the only code that acts on the scheduler for a decision or
writes the decision log: one handler per :class:`~blockflow.scheduling.actions.Action`
(:attr:`Rebalancer.HANDLERS`). The policy's rules, the plugin's own rules (kernels'
placements, the unsatisfiable-task watch, the balancing hand-over, admission control),
backup outcomes and worker arrivals all reach the scheduler and the log through it.

Clients read the plugin's state through one read-only scheduler handler,
``blockflow_status``; the plugin accepts no commands.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import dask.config
from dask.utils import key_split, parse_timedelta
from distributed.diagnostics.plugin import SchedulerPlugin

from blockflow import _distributed, config
from blockflow.errors import ResourceError
from blockflow.scheduling.actions import KERNEL_PREFIX, Action, Decision
from blockflow.scheduling import resources
from blockflow.scheduling.overhead import PluginCost
from blockflow.scheduling.overhead import clock as _clock
from blockflow.scheduling.overhead import cpu_clock as _cpu_clock
from blockflow.scheduling.policies import (
    POLICIES,
    REGISTRY,
    ClusterSnapshot,
    make_policy,
)
from blockflow.scheduling.rules import (
    AdmissionRule,
    BalancingRule,
    KernelPlacementRule,
    UnsatisfiableRule,
)
from blockflow.scheduling.estimate import LinkBandwidth
from blockflow.pools import plan as cost
from blockflow.pools.pool import Pool, pools_of
from blockflow.pools.scaling import PoolScalingRule, ScalingRequest
from blockflow.scheduling.runs import RunTracker
from blockflow.scheduling.speed import SpeedModel

__all__ = ["POLICIES", "Rebalancer"]

logger = logging.getLogger(__name__)
objective_logger = logging.getLogger("blockflow.pools.objective")

#: Transitions of a tracked producer or consumer after which admission control looks again.
_ADMISSION_EVENTS = frozenset({"memory", "released", "forgotten", "erred"})


class _Folded:
    """A :class:`Rebalancer` attribute fed by finished tasks (stored as ``_<name>``), read
    with the tasks the transition hook queued folded in first
    (:meth:`Rebalancer._flush_finished`)."""

    def __init__(self, doc: str):
        self.__doc__ = doc

    def __set_name__(self, owner, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, plugin, owner=None):
        if plugin is None:
            return self
        if plugin._finished:
            plugin._flush_finished()
        return getattr(plugin, self.attr)

    def __set__(self, plugin, value) -> None:  # read-only, as a property
        raise AttributeError(f"{self.attr[1:]} is read-only")


class Rebalancer(SchedulerPlugin):
    """Scheduler plugin that places and moves tasks from GPU metrics and learned speed.

    Parameters
    ----------
    policy : str, optional
        A name of :data:`blockflow.scheduling.policies.POLICIES` (``"dynamic"``,
        ``"memory"``, ``"static-round-robin"``, ``"static-capacity"``, ``"off"``); default
        ``blockflow.cluster.policy``.
    interval : str or float, optional
        Period of the control loop (``"200ms"`` or seconds); default
        ``blockflow.rebalancer.interval``. 0 disables the loop (call :meth:`run_once`).

    Raises
    ------
    ValueError
        If ``policy`` is not one of the names above.

    Notes
    -----
    Register with ``client.register_plugin(Rebalancer())`` (what :func:`blockflow.connect`
    does) or ``dask scheduler --preload blockflow.scheduling.preload``.
    """

    name = "blockflow-rebalancer"
    idempotent = True

    def __init__(self, policy: str | None = None, interval: str | float | None = None):
        policy = config.get("cluster.policy", policy)
        if policy not in POLICIES:
            raise ValueError(
                f"Unknown blockflow policy {policy!r}; choose one of {', '.join(POLICIES)}."
            )
        self.policy_name = policy
        self.interval = parse_timedelta(config.get("rebalancer.interval", interval))
        self.decision_log_size = int(config.get("rebalancer.decision-log-size"))
        self._init_state()

    def _init_state(self) -> None:
        # Called on the scheduler too: the plugin travels pickled, state starts fresh.
        self.scheduler = None
        self.policy = None
        # The state finished tasks update (task_counts, kernel_counts, runs, task_log,
        # speeds, group_inputs) is read through properties that first fold in the tasks
        # the transition hook queued (_flush_finished): the hook only queues.
        self._finished: list[tuple] = []
        self._task_counts: Counter[str] = Counter()
        self._kernel_counts: Counter[str] = Counter()
        self._runs = RunTracker(  # "this run": see blockflow.scheduling.runs
            span_figures=lambda span_id: _distributed.span_figures(self.scheduler, span_id))
        # (worker, start, stop) of finished tasks, for run reports; bounded
        self._task_log: deque[tuple[str, float, float]] = deque(maxlen=100_000)
        self.memory_peak: dict[str, float] = {}  # worker -> device bytes, highest seen
        self._speeds = SpeedModel()
        self.paused: dict[str, str] = {}  # worker -> reason, for pauses this plugin made
        self.held: dict[str, str] = {}  # worker -> reason: held back from the queue
        self.decisions: deque[dict[str, Any]] = deque(maxlen=self.decision_log_size)
        self.ticks = 0
        self.moves_requested = 0
        self._stealing = None
        self._host_pause_fraction: float | None = None
        self._worker_checked = False
        # the plugin's own rules, under every policy (set in start())
        self.balancing: BalancingRule | None = None
        self.kernel_placement = KernelPlacementRule()
        self.unsatisfiable: UnsatisfiableRule | None = None
        self._placed_now: set = set()  # keys the last "restrict" decision restricted
        self.backups: dict[Any, dict[str, Any]] = {}  # key -> backup copy running now
        self.speculation: Counter[str] = Counter(launched=0, duplicated_seconds=0.0,
                                                 saved_seconds=0.0)
        self.admission: AdmissionRule | None = None
        self._admission_kick = False  # an "admit" snapshot is scheduled
        self.cost = PluginCost()  # the plugin's own time on the scheduler's event loop
        self._last_snap: ClusterSnapshot | None = None  # the last tick's (for status())
        self._view_cache = _distributed.WorkerViewCache()  # the ticks' worker views
        self._links: LinkBandwidth | None = None  # measured links, kept across ticks
        # pools and objectives (blockflow.pools.pool, .objective, .cost)
        self.parked: dict[str, str] = {}  # worker -> reason: its pool is not needed now
        #: Pools known before any of their workers joins (name -> Pool): a cluster that
        #: scales pools from zero registers them here (``client.run_on_scheduler``).
        self.declared_pools: dict[str, Pool] = {}
        # elastic scaling of pools (PoolCluster.adapt): its rule, the workers it retires
        self.scaling = PoolScalingRule()
        self.retiring: dict[str, str] = {}  # worker -> its name, retired, not gone yet
        self._providers: dict[str, str] = {}  # worker -> its pool's provider
        self._multi_provider = False  # workers of several providers (inputs are tracked)
        # task group -> [tasks seen, {provider -> input bytes}]: where a group's inputs live
        self._group_inputs: dict[str, list] = {}

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
        self.policy = make_policy(self.policy_name)
        self._start_resources()
        _distributed.add_handler(scheduler, "blockflow_status", self.status)
        _distributed.add_handler(scheduler, "blockflow_pool_targets", self.pool_targets)
        for amm_policy in self.policy.amm_policies():
            _distributed.add_amm_policy(scheduler, amm_policy)
        for worker_plugin in self.policy.worker_plugins():
            await _distributed.register_worker_plugin_on_scheduler(
                scheduler, worker_plugin, worker_plugin.name, idempotent=True)
        # A first tick now, so hot or full workers are paused before the first graph lands.
        self.run_once()
        if self.interval > 0:
            _distributed.add_periodic_callback(scheduler, self.name, self.run_once,
                                               self.interval)

    async def close(self) -> None:
        self._flush_finished()
        if self.scheduler is not None:
            _distributed.remove_periodic_callback(self.scheduler, self.name)
        if self._stealing is not None:
            self._stealing.restore()
        if self.admission is not None and self.scheduler is not None:
            self._run_admission("close", workers={})
        if self.scheduler is not None:  # nothing stays held back without the plugin
            for addr in list(self.held):
                self.held.pop(addr)
                if addr in _distributed.worker_addresses(self.scheduler) \
                        and addr not in self.paused:
                    _distributed.set_worker_status(self.scheduler, addr, False,
                                                   f"blockflow-close-{time.time()}")

    # --- hooks: keep them O(1) -----------------------------------------------------------

    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs) -> None:
        # Fast path, first: of a task's ~5 transitions only its end (processing -> memory),
        # its forgetting and, for the few keys admission control watches, the events that
        # free room in its budget need anything. The rest return here, untimed (the cost
        # this plugin reports is the work past this test).
        if finish != "forgotten" and (finish != "memory" or start != "processing"):
            admission = self.admission
            if admission is None or finish not in _ADMISSION_EVENTS \
                    or not admission.watches(key):
                return
        cost = self.cost
        if not cost.sampled():
            t0 = _clock()
            try:
                self._transition(key, start, finish, kwargs)
            finally:
                cost.hooks += _clock() - t0
        else:
            t0, c0 = _clock(), _cpu_clock()
            try:
                self._transition(key, start, finish, kwargs)
            finally:
                cost.hook_cpu_sampled += _cpu_clock() - c0
                cost.hook_samples += 1
                cost.hooks += _clock() - t0
        if len(self._finished) >= self.max_queued:  # bounded with the loop off (interval=0)
            self._flush_finished()

    #: Finished (and forgotten) tasks the transition hook queues before they are folded in
    #: where they are (:meth:`_flush_finished`, also at every tick and every read).
    max_queued = 10_000

    def _transition(self, key, start, finish, kwargs) -> None:
        # Only what may be gone later is read here (the task's facts: it may be forgotten
        # before the queue is folded in; where its inputs are: who holds them changes);
        # the rest waits in the queue for _flush_finished.
        if self.admission is not None and self.admission.watches(key) \
                and finish in _ADMISSION_EVENTS:
            self._kick_admission()
        if finish == "forgotten":
            self._finished.append((key, None))
            return
        if start != "processing" or finish != "memory":
            return
        worker = kwargs.get("worker")
        if worker is None:
            return
        if self._multi_provider:
            self._record_inputs(key, worker)
        # One flat tuple of strings and numbers, read in one pass (not the message's
        # dicts, which would outlive the young generation waiting for the fold).
        self._finished.append(_distributed.finished_task_record(
            self.scheduler, key, worker, kwargs.get("startstops"), kwargs.get("metadata")))

    def _flush_finished(self) -> None:
        """Fold the tasks the transition hook queued, in order, into the task and kernel
        counts, the task log, the runs and the speed model. Runs before anything reads
        them (the properties below, ticks, graphs); its time counts as hook time (the
        cost per finished task, wherever it is spent)."""
        queued = self._finished
        if not queued:
            return
        cost = self.cost
        t0, c0 = _clock(), _cpu_clock()
        self._finished = []
        try:
            task_counts, kernel_counts = self._task_counts, self._kernel_counts
            runs, task_log, speeds = self._runs, self._task_log, self._speeds
            for entry in queued:
                try:
                    key, worker = entry[0], entry[1]
                    if worker is None:
                        runs.forget(key)
                        continue
                    # (key, worker, group, work, size, wait, start, stop, start, stop, ...):
                    # the compute spans the worker reported; ``wait`` the seconds the task
                    # reported waiting (seceded) at its start, for a value posted to it (a
                    # training step submitted ahead): neither busy time nor speed evidence
                    group, work, size, wait = entry[2], entry[3], entry[4], entry[5]
                    task_counts[worker] += 1
                    if group.startswith(KERNEL_PREFIX):
                        kernel_counts[worker] += 1
                    if len(entry) > 6:
                        compute = 0.0
                        for i in range(6, len(entry), 2):
                            begin, stop = entry[i], entry[i + 1]
                            start = min(begin + wait, stop)
                            wait = max(0.0, wait - (stop - begin))
                            compute += stop - start
                            task_log.append((worker, start, stop))
                            runs.executed(key, worker, start, stop)
                        if compute > 0:
                            speeds.observe(worker, group, compute,
                                           1.0 if work is None else work, size=size)
                    runs.finished(key, worker)
                except Exception:  # one task's bad record must not drop the rest
                    logger.warning("blockflow: accounting for finished task %r failed",
                                   entry[0], exc_info=True)
        finally:
            wall, cpu = _clock() - t0, _cpu_clock() - c0
            cost.hooks += wall
            cost.flush_wall += wall
            cost.flush_cpu += cpu

    # The state finished tasks update, read with the queue folded in first.
    task_counts = _Folded("Worker -> tasks it finished (re-executions included): Counter.")
    kernel_counts = _Folded("Worker -> blockflow kernel tasks it finished: Counter.")
    runs = _Folded("The runs (:class:`~blockflow.scheduling.runs.RunTracker`).")
    task_log = _Folded("``(worker, start, stop)`` of finished tasks' executions (bounded "
                       "deque).")
    speeds = _Folded("The speed model (:class:`~blockflow.scheduling.speed.SpeedModel`).")
    group_inputs = _Folded("Task group -> ``[tasks seen, {provider -> input bytes}, run "
                           "id]``, of the latest run that gave the group tasks.")

    def _new_run_inputs(self, run_id: str, keys) -> None:
        """A graph gave tasks of groups whose inputs were seen in another run: forget what
        was seen there. A run's tasks of one group read what that run gives them (a
        group that read 100 MB from another provider in one run may read nothing in the
        next), so the egress the objective prices for them is learnt again from this
        run's own finished tasks, as on a fresh cluster. O(keys)."""
        for group in {key_split(k) for k in keys}:
            seen = self._group_inputs.get(group)
            if seen is not None and seen[2] != run_id:
                self._group_inputs[group] = [0, Counter(), run_id]

    def _record_inputs(self, key, worker: str) -> None:
        """Where a finished task's inputs came from (providers): bytes that crossed into
        ``worker``'s provider go to the run's account, and the group's inputs by provider
        (in the latest run that gave the group tasks) feed the objective's egress prices.
        O(inputs)."""
        here = self._providers.get(worker)
        group = key_split(key)
        seen = self._group_inputs.get(group)
        if seen is None:
            seen = self._group_inputs[group] = [0, Counter(), self._runs.run_id(key)]
            while len(self._group_inputs) > 256:
                self._group_inputs.pop(next(iter(self._group_inputs)))
        seen[0] += 1
        for nbytes, holders in _distributed.input_holders(self.scheduler, key, worker):
            providers = {self._providers.get(h) for h in holders}
            if not holders or here in providers:
                seen[1][here] += nbytes  # made here, or read within the provider
                continue
            src = sorted(p for p in providers if p is not None)
            src = src[0] if src else here
            seen[1][src] += nbytes
            if src != here:
                self._runs.crossed(key, src, here, nbytes)

    def update_graph(self, scheduler, *, client=None, keys=None, tasks=None, annotations=None,
                     **kwargs) -> None:
        self._flush_finished()  # runs.graph reads the runs' pending keys (timed itself)
        cost = self.cost
        t0, c0 = _clock(), _cpu_clock()
        w0, f0 = cost.flush_wall, cost.flush_cpu
        try:
            self._update_graph(scheduler, client, tasks, annotations)
        finally:
            # a flush inside (tasks finished meanwhile) timed itself: not counted twice
            cost.graph_cpu += _cpu_clock() - c0 - (cost.flush_cpu - f0)
            cost.hooks += _clock() - t0 - (cost.flush_wall - w0)

    def _update_graph(self, scheduler, client, tasks, annotations) -> None:
        run = self.runs.graph(client=client,
                              states=_distributed.task_states(scheduler, tasks or ()),
                              annotations=annotations or {}, now=time.time())
        if self._group_inputs and run is not None and tasks:
            self._new_run_inputs(run.id, tasks)
        if self.policy is None or not tasks:
            return
        new_tasks = self._resources_on_graph(scheduler, list(tasks), client)
        views = self._views()
        run = self._objective_run()
        snap = ClusterSnapshot(time=time.time(), workers=views, event="graph",
                               new_tasks=new_tasks, run=run, parked=frozenset(self.parked),
                               declared_pools=dict(self.declared_pools),
                               throughput=self._throughput(views) if run else {})
        for d in self.policy.run(snap):
            self._apply(d, snap)

    def add_worker(self, scheduler, worker) -> None:
        if not self._worker_checked and self.scheduler is not None:
            # a scheduler started with --preload has no worker when the plugin starts
            self._worker_checked = True
            _distributed.check_scheduler(scheduler)
        self._apply(Decision(Action.JOIN, worker, "worker joined the cluster"))

    def remove_worker(self, scheduler, worker, *, stimulus_id=None, **kwargs) -> None:
        if self._last_snap is not None:
            self._last_snap.workers.pop(worker, None)
        self.speeds.forget(worker)
        self.parked.pop(worker, None)
        self.retiring.pop(worker, None)
        self._providers.pop(worker, None)
        was_paused = self.paused.pop(worker, None)
        self.held.pop(worker, None)
        self._apply(Decision(Action.FORGET, worker, "worker left the cluster"
                             + (" (it was paused by blockflow)" if was_paused else "")))

    # --- worker resources: placement, unsatisfiable tasks, admission control ----------

    def _start_resources(self) -> None:
        self.unsatisfiable = UnsatisfiableRule()
        self.balancing = BalancingRule(hands_over=self.policy.replaces_work_stealing)
        self.admission = AdmissionRule()
        if not self.policy.admits:  # e.g. observe only: never hold tasks back
            self.admission.enabled = False

    def _resources_on_graph(self, scheduler, keys: list, client=None) -> list:
        """New tasks: restrict them as their kernels asked (resources=, workers=), then hold
        back producers feeding resource-restricted consumers; the tasks' views for the
        policy.

        Three snapshots, each read before the decisions it leads to are applied: the new
        tasks (the kernel placement rule: ``restrict``); after that, the feeders among them
        (which tasks are feeders depends on the restrictions just set; the admission rule:
        ``hold``); after the holds, where the feeders stand (the admission rule:
        ``release``, ``admit``).
        """
        views = _distributed.new_task_views(scheduler, keys)
        snap = ClusterSnapshot(time=time.time(), workers={}, event="graph", new_tasks=views)
        self._placed_now = set()
        for d in self.kernel_placement.run(snap, None):
            self._apply(d, snap)
        if self._placed_now:  # restricted here: the policy's rules leave them alone
            views = [replace(v, restricted=True)
                     if v.key in self._placed_now and not v.restricted else v for v in views]
        if self.admission is not None and self.admission.enabled and keys:
            feeders = _distributed.feeder_tasks(scheduler, keys,
                                                expect=self.admission.expected(client))
            graph = ClusterSnapshot(time=time.time(), workers={}, event="graph",
                                    new_tasks=views, feeders=feeders, client=client)
            for d in self.admission.run(graph, None):
                self._apply(d, graph)
            self._run_admission("held")
        return views

    def _run_admission(self, event: str, workers=None) -> None:
        """Take an admission snapshot (``"held"``, ``"admit"``, ``"close"``) and apply what
        the admission rule yields for it."""
        snap = ClusterSnapshot(time=time.time(),
                               workers=self._views() if workers is None else workers,
                               event=event,
                               feeder_states=_distributed.feeder_state_view(self.scheduler))
        for d in self.admission.run(snap, None):
            self._apply(d, snap)

    def _kick_admission(self) -> None:
        """Run the admission rule on the scheduler's event loop soon (coalesced): called from
        the ``transition`` hook, where scheduler state must not change."""
        if self._admission_kick or not self.admission.holding:
            return
        self._admission_kick = True

        def run():
            self._admission_kick = False
            self._run_admission("admit")

        _distributed.call_soon(self.scheduler, run)

    def _resources_tick(self, snap: ClusterSnapshot) -> None:
        if self.unsatisfiable is not None:
            for d in self.unsatisfiable.run(snap, None):
                self._apply(d, snap)
        if self.admission is not None:
            tick = replace(snap, feeder_states=_distributed.feeder_state_view(self.scheduler))
            for d in self.admission.run(tick, None):
                self._apply(d, tick)

    # --- control loop -----------------------------------------------------------------

    def _views(self, previous=None):
        return _distributed.worker_views(self.scheduler, speed=self.speeds.speed,
                                         confidence=self.speeds.confidence,
                                         paused=self.paused,
                                         recent_speed=self.speeds.recent_speed,
                                         slow_for=self.speeds.slow_for,
                                         previous=previous)

    def _running(self, now: float) -> dict:
        """The running tasks, each expected to last its group's duration times its size
        against the group's typical size (a block with 8x the input of the others is
        expected to take 8x as long, not judged a straggler: see
        :meth:`~blockflow.scheduling.speed.SpeedModel.size_factor`)."""
        running = _distributed.running_tasks(self.scheduler, now)
        factor = self.speeds.size_factor
        for tasks in running.values():
            for i, t in enumerate(tasks):
                f = factor(t.group, t.size)
                if f != 1.0:
                    tasks[i] = replace(t, duration=t.duration * f)
        return running

    def take_snapshot(self) -> ClusterSnapshot:
        """The rebalancer's view of the cluster now (speeds updated first); plain data.

        ``balancing`` is True when the speed model knows, with confidence, that running
        workers differ in speed: only then does a speed-aware policy balance (and
        distributed's speed-blind stealing pause); knowing less, blockflow leaves balancing
        to distributed, as plain Dask does.
        """
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
        active = self.balancing is not None and self.balancing.active
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
        snap.balancing = (self.balancing.judge(snap) if self.balancing is not None
                          else snap.speeds_differ)
        pools = pools_of(views)
        self._providers = {a: p.provider for a, p in pools.items()}
        self._multi_provider = len(set(self._providers.values())) > 1
        snap.parked = frozenset(self.parked)
        snap.declared_pools = dict(self.declared_pools)
        snap.run = self._objective_run()
        if snap.run is not None:
            snap.throughput = self._throughput(views)
            snap.inputs = {g: {p: b / max(n, 1) for p, b in by.items()}
                           for g, (n, by, _) in self.group_inputs.items()}
        return snap

    def _objective_run(self):
        """The run most recently given work, when it runs under an objective."""
        run = self.runs.run_of(self.runs.current)
        return run if run is not None and run.objective is not None else None

    def _throughput(self, views) -> dict[str, dict[str, float]]:
        """The throughput matrix (group -> pool -> seconds per task) from the speed model."""
        return cost.throughput_matrix(self.speeds.group_durations(), pools_of(views),
                                      {a: w.speed for a, w in views.items()})

    def _stopped(self, views) -> frozenset:
        """Workers that paused themselves (distributed's host-memory pause threshold): their
        threads start nothing, so none of their tasks is about to start. blockflow's own
        pauses and holds are scheduler-side only (the worker runs what it has), unless the
        worker is also over its own pause threshold."""
        limit = self._host_pause_fraction
        out = set()
        for a, w in views.items():
            if w.status != "paused":
                continue
            hm = w.host_memory_fraction
            if (a not in self.paused and a not in self.held and a not in self.parked) or (
                    limit and hm is not None and hm >= limit):
                out.add(a)
        return frozenset(out)

    def run_once(self) -> list[Decision]:
        """One tick of the control loop; returns the decisions applied (for tests).

        Deterministic given the scheduler's state and the observed durations.
        """
        if self.scheduler is None or self.policy is None:
            return []
        self._flush_finished()  # timed as hook time: the cost of the tasks it folds in
        cost = self.cost
        full = gc.get_stats()[2]["collections"]
        t0, c0 = _clock(), _cpu_clock()
        w0, f0 = cost.flush_wall, cost.flush_cpu
        try:
            return self._tick()
        finally:
            cost.tick(_clock() - t0 - (cost.flush_wall - w0),
                      _cpu_clock() - c0 - (cost.flush_cpu - f0),
                      full_gc=gc.get_stats()[2]["collections"] != full)

    def _tick(self) -> list[Decision]:
        self.ticks += 1
        snap = self.take_snapshot()
        self._resources_tick(snap)
        self._reapply_pauses(snap)
        for d in self.balancing.run(snap, None):  # suspend or give back distributed's stealing
            self._apply(d, snap)
        applied = []
        for d in self.policy.run(snap):
            if self._apply(d, snap):
                applied.append(d)
        self._view_cache.changed = frozenset()  # the rules have seen them
        for a in (snap.workers if snap.changed is None else snap.changed):
            w = snap.workers.get(a)
            used = None if w is None else w.metrics.gpu_memory_used
            if used is not None and used > self.memory_peak.get(a, -1.0):
                self.memory_peak[a] = used
        self._last_snap = snap  # its worker table is built when status() asks
        return applied

    @property
    def snapshot_workers(self) -> dict[str, dict[str, Any]]:
        """Per worker, the metrics and state the last tick saw (plain data; built on
        demand: a tick does not pay for a table nobody reads)."""
        snap = self._last_snap
        if snap is None:
            return {}
        return {
            a: {**w.metrics.to_dict(), "nthreads": w.nthreads, "status": w.status,
                "paused_by_blockflow": a in self.paused, "speed": w.speed,
                "processing": w.processing, "projected_finish": w.projected_finish}
            for a, w in snap.workers.items()
        }

    def _reapply_pauses(self, snap: ClusterSnapshot) -> None:
        # A worker's own status message can flip a scheduler-side pause back to running.
        for kept, what in ((self.held, "rehold"), (self.paused, "repause"),
                           (self.parked, "repark")):
            for addr in list(kept):
                w = snap.workers.get(addr)
                if w is None:
                    kept.pop(addr)
                elif w.status == "running":
                    _distributed.set_worker_status(self.scheduler, addr, True,
                                                   f"blockflow-{what}-{time.time()}")
                    w.status = "paused"
                    if snap.changed is not None:
                        snap.changed = snap.changed | {addr}

    # --- applying decisions: one handler per action -----------------------------------

    def _apply(self, d: Decision, snap: ClusterSnapshot | None = None) -> bool:
        """Apply one decision and log it (the only code that does either).

        The handler of ``d.action`` (:attr:`HANDLERS`) acts on the scheduler through
        :mod:`blockflow._distributed` and returns the decision to log (perhaps another:
        a resume left to the worker is logged as ``handover``), or None when nothing is to
        be logged: nothing was applied, or the decision is one of admission control's holds
        and releases of tasks (its ``admit`` decision summarises them). Decisions about one
        worker (:attr:`ON_WORKER`) apply only while the snapshot they came from shows it;
        a ``hold`` or ``release`` of tasks (``keys``, no ``worker``) is about no worker.
        """
        if d.action in self.ON_WORKER and not self._on_tasks(d) and (
                snap is None or d.worker not in snap.workers):
            return False
        d = self.HANDLERS[d.action](self, d, snap)
        if d is None:
            return False
        self._log(d)
        return True

    def _stimulus(self, d: Decision) -> str:
        return f"blockflow-{d.action.value}-{time.time()}"

    def _on_pause(self, d, snap):
        _distributed.set_worker_status(self.scheduler, d.worker, True, self._stimulus(d))
        self.paused[d.worker] = d.reason
        return d

    def _on_resume(self, d, snap):
        self.paused.pop(d.worker, None)
        self.speeds.reset(d.worker)  # judged on what it does from now on
        hm = snap.workers[d.worker].host_memory_fraction
        if hm is not None and hm >= (self._host_pause_fraction or math.inf):
            # The worker is also over its own host-memory pause threshold: leave it
            # paused and let the worker resume itself.
            return Decision(Action.HANDOVER, d.worker, f"{d.reason}; stays paused: host "
                            f"memory {hm:.0%} is over the worker's own pause threshold", d.seen)
        _distributed.set_worker_status(self.scheduler, d.worker, False, self._stimulus(d))
        return d

    @staticmethod
    def _on_tasks(d: Decision) -> bool:
        """Whether ``d`` holds or releases tasks (admission control), not a worker."""
        return d.action in (Action.HOLD, Action.RELEASE) and not d.worker and bool(d.keys)

    def _on_hold(self, d, snap):
        if self._on_tasks(d):  # producers held back: they wait in no-worker
            _distributed.hold_tasks(self.scheduler, list(d.keys), self._stimulus(d))
            return None
        _distributed.set_worker_status(self.scheduler, d.worker, True, self._stimulus(d))
        self.held[d.worker] = d.reason
        return d

    def _on_release(self, d, snap):
        if self._on_tasks(d):
            released = _distributed.release_tasks(self.scheduler, list(d.keys),
                                                  d.detail["stimulus"])
            if d.detail["count"]:
                self.admission.released += len(released)
            return None
        if self.held.pop(d.worker, None) is None:
            return None
        if d.worker not in self.paused:
            _distributed.set_worker_status(self.scheduler, d.worker, False, self._stimulus(d))
        return d

    def _on_move(self, d, snap):
        if d.target not in snap.workers or not _distributed.move_task(
                self.scheduler, d.key, d.worker, d.target):
            return None
        self.moves_requested += 1
        return d

    def _on_restrict_to_workers(self, d, snap):  # assign, place
        where = d.workers or d.worker
        pinned = sum(_distributed.restrict_task(self.scheduler, k, where) for k in d.keys)
        return d if pinned else None

    def _on_speculate(self, d, snap):
        if d.target not in snap.workers or d.key in self.backups:
            return None
        self._start_backup(d)
        return d

    def _on_keep(self, d, snap):
        last = self.decisions[-1] if self.decisions else None
        if last and last["action"] == Action.KEEP and last["worker"] == d.worker:
            return None  # do not flood the log with the same non-decision
        return d

    def _on_restrict(self, d, snap):
        placed = [k for k, placement in d.detail.items()
                  if _distributed.set_task_placement(self.scheduler, k, placement)]
        self._placed_now = set(placed)
        if not placed:
            return None
        if len(placed) != len(d.keys):
            d = replace(d, reason=f"{len(placed)} tasks restricted as their kernels asked "
                        f"(resources=, workers=)", seen={"tasks": len(placed)},
                        keys=tuple(placed))
        return d

    def _on_wait(self, d, snap):
        resources.logger.warning(d.reason)
        return d

    def _on_fail(self, d, snap):
        if isinstance(d.detail, BaseException):  # refused before anything runs
            held = _distributed.hold_tasks(self.scheduler, list(d.keys))
            objective_logger.error("%s", d.detail)
            keys = list(d.keys)  # held ones, and restricted ones waiting in no-worker
            _distributed.call_soon(self.scheduler, lambda: _distributed.fail_tasks(
                self.scheduler, keys, d.detail, f"blockflow-refused-{time.time()}"))
            return replace(d, seen={**d.seen, "held": len(held)})
        need = d.seen["resources"]
        failed = _distributed.fail_tasks(self.scheduler, list(d.keys), ResourceError(d.detail),
                                         f"blockflow-unsatisfiable-{time.time()}")
        if not failed:
            return None
        self.unsatisfiable.failed += failed
        resources.logger.error("blockflow: failed %d tasks needing resources %s after %g s: no "
                     "worker declares them", failed, need, self.unsatisfiable.timeout)
        return replace(d, reason=self.unsatisfiable.fail_reason(failed, need),
                       seen={**d.seen, "tasks": failed})

    def _on_balance(self, d, snap):
        if self._stealing is None:
            self._stealing = _distributed.suspend_work_stealing(self.scheduler)
        return d

    def _on_defer(self, d, snap):
        if self._stealing is not None:
            self._stealing.restore()
            self._stealing = None
        return d

    def _log_only(self, d, snap):
        return d

    def _on_retire(self, d, snap):
        if d.worker in self.retiring or not _distributed.retire_idle_worker(
                self.scheduler, d.worker, self._stimulus(d)):
            return None
        self.retiring[d.worker] = str(snap.workers[d.worker].name)
        return d

    def _on_park(self, d, snap):
        if d.worker in self.parked:
            return None
        _distributed.set_worker_status(self.scheduler, d.worker, True, self._stimulus(d))
        self.parked[d.worker] = d.reason
        return d

    def _on_unpark(self, d, snap):
        if self.parked.pop(d.worker, None) is None:
            return None
        if d.worker not in self.paused and d.worker not in self.held:
            _distributed.set_worker_status(self.scheduler, d.worker, False, self._stimulus(d))
        return d

    def _on_objective(self, d, snap):
        if (d.detail or {}).get("warning"):
            objective_logger.warning("blockflow: %s", d.reason)
        return d

    #: Actions about one worker: applied only while their snapshot shows the worker.
    ON_WORKER = frozenset({Action.PAUSE, Action.RESUME, Action.HANDOVER, Action.HOLD,
                           Action.RELEASE, Action.MOVE, Action.ASSIGN, Action.PLACE,
                           Action.SPECULATE, Action.KEEP, Action.PARK, Action.UNPARK,
                           Action.RETIRE})
    #: The one table of handlers: action -> ``handler(plugin, decision, snapshot)``.
    HANDLERS: dict[Action, Callable] = {
        Action.PAUSE: _on_pause,
        Action.RESUME: _on_resume,
        Action.HANDOVER: _log_only,  # made by the resume handler
        Action.HOLD: _on_hold,
        Action.RELEASE: _on_release,
        Action.MOVE: _on_move,
        Action.ASSIGN: _on_restrict_to_workers,
        Action.PLACE: _on_restrict_to_workers,
        Action.SPECULATE: _on_speculate,
        Action.RESTRICT: _on_restrict,
        Action.ADMIT: _log_only,  # the summary of admission control's holds and releases
        Action.FAIL: _on_fail,
        Action.BALANCE: _on_balance,
        Action.DEFER: _on_defer,
        Action.KEEP: _on_keep,
        Action.WAIT: _on_wait,
        Action.BACKUP: _log_only,  # the outcome of a copy _start_backup launched
        Action.MEMORY_MOVE: _log_only,  # distributed's AMM applies it
        Action.JOIN: _log_only,
        Action.FORGET: _log_only,
        Action.RETIRE: _on_retire,
        Action.SCALE: _log_only,  # the cluster (PoolAdaptive) starts the workers
        Action.PARK: _on_park,
        Action.UNPARK: _on_unpark,
        Action.OBJECTIVE: _on_objective,
    }

    def _start_backup(self, d: Decision) -> None:
        """Ask the straggler's worker to copy the task to ``d.target``; log the outcome."""
        started = time.time()
        self.backups[d.key] = {"worker": d.worker, "target": d.target, "started": started}
        self.speculation["launched"] += 1
        expected = float(d.seen.get("time_to_end") or 0.0) + float(
            d.seen.get("backup_time") or 0.0)
        timeout = max(60.0, 10 * expected)

        async def backup():
            reply = await _distributed.request_backup(self.scheduler, d.key, d.worker,
                                                      d.target, timeout)
            self.backups.pop(d.key, None)
            outcome = reply.get("outcome", "failed")
            stats = self.speculation
            stats[outcome] = stats.get(outcome, 0) + 1
            copy_s = float(reply.get("backup_seconds") or 0.0)
            if outcome == "backup-won":
                # the original's time since the copy began was spent for nothing
                stats["duplicated_seconds"] += copy_s
                stats["saved_seconds"] += max(
                    float(d.seen.get("time_to_end") or 0.0) - copy_s, 0.0)
            elif outcome == "original-won":
                stats["duplicated_seconds"] += copy_s
            detail = reply.get("error") or reply.get("detail") or ""
            self._apply(Decision(
                Action.BACKUP, d.worker, f"{outcome}: copy on the target took {copy_s:.3f}s"
                + (f" ({detail})" if detail else ""),
                {"outcome": outcome, "backup_seconds": round(copy_s, 4),
                 "since_start": round(time.time() - started, 4)},
                key=str(d.key), target=d.target))

        _distributed.spawn(self.scheduler, backup())

    def _log(self, d: Decision) -> None:
        """Append a decision to the bounded log (time in seconds since the epoch); the
        action as its plain string (the status handler serves plain data)."""
        self.decisions.append({
            "time": time.time(), "policy": self.policy_name, "action": d.action.value,
            "worker": d.worker, "target": d.target,
            "key": None if d.key is None else str(d.key), "reason": d.reason,
            **{f"seen_{k}": v for k, v in d.seen.items()},
        })

    def log_decision(self, action: str | Action, worker: str, reason: str, seen: dict,
                     key: str | None = None, target: str | None = None) -> bool:
        """Record a decision taken elsewhere (distributed's AMM policies): through
        :meth:`_apply`, like every decision.

        Raises
        ------
        ValueError
            If ``action`` names no :class:`~blockflow.scheduling.actions.Action`.
        """
        return self._apply(Decision(action, worker, reason, seen, key=key, target=target))

    # --- read-only handler ------------------------------------------------------------

    def pool_targets(self, comm=None, *, pools: dict, bounds: dict,
                     starting: dict | None = None, threads: dict | None = None,
                     target_duration: float = 5.0, startup: float = 5.0,
                     wait_count: int = 3) -> dict[str, Any]:
        """Per-pool worker targets for elastic scaling (the ``blockflow_pool_targets``
        handler, asked by :class:`blockflow.pools.adaptive.PoolAdaptive`, as distributed's
        ``Adaptive`` asks ``adaptive_target``).

        Runs :class:`~blockflow.pools.scaling.PoolScalingRule` on a fresh
        snapshot and applies its decisions: ``scale`` (a target changed, logged) and
        ``retire`` (an idle worker of a pool above its target: paused and retired here, in
        one step with the idleness check). The pools become :attr:`declared_pools`.

        Parameters
        ----------
        pools : dict
            Pool name -> :meth:`~blockflow.pools.pool.Pool.to_dict`.
        bounds : dict
            Pool name -> ``[minimum, maximum]`` workers.
        starting : dict, optional
            Pool name -> workers started that have not joined yet.
        threads : dict, optional
            Pool name -> threads per worker.
        target_duration, startup : float
            Seconds (see :class:`~blockflow.pools.scaling.ScalingRequest`).
        wait_count : int

        Returns
        -------
        dict
            ``targets`` (pool -> workers), ``reasons`` (pool -> why), ``retiring`` (names of
            the workers retired and not gone yet: the cluster forgets them).
        """
        if self.scheduler is None or self.policy is None:
            return {"targets": {}, "reasons": {}, "retiring": []}
        request = ScalingRequest(
            pools={n: Pool.from_dict(d) for n, d in pools.items()},
            bounds={n: (int(b[0]), int(b[1])) for n, b in bounds.items()},
            starting=dict(starting or {}), threads=dict(threads or {}),
            target_duration=float(target_duration), startup=float(startup),
            wait_count=int(wait_count))
        self.declared_pools.update(request.pools)
        snap = self.take_snapshot()
        run = self.runs.run_of(self.runs.current)
        if run is not None and not snap.throughput:
            snap.throughput = self._throughput(snap.workers)
        reference = {}
        for g in (run.group_pending if run is not None else ()):
            seconds = _distributed.group_duration(self.scheduler, g)
            if seconds is not None:
                reference[g] = seconds
        spent = 0.0
        if run is not None and run.objective is not None and run.objective.budget is not None:
            rule = getattr(self.policy, "objective", None)
            if rule is not None:
                spent = rule.spent(run, pools_of(snap.workers), snap.time, snap.workers)
        for d in self.scaling.run(snap, request, run, reference, spent,
                                  frozenset(self.retiring),
                                  _distributed.workers_holding_data(self.scheduler)):
            self._apply(d, snap)
        return {"targets": dict(self.scaling.targets), "reasons": dict(self.scaling.reasons),
                "retiring": sorted(self.retiring.values())}

    def _pool_status(self) -> dict[str, Any]:
        """Pools, parked workers, the throughput matrix, the current run's objective, plan
        and cost so far (plain data, for ``status``)."""
        if self.scheduler is None:
            return {"pools": {}, "parked": {}, "throughput": {}, "objective": None}
        views = self._views()
        pools = pools_of(views)
        by_pool: dict[str, dict[str, Any]] = {}
        for a, p in sorted(pools.items()):
            by_pool.setdefault(p.name, {**p.to_dict(), "workers": []})["workers"].append(a)
        for name, p in self.declared_pools.items():
            by_pool.setdefault(name, {**p.to_dict(), "workers": []})
        run = self.runs.run_of(self.runs.current)
        objective = None
        if run is not None and run.objective is not None:
            rule = getattr(self.policy, "objective", None)
            plan = getattr(rule, "plans", {}).get(run.id)
            objective = {**run.objective.as_dict(), "run": run.id,
                         "deadline_at": run.deadline_at, "plan": plan,
                         "spent": (rule.spent(run, pools, time.time(), views)
                                   if rule is not None else None)}
        run_cost = None
        if run is not None and run.spans:
            run_cost = cost.run_cost(
                [(w, s0, s1) for w, (s0, s1) in run.spans.items()], pools,
                [(a, b, n) for (a, b), n in run.crossings.items()])
        return {"pools": by_pool, "parked": dict(self.parked),
                "scaling": {"targets": dict(self.scaling.targets),
                            "reasons": dict(self.scaling.reasons),
                            "retiring": dict(self.retiring)},
                "throughput": self._throughput(views), "objective": objective,
                "run_cost": run_cost}

    def status(self, comm=None, since: float | None = None,
               task_log: bool = False, run: str | None = None) -> dict[str, Any]:
        """Plain-data view of the plugin's state, served as the ``blockflow_status`` handler.

        Parameters
        ----------
        since : float, optional
            Only decisions (and task-log entries) after this time (seconds since the epoch).
        task_log : bool, default False
            Include ``(worker, start, stop)`` of finished tasks (for run reports).
        run : str, optional
            A run id (:func:`blockflow.scheduling.runs.run_scope`): include that run as
            ``requested_run`` (None if unknown).

        Returns
        -------
        dict
            Plain data. ``run`` is the run most recently given tasks
            (:meth:`~blockflow.scheduling.runs.Run.as_dict`, or None); ``run_counts`` and
            ``run_started`` are its per-worker counts and start time. ``cost`` is the
            plugin's own time on the scheduler's event loop (``blockflow.scheduling.overhead``):
            per finished task in its hooks (``per_task_us`` wall, ``cpu_per_task_us`` CPU),
            per tick (``tick_ms_median``, ``tick_ms_max``) and in all
            (``all_in_per_task_us``).
        """
        decisions = list(self.decisions)
        if since is not None:
            decisions = [d for d in decisions if d["time"] > since]
        extra = {}
        if task_log:
            extra["task_log"] = [t for t in self.task_log if since is None or t[2] > since]
        if run is not None:
            extra["requested_run"] = self.runs.get(run)
        current = self.runs.current_run()
        return {
            "policy": self.policy_name,
            "interval": self.interval,
            "ticks": self.ticks,
            "moves_requested": self.moves_requested,
            "cost": self.cost.as_dict(sum(self.task_counts.values())),
            "task_counts": dict(self.task_counts),
            "kernel_counts": dict(self.kernel_counts),
            "run": current,
            "run_counts": current["counts"] if current else {},
            "run_started": current["started"] if current else None,
            "speeds": {a: self.speeds.speed(a)
                       for a in _distributed.worker_addresses(self.scheduler)}
            if self.scheduler else {},
            "speed_confidence": {a: self.speeds.confidence(a)
                                 for a in _distributed.worker_addresses(self.scheduler)}
            if self.scheduler else {},
            "balancing": self._stealing is not None,
            "policies": list(POLICIES),
            "policy_description": _summary(REGISTRY[self.policy_name]),
            "paused": dict(self.paused),
            "held": dict(self.held),
            "workers": self.snapshot_workers,
            "memory_peak": dict(self.memory_peak),
            "decisions": decisions,
            **self._pool_status(),
            "speculation": {**dict(self.speculation),
                            "running": {str(k): dict(v) for k, v in self.backups.items()}},
            "resources": {
                "unsatisfiable": self.unsatisfiable.status() if self.unsatisfiable else None,
                "admission": self.admission.status() if self.admission else None,
                "shared_gpus": {u: list(a) for u, a in _distributed.shared_devices(
                    self._views()).items()} if self.scheduler else {},
            },
            **extra,
        }


def _summary(cls) -> str:
    """First line of a policy's docstring (shown on the dashboard)."""
    return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else cls.name
