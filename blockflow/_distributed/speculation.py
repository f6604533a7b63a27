"""Worker side of backup copies: the plugin serving the copy handlers
(:data:`blockflow.core.speculation.HANDLERS`, imported by dotted path on the worker)."""

from __future__ import annotations

import importlib

from blockflow._distributed.worker import HandlerPlugin

__all__ = ["SpeculationHandlers", "import_object"]

#: Where the handlers live (``fn(worker, **message)`` by RPC operation name).
HANDLERS_PATH = "blockflow.core.speculation.HANDLERS"


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


class SpeculationHandlers(HandlerPlugin):
    """Worker plugin serving the backup-copy RPC handlers on every worker."""

    name = "blockflow-speculation"
    idempotent = True

    def handlers(self):
        return import_object(HANDLERS_PATH)
