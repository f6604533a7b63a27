"""Waiting for futures while workers die: the client's one wait.

Waits that fail with :class:`~blockflow.errors.WorkerLostError` when the workers they need
are gone, instead of waiting forever. Guide: :doc:`/guide/reliability`.
"""

from __future__ import annotations

import asyncio
import time
from asyncio import CancelledError
from typing import Any, Callable, Iterable

from dask.utils import key_split, parse_timedelta
from distributed import Client, KilledWorker, futures_of, wait
from distributed import TimeoutError as DTimeout

from blockflow import _distributed, config
from blockflow.errors import WorkerLostError

__all__ = ["add_worker_plugin", "fetch", "fetch_many", "gather_as_done", "gather_results",
           "remove_worker_plugin", "run_each", "task_label", "wait_any", "wait_for"]


def wait_for(client: Client, futures: Any, *, what: str = "the computation",
             worker_loss_timeout: str | float | None = None) -> None:
    """Wait until ``futures`` are done (finished or failed), failing if every worker is lost.

    Like :func:`distributed.wait`; workers that come back reset the clock.

    Parameters
    ----------
    client : distributed.Client
    futures : future, collection of futures, or persisted Dask collection
    what : str, default "the computation"
        Named in the error message.
    worker_loss_timeout : str or float, optional
        Seconds (or ``"60s"``) without any worker before :class:`WorkerLostError`; default
        ``blockflow.cluster.worker-loss-timeout``.
    """
    pending = futures_of(futures)
    n = len(pending)
    futures = None  # a traceback keeps this frame: it must not keep the results alive
    limit = parse_timedelta(config.get("cluster.worker-loss-timeout", worker_loss_timeout))
    check_every = min(0.5, max(limit / 4, 0.05))
    checked = time.monotonic()
    lost_since = None
    # Polls Future.done() (local state) rather than distributed.wait(timeout=): a timed-out
    # wait leaves the futures referenced by its traceback until the garbage collector runs,
    # which keeps finished results on the workers for longer.
    while True:
        if any(f.status in ("error", "cancelled") for f in pending):
            return  # the caller's gather raises it: no need to wait for the rest
        pending = [f for f in pending if not f.done()]
        if not pending:
            return
        time.sleep(0.02)
        now = time.monotonic()
        if now - checked < check_every:
            continue
        checked = now
        if client.nthreads():
            lost_since = None
            continue
        lost_since = now if lost_since is None else lost_since
        if now - lost_since >= limit:
            left = len([f for f in pending if not f.done()])
            pending = None
            raise WorkerLostError(
                f"blockflow: every worker of the cluster at {client.scheduler.address} was "
                f"lost during {what}; with no worker for {limit:g} s, {left} of {n} "
                f"results could not be computed. Restart the workers (or the cluster) and run "
                f"again. Workers that keep dying usually run out of memory or crash: their "
                f"logs say which; give them more memory (memory_limit=) or use smaller blocks. "
                f"(blockflow.cluster.worker-loss-timeout sets how long to wait.)"
            )


def gather_results(client: Client, futures: Any, *, what: str = "the computation",
                   worker_loss_timeout: str | float | None = None) -> Any:
    """:func:`wait_for` the futures, then ``client.gather`` them; worker deaths explained.

    Raises
    ------
    WorkerLostError
        If every worker was lost, or in place of distributed's ``KilledWorker`` (chained).
    Exception
        A task's own exception.
    """
    wait_for(client, futures, what=what, worker_loss_timeout=worker_loss_timeout)
    try:
        return client.gather(futures)
    except KilledWorker as e:
        futures = None  # the traceback keeps this frame: don't keep the results alive
        last = getattr(e.last_worker, "address", e.last_worker)
        n = e.allowed_failures + 1
        raise WorkerLostError(
            f"blockflow: {what} failed because workers died while running "
            f"{task_label(e.task)}: "
            f"the worker running it died {n} time{'s' if n != 1 else ''} (the last one was "
            f"{last}), so Dask gave up on it (KilledWorker). A task that kills its worker usually runs "
            f"it out of memory or crashes native code: check the worker logs, give workers "
            f"more memory (memory_limit=) or use smaller blocks; if the deaths had nothing to "
            f"do with the task, raise distributed.scheduler.allowed-failures and run again."
        ) from e


