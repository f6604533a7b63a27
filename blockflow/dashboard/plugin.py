"""The scheduler plugin that installs blockflow's dashboard page and JSON routes."""

from __future__ import annotations

import logging

from distributed.diagnostics.plugin import SchedulerPlugin

from blockflow import _distributed

__all__ = ["DashboardPlugin"]

logger = logging.getLogger(__name__)

PAGE_PATH = "/blockflow"


class DashboardPlugin(SchedulerPlugin):
    """Serve ``/blockflow``, ``/blockflow/status.json`` and ``/blockflow/decisions.json``
    (read-only) from the scheduler; nothing without an HTTP server or Bokeh."""

    name = "blockflow-dashboard"
    idempotent = True

    async def start(self, scheduler) -> None:
        from blockflow.dashboard.routes import routes

        if _distributed.add_http_routes(scheduler, routes):
            if not _distributed.add_dashboard_page(scheduler, PAGE_PATH, _page_doc, "blockflow"):
                logger.info("blockflow: no Bokeh dashboard on this scheduler; JSON routes only")


def _page_doc(scheduler, extra, doc):
    """The page's Bokeh document: Bokeh loads with the first page served, so a scheduler
    without a Bokeh dashboard never imports it."""
    from blockflow.dashboard.page import blockflow_doc

    return blockflow_doc(scheduler, extra, doc)
