"""Scheduler extensions installed beside blockflow's plugin, named by dotted path in
``blockflow.scheduler.extensions`` (the dashboard page by default), so that the scheduler
side names no module above it."""

from __future__ import annotations

from blockflow import config
from blockflow._distributed.speculation import import_object

__all__ = ["scheduler_extensions"]


def scheduler_extensions(paths: list[str] | None = None) -> list:
    """One instance of each configured scheduler extension, in order.

    Parameters
    ----------
    paths : list of str, optional
        Dotted paths of scheduler-plugin classes taking no arguments; default
        ``blockflow.scheduler.extensions``.

    Raises
    ------
    ImportError
        If a path names no importable object (the message names the path).
    """
    return [import_object(path)() for path in config.get("scheduler.extensions", paths) or ()]
