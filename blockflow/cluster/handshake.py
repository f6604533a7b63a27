"""Whether a Dask scheduler answers at an address: one bounded look before a Client connects.

distributed's ``Client`` retries refused connections, waits for a handshake without bound and takes
any reply's first 8 bytes as a frame length; :func:`probe_scheduler` looks first and names what it
found. Method: blockflow heuristic on distributed's TCP framing
(:mod:`blockflow._distributed.wire`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import socket
import ssl
from typing import Any

from distributed.comm import connect, parse_address
from distributed.comm.addressing import parse_host_port

from blockflow._distributed.wire import HEADER_BYTES, client_handshake, decode_message, message_length

__all__ = ["ProbeError", "probe_scheduler"]

#: Largest first message taken for Dask's handshake (bytes): it is a few hundred.
HANDSHAKE_MAX_BYTES = 1 << 16
#: Longest pause between attempts at a port that refuses connections (seconds).
RETRY_MAX_DELAY = 0.5
#: Bytes of a non-Dask reply quoted in the error.
QUOTE_BYTES = 32
#: Time at the end of the handshake bound kept for asking a silent server whether it speaks
#: HTTP or TLS (seconds; at most a fifth of the bound).
HTTP_POKE_SECONDS = 1.0

# OpenSSL reasons meaning "the peer does not talk TLS".
_NOT_TLS = {"WRONG_VERSION_NUMBER", "UNKNOWN_PROTOCOL", "HTTP_REQUEST",
            "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE", "UNEXPECTED_EOF_WHILE_READING"}


class ProbeError(OSError):
    """No Dask scheduler answered as expected at an address.

    Attributes
    ----------
    kind : str
        ``"refused"``, ``"unreachable"``, ``"unresolved"``, ``"silent"`` (no handshake in
        time), ``"closed"``, ``"not-dask"``, ``"not-tls"``, ``"tls"`` (TLS handshake failed),
        ``"tls-server"`` (plain connection to a TLS server) or ``"not-scheduler"``.
    reply : bytes
        The first bytes a non-Dask server sent (``"not-dask"``), else empty.
    """

    def __init__(self, kind: str, text: str, reply: bytes = b""):
        super().__init__(text)
        self.kind, self.reply = kind, reply

    def __str__(self) -> str:
        return str(self.args[0])


def probe_scheduler(address: str, timeout: float, connection_args: dict[str, Any]) -> None:
    """Check, within about ``timeout`` seconds, that a Dask scheduler answers at ``address``.

    Parameters
    ----------
    address : str
        ``tcp://`` or ``tls://host:port`` (other schemes only ask the server's identity).
    timeout : float
        Seconds to connect and get the handshake; the identity query has as long again.
    connection_args : dict
        ``distributed.Security(...).get_connection_args("client")``.

    Raises
    ------
    ProbeError
        If no Dask scheduler answers.
    """
    # A thread of its own: Jupyter's main thread already runs an event loop.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, _check(address, timeout, connection_args)).result()


async def _check(address: str, timeout: float, args: dict[str, Any]) -> None:
    scheme, location = parse_address(address)
    if scheme in ("tcp", "tls"):
        host, port = parse_host_port(location)
        ctx = args.get("ssl_context") if scheme == "tls" else None
        await _look(address, host, port, ctx, timeout)
    await _identity(address, timeout, args)


async def _look(address: str, host: str, port: int, ctx: ssl.SSLContext | None,
                timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    # Time kept at the end of the bound to ask a silent server what it is (plain TCP only).
    spare = min(HTTP_POKE_SECONDS, timeout / 5) if ctx is None else 0
    reader, writer = await _open(address, host, port, ctx, deadline, timeout)
    try:
        # Dask's handshake first, as distributed's own clients send it: a Dask server reads
        # it, a TLS server takes it for a failed TLS handshake and hangs up at once.
        writer.write(client_handshake())
        await _first_message(address, reader, deadline - spare, timeout, ctx)
    except ProbeError as e:
        if ctx is None and e.kind in ("silent", "closed"):
            await _what_else(address, host, port, e, deadline)
        raise
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 1)


async def _what_else(address: str, host: str, port: int, error: ProbeError,
                     deadline: float) -> None:
    """Ask a silent or hung-up server, on fresh connections, if it speaks HTTP or TLS; raises."""
    loop = asyncio.get_running_loop()
    if error.kind == "silent":
        asked_until = deadline - max(deadline - loop.time(), 0) / 2  # half for the TLS check
        reply = b""
        with contextlib.suppress(Exception):
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                    max(asked_until - loop.time(), 0.1))
            try:
                writer.write(b"GET / HTTP/1.0\r\n\r\n")
                reply = await asyncio.wait_for(reader.read(QUOTE_BYTES),
                                               max(asked_until - loop.time(), 0.1))
            finally:
                writer.transport.abort()
        if reply.startswith(b"HTTP/"):
            raise _not_dask(address, reply, asked_http=True) from None
    if await _talks_tls(host, port, max(deadline - loop.time(), 0.2)):
        raise ProbeError("tls-server", f"the server at {address!r} talks TLS, and hung up on "
                                       f"(or ignored) a plain connection") from None


async def _open(address: str, host: str, port: int, ctx: ssl.SSLContext | None,
                deadline: float, timeout: float):
    loop = asyncio.get_running_loop()
    delay, refused, last = 0.05, False, None
    while True:
        left = deadline - loop.time()
        if left <= 0:
            break
        try:
            return await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=ctx,
                                        server_hostname=host if ctx is not None else None),
                left)
        except ConnectionRefusedError:
            refused = True
        except socket.gaierror as e:
            raise ProbeError("unresolved", f"the host {host!r} of {address!r} cannot be "
                                           f"resolved ({e.strerror or e})") from None
        except ssl.SSLError as e:
            raise _tls_error(address, e) from None
        except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError) as e:
            if ctx is not None:  # dropped during the TLS handshake
                raise ProbeError(
                    "not-tls", f"the server at {address!r} dropped the connection during the "
                               f"TLS handshake ({type(e).__name__}): it does not talk TLS, "
                               f"or refuses these credentials") from None
            last = e
        except asyncio.TimeoutError:
            break
        except OSError as e:  # host or network unreachable: it may come up; retry
            last = e
        await asyncio.sleep(min(delay, max(deadline - loop.time(), 0)))
        delay = min(delay * 2, RETRY_MAX_DELAY)
    if refused:
        raise ProbeError("refused", f"nothing is listening at {address!r} (connection "
                                    f"refused for {timeout:g} s)")
    why = f" ({type(last).__name__}: {last})" if last is not None else ""
    raise ProbeError("unreachable", f"no answer from {address!r} within {timeout:g} s{why}")


async def _first_message(address: str, reader: asyncio.StreamReader, deadline: float,
                         timeout: float, ctx: ssl.SSLContext | None) -> None:
    """Read the peer's first message (an 8-byte length, then that many bytes of frames) and
    check that it is Dask's handshake."""
    header = await _read(address, reader, HEADER_BYTES, deadline, timeout, ctx)
    n = message_length(header)
    if not 0 < n <= HANDSHAKE_MAX_BYTES:
        more = b""
        with contextlib.suppress(Exception):
            more = await asyncio.wait_for(reader.read(QUOTE_BYTES), 0.2)
        raise _not_dask(address, header + more)
    payload = await _read(address, reader, n, deadline, timeout, ctx, header)
    msg = decode_message(payload)
    if not (isinstance(msg, dict) and "compression" in msg):
        raise _not_dask(address, header + payload)


