"""A command's session: connect to or start the cluster, stop on SIGINT/SIGTERM, shut down.

SIGINT (Ctrl-C) and SIGTERM are taken as ``dask scheduler`` takes them: the command's client
is closed and it ends with exit status 130 and one line, or 143.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import threading
import time
from multiprocessing import resource_tracker
from typing import Any, Iterator

import click

import blockflow
from blockflow.cli.options import _GPU_CHOICES, _check_address, _check_cluster_options

_OUTPUT = "blockflow.output"  # ctx.meta: the run's --output, and whether it was written
_WRITTEN = "blockflow.output-written"


@contextlib.contextmanager
def _client(address: str | None, gpu: str | None = None, n_workers: int | None = None,
            threads_per_worker: int | None = None, policy: str | None = None,
            timeout: float | None = None, announce: bool = True) -> Iterator[Any]:
    """A client with blockflow's plugin; an embedded cluster is shut down afterwards."""
    from blockflow.backends import GPUUnavailableError

    _check_cluster_options(address, gpu, n_workers, threads_per_worker, timeout)
    options = {}
    if address is None:
        options = {"gpu": None if gpu is None else _GPU_CHOICES[gpu], "n_workers": n_workers,
                   "threads_per_worker": threads_per_worker}
    if address is not None:
        _check_address(address)
        options = {"timeout": timeout}
    client = None
    _raise_if_stopped()
    try:
        try:
            with _sigint_deferred(enabled=address is None):
                client = blockflow.connect(address, policy=policy, **options)
        except (GPUUnavailableError, OSError, ValueError) as e:  # incl. invalid settings
            raise click.ClickException(str(e)) from None
        # a stop closes the client from its own event loop: the command's waits on it end
        _STOP["hooks"].append(lambda: client.loop.add_callback(client.close))
        _raise_if_stopped()
        if announce:  # blockflow's page; an embedded cluster's is live only during the job
            click.echo(f"Dashboard (while the job runs): {_page(client.dashboard_link)}")
        yield client
    finally:
        if client is None:
            pass
        elif address is None:
            with _quiet_shutdown():
                _close_workers_first(client)
                client.shutdown()  # we started the cluster: stop its workers and scheduler
        else:
            client.close()  # someone else's cluster: leave it running


