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
from distributed.diagnostics.progressbar import ProgressBar
from distributed.utils import is_kernel

from blockflow.blockwise import check_retries
from blockflow.cluster import gather_results, wait_for
from blockflow.io import atomic_output_dir, write_manifest
from blockflow.scheduling.runs import new_run_id, run_scope

__all__ = ["Job", "StageProgress", "run_workload", "show_progress", "task_counts_or_none"]

logger = logging.getLogger(__name__)

R = TypeVar("R")


def task_counts_or_none(client, run_id: str | None = None) -> dict[str, int] | None:
    """Tasks finished per worker per blockflow's plugin, or None if the scheduler has none.

    With ``run_id``: the tasks of that run only (:mod:`blockflow.scheduling.runs`; ``{}``
    for a run that ran nothing); without: since the plugin started.
    """
    from blockflow.cluster import plugin_status

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
        return is_kernel() or bool(getattr(sys.stderr, "isatty", lambda: False)())
    return bool(progress)


def _notebook_bars() -> bool:
    """In a Jupyter kernel with ipywidgets: tqdm's widget bar works."""
    return is_kernel() and importlib.util.find_spec("ipywidgets") is not None


class StageProgress(ProgressBar):
    """One labelled progress bar for one stage of a job: the tasks still to run for
    ``futures``, counted by distributed's :class:`~distributed.diagnostics.progress.Progress`
    on the scheduler, drawn with tqdm.

    In a terminal (or any non-Jupyter stream) a ``tqdm`` text bar on stderr
    (``label: 45%|####  | 18/40 [00:01<00:01, 14.2 tasks/s]``); in a Jupyter kernel an
    ipywidgets bar (``tqdm.notebook``), no text and no escape codes in the cell; in a kernel
    without ipywidgets one line when the stage ends. Tasks whose results are already in
    memory (an earlier stage's persisted output) are not counted, so each bar starts at 0.

    Parameters
    ----------
    futures : list of distributed.Future
        The stage's futures (of one ``client.compute`` / ``persist``).
    client : distributed.Client
    label : str
        The stage, as the bar names it (``"flights [1/2] load, clean, persist"``).

    Notes
    -----
    The bar is created in the calling thread (a widget is displayed in the running cell);
    the scheduler's counts arrive in a background thread with its own event loop, so the
    caller may block meanwhile. Call :meth:`finish` when the stage is over.
    """

    def __init__(self, futures, client, label: str):
        super().__init__(futures, scheduler=client.scheduler.address, interval="200ms",
                         complete=False)
        self.label = label
        self._line = False
        if _notebook_bars():
            from tqdm.notebook import tqdm

            self.bar = tqdm(total=None, desc=label, unit=" tasks")
        elif is_kernel():  # no ipywidgets: one line at the end, never escape codes
            from tqdm import tqdm

            self.bar, self._line = tqdm(total=None, desc=label, disable=True), True
        else:
            from tqdm import tqdm

            self.bar = tqdm(total=None, desc=label, unit=" tasks", file=sys.stderr,
                            dynamic_ncols=True)
        self._started = time.perf_counter()
        self._loop = asyncio.new_event_loop()
        self._task = self._loop.create_task(self.listen())
        self._thread = threading.Thread(target=self._listen, daemon=True,
                                        name="blockflow-progress")
        self._thread.start()

    def _listen(self) -> None:
        try:
            self._loop.run_until_complete(self._task)
        except (asyncio.CancelledError, Exception) as e:  # a bar never fails the job
            logger.debug("blockflow: progress bar %r stopped: %r", self.label, e)
        finally:
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    def _draw_bar(self, remaining, all, **kwargs) -> None:
        if self.bar.total != all:
            self.bar.reset(total=all)
        self.bar.n = all - remaining
        self.bar.refresh()

    def finish(self, done: bool, timeout: float = 2.0) -> None:
        """End the bar: full if the stage is ``done``, left where it stopped otherwise."""
        self._thread.join(timeout)  # the scheduler's last count, usually within 200 ms
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._task.cancel)
            self._thread.join(timeout)
        if done and self.bar.total is not None:
            self.bar.n = self.bar.total
            self.bar.refresh()
        self.bar.close()
        if self._line:
            total = "?" if self.bar.total is None else f"{self.bar.total:,}"
            state = "done" if done else "stopped"
            print(f"{self.label}: {total} tasks, {state} after "
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

    def _bar(self, submitted, label: str | None) -> StageProgress | None:
        if not self.show:
            return None
        try:
            return StageProgress(futures_of(submitted), self.client, label or self.what)
        except Exception as e:  # e.g. no terminal to draw on: the job runs without a bar
            logger.debug("blockflow: no progress bar for %s: %r", label or self.what, e)
            return None

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
        with run_scope(self.what, self.run_id):
            persisted = self.client.persist(collections, retries=self.retries or None)
        bar, done = self._bar(persisted, label), False
        try:
            wait_for(self.client, persisted, what=self.what)
            done = True
            return persisted
        finally:
            if bar is not None:
                bar.finish(done)
            persisted = None  # a traceback keeps this frame: it must not keep the results

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
        with run_scope(self.what, self.run_id):
            futures = self.client.compute(collections, retries=self.retries or None)
        bar, done = self._bar(futures, label), False
        try:
            results = gather_results(self.client, futures, what=self.what)
            done = True
            return results
        finally:
            if bar is not None:
                bar.finish(done)
            futures = None  # a traceback keeps this frame: it must not keep the results


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
            write_manifest(tmp, {**result.manifest(), **extra})
    return result
