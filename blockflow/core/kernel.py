"""The kernel wrapper: how a blockflow task runs a user's function on one block.

:class:`Kernel` adds in-place retries (at most ``1 + max(retries, d)`` attempts under
distributed's ``retries=d``), errors naming the failed block (:class:`~blockflow.BlockKernelError`,
:class:`~blockflow.DeviceMemoryError`) and placement that graph optimisation cannot drop; a
task whose arguments hold CuPy arrays runs on its worker thread's own CUDA stream
(:mod:`blockflow.device_streams`).
Guide: docs/guide/reliability.md.
"""

from __future__ import annotations

import logging
import numbers
import sys
import time
from collections.abc import Mapping
from typing import Any, Callable

from dask.utils import format_bytes, funcname
from distributed import Reschedule, get_client, get_worker

from blockflow import _distributed
from blockflow import device_streams
from blockflow._distributed import current_worker_resources
from blockflow.scheduling import speculation as _speculation
from blockflow.scheduling.speculation import in_backup_copy

from blockflow.errors import (
    BlockKernelError,
    DeviceMemoryError,
    ResourceError,
    is_device_oom,
    requested_bytes,
)

__all__ = ["Kernel", "check_placement", "check_retries", "device_memory_error",
           "largest_free_device_memory"]


def check_retries(retries: Any, func: str) -> int:
    """Validate a ``retries=`` argument (extra attempts of a task whose kernel raises; None
    means 0) for the caller ``func``, as messages name it; returns an int.

    Raises
    ------
    ValueError
        If ``retries`` is not an integer >= 0.
    """
    if retries is None:
        return 0
    if isinstance(retries, bool) or not isinstance(retries, numbers.Integral) or retries < 0:
        raise ValueError(
            f"{func}: retries must be an integer >= 0 (extra attempts per block), got "
            f"{retries!r}."
        )
    return int(retries)


def check_placement(resources: Any, workers: Any, allow_other_workers: Any,
                    func: str) -> dict | None:
    """Validate ``resources=``, ``workers=``, ``allow_other_workers=`` (as in
    ``Client.submit``) for the caller ``func``, as messages name it.

    Returns
    -------
    dict or None
        ``{"resources": ..., "workers": tuple or None, "allow_other_workers": bool}``;
        None when nothing was asked.

    Raises
    ------
    TypeError
        For an argument of the wrong type.
    ValueError
        A resource amount not > 0, an empty ``workers``, or ``allow_other_workers=True``
        without ``workers``.
    """
    if resources is not None:
        if not isinstance(resources, Mapping):
            raise TypeError(
                f"{func}: resources must be a mapping of resource name to amount, e.g. "
                f"resources={{'GPU': 1}}, got {resources!r}.")
        for name, amount in resources.items():
            if (not isinstance(name, str) or isinstance(amount, bool)
                    or not isinstance(amount, numbers.Real) or not amount > 0):
                raise ValueError(
                    f"{func}: resources must map resource names to amounts > 0, e.g. "
                    f"resources={{'GPU': 1}}, got {name!r}: {amount!r}.")
        resources = {name: amount for name, amount in resources.items()} or None
    if workers is not None:
        items = [workers] if isinstance(workers, (str, int)) else workers
        try:
            items = list(items)
        except TypeError:
            items = None
        if items is None or not all(isinstance(w, (str, int)) and not isinstance(w, bool)
                                    for w in items):
            raise TypeError(
                f"{func}: workers must be a worker address, name or host name, or a list of "
                f"them, e.g. workers=['tcp://10.0.0.5:40000'], got {workers!r}.")
        if not items:
            raise ValueError(
                f"{func}: workers is empty; name at least one worker, or leave workers=None "
                f"to let any worker run the tasks.")
        workers = tuple(items)
    if allow_other_workers is not None and not isinstance(allow_other_workers, bool):
        raise TypeError(
            f"{func}: allow_other_workers must be True or False, got {allow_other_workers!r}.")
    if allow_other_workers and workers is None:
        raise ValueError(
            f"{func}: allow_other_workers=True only loosens workers=; name the workers too, "
            f"or leave allow_other_workers unset.")
    if resources is None and workers is None:
        return None
    return {"resources": resources, "workers": workers,
            "allow_other_workers": bool(allow_other_workers)}


