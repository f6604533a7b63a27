"""torch.distributed process groups on Dask workers: blockflow places, torch communicates.

:func:`run_group` runs ``fn`` as one Dask task per rank, one rank per chosen worker (a
worker process holds at most one group at a time: torch's default group is per process).
The ranks meet through the scheduler: rank 0 opens a ``torch.distributed.TCPStore`` on its
worker's address at a free port and publishes ``host:port`` in a
:class:`distributed.Variable`; every rank then joins ``init_process_group`` on that store,
with ``nccl`` when every rank sees a CUDA device and ``gloo`` otherwise. Collectives time
out after ``blockflow.ml.collective-timeout``, so a lost peer is an error, never a hang; the
client watches the ranks' workers and ends the group as soon as one leaves. This is how
dask-pytorch-ddp and Ray Train run torch on their clusters. Guide: docs/guide/ai.md.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import uuid
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any, Callable, Sequence
from urllib.parse import urlparse

from dask.utils import parse_timedelta
from distributed import Variable, get_client, get_worker

from blockflow import _distributed, config
from blockflow.errors import WorkerLostError
from blockflow.scheduling.view import workers_info
from blockflow.scheduling.wait import wait_any

__all__ = ["GroupLost", "Rank", "RankFailed", "first_kept", "gone_workers", "keep_copies",
           "run_group", "worker_processes"]

_ONE_GROUP = threading.Lock()  # torch's default group is one per process
_held_by: list = [None]  # the token of the group this process holds a rank of


@dataclass
class Rank:
    """What a rank's function is given: its place in the group.

    Attributes
    ----------
    rank, world_size : int
    worker : str
        This rank's Dask worker address.
    workers : list of str
        Every rank's worker, in rank order.
    backend : {"nccl", "gloo"}
    device : torch.device
        ``cuda`` (the worker's device) with nccl, else ``cpu``.
    """

    rank: int
    world_size: int
    worker: str
    workers: list
    backend: str
    device: Any


class GroupLost(WorkerLostError):
    """Workers holding ranks left the cluster while the group ran (``lost`` names them)."""


class RankFailed(RuntimeError):
    """A rank ended because a peer did (a collective failed or timed out): not the cause."""


class _FormFailed(RuntimeError):
    """The group did not form (a peer late or gone, a stale store): tried once more."""


class _HeapForTensors:
    """glibc's heap kept for tensors while a rank runs, as in a plain process.

    Dask's nanny sets ``MALLOC_TRIM_THRESHOLD_`` (64 KiB) in its workers, which also fixes
    glibc's mmap threshold at 128 KiB: every activation or gradient above it is then
    mmapped and unmapped (zeroed pages, faults) at each step, measured 1.4x slower per
    training step of a 4-layer 1024-wide MLP here. A rank raises both thresholds to
    glibc's largest mmap threshold (32 MiB) and restores the nanny's on leaving, trimming
    the heap then. Linux glibc only; elsewhere nothing changes.
    """

    TRIM, MMAP, LARGE = -1, -3, 32 * 2**20

    def __enter__(self):
        import ctypes
        import sys

        self.libc = None
        if sys.platform.startswith("linux"):
            try:
                self.libc = ctypes.CDLL("libc.so.6")
                self.libc.mallopt(self.MMAP, self.LARGE)
                self.libc.mallopt(self.TRIM, 8 * self.LARGE)
            except (OSError, AttributeError):
                self.libc = None
        return self

    def __exit__(self, *exc):
        if self.libc is not None:
            trim = os.environ.get("MALLOC_TRIM_THRESHOLD_", "")
            self.libc.mallopt(self.TRIM, int(trim) if trim.isdigit() else 128 * 1024)
            self.libc.mallopt(self.MMAP, 128 * 1024)
            self.libc.malloc_trim(0)


def _seconds(name: str, value) -> float:
    return float(parse_timedelta(config.get(f"ml.{name}") if value is None else value))


def _interface_of(ip: str) -> str | None:
    """The network interface holding ``ip`` on this host, or None."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return None


def _join(store, rank: int, workers: Sequence[str], timeout: float, what: str) -> None:
    """Every rank writes ``joined/<rank>``; waits for all, naming the workers that did not."""
    store.set(f"joined/{rank}", "1")
    end = time.monotonic() + timeout
    missing = list(range(len(workers)))
    while missing:
        missing = [r for r in missing if not store.check([f"joined/{r}"])]
        if not missing:
            return
        if time.monotonic() > end:
            names = ", ".join(f"{workers[r]} (rank {r})" for r in missing)
            raise RuntimeError(
                f"blockflow: {what}: {names} did not join within {timeout:g} s; their "
                f"threads may be busy with other tasks. Raise blockflow.ml.rendezvous-"
                f"timeout or free those workers.")
        time.sleep(0.01)


def _rank_main(fn: Callable, rank: int, workers: list, token: str, what: str,
               timeouts: tuple[float, float], threads: int | None, args: tuple) -> Any:
    """On a worker: join the group as ``rank``, run ``fn(Rank, *args)``, leave the group."""
    import torch
    import torch.distributed as dist

    rendezvous, collective = timeouts
    worker = get_worker()
    if _held_by[0] == token:
        raise RuntimeError(
            f"blockflow: {what}: workers {workers[_held_by[1]]} and {worker.address} run in "
            f"one process, and torch.distributed needs a process per rank: start workers as "
            f"processes (LocalCluster(processes=True), or one `dask worker` per process).")
    if not _ONE_GROUP.acquire(timeout=rendezvous):
        raise _FormFailed(f"blockflow: {what}: worker {worker.address} still runs a rank of "
                          f"another torch.distributed group; run one group at a time.")
    _held_by[:] = [token, rank]
    threads_before = torch.get_num_threads()
    store, formed = None, False
    var = Variable(f"blockflow-rendezvous-{token}", client=get_client())
    try:
        host = urlparse(worker.address).hostname or "127.0.0.1"
        ifname = _interface_of(host)
        if ifname is not None:  # gloo and nccl bind to the worker's own interface
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = ifname
        wait = datetime.timedelta(seconds=rendezvous)
        try:
            store, backend, device = _form(dist, torch, var, worker, rank, workers, host, wait,
                                           rendezvous, what)
        except (dist.DistError, RuntimeError, TimeoutError) as e:
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise _FormFailed(text if text.startswith("blockflow:") else
                              f"blockflow: {what}: the group of workers {', '.join(workers)} "
                              f"did not form ({text}).") from None
        formed = True
        try:  # forming waits at most the rendezvous timeout, each collective its own
            from torch.distributed.distributed_c10d import _set_pg_timeout

            _set_pg_timeout(datetime.timedelta(seconds=collective))
        except (ImportError, RuntimeError, ValueError):  # torch keeps the rendezvous's
            pass
        # a store that goes with its rank is not waited for long on the way out
        store.set_timeout(datetime.timedelta(seconds=min(rendezvous, 10.0)))
        if threads:
            torch.set_num_threads(threads)
        ctx = Rank(rank, len(workers), worker.address, list(workers), backend, device)
        _distributed.quiet_task_failures(RankFailed)  # a peer's end is logged by that peer
        _distributed.quiet_task_failures(_FormFailed)
        try:
            with _HeapForTensors():
                return fn(ctx, *args)
        except (dist.DistError, RuntimeError) as e:
            if _is_peer_failure(e):
                raise RankFailed(f"rank {rank} on {worker.address}: {str(e).splitlines()[0]}"
                                 ) from None
            raise
    finally:
        torch.set_num_threads(threads_before)
        if formed:
            dist.destroy_process_group()
        if rank == 0:
            try:
                var.delete()
            except Exception:  # the scheduler may be gone: nothing left to tidy
                pass
        _held_by[:] = [None]
        _ONE_GROUP.release()


def _form(dist, torch, var, worker, rank: int, workers: list, host: str, wait, rendezvous,
          what: str):
    """Meet the other ranks (rank 0's store, published in ``var``) and form the default
    group: (store, backend, device)."""
    if rank == 0:
        store = dist.TCPStore(host, 0, len(workers), True, timeout=wait,
                              wait_for_workers=False)
        var.set(f"{host}:{store.port}")
    else:
        try:
            where = var.get(timeout=rendezvous)
        except TimeoutError:
            raise RuntimeError(
                f"blockflow: {what}: rank 0 on {workers[0]} did not open the group "
                f"within {rendezvous:g} s; its threads may be busy with other tasks."
            ) from None
        h, _, p = str(where).rpartition(":")
        store = dist.TCPStore(h, int(p), len(workers), False, timeout=wait)
    store.set(f"cuda/{rank}", "1" if torch.cuda.is_available() else "0")
    # a rank may first wait for its process's lock: a rank of a broken group there
    # leaves it within the rendezvous timeout (its init waits no longer)
    _join(store, rank, workers, 2 * rendezvous, what)
    cuda = all(store.get(f"cuda/{r}") == b"1" for r in range(len(workers)))
    backend = "nccl" if cuda else "gloo"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else \
        torch.device("cpu")
    _fresh_group_names(dist)
    dist.init_process_group(backend, store=store, rank=rank, world_size=len(workers),
                            timeout=wait)
    return store, backend, device


def _fresh_group_names(dist) -> None:
    """Name the new group's keys as every rank of it does: from a count of 0.

    torch prefixes a group's store keys with a per-process count of the groups it formed,
    which agrees across ranks under torchrun (every process forms the same groups). A
    long-lived worker whose earlier group failed while forming keeps a higher count, and
    its keys would never meet its peers'; ``destroy_process_group`` resets the count, and
    this does where no group is left to destroy (torch's private ``_world``).
    """
    if not dist.is_initialized():
        try:
            from torch.distributed.distributed_c10d import _world

            _world.group_count = 0
        except (ImportError, AttributeError):
            pass


def _is_peer_failure(e: BaseException) -> bool:
    """Whether a torch error says a peer went away or a collective timed out."""
    import torch.distributed as dist

    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return any(s in text for s in ("connection closed", "connection reset", "timed out",
                                   "broken pipe", "gloo", "nccl", "connection refused"))


def _copy(value):
    return value


def keep_copies(client, futures: Sequence, workers: Sequence[str], made_on: Sequence[str],
                copies: int = 2) -> list:
    """Each of ``futures`` (finished, made on ``made_on[i]``) kept on ``copies`` workers: per
    future, a list of it and copies under keys of their own on other workers of ``workers``
    (a checkpoint kept in peers' memory). Copies of one key would not do: distributed's
    active memory manager drops the replicas ``client.replicate`` makes (``ReduceReplicas``).
    """
    out = []
    for f, home in zip(futures, made_on):
        others = [w for w in workers if w != home][:max(0, copies - 1)]
        out.append([f] + [client.submit(_copy, f, workers=[w], allow_other_workers=False,
                                        pure=False, key=f"checkpoint-copy-{uuid.uuid4().hex}")
                          for w in others])
    from distributed import wait

    wait([k for ks in out for k in ks[1:]])
    return out


def first_kept(kept: Sequence):
    """The first of ``kept`` (from :func:`keep_copies`) still in memory, or None."""
    return next((f for f in kept if f.status == "finished"), None)


def gone_workers(client, workers: Sequence[str], *, expect: Sequence[str] = (),
                 timeout: float = 10.0) -> set[str]:
    """Those of ``workers`` the scheduler no longer lists, after waiting up to ``timeout``
    seconds for ``expect`` to leave (or, without ``expect``, for any of ``workers`` to):
    a worker that died is dropped within a heartbeat, and a failure can arrive first."""
    workers, expect = set(workers), set(expect)
    end = time.monotonic() + timeout
    while True:
        gone = workers - set(workers_info(client))
        if (gone >= expect if expect else gone) or time.monotonic() >= end:
            return gone
        time.sleep(0.05)


def worker_processes(client, workers: Sequence[str] | None = None,
                     info: dict | None = None) -> list[str]:
    """``workers`` (default all), keeping the first of any that share one process (one
    nanny, or one ``inproc://host/pid/`` process): a process holds one torch.distributed
    rank. Workers without a nanny over TCP cannot be told apart here; a group that puts two
    ranks in one process ends at once with an error naming both."""
    info = workers_info(client) if info is None else info
    seen, out = set(), []
    for a in sorted(info) if workers is None else workers:
        if a not in info:
            raise ValueError(f"blockflow: worker {a} is not in the cluster; choose among "
                             f"{sorted(info)}.")
        u = urlparse(a)
        one = (u.hostname, u.path.split("/")[1]) if u.scheme == "inproc" else \
            (info[a].get("nanny") or a)
        if one not in seen:
            seen.add(one)
            out.append(a)
    return out


def run_group(client, workers: Sequence[str], fn: Callable, args: Sequence[tuple] = (), *,
              name: str = "rank", what: str = "the group", threads: bool = True,
              rendezvous_timeout=None, collective_timeout=None, gather: bool = True,
              poll: float = 0.25) -> list:
    """Run ``fn(Rank, *args[r])`` on each of ``workers`` as rank ``r`` of one torch group.

    Parameters
    ----------
    client : distributed.Client
    workers : sequence of str
        One worker per rank, in rank order (see :func:`worker_processes`).
    fn : callable
        ``fn(rank: Rank, *args)``, run on the worker in a task, inside the group.
    args : sequence of tuple, optional
        Per rank, the extra arguments (futures among them are resolved on the worker).
    name : str, default "rank"
        Task key prefix, as the dashboard shows it.
    what : str
        Named in errors ("training", "pipeline stage 2").
    threads : bool, default True
        Let torch use as many threads as the worker has.
    rendezvous_timeout, collective_timeout : str or float, optional
        Defaults ``blockflow.ml.rendezvous-timeout`` and ``blockflow.ml.collective-timeout``.
    gather : bool, default True
        Return the results; False returns the finished futures, leaving each result in its
        worker's memory (a checkpoint kept by peers: ``client.replicate`` it).

    Returns
    -------
    list
        Each rank's result (or finished future), in rank order.

    Raises
    ------
    GroupLost
        A rank's worker left the cluster (``lost``: their addresses); the other ranks are
        cancelled.
    Exception
        The first rank's own error (a user's function failing, bad data), not the
        :class:`RankFailed` of the peers it took down.
    """
    workers = list(workers)
    if not workers:
        raise ValueError(f"blockflow: {what} needs at least one worker.")
    timeouts = (_seconds("rendezvous-timeout", rendezvous_timeout),
                _seconds("collective-timeout", collective_timeout))
    args = list(args) or [()] * len(workers)
    info = workers_info(client)
    for attempt in (1, 2):  # a group that did not form (a stale rank, a late peer): once more
        token = uuid.uuid4().hex
        futures = [client.submit(_rank_main, fn, r, workers, token, what, timeouts,
                                 int(info.get(w, {}).get("nthreads") or 1) if threads
                                 else None, tuple(args[r]), key=f"{name}-{token}-{r}",
                                 workers=[w], allow_other_workers=False, pure=False)
                   for r, w in enumerate(workers)]
        try:
            _wait_ranks(client, futures, workers, what, poll, grace=min(timeouts[1], 10.0))
        except _FormFailed as e:
            client.cancel(futures)
            if attempt == 2:
                raise RuntimeError(str(e)) from None
            continue
        except BaseException:
            client.cancel(futures)
            raise
        return [f.result() for f in futures] if gather else futures


def _wait_ranks(client, futures: list, workers: list, what: str, poll: float,
                grace: float) -> None:
    """Until every rank is done; the cause when one fails; :class:`GroupLost` when workers
    go (a killed worker's rank, and a rank whose inputs it held, come back cancelled)."""
    pending = set(futures)
    failed_at = None
    while pending:
        try:
            done = wait_any(pending, timeout=poll)
        except CancelledError:
            done = [f for f in pending if f.cancelled()]
        gone = set(workers) - set(workers_info(client))
        if gone:
            ranks = ", ".join(f"{w} (rank {workers.index(w)})" for w in workers if w in gone)
            raise GroupLost(f"blockflow: {what}: lost {ranks}.", lost=gone)
        for f in done:
            pending.discard(f)
            if f.status == "error":
                e = f.exception()
                if not isinstance(e, RankFailed):  # the cause: at once
                    raise e.with_traceback(None)
            failed_at = failed_at or (None if f.status == "finished" else time.monotonic())
        if failed_at is not None and (not pending or time.monotonic() - failed_at > grace):
            break
    errors = [f.exception() for f in futures if f.status == "error"]
    if errors:  # every rank that ended said a peer did: the first
        raise errors[0].with_traceback(None)
    cancelled = [workers[i] for i, f in enumerate(futures) if f.status != "finished"]
    if cancelled:
        raise GroupLost(f"blockflow: {what}: the ranks on {', '.join(cancelled)} were "
                        f"cancelled: data they read was lost with a worker.",
                        lost=set(workers) - set(workers_info(client)))
