"""A real one-node Slurm for tests: munge, slurmctld and slurmd started without systemd, every file
in one temporary folder (:func:`local_slurm`); :class:`SlurmUnavailable` says why not."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

__all__ = ["LocalSlurm", "SlurmUnavailable", "local_slurm"]

_DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sinfo")
_INSTALL = "apt-get install slurm-wlm munge (Debian/Ubuntu)"


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or started here; the message says why."""


@dataclass
class LocalSlurm:
    """A running one-node Slurm (see :func:`local_slurm`).

    Attributes
    ----------
    directory : str
        Holds config, state, logs and job output (``jobs/``).
    conf, node : str
    partitions : tuple of str
        The first is the default.
    cpus : int
    env : dict
        ``SLURM_CONF`` for Slurm's commands.
    """

    directory: str
    conf: str
    node: str
    partitions: tuple[str, ...]
    cpus: int
    env: dict = field(default_factory=dict)
    _procs: list = field(default_factory=list, repr=False)

    @property
    def job_directory(self) -> str:
        """Where job scripts write their output (``log_directory`` of dask-jobqueue)."""
        return os.path.join(self.directory, "jobs")

    def log(self, name: str = "slurmctld") -> str:
        """The text of one daemon's log (``slurmctld``, ``slurmd`` or ``munged``)."""
        try:
            with open(os.path.join(self.directory, f"{name}.log")) as f:
                return f.read()
        except OSError:
            return ""

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a Slurm command (``sinfo``, ``squeue``, ``scancel``...) against this Slurm."""
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env})

    def jobs(self) -> list[str]:
        """Ids of the jobs Slurm holds now (pending or running)."""
        out = self.run("squeue", "--noheader", "--format=%i")
        return out.stdout.split() if out.returncode == 0 else []

    def cancel_all(self) -> None:
        """Cancel every job of this Slurm."""
        jobs = self.jobs()
        if jobs:
            self.run("scancel", *jobs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_mb() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 4096


def _config(d: str, node: str, partitions: Sequence[str], cpus: int, memory_mb: int,
            ctld_port: int, slurmd_port: int) -> str:
    parts = "\n".join(
        f"PartitionName={p} Nodes={node} Default={'YES' if i == 0 else 'NO'} "
        f"MaxTime=INFINITE State=UP"
        for i, p in enumerate(partitions))
    return f"""\
