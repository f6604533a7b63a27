"""connect(address) at things that are not a Dask scheduler: one line, within the bound.

Real sockets on 127.0.0.1: an HTTP server, servers that send garbage, stay silent or hang
up, TLS on one side only, a refused port, a worker, and a scheduler that starts late. Time
bounds are generous (a loaded 2-core machine); what is asserted is the message, and that
a fast failure does not wait for the timeout.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import os
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time

import dask
import pytest
from distributed import LocalCluster, Security

import blockflow

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """A TCP server on a free port whose ``handle(sock)`` runs for each connection."""

    def __init__(self, handle):
        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                handle(self.request)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.address = f"tcp://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(handle):
        servers.append(_Server(handle))
        return servers[-1].address

    yield start
    for s in servers:
        s.close()


def _connect_error(address: str, **kwargs) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(OSError) as info:
        blockflow.connect(address, **kwargs)
    took = time.monotonic() - start
    text = str(info.value)
    assert "\n" not in text and text.startswith("blockflow.connect: ")
    assert not isinstance(info.value.__cause__, MemoryError)
    return text, took


def _hold(sock, seconds: float = 30) -> None:
    sock.settimeout(seconds)
    try:
        while sock.recv(1024):
            pass
    except OSError:
        pass


# --- nothing there ----------------------------------------------------------------------------


@pytest.mark.slow
def test_refused_port_fails_fast_by_default():
    port = _free_port()
    text, took = _connect_error(f"tcp://127.0.0.1:{port}")
    assert text == (
        f"blockflow.connect: nothing is listening at 'tcp://127.0.0.1:{port}' (connection "
        f"refused for 5 s). Start a scheduler there (`dask scheduler --preload "
        f"blockflow.scheduling.preload`) or check the address and port; to wait longer for a "
        f"scheduler that is still starting, raise timeout= (CLI: --timeout; setting "
        f"blockflow.cluster.connect-timeout).")
    assert took < 30  # 5 s, plus a loaded machine's slack; the old default waited 30 s


@pytest.mark.slow
def test_the_setting_and_the_argument_set_how_long_a_refused_port_is_retried():
    port = _free_port()
    with dask.config.set({"blockflow.cluster.connect-timeout": "1s"}):
        text, _ = _connect_error(f"tcp://127.0.0.1:{port}")
        assert "(connection refused for 1 s)" in text
        text, _ = _connect_error(f"tcp://127.0.0.1:{port}", timeout="2s")
        assert "(connection refused for 2 s)" in text


@pytest.mark.slow
def test_a_scheduler_that_is_still_starting_is_waited_for(tmp_path):
    """With a longer timeout, a refused port is retried until the scheduler listens."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(3); from distributed.cli import "
         "dask_scheduler; dask_scheduler.main()", "--host", "127.0.0.1", "--port", str(port),
         "--no-dashboard"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = blockflow.connect(f"tcp://127.0.0.1:{port}", timeout=120, policy="off")
        assert client.scheduler_info()["address"] == f"tcp://127.0.0.1:{port}"
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_an_unknown_host_is_named():
    text, _ = _connect_error("tcp://no-such-host.invalid:8786", timeout=2)
    assert text.startswith("blockflow.connect: the host 'no-such-host.invalid' of "
                           "'tcp://no-such-host.invalid:8786' cannot be resolved (")
    assert text.endswith("). Check the host name in the address.")


# --- something else there ---------------------------------------------------------------------


def test_an_http_server_that_answers_at_once(serve):
    """The issue's case: HTTP bytes first, read by distributed as a 3 EiB frame length."""
    def handle(sock):
        sock.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        _hold(sock)

    address = serve(handle)
    text, took = _connect_error(address, timeout=20)
    assert text == (
        f"blockflow.connect: the server at {address!r} is not a Dask scheduler: it answered "
        f"b'HTTP/1.1 400 Bad Request\\r\\nConten'..., an HTTP reply instead of Dask's "
        f"handshake. Check the address and port: a Dask scheduler listens on its own port "
        f"(8786 by default; 8787 is its dashboard, which speaks HTTP).")
    assert took < 15  # at once, not after the 20 s bound