async def _read(address: str, reader: asyncio.StreamReader, n: int, deadline: float,
                timeout: float, ctx: ssl.SSLContext | None, before: bytes = b"") -> bytes:
    left = max(deadline - asyncio.get_running_loop().time(), 0)
    try:
        return await asyncio.wait_for(reader.readexactly(n), left)
    except asyncio.IncompleteReadError as e:
        if before or e.partial:
            raise _not_dask(address, before + e.partial) from None
        raise ProbeError("closed", f"the server at {address!r} closed the connection without "
                                   f"a Dask handshake") from None
    except asyncio.TimeoutError:
        if before:
            raise _not_dask(address, before) from None
        raise ProbeError("silent", f"the server at {address!r} accepted the connection but "
                                   f"sent no Dask handshake within {timeout:g} s") from None
    except ssl.SSLError as e:
        raise _tls_error(address, e) from None
    except OSError:  # reset: it hung up while we spoke
        raise ProbeError("closed", f"the server at {address!r} closed the connection without "
                                   f"a Dask handshake") from None


def _not_dask(address: str, reply: bytes, asked_http: bool = False) -> ProbeError:
    quoted = repr(reply[:QUOTE_BYTES]) + ("..." if len(reply) > QUOTE_BYTES else "")
    if asked_http:
        seen = f"it sent no Dask handshake, and answers HTTP requests ({quoted})"
    else:
        what = ", an HTTP reply" if reply.startswith((b"HTTP/", b"<")) else ""
        seen = f"it answered {quoted}{what} instead of Dask's handshake"
    return ProbeError("not-dask", f"the server at {address!r} is not a Dask scheduler: "
                                  f"{seen}", reply=reply)


async def _talks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether the server at ``host:port`` starts a TLS handshake."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ctx, server_hostname=host), timeout)
    except ssl.SSLError as e:  # it spoke TLS, then refused (e.g. no client certificate)
        return getattr(e, "reason", None) not in _NOT_TLS
    except (OSError, asyncio.TimeoutError):
        return False
    writer.transport.abort()
    return True


def _tls_error(address: str, e: ssl.SSLError) -> ProbeError:
    reason = getattr(e, "reason", None) or type(e).__name__
    if reason in _NOT_TLS:
        return ProbeError("not-tls", f"the server at {address!r} does not talk TLS "
                                     f"(SSL: {reason})")
    detail = getattr(e, "verify_message", None) or reason
    return ProbeError("tls", f"the TLS handshake with {address!r} failed ({detail})")


async def _identity(address: str, timeout: float, args: dict[str, Any]) -> None:
    """Ask the Dask server its type (a worker or nanny answers the handshake too)."""
    async def ask() -> Any:
        # distributed's connect gives its first attempt a fifth of ``timeout`` and then tries
        # again: on a loaded machine that cuts a TLS handshake short, and the scheduler logs
        # "TLS handshake failed". One attempt gets the whole bound (wait_for below keeps it).
        comm = await connect(address, timeout=5 * timeout, **args)
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            comm.abort()

    try:
        info = await asyncio.wait_for(ask(), timeout)
    except asyncio.TimeoutError:
        raise ProbeError("silent", f"the server at {address!r} did not say who it is within "
                                   f"{timeout:g} s") from None
    except OSError as e:
        raise ProbeError("closed", f"the server at {address!r} dropped the connection "
                                   f"({type(e).__name__}: {e})") from None
    except Exception as e:  # garbage that reached distributed's decoder
        raise ProbeError("not-dask", f"the server at {address!r} is not a Dask scheduler: "
                                     f"its reply is not Dask's protocol ({type(e).__name__})"
                         ) from None
    kind = info.get("type") if isinstance(info, dict) else None
    if kind != "Scheduler":
        raise ProbeError("not-scheduler", f"{address!r} is the address of a Dask "
                                          f"{kind or 'server'}, not of a scheduler")