def _check_worker_resources(label: str, step: str | None, resources: dict) -> None:
    """Refuse to run on a distributed worker lacking the kernel's resources."""
    here = current_worker_resources()
    if here is None:
        return
    address, declared = here
    if all(declared.get(r, 0) >= q for r, q in resources.items()):
        return
    what = f"kernel {label!r}" if step is None else f"tree_reduce {step} function {label!r}"
    raise ResourceError(
        f"blockflow: {what} asked for resources {resources} but the scheduler ran it on "
        f"{address}, which declares {declared or 'no resources'}: that scheduler does not "
        f"run blockflow's plugin, which applies resources= to the tasks. Connect with "
        f"blockflow.connect(...) (or register blockflow.scheduling.Rebalancer, or start the "
        f"scheduler with --preload blockflow.scheduling.preload).")


class Kernel:
    """A user's function as a blockflow task runs it: retried in place, failures labelled.

    Parameters
    ----------
    func : callable
        The user's function.
    retries : int, default 0
        Extra attempts when ``func`` raises (:func:`check_retries`).
    step : str, optional
        The tree-reduction step (``"chunk"``, ``"combine"``, ``"aggregate"``); None for a
        blockwise kernel.
    working_set : int or dict, optional
        Device memory the function needs, in bytes: one number or block index -> bytes.
    placement : dict, optional
        Where the tasks may run, as :func:`check_placement` returns it.
    speculative : bool, default True
        Whether a straggling task may get a backup copy (the function must be idempotent;
        :mod:`blockflow.scheduling.speculation`).

    Notes
    -----
    Out of device memory while another worker has room, a block raises
    :class:`distributed.Reschedule`, at most :data:`MAX_RESCHEDULES` times per worker.
    """

    #: Logger of the retry warnings (subclasses log under their own module's name).
    logger = logging.getLogger(__name__)

    #: Whether a straggling task of this kernel may get a backup copy on another worker
    #: (idempotent kernels: the default). ``map_blocks(speculative=False)`` sets it off.
    speculative = True

    def __init__(self, func: Callable, retries: int = 0, step: str | None = None,
                 working_set: int | dict | None = None, placement: dict | None = None,
                 speculative: bool = True):
        if not speculative:
            self.speculative = False
        self.func = func
        self.label = funcname(func)
        self.retries = retries
        self.step = step
        self.working_set = working_set
        self.placement = placement

    def blockflow_placement(self) -> dict | None:
        """Where the kernel's tasks may run, or None when the caller asked nothing."""
        return getattr(self, "placement", None)

    def blockflow_working_set(self, key) -> int | None:
        """Device memory (bytes) the block of task ``key`` needs, when declared; else None."""
        declared = self.working_set
        if isinstance(declared, dict):
            index = tuple(key[1:]) if isinstance(key, tuple) else ()
            return declared.get(index)
        return declared

    def run(self, where: Callable[[], str], *args, **kwargs):
        """Call the function, up to ``1 + retries`` times; the last failure raises.

        Parameters
        ----------
        where : callable
            ``where() -> str`` names the block for messages; called only on failure.
        *args, **kwargs
            Passed to the function.

        Raises
        ------
        BlockKernelError
            When the last attempt raises (see :meth:`error`).
        """
        placement = getattr(self, "placement", None)
        if placement and placement["resources"] and not placement["allow_other_workers"]:
            _check_worker_resources(self.label, self.step, placement["resources"])
        return _speculation.run_kernel(self, lambda: self._attempts(where, args, kwargs),
                                       args, kwargs)

    def _attempts(self, where: Callable[[], str], args: tuple, kwargs: dict):
        """The attempts of :meth:`run` in this run of the task (see :meth:`_attempt_plan`)."""
        attempt = 0
        plan = None  # worked out at the first failure: a kernel that succeeds asks nothing
        while True:
            attempt += 1
            try:
                cupy = _modules.get("cupy")
                if cupy is None:  # no device array can be an argument: a plain call
                    return self.func(*args, **kwargs)
                # device blocks run on this thread's own CUDA stream (device_streams)
                return device_streams.call_on_stream(cupy, self.func, args, kwargs)
            except Exception as e:
                if is_device_oom(e) and _fits_on_another_worker(e) and _may_reschedule():
                    self.logger.info("blockflow kernel %r ran out of device memory on %s; "
                                     "another worker has room: rescheduled", self.label,
                                     where())
                    # hold this (unsuitable) worker's slot a moment, so that the scheduler
                    # hands the block to a worker that frees up meanwhile
                    time.sleep(RESCHEDULE_BACKOFF * _reschedules.get(_current_key(), 1))
                    raise Reschedule() from e
                if plan is None:
                    plan = self._attempt_plan()
                here, before, total = plan
                if attempt > here:
                    raise self.error(e, where(), before + attempt) from e
                self._warn_retry(e, where(), before + attempt, total)

    def _attempt_plan(self) -> tuple[int, int, int]:
        """Extra attempts this run of the task makes, attempts its earlier runs made, and
        attempts in all: ``1 + max(retries, d)`` under distributed's ``retries=d``."""
        if in_backup_copy():
            # a backup copy is one more call beside the task's own attempts: if it fails,
            # the original runs on with its retries
            return 0, 0, 1
        given = _distributed.task_retries_given()
        if not given:
            return self.retries, 0, self.retries + 1
        total = max(self.retries, given) + 1
        extra = max(self.retries - given, 0)
        left = _distributed.task_retries_left()
        if left is None or left > given:
            return 0, 0, total
        done = given - left  # erred runs before this one
        if done == 0:
            return extra, 0, total
        return 0, extra + done, total

    def _warn_retry(self, exc: BaseException, where: str, attempt: int, total: int) -> None:
        if self.step is None:
            self.logger.warning("blockflow kernel %r failed on %s (attempt %d of %d), "
                                "retrying: %s: %s", self.label, where, attempt,
                                total, type(exc).__name__, exc)
        else:
            self.logger.warning("blockflow tree_reduce: %s function %r failed (attempt %d of "
                                "%d), retrying: %s: %s", self.step, self.label, attempt,
                                total, type(exc).__name__, exc)

    def error(self, exc: BaseException, where: str, attempts: int = 1) -> BlockKernelError:
        """The error that replaces ``exc``, the function's last failure, at the client.

        Returns
        -------
        BlockKernelError
            A :class:`~blockflow.DeviceMemoryError` for a device out-of-memory error
            (:func:`~blockflow.errors.is_device_oom`), else one naming the function, block or
            step, attempts and ``exc`` (chained as ``__cause__``).
        """
        after = f" after {attempts} attempts" if attempts > 1 else ""
        if is_device_oom(exc):
            err: BlockKernelError = device_memory_error(
                self.label, where if self.step is None else f"a tree_reduce {self.step} step",
                exc, after)
        elif self.step is None:
            err = BlockKernelError(
                f"blockflow kernel {self.label!r} failed on {where}{after}: "
                f"{type(exc).__name__}: {exc}"
            )
        else:
            err = BlockKernelError(
                f"blockflow tree_reduce: {self.step} function {self.label!r} failed{after}: "
                f"{type(exc).__name__}: {exc}"
            )
        err.__cause__ = exc
        return err