@contextlib.contextmanager
def _quiet_shutdown() -> Iterator[None]:
    """While the embedded cluster shuts down on purpose: release what this process holds
    and keep distributed's worker-loss warnings off the terminal."""
    gc.collect()  # futures held only by reference cycles are released before, not lost
    loggers = [logging.getLogger(name) for name in ("distributed", "distributed.scheduler",
                                                    "distributed.nanny")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _close_workers_first(client, timeout: float = 30.0) -> None:
    """Close an embedded cluster's workers before its scheduler (best effort)."""
    cluster = getattr(client, "cluster", None)
    if cluster is None or not hasattr(cluster, "scale"):
        return
    try:
        cluster.scale(0)
        deadline = time.monotonic() + timeout
        while cluster.workers and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # a cluster already closing, or a worker stuck: shutdown handles it
        pass


@contextlib.contextmanager
def _sigint_deferred(enabled: bool = True) -> Iterator[None]:
    """Block SIGINT while the embedded cluster starts, so worker processes inherit it and
    Ctrl-C reaches only this process."""
    if (not enabled or not hasattr(signal, "pthread_sigmask")
            or threading.current_thread() is not threading.main_thread()):
        yield
        return
    # multiprocessing's resource tracker, started on first use, unblocks SIGINT in the
    # thread that starts it (distributed's event loop thread, which then starts the
    # workers): start it now, before the block.
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _page(link: str | None) -> str:
    """blockflow's dashboard page from the cluster's dashboard link (``.../status``)."""
    if not link:
        return "n/a"
    if link.endswith("/status"):
        return link[: -len("status")] + "blockflow"
    return f"{link} (blockflow's page: More... > blockflow)"


def _dashboard_after(address: str | None, link: str | None) -> str:
    """The dashboard line once the job is done: no link to an embedded cluster, now gone."""
    if address is None:
        return ("Dashboard: closed (the embedded cluster has stopped; to keep a dashboard "
                "after the job, run it on a cluster of your own with --address)")
    return f"Dashboard: {_page(link)} (the cluster at {address} keeps running)"


def _without_dashboard_line(text: str) -> str:
    """A job's report without its ``Dashboard: <link>`` line."""
    return "\n".join(x for x in text.splitlines() if not x.startswith("Dashboard:"))


def _print_inventory(client) -> None:
    click.echo(blockflow.inventory(client))
    click.echo("")


class _Group(click.Group):
    """SIGINT and SIGTERM stop a command once it has cleaned up: exit status 130 with one
    line, or 143."""

    def invoke(self, ctx: click.Context) -> Any:
        with _stop_on_signals():
            try:
                result = super().invoke(ctx)
            except BaseException:
                if _STOP["signum"] is None:
                    raise
                result = None  # what the stop made the command raise
            if _STOP["signum"] is not None:
                if _STOP["signum"] == signal.SIGINT:
                    click.echo(_interrupted_message(ctx.meta), err=True)
                ctx.exit(128 + _STOP["signum"])  # as shells report a signal's end
            return result


_STOP: dict[str, Any] = {"signum": None, "hooks": []}


class _Stopped(Exception):
    """Raised where a command checks for a stop before it starts work."""


def _raise_if_stopped() -> None:
    if _STOP["signum"] is not None:
        raise _Stopped


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM ask the command to stop, as ``dask scheduler`` takes them: record
    the signal and run the stop hooks; a second signal gets Python's own handling."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        signal.signal(signum, old[signum])
        _STOP["signum"] = signum
        for name in ("distributed", "distributed.scheduler", "distributed.nanny",
                     "distributed.worker", "distributed.core", "asyncio",
                     "tornado.application"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        for hook in _STOP["hooks"]:
            hook()

    _STOP.update(signum=None, hooks=[])
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig, was in old.items():
        if was not in (signal.SIG_IGN, None):
            signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, was in old.items():
            if was is not None:
                signal.signal(sig, was)


def _interrupted_message(meta: dict) -> str:
    output = meta.get(_OUTPUT)
    if output is None:
        return "Interrupted (Ctrl-C)."
    if meta.get(_WRITTEN):
        return f"Interrupted (Ctrl-C) after the results were written to {output!r}."
    kept = " (the existing output there is untouched)" if os.path.lexists(output) else ""
    return (f"Interrupted (Ctrl-C): the run was stopped and nothing was written to "
            f"{output!r}{kept}.")


def _check_output(output: str, overwrite: bool) -> None:
    from blockflow.io import check_output_dir

    try:
        check_output_dir(output, overwrite)
    except OSError as e:  # exists, not a blockflow output, not writable, refuses folders
        raise click.ClickException(str(e)) from None
    click.get_current_context().meta[_OUTPUT] = os.path.abspath(output)


def _written() -> None:
    """The run has renamed its output into place: an interrupt no longer undoes it."""
    click.get_current_context().meta[_WRITTEN] = True


def _job_errors() -> tuple[type[BaseException], ...]:
    """The errors that end every ``run`` job with one ``Error: ...`` line (exit status 1)."""
    from blockflow.errors import BlockKernelError, ResourceError, WorkerLostError
    from blockflow.io import OutputWriteError
    from blockflow.workloads import JobFailed

    return (FileExistsError, OutputWriteError, BlockKernelError, WorkerLostError,
            ResourceError, JobFailed)


@contextlib.contextmanager
def _job(output: str, overwrite: bool, cluster: dict[str, Any]) -> Iterator[Any]:
    """The frame of every ``run`` command: check ``--output``, start or connect to the
    cluster, yield the client; :func:`_job_errors` end it with one ``Error: ...`` line."""
    _check_output(output, overwrite)
    with _client(**cluster) as client:
        _print_inventory(client)
        try:
            yield client
        except _job_errors() as e:
            raise click.ClickException(str(e)) from None
        link = client.dashboard_link
    click.echo(_dashboard_after(cluster["address"], link))
