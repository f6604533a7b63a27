"""blockflow's command line: run a ready workload on a Dask cluster, or show its inventory.

``blockflow run flights`` / ``blockflow run array-stats`` start an embedded cluster with
:func:`blockflow.connect` (``LocalCUDACluster`` when a GPU and dask-cuda are present, else
``LocalCluster``) or connect to a running scheduler with ``--address``, run the workload, print
what ran where and how fast, and write the results atomically to ``--output``. A run prints
the URL of blockflow's dashboard page when it starts; an embedded cluster's dashboard goes
with the cluster, so the last line says so rather than repeating a dead link. ``blockflow
info`` prints the worker inventory of a running cluster (``--address`` or Dask's
``scheduler-address`` setting); it starts none. The same commands run as
``python -m blockflow ...`` and ``dask blockflow ...`` (the ``dask_cli`` entry point).

Exit statuses: 2 for a bad option, as click gives for its own checks of option types and
ranges (which also print the usage): blockflow's checks (``--scale 0``, a malformed
``--address``, options of the embedded cluster with ``--address``, ``blockflow info``
without an address) and an invalid blockflow setting (``DASK_BLOCKFLOW__...``, checked once
by the ``blockflow`` group; see :mod:`blockflow.config`) end with a one-line ``Error: ...``.
1 when the job cannot run or fails: an existing or unwritable output folder, an unreachable
``--address`` or something other than a scheduler there, ``--gpu true`` without a GPU, a
failed task, an output that fails to be written (nothing is written); one line ``Error:
...``, before any cluster is started where it can be checked up front. Ctrl-C and SIGTERM
stop a run cleanly, leaving no partial output: exit status 130 (with one line saying so)
and 143.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator

import click

__all__ = ["cli"]

_GPU_CHOICES = {"auto": "auto", "true": True, "false": False}
_ARRAY_SIZES = ("small", "medium", "large")
_OUTPUT = "blockflow.output"  # ctx.meta: the run's --output, and whether it was written
_WRITTEN = "blockflow.output-written"


def _cluster_options(command: Callable) -> Callable:
    """The options that choose or start the cluster, shared by the ``run`` commands."""
    options = [
        click.option("--address", metavar="ADDRESS", default=None,
                     help="Scheduler to connect to (tcp://host:8786). Default: start an "
                          "embedded cluster on this machine."),
        _timeout_option,
        click.option("--gpu", type=click.Choice(list(_GPU_CHOICES)), default=None,
                     help="Embedded cluster: GPU workers (LocalCUDACluster) if available "
                          "(auto), required (true) or never (false). Default: the "
                          "blockflow.cluster.gpu setting (auto)."),
        click.option("--n-workers", type=click.IntRange(min=1), default=None,
                     help="Embedded cluster: number of workers. Default: one per GPU, or "
                          "distributed's default on CPU."),
        click.option("--threads-per-worker", type=click.IntRange(min=1), default=None,
                     help="Embedded cluster: threads per worker."),
        click.option("--policy", type=_PolicyChoice(), default=None,
                     help="Policy of blockflow's scheduler plugin. Default: the "
                          "blockflow.cluster.policy setting (dynamic)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


class _PolicyChoice(click.Choice):
    """The names in :data:`blockflow.scheduling.POLICIES`, read when an option is checked or
    the help is shown: importing the scheduling package (and distributed) waits until a
    command runs, so ``blockflow --help`` is quick and a Ctrl-C while a command starts is
    the command's to handle."""

    def __init__(self):
        super().__init__([])

    @property
    def choices(self) -> tuple[str, ...]:
        from blockflow.scheduling import POLICIES

        return tuple(POLICIES)

    @choices.setter
    def choices(self, value) -> None:  # click.Choice.__init__ sets it; the registry rules
        pass


class _Duration(click.ParamType):
    """A time: seconds or a string :func:`dask.utils.parse_timedelta` reads ("30s", "2min")."""

    name = "duration"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        from dask.utils import parse_timedelta

        try:
            seconds = parse_timedelta(value)
        except (ValueError, KeyError, TypeError):
            seconds = None
        if seconds is None or not seconds > 0:
            self.fail(f"{value!r} is not a duration above 0; give seconds or a time with a "
                      f"unit, e.g. 30 or '2min'.", param, ctx)
        return seconds


