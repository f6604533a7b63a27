"""A worker's own shutdown is not logged as a failed heartbeat (dask/distributed#7192).

``Worker.close`` closes its pooled comms under a heartbeat still in flight, and the worker
logs "Failed to communicate with scheduler during heartbeat." at ERROR with a traceback:
after a successful ``blockflow run``, on stderr. blockflow's filter drops that record while a
worker of the process is closing, and only then.
"""

from __future__ import annotations

import logging

from distributed.core import Status
from distributed.utils_test import gen_cluster

import blockflow  # noqa: F401  (loads blockflow's settings before gen_cluster copies them)
from blockflow import _distributed
from blockflow.cluster.connection import connect


def _record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1, msg, None, None)


@gen_cluster(nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)])
async def test_the_cut_heartbeat_is_dropped_only_while_a_worker_closes(s, a, b):
    _distributed.quiet_closing_heartbeat(a)
    _distributed.quiet_closing_heartbeat(a)  # idempotent: one filter per process
    _distributed.quiet_closing_heartbeat(b)
    logger = logging.getLogger("distributed.worker")
    filters = [f for f in logger.filters if isinstance(f, _distributed._ClosingHeartbeatFilter)]
    assert len(filters) == 1
    (f,) = filters
    cut, other = _record(_distributed.HEARTBEAT_FAILED), _record("Something else failed.")
    assert f.filter(cut) and f.filter(other)  # both running: a real failure shows
    a.status = Status.closing  # the state Worker.close is in when it cuts the heartbeat
    try:
        assert not f.filter(cut) and f.filter(other)
    finally:
        a.status = Status.running
    assert f.filter(cut)


def test_connect_installs_it_on_the_workers_of_the_cluster_it_starts():
    def installed(dask_worker):
        return "blockflow-quiet-close" in dask_worker.plugins

    with connect(n_workers=1, threads_per_worker=1, processes=False, gpu=False,
                 dashboard_address=":0") as client:
        assert all(client.run(installed).values())
