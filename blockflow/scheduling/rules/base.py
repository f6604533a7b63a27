"""The rule interface: plain data in, commands and records out, as distributed's AMM policies."""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dask.utils import format_bytes

from blockflow.scheduling.actions import Decision, Record

if TYPE_CHECKING:  # annotations only: policies.py imports the rules
    from blockflow.scheduling.policies import ClusterSnapshot

__all__ = ["Rule", "RuleContext"]


@dataclass
class RuleContext:
    """What the rules of one policy tell each other about one snapshot.

    Attributes
    ----------
    paused_now : set of str
        Workers paused or held by an earlier rule (no new work for them).
    taken : set of str
        Workers a waiting task moves to (no free thread for a backup copy).
    """

    paused_now: set = field(default_factory=set)
    taken: set = field(default_factory=set)


class Rule(abc.ABC):
    """One scheduling rule; subclasses implement :meth:`run`."""

    @abc.abstractmethod
    def run(self, snapshot: ClusterSnapshot,
            context: RuleContext) -> Iterable[Decision | Record]:
        """The commands and records for ``snapshot`` (a list or an iterator)."""


def fmt_bytes(n: float) -> str:
    return format_bytes(int(n))


def fmt_seconds(seconds: float) -> str:
    return "never (paused)" if math.isinf(seconds) else f"{seconds:.3f}s"


def some_tasks(keys: list) -> str:
    """``"N task(s) (e.g. 'key')"``: the start of a message about ``keys`` (non-empty)."""
    return f"{len(keys)} task{'s' if len(keys) != 1 else ''} (e.g. {keys[0]!r})"