def device_memory_error(label: str, where: str, exc: BaseException, after: str = ""
                        ) -> DeviceMemoryError:
    """The error for kernel ``label`` out of device memory on ``where`` (a block or step):
    ``exc`` is the device library's error, ``after`` e.g. ``" after 3 attempts"``."""
    need = requested_bytes(exc)
    free, worker = largest_free_device_memory()
    if need is not None and free is not None and free >= need:
        # stale metrics of this very worker (its allocation failed): never claim room
        free, worker = largest_free_device_memory(exclude=_this_worker())
    need_text = "more" if need is None else f"{need:,} bytes ({format_bytes(need)})"
    if need is not None and free is not None and free >= need:
        # another worker has room, but the scheduler kept placing the block here
        return DeviceMemoryError(
            f"blockflow kernel {label!r} ran out of device memory on {where}{after}: it "
            f"asked for {need_text} of device memory, more than this worker had free, and the "
            f"scheduler placed it here again {MAX_RESCHEDULES} times although {worker} has "
            f"room. Declare what a block needs, map_blocks(..., working_set={need}), and use "
            f"blockflow's dynamic policy (the default of blockflow.connect), which places each "
            f"block where it fits. {type(exc).__name__}: {exc}",
            block=where, working_set=need, largest_free=None,
        )
    free_text = ("unknown (no worker reports device memory)" if free is None
                 else f"{free:,} bytes ({format_bytes(free)}, on {worker})")
    return DeviceMemoryError(
        f"blockflow kernel {label!r} ran out of device memory on {where}{after}: it "
        f"asked for {need_text} of device memory, but the largest free device memory of any "
        f"worker is {free_text}. Make the block fit: use smaller blocks (rechunk or "
        f"repartition), free device memory (persisted results, other processes on the GPU), "
        f"or use workers with larger GPUs. {type(exc).__name__}: {exc}",
        block=where, working_set=need, largest_free=free,
    )


