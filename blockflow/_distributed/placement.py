"""Task placement: what a task's kernels declare, and the restrictions that place or hold it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dask.utils import key_split

from blockflow._distributed.worker import task_wait

__all__ = [
    "HOLD_ADDRESS",
    "WORK_ANNOTATION",
    "finished_task_record",
    "set_task_placement",
    "task_facts",
    "task_placement",
    "task_size",
    "task_work",
    "task_working_set",
]



#: Task annotation ``dask.annotate(blockflow_work=...)``: the work of a task, in units its
#: group shares (rows, say), for groups whose tasks differ in size on purpose.
WORK_ANNOTATION = "blockflow_work"


def task_work(scheduler, key) -> float | None:
    """The positive work ``key`` declared with ``dask.annotate(blockflow_work=...)``, else None."""
    ts = scheduler.tasks.get(key)
    return None if ts is None else _work_of(ts)


def task_facts(scheduler, key) -> tuple[str, float | None, float | None]:
    """``(group, work, size)`` of task ``key`` (:func:`task_work`, :func:`task_size`); ``(group,
    None, None)`` for an unknown key."""
    ts = scheduler.tasks.get(key)
    if ts is None:
        return key_split(key), None, None
    return (ts.prefix.name, *_work_and_size(ts))


def _work_and_size(ts) -> tuple[float | None, float | None]:
    """``(work, size)`` of a ``TaskState`` in one look."""
    work = _work_of(ts) if getattr(ts, "annotations", None) else None
    if work is not None:
        return work, work
    return None, (_input_bytes(ts) if ts.dependencies else None)


def finished_task_record(scheduler, key, worker: str, startstops=None,
                         metadata=None) -> tuple:
    """What the scheduler plugin keeps of a task that finished on ``worker``, as one flat tuple.

    Parameters
    ----------
    scheduler : distributed.Scheduler
    key : str, tuple or int
    worker : str
    startstops : sequence of dict, optional
        The transition's ``{"action", "start", "stop"}`` spans (epoch seconds).
    metadata : dict, optional
        The transition's metadata (:func:`~blockflow._distributed.worker.task_wait`).

    Returns
    -------
    tuple
        ``(key, worker, group, work, size, wait, start, stop, ...)``: :func:`task_facts`, the
        seconds waited, then each ``compute`` span's start and stop.
    """
    ts = scheduler.tasks.get(key)
    if ts is None:
        entry = (key, worker, key_split(key), None, None, 0.0)
    else:
        entry = (key, worker, ts.prefix.name, *_work_and_size(ts), 0.0)
    if startstops:
        for ss in startstops:
            if ss.get("action") == "compute":
                entry += (ss["start"], ss["stop"])
        if metadata and len(entry) > 6:
            wait = task_wait(metadata)
            if wait:
                entry = entry[:5] + (wait,) + entry[6:]
    return entry


def task_size(scheduler, key) -> float | None:
    """Task ``key``'s declared work, else its input bytes; None when neither is known."""
    ts = scheduler.tasks.get(key)
    return None if ts is None else _size_of(ts)


def _work_of(ts) -> float | None:
    """:func:`task_work` of a ``TaskState``."""
    annotations = getattr(ts, "annotations", None)
    work = annotations.get(WORK_ANNOTATION) if annotations else None
    if isinstance(work, (int, float)) and math.isfinite(work) and work > 0:
        return float(work)
    return None


def _input_bytes(ts) -> float | None:
    nbytes = sum(dts.nbytes for dts in ts.dependencies if dts.nbytes > 0)
    return float(nbytes) if nbytes > 0 else None


def _size_of(ts) -> float | None:
    """:func:`task_size` of a ``TaskState``."""
    work = _work_of(ts)
    return work if work is not None else _input_bytes(ts)


def _restricted(ts) -> bool:
    return bool(ts.worker_restrictions or ts.host_restrictions or ts.resource_restrictions)


def task_working_set(run_spec, key, *, max_nodes: int = 256) -> int | None:
    """Device memory (bytes) a task's kernel declared (``map_blocks(working_set=)``), or None."""
    return _working_set(_declaring_objects(run_spec, max_nodes), key)


def _working_set(objects: list, key) -> int | None:
    found = None
    for obj in objects:
        method = getattr(obj, "blockflow_working_set", None)
        if not callable(method):
            continue
        try:
            ws = method(key)
        except Exception:  # a kernel's own bug must not break the scheduler
            ws = None
        if isinstance(ws, int) and ws > 0:
            found = max(found or 0, ws)
    return found


#: Attributes through which a task spec reaches the callables and arguments it holds:
#: ``dask._task_spec`` nodes (func, args, kwargs, value), functools.partial (keywords),
#: toolz's Compose (first, funcs).
_SPEC_ATTRS = ("func", "args", "kwargs", "keywords", "value", "first", "funcs")
_SPEC_LEAVES = (str, bytes, int, float, complex, type(None), type)
#: type -> how to look inside its objects (computed once per type: attribute look-ups that
#: miss are slow, and a graph of 50,000 tasks holds a few dozen types)
_spec_plans: dict[type, tuple] = {}


