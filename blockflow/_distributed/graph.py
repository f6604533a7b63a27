"""Dask's task graph nodes (``dask._task_spec``): what blockflow reads of an optimised graph.

Since Dask 2024.12 an optimised graph maps keys to task-spec nodes (``Task``, ``DataNode``,
``Alias``...) of the private module ``dask._task_spec``; the one use blockflow makes of
their classes (telling a fusion alias from a task) is here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["alias_target", "renamed_task"]


def alias_target(node) -> Any | None:
    """The key ``node`` stands for when it is an ``Alias`` (the node Dask's linear fusion
    leaves at a fused producer's old key), else None."""
    from dask._task_spec import Alias

    return node.target if isinstance(node, Alias) else None


def renamed_task(node, key):
    """The graph node ``node`` under the key ``key`` (``GraphNode.substitute``)."""
    return node.substitute({}, key=key)
