"""Read-only JSON routes: ``/blockflow/status.json`` and ``/blockflow/decisions.json`` (GET)."""

from __future__ import annotations

import datetime
import json

from tornado import web

from blockflow.dashboard.state import dashboard_state
from blockflow.scheduling.view import epoch_seconds

__all__ = ["DecisionsHandler", "StatusHandler", "routes"]


class _JSONHandler(web.RequestHandler):
    def initialize(self, dask_server=None, extra=None):
        self.server = dask_server

    def write_error(self, status_code: int, **kwargs) -> None:
        exc = kwargs.get("exc_info", (None, None))[1]
        self._write({"error": getattr(exc, "log_message", None) or self._reason,
                     "status": status_code})

    def _write(self, data) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(data, default=str))


class StatusHandler(_JSONHandler):
    """``GET /blockflow/status.json``: policy, one entry per worker, decision count."""

    def get(self):
        state = dashboard_state(self.server, max_decisions=0)
        del state["decisions"]
        self._write(state)


class DecisionsHandler(_JSONHandler):
    """``GET /blockflow/decisions.json[?since=<time>&limit=N]``: the decision log; ``since``
    in seconds since the epoch or an ISO 8601 datetime (``2026-12-06T10:00:00+00:00``; without
    an offset, the scheduler's local time), each decision's ``time`` in seconds since the
    epoch."""

    def get(self):
        try:
            since = _since(self.get_argument("since", None))
            limit = int(self.get_argument("limit", "1000"))
            if limit < 0:
                raise ValueError(limit)
        except (TypeError, ValueError):
            raise web.HTTPError(400, "since must be seconds since the epoch or an ISO 8601 "
                                     "datetime, limit an int >= 0")
        state = dashboard_state(self.server, since=since, max_decisions=limit)
        self._write({"time": state["time"], "policy": state["policy"],
                     "decisions": state["decisions"]})


def _since(text: str | None) -> float | None:
    """A ``since`` query value as seconds since the epoch (:func:`epoch_seconds`)."""
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = datetime.datetime.fromisoformat(text)
    return epoch_seconds(value)


#: For ``distributed.scheduler.http.routes``-style registration.
routes = [
    ("blockflow/status.json", StatusHandler, {}),
    ("blockflow/decisions.json", DecisionsHandler, {}),
]
