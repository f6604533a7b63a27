"""Wall-clock bounds for tests on a loaded machine.

A bound such as "refused within 5 s" holds on an idle machine; on a 2-core box shared with
other jobs the same work takes several times longer. :func:`scaled` stretches a bound by how
contended the CPUs are now (the 1-minute load average per CPU, between 1 and 10), so a test
keeps its meaning (fast, not "waited for the 30 s timeout") without failing for the load.
Set ``BLOCKFLOW_TEST_TIME_SCALE`` to fix the factor (e.g. ``1`` on a quiet machine).

Tests that wait for progress should rather fail when nothing moves for a while (see
``tests/reliability/test_load.py``) than bound the total time.

Tests wait for a condition with :func:`wait_until` (or :func:`async_wait_until` inside a
``gen_cluster`` test), never with a hand-written deadline loop: the bound stretches with the
load, and a wait that runs out says what it waited for.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from typing import Any, Callable

import pytest

__all__ = ["async_wait_until", "scaled", "time_scale", "wait_until"]

MAX_SCALE = 10.0


def time_scale() -> float:
    """How many times slower than an idle machine this one runs now, 1 to 10."""
    fixed = os.environ.get("BLOCKFLOW_TEST_TIME_SCALE")
    if fixed:
        return float(fixed)
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        return 1.0
    return min(max(load, 1.0), MAX_SCALE)


def scaled(seconds: float, *, at_most: float | None = None) -> float:
    """``seconds`` stretched by :func:`time_scale`, optionally capped at ``at_most`` (keep a
    "fails fast" bound below the timeout it must not wait for)."""
    bound = seconds * time_scale()
    return bound if at_most is None else min(bound, at_most)


def _timed_out(bound: float, timeout: float, message: str | Callable[[], str]) -> None:
    what = message() if callable(message) else message
    pytest.fail(f"timed out after {bound:.1f} s ({timeout:g} s scaled to the machine's load) "
                f"waiting for {what}")


def wait_until(predicate: Callable[[], Any], *, timeout: float = 30, interval: float = 0.05,
               message: str | Callable[[], str] = "condition") -> Any:
    """Poll ``predicate`` until it returns something true (returned); fail the test when it has not
    after ``timeout`` seconds stretched by the load (:func:`scaled`).

    Parameters
    ----------
    predicate : callable
        No arguments; may itself assert (a process that must stay alive meanwhile), which
        fails the test at once.
    timeout : float, default 30
        Seconds on an idle machine.
    interval : float, default 0.05
        Seconds between polls.
    message : str or callable, default "condition"
        What is waited for, in the failure ``"timed out after ... waiting for <message>"``;
        a callable is called then (to show the state at that moment).

    Returns
    -------
    object
        The predicate's first true value.

    Raises
    ------
    pytest.fail.Exception
        When the time is up (the predicate is tried once more first).
    """
    bound = scaled(timeout)
    deadline = time.monotonic() + bound
    while not (value := predicate()):
        if time.monotonic() > deadline:
            _timed_out(bound, timeout, message)
        time.sleep(interval)
    return value


async def async_wait_until(predicate: Callable[[], Any], *, timeout: float = 30,
                           interval: float = 0.01,
                           message: str | Callable[[], str] = "condition") -> Any:
    """:func:`wait_until` for coroutines (``gen_cluster`` tests): sleeps with
    ``asyncio.sleep`` so the event loop (scheduler, workers) runs meanwhile, and ``predicate``
    may be a coroutine function (``lambda: c.run(...)`` results are awaited)."""
    bound = scaled(timeout)
    deadline = time.monotonic() + bound
    while True:
        ok = predicate()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return ok
        if time.monotonic() > deadline:
            _timed_out(bound, timeout, message)
        await asyncio.sleep(interval)
