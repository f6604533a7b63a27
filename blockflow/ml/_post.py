"""Posted arguments: a pass submitted ahead of its parameters, which the client sends later.

Step ``k + 1``'s tasks wait on their workers for a :class:`Posted` value that the client
posts straight to them (``blockflow_post``, :class:`PostPlugin`), keeping the scheduler off
the critical path. Sources: the parameter server (Li et al., OSDI 2014); submitting ahead is
a blockflow heuristic.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from distributed import rejoin, secede

from blockflow._distributed import HandlerPlugin, add_task_wait

__all__ = ["POSTED", "Posted", "PostPlugin", "resolve"]

HANDLER = "blockflow_post"
# Seconds a task waits for its post before it gives up, as cancelled.
POST_TIMEOUT = 300.0
# Slots older than this (seconds) are dropped: their task never ran (released first).
_STALE = 2 * POST_TIMEOUT


class _Posted:
    """Marks, in a pass's ``args``, where the posted value goes (``POSTED``)."""

    def __repr__(self) -> str:
        return "POSTED"


POSTED = _Posted()


class Posted:
    """The placeholder a posted pass's tasks carry: the key its value is posted under."""

    __slots__ = ("key",)

    def __init__(self, key: str | None = None):
        self.key = key or f"blockflow-post-{uuid.uuid4().hex}"

    def __repr__(self) -> str:
        return f"Posted({self.key!r})"

    def __reduce__(self):
        return Posted, (self.key,)


class _Slot:
    __slots__ = ("event", "value", "cancelled", "created")

    def __init__(self):
        self.event = threading.Event()
        self.value: Any = None
        self.cancelled = False
        self.created = time.monotonic()


# (worker address, post key) -> slot: in-process workers share this module
_SLOTS: dict[tuple[str, str], _Slot] = {}
_LOCK = threading.Lock()


def _slot(key: tuple[str, str]) -> _Slot:
    with _LOCK:
        s = _SLOTS.get(key)
        if s is None:
            now = time.monotonic()
            for k in [k for k, v in _SLOTS.items() if now - v.created > _STALE]:
                del _SLOTS[k]
            s = _SLOTS[key] = _Slot()
        return s


def deliver(worker: str, key: str, value: Any = None, cancel: bool = False) -> None:
    """Put ``value`` (or a cancellation) in slot ``key`` on ``worker`` and wake its task."""
    s = _slot((worker, key))
    if cancel:
        s.cancelled = True
    else:
        s.value = value
    s.event.set()


def resolve(worker: str, args: tuple, timeout: float | None = None) -> tuple | None:
    """``args`` with each :class:`Posted` replaced by its value, waiting for it; None when
    cancelled or after ``timeout`` seconds (default :data:`POST_TIMEOUT`)."""
    if not any(isinstance(a, Posted) for a in args):
        return args
    out = []
    for a in args:
        if isinstance(a, Posted):
            s = _slot((worker, a.key))
            ok = s.event.is_set()
            if not ok:
                t0 = time.perf_counter()
                ok = _wait_seceded(s.event, POST_TIMEOUT if timeout is None else timeout)
                # waiting is not work: the scheduler plugin's speed model leaves it out
                add_task_wait(time.perf_counter() - t0)
            with _LOCK:
                _SLOTS.pop((worker, a.key), None)
            if not ok or s.cancelled:
                return None
            a = s.value
        out.append(a)
    return tuple(out)


def _wait_seceded(event: threading.Event, timeout: float) -> bool:
    """Wait for ``event`` seceded from the worker's thread pool, then rejoin."""
    try:
        secede()
    except (KeyError, ValueError, AttributeError):  # not on a worker's task thread
        return event.wait(timeout)
    try:
        return event.wait(timeout)
    finally:
        rejoin()


def _serve(worker, key: str, value: Any = None, cancel: bool = False) -> str:
    deliver(worker.address, key, value, cancel)
    return "OK"


class PostPlugin(HandlerPlugin):
    """Worker plugin serving the ``blockflow_post`` comm handler (name
    ``"blockflow-post"``)."""

    name = "blockflow-post"

    def handlers(self):
        return {HANDLER: _serve}
