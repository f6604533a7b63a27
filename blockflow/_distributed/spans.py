"""distributed's spans (:mod:`distributed.spans`) for blockflow's runs: annotation and figures."""

from __future__ import annotations

from typing import Any

import dask

__all__ = ["span_annotation", "span_figures"]


def span_annotation(tag: str, span_id: str) -> dict[str, tuple[str, ...]]:
    """The ``span`` annotation of span ``tag`` (id ``span_id``) nested in the open one."""
    outer = dask.get_annotations().get("span") or {}
    names, ids = tuple(outer.get("name", ())), tuple(outer.get("ids", ()))
    if span_id in ids:
        i = ids.index(span_id) + 1
        return {"name": names[:i], "ids": ids[:i]}
    return {"name": (*names, tag), "ids": (*ids, span_id)}


def span_figures(scheduler, span_id: str) -> dict[str, Any] | None:
    """A span's ``name``, ``enqueued``, ``start``, ``stop`` (epoch seconds), ``done``, ``duration``
    (task seconds) and ``nbytes_total``, sub-spans included; None when unavailable."""
    ext = scheduler.extensions.get("spans") if scheduler is not None else None
    span = ext.spans.get(span_id) if ext is not None else None
    if span is None or not any(True for _ in span.traverse_groups()):
        return None  # no task group (yet): Span.stop would fail on an empty max()
    return {"name": list(span.name), "enqueued": span.enqueued, "start": span.start,
            "stop": span.stop, "done": span.done, "duration": span.duration,
            "nbytes_total": span.nbytes_total}
