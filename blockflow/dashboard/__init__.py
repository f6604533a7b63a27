"""blockflow in the Dask dashboard: a live ``/blockflow`` page and read-only JSON routes.

Installed on the scheduler by :class:`~blockflow.dashboard.plugin.DashboardPlugin`, which
:func:`blockflow.connect` registers beside the rebalancer (and the
``blockflow.scheduling.preload`` preload installs on ``dask scheduler``).
"""

from blockflow.dashboard.plugin import DashboardPlugin
from blockflow.dashboard.state import dashboard_state

__all__ = ["DashboardPlugin", "dashboard_state"]