_timeout_option = click.option(
    "--timeout", type=_Duration(), default=None, metavar="DURATION",
    help="With --address: how long to wait for the scheduler (seconds, or 30s, 2min); a "
         "refused connection is retried until then, for a scheduler that is still starting. "
         "Default: the blockflow.cluster.connect-timeout setting (5s).")


class _OptionError(click.ClickException):
    """A bad option value that blockflow checks itself (``--scale 0``, a malformed
    ``--address``): ``Error: <message>`` and exit status 2, as for click's own checks of
    option types and ranges, without click's usage lines."""

    exit_code = 2


def _check_cluster_options(address: str | None, gpu: str | None, n_workers: int | None,
                           threads_per_worker: int | None, timeout: float | None = None
                           ) -> None:
    """Options of the embedded cluster make no sense with --address, nor --timeout without
    it: refuse, don't ignore."""
    if address is None:
        if timeout is not None:
            raise _OptionError("--timeout only applies with --address (how long to wait for "
                               "that scheduler); the embedded cluster is started here.")
        return
    given = [name for name, value in (("--gpu", gpu), ("--n-workers", n_workers),
                                      ("--threads-per-worker", threads_per_worker))
             if value is not None]
    if given:
        verb = "applies" if len(given) == 1 else "apply"
        raise _OptionError(
            f"{', '.join(given)} only {verb} to the embedded cluster and cannot be combined "
            f"with --address; size the workers of {address} where they are started."
        )


@contextlib.contextmanager
def _client(address: str | None, gpu: str | None = None, n_workers: int | None = None,
            threads_per_worker: int | None = None, policy: str | None = None,
            timeout: float | None = None, announce: bool = True) -> Iterator[Any]:
    """A client with blockflow's plugin; an embedded cluster is shut down afterwards."""
    import blockflow
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
    """While the embedded cluster shuts down, at the end of a job, on Ctrl-C or SIGTERM:
    release what this process still holds (results of a job that is over, a model kept by
    a reference cycle), and keep distributed's warnings about what the closing workers take
    with them ("Removing worker ... caused the cluster to lose already computed task(s)",
    "Worker process still alive after 4.0 seconds, killing") off the terminal: the cluster
    is being stopped on purpose, and nothing of the job is lost that it still needed. The
    log levels are restored afterwards."""
    import gc

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
    """Close an embedded cluster's workers before its scheduler.

    ``Client.shutdown()`` stops the scheduler while the workers still run: a worker whose
    heartbeat is in flight then logs "Failed to communicate with scheduler during
    heartbeat" with a CommClosedError traceback, as a *running* worker (distributed logs
    it at ERROR; seen in CI after a run that had succeeded). Scaling the cluster to zero
    first closes each worker in order while the scheduler still answers; a heartbeat its
    own close cuts is then logged while the worker is closing, which the filter blockflow
    installs on the workers it starts drops (:class:`blockflow._distributed.QuietClose`).
    Best effort: whatever it leaves, ``shutdown`` stops."""
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
    """Block SIGINT while the embedded cluster starts.

    Worker processes started meanwhile inherit the blocked signal, so Ctrl-C (which the
    terminal sends to the whole process group) reaches only this process, which shuts the
    cluster down in order, rather than every worker printing a KeyboardInterrupt traceback.
    A Ctrl-C pressed meanwhile is delivered when the block ends, once the client exists.
    """
    if (not enabled or not hasattr(signal, "pthread_sigmask")
            or threading.current_thread() is not threading.main_thread()):
        yield
        return
    # multiprocessing's resource tracker, started on first use, unblocks SIGINT in the
    # thread that starts it (distributed's event loop thread, which then starts the
    # workers): start it now, before the block.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _check_address(address: str) -> None:
    """A scheduler address must look like ``[tcp://|tls://|ucx://]host:port``."""
    from distributed.comm import parse_address
    from distributed.comm.addressing import parse_host_port

    port = None
    try:
        scheme, loc = parse_address(address)
        if scheme not in ("tcp", "tls", "ucx", "inproc"):
            raise ValueError(scheme)
        if scheme != "inproc":
            _, port = parse_host_port(loc)
    except (ValueError, TypeError):
        raise _OptionError(
            f"--address {address!r} is not a scheduler address; give "
            f"tcp://host:port (or tls://host:port), e.g. tcp://10.0.0.5:8786."
        ) from None
    if port is not None and not 1 <= port <= 65535:
        raise _OptionError(
            f"--address {address!r} has port {port}, outside 1-65535; give the port the "
            f"scheduler listens on, e.g. tcp://10.0.0.5:8786."
        )


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
    """A job's report without its ``Dashboard: <link>`` line (printed once the cluster's
    fate is known, by :func:`_dashboard_after`)."""
    return "\n".join(x for x in text.splitlines() if not x.startswith("Dashboard:"))


