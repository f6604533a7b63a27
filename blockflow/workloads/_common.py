"""Helpers shared by the ready workloads (not public API)."""

from __future__ import annotations

import sys

__all__ = ["show_progress", "task_counts_or_none"]


def task_counts_or_none(client) -> dict[str, int] | None:
    """Tasks finished per worker per blockflow's plugin, or None if the scheduler has none."""
    import blockflow

    try:
        return dict(blockflow.task_counts(client))
    except RuntimeError:  # the scheduler runs no blockflow plugin
        return None


def show_progress(progress: bool | None) -> bool:
    """Whether to draw progress bars: as asked, or (None) when stdout is a terminal."""
    if progress is None:
        return bool(getattr(sys.stdout, "isatty", lambda: False)())
    return bool(progress)
