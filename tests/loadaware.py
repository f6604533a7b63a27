"""Wall-clock bounds for tests on a loaded machine.

A bound such as "refused within 5 s" holds on an idle machine; on a 2-core box shared with
other jobs the same work takes several times longer. :func:`scaled` stretches a bound by how
contended the CPUs are now (the 1-minute load average per CPU, between 1 and 10), so a test
keeps its meaning (fast, not "waited for the 30 s timeout") without failing for the load.
Set ``BLOCKFLOW_TEST_TIME_SCALE`` to fix the factor (e.g. ``1`` on a quiet machine).

Tests that wait for progress should rather fail when nothing moves for a while (see
``tests/reliability/test_load.py``) than bound the total time.
"""

from __future__ import annotations

import os

__all__ = ["scaled", "time_scale"]

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
