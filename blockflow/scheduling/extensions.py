"""Scheduler extensions installed beside blockflow's plugin (``blockflow.scheduler.extensions``)."""

from __future__ import annotations

from blockflow import config
from blockflow._distributed.speculation import import_object

__all__ = ["scheduler_extensions"]


def scheduler_extensions(paths: list[str] | None = None) -> list:
    """One instance of each configured scheduler extension, in order.

    Parameters
    ----------
    paths : list of str, optional
        Dotted paths of argument-free scheduler-plugin classes; default
        ``blockflow.scheduler.extensions``.

    Raises
    ------
    ImportError
        If a path names no importable object.
    """
    return [import_object(path)() for path in config.get("scheduler.extensions", paths) or ()]
