"""The workload runner: what every ready workload does around its own graph (not public API).

A workload (:mod:`~blockflow.workloads.flights`, :mod:`~blockflow.workloads.array_stats`)
supplies two steps, and :func:`run_workload` does the rest the same way for all of them:

* ``compute(job)`` builds the workload's graph and runs it through the :class:`Job` it is
  handed: :meth:`Job.persist` / :meth:`Job.compute` submit with distributed's task
  ``retries``, show one labelled progress bar per stage (:class:`StageProgress`: tqdm in a
  terminal, an ipywidgets bar in Jupyter), and wait while watching for lost workers
  (:func:`blockflow.cluster.wait_for`, :func:`~blockflow.cluster.gather_results`). Every
  graph a job submits belongs to one run (:mod:`blockflow.scheduling.runs`): :meth:`Job.stop`
  reads the tasks each worker finished for that run from blockflow's scheduler plugin, the
  same numbers the dashboard's "Tasks (this run)" column shows. It returns the workload's
  result object.
* ``write(result, directory)`` writes the data files into a temporary folder and returns
  extra manifest entries; :func:`run_workload` adds ``manifest.json``
  (``result.manifest()`` plus those entries) and renames the folder into place
  (:func:`blockflow.io.atomic_output_dir`): a failed run leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Mapping, TypeVar

from distributed import futures_of

from blockflow._distributed.client import SchedulerProgress, in_notebook_kernel
from blockflow.blockwise import check_retries
from blockflow.cluster.report import pool_costs
from blockflow.io import atomic_output_dir, write_manifest
from blockflow.scheduling.runs import new_run_id, run_scope
from blockflow.scheduling.view import plugin_status
from blockflow.scheduling.wait import gather_results, wait_for

__all__ = ["Job", "StageProgress", "StepProgress", "new_bar", "run_workload", "show_progress",
           "task_counts_or_none"]

logger = logging.getLogger(__name__)

R = TypeVar("R")


def task_counts_or_none(client, run_id: str | None = None) -> dict[str, int] | None:
    """Tasks finished per worker per blockflow's plugin, or None if the scheduler has none.

    With ``run_id``: the tasks of that run only (:mod:`blockflow.scheduling.runs`; ``{}``
    for a run that ran nothing); without: since the plugin started.
    """
    try:
        if run_id is None:
            return dict(plugin_status(client)["task_counts"])
        run = plugin_status(client, run=run_id).get("requested_run")
    except RuntimeError:  # the scheduler runs no blockflow plugin
        return None
    counts = (run or {}).get("counts", {})
    return {w: int(n) for w, n in sorted(counts.items()) if n}


def show_progress(progress: bool | None) -> bool:
    """Whether to show progress bars: as asked, or (None) in a Jupyter kernel or when stderr
    (where the terminal bars go) is a terminal."""
    if progress is None:
        return in_notebook_kernel() or bool(getattr(sys.stderr, "isatty", lambda: False)())
    return bool(progress)


def _columns(stream) -> int:
    """The width of the terminal ``stream`` writes to; 0 if unknown."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


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
    """A tqdm bar as every job draws one: ``(bar, line)``.

    In a Jupyter kernel with ipywidgets a widget; in a kernel without them a disabled bar
    (``line`` True: the caller prints one line when it ends, never escape codes); else a
    text bar on stderr.
    """
    if _notebook_bars():
        from tqdm.notebook import tqdm

        return tqdm(total=total, desc=label, unit=unit), False
    from tqdm import tqdm

    if in_notebook_kernel():  # no ipywidgets: one line at the end, never escape codes
        return tqdm(total=total, desc=label, disable=True), True
    # a terminal that reports no width (a fresh pseudo-terminal) would get empty bars
    width = {"dynamic_ncols": True} if _columns(sys.stderr) else {"ncols": 100}
    return tqdm(total=total, desc=label, unit=unit, file=sys.stderr, **width), False


