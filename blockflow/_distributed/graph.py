"""Dask's task-spec nodes (``dask._task_spec``): telling a fusion alias from a task."""

from __future__ import annotations

from typing import Any

__all__ = ["alias_target", "renamed_task"]


def alias_target(node) -> Any | None:
    """The key ``node`` stands for when it is a fusion ``Alias``, else None."""
    from dask._task_spec import Alias

    return node.target if isinstance(node, Alias) else None


def renamed_task(node, key):
    """The graph node ``node`` under the key ``key`` (``GraphNode.substitute``)."""
    return node.substitute({}, key=key)
