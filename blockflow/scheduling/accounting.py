"""What finished tasks tell the scheduler plugin: counts, busy time, speeds, runs, egress.

The ``transition`` hook only queues a finished task; :meth:`Accounting.flush_finished`
folds the queue in before anything reads it.
"""

from __future__ import annotations

import logging
from collections import Counter, deque

from dask.utils import key_split

from blockflow import _distributed
from blockflow.pools.plan import dollars_between
from blockflow.scheduling.actions import KERNEL_PREFIX, PROBE_PREFIX
from blockflow.scheduling.overhead import clock, cpu_clock
from blockflow.scheduling.runs import RunTracker
from blockflow.scheduling.speed import SpeedModel

__all__ = ["Accounting"]

logger = logging.getLogger("blockflow.scheduling.plugin")


class _Folded:
    """An :class:`Accounting` attribute (``_<name>``), read with queued tasks folded in."""

    def __init__(self, doc: str):
        self.__doc__ = doc

    def __set_name__(self, owner, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, plugin, owner=None):
        if plugin is None:
            return self
        if plugin._finished:
            plugin.flush_finished()
        return getattr(plugin, self.attr)

    def __set__(self, plugin, value) -> None:  # read-only, as a property
        raise AttributeError(f"{self.attr[1:]} is read-only")


