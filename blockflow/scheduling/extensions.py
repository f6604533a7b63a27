"""Scheduler extensions beside blockflow's plugin (``blockflow.scheduler.extensions``)."""

from __future__ import annotations

import importlib

from blockflow import config

__all__ = ["scheduler_extensions"]


def scheduler_extensions(paths: list[str] | None = None) -> list:
    """One instance of each scheduler-plugin class named by dotted path in ``paths`` (default
    ``blockflow.scheduler.extensions``); ``ImportError`` names a path that does not import.
    """
    return [import_object(path)() for path in config.get("scheduler.extensions", paths) or ()]


def import_object(path: str):
    """The object a dotted path ``package.module.name`` names.

    Raises
    ------
    ImportError
        If the module or the name does not exist.
    """
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ImportError(f"blockflow: cannot import {path!r}: {e}") from e
