"""The workload runner: progress, retries, task counts, timing and atomic output (private)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
import time
from typing import Any, Callable, Mapping, TypeVar

from distributed import futures_of

from blockflow._distributed.client import SchedulerProgress, in_notebook_kernel
from blockflow.blockwise import check_retries
from blockflow.cluster.report import pool_costs, warn_workers_left, worker_hosts
from blockflow.io import atomic_output_dir, write_manifest
from blockflow.scheduling.runs import new_run_id, run_scope
from blockflow.scheduling.view import plugin_status
from blockflow.scheduling.wait import gather_results, wait_for
from blockflow.workloads import dashboard_page

__all__ = ["Job", "StageProgress", "StepProgress", "new_bar", "run_workload", "show_progress",
           "task_counts_or_none"]

logger = logging.getLogger(__name__)

R = TypeVar("R")


def task_counts_or_none(client, run_id: str | None = None) -> dict[str, int] | None:
    """Worker -> tasks finished (of run ``run_id`` only, if given) per blockflow's plugin;
    None if the scheduler runs none."""
    try:
        if run_id is None:
            return dict(plugin_status(client)["task_counts"])
        run = plugin_status(client, run=run_id).get("requested_run")
    except RuntimeError:  # the scheduler runs no blockflow plugin
        return None
    counts = (run or {}).get("counts", {})
    return {w: int(n) for w, n in sorted(counts.items()) if n}


def show_progress(progress: bool | None) -> bool:
    """Whether to show progress bars: as asked, else (None) in Jupyter or a terminal."""
    if progress is None:
        return in_notebook_kernel() or bool(getattr(sys.stderr, "isatty", lambda: False)())
    return bool(progress)


def _bar_size(stream) -> dict[str, Any]:
    """tqdm's size arguments for a bar on ``stream``: its terminal's own size, read again
    as it changes, where the terminal reports one; else fixed, with what it does not report
    (0 columns or 0 rows, as a fresh pseudo-terminal does) from
    :func:`shutil.get_terminal_size` (``COLUMNS``/``LINES``, stdout's terminal, 100 x 24).
    tqdm draws no bar at all on a terminal of 0 rows (nor one of 0 columns)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        size = os.terminal_size((0, 0))
    if size.columns > 0 and size.lines > 0:
        return {"dynamic_ncols": True}
    fallback = shutil.get_terminal_size((100, 24))
    return {"ncols": size.columns or fallback.columns, "nrows": size.lines or fallback.lines}


def _notebook_bars() -> bool:
    """In a Jupyter kernel with ipywidgets: tqdm's widget bar works."""
    return in_notebook_kernel() and importlib.util.find_spec("ipywidgets") is not None


def _run_record(client, run_id: str) -> dict[str, Any] | None:
    """The run as blockflow's plugin counts it (``{}`` before its first graph), or None if
    the scheduler runs no blockflow plugin. Decisions are left out (``since`` now)."""
    try:
        return plugin_status(client, since=time.time(), run=run_id).get("requested_run") or {}
    except RuntimeError:
        return None


def new_bar(label: str, total: int | None, unit: str):
    """``(bar, line)``: a tqdm widget in Jupyter with ipywidgets, a disabled bar in a kernel
    without them (``line`` True: print one line at the end), else a text bar on stderr."""
    if _notebook_bars():
        from tqdm.notebook import tqdm

        return tqdm(total=total, desc=label, unit=unit), False
    from tqdm import tqdm

    if in_notebook_kernel():  # no ipywidgets: one line at the end, never escape codes
        return tqdm(total=total, desc=label, disable=True), True
    return tqdm(total=total, desc=label, unit=unit, file=sys.stderr,
                **_bar_size(sys.stderr)), False


class StepProgress:
    """A labelled bar of ``total`` steps that are not one graph each (training steps):
    :meth:`advance` after each, :meth:`finish` at the end."""

    def __init__(self, label: str, total: int, unit: str = " steps"):
        self.label, self._started = label, time.perf_counter()
        self.bar, self._line = new_bar(label, total, unit)

    def advance(self, n: int = 1, **postfix) -> None:
        """``n`` more steps done; ``postfix`` (``loss=0.41``) is shown after the bar."""
        self.bar.update(n)
        if postfix:
            self.bar.set_postfix(postfix, refresh=False)

    def finish(self) -> None:
        """End the bar where it is."""
        self.bar.close()
        if self._line:
            print(f"{self.label}: {self.bar.n:,} of {self.bar.total:,} steps after "
                  f"{time.perf_counter() - self._started:.1f} s")


class StageProgress:
    """The progress bar of one stage of a job (:func:`new_bar`), from blockflow's run record
    (``before``) or distributed's progress feed; call :meth:`finish` at the stage's end."""

    def __init__(self, client, label: str, *, run_id: str, before: dict | None, futures):
        self.client, self.label, self.run_id, self.before = client, label, run_id, before
        self.bar, self._line = new_bar(label, None, " tasks")
        self._started, self._t0 = time.perf_counter(), self.bar.start_t
        self._stop = threading.Event()
        self._loop = self._task = None
        if before is None:
            feed = SchedulerProgress(futures, client, self._draw)
            self._loop = asyncio.new_event_loop()
            self._task = self._loop.create_task(feed.listen())
        self._thread = threading.Thread(target=self._follow, daemon=True,
                                        name="blockflow-progress")
        self._thread.start()

    def _stage_counts(self) -> tuple[int, int] | None:
        """(finished, total) of the stage's tasks per the run record, None before the
        scheduler has the stage's graph."""
        run = self.client.sync(self.client.scheduler.blockflow_status, since=time.time(),
                               run=self.run_id).get("requested_run")
        if not run or run["graphs"] <= self.before.get("graphs", 0):
            return None
        total = run["tasks"] - self.before.get("tasks", 0)
        return min(run["finished"] - self.before.get("finished", 0), total), total

    def _follow(self) -> None:
        try:
            if self._loop is not None:
                self._loop.run_until_complete(self._task)
                return
            while not self._stop.wait(0.2):
                counts = self._stage_counts()
                if counts is not None:
                    self._draw(*counts)
        except (asyncio.CancelledError, Exception) as e:  # a bar never fails the job
            logger.debug("blockflow: progress bar %r stopped: %r", self.label, e)
        finally:
            if self._loop is not None:
                with contextlib.suppress(Exception):
                    self._loop.run_until_complete(self._loop.shutdown_asyncgens())
                self._loop.close()

    def _draw(self, done: int, total: int) -> None:
        if self.bar.total != total:
            self.bar.reset(total=total)  # also the widget's maximum in Jupyter
            # keep the clock of the stage's start: the rate is not of the last 200 ms
            self.bar.start_t = self.bar.last_print_t = self._t0
        self.bar.n = done
        self.bar.refresh()

    def finish(self, done: bool, timeout: float = 2.0) -> None:
        """End the bar: the stage's final counts, or where it stopped if not ``done``."""
        self._stop.set()
        self._thread.join(timeout)  # the last count, usually within 200 ms
        if self._thread.is_alive() and self._loop is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            counts = None
            if self.before is not None:
                with contextlib.suppress(Exception):
                    counts = self._stage_counts()
            if counts is not None:
                self._draw(*counts)
            elif done and self.bar.total is not None:
                self._draw(self.bar.total, self.bar.total)
        self.bar.close()
        if self._line:
            total = "?" if self.bar.total is None else f"{self.bar.total:,}"
            print(f"{self.label}: {total} tasks, {'done' if done else 'stopped'} after "
                  f"{time.perf_counter() - self._started:.1f} s")


class Job:
    """One run of a workload: every graph it submits belongs to one run
    (:func:`blockflow.scheduling.runs.run_scope`).

    Parameters
    ----------
    client : distributed.Client
    what : str
        The run's name in errors and the dashboard.
    progress : bool, optional
        Default in Jupyter or a terminal.
    retries : int, default 0

    Attributes
    ----------
    run_id : str
    wall_time : float or None
        Seconds from :meth:`start` to :meth:`stop`.
    task_counts : dict of str to int, or None
        Tasks per worker (None without blockflow's plugin).
    """

    def __init__(self, client, what: str, *, progress: bool | None = None, retries: int = 0):
        self.client = client
        self.what = what
        self.show = show_progress(progress)
        self.retries = retries
        self.run_id = new_run_id(what)
        self.wall_time: float | None = None
        self.task_counts: dict[str, int] | None = None
        self._start: float | None = None
        self._workers: dict[str, str] = {}  # address -> host, when the run started

    @property
    def dashboard_link(self) -> str | None:
        """blockflow's page of the cluster's dashboard (:func:`dashboard_page`), if it has
        one."""
        return dashboard_page(self.client.dashboard_link)

    @property
    def n_tasks(self) -> int | None:
        """Tasks this run finished: the sum of :attr:`task_counts` (None without them)."""
        return None if self.task_counts is None else sum(self.task_counts.values())

    def start(self) -> None:
        """Start the clock."""
        self._start = time.perf_counter()
        self._workers = worker_hosts(self.client)

    def stop(self) -> float:
        """Stop the clock, read :attr:`task_counts`; :attr:`wall_time` in seconds. Workers
        that left meanwhile are named in one warning."""
        self.wall_time = time.perf_counter() - self._start
        self.task_counts = task_counts_or_none(self.client, self.run_id)
        warn_workers_left(self.client, self._workers, self.what)
        return self.wall_time

    def _bar(self, before, submitted, label: str | None) -> StageProgress | None:
        if not self.show:
            return None
        try:
            return StageProgress(self.client, label or self.what, run_id=self.run_id,
                                 before=before, futures=futures_of(submitted))
        except Exception as e:  # e.g. no terminal to draw on: the job runs without a bar
            logger.debug("blockflow: no progress bar for %s: %r", label or self.what, e)
            return None

    def steps(self, label: str, total: int) -> StepProgress | None:
        """A :class:`StepProgress` of ``total`` steps if the job shows bars, else None."""
        if not self.show:
            return None
        try:
            return StepProgress(label, total)
        except Exception as e:  # e.g. no terminal to draw on: the job runs without a bar
            logger.debug("blockflow: no progress bar for %s: %r", label, e)
            return None

    def _before(self) -> dict | None:
        """The run's record before a stage is submitted (for its bar), if a bar is shown."""
        return _run_record(self.client, self.run_id) if self.show else None

    def _stage(self, submit: Callable, wait: Callable, collections, label: str | None
               ) -> tuple[Any, Any]:
        """``(submit(collections), wait(...))`` as a stage of this run, under its bar."""
        before = self._before()
        with run_scope(self.what, self.run_id):
            submitted = submit(collections, retries=self.retries or None)
        bar, done = self._bar(before, submitted, label), False
        try:
            waited = wait(self.client, submitted, what=self.what)
            done = True
            return submitted, waited
        finally:
            if bar is not None:
                bar.finish(done)
            submitted = None  # a traceback keeps this frame: it must not keep the results

    def persist(self, collections, *, label: str | None = None):
        """``client.persist(collections)``, waited for
        (:func:`~blockflow.scheduling.wait.wait_for`)."""
        persisted, _ = self._stage(self.client.persist, wait_for, collections, label)
        return persisted

    def compute(self, collections, *, label: str | None = None):
        """The results of ``client.compute(collections)``
        (:func:`~blockflow.scheduling.wait.gather_results`)."""
        _, results = self._stage(self.client.compute, gather_results, collections, label)
        return results


def _pool_costs(client) -> dict | None:
    """The run's cost per pool (:func:`blockflow.cluster.report.pool_costs`), or None
    without pools or without blockflow's plugin."""
    try:
        return pool_costs(client)
    except RuntimeError:  # no plugin on that scheduler
        return None


def run_workload(
    client,
    what: str,
    compute: Callable[[Job], R],
    write: Callable[[R, str], Mapping[str, Any] | None],
    *,
    name: str,
    output: str | os.PathLike | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    retries: int | None = None,
) -> R:
    """Run a workload's ``compute(job)`` on the cluster and write its output atomically.

    Parameters
    ----------
    client : distributed.Client
    what, name : str
        The run and the workload, as messages name them.
    compute : callable
        ``compute(job)`` -> result (with ``output`` and ``manifest()``).
    write : callable
        ``write(result, directory)`` -> extra manifest entries.
    output : str or path-like, optional
    overwrite : bool, default False
    progress : bool, optional
    retries : int, optional

    Returns
    -------
    The result of ``compute``, ``output`` set to the absolute folder.

    Raises
    ------
    ValueError
        If ``retries`` is not an integer >= 0.
    FileExistsError
        If ``output`` exists and ``overwrite`` is False.
    """
    retries = check_retries(retries, name)
    with contextlib.ExitStack() as stack:
        tmp = None
        if output is not None:
            # Claim the output first: an existing folder fails before any work, and a run
            # that fails later leaves nothing behind (and an old output untouched).
            tmp = stack.enter_context(atomic_output_dir(output, overwrite=overwrite))
        result = compute(Job(client, what, progress=progress, retries=retries))
        if tmp is not None:
            result.output = os.path.abspath(os.fspath(output))
            extra = write(result, tmp) or {}
            manifest = {**result.manifest(), **extra}
            costs = _pool_costs(client)
            if costs is not None:  # workers in pools: cost per pool, egress, LP bound
                manifest["cost"] = costs
            write_manifest(tmp, manifest)
    return result
