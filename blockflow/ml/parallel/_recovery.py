"""A pipeline that lost a worker: the stages re-placed on the survivors, from the checkpoint.

Every segment ends with each stage's checkpoint in worker memory, replicated on a second
worker (:mod:`~blockflow.ml.parallel._step`). :func:`recover` re-partitions the layers over
the surviving workers (the same planner as the first placement) and the segment runs again
from that checkpoint; :class:`~blockflow.errors.WorkerLostError` when nothing can take it.
"""

from __future__ import annotations

import warnings

from blockflow.errors import BlockflowWarning, DeviceMemoryError, WorkerLostError
from blockflow.ml._group import first_kept, gone_workers
from blockflow.ml.parallel import _placement

__all__ = ["recover"]


def recover(pipe, lost: set[str], what: str, redone: int) -> None:
    """Re-place the stages on the workers left, resuming from the last checkpoint.

    Raises
    ------
    WorkerLostError
        One line naming the lost stage when no worker is left, its checkpoint went with
        the worker, or the survivors have no room for the layers.
    """
    # the scheduler may still list a dying worker
    lost = set(lost) | gone_workers(pipe.client, set(pipe.stage_workers) | set(lost),
                                    expect=lost)
    names = [pipe._stage_name(s) for s, w in enumerate(pipe.stage_workers) if w in lost]
    stages = ", ".join(names) or "no stage"
    workers = ", ".join(sorted(lost))
    survivors = [w for w in pipe.workers if w not in lost and w in pipe._alive()]
    gone = [k for _, _, k in pipe._ckpt if first_kept(k) is None]
    reason = None
    if not survivors:
        reason = "no worker is left to take it"
    elif gone:
        reason = "its checkpoint was lost with it (no second worker held a copy)"
    if reason is None:
        before = (list(pipe.stage_workers), list(pipe.bounds))
        pipe.workers = survivors
        try:
            _placement.place(pipe, None, keep_probe=True)
        except DeviceMemoryError as e:
            pipe.stage_workers, pipe.bounds = before
            reason = (f"the {len(survivors)} surviving workers have no room for its layers "
                      f"({str(e).split('; ')[0].split('(')[-1].rstrip(')')})")
    if reason is not None:
        raise WorkerLostError(f"blockflow: {what} failed: lost {stages} on worker {workers}, "
                              f"and {reason}; add a worker and build the PipelineParallel "
                              f"again.", lost=lost)
    pipe.recoveries.append({"step": pipe.steps + redone, "resumed_from": pipe.steps,
                            "redone": redone, "stages": names, "lost": sorted(lost)})
    warnings.warn(f"blockflow: the pipeline lost worker {workers} ({stages}); re-formed on "
                  f"{len(pipe.ranks)} worker(s) from the checkpoint of step {pipe.steps}, "
                  f"redoing {redone} step(s).", BlockflowWarning, stacklevel=4)
