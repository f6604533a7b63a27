"""The unsatisfiable-task rule: warn about, then fail, tasks waiting for resources no worker
declares."""

from __future__ import annotations

from typing import Any

from dask.utils import parse_timedelta

from blockflow import config
from blockflow.scheduling.actions import Action, Decision, Record, Recorded
from blockflow.scheduling.resources import describe_worker_resources
from blockflow.scheduling.rules.base import Rule, RuleContext, some_tasks

__all__ = ["UnsatisfiableRule"]


class UnsatisfiableRule(Rule):
    """Warn about, then fail, tasks waiting for worker resources no worker declares.

    distributed lets them wait forever. A ``wait`` record (and WARNING) once per kind of
    resources, then after ``timeout`` seconds (default
    ``blockflow.resources.unsatisfiable-timeout``) a ``fail`` with
    :class:`~blockflow.errors.ResourceError` unless a worker declaring them joins. Runs on
    ``"tick"``. :attr:`since`: key -> monotonic time first seen; :attr:`failed`: tasks failed.
    """

    def __init__(self, timeout: str | float | None = None):
        self.timeout = parse_timedelta(config.get("resources.unsatisfiable-timeout", timeout))
        self.since: dict[Any, float] = {}
        self.failed = 0

    def run(self, snap, context: RuleContext | None = None) -> list[Decision]:
        if snap.event != "tick":
            return []
        now = snap.monotonic
        waiting = snap.unsatisfiable
        if not waiting and not self.since:
            return []
        current = {key for key, _ in waiting}
        for key in list(self.since):
            if key not in current:
                del self.since[key]  # it ran, failed or was released meanwhile
        started: dict[str, list] = {}
        due: dict[str, tuple[dict, list]] = {}
        for key, need in waiting:
            sig = repr(sorted(need.items()))
            if key not in self.since:
                self.since[key] = now
                started.setdefault(sig, [need, []])[1].append(key)
            elif now - self.since[key] >= self.timeout:
                due.setdefault(sig, (need, []))[1].append(key)
        have = describe_worker_resources(snap.workers)
        out = []
        for need, keys in started.values():
            msg = (f"blockflow: {some_tasks(keys)} need{'s' if len(keys) == 1 else ''} "
                   f"resources {need}, which "
                   f"no worker declares (workers declare: {have}); they fail in "
                   f"{self.timeout:g} s unless such a worker joins")
            out.append(Record(Recorded.WAIT, "", msg, {"resources": need, "tasks": len(keys)},
                                keys=tuple(keys)))
        for need, keys in due.values():
            waited = max(now - min(self.since[k] for k in keys), self.timeout)
            error = (
                f"blockflow: task {keys[0]!r} needs resources {need}, which no worker of the "
                f"cluster declares (waited {waited:.0f} s); the workers declare: {have}. "
                f"Start workers that declare them (dask worker <scheduler> --resources "
                f"{','.join(f'{r}={q:g}' for r, q in need.items())}; blockflow.connect() "
                f"declares GPU=1 on each GPU worker it starts), or drop resources= from the "
                f"kernel. (blockflow.resources.unsatisfiable-timeout sets how long to wait.)")
            for k in keys:
                self.since.pop(k, None)
            out.append(Decision(Action.FAIL, "", self.fail_reason(len(keys), need),
                                {"resources": need, "tasks": len(keys)}, keys=tuple(keys),
                                detail=error))
        return out

    def fail_reason(self, n: int, need: dict) -> str:
        """The logged reason of a ``fail`` decision that failed ``n`` tasks."""
        return (f"{n} tasks needing resources {need} failed after {self.timeout:g} s: no "
                f"worker declares them")

    def status(self) -> dict[str, Any]:
        """Plain data: tasks waiting for resources no worker has, and failed so far."""
        return {"waiting": len(self.since), "failed": self.failed, "timeout": self.timeout}