def _print_inventory(client) -> None:
    import blockflow

    click.echo(blockflow.inventory(client))
    click.echo("")


class _Group(click.Group):
    """SIGINT (Ctrl-C) and SIGTERM stop a command once it has cleaned up (temporary output
    folder deleted, embedded cluster shut down): exit status 130 with one line, or 143,
    instead of click's "Aborted!" and status 1."""

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
    """SIGINT and SIGTERM ask the command to stop, the way ``dask scheduler`` takes them
    (``distributed._signals.wait_for_signals``): the handler raises nothing, it records the
    signal, quiets distributed's logs of the work the stop abandons and runs the stop hooks
    (closing the command's client ends its waits on the cluster); the old handler is put
    back, so a second signal gets Python's own handling. A signal ignored at start stays
    ignored."""
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


@click.group(name="blockflow", cls=_Group,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="blockflow", prog_name="blockflow")
def cli() -> None:
    """blockflow: spread chunked data and AI workloads over many CPUs and GPUs with Dask.

    \b
    Jobs (blockflow run JOB --help for each):
      flights      the 2013 NYC flights ETL (Parquet tables)
      array-stats  per-grid-point moments of a gridded field
      train        data-parallel training of an MLP on the flights
      tune         asynchronous successive halving of an MLP on the digits
      infer        batch inference of a digits classifier
      pipeline     pipeline-parallel training of a small transformer
    """
    _validate_settings()


class _SettingsError(click.ClickException):
    """An invalid blockflow setting: ``Error: <message>`` and exit status 2 (a usage error,
    as for a bad option), without click's usage lines."""

    exit_code = 2


def _validate_settings() -> None:
    """Check blockflow's settings once, before any command starts a cluster or reads input;
    its warnings (environment variables that look like settings but are not read) are
    printed as one ``Warning: ...`` line each on stderr."""
    import warnings

    from blockflow import config
    # the settings whose allowed values code registers (cluster.policy: the policy
    # registry) are checked against that registry: import it first
    from blockflow.scheduling import policies  # noqa: F401

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            config.validate()
        except ValueError as e:
            raise _SettingsError(str(e)) from None
    for w in caught:
        click.echo(f"Warning: {w.message}", err=True)


@cli.group(name="run")
def run_group() -> None:
    """Run a ready job (flights, array-stats, train, tune, infer, pipeline) on a Dask cluster.

    Without --address an embedded cluster is started on this machine and shut down at the
    end. Results go to --output atomically: a failed run leaves no partial folder.
    """


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


def _output_options(default: str, help: str) -> Callable:
    """``--output`` (default folder ``default``, described by ``help``) and ``--overwrite``,
    shared by the ``run`` commands."""
    def decorate(command: Callable) -> Callable:
        command = click.option("--overwrite", is_flag=True,
                               help="Replace --output if it exists.")(command)
        return click.option("--output", type=click.Path(), default=default,
                            show_default=True, help=help)(command)
    return decorate


def _job_errors() -> tuple[type[BaseException], ...]:
    """The errors that end every ``run`` job with one ``Error: ...`` line (exit status 1),
    whichever the job: an output that exists or cannot be written (disk full, read-only),
    a block's kernel that failed, workers lost, resources no worker has, a job that ends
    with nothing to write (:class:`blockflow.workloads.JobFailed`)."""
    from blockflow.errors import BlockKernelError, ResourceError, WorkerLostError
    from blockflow.io import OutputWriteError
    from blockflow.workloads import JobFailed

    return (FileExistsError, OutputWriteError, BlockKernelError, WorkerLostError,
            ResourceError, JobFailed)


@contextlib.contextmanager
def _job(output: str, overwrite: bool, cluster: dict[str, Any]) -> Iterator[Any]:
    """The frame of every ``run`` command: check ``--output`` before any cluster starts,
    start or connect to the cluster (``cluster``: the ``_cluster_options``), print its
    inventory and yield the client; the errors of :func:`_job_errors` raised by the job end
    it with one ``Error: ...`` line (exit status 1), the same for every job; once the
    cluster is closed, print where its dashboard is, if anywhere."""
    _check_output(output, overwrite)
    with _client(**cluster) as client:
        _print_inventory(client)
        try:
            yield client
        except _job_errors() as e:
            raise click.ClickException(str(e)) from None
        link = client.dashboard_link
    click.echo(_dashboard_after(cluster["address"], link))


