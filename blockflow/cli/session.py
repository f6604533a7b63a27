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
import warnings
from multiprocessing import resource_tracker
from typing import Any, Iterator

import click

import blockflow
from blockflow.cli.options import _GPU_CHOICES, _OptionError
from blockflow.workloads import dashboard_page

_OUTPUT = "blockflow.output"  # ctx.meta: the run's --output, and whether it was written
_WRITTEN = "blockflow.output-written"


@contextlib.contextmanager
def _client(address: str | None, gpu: str | None = None, n_workers: int | None = None,
            threads_per_worker: int | None = None, policy: str | None = None,
            timeout: float | None = None, announce: bool = True,
            pools: dict | None = None) -> Iterator[Any]:
    """A client with blockflow's plugin; an embedded cluster (its workers in ``pools``, from
    :func:`_embedded_pools`) is shut down afterwards. The options were checked before
    (:func:`blockflow.cli.options._goal`)."""
    from blockflow.backends import GPUUnavailableError

    options = {"timeout": timeout}
    if address is None:
        options = {"gpu": None if gpu is None else _GPU_CHOICES[gpu], "n_workers": n_workers,
                   "threads_per_worker": threads_per_worker, "pools": pools or None}
    client = None
    _raise_if_stopped()
    try:
        try:
            with _sigint_deferred(enabled=address is None), _warnings_as_lines():
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
def _warnings_as_lines() -> Iterator[None]:
    """Warnings raised inside go to stderr as one line each, ``Warning: <message>``, not
    as Python shows them (file, line and source line)."""
    with warnings.catch_warnings(record=True) as caught:
        try:
            yield
        finally:
            for w in caught:
                click.echo(f"Warning: {w.message}", err=True)


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
    page = dashboard_page(link)
    if not page:
        return "n/a"
    return page if page != link else f"{link} (blockflow's page: More... > blockflow)"


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


@contextlib.contextmanager
def _one_line_warnings() -> Iterator[None]:
    """blockflow's warnings as one line on stderr (``Warning: ...``), not Python's two (the
    message, then the source line that warned)."""
    from blockflow.errors import BlockflowWarning

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, BlockflowWarning):
            click.echo(f"Warning: {message}", err=True)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


class _Group(click.Group):
    """SIGINT and SIGTERM stop a command once it has cleaned up: exit status 130 with one
    line, or 143."""

    def invoke(self, ctx: click.Context) -> Any:
        with _stop_on_signals(), _one_line_warnings():
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

    from blockflow.errors import ObjectiveError

    return (FileExistsError, OutputWriteError, BlockKernelError, WorkerLostError,
            ResourceError, ObjectiveError, JobFailed)


@contextlib.contextmanager
def _job(output: str, overwrite: bool, cluster: dict[str, Any], goal=None) -> Iterator[Any]:
    """The frame of every ``run`` command: check ``--output`` and the pools, start or connect
    to the cluster, yield the client inside ``with goal:`` (the run's objective, from
    :func:`blockflow.cli.options._objective`); :func:`_job_errors` end it with one
    ``Error: ...`` line."""
    pools = _embedded_pools(cluster, goal)  # before anything starts
    _check_output(output, overwrite)
    with _client(**cluster, pools=pools) as client:
        _print_inventory(client)
        if cluster["address"] is not None:
            _check_prices(client, goal, cluster["address"])
        try:
            with _objective_scope(goal):
                yield client
        except _job_errors() as e:
            raise click.ClickException(str(e)) from None
        link = client.dashboard_link
    click.echo(_dashboard_after(cluster["address"], link))


def _goal_option(goal) -> str:
    """The option that asked for prices: ``--objective cost`` or ``--budget``."""
    return "--objective cost" if goal.kind == "cost" else "--budget"


def _embedded_pools(cluster: dict[str, Any], goal) -> dict | None:
    """The embedded cluster's pools (the ``blockflow.pools`` setting), checked with the
    command's options before anything starts: None with ``--address`` or without pools.

    Raises
    ------
    _OptionError
        A bad pool, ``--n-workers`` (or ``blockflow.cluster.n-workers``) other than the
        pools' workers, or an objective needing prices of pools that have none.
    """
    from blockflow import config

    if cluster["address"] is not None:
        return None
    from blockflow.pools.cluster import pools_from_settings

    try:
        pools = pools_from_settings()
    except ValueError as e:
        raise _OptionError(str(e)) from None
    total = sum(pools.values())
    if pools:
        for name, n in (("--n-workers", cluster["n_workers"]),
                        ("the setting blockflow.cluster.n-workers",
                         config.get("cluster.n-workers"))):
            if n is not None and n != total:
                raise _OptionError(
                    f"{name} is {n} but the blockflow.pools setting puts {total} workers in "
                    f"pools ({', '.join(f'{p.name}: {k}' for p, k in pools.items())}); "
                    f"leave {name.removeprefix('the setting ')} out, or change the pools' "
                    f"workers.")
    if goal is None or not goal.needs_prices:
        return pools or None
    if not pools:
        raise _OptionError(
            f"{_goal_option(goal)} needs each pool's price, but the embedded cluster's "
            f"workers are all in the pool 'default', which has none; declare pools with "
            f"prices in the blockflow.pools setting (a Dask config file: docs/guide/pools.md, "
            f"'Pools in a config file'), or run on a cluster with priced pools (--address).")
    unpriced = [p.name for p in pools if p.price is None]
    if unpriced:
        raise _OptionError(
            f"{_goal_option(goal)} needs each pool's price, but pool {unpriced[0]!r} of the "
            f"blockflow.pools setting has none; give it price: <dollars per worker-hour>.")
    return pools


def _check_prices(client, goal, address: str) -> None:
    """With ``--address``: an objective needing prices needs every pool of that cluster to
    have one (:class:`click.ClickException`, exit status 1, before any task runs)."""
    if goal is None or not goal.needs_prices:
        return
    from blockflow.pools.pool import pools_of
    from blockflow.scheduling.view import workers_info

    unpriced = sorted({p.name for p in pools_of(workers_info(client)).values()
                       if p.price is None})
    if unpriced:
        raise click.ClickException(
            f"{_goal_option(goal)} needs each pool's price, but pool {unpriced[0]!r} of the "
            f"cluster at {address} has none; start its workers with `--preload "
            f"blockflow.pools.preload --pool {unpriced[0]} --price <dollars per "
            f"worker-hour>`, or leave out {_goal_option(goal)}.")


class _DropRefusals(logging.Filter):
    """Drops the scheduler's ERROR line about an objective it refused: the embedded
    scheduler runs in this process, and the job's ``Error: ...`` line says the same."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


@contextlib.contextmanager
def _objective_scope(goal) -> Iterator[None]:
    if goal is None:
        yield
        return
    log = logging.getLogger("blockflow.pools.objective")
    drop = _DropRefusals()
    log.addFilter(drop)
    try:
        with goal:
            yield
    finally:
        log.removeFilter(drop)
