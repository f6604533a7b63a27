"""Worker resources as people read them: what the workers declare, for messages."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

__all__ = ["describe_worker_resources", "logger"]

#: Where tasks waiting for, and failed for, missing resources are reported (WARNING, ERROR).
logger = logging.getLogger(__name__)


def describe_worker_resources(workers: Mapping[str, Any], limit: int = 4) -> str:
    """What the workers declare: ``"{'FPGA': 1} (tcp://10.0.0.5:40000); none (3 workers)"``."""
    if not workers:
        return "no worker is connected"
    groups: dict[str, list[str]] = {}
    for addr, w in sorted(workers.items()):
        res = dict(getattr(w, "resources", w) or {})
        groups.setdefault(repr(res) if res else "none", []).append(addr)
    parts = []
    for what, addrs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        who = (", ".join(addrs[:limit]) + (f" and {len(addrs) - limit} more"
                                           if len(addrs) > limit else "")
               if what != "none" or len(addrs) == 1 else f"{len(addrs)} workers")
        parts.append(f"{what} ({who})")
    return "; ".join(parts)
