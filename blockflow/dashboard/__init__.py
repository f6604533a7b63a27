"""blockflow in the Dask dashboard: a live ``/blockflow`` page and read-only JSON routes
(:class:`~blockflow.dashboard.plugin.DashboardPlugin`)."""

from blockflow.dashboard.plugin import DashboardPlugin
from blockflow.dashboard.state import dashboard_state

__all__ = ["DashboardPlugin", "dashboard_state"]