@pytest.mark.slow
def test_an_http_server_that_waits_for_a_request():
    """``python -m http.server`` says nothing until asked: it is asked, within the bound."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    address = f"tcp://127.0.0.1:{httpd.server_address[1]}"
    try:
        text, _ = _connect_error(address, timeout=3)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert text.startswith(
        f"blockflow.connect: the server at {address!r} is not a Dask scheduler: it sent no "
        f"Dask handshake, and answers HTTP requests (b'HTTP/1.0 ")
    assert "8787 is its dashboard" in text


@pytest.mark.slow
def test_a_dask_dashboard_port_is_recognised_as_http():
    with LocalCluster(n_workers=0, processes=False, dashboard_address="127.0.0.1:0") as cluster:
        port = cluster.scheduler.services["dashboard"].port
        text, _ = _connect_error(f"tcp://127.0.0.1:{port}", timeout=3)
    assert "answers HTTP requests (b'HTTP/1.1 " in text


@pytest.mark.parametrize("reply", [
    pytest.param(b"\xff" * 64, id="huge-length"),
    pytest.param(b"SSH-2.0-OpenSSH_9.6\r\n", id="ssh-banner"),
    pytest.param(struct.pack("<Q", 23) + b"not msgpack, not frames", id="plausible-length"),
    pytest.param(struct.pack("<Q", 0), id="zero-length"),
])
def test_garbage_is_refused_at_once(serve, reply):
    def handle(sock):
        sock.sendall(reply)
        _hold(sock)

    address = serve(handle)
    text, took = _connect_error(address, timeout=20)
    assert text.startswith(f"blockflow.connect: the server at {address!r} is not a Dask "
                           f"scheduler: it answered b")
    assert took < 15


@pytest.mark.slow
def test_a_silent_server_fails_within_the_bound(serve):
    address = serve(_hold)
    text, took = _connect_error(address, timeout=2)
    assert text == (
        f"blockflow.connect: the server at {address!r} accepted the connection but sent no "
        f"Dask handshake within 2 s. It is not a Dask scheduler: check the address and port.")
    assert took < 15


def test_a_server_that_hangs_up(serve):
    address = serve(lambda sock: sock.close())
    text, took = _connect_error(address, timeout=20)
    assert text == (f"blockflow.connect: the server at {address!r} closed the connection "
                    f"without a Dask handshake. It is not a Dask scheduler: check the address "
                    f"and port.")
    assert took < 15


def test_a_worker_is_not_a_scheduler():
    with LocalCluster(n_workers=1, processes=False, protocol="tcp",
                      dashboard_address=":0") as cluster:
        worker = next(iter(cluster.scheduler_info["workers"]))
        text, _ = _connect_error(worker, timeout=10)
    assert text == (f"blockflow.connect: {worker!r} is the address of a Dask Worker, not of a "
                    f"scheduler. Connect to the scheduler's address (the one its workers were "
                    f"started with).")


# --- TLS on one side only ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_cluster():
    with LocalCluster(n_workers=0, processes=False, protocol="tls", dashboard_address=":0",
                      security=Security.temporary()) as cluster:
        yield cluster


def test_plain_address_of_a_tls_scheduler(tls_cluster):
    plain = tls_cluster.scheduler_address.replace("tls://", "tcp://")
    text, took = _connect_error(plain, timeout=20)
    assert text == (f"blockflow.connect: the server at {plain!r} talks TLS, and hung up on (or "
                    f"ignored) a plain connection. Connect to "
                    f"{tls_cluster.scheduler_address!r} with security=distributed.Security(...) "
                    f"holding credentials that cluster trusts.")
    assert took < 15  # at once: the TLS server hangs up on Dask's plain handshake


@pytest.mark.slow
def test_a_tls_server_that_waits_in_silence(serve):
    """A TLS server that ignores plain bytes (rather than hanging up) is asked too."""
    import ssl
    import tempfile

    security = Security.temporary()
    with tempfile.TemporaryDirectory() as folder:
        cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        with open(cert, "w") as f:
            f.write(security.tls_scheduler_cert)
        with open(key, "w") as f:
            f.write(security.tls_scheduler_key)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)

    def handle(sock):
        first = sock.recv(1, socket.MSG_PEEK)
        if first == b"\x16":  # a TLS ClientHello
            with contextlib.suppress(OSError):
                ctx.wrap_socket(sock, server_side=True)
        _hold(sock)

    address = serve(handle)
    text, _ = _connect_error(address, timeout=3)
    assert text.startswith(f"blockflow.connect: the server at {address!r} talks TLS")


def test_tls_address_of_a_plain_scheduler(tls_cluster):
    with LocalCluster(n_workers=0, processes=False, protocol="tcp",
                      dashboard_address=":0") as plain:
        secure = plain.scheduler_address.replace("tcp://", "tls://")
        text, took = _connect_error(secure, timeout=20, security=tls_cluster.security)
    assert text == (
        f"blockflow.connect: the server at {secure!r} does not talk TLS (SSL: "
        f"WRONG_VERSION_NUMBER). If it is a plain Dask scheduler, connect to "
        f"{plain.scheduler_address!r} without TLS credentials; otherwise check the address "
        f"and port, and that security= holds credentials that cluster trusts.")
    assert took < 15


def test_tls_credentials_the_scheduler_does_not_trust(tls_cluster):
    text, _ = _connect_error(tls_cluster.scheduler_address, timeout=20,
                             security=Security.temporary())
    assert text.startswith(f"blockflow.connect: the TLS handshake with "
                           f"{tls_cluster.scheduler_address!r} failed (")
    assert "Check that security= holds the CA and client certificate" in text


# --- a real scheduler -------------------------------------------------------------------------


def test_the_look_leaves_no_trace_in_the_schedulers_log():
    """The probe sends Dask's handshake, so the scheduler's log gets no "closed before
    handshake completed" (nor a TLS warning); the client that follows connects as usual.

    Only the records of this test's schedulers count: each runs its own event-loop thread
    (in-process clusters), and the module's ``tls_cluster`` may still log, late on a loaded
    host, a handshake that an earlier test's diagnosis cut short. The log is read once the
    client has made a round trip on its own connections: the probe's connection is closed
    by then. What the client's close logs after that (on a loaded host, a pooled TLS
    connection still in its TLS handshake when the client closes makes the scheduler warn
    of an EOF) is distributed's, not the probe's."""
    records = []
    seen = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("distributed.comm.tcp")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        with LocalCluster(n_workers=1, processes=False, protocol="tcp",
                          dashboard_address=":0") as cluster:
            client = blockflow.connect(cluster.scheduler_address, policy="off")
            assert client.submit(sum, [1, 2]).result() == 3
            thread = client.run_on_scheduler(threading.get_ident)
            seen.extend(r for r in list(records) if r.thread == thread)
            client.close()
        mark = len(records)
        with LocalCluster(n_workers=0, processes=False, protocol="tls", dashboard_address=":0",
                          security=Security.temporary()) as tls_cluster:
            secure = blockflow.connect(tls_cluster.scheduler_address, policy="off",
                                       security=tls_cluster.security)
            assert secure.scheduler_info()["address"] == tls_cluster.scheduler_address
            thread = secure.run_on_scheduler(threading.get_ident)  # a round trip
            seen.extend(r for r in records[mark:] if r.thread == thread)
            secure.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    # The filter keeps the schedulers' own records (a test that can fail: it sees them).
    assert any("Incoming connection" in r.getMessage() for r in seen)
    assert not [r for r in seen if "before handshake" in r.getMessage()
                or r.levelno >= logging.WARNING], [r.getMessage() for r in seen]


def test_no_scheduler_environment_variable_leaks():
    assert "BLOCKFLOW_BOOTSTRAP_NOTE" not in os.environ