def task_label(key) -> str:
    """A task key as messages name it, never the token: ``"block (3,) of step 'blockflow-x'"``."""
    name = key_split(key)
    if isinstance(key, tuple) and len(key) > 1:
        return f"block {tuple(key[1:])} of step {name!r}"
    return f"step {name!r}"


def fetch(future, *, timeout: float = 10.0, deadline: float | None = None) -> Any:
    """The result of a finished future, asked again every ``timeout`` seconds (distributed's
    ``Future.result(timeout=)`` can race) for at most ``deadline`` seconds.

    Raises
    ------
    WorkerLostError
        If the result was lost or the deadline passed; ``lost`` names the key.
    Exception
        The task's own exception.
    """
    end = None if deadline is None else time.monotonic() + deadline
    while True:
        try:
            return future.result(timeout=timeout)
        except (TimeoutError, UnboundLocalError):
            pass
        if future.status != "finished" or (end is not None and time.monotonic() >= end):
            raise WorkerLostError(
                f"blockflow: the result of {future.key!r} was lost before it could be "
                f"fetched (status {future.status!r}): the worker holding it left.",
                lost=[str(future.key)])


def fetch_many(futures, *, timeout: float = 10.0) -> list:
    """The results of finished futures of one client, in order, in one request within
    ``timeout`` seconds; any failure raises (fall back on :func:`fetch`).
    """
    futures = list(futures)
    if not futures:
        return []
    client = futures[0].client

    async def gather():
        return await asyncio.wait_for(client.gather(futures, asynchronous=True), timeout)

    return list(client.sync(gather))


def run_each(client: Client, fn: Callable, *args: Any, workers: Iterable[str] | None = None,
             what: str = "a call", timeout: str | float | None = None) -> dict[str, Any]:
    """``client.run(fn, *args)`` on each worker, each bounded: the workers that answered.

    A worker that does not answer within ``timeout`` (unreachable, dying, its event loop
    stuck) or whose connection fails on the way is left out, named in one
    :class:`~blockflow.errors.BlockflowWarning`; the call itself failing on a worker that
    answered is that worker's result (an exception object), as ``on_error="return"`` gives.

    Parameters
    ----------
    client : distributed.Client
    fn : callable
        Run on each worker (``dask_worker=`` is passed when it takes one, as ``client.run``).
    workers : iterable of str, optional
        Default: the workers the scheduler lists now.
    what : str, default "a call"
        Named in the warning ("the inventory's probe").
    timeout : str or float, optional
        Seconds per worker; default ``blockflow.cluster.worker-call-timeout``.

    Returns
    -------
    dict
        Worker address -> its result, for the workers that answered.
    """
    workers = list(client.scheduler_info()["workers"]) if workers is None else list(workers)
    limit = _call_timeout(timeout)

    async def one(w: str):
        try:
            got = await asyncio.wait_for(client.run(fn, *args, workers=[w], on_error="return",
                                                    asynchronous=True), limit)
        except (asyncio.TimeoutError, TimeoutError):
            return w, None, f"no answer within {limit:g} s"
        except (OSError, CancelledError) as e:  # the comm closed, the worker went
            return w, None, type(e).__name__
        value = got.get(w)
        if isinstance(value, (OSError, asyncio.TimeoutError, TimeoutError)):
            # the scheduler could not reach it (CommClosedError is an OSError)
            return w, None, type(value).__name__
        return w, value, None

    async def every():
        return await asyncio.gather(*(one(w) for w in workers))

    out, silent = {}, {}
    for w, value, why in (client.sync(every) if workers else []):
        if why is None:
            out[w] = value
        else:
            silent[w] = why
    _name_silent(client, silent, what, limit)
    return out


def add_worker_plugin(client: Client, plugin: Any, *, what: str | None = None,
                      timeout: str | float | None = None) -> None:
    """``client.register_plugin(plugin)`` for a worker plugin, each worker bounded: a worker
    that does not answer within ``timeout`` is named in one
    :class:`~blockflow.errors.BlockflowWarning` and the registration goes on (the scheduler
    keeps the plugin for the workers that join later).

    Parameters
    ----------
    client : distributed.Client
    plugin : distributed.WorkerPlugin
    what : str, optional
        Named in the warning; default "setting up blockflow on the workers".
    timeout : str or float, optional
        Seconds per worker; default ``blockflow.cluster.worker-call-timeout``.

    Raises
    ------
    Exception
        The plugin's ``setup`` failing on a worker, as ``Client.register_plugin`` raises it.
    """
    limit = _call_timeout(timeout)
    silent = _distributed.add_worker_plugin_each(client, plugin, limit)
    _name_silent(client, silent, what or "setting up blockflow on the workers", limit)


