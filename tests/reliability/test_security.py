"""Security: TLS with temporary credentials, clients without them refused, a localhost-only
dashboard, read-only HTTP routes, and no plugin handler that runs client-supplied code."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import dask.array as da
import pytest
from distributed import Client, LocalCluster, Security
from loadaware import scaled

import blockflow
from blockflow.scheduling.view import workers_info
from blockflow.dashboard.plugin import DashboardPlugin
from blockflow.scheduling import Rebalancer


@pytest.fixture(scope="module")
def tls_client():
    client = blockflow.connect(security="temporary", gpu=False, n_workers=1,
                               threads_per_worker=1, policy="off")  # default dashboard
    yield client
    client.shutdown()
    client.close()


@pytest.mark.slow
def test_temporary_security_runs_the_embedded_cluster_on_tls(tls_client):
    assert tls_client.scheduler.address.startswith("tls://127.0.0.1:")
    workers = workers_info(tls_client)
    assert workers and all(a.startswith("tls://127.0.0.1:") for a in workers)
    x = blockflow.map_blocks(lambda b: b * 2, da.ones(10, chunks=5))
    assert tls_client.compute(x.sum()).result() == 20
    assert blockflow.plugin_status(tls_client)["policy"] == "off"


def _client_ids(dask_scheduler=None) -> list[str]:
    return sorted(dask_scheduler.clients)


@pytest.mark.parametrize("how", ["plain-tcp", "tls-without-credentials", "other-credentials"])
def test_a_client_without_the_credentials_is_refused(tls_client, how):
    address = tls_client.scheduler.address
    if how == "plain-tcp":
        kwargs = {"address": address.replace("tls://", "tcp://")}
    elif how == "tls-without-credentials":
        kwargs = {"address": address}
    else:
        kwargs = {"address": address, "security": Security.temporary()}  # another CA
    clients = tls_client.run_on_scheduler(_client_ids)
    start = time.monotonic()
    with pytest.raises(Exception):  # OSError, TimeoutError, TypeError: distributed's choice
        Client(timeout=3, **kwargs)
    assert time.monotonic() - start < scaled(30)
    assert tls_client.run_on_scheduler(_client_ids) == clients  # it never got in


def test_blockflow_connect_to_a_tls_scheduler_needs_its_credentials(tls_client):
    address = tls_client.scheduler.address
    with pytest.raises(OSError, match=r"Check that security= holds the CA and client "
                                      r"certificate that cluster trusts"):
        blockflow.connect(address, security=Security.temporary(), timeout=3)
    with blockflow.connect(address, security=tls_client.cluster.security) as other:
        assert blockflow.plugin_status(other)["policy"] == "off"


def test_plain_tcp_to_a_tls_scheduler_fails_fast_and_says_to_use_tls(tls_client):
    address = tls_client.scheduler.address.replace("tls://", "tcp://")
    start = time.monotonic()
    with pytest.raises(OSError) as info:
        blockflow.connect(address, timeout=60)
    assert time.monotonic() - start < scaled(5, at_most=50)  # never waits for the timeout
    assert str(info.value) == (
        f"blockflow.connect: the server at {address!r} talks TLS, and hung up on (or ignored) "
        f"a plain connection. Connect to {tls_client.scheduler.address!r} with "
        f"security=distributed.Security(...) holding credentials that cluster trusts.")


def test_credentials_that_require_encryption_need_a_tls_address(tls_client):
    address = tls_client.scheduler.address.replace("tls://", "tcp://")
    with pytest.raises(ValueError) as info:
        blockflow.connect(address, security=tls_client.cluster.security, timeout=5)
    assert str(info.value) == (
        f"blockflow.connect: security= requires encryption, but {address!r} is a tcp:// "
        f"address, which is not encrypted; connect to the scheduler's tls:// address (the "
        f"scheduler prints it), e.g. {tls_client.scheduler.address!r}.")


def _dashboard_sockets(dask_scheduler=None) -> list:
    return [s.getsockname()[:2] for s in dask_scheduler.http_server._sockets.values()]


def test_the_dashboard_listens_on_localhost_only(tls_client):
    assert blockflow.config.defaults["blockflow"]["cluster"]["dashboard-address"].startswith(
        "127.0.0.1:")
    sockets = tls_client.run_on_scheduler(_dashboard_sockets)
    assert sockets and {host for host, _ in sockets} == {"127.0.0.1"}


@pytest.mark.parametrize("path", ["blockflow/status.json", "blockflow/decisions.json"])
@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_blockflow_http_routes_are_read_only(tls_client, path, method):
    url = tls_client.dashboard_link.replace("/status", "/" + path)
    assert url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200 and json.loads(r.read())["policy"] == "off"
    request = urllib.request.Request(url, method=method, data=b"{}")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 405


@pytest.mark.slow
def test_the_plugins_add_two_handlers_and_no_stream_handler():
    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as c:
        s = cluster.scheduler
        handlers, stream = set(s.handlers), set(s.stream_handlers)
        c.register_plugin(Rebalancer(policy="dynamic", interval=0))
        c.register_plugin(DashboardPlugin())
        # blockflow_status reads; blockflow_pool_targets is PoolAdaptive's question (it may
        # retire an idle worker of a pool above its target, as distributed's own
        # adaptive_target + retire_workers handlers let any client of the scheduler do)
        assert set(s.handlers) - handlers == {"blockflow_status", "blockflow_pool_targets"}
        assert set(s.stream_handlers) == stream
        status = c.sync(c.scheduler.blockflow_status, since=0.0, task_log=True)
        assert status["policy"] == "dynamic"
        with pytest.raises(TypeError):  # no other parameters: nothing to smuggle code through
            c.sync(c.scheduler.blockflow_status, policy="off")
        assert s.plugins["blockflow-rebalancer"].policy_name == "dynamic"