_retries_option = click.option(
    "--retries", type=click.IntRange(min=0), default=0, show_default=True,
    help="Extra attempts of a task that raises, on any worker (distributed's task retries).")


def _progress(no_progress: bool) -> bool | None:
    return False if no_progress else None  # None: a bar when stdout is a terminal


def _objective(kind: str | None, deadline: str | None, budget: float | None):
    """The run's :func:`blockflow.objective` from ``--objective/--deadline/--budget`` (a
    no-op context without them).

    Raises
    ------
    ValueError
        One line naming the option to fix (a deadline without ``--objective cost``...).
    """
    if kind is None and deadline is None and budget is None:
        return contextlib.nullcontext()
    from blockflow.pools.objective import objective

    if kind is None:
        kind = "cost" if deadline is not None else "makespan"
    if kind == "cost" and deadline is None:
        raise ValueError("--objective cost needs --deadline (the cheapest run that meets "
                         "it), e.g. --deadline 10m.")
    try:
        return objective(kind, deadline=deadline, budget=budget)
    except ValueError as e:
        raise ValueError(str(e).replace("blockflow.objective: ", "").replace(
            "deadline=", "--deadline").replace("budget=", "--budget")) from None


@run_group.command(name="flights")
@click.option("--scale", type=int, default=1, show_default=True,
              help="Copies of the 336,776-row 2013 NYC flights table (>= 1).")
@_output_options("blockflow-flights-out",
                 "Folder for by_carrier.parquet, by_origin_month.parquet, manifest.json.")
@click.option("--partitions-per-copy", type=int, default=4, show_default=True,
              help="Partitions per copy of the table (>= 1).")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.option("--objective", "objective_kind", type=click.Choice(["makespan", "cost"]),
              default=None, help="What the run optimises over the cluster's pools: the "
              "fastest run (makespan, the default) or the cheapest one that meets --deadline "
              "(cost).")
@click.option("--deadline", default=None, metavar="DURATION",
              help="With --objective cost: the run must finish within it (10m, 90s).")
@click.option("--budget", type=float, default=None, metavar="DOLLARS",
              help="With --objective makespan: the run may cost at most this many dollars.")
@_retries_option
@_cluster_options
def flights_command(scale: int, output: str, overwrite: bool, partitions_per_copy: int,
                    no_progress: bool, objective_kind: str | None, deadline: str | None,
                    budget: float | None, retries: int, **cluster: Any) -> None:
    """The 2013 NYC flights ETL: clean, feature, delay statistics per carrier and per
    (origin, month), written as Parquet."""
    from blockflow.workloads import flights

    try:  # bad input fails before a cluster starts
        flights.check_scale(scale)
        flights.check_partitions_per_copy(partitions_per_copy)
        goal = _objective(objective_kind, deadline, budget)
    except ValueError as e:
        raise _OptionError(str(e)) from None
    with _job(output, overwrite, cluster) as client, goal:
        result = flights.run(client, scale=scale, output=output,
                             partitions_per_copy=partitions_per_copy, overwrite=overwrite,
                             progress=_progress(no_progress), retries=retries)
        _written()
        click.echo(_without_dashboard_line(result.report()))


@run_group.command(name="array-stats")
@click.option("--size", type=click.Choice(_ARRAY_SIZES), default="small", show_default=True,
              help="Field size: small (1 MB), medium (249 MB) or large (3.8 GB) of float32.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the field (>= 0).")