ClusterName=blockflow{ctld_port}
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge.socket
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=30
KillWait=2
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
{parts}
"""


def _start(args: list[str], env: dict, what: str, d: str) -> subprocess.Popen:
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(d, f"{what}.stderr"), "w"),
                            start_new_session=True)
    return proc


def _tail(path: str, n: int = 3) -> str:
    try:
        with open(path) as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    for proc in reversed(procs):
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=5)


@contextlib.contextmanager
def local_slurm(partitions: Sequence[str] = ("fast", "slow"), *, cpus: int = 16,
                directory: str | None = None, timeout: float = 60) -> Iterator[LocalSlurm]:
    """Start a real one-node Slurm with the given partitions; stop it all on exit.

    Parameters
    ----------
    partitions : sequence of str, default ("fast", "slow")
    cpus : int, default 16
        CPUs offered to jobs (may exceed the machine's).
    directory : str, optional
        Default a temporary folder, removed on exit.
    timeout : float, default 60
        Seconds for the node to be idle in every partition.

    Yields
    ------
    LocalSlurm
        With ``SLURM_CONF`` set in ``os.environ`` meanwhile.

    Raises
    ------
    SlurmUnavailable
        A program missing, not root, or the node not ready (with the daemon's last log lines).
    """
    missing = [p for p in _DAEMONS if shutil.which(p) is None]
    if missing:
        raise SlurmUnavailable(f"Slurm/munge programs not found: {', '.join(missing)}; "
                               f"install them with {_INSTALL}.")
    if os.geteuid() != 0:
        raise SlurmUnavailable("a local Slurm needs root here (SlurmUser=root runs the "
                               "daemons and jobs); run the tests as root.")
    partitions = tuple(partitions)
    if not partitions:
        raise ValueError("local_slurm: give at least one partition name.")
    own_dir = directory is None
    d = tempfile.mkdtemp(prefix="blockflow-slurm-") if own_dir else os.path.abspath(directory)
    os.makedirs(d, exist_ok=True)
    os.chmod(d, 0o700)
    node = socket.gethostname().split(".")[0]
    for sub in ("state", "spool", "jobs"):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    conf = os.path.join(d, "slurm.conf")
    with open(conf, "w") as f:
        f.write(_config(d, node, partitions, cpus, max(256, _memory_mb() // 2),
                        _free_port(), _free_port()))
    env = {**os.environ, "SLURM_CONF": conf}
    slurm = LocalSlurm(directory=d, conf=conf, node=node, partitions=partitions, cpus=cpus,
                       env={"SLURM_CONF": conf})
    old_conf = os.environ.get("SLURM_CONF")
    try:
        key = os.path.join(d, "munge.key")
        made = subprocess.run(["mungekey", "--create", f"--keyfile={key}"],
                              capture_output=True, text=True, timeout=30)
        if made.returncode != 0:
            raise SlurmUnavailable(f"mungekey could not create a key: {made.stderr.strip()}")
        os.chmod(key, 0o600)
        munged = subprocess.run(
            ["munged", "--force", f"--socket={d}/munge.socket", f"--key-file={key}",
             f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
             f"--seed-file={d}/munged.seed"],
            capture_output=True, text=True, timeout=30)
        if munged.returncode != 0:
            raise SlurmUnavailable(f"munged did not start: {munged.stderr.strip()} "
                                   f"{_tail(os.path.join(d, 'munged.log'))}")
        slurm._procs.append(("munged", os.path.join(d, "munged.pid")))
        ctld = _start(["slurmctld", "-D", "-i", "-f", conf], env, "slurmctld", d)
        slurm._procs.append(ctld)
        slurmd = _start(["slurmd", "-D", "-N", node, "-f", conf], env, "slurmd", d)
        slurm._procs.append(slurmd)
        deadline = time.monotonic() + timeout
        while True:
            for proc, name in ((ctld, "slurmctld"), (slurmd, "slurmd")):
                if proc.poll() is not None:
                    raise SlurmUnavailable(
                        f"{name} exited with status {proc.returncode}: "
                        f"{_tail(os.path.join(d, name + '.log')) or _tail(os.path.join(d, name + '.stderr'))}")
            out = slurm.run("sinfo", "--noheader", "--format=%P %t", timeout=10)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            states = {p.rstrip("*"): s for p, s in states.items()}
            if out.returncode == 0 and all(states.get(p) in ("idle", "mix", "alloc")
                                           for p in partitions):
                break
            if time.monotonic() > deadline:
                raise SlurmUnavailable(
                    f"the Slurm node was not ready within {timeout:g} s (sinfo: "
                    f"{out.stdout.strip() or out.stderr.strip()}); slurmctld log: "
                    f"{_tail(os.path.join(d, 'slurmctld.log'))}")
            time.sleep(0.2)
        os.environ["SLURM_CONF"] = conf
        yield slurm
    finally:
        if old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old_conf
        with contextlib.suppress(Exception):
            slurm.cancel_all()
        _stop([p for p in slurm._procs if isinstance(p, subprocess.Popen)])
        _stop_munged(d)
        if own_dir:
            shutil.rmtree(d, ignore_errors=True)


def _stop_munged(d: str) -> None:
    """munged forks into the background: stop it by its socket (``munged --stop``)."""
    if os.path.exists(os.path.join(d, "munge.socket")):
        with contextlib.suppress(Exception):
            subprocess.run(["munged", "--stop", f"--socket={d}/munge.socket"],
                           capture_output=True, timeout=15)
