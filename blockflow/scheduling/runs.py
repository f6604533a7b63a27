"""Runs: the one meaning of "this run" in blockflow (CLI, dashboard, ``manifest.json``).

A run is everything one job (:func:`run_scope`) or one ``compute()`` submitted that was not
already in memory. Guide: :doc:`/guide/scheduling`, "Runs".
"""

from __future__ import annotations

import contextlib
import uuid
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import dask
from dask.utils import key_split

from blockflow._distributed.spans import span_annotation
from blockflow.pools.objective import OBJECTIVE_ANNOTATION, Objective, objective_scope

__all__ = ["RUN_ANNOTATION", "Run", "RunTracker", "new_run_id", "run_scope"]

#: The task annotation that carries a run's id and name (``{"id": ..., "name": ...}``), a
#: global annotation (optimisation cannot drop it). Not the span's: distributed moves a task
#: to the span of an earlier task group of the same name (two ``client.map(f, ...)``).
RUN_ANNOTATION = "blockflow_run"

# Task states that will still run; a key in "memory" or "erred" was computed (or failed)
# before this graph asked for it.
_TO_RUN = frozenset({"released", "waiting", "queued", "processing", "no-worker"})


def new_run_id(name: str) -> str:
    """A fresh run id: ``name`` plus a random suffix."""
    return f"{name}-{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def run_scope(name: str, run_id: str | None = None) -> Iterator[str]:
    """Count every graph submitted inside the block as one run named ``name`` (default id
    :func:`new_run_id`, or continue ``run_id``), in a :func:`distributed.span` of the same name
    and id.

    Yields
    ------
    str
        The run's id.
    """
    run_id = run_id or new_run_id(name)
    tag = {RUN_ANNOTATION: {"id": run_id, "name": name}}
    with warnings.catch_warnings(), dask.annotate(span=span_annotation(name, run_id), **tag):
        # dask.dataframe warns that annotations are ignored with query planning: that is
        # about annotations on its expressions; a global annotation travels with the graph.
        warnings.filterwarnings("ignore", message="Dask annotations .* detected",
                                category=UserWarning)
        yield run_id


@dataclass
class Run:
    """One run as the scheduler plugin saw it (see the module docstring)."""

    id: str
    name: str
    client: str | None
    started: float  # seconds since the epoch
    graphs: int = 0  # graphs submitted to it
    tasks: int = 0  # tasks its graphs submitted that were not already in memory
    pending: int = 0  # of those, not finished (nor forgotten) yet
    counts: Counter = field(default_factory=Counter)  # worker -> task executions finished
    objective: Objective | None = None  # blockflow.objective(...) it was submitted under
    scope: str | None = None  # that with-block's token (objective_scope)
    group_pending: Counter = field(default_factory=Counter)  # task group -> not finished
    group_tasks: Counter = field(default_factory=Counter)  # task group -> tasks given
    # worker -> [first start, last stop] of its task executions in this run (billing)
    spans: dict = field(default_factory=dict)
    # worker -> seconds its task executions in this run took (busy time within its span)
    busy: Counter = field(default_factory=Counter)
    # worker -> dollars of that busy time at the prices in force as the tasks ran
    busy_cost: Counter = field(default_factory=Counter)
    # worker -> seconds within its span here that other runs' tasks took (billed to them)
    shared: Counter = field(default_factory=Counter)
    # (from provider, to provider) -> input bytes tasks read across providers
    crossings: Counter = field(default_factory=Counter)
    ended: float | None = None  # when its last pending task finished
    last_graph: float = 0.0  # when it was last given a graph (seconds since the epoch)

    @property
    def deadline_at(self) -> float | None:
        """Seconds since the epoch by which a cost objective wants the run finished."""
        o = self.objective
        return None if o is None or o.deadline is None else self.started + o.deadline

    def as_dict(self) -> dict[str, Any]:
        """Plain data: the fields (``busy`` aside), ``finished`` and ``deadline_at``."""
        return {"id": self.id, "name": self.name, "client": self.client,
                "started": self.started, "graphs": self.graphs, "tasks": self.tasks,
                "pending": self.pending, "finished": sum(self.counts.values()),
                "counts": dict(self.counts),
                "objective": self.objective.as_dict() if self.objective else None,
                "deadline_at": self.deadline_at,
                "group_pending": {g: n for g, n in self.group_pending.items() if n > 0},
                "group_tasks": dict(self.group_tasks),
                "spans": {w: list(s) for w, s in self.spans.items()},
                "crossings": [[a, b, n] for (a, b), n in self.crossings.items()],
                "ended": self.ended}


