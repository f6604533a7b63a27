"""The workload runner: what every ready workload does around its own graph (not public API).

A workload (:mod:`~blockflow.workloads.flights`, :mod:`~blockflow.workloads.array_stats`)
supplies two steps, and :func:`run_workload` does the rest the same way for all of them:

* ``compute(job)`` builds the workload's graph and runs it through the :class:`Job` it is
  handed: :meth:`Job.persist` / :meth:`Job.compute` submit with distributed's task
  ``retries``, draw :func:`distributed.progress` bars, and wait while watching for lost
  workers (:func:`blockflow.cluster.wait_for`, :func:`~blockflow.cluster.gather_results`);
  :meth:`Job.start` / :meth:`Job.stop` time the run and count the tasks each worker finished
  meanwhile (blockflow's scheduler plugin). It returns the workload's result object.
* ``write(result, directory)`` writes the data files into a temporary folder and returns
  extra manifest entries; :func:`run_workload` adds ``manifest.json``
  (``result.manifest()`` plus those entries) and renames the folder into place
  (:func:`blockflow.io.atomic_output_dir`): a failed run leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any, Callable, Mapping, TypeVar

from distributed import progress as progress_bar

from blockflow.blockwise import check_retries
from blockflow.cluster import gather_results, wait_for
from blockflow.io import atomic_output_dir, write_manifest

__all__ = ["Job", "run_workload", "show_progress", "task_counts_or_none"]

R = TypeVar("R")


def task_counts_or_none(client) -> dict[str, int] | None:
    """Tasks finished per worker per blockflow's plugin, or None if the scheduler has none."""
    import blockflow

    try:
        return dict(blockflow.task_counts(client))
    except RuntimeError:  # the scheduler runs no blockflow plugin
        return None


def show_progress(progress: bool | None) -> bool:
    """Whether to draw progress bars: as asked, or (None) when stdout is a terminal."""
    if progress is None:
        return bool(getattr(sys.stdout, "isatty", lambda: False)())
    return bool(progress)


class _ProgressBar:
    """A text progress bar in a background thread, so that the caller's wait can watch for
    lost workers meanwhile; :meth:`finish` lets the bar print its last (100 %) line."""

    def __init__(self, futures, show: bool):
        self.thread = None
        if show:
            self.thread = threading.Thread(target=progress_bar, args=(futures,),
                                           kwargs={"notebook": False}, daemon=True,
                                           name="blockflow-progress")
            self.thread.start()

    def finish(self, timeout: float = 10.0) -> None:
        if self.thread is not None:
            self.thread.join(timeout)


class Job:
    """One run of a workload on a cluster: submission, progress, timing and task counts.

    Parameters
    ----------
    client : distributed.Client
        Connected client; the work runs on its cluster.
    what : str
        The run as error messages name it (``"the flights ETL (scale 2)"``).
    progress : bool, optional
        Draw :func:`distributed.progress` bars; default: when stdout is a terminal.
    retries : int, default 0
        Distributed task retries: a task that raises is run again up to ``retries`` more
        times by the scheduler, possibly on another worker (``client.compute(retries=)``).

    Attributes
    ----------
    wall_time : float or None
        Seconds from :meth:`start` to :meth:`stop`.
    task_counts : dict of str to int, or None
        Tasks each worker finished between :meth:`start` and :meth:`stop` (workers with
        none left out); None when the scheduler runs no blockflow plugin.
    """

    def __init__(self, client, what: str, *, progress: bool | None = None, retries: int = 0):
        self.client = client
        self.what = what
        self.show = show_progress(progress)
        self.retries = retries
        self.wall_time: float | None = None
        self.task_counts: dict[str, int] | None = None
        self._before: dict[str, int] | None = None
        self._start: float | None = None

    @property
    def dashboard_link(self) -> str | None:
        """The cluster's dashboard address, if it has one."""
        return self.client.dashboard_link

    def start(self) -> None:
        """Start the clock; note the tasks each worker has finished so far."""
        self._before = task_counts_or_none(self.client)
        self._start = time.perf_counter()

    def stop(self) -> float:
        """Stop the clock and count the tasks each worker finished since :meth:`start`.

        Returns
        -------
        float
            :attr:`wall_time`, seconds.
        """
        self.wall_time = time.perf_counter() - self._start
        after = task_counts_or_none(self.client)
        if self._before is not None and after is not None:
            self.task_counts = {w: after[w] - self._before.get(w, 0) for w in sorted(after)
                                if after[w] - self._before.get(w, 0)}
        return self.wall_time

    def persist(self, collections):
        """Persist ``collections`` on the cluster and wait until they are done.

        Parameters
        ----------
        collections : Dask collection or list of them
            As for :meth:`distributed.Client.persist`.

        Returns
        -------
        Same as ``collections``, persisted.

        Raises
        ------
        WorkerLostError
            If every worker is lost for ``blockflow.cluster.worker-loss-timeout``.
        """
        persisted = self.client.persist(collections, retries=self.retries or None)
        bar = _ProgressBar(persisted, self.show)
        try:
            wait_for(self.client, persisted, what=self.what)
            bar.finish()
            return persisted
        finally:
            persisted = None  # a traceback keeps this frame: it must not keep the results

    def compute(self, collections):
        """Compute ``collections`` on the cluster and gather the results to the client.

        Parameters
        ----------
        collections : Dask collection or list of them
            As for :meth:`distributed.Client.compute`.

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
        futures = self.client.compute(collections, retries=self.retries or None)
        bar = _ProgressBar(futures, self.show)
        try:
            results = gather_results(self.client, futures, what=self.what)
            bar.finish()
            return results
        finally:
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
        Draw progress bars; default: when stdout is a terminal.
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
