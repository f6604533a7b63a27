"""Admission control's read of feeder tasks: where each producer stands, read when asked.

:class:`FeederStates` is the plain-string view the admission rule
(:class:`blockflow.scheduling.rules.AdmissionRule`) reads: key -> state as
:func:`blockflow._distributed.feeder_states` gives it, read from the scheduler on first
access and kept (a rule reads it fully before the plugin applies anything, so it is a
snapshot of one moment). Lazy because a tick reads only the admitted feeders and as many
held ones as the budget has room for, not every held one.
"""

from __future__ import annotations

from typing import Any

from blockflow._distributed.views import feeder_states

__all__ = ["FeederStates", "feeder_state_view"]


class FeederStates:
    """key -> a feeder task's state (``"held"``, ``"orphan"``, ``"pending"``, ``"running"``,
    ``"feeding"``, ``"stored"``, ``"done"``: see
    :func:`blockflow._distributed.feeder_states`), read on first access; any key may be
    asked (a task the scheduler no longer knows reads ``"done"``)."""

    def __init__(self, scheduler):
        self._scheduler = scheduler
        self._cache: dict[Any, str] = {}

    def __getitem__(self, key) -> str:
        try:
            return self._cache[key]
        except KeyError:
            state = self._cache[key] = feeder_states(self._scheduler, [key])[key]
            return state

    def read(self, keys) -> dict:
        """key -> state for each of ``keys`` (one pass over the scheduler's tasks)."""
        missing = [k for k in keys if k not in self._cache]
        if missing:
            self._cache.update(feeder_states(self._scheduler, missing))
        return {k: self._cache[k] for k in keys}


def feeder_state_view(scheduler) -> FeederStates:
    """A :class:`FeederStates` view of ``scheduler``'s tasks."""
    return FeederStates(scheduler)