class StepProgress:
    """A labelled progress bar of a job's steps that are not one graph each (training
    steps): :meth:`advance` after each, :meth:`finish` at the end; drawn as
    :class:`StageProgress` draws its bars (tqdm on stderr, a widget in Jupyter).

    Parameters
    ----------
    label : str
        The stage, as the bar names it (``"train [2/2] 132 steps"``).
    total : int
        Steps expected.
    unit : str, default " steps"
    """

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
    """One labelled progress bar for one stage (one submitted graph) of a job, drawn with
    tqdm.

    In a terminal (or any non-Jupyter stream) a text bar on stderr
    (``label:  45%|####  | 18/40 [00:01<00:01, 14.2 tasks/s]``); in a Jupyter kernel an
    ipywidgets bar (``tqdm.notebook``): no text lines and no escape codes in the cell; in a
    kernel without ipywidgets one line when the stage ends.

    With blockflow's scheduler plugin the bar counts the tasks the stage's graph added to
    the job's run (:mod:`blockflow.scheduling.runs`) and how many of them finished: the
    stages' totals add up to the run's task count that the report, the dashboard and
    ``manifest.json`` show. Without the plugin it counts, with distributed's
    :class:`~distributed.diagnostics.progress.Progress`, the tasks still to run for the
    stage's futures. Either way results already in memory (an earlier stage's persisted
    output) are not counted: each bar starts at 0.

    Parameters
    ----------
    client : distributed.Client
    label : str
        The stage, as the bar names it (``"flights [1/2] load, clean, persist"``).
    run_id : str
        The job's run.
    before : dict or None
        The run's record (:meth:`blockflow.scheduling.runs.Run.as_dict`, ``{}`` if none yet)
        read before the stage was submitted; None when the scheduler runs no blockflow plugin.
    futures : list of distributed.Future
        The stage's futures (used without the plugin).

    Notes
    -----
    The bar is created in the calling thread (a widget is displayed in the running cell);
    counts are read in a background thread every 200 ms, so the caller may block meanwhile.
    Call :meth:`finish` when the stage is over.
    """

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
    """One run of a workload on a cluster: submission, progress, timing and task counts.

    Every graph the job submits (:meth:`persist`, :meth:`compute`) is part of one run
    (:func:`blockflow.scheduling.runs.run_scope`), so the dashboard's "Tasks (this run)"
    does not start over at the second graph, and :attr:`task_counts` are the tasks of this
    job only (not those other clients ran meanwhile).

    Parameters
    ----------
    client : distributed.Client
        Connected client; the work runs on its cluster.
    what : str
        The run as error messages and the dashboard name it (``"the flights ETL (scale 2)"``).
    progress : bool, optional
        Show one labelled progress bar per stage (:class:`StageProgress`); default: in
        Jupyter, or when stderr is a terminal.
    retries : int, default 0
        Distributed task retries: a task that raises is run again up to ``retries`` more
        times by the scheduler, possibly on another worker (``client.compute(retries=)``).

    Attributes
    ----------
    run_id : str
        The run's id on the scheduler (``Rebalancer.status(run=)``).
    wall_time : float or None
        Seconds from :meth:`start` to :meth:`stop`.
    task_counts : dict of str to int, or None
        Tasks each worker finished for this run (workers with none left out; a task run
        again after a lost worker counts again); None when the scheduler runs no blockflow
        plugin. Set by :meth:`stop`.
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

    @property
    def dashboard_link(self) -> str | None:
        """The cluster's dashboard address, if it has one."""
        return self.client.dashboard_link

    @property
    def n_tasks(self) -> int | None:
        """Tasks this run finished: the sum of :attr:`task_counts` (None without them)."""
        return None if self.task_counts is None else sum(self.task_counts.values())

    def start(self) -> None:
        """Start the clock."""
        self._start = time.perf_counter()

    def stop(self) -> float:
        """Stop the clock and read the tasks each worker finished for this run.

        Returns
        -------
        float
            :attr:`wall_time`, seconds.
        """
        self.wall_time = time.perf_counter() - self._start
        self.task_counts = task_counts_or_none(self.client, self.run_id)
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
        """A bar of ``total`` steps that are not one graph each (training steps), if the
        job shows bars; None otherwise. See :class:`StepProgress`."""
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
        """Submit ``collections`` as a stage of this run with ``submit`` (the client's
        ``persist`` or ``compute``, with the job's retries) and wait for them with ``wait``
        (:func:`~blockflow.cluster.wait_for` or :func:`~blockflow.cluster.gather_results`),
        under the stage's progress bar if one is shown.

        Returns
        -------
        tuple
            (what ``submit`` returned, what ``wait`` returned).
        """
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
        """Persist ``collections`` on the cluster and wait until they are done.

        Parameters
        ----------
        collections : Dask collection or list of them
            As for :meth:`distributed.Client.persist`.
        label : str, optional
            The stage, as its progress bar names it; default the job's ``what``.

        Returns
        -------
        Same as ``collections``, persisted.

        Raises
        ------
        WorkerLostError
            If every worker is lost for ``blockflow.cluster.worker-loss-timeout``.
        """
        persisted, _ = self._stage(self.client.persist, wait_for, collections, label)
        return persisted

    def compute(self, collections, *, label: str | None = None):
        """Compute ``collections`` on the cluster and gather the results to the client.

        Parameters
        ----------
        collections : Dask collection or list of them
            As for :meth:`distributed.Client.compute`.
        label : str, optional
            The stage, as its progress bar names it; default the job's ``what``.

        Returns
        -------
        The computed results, as ``client.gather`` returns them.

        Raises
        ------
        WorkerLostError
            If every worker is lost, or workers die repeatedly under one task (see
            :func:`blockflow.cluster.gather_results`).
        Exception
            A task's own exception, on its last attempt.
        """
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
    """Run a workload's ``compute`` step on the cluster and write its output atomically.

    Parameters
    ----------
    client : distributed.Client
        Connected client; the work runs on its cluster.
    what : str
        The run as error messages name it.
    compute : callable
        ``compute(job)`` builds the graph, runs it through ``job`` (a :class:`Job`) and
        returns the result object (with ``output`` and ``manifest()``).
    write : callable
        ``write(result, directory)`` writes the data files into ``directory`` and returns
        extra ``manifest.json`` entries (or None).
    name : str
        The workload, as argument errors name it (``"flights"``).
    output : str or path-like, optional
        Folder to write to: claimed before computing (an existing one fails before any
        work), renamed into place only when everything is written.
    overwrite : bool, default False
        Replace ``output`` if it exists.
    progress : bool, optional
        Show a labelled progress bar per stage; default: in Jupyter (a widget), or when
        stderr is a terminal.
    retries : int, optional
        Distributed task retries (default 0): a task that raises is run again up to
        ``retries`` more times by the scheduler, possibly on another worker.

    Returns
    -------
    The result of ``compute``, with ``output`` set to the absolute output folder, if any.

    Raises
    ------
    ValueError
        If ``retries`` is not an integer >= 0 (before ``output`` is claimed).
    FileExistsError
        If ``output`` exists and ``overwrite`` is False (before any work starts).
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
