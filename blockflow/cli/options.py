"""The command line's options and their checks, shared by the ``run`` commands."""

from __future__ import annotations

import math
from typing import Any, Callable

import click
from dask.utils import parse_timedelta

_GPU_CHOICES = {"auto": "auto", "true": True, "false": False}


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
                     help="Policy of blockflow's scheduler plugin (a name, or the dotted path of a "
                          "policy class). Default: the blockflow.cluster.policy setting "
                          "(dynamic)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


class _PolicyChoice(click.Choice):
    """The names in :data:`blockflow.scheduling.POLICIES`, read lazily, or the dotted path of
    a policy class (as ``blockflow.cluster.policy`` takes)."""

    def __init__(self):
        super().__init__([])

    @property
    def choices(self) -> tuple[str, ...]:
        from blockflow.scheduling import POLICIES

        return tuple(POLICIES)

    @choices.setter
    def choices(self, value) -> None:  # click.Choice.__init__ sets it; the registry rules
        pass

    def get_metavar(self, *args, **kwargs) -> str:
        return "[" + "|".join(self.choices) + "|PKG.POLICY]"

    def convert(self, value, param, ctx):
        if value in self.choices or (isinstance(value, str) and "." in value):
            return value  # a dotted path is checked where the scheduler runs (connect)
        from blockflow.scheduling.policies import policy_class

        try:
            policy_class(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return value


class _Duration(click.ParamType):
    """A time: seconds or a string :func:`dask.utils.parse_timedelta` reads ("30s", "2m")."""

    name = "duration"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            seconds = parse_timedelta(value)
        except (ValueError, KeyError, TypeError):
            seconds = None
        if seconds is None or not seconds > 0:
            self.fail(f"{value!r} is not a duration above 0; give seconds or a time with a "
                      f"unit, e.g. 30 or '2m'.", param, ctx)
        return seconds


_timeout_option = click.option(
    "--timeout", type=_Duration(), default=None, metavar="DURATION",
    help="With --address: how long to wait for the scheduler (seconds, or 30s, 2m); a "
         "refused connection is retried until then, for a scheduler that is still starting. "
         "Default: the blockflow.cluster.connect-timeout setting (5s).")


class _OptionError(click.ClickException):
    """A bad option value blockflow checks itself: ``Error: <message>``, exit status 2."""

    exit_code = 2


def _check_cluster_options(address: str | None, gpu: str | None, n_workers: int | None,
                           threads_per_worker: int | None, timeout: float | None = None
                           ) -> None:
    """Refuse embedded-cluster options with --address, and --timeout without it."""
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


def _check_address(address: str) -> None:
    """A scheduler address must look like ``[tcp://|tls://|ucx://]host:port``.

    Read as :func:`distributed.comm.parse_address` and ``parse_host_port`` read it, without
    importing distributed (seconds on a loaded machine): a bad address fails at once."""
    scheme, sep, loc = address.rpartition("://")
    scheme = scheme if sep else "tcp"
    port = None
    try:
        if scheme not in ("tcp", "tls", "ucx", "inproc"):
            raise ValueError(scheme)
        if scheme != "inproc":
            if loc.startswith("["):  # [IPv6]:port
                host, bracket, tail = loc[1:].partition("]")
                if not bracket or not tail.startswith(":"):
                    raise ValueError(loc)
                port = tail[1:]
            else:
                host, colon, port = loc.rpartition(":")
                if not colon or ":" in host:
                    raise ValueError(loc)
            if not port.isdigit():
                raise ValueError(loc)
            port = int(port)
    except ValueError:
        raise _OptionError(
            f"--address {address!r} is not a scheduler address; give "
            f"tcp://host:port (or tls://host:port), e.g. tcp://10.0.0.5:8786."
        ) from None
    if port is not None and not 1 <= port <= 65535:
        raise _OptionError(
            f"--address {address!r} has port {port}, outside 1-65535; give the port the "
            f"scheduler listens on, e.g. tcp://10.0.0.5:8786."
        )


def _output_options(default: str, help: str) -> Callable:
    """``--output`` and ``--overwrite``, shared by the ``run`` commands."""
    def decorate(command: Callable) -> Callable:
        command = click.option("--overwrite", is_flag=True,
                               help="Replace --output if it exists.")(command)
        return click.option("--output", type=click.Path(), default=default,
                            show_default=True, help=help)(command)
    return decorate


_retries_option = click.option(
    "--retries", type=click.IntRange(min=0), default=0, show_default=True,
    help="Extra attempts of a task that raises, on any worker (distributed's task retries).")


_progress_option = click.option(
    "--no-progress", is_flag=True,
    help="No progress bars (default: bars on stderr when it is a terminal).")


def _progress(no_progress: bool) -> bool | None:
    return False if no_progress else None  # None: a bar when stdout is a terminal


def _objective_options(command: Callable) -> Callable:
    """``--objective``, ``--deadline`` and ``--budget``, shared by the ``run`` commands."""
    options = [
        click.option("--objective", "objective_kind", type=click.Choice(["makespan", "cost"]),
                     default=None, help="What the run optimises over the cluster's pools: "
                     "the fastest run (makespan, the default) or the cheapest one that meets "
                     "--deadline (cost). Prices per pool: the blockflow.pools setting "
                     "(embedded cluster) or the workers' pools (--address)."),
        click.option("--deadline", default=None, metavar="DURATION",
                     help="With --objective cost: the run must finish within it (10m, 90s)."),
        click.option("--budget", default=None, metavar="DOLLARS",
                     help="With --objective makespan: the run may cost at most this many "
                          "dollars."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _goal(options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A ``run`` command's keyword options split into its objective (:func:`_objective`)
    and the cluster options (:func:`_cluster_options`), both checked: a bad value fails
    here, before the job imports its libraries (dask.dataframe, PyTorch) or starts a
    cluster."""
    options = dict(options)
    goal = _objective(options.pop("objective_kind"), options.pop("deadline"),
                      options.pop("budget"))
    _check_cluster_options(options["address"], options["gpu"], options["n_workers"],
                           options["threads_per_worker"], options["timeout"])
    if options["address"] is not None:
        _check_address(options["address"])
    return goal, options


def _objective(kind: str | None, deadline: str | None, budget: str | None):
    """The run's :class:`blockflow.pools.objective.Objective` from ``--objective``,
    ``--deadline`` and ``--budget``, or None when none is given.

    Raises
    ------
    _OptionError
        One line naming the options to fix (exit status 2).
    """
    if kind is None and deadline is None and budget is None:
        return None
    from blockflow.pools.objective import objective, positive_seconds

    if kind is None and deadline is not None and budget is not None:
        raise _OptionError("--deadline and --budget ask for two objectives (the cheapest run "
                           "by a deadline, the fastest within a budget); give one of them.")
    if kind is None:
        kind = "cost" if deadline is not None else "makespan"
    if kind == "cost" and deadline is None:
        raise _OptionError("--objective cost needs --deadline (the cheapest run that meets "
                           "it), e.g. --deadline 10m.")
    if kind == "cost" and budget is not None:
        raise _OptionError("--budget goes with --objective makespan (the fastest run within "
                           "it); with --objective cost give a --deadline only.")
    if kind == "makespan" and deadline is not None:
        raise _OptionError("--deadline goes with --objective cost (the cheapest run that "
                           "meets it); for the fastest run leave --deadline out, or give "
                           "--budget.")
    seconds = dollars = None
    if deadline is not None:
        seconds = positive_seconds(deadline)
        if seconds is None:
            raise _OptionError(f"--deadline {deadline!r} is not a duration above 0; give "
                               f"seconds or a time with a unit, e.g. 10m or 90s.")
    if budget is not None:
        try:
            dollars = float(budget)
        except ValueError:
            dollars = None
        if dollars is None or not math.isfinite(dollars) or dollars <= 0:
            raise _OptionError(f"--budget {budget!r} is not a number of dollars above 0; "
                               f"give e.g. --budget 2.5.")
    return objective(kind, deadline=seconds, budget=dollars)
