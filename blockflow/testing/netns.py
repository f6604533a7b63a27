"""Hosts made of Linux network namespaces, and a Dask cluster spread over them, for tests.

Each host is a namespace with a veth link to a bridge on ``10.231.X.0/24``; links can be cut and
rate-limited (``ip``, ``tc``). Needs root (``CAP_NET_ADMIN``) and ``iproute2``
(:func:`netns_unavailable` says why not); ``close()`` removes everything a network made."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from itertools import count
from pathlib import Path
from typing import Any

from distributed import Client, Security

__all__ = ["Host", "NamespaceCluster", "NamespaceNetwork", "netns_unavailable"]

_ids = count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be used here (a one-line reason for ``pytest.skip``), or None."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: apt-get install iproute2)"
    name = f"bfprobe{os.getpid()}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
    _ip("netns", "del", name, check=False)
    br = f"bfp{os.getpid() % 100000}"
    made = _ip("link", "add", br, "type", "bridge", check=False)
    if made.returncode != 0:
        return f"cannot create a bridge: {made.stderr.strip() or made.returncode}"
    _ip("link", "del", br, check=False)
    return None


class Host:
    """One namespace host of a :class:`NamespaceNetwork`.

    Attributes
    ----------
    name, netns, ip : str
        Short name, namespace name, address.
    link : str
        The root-namespace end of its veth pair (what :meth:`cut` takes down).
    """

    def __init__(self, network: NamespaceNetwork, name: str, netns: str, ip: str, link: str):
        self.network, self.name, self.netns, self.ip, self.link = network, name, netns, ip, link
        self.processes: list[subprocess.Popen] = []

    def __repr__(self) -> str:
        return f"<Host {self.name} {self.ip} (netns {self.netns})>"

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` wrapped to run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *args]

    def popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``args`` on this host (``subprocess.Popen`` arguments in ``kwargs``); the
        process is stopped by :meth:`NamespaceNetwork.close`."""
        p = subprocess.Popen(self.command(args), **kwargs)
        self.processes.append(p)
        return p

    def run(self, args: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``args`` on this host to the end (``subprocess.run`` arguments in ``kwargs``)."""
        return subprocess.run(self.command(args), **kwargs)

    def cut(self) -> None:
        """Take the host's link down: nothing reaches it or leaves it (a pulled cable)."""
        _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        """Bring the host's link back up."""
        _ip("link", "set", self.link, "up")

    def limit(self, rate: str = "50mbit", burst: str = "64kb") -> None:
        """Limit the host's link to ``rate`` each way (``tc``'s token bucket; ``"50mbit"``, ``"1gbit"``)."""
        spec = ["root", "tbf", "rate", rate, "burst", burst, "latency", "100ms"]
        subprocess.run(["tc", "qdisc", "replace", "dev", self.link, *spec], check=True,
                       capture_output=True)
        self.run(["tc", "qdisc", "replace", "dev", "eth0", *spec], check=True,
                 capture_output=True)

    def unlimit(self) -> None:
        """Lift :meth:`limit`."""
        subprocess.run(["tc", "qdisc", "del", "dev", self.link, "root"], capture_output=True)
        self.run(["tc", "qdisc", "del", "dev", "eth0", "root"], capture_output=True)

    def stop_processes(self, timeout: float = 10) -> None:
        """Stop the processes started on this host: SIGTERM, then SIGKILL after
        ``timeout`` seconds; then any process still in the namespace (their children)."""
        for p in self.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.processes:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        # children the processes started (a nanny's worker) die with them; any left over
        # were started by them too, in this namespace
        left = _ip("netns", "pids", self.netns, check=False).stdout.split()
        for pid in left:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        self.processes = []


_TAG = re.compile(r"^bf(\d+)x\d+")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale() -> None:
    """Remove what networks of processes that died without closing them (SIGKILL) left:
    their namespaces (and the processes still in them), links and bridges."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _TAG.match(name)
        if m and not _alive(int(m.group(1))):
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", name, check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        m = _TAG.match(name)
        if m and not _alive(int(m.group(1))):
            _ip("link", "del", name, check=False)


class NamespaceNetwork:
    """A bridge in the root namespace and namespace hosts on it (a context manager).

    Parameters
    ----------
    subnet : int, optional
        ``X`` of ``10.231.X.0/24``; default the first free one.

    Examples
    --------
    >>> with NamespaceNetwork() as net:                       # doctest: +SKIP
    ...     a, b = net.add_host("a"), net.add_host("b")
    ...     b.limit("50mbit")
    """

    def __init__(self, subnet: int | None = None):
        _remove_stale()
        self.tag = f"bf{os.getpid()}x{next(_ids)}"
        self.subnet = self._free_subnet() if subnet is None else int(subnet)
        self.prefix = f"10.231.{self.subnet}"
        self.bridge = f"{self.tag}br"
        self.hosts: dict[str, Host] = {}
        self._closed = False
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except subprocess.CalledProcessError as e:
            self.close()
            raise RuntimeError(f"blockflow.testing.netns: cannot create bridge {self.bridge}: "
                               f"{e.stderr.strip()}") from None

    @staticmethod
    def _free_subnet() -> int:
        used = _ip("-4", "addr", check=False).stdout
        start = os.getpid() % 240
        for i in range(240):
            x = (start + i) % 240 + 10
            if f"10.231.{x}." not in used:
                return x
        raise RuntimeError("blockflow.testing.netns: no free 10.231.X.0/24 subnet")

    @property
    def gateway(self) -> str:
        """The root namespace's address on the network (the bridge)."""
        return f"{self.prefix}.1"

    def add_host(self, name: str) -> Host:
        """A new host ``name``: a namespace with loopback up and ``eth0`` on the bridge."""
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists already")
        n = len(self.hosts) + 1
        netns, link, ip = f"{self.tag}-{name}", f"{self.tag}v{n}", f"{self.prefix}.{10 + n}"
        host = Host(self, name, netns, ip, link)
        self.hosts[name] = host
        try:
            _ip("netns", "add", netns)
            _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", netns)
            _ip("link", "set", link, "master", self.bridge, "up")
            for args in (["addr", "add", f"{ip}/24", "dev", "eth0"],
                         ["link", "set", "eth0", "up"], ["link", "set", "lo", "up"],
                         ["route", "add", "default", "via", self.gateway]):
                _ip("netns", "exec", netns, "ip", *args)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"blockflow.testing.netns: cannot create host {name!r}: "
                               f"{e.stderr.strip()}") from None
        return host

    def close(self) -> None:
        """Stop every host's processes, delete the namespaces, links and the bridge."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts.values():
            host.stop_processes()
        for host in self.hosts.values():
            _ip("netns", "del", host.netns, check=False)
            _ip("link", "del", host.link, check=False)
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> NamespaceNetwork:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _dask_cli() -> str:
    found = shutil.which("dask", path=os.path.dirname(sys.executable)) or shutil.which("dask")
    if not found:
        raise RuntimeError("the `dask` command is not installed (it comes with distributed)")
    return found


def _write_credentials(folder: Path) -> dict[str, str]:
    """Self-signed TLS credentials as files (distributed's ``Security.temporary``)."""
    sec = Security.temporary()
    files = {"ca": folder / "ca.pem", "cert": folder / "cert.pem", "key": folder / "key.pem"}
    files["ca"].write_text(sec.tls_ca_file)
    files["cert"].write_text(sec.tls_scheduler_cert)
    files["key"].write_text(sec.tls_scheduler_key)
    return {k: str(v) for k, v in files.items()}


class NamespaceCluster:
    """A Dask cluster over namespace hosts: ``dask scheduler`` with blockflow's preload on host
    ``"sched"`` (ports 8786, 8787), one ``dask worker`` per host.

    Parameters
    ----------
    workers : mapping of str to sequence of str
        Worker (and host) name -> extra ``dask worker`` arguments.
    tls : bool, default False
        TLS only, self-signed; the client's credentials are :attr:`security`.
    env : mapping, optional
        Extra environment for every process.
    nthreads : int, default 1
    timeout : float, default 60
        Seconds to wait for scheduler and workers.
    one_host : bool, default False
        Run the workers on the scheduler's host (the single-machine comparison).

    Attributes
    ----------
    address, dashboard : str
    hosts : dict of str to Host
    security : distributed.Security or None
    """

    def __init__(self, workers: Mapping[str, Sequence[str]], *, tls: bool = False,
                 env: Mapping[str, str] | None = None, nthreads: int = 1,
                 timeout: float = 60, one_host: bool = False):
        self.network = NamespaceNetwork()
        self.folder = Path(tempfile.mkdtemp(prefix="blockflow-netns-"))
        self.worker_args = {name: list(args) for name, args in workers.items()}
        self.nthreads = int(nthreads)
        self.env = {**os.environ, **(env or {})}
        self.security = None
        self.tls_args: list[str] = []
        try:
            self.hosts = {"sched": self.network.add_host("sched")}
            for name in workers:
                self.hosts[name] = (self.hosts["sched"] if one_host
                                    else self.network.add_host(name))
            protocol = "tcp"
            if tls:
                files = _write_credentials(self.folder)
                self.tls_args = ["--tls-ca-file", files["ca"], "--tls-cert", files["cert"],
                                 "--tls-key", files["key"]]
                self.security = Security(tls_ca_file=files["ca"],
                                         tls_client_cert=files["cert"],
                                         tls_client_key=files["key"],
                                         require_encryption=True)
                protocol = "tls"
            sched = self.hosts["sched"]
            self.address = f"{protocol}://{sched.ip}:8786"
            self.dashboard = f"http://{sched.ip}:8787"
            sched.popen(
                [_dask_cli(), "scheduler", "--host", sched.ip, "--port", "8786",
                 "--protocol", protocol, "--dashboard-address", f"{sched.ip}:8787",
                 "--preload", "blockflow.scheduling.preload", *self.tls_args],
                **self._io("sched"))
            for name in workers:
                self.start_worker(name)
            self.wait_for_workers(len(workers), timeout=timeout)
        except BaseException:
            self.close()
            raise

    def _io(self, name: str) -> dict[str, Any]:
        log = open(self.folder / f"{name}.log", "ab")
        return {"stdout": log, "stderr": subprocess.STDOUT, "env": self.env,
                "cwd": self.folder}

    def start_worker(self, name: str) -> subprocess.Popen:
        """Start (again) the ``dask worker`` of host ``name``."""
        host = self.hosts[name]
        return host.popen(
            [_dask_cli(), "worker", self.address, "--host", host.ip, "--name", name,
             "--nthreads", str(self.nthreads), "--no-dashboard", *self.tls_args,
             *self.worker_args[name]], **self._io(name))

    def logs(self, name: str) -> str:
        """The output of host ``name``'s processes so far (scheduler: ``"sched"``)."""
        path = self.folder / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def client(self, **kwargs: Any):
        """A ``distributed.Client`` of this cluster (with :attr:`security`)."""
        return Client(self.address, security=self.security, **kwargs)

    def wait_for_workers(self, n: int, timeout: float = 60) -> None:
        """Wait until ``n`` workers are connected; TimeoutError names the hosts that did not connect."""
        with self.client(timeout=timeout) as c:
            try:
                c.wait_for_workers(n, timeout=timeout)
            except TimeoutError:
                names = {w["name"] for w in c.scheduler_info(n_workers=-1)["workers"].values()}
                missing = [h for h in self.worker_args if h not in names]
                last = {h: (self.logs(h).strip().splitlines() or ["(no output)"])[-1]
                        for h in missing}
                raise TimeoutError(f"workers on hosts {missing} did not connect to "
                                   f"{self.address} within {timeout:g} s: {last}") from None

    def close(self) -> None:
        """Stop every process, remove the hosts and the network, and the credentials."""
        self.network.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> NamespaceCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
