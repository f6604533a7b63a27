"""What finished tasks tell the scheduler plugin: counts, busy time, speeds, runs, egress.

The ``transition`` hook only queues a finished task; :meth:`Accounting.flush_finished`
folds the queue in before anything reads it.
"""

from __future__ import annotations

import logging
from collections import Counter, deque

from dask.utils import key_split

from blockflow import _distributed
from blockflow.scheduling.actions import KERNEL_PREFIX
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
        self._providers: dict[str, str] = {}  # worker -> its pool's provider
        self._multi_provider = False  # workers of several providers: inputs are tracked
        # task group -> [tasks seen, {provider -> input bytes}, run id]
        self._group_inputs: dict[str, list] = {}

    task_counts = _Folded("Worker -> tasks it finished (re-executions included): Counter.")
    kernel_counts = _Folded("Worker -> blockflow kernel tasks it finished: Counter.")
    runs = _Folded("The runs (:class:`~blockflow.scheduling.runs.RunTracker`).")
    task_log = _Folded("``(worker, start, stop)`` of finished tasks' executions (bounded "
                       "deque).")
    speeds = _Folded("The speed model (:class:`~blockflow.scheduling.speed.SpeedModel`).")
    group_inputs = _Folded("Task group -> ``[tasks seen, {provider -> input bytes}, run "
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
                    if worker is None:
                        runs.forget(key)
                        continue
                    # (key, worker, group, work, size, wait, start, stop, start, stop, ...):
                    # ``wait``: seconds the task waited (seceded) at its start for a value
                    # posted to it; neither busy time nor speed evidence
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
            wall, cpu = clock() - t0, cpu_clock() - c0
            cost.hooks += wall
            cost.flush_wall += wall
            cost.flush_cpu += cpu

    def set_providers(self, providers: dict[str, str]) -> None:
        """Worker -> its pool's provider; inputs are tracked while there are several."""
        self._providers = providers
        self._multi_provider = len(set(providers.values())) > 1

    def new_run_inputs(self, run_id: str, keys) -> None:
        """Forget the inputs seen for the groups of ``keys`` in other runs. O(keys)."""
        for group in {key_split(k) for k in keys}:
            seen = self._group_inputs.get(group)
            if seen is not None and seen[2] != run_id:
                self._group_inputs[group] = [0, Counter(), run_id]

    def record_inputs(self, key, worker: str) -> None:
        """Account a finished task's input bytes by provider (run egress, objective prices).
        O(inputs).
        """
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