@_output_options("blockflow-array-stats-out", "Folder for stats.parquet and manifest.json.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@_retries_option
@_cluster_options
def array_stats_command(size: str, seed: int, output: str, overwrite: bool, no_progress: bool,
                        retries: int, **cluster: Any) -> None:
    """Array statistics: per-grid-point moments of a generated gridded field (xarray),
    written as Parquet."""
    from dask.utils import format_bytes

    from blockflow.workloads import array_stats

    with _job(output, overwrite, cluster) as client:
        result = array_stats.run(client, size=size, output=output, overwrite=overwrite,
                                 seed=seed, progress=_progress(no_progress), retries=retries)
        _written()
        click.echo(f"blockflow array-stats: size {size} ({format_bytes(result.nbytes)}), "
                   f"seed {seed}")
        click.echo("")
        click.echo(result.summary().to_string())
        click.echo("")
        _echo_task_counts(result.task_counts)
        click.echo("")
        click.echo(f"Wall time: {result.wall_time:.2f} s")
        click.echo(f"Throughput: {format_bytes(result.bytes_per_second)}/s")
        click.echo(f"Output: {result.output}")


@run_group.command(name="train")
@click.option("--scale", type=click.IntRange(min=1), default=1, show_default=True,
              help="Copies of the 336,776-row 2013 NYC flights table (>= 1).")
@click.option("--epochs", type=click.IntRange(min=1), default=2, show_default=True,
              help="Passes over the training rows.")
@click.option("--batch-size", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Samples per step, split over the workers by speed.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=0.01,
              show_default=True, help="Adam's learning rate (> 0).")
@click.option("--hidden", type=click.IntRange(min=1), default=32, show_default=True,
              help="Units of the MLP's hidden layer.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the initialisation and the batches (>= 0).")
@_output_options("blockflow-train-out",
                 "Folder for model.pt, metrics.json, loss_curve.csv, manifest.json.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@_cluster_options
def train_command(scale: int, epochs: int, batch_size: int, lr: float, hidden: int,
                  seed: int, output: str, overwrite: bool, no_progress: bool,
                  **cluster: Any) -> None:
    """Train an MLP predicting, at departure, whether a 2013 NYC flight arrives > 15 minutes
    late (departure time and delay, carrier, origin, distance), data-parallel with
    speed-weighted shards; prints its held-out accuracy beside the majority class's."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise click.ClickException(f"blockflow: run train needs PyTorch ({e}); install it "
                                   f"with pip install 'blockflow[ai]'.") from None
    from blockflow.workloads import train

    with _job(output, overwrite, cluster) as client:
        result = train.run(client, output=output, scale=scale, epochs=epochs,
                           batch_size=batch_size, lr=lr, hidden=hidden, seed=seed,
                           overwrite=overwrite, progress=_progress(no_progress))
        _written()
        click.echo(result.report())
        click.echo("")
        _echo_task_counts(result.task_counts)


@run_group.command(name="tune")
@click.option("--configs", "n_configs", type=click.IntRange(min=1), default=81,
              show_default=True, help="MLP configurations drawn from the search space.")
@click.option("--eta", type=click.IntRange(min=2), default=3, show_default=True,
              help="Successive halving's factor: the top 1/eta of a rung is promoted.")
@click.option("--max-epochs", type=click.IntRange(min=1), default=27, show_default=True,
              help="Epochs of the top rung (rung 0 trains one).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the configurations (>= 0).")
@click.option("--promotion", type=click.Choice(["certain-first", "asha"]), default=None,
              help="Order of promotions: certain-first (synchronous SH's promotions first, "
                   "speculative ones for idle threads) or asha (Li et al.'s order). "
                   "Default: the setting blockflow.tune.promotion (certain-first).")
@_output_options("blockflow-tune-out",
                 "Folder for trials.parquet, history.parquet, best_model.pkl, manifest.json.")
@_cluster_options
def tune_command(n_configs: int, eta: int, max_epochs: int, seed: int,
                 promotion: str | None, output: str, overwrite: bool,
                 **cluster: Any) -> None:
    """Tune a small MLP on scikit-learn's bundled digits by asynchronous successive halving,
    trials running as Dask tasks on the fastest free workers."""
    try:
        from blockflow.workloads import digits_tuning
        import sklearn  # noqa: F401  (the trials' model; digits_tuning imports it lazily)
    except ImportError as e:  # scikit-learn missing
        raise click.ClickException(f"blockflow: run tune needs scikit-learn ({e}); install "
                                   f"it with pip install 'blockflow[ai]'.") from None
    with _job(output, overwrite, cluster) as client:
        result = digits_tuning.run(client, n_configs=n_configs, eta=eta, max_budget=max_epochs,
                                   seed=seed, promotion=promotion, output=output,
                                   overwrite=overwrite)
        _written()
        click.echo(result.report())
        click.echo("")
        _echo_task_counts(result.task_counts)


@run_group.command(name="infer")
@click.option("--scale", type=click.IntRange(min=1), default=10, show_default=True,
              help="Copies of scikit-learn's 1,797 digits to classify.")
@click.option("--blocks", type=click.IntRange(min=1), default=20, show_default=True,
              help="Row blocks of the replicated data.")
@_output_options("blockflow-infer-out", "Folder for predictions.parquet and manifest.json.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@_cluster_options
def infer_command(scale: int, blocks: int, output: str, overwrite: bool, no_progress: bool,
                  **cluster: Any) -> None:
    """Batch inference: a digits classifier trained here, applied to a chunked copy of the
    digits with blockflow.predict (the model shipped once per worker)."""
    try:
        from blockflow.workloads import digits_inference
        import sklearn  # noqa: F401
    except ImportError as e:  # scikit-learn missing
        raise click.ClickException(f"blockflow: run infer needs scikit-learn ({e}); install "
                                   f"it with pip install 'blockflow[ai]'.") from None
    with _job(output, overwrite, cluster) as client:
        result = digits_inference.run(client, scale=scale, blocks=blocks, output=output,
                                      overwrite=overwrite, progress=_progress(no_progress))
        _written()
        click.echo(result.report())
        click.echo("")
        _echo_task_counts(result.task_counts)
        click.echo(f"Output: {result.output}")


@run_group.command(name="pipeline")
@click.option("--n-train", type=click.IntRange(min=1), default=2000, show_default=True,
              help="Training sequences of the synthetic task (500 more are held out).")
@click.option("--epochs", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--micro-batches", "n_micro_batches", type=click.IntRange(min=1), default=4,
              show_default=True, help="Micro-batches per step (at most --batch-size).")
@click.option("--schedule", type=click.Choice(["gpipe", "1f1b"]), default="1f1b",
              show_default=True, help="Pipeline schedule.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@_output_options("blockflow-pipeline-out",
                 "Folder for model.pt, history.parquet, manifest.json.")
@_cluster_options
def pipeline_command(n_train: int, epochs: int, batch_size: int, n_micro_batches: int,
                     schedule: str, seed: int, output: str, overwrite: bool,
                     **cluster: Any) -> None:
    """Train a small transformer (a stack of nn.TransformerEncoderLayer) pipeline-parallel:
    stages on different workers, cut from measured layer times and free device memory."""
    if n_micro_batches > batch_size:
        raise click.BadParameter(f"{n_micro_batches} micro-batches for batches of "
                                 f"{batch_size} rows; pass at most --batch-size.",
                                 param_hint="--micro-batches")
    try:
        import torch  # noqa: F401
        from blockflow.workloads import sequence
    except ImportError as e:  # PyTorch missing
        raise click.ClickException(f"blockflow: run pipeline needs PyTorch ({e}); install "
                                   f"it with pip install 'blockflow[ai]'.") from None
    with _job(output, overwrite, cluster) as client:
        result = sequence.run(client, n_train=n_train, epochs=epochs, batch_size=batch_size,
                              n_micro_batches=n_micro_batches, schedule=schedule, seed=seed,
                              output=output, overwrite=overwrite)
        _written()
        click.echo(result.report())
        click.echo("")
        _echo_task_counts(result.task_counts)
        click.echo(f"Output: {result.output}")


def _echo_task_counts(counts: dict[str, int] | None) -> None:
    if not counts:
        click.echo("Tasks per worker: n/a (the scheduler runs no blockflow plugin)")
        return
    click.echo("Tasks per worker (this run):")
    width = max(len(w) for w in counts)
    for worker, n in sorted(counts.items()):
        click.echo(f"  {worker:<{width}}  {n:>6,}")


@cli.command(name="info")
@click.option("--address", metavar="ADDRESS", default=None,
              help="Scheduler of the cluster to show (tcp://host:8786). Default: Dask's "
                   "scheduler-address setting (DASK_SCHEDULER_ADDRESS).")
@_timeout_option
def info_command(address: str | None, timeout: float | None) -> None:
    """Print the workers of a running cluster with their threads, memory and GPUs."""
    import dask.config

    address = address or dask.config.get("scheduler-address", None)
    if not address:  # an embedded cluster started here would be gone before it was seen
        raise _OptionError(
            "blockflow info shows a running cluster: point it at one with --address "
            "tcp://host:8786 (or DASK_SCHEDULER_ADDRESS=tcp://host:8786). `blockflow run` "
            "starts an embedded cluster only for the length of its job.")
    with _client(address, timeout=timeout, announce=False) as client:
        _print_inventory(client)
        click.echo(f"Dashboard: {_page(client.dashboard_link)}")


def main() -> None:
    """Entry point of ``python -m blockflow``."""
    cli(prog_name="blockflow")

