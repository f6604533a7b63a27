"""Objectives: what a run optimises, "makespan" (the default) or "cost", by a deadline or a
budget.

Guide: :doc:`/guide/pools`, "Objectives".
"""

from __future__ import annotations

import contextlib
import math
import sys
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import dask
from dask.utils import parse_timedelta

__all__ = ["OBJECTIVE_ANNOTATION", "OBJECTIVES", "WARN_TOPIC", "Objective", "objective",
           "objective_scope", "positive_seconds"]

#: The task annotation carrying a run's objective (``Objective.as_dict``).
OBJECTIVE_ANNOTATION = "blockflow_objective"
#: The client event topic a run's missed objective is told on (``{"message", "scope"}``).
WARN_TOPIC = "blockflow-objective-warning"
#: objective scope token -> (file, line, module) of the ``with`` that opened it, this process
_WHERE: dict[str, tuple[str, int, str]] = {}


def _show_warning(event) -> None:
    """Client event handler of :data:`WARN_TOPIC`: the scheduler's message as one
    :class:`~blockflow.errors.BlockflowWarning` pointing at the user's ``with
    blockflow.objective(...)`` line (not at the event loop that received it)."""
    from blockflow.errors import BlockflowWarning

    _, msg = event
    if not isinstance(msg, dict) or not isinstance(msg.get("message"), str):
        return
    where = _WHERE.get(msg.get("scope")) or (next(reversed(_WHERE.values()), None))
    if where is None:
        warnings.warn(msg["message"], BlockflowWarning, stacklevel=2)
    else:
        warnings.warn_explicit(msg["message"], BlockflowWarning, where[0], where[1],
                               module=where[2])


def _listen(scope: str, frame) -> None:
    """Remember where ``scope``'s ``with`` is, and have this process's default client (if
    any) show its run's missed objective (:func:`_show_warning`)."""
    _WHERE[scope] = (frame.f_code.co_filename, frame.f_lineno,
                     frame.f_globals.get("__name__", "__main__"))
    while len(_WHERE) > 1000:
        del _WHERE[next(iter(_WHERE))]
    try:
        from distributed import default_client

        client = default_client()
    except (ImportError, ValueError):  # no client yet: the run gets no client warning
        return
    client.subscribe_topic(WARN_TOPIC, _show_warning)  # idempotent


#: The objective kinds.
OBJECTIVES = ("makespan", "cost")


@dataclass(frozen=True)
class Objective:
    """What a run optimises (see :func:`objective`).

    Attributes
    ----------
    kind : {"makespan", "cost"}
    deadline : float or None
        Seconds from the run's start (cost objective).
    budget : float or None
        Dollars (makespan objective).
    """

    kind: str = "makespan"
    deadline: float | None = None
    budget: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain data (the annotation's value)."""
        return {"kind": self.kind, "deadline": self.deadline, "budget": self.budget}

    @classmethod
    def from_dict(cls, d: Any) -> Objective | None:
        """The objective an annotation (or :meth:`as_dict`) carries; None if it is not one
        (its ``scope`` token aside: see :func:`objective_scope`)."""
        if not isinstance(d, dict) or d.get("kind") not in OBJECTIVES:
            return None
        return cls(d["kind"], d.get("deadline"), d.get("budget"))

    @property
    def needs_prices(self) -> bool:
        """Whether pools' prices matter (a cost objective, or a budget)."""
        return self.kind == "cost" or self.budget is not None

    @contextlib.contextmanager
    def _scope(self, frame) -> Iterator[Objective]:
        # "scope": this ``with`` block's token: graphs submitted inside it are one run, the
        # only run this objective applies to (a graph outside is a run of its own)
        tag = {**self.as_dict(), "scope": uuid.uuid4().hex[:12]}
        _listen(tag["scope"], frame)
        with warnings.catch_warnings(), dask.annotate(**{OBJECTIVE_ANNOTATION: tag}):
            warnings.filterwarnings("ignore", message="Dask annotations .* detected",
                                    category=UserWarning)
            yield self

    def __enter__(self) -> Objective:
        cm = self._scope(sys._getframe(1))
        self.__dict__.setdefault("_stack", []).append(cm)
        return cm.__enter__()

    def __exit__(self, *exc) -> bool | None:
        return self.__dict__["_stack"].pop().__exit__(*exc)


def objective_scope(d: Any) -> str | None:
    """The ``with`` block an objective annotation was given in (a token), or None."""
    scope = d.get("scope") if isinstance(d, dict) else None
    return str(scope) if scope else None


def positive_seconds(value: Any) -> float | None:
    """Seconds in ``value`` (a number or a duration such as ``"10m"``, parsed by
    :func:`dask.utils.parse_timedelta`) when finite and above 0, else None."""
    try:
        seconds = parse_timedelta(value)
    except (TypeError, ValueError, KeyError):  # KeyError: an unknown unit ("soon")
        return None
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        return None
    return float(seconds)


def objective(kind: str = "makespan", *, deadline: str | float | None = None,
              budget: float | None = None) -> Objective:
    """What the computations submitted inside the ``with`` block optimise.

    The graphs submitted inside carry :data:`OBJECTIVE_ANNOTATION` and are one run, planned
    by the LP of :func:`blockflow.pools.plan.plan`; the objective is that run's alone (it ends
    with the run, refused, erred or done; graphs submitted after the block are other runs).

    Parameters
    ----------
    kind : {"makespan", "cost"}, default "makespan"
        ``"cost"``: the cheapest run that meets ``deadline``; ``"makespan"``: the fastest,
        within ``budget`` if given.
    deadline : str or float, optional
        Cost only: seconds (or ``"10m"``) from the run's start.
    budget : float, optional
        Makespan only: dollars (compute plus egress).

    Returns
    -------
    Objective
        A context manager.

    Raises
    ------
    ValueError
        For an unknown kind, a non-positive deadline or budget, or one with the wrong kind.
        Impossible objectives fail the tasks with :class:`blockflow.errors.ObjectiveError`.

    Examples
    --------
    >>> with blockflow.objective("cost", deadline="10m"):  # doctest: +SKIP
    ...     x.compute()
    """
    if kind not in OBJECTIVES:
        raise ValueError(f"blockflow.objective: kind must be one of {', '.join(OBJECTIVES)}, "
                         f"got {kind!r}.")
    if deadline is not None:
        if kind != "cost":
            raise ValueError("blockflow.objective: a deadline goes with the 'cost' objective "
                             "(the cheapest run that meets it); for the fastest run leave it "
                             "out, or give 'makespan' a budget=.")
        seconds = positive_seconds(deadline)
        if seconds is None:
            raise ValueError(f"blockflow.objective: deadline must be a positive duration "
                             f"('10m', 90), got {deadline!r}.")
        deadline = seconds
    if budget is not None:
        if kind != "makespan":
            raise ValueError("blockflow.objective: a budget goes with the 'makespan' "
                             "objective (the fastest run within it); under 'cost' give a "
                             "deadline=.")
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) \
                or not math.isfinite(budget) or budget <= 0:
            raise ValueError(f"blockflow.objective: budget must be a positive number of "
                             f"dollars, got {budget!r}.")
        budget = float(budget)
    return Objective(kind, deadline, budget)