_modules = sys.modules  # where the kernel looks up CuPy, without importing it

#: Most times one worker hands a task back for running out of device memory.
MAX_RESCHEDULES = 5
#: Seconds a worker waits before handing a task back, times the attempt.
RESCHEDULE_BACKOFF = 0.1
_reschedules: dict = {}  # task key -> times this worker process rescheduled it


def _current_key():
    try:
        return get_worker().get_current_task()
    except Exception:  # not in a task on a worker
        return None


def _may_reschedule() -> bool:
    """Count a reschedule of the current task from this worker; False past the bound."""
    key = _current_key()
    if key is None:
        return False
    n = _reschedules.get(key, 0)
    if n >= MAX_RESCHEDULES:
        return False
    if len(_reschedules) > 10_000:
        _reschedules.clear()
    _reschedules[key] = n + 1
    return True


def _this_worker() -> str | None:
    try:
        return get_worker().address
    except Exception:  # not in a task on a worker
        return None


def _fits_on_another_worker(exc: BaseException) -> bool:
    """Whether a worker other than this one has free device memory for what ``exc`` asked."""
    need = requested_bytes(exc)
    if need is None:
        return False
    for _ in range(2):  # the task's first client call may time out on a loaded worker
        free, _ = largest_free_device_memory(exclude=_this_worker())
        if free is not None:
            return free >= need
    return False


def largest_free_device_memory(exclude: str | None = None) -> tuple[int | None, str | None]:
    """``(free bytes, worker address)`` of the worker with the most free device memory,
    ``exclude`` left out; ``(None, None)`` when unknown."""
    from blockflow.scheduling.view import worker_memory  # client side: only when out of memory

    try:
        memory = worker_memory(get_client())
    except Exception as e:  # outside a cluster, or the scheduler is gone: say "unknown"
        logging.getLogger(__name__).info(
            "blockflow: could not read the workers' device memory: %r", e)
        return None, None
    best: tuple[int | None, str | None] = (None, None)
    for address in sorted(memory):
        if address == exclude:
            continue
        free = memory[address].device_free
        if free is None:
            continue
        if best[0] is None or int(free) > best[0]:
            best = (int(free), address)
    return best