#: The exact leaf types, not pushed on the walk's stack at all (their subclasses are
#: pushed, and found to be leaves there).
_LEAF_TYPES = frozenset(_SPEC_LEAVES)


def _spec_plan(t: type) -> tuple:
    plan = _spec_plans.get(t)
    if plan is None:
        if issubclass(t, _SPEC_LEAVES):
            plan = ("leaf",)
        elif hasattr(t, "blockflow_working_set") or hasattr(t, "blockflow_placement"):
            plan = ("declares",)
        elif t.__module__ == "dask._task_spec" and t.__name__ == "Task":
            plan = ("task",)  # func, args, kwargs: most nodes of most graphs
        elif issubclass(t, dict):
            plan = ("dict",)
        elif issubclass(t, (list, tuple, set, frozenset)):
            plan = ("seq",)
        else:
            plan = ("obj", tuple(a for a in _SPEC_ATTRS if hasattr(t, a)),
                    bool(getattr(t, "__dictoffset__", 0)))
        if len(_spec_plans) < 10_000:
            _spec_plans[t] = plan
    return plan


def _declaring_objects(run_spec, max_nodes: int = 256) -> list:
    """The objects in a task's spec with a ``blockflow_working_set`` or ``blockflow_placement``
    method, at most ``max_nodes`` nodes searched."""
    stack, seen, found = [run_spec], 0, []
    plans, leaves = _spec_plans, _LEAF_TYPES
    while stack and seen < max_nodes:
        node = stack.pop()
        seen += 1
        plan = plans.get(type(node)) or _spec_plan(type(node))
        kind = plan[0]
        if kind == "leaf":
            continue
        if kind == "declares":
            found.append(node)
        elif kind == "task":
            stack.append(node.func)
            for child in node.args:
                if type(child) not in leaves:
                    stack.append(child)
            if node.kwargs:
                stack.extend(node.kwargs.values())
        elif kind == "dict":
            stack.extend(node.values())
        elif kind == "seq":
            stack.extend(node)
        else:
            for attr in plan[1]:
                child = getattr(node, attr, None)
                if child is not None:
                    stack.append(child)
            if plan[2] and (d := node.__dict__):  # a plain function's is empty
                for attr in _SPEC_ATTRS:
                    if attr in d and attr not in plan[1]:
                        stack.append(d[attr])
    return found


#: The worker restriction that holds a task back (admission control): no worker has this
#: address, so the scheduler keeps the task in "no-worker" until :func:`release_tasks`.
HOLD_ADDRESS = "blockflow-admission://held"


def task_placement(run_spec, *, max_nodes: int = 256) -> dict | None:
    """Where a task's kernels asked to run, or None.

    Fused kernels combine: the largest amount of each resource, the first kernel's workers,
    other workers only if every kernel allows it.

    Returns
    -------
    dict or None
        ``{"resources": dict or None, "workers": tuple or None, "allow_other_workers": bool}``.
    """
    return _placement(_declaring_objects(run_spec, max_nodes))


def _placement(objects: list) -> dict | None:
    found = []
    for obj in objects:
        method = getattr(obj, "blockflow_placement", None)
        if not callable(method):
            continue
        try:
            p = method()
        except Exception:  # a kernel's own bug must not break the scheduler
            p = None
        if p:
            found.append(p)
    if not found:
        return None
    resources: dict[str, float] = {}
    for p in found:
        for r, q in (p.get("resources") or {}).items():
            resources[r] = max(resources.get(r, 0), q)
    workers = next((tuple(p["workers"]) for p in found if p.get("workers")), None)
    return {"resources": resources or None, "workers": workers,
            "allow_other_workers": all(bool(p.get("allow_other_workers")) for p in found)}


def set_task_placement(scheduler, key, placement: Mapping[str, Any]) -> bool:
    """Restrict an unscheduled task as ``placement`` (:func:`task_placement`) asks. False when the
    task is gone or past ``released``/``waiting``."""
    ts = scheduler.tasks.get(key)
    if ts is None or ts.state not in ("released", "waiting"):
        return False
    resources = placement.get("resources")
    if resources:
        ts.resource_restrictions = {**(ts.resource_restrictions or {}), **resources}
    workers = placement.get("workers")
    if workers:
        addresses, hosts = set(), set()
        for w in workers:
            try:
                addresses.add(scheduler.coerce_address(w))
            except (ValueError, OSError):  # not an address: perhaps a host name
                hosts.add(w)
        ts.worker_restrictions = addresses or None
        ts.host_restrictions = hosts or None
    ts.loose_restrictions = bool(placement.get("allow_other_workers"))
    return True
