"""The scheduler plugin's own cost: seconds on the scheduler's event loop (status ``cost``)."""

from __future__ import annotations

import statistics
from collections import deque
from time import perf_counter as clock
from time import thread_time as cpu_clock
from typing import Any

__all__ = ["PluginCost", "clock", "cpu_clock"]


class PluginCost:
    """Seconds the scheduler plugin spent in its hooks and ticks.

    Attributes
    ----------
    hooks, tick_total, tick_max : float
        Seconds in the per-task hooks, in all ticks, in the longest tick.
    ticks : deque of float
        Seconds of the latest :attr:`max_ticks` ticks.
    tick_count, hook_calls : int
        Ticks, and timed ``transition`` calls.
    hook_cpu_sampled, graph_cpu, tick_cpu : float
        Thread CPU seconds: sampled ``transition`` calls (one in :attr:`sample_every`),
        ``update_graph``, ticks.
    flush_wall, flush_cpu : float
        Seconds folding in finished tasks (counted in :attr:`hooks`).
    """

    #: Tick durations kept for the median.
    max_ticks = 10_000
    #: One ``transition`` call in this many (a power of 2) also reads the thread's CPU time.
    sample_every = 32

    def __init__(self):
        self.hooks = 0.0
        self.ticks: deque[float] = deque(maxlen=self.max_ticks)
        self.tick_total = 0.0
        self.tick_max = 0.0
        self.tick_count = 0
        self.hook_calls = 0
        self.hook_cpu_sampled = 0.0
        self.hook_samples = 0
        self.graph_cpu = 0.0
        self.tick_cpu = 0.0
        self.flush_wall = 0.0
        self.flush_cpu = 0.0
        self.tick_full_gc = 0
        self.tick_max_without_gc = 0.0

    def sampled(self) -> bool:
        """Count a ``transition`` call; whether this one reads the CPU time too."""
        self.hook_calls += 1
        return not self.hook_calls & (self.sample_every - 1)

    def tick(self, seconds: float, cpu: float = 0.0, full_gc: bool = False) -> None:
        """Record one tick of ``seconds`` (``cpu``: thread CPU seconds; ``full_gc``: a full garbage
        collection ran during it).
        """
        self.ticks.append(seconds)
        self.tick_total += seconds
        self.tick_cpu += cpu
        self.tick_count += 1
        if seconds > self.tick_max:
            self.tick_max = seconds
        if full_gc:
            self.tick_full_gc += 1
        elif seconds > self.tick_max_without_gc:
            self.tick_max_without_gc = seconds

    def as_dict(self, tasks: int) -> dict[str, Any]:
        """Plain data: totals, per finished task (``tasks``) and per tick.

        Returns
        -------
        dict
            ``tasks``, ``hook_seconds``, ``per_task_us`` (microseconds), ``tick_count``,
            ``tick_seconds``, ``tick_ms_median``, ``tick_ms_max``, ``tick_ms_max_without_full_gc``
            (milliseconds), ``ticks_with_full_gc``, ``all_in_per_task_us``, ``hook_cpu_seconds``,
            ``cpu_per_task_us``, ``tick_cpu_seconds``; per-task and per-tick values None before
            the first.
        """
        ticks = list(self.ticks)
        hook_cpu = self.graph_cpu + self.flush_cpu + (self.hook_cpu_sampled / self.hook_samples * self.hook_calls
                                     if self.hook_samples else 0.0)
        return {
            "hook_cpu_seconds": hook_cpu,
            "cpu_per_task_us": 1e6 * hook_cpu / tasks if tasks else None,
            "tick_cpu_seconds": self.tick_cpu,
            "tasks": tasks,
            "hook_seconds": self.hooks,
            "per_task_us": 1e6 * self.hooks / tasks if tasks else None,
            "tick_count": self.tick_count,
            "tick_seconds": self.tick_total,
            "tick_ms_median": 1e3 * statistics.median(ticks) if ticks else None,
            "tick_ms_max": 1e3 * self.tick_max if ticks else None,
            "tick_ms_max_without_full_gc": 1e3 * self.tick_max_without_gc if ticks else None,
            "ticks_with_full_gc": self.tick_full_gc,
            "all_in_per_task_us": 1e6 * (self.hooks + self.tick_total) / tasks
            if tasks else None,
        }
