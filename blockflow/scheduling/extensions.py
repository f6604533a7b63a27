"""Scheduler extensions beside blockflow's plugin (``blockflow.scheduler.extensions``)."""

from __future__ import annotations

from blockflow import config
from blockflow._distributed.speculation import import_object

__all__ = ["scheduler_extensions"]


def scheduler_extensions(paths: list[str] | None = None) -> list:
    """One instance of each scheduler-plugin class named by dotted path in ``paths`` (default
    ``blockflow.scheduler.extensions``); ``ImportError`` names a path that does not import.
    """
    return [import_object(path)() for path in config.get("scheduler.extensions", paths) or ()]
