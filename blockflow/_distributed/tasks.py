"""The scheduler's tasks as plain data: views, held results, running and unsatisfiable tasks."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from dask.utils import key_split

from blockflow._distributed.placement import (
    _declaring_objects,
    _placement,
    _restricted,
    _size_of,
    _working_set,
)
from blockflow._distributed.views import _LazyMapping

__all__ = ["HeldResult", "RunningTask", "TaskView", "group_duration", "held_results",
           "input_sources", "new_task_views", "prefix_duration", "running_tasks", "task_start_inputs",
           "task_states", "unsatisfiable_tasks", "waiting_tasks"]


@dataclass(frozen=True)
class TaskView:
    """One task as policies see it (plain data).

    Attributes
    ----------
    key : str, tuple or int
    group : str
        Its task group (``dask.utils.key_split``).
    state : str
        Scheduler state (``"released"``, ``"waiting"``, ``"processing"``, ...).
    priority : tuple
        Dask's priority (smaller runs first).
    duration : float
        distributed's compute-time estimate at speed 1, seconds.
    duration_measured : bool
        Whether it comes from finished tasks of its prefix (not
        ``distributed.scheduler.unknown-task-duration``).
    input_bytes : int
    restricted : bool
        Carries worker, host or resource restrictions.
    runnable : bool
        Has something to run (not a scattered or pure-data key).
    allowed_workers : frozenset of str or None
        Workers allowed to run it, None for any.
    comm_cost : mapping of str to float
        Seconds to move its missing inputs to each worker
        (:class:`blockflow.scheduling.estimate.LinkBandwidth`, else the scheduler's bandwidth).
    comm_bytes : mapping of str to int
        Bytes of its inputs each worker lacks.
    working_set : int or None
        Declared device memory of its kernel, bytes (``map_blocks(working_set=)``).
    placement : dict or None
        Where its kernel asked to run (``map_blocks(resources=, workers=,
        allow_other_workers=)``).
    """

    key: Any
    group: str
    state: str = "processing"
    priority: tuple = ()
    duration: float = 0.0
    duration_measured: bool = True
    input_bytes: int = 0
    restricted: bool = False
    runnable: bool = True
    allowed_workers: frozenset | None = None
    comm_cost: Mapping[str, float] = field(default_factory=dict)
    comm_bytes: Mapping[str, int] = field(default_factory=dict)
    working_set: int | None = None
    placement: dict | None = None


@dataclass(frozen=True)
class HeldResult:
    """A result held in a worker's memory: its key, size in bytes and the workers holding it."""

    key: Any
    nbytes: int
    holders: frozenset


# scheduler -> prefix name -> the last measured average duration (seconds) of its tasks
_MEASURED: "weakref.WeakKeyDictionary[Any, dict[str, float]]" = weakref.WeakKeyDictionary()
_MEASURED_MAX = 10_000  # prefix names remembered per scheduler


def prefix_duration(scheduler, prefix) -> tuple[float, bool]:
    """``(seconds, measured)``: expected compute time of a task of ``prefix``; whether measured.

    Keeps the last measured average when distributed resets it (``duration_average = -1``).
    """
    memory = _MEASURED.setdefault(scheduler, {})
    average = float(prefix.duration_average)
    if average >= 0:
        if len(memory) >= _MEASURED_MAX and prefix.name not in memory:
            memory.clear()
        memory[prefix.name] = average
        return average, True
    if prefix.name in memory:
        return memory[prefix.name], True
    return float(scheduler._get_prefix_duration(prefix)), False


def group_duration(scheduler, name: str) -> float | None:
    """Expected seconds of a task of prefix ``name`` (:func:`prefix_duration`); None if unknown."""
    prefix = scheduler.task_prefixes.get(name)
    return None if prefix is None else prefix_duration(scheduler, prefix)[0]


def _comm(scheduler, ts, ws, links) -> tuple[float, int]:
    """``(seconds, bytes)`` to send ``ts``'s missing inputs to ``ws`` over the fastest links."""
    has = ws.has_what
    seconds, nbytes = 0.0, 0
    default = float(scheduler.bandwidth)
    for dts in ts.dependencies:
        if dts in has:
            continue
        n = dts.nbytes
        if n <= 0:
            continue
        bw = default
        if links is not None and dts.who_has:
            bw = max(links(ws.address, h.address) for h in dts.who_has)
        seconds += n / bw
        nbytes += n
    return seconds, nbytes


def _task_view(scheduler, ts, thieves=(), links=None) -> TaskView:
    valid = scheduler.valid_workers(ts)
    duration, measured = prefix_duration(scheduler, ts.prefix)
    comm = {ws.address: _comm(scheduler, ts, ws, links) for ws in thieves}
    return TaskView(
        key=ts.key,
        group=key_split(ts.key),
        state=ts.state,
        priority=tuple(ts.priority or ()),
        duration=duration,
        duration_measured=measured,
        input_bytes=sum(dts.nbytes for dts in ts.dependencies if dts.nbytes > 0),
        restricted=_restricted(ts),
        runnable=bool(ts.run_spec),
        allowed_workers=None if valid is None else frozenset(w.address for w in valid),
        comm_cost={a: c[0] for a, c in comm.items()},
        comm_bytes={a: c[1] for a, c in comm.items()},
    )


def task_states(scheduler, keys) -> dict:
    """key -> the scheduler's state of that task; unknown keys left out."""
    out = {}
    for key in keys:
        ts = scheduler.tasks.get(key)
        if ts is not None:
            out[key] = ts.state
    return out


def task_start_inputs(scheduler, key) -> list[tuple[Any, int, tuple]]:
    """``(input key, nbytes, holders)`` of each input of a task that just started processing
    (holders sorted): where its inputs are before the memory manager drops a copy, and
    before the task moves."""
    ts = scheduler.tasks.get(key)
    if ts is None:
        return []
    return [(dep.key, int(dep.nbytes or 0), tuple(sorted(w.address for w in dep.who_has or ())))
            for dep in ts.dependencies]


#: The comm costs of a view that has none (a new task's): one shared, read-only mapping.
_NO_COMM: Mapping = MappingProxyType({})


_NEW_VIEW_DEFAULTS = {"duration": 0.0, "duration_measured": True, "input_bytes": 0,
                      "allowed_workers": None, "comm_cost": _NO_COMM, "comm_bytes": _NO_COMM}


def new_task_views(scheduler, keys) -> list[TaskView]:
    """Views of the tasks of a graph that just arrived, in the order of ``keys``; gone keys
    skipped, no comm costs."""
    out = []
    tasks = scheduler.tasks
    new = object.__new__
    defaults = _NEW_VIEW_DEFAULTS
    for key in keys:
        ts = tasks.get(key)
        if ts is not None:
            run_spec = ts.run_spec
            declaring = _declaring_objects(run_spec) if run_spec else ()
            view = new(TaskView)
            d = view.__dict__
            d.update(defaults)
            # ts.prefix.name is key_split(ts.key): distributed names the prefix so
            d["key"], d["group"], d["state"] = ts.key, ts.prefix.name, ts.state
            d["priority"] = tuple(ts.priority or ())
            d["restricted"] = _restricted(ts)
            d["runnable"] = bool(run_spec)
            d["working_set"] = _working_set(declaring, ts.key) if declaring else None
            d["placement"] = _placement(declaring) if declaring else None
            out.append(view)
    return out


def waiting_tasks(scheduler, *, thieves: list[str] | None = None,
                  stopped: Collection[str] = (),
                  links: Callable[[str, str], float] | None = None
                  ) -> Mapping[str, Iterator]:
    """address -> lazy iterator of :class:`TaskView` of the tasks waiting on that worker, last to
    run first; actors and tasks with a pending move skipped, comm costs to each of ``thieves``.

    Tasks about to start on a free thread are left out; on a ``stopped`` worker every task not
    started is waiting."""
    stealing = scheduler.extensions.get("stealing")
    in_flight = stealing.in_flight if stealing is not None else {}

    def waiting(addr: str) -> Iterator[TaskView]:
        ws = scheduler.workers.get(addr)
        if ws is None:
            return
        targets = [scheduler.workers[a] for a in (thieves or ()) if a in scheduler.workers]
        # not started, highest priority first; the first free threads take the first ones
        # (the executing tasks are not always those of the highest priority: a task that
        # became ready behind a long one waits although it ranks before it)
        pending = sorted((ts for ts in ws.processing if ts not in ws.executing),
                         key=lambda ts: ts.priority or ())
        free = 0 if addr in stopped else max(ws.nthreads - len(ws.executing), 0)
        for ts in reversed(pending[free:]):
            if ts.actor or ts in in_flight or ts.processing_on is not ws:
                continue
            yield _task_view(scheduler, ts, targets, links)

    return _LazyMapping(scheduler.workers, lambda addr: waiting(addr))


def held_results(scheduler) -> Mapping[str, list[HeldResult]]:
    """address -> results held in the worker's memory, largest first (lazily per worker)."""

    def held(addr: str) -> list[HeldResult]:
        ws = scheduler.workers.get(addr)
        if ws is None:
            return []
        return [HeldResult(ts.key, int(ts.nbytes), frozenset(w.address for w in ts.who_has))
                for ts in sorted(ws.has_what, key=lambda t: t.nbytes, reverse=True)]

    return _LazyMapping(scheduler.workers, held)


def unsatisfiable_tasks(scheduler) -> list[tuple[Any, dict]]:
    """``(key, resources)`` of tasks in ``no-worker`` because no connected worker declares their
    resources; empty with no worker; held tasks (:func:`hold_tasks`) excluded."""
    workers = list(scheduler.workers.values())
    if not workers:
        return []
    fits: dict[frozenset, bool] = {}
    out = []
    for ts in list(scheduler.unrunnable):
        need = ts.resource_restrictions
        if not need or ts.loose_restrictions:
            continue
        sig = frozenset(need.items())
        if sig not in fits:
            fits[sig] = any(all((ws.resources or {}).get(r, 0) >= q for r, q in need.items())
                            for ws in workers)
        if not fits[sig]:
            out.append((ts.key, dict(need)))
    return out


# scheduler -> task key -> whether its spec runs a blockflow kernel that may be copied
_KERNEL: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


_KERNEL_MAX = 100_000  # keys remembered per scheduler


@dataclass
class RunningTask:
    """A task a worker is running now, as the speculation rule sees it (plain data).

    Attributes
    ----------
    key : str, tuple or int
    group : str
    elapsed : float
        Seconds running (last heartbeat's report plus the time since).
    duration : float
        distributed's compute-time estimate at speed 1, seconds.
    duration_measured : bool
    input_bytes : int
    kernel : bool
        A blockflow kernel task (only those can have backup copies).
    size : float or None
        Declared work (``blockflow_work``), else input bytes (:func:`task_size`); scales
        ``duration`` (:meth:`blockflow.scheduling.speed.SpeedModel.size_factor`).
    """

    key: Any
    group: str
    elapsed: float
    duration: float
    duration_measured: bool
    input_bytes: int
    kernel: bool
    size: float | None = None


def running_tasks(scheduler, now: float) -> dict[str, list[RunningTask]]:
    """address -> the tasks it still runs (per its last heartbeat), with their elapsed seconds to
    ``now``; ``kernel`` marks copyable blockflow kernels."""
    out: dict[str, list[RunningTask]] = {}
    known = _KERNEL.setdefault(scheduler, {})
    for addr, ws in scheduler.workers.items():
        if not ws.executing:
            continue
        since = max(now - float(getattr(ws, "last_seen", now) or now), 0.0)
        tasks = []
        for ts, duration in list(ws.executing.items()):
            if ts.processing_on is not ws or ts.state != "processing":
                continue
            group = key_split(ts.key)
            # a blockflow kernel that may be copied, also when Dask fused it into a task of
            # another name (``arange-blockflow-f-<token>``); looked for once per task (a
            # task runs for many ticks, and a tick should not walk every running spec)
            kernel = known.get(ts.key)
            if kernel is None:
                kernel = any(getattr(o, "speculative", False)
                             for o in _declaring_objects(ts.run_spec)) if ts.run_spec else False
                if len(known) >= _KERNEL_MAX:
                    known.clear()
                known[ts.key] = kernel
            expected, measured = prefix_duration(scheduler, ts.prefix)
            tasks.append(RunningTask(
                key=ts.key, group=group, elapsed=float(duration) + since,
                duration=expected, duration_measured=measured,
                input_bytes=sum(dts.nbytes for dts in ts.dependencies if dts.nbytes > 0),
                kernel=kernel, size=_size_of(ts)))
        if tasks:
            out[addr] = tasks
    return out


def input_sources(scheduler, keys) -> list[list[tuple[int, tuple[str, ...]]]]:
    """Per task of ``keys`` (gone ones skipped): ``(nbytes, holders)`` of each of its inputs
    in memory, holders sorted."""
    out = []
    for key in keys:
        ts = scheduler.tasks.get(key)
        if ts is None:
            continue
        out.append([(int(dep.nbytes or 0), tuple(sorted(w.address for w in dep.who_has)))
                    for dep in ts.dependencies if dep.who_has])
    return out