class Accounting:
    """The finished-task accounts of :class:`~blockflow.scheduling.plugin.Rebalancer` (a base)."""

    #: Finished tasks queued before they are folded in where they are.
    max_queued = 10_000

    def _init_accounting(self) -> None:
        self._finished: list[tuple] = []
        self._task_counts: Counter[str] = Counter()
        self._kernel_counts: Counter[str] = Counter()
        self._runs = RunTracker(  # "this run": see blockflow.scheduling.runs
            span_figures=lambda span_id: _distributed.span_figures(self.scheduler, span_id))
        self._task_log: deque[tuple[str, float, float]] = deque(maxlen=100_000)
        self._speeds = SpeedModel()
        self._pools: dict = {}  # worker -> its Pool (set each tick)
        self._multi_provider = False  # workers of several providers: inputs are tracked
        # task group -> [tasks seen, {sending pool -> input bytes}, run id]
        self._group_inputs: dict[str, list] = {}
        self._fetched: dict = {}  # (input key, worker) whose crossing was counted (bounded)
        self._started_inputs: dict = {}  # key -> its inputs' holders when it started
        # worker -> [pool, arrival, departure, [(since, pool), ...]]: the pools (prices) it
        # reported, oldest first, each billed from when it was reported
        self._lifetimes: dict[str, list] = {}

    task_counts = _Folded("Worker -> tasks it finished (re-executions included): Counter.")
    kernel_counts = _Folded("Worker -> blockflow kernel tasks it finished: Counter.")
    runs = _Folded("The runs (:class:`~blockflow.scheduling.runs.RunTracker`).")
    task_log = _Folded("``(worker, start, stop)`` of finished tasks' executions (bounded "
                       "deque).")
    speeds = _Folded("The speed model (:class:`~blockflow.scheduling.speed.SpeedModel`).")
    group_inputs = _Folded("Task group -> ``[tasks seen, {sending pool -> input bytes}, run "
                           "id]``, of the latest run that gave the group tasks.")

    def flush_finished(self) -> None:
        """Fold the queued finished tasks in, in order; timed as hook time."""
        queued = self._finished
        if not queued:
            return
        cost = self.cost
        t0, c0 = clock(), cpu_clock()
        self._finished = []
        try:
            task_counts, kernel_counts = self._task_counts, self._kernel_counts
            runs, task_log, speeds = self._runs, self._task_log, self._speeds
            for entry in queued:
                try:
                    key, worker = entry[0], entry[1]
                    if worker is None:  # (key, None): forgotten; (key, None, when): erred
                        if len(entry) > 2:
                            runs.erred(key, entry[2])
                        else:
                            runs.forget(key)
                        continue
                    # (key, worker, group, work, size, wait, start, stop, start, stop, ...):
                    # ``wait``: seconds the task waited (seceded) at its start for a value
                    # posted to it; neither busy time nor speed evidence
                    group, work, size, wait = entry[2], entry[3], entry[4], entry[5]
                    if group.startswith(PROBE_PREFIX):  # blockflow's overhead probe
                        continue
                    task_counts[worker] += 1
                    if group.startswith(KERNEL_PREFIX):
                        kernel_counts[worker] += 1
                    if len(entry) > 6:
                        compute, first = 0.0, entry[6]
                        for i in range(6, len(entry), 2):
                            begin, stop = entry[i], entry[i + 1]
                            start = min(begin + wait, stop)
                            wait = max(0.0, wait - (stop - begin))
                            compute += stop - start
                            task_log.append((worker, start, stop))
                            life = self._lifetimes.get(worker)
                            runs.executed(key, worker, start, stop,
                                          dollars_between(life[3], start, stop)
                                          if life is not None and life[3] else None)
                        if compute > 0:
                            speeds.observe(worker, group, compute,
                                           1.0 if work is None else work, size=size,
                                           start=first)
                    runs.finished(key, worker)
                except Exception:  # one task's bad record must not drop the rest
                    logger.warning("blockflow: accounting for finished task %r failed",
                                   entry[0], exc_info=True)
        finally:
            wall, cpu = clock() - t0, cpu_clock() - c0
            cost.hooks += wall
            cost.flush_wall += wall
            cost.flush_cpu += cpu

    def set_pools(self, pools: dict, now: float) -> None:
        """Worker address -> its :class:`~blockflow.pools.pool.Pool`, each tick: inputs are
        tracked while there are several providers; a worker first seen now arrived now
        (workers present before the plugin started arrived at its start); a pool reported
        other than before (a new price) is billed from now, the seconds before at the old
        one."""
        self._pools = pools
        self._multi_provider = len({p.provider for p in pools.values()}) > 1
        lifetimes = self._lifetimes
        for a, p in pools.items():
            life = lifetimes.get(a)
            if life is None or life[2] is not None:
                lifetimes[a] = [p, now, None, [(now, p)]]
            elif life[0] != p:
                history = life[3]
                history.append((now if history else life[1], p))
                if len(history) > 64:  # a price that keeps changing: the oldest merge
                    del history[1]
                life[0] = p

    def worker_arrived(self, worker: str, now: float) -> None:
        """``worker`` joined the cluster at ``now`` (epoch seconds): it is billed from here."""
        pool = self._pools.get(worker)
        self._lifetimes[worker] = [pool, now, None, [(now, pool)] if pool else []]

    def worker_left(self, worker: str, now: float) -> None:
        """``worker`` left (retired or lost) at ``now``: its billing stops here."""
        life = self._lifetimes.get(worker)
        if life is not None and life[2] is None:
            life[2] = now
        self._pools.pop(worker, None)
        gone = [a for a, life in self._lifetimes.items() if life[2] is not None]
        for a in gone[:max(len(gone) - 10_000, 0)]:
            del self._lifetimes[a]

    @property
    def lifetimes(self) -> dict[str, tuple]:
        """Worker -> ``(pool, arrival, departure or None, ((since, pool), ...))`` (epoch
        seconds) of the workers that reported a pool: the billing of
        :func:`blockflow.pools.plan.run_cost`, the last item the pools (prices) in force
        from each time on, oldest first."""
        return {a: (*life[:3], tuple(life[3])) for a, life in self._lifetimes.items()
                if life[0] is not None}

    def new_run_inputs(self, run_id: str, keys) -> None:
        """Forget the inputs seen for the groups of ``keys`` in other runs. O(keys)."""
        for group in {key_split(k) for k in keys}:
            seen = self._group_inputs.get(group)
            if seen is not None and seen[2] != run_id:
                self._group_inputs[group] = [0, Counter(), run_id]

    def note_inputs(self, key) -> None:
        """Where a task's inputs are as it starts processing (read again by
        :meth:`record_inputs` when it finishes, wherever it moved meanwhile). O(inputs)."""
        inputs = _distributed.task_start_inputs(self.scheduler, key)
        if inputs:
            started = self._started_inputs
            started[key] = inputs
            if len(started) > 100_000:  # tasks forgotten unfinished
                started.pop(next(iter(started)))

    def record_inputs(self, key, worker: str) -> None:
        """Account the inputs of a task that finished on ``worker``: bytes of an input it did
        not hold when the task started, from another provider's worker, crossed providers
        (run egress, priced by the sending pool; the objective's prices per group). O(inputs);
        called from the ``transition`` hook."""
        inputs = self._started_inputs.pop(key, ())
        pools = self._pools
        here = pools.get(worker)
        if here is None or not inputs:
            return
        group = key_split(key)
        seen = self._group_inputs.get(group)
        if seen is None:
            seen = self._group_inputs[group] = [0, Counter(), self._runs.run_id(key)]
            while len(self._group_inputs) > 256:
                self._group_inputs.pop(next(iter(self._group_inputs)))
        seen[0] += 1
        fetched = self._fetched
        for dep, nbytes, holders in inputs:
            if worker in holders:  # it was there already
                seen[1][here.name] += nbytes
                continue
            srcs = [pools[h] for h in holders if h in pools]
            local = [p for p in srcs if p.provider == here.provider]
            if local or not srcs:  # read within the provider (or its holder left)
                seen[1][local[0].name if local else here.name] += nbytes
                continue
            src = min(srcs, key=lambda p: (p.egress, p.name))  # the cheapest sender
            seen[1][src.name] += nbytes
            if (dep, worker) in fetched:
                continue  # this worker fetches it once
            fetched[(dep, worker)] = None
            if len(fetched) > 100_000:
                fetched.pop(next(iter(fetched)))
            self._runs.crossed(key, src.name, here.provider, nbytes)
