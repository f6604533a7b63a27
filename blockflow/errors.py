"""Errors and warnings blockflow raises, with messages that name the problem and the fix."""

from __future__ import annotations

from typing import Any


class BlockflowWarning(UserWarning):
    """A warning from blockflow (tests turn these into errors)."""


class BlockKernelError(RuntimeError):
    """A blockwise kernel failed on one block.

    The message names the kernel, the block (index of an array block, partition number of a
    dataframe, coordinate range of an xarray block) and the original exception, which is
    also chained as ``__cause__`` where the traceback survives serialisation.
    """


class EmptyCollectionError(ValueError):
    """A collection with no data where blocks are needed."""


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