class RunTracker:
    """Runs the scheduler has seen, and the run of each task not yet forgotten (per-task methods
    O(1)). ``max_runs``: runs remembered (least recently used forgotten first);
    ``span_figures``: span id -> distributed's figures on it, added by :meth:`get`.
    """

    def __init__(self, max_runs: int = 1000,
                 span_figures: Callable[[str], dict | None] | None = None):
        self.max_runs = max_runs
        self.span_figures = span_figures
        self.runs: OrderedDict[str, Run] = OrderedDict()
        self.current: str | None = None  # the run most recently given tasks
        self._key_run: dict[Hashable, str] = {}
        self._pending: set[Hashable] = set()  # keys given to a run, not finished yet
        # (client, objective scope or None) -> its latest untagged run
        self._client_run: dict[tuple, str] = {}
        self._open: dict[str, Run] = {}  # runs with tasks pending
        self._untagged = 0

    def graph(self, *, client: str | None, states: Mapping[Hashable, str],
              annotations: Mapping[str, Mapping[Hashable, Any]], now: float) -> Run | None:
        """Give a graph just received to a run: the one its annotation names, else the run of
        its :func:`blockflow.objective` block, else its client's run while that has tasks
        pending and no objective, else a new one.

        An objective is its run's: a graph submitted outside the ``with`` block is never
        given to the block's run (nor a graph of another block), so nothing submitted later
        runs under it. ``states``: key -> scheduler state of each task the graph touched;
        ``annotations``: name -> key -> value; ``now``: seconds since the epoch. Returns None
        if the graph had nothing to run and named no run.
        """
        tag = next(iter((annotations.get(RUN_ANNOTATION) or {}).values()), None)
        given = next(iter((annotations.get(OBJECTIVE_ANNOTATION) or {}).values()), None)
        goal, scope = Objective.from_dict(given), objective_scope(given)
        new = [k for k, s in states.items()
               if s in _TO_RUN and (s == "released" or k not in self._key_run)]
        if isinstance(tag, Mapping) and tag.get("id"):
            run_id, name = str(tag["id"]), str(tag.get("name") or tag["id"])
        else:
            slot = (client, scope if goal is not None else None)
            open_run = self.runs.get(self._client_run.get(slot))
            if open_run is not None and (scope is not None and goal is not None
                                         or open_run.pending > 0):
                run_id, name = open_run.id, open_run.name  # the same block, or computing
            elif not new:
                return None  # nothing to run, and no run to add it to
            else:
                self._untagged += 1
                run_id, name = f"compute-{self._untagged}", "a compute()"
            self._client_run[slot] = run_id
        run = self.runs.get(run_id)
        if run is None:
            run = self.runs[run_id] = Run(id=run_id, name=name, client=client, started=now)
            while len(self.runs) > self.max_runs:
                old = self.runs.popitem(last=False)[1]
                self._open.pop(old.id, None)
                for slot in [s for s, r in self._client_run.items() if r == old.id]:
                    del self._client_run[slot]
        self.runs.move_to_end(run_id)
        for key in new:
            self._unpend(key)  # a key given to another run before is this run's now
            self._key_run[key] = run_id
            self._pending.add(key)
            group = key_split(key)
            run.group_pending[group] += 1
            run.group_tasks[group] += 1
        if goal is not None:
            run.objective, run.scope = goal, scope
        if new:
            run.ended = None
        run.graphs += 1
        run.last_graph = now
        run.tasks += len(new)
        run.pending += len(new)
        if run.pending > 0:
            self._open[run_id] = run
        self.current = run_id
        return run

    def latest_of(self, client: str) -> str | None:
        """The id of the run ``client`` most recently gave work, or None. O(runs)."""
        return next((r.id for r in reversed(self.runs.values()) if r.client == client), None)

    def objective_runs(self) -> list[Run]:
        """The runs under an objective with tasks still to run, oldest first."""
        return [r for r in self.runs.values() if r.objective is not None and r.pending > 0]

    def objective_run(self) -> Run | None:
        """The run most recently given work if it runs under an objective, else the latest
        run under one with tasks still to run; None if none."""
        run = self.run_of(self.current)
        if run is not None and run.objective is not None:
            return run
        runs = self.objective_runs()
        return runs[-1] if runs else None

    def _unpend(self, key: Hashable) -> None:
        if key in self._pending:
            self._pending.discard(key)
            run = self.runs.get(self._key_run.get(key))
            if run is not None:
                run.pending -= 1
                if run.pending <= 0:
                    self._open.pop(run.id, None)
                group = key_split(key)
                run.group_pending[group] -= 1
                if run.group_pending[group] <= 0:
                    del run.group_pending[group]

    def erred(self, key: Hashable, now: float) -> None:
        """A task of a run erred (or was refused): it will not run, so its run does not wait
        for it (``now``: seconds since the epoch, its end if it was the last)."""
        run = self.runs.get(self._key_run.get(key))
        if key in self._pending:
            self._unpend(key)
            if run is not None and run.pending <= 0 and run.ended is None:
                run.ended = now

    def run_id(self, key: Hashable) -> str | None:
        """The id of the run a task was given to; None if none, or forgotten since."""
        return self._key_run.get(key)

    def finished(self, key: Hashable, worker: str) -> None:
        """A task finished on ``worker`` (processing -> memory)."""
        run = self.runs.get(self._key_run.get(key))
        if run is not None:
            run.counts[worker] += 1
        self._unpend(key)

    def executed(self, key: Hashable, worker: str, start: float, stop: float,
                 dollars: float | None = None) -> None:
        """Widen ``worker``'s billed span in the task's run (times: seconds since the epoch);
        ``dollars``: what the execution cost at the prices in force as it ran."""
        run = self.runs.get(self._key_run.get(key))
        if run is None:
            return
        span = run.spans.get(worker)
        if span is None:
            run.spans[worker] = [start, stop]
        else:
            span[0], span[1] = min(span[0], start), max(span[1], stop)
        run.busy[worker] += max(stop - start, 0.0)
        if dollars is not None:
            run.busy_cost[worker] += dollars
        for other in self._open.values():  # runs at once: each billed its own use
            span = other.spans.get(worker) if other is not run else None
            if span is not None and stop > max(start, span[0]):
                other.shared[worker] += stop - max(start, span[0])
        if run.pending <= 1:
            run.ended = stop

    def crossed(self, key: Hashable, src: str, dst: str, nbytes: int) -> None:
        """``nbytes`` of the task's inputs came from provider ``src`` to ``dst``."""
        run = self.runs.get(self._key_run.get(key))
        if run is not None:
            run.crossings[(src, dst)] += int(nbytes)

    def run_of(self, run_id: str | None) -> Run | None:
        """The :class:`Run` itself (the plugin's rules read it), or None."""
        return self.runs.get(run_id) if run_id is not None else None

    def forget(self, key: Hashable) -> None:
        """The scheduler forgot the task."""
        self._unpend(key)
        self._key_run.pop(key, None)

    def get(self, run_id: str | None) -> dict[str, Any] | None:
        """A run as plain data (with ``span`` where distributed has it), or None."""
        run = self.run_of(run_id)
        span = run is not None and self.span_figures is not None and self.span_figures(run.id)
        return None if run is None else {**run.as_dict(), **({"span": span} if span else {})}

    def current_run(self) -> dict[str, Any] | None:
        """The run most recently given tasks, as plain data, or None."""
        return self.get(self.current)