def remove_worker_plugin(client: Client, name: str, *, what: str | None = None,
                         timeout: str | float | None = None) -> None:
    """``client.unregister_worker_plugin(name)``, each worker bounded as
    :func:`add_worker_plugin`; nothing when no plugin ``name`` is registered."""
    limit = _call_timeout(timeout)
    silent = _distributed.remove_worker_plugin_each(client, name, limit)
    _name_silent(client, silent, what or "removing blockflow's set-up from the workers", limit)


def _call_timeout(timeout: str | float | None) -> float:
    return float(parse_timedelta(config.get("cluster.worker-call-timeout", timeout)))


def _name_silent(client: Client, silent: dict[str, str], what: str, limit: float) -> None:
    """One warning naming the workers of ``silent`` (address -> why) still in the cluster."""
    import warnings

    from blockflow.errors import BlockflowWarning

    if silent:
        try:  # a worker that left the cluster meanwhile (killed, a shutdown, Ctrl-C) is no
            # news: the scheduler's removal of it says so
            listed = set(client.scheduler_info(n_workers=-1)["workers"])
        except Exception:
            listed = set()
        silent = {w: why for w, why in silent.items() if w in listed}
    if silent:
        named = ", ".join(f"{w} ({why})" for w, why in silent.items())
        many = len(silent) > 1
        warnings.warn(f"blockflow: {what}: going on without worker{'s' * many} {named}; "
                      f"check {'they are' if many else 'it is'} reachable, or raise "
                      f"blockflow.cluster.worker-call-timeout.", BlockflowWarning,
                      stacklevel=3)


def wait_any(futures: Iterable, timeout: float = 1.0) -> list:
    """The done futures of ``futures``, waiting up to ``timeout`` seconds for the first."""
    futures = list(futures)
    if not futures:
        return []
    try:
        done, _ = wait(futures, timeout=timeout, return_when="FIRST_COMPLETED")
    except (DTimeout, TimeoutError) as e:
        # distributed's sync() keeps the error in a frame its traceback holds: a cycle
        # that kept these futures (and the callers' frames) until the next gc
        e.__traceback__ = None
        return []
    return [f for f in futures if f in done]


def gather_as_done(futures: Iterable, *, alive: Callable[[], Iterable[str]],
                   needed: Iterable[str] = (), poll: float = 0.5,
                   get: Callable[[Any], Any] | None = None,
                   deadline: float | None = None) -> list:
    """Every future's result, in the order they finish; fails fast on a lost worker.

    Parameters
    ----------
    futures : iterable of distributed.Future
    alive : callable
        Returns the addresses of the workers alive now.
    needed : iterable of str
        The workers holding the futures' inputs.
    poll : float, default 0.5
        Seconds between worker checks while nothing finishes.
    get : callable, optional
        Fetches one done future (default ``future.result()``).
    deadline : float, optional
        Seconds in all (default no bound).

    Raises
    ------
    WorkerLostError
        When workers of ``needed`` left (``lost`` names them).
    TimeoutError
        When ``deadline`` passed.
    """
    needed = set(needed)
    get = get or (lambda f: f.result())
    pending, got = list(futures), []
    end = None if deadline is None else time.monotonic() + deadline

    def check() -> None:
        lost = needed - set(alive())
        if lost:
            raise WorkerLostError(f"blockflow: workers lost: {sorted(lost)}", lost=lost)

    while pending:
        try:
            # a future cancelled for "lost dependencies" raises in the wait as in the fetch
            done = wait_any(pending, timeout=poll)
            for f in done:
                got.append(get(f))
                pending.remove(f)
        except CancelledError:  # "lost dependencies": a worker died under the computation
            raise WorkerLostError(f"blockflow: workers lost: "
                                  f"{sorted(needed - set(alive()))}",
                                  lost=needed - set(alive())) from None
        except WorkerLostError:
            raise
        except Exception:
            check()
            raise
        if not done:
            check()
            if end is not None and time.monotonic() >= end:
                raise TimeoutError(f"blockflow: {len(pending)} results not back within "
                                   f"{deadline:g} s: {[str(f.key) for f in pending[:5]]}")
    return got
