"""Errors and warnings blockflow raises, with messages that name the problem and the fix."""

from __future__ import annotations

import math
import numbers
import re
from typing import Any


class BlockflowWarning(UserWarning):
    """A warning from blockflow (tests turn these into errors)."""


class ConvergenceWarning(BlockflowWarning):
    """An optimiser stopped before it converged (scikit-learn's ``ConvergenceWarning``)."""


class BlockSizeWarning(BlockflowWarning):
    """Blocks far smaller than GPU workers want: per-task overhead dominates; the message
    gives the ``rechunk`` that fits (config ``blockflow.blocks.advise-below``)."""


class BlockKernelError(RuntimeError):
    """A blockwise kernel failed on one block, or a tree-reduction step failed.

    The message names the kernel, the block or step, the attempts and the original
    exception (the ``__cause__``).
    """


class NonFiniteError(ValueError):
    """``X`` or ``y`` holds a NaN or an infinity; the message names the first one."""


class EmptyCollectionError(ValueError):
    """A collection with no data where blocks are needed."""


class DeviceMemoryError(BlockKernelError, MemoryError):
    """A blockwise kernel ran out of device (GPU) memory on one block.

    Raised in place of the device library's out-of-memory error (:func:`is_device_oom`).

    Attributes
    ----------
    block : str
        The block, as named in the message (``"block (3, 0)"``, ``"partition 7"``).
    working_set : int or None
        Bytes the kernel asked for, when the original error says.
    largest_free : int or None
        Largest free device memory of any worker in bytes, None when none reports it.
    """

    def __init__(self, message: str, block: str | None = None, working_set: int | None = None,
                 largest_free: int | None = None):
        super().__init__(message)
        self.block, self.working_set, self.largest_free = block, working_set, largest_free

    def __reduce__(self):  # keep the attributes from the worker to the client
        return type(self), (str(self), self.block, self.working_set, self.largest_free)


class WorkerLostError(RuntimeError):
    """Workers died under a computation and Dask gave up on it.

    Raised when every worker is gone longer than ``blockflow.cluster.worker-loss-timeout``,
    in place of ``KilledWorker``, and when results a computation needs are lost.

    Parameters
    ----------
    *args
        The message.
    lost : iterable of str, optional
        Worker addresses or task keys, kept in :attr:`lost` as a frozenset.
    """

    def __init__(self, *args, lost=()):
        super().__init__(*args)
        self.lost = frozenset(lost)

    def __reduce__(self):  # keep what was lost across processes
        return _worker_lost, (self.args, tuple(self.lost))


def _worker_lost(args, lost):
    return WorkerLostError(*args, lost=lost)


class ClusterStartError(RuntimeError):
    """A cluster's workers could not be started or did not join its scheduler; submitted
    jobs are cancelled."""


class ResourceError(RuntimeError):
    """A task's worker resources cannot be met: none declares them within
    ``blockflow.resources.unsatisfiable-timeout``, or it ran on a worker lacking them."""


class ObjectiveError(ValueError):
    """A run's objective or pools cannot be met as asked (:func:`blockflow.objective`)."""


#: Class names of device out-of-memory errors (CuPy's), matched by name: no GPU import.
DEVICE_OOM_NAMES = frozenset({"OutOfMemoryError"})


def is_device_oom(exc: BaseException) -> bool:
    """Whether ``exc`` reports device memory exhaustion (CuPy's or RMM's; not a host
    ``MemoryError``)."""
    if any(cls.__name__ in DEVICE_OOM_NAMES for cls in type(exc).__mro__):
        return True
    return isinstance(exc, MemoryError) and "out_of_memory" in str(exc).lower()


def requested_bytes(exc: BaseException) -> int | None:
    """Bytes a failed device allocation asked for, from the error, or None if it does not say.

    Reads a ``size`` attribute or CuPy's wording ``"Out of memory allocating 1,024 bytes"``.
    """
    size = getattr(exc, "size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
        return size
    m = re.search(r"allocating ([\d,]+) bytes", str(exc))
    return int(m.group(1).replace(",", "")) if m else None


def describe(obj: Any) -> str:
    """``module.Type`` of an object, for error messages."""
    t = type(obj)
    mod = t.__module__.split(".")[0]
    return f"{mod}.{t.__name__}"


def not_a_collection(func: str, position: str, obj: Any) -> TypeError:
    """The error for in-memory data passed where a Dask collection is expected."""
    mod = type(obj).__module__.split(".")[0]
    if mod in ("numpy", "cupy"):
        fix = "wrap it with dask.array.from_array(x, chunks=...)"
    elif mod in ("pandas", "cudf"):
        fix = "wrap it with dask.dataframe.from_pandas(df, npartitions=...)"
    elif mod == "xarray":
        fix = "chunk it with obj.chunk(...) so that it is backed by dask"
    else:
        fix = "pass a dask.array.Array, dask.dataframe.DataFrame/Series or a chunked xarray object"
    return TypeError(
        f"{func}: {position} is a {describe(obj)}, not a Dask collection; {fix}."
    )


def check_number(value: Any, name: str, func: str, what: str, *, integer: bool = False,
                 low: float | None = None, low_open: bool = False, high: float | None = None,
                 high_open: bool = False, none: bool = False, finite: bool = True):
    """Validate a numeric argument; return it (``int`` when ``integer``).

    Parameters
    ----------
    value : Any
        The argument as given.
    name, func, what : str
        Its name, the caller as messages name it, and its meaning with its unit.
    integer : bool, default False
        Whether it must be an integer (``bool`` is refused).
    low, high : float, optional
        Bounds; ``low_open`` / ``high_open`` exclude them.
    none : bool, default False
        Whether None is accepted (and returned).
    finite : bool, default True
        Whether infinity is refused (NaN always is).

    Raises
    ------
    ValueError
        ``"<func>: <name> must be an integer >= 1 (<what>), got 0."``.
    """
    if value is None and none:
        return None
    kind = numbers.Integral if integer else numbers.Real
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if ok and not integer:
        ok = math.isfinite(float(value)) or (not finite and not math.isnan(float(value)))
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if ok:
        return int(value) if integer else value
    noun = "an integer" if integer else ("a finite number" if finite else "a number")
    bounds = []
    if low is not None:
        bounds.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        bounds.append(f"{'<' if high_open else '<='} {high:g}")
    rng = (" " + " and ".join(bounds)) if bounds else ""
    opt = " (or None)" if none else ""
    raise ValueError(f"{func}: {name} must be {noun}{rng}{opt} ({what}), got {value!r}.")
