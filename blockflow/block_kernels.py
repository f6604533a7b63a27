"""Block kernels: the wrappers :func:`blockflow.map_blocks` runs on each block, naming the
failed block and checking each result against the declared output."""

from __future__ import annotations

import inspect
import logging
from typing import Callable

import numpy as np
from dask.utils import (
    is_arraylike,
    is_dataframe_like,
    is_index_like,
    is_series_like,
)

from blockflow.core.kernel import Kernel
from blockflow.errors import (
    BlockKernelError,
    describe,
)

logger = logging.getLogger("blockflow.blockwise")


def _wants(func: Callable, keyword: str) -> bool:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
    return keyword in params


class _Kernel(Kernel):
    """A blockwise kernel as its tasks run it (:class:`blockflow.core.kernel.Kernel`)."""

    logger = logger

    def __init__(self, kernel: Callable, name: str, retries: int = 0, working_set=None,
                 placement=None):
        super().__init__(kernel, retries, working_set=working_set, placement=placement)
        self.__name__ = name  # dask.utils.funcname -> task names start with "blockflow-"

    def __repr__(self) -> str:
        return f"<blockflow kernel {self.label}>"


class _ArrayKernel(_Kernel):
    def __init__(self, kernel, name, *, dtype=None, ndim=None, retries=0, working_set=None,
                 placement=None):
        super().__init__(kernel, name, retries, working_set, placement)
        self.pass_block_id = _wants(kernel, "block_id")
        self.dtype = np.dtype(dtype) if dtype is not None else None
        self.ndim = ndim
        # Set after the output collection is built (before any task runs) so each block's
        # result can be checked against the chunk shape Dask expects.
        self.expected_chunks: tuple[tuple[int, ...], ...] | None = None

    def __call__(self, *blocks, block_id=None, **kwargs):
        if self.pass_block_id:
            kwargs["block_id"] = block_id
        if block_id is None:  # metadata inference on empty blocks: let Dask handle errors
            out = self.func(*blocks, **kwargs)
            # A non-array (None, a list) would become the output's meta and break it while
            # the graph is built; without it Dask falls back to dtype=, and the first block
            # that runs says what is wrong (see _check).
            return out if _is_array(out) else None
        out = self.run(lambda: f"block {tuple(block_id)}", *blocks, **kwargs)
        self._check(out, block_id)
        return out

    def _check(self, out, block_id):
        where = f"block {tuple(block_id)}"
        if not _is_array(out):
            raise BlockKernelError(
                f"blockflow kernel {self.label!r} returned a {_type_name(out)} for {where}, not "
                f"an array; return one array per block from the kernel (a NumPy or CuPy array: "
                f"wrap scalars and lists with np.asarray, or cupy.asarray on GPU)."
            )
        shape = out.shape
        if self.ndim is not None and len(shape) != self.ndim:
            raise BlockKernelError(
                f"blockflow kernel {self.label!r} returned a {len(shape)}-d block for {where}, "
                f"but the output is declared {self.ndim}-d; pass chunks=/drop_axis=/new_axis= "
                f"to map_blocks to declare the shape it returns."
            )
        if self.dtype is not None and getattr(out, "dtype", self.dtype) != self.dtype:
            raise BlockKernelError(
                f"blockflow kernel {self.label!r} returned dtype {out.dtype} for {where}, but "
                f"the output is declared {self.dtype}; cast inside the kernel or pass "
                f"dtype={out.dtype}/meta= to map_blocks."
            )
        if self.expected_chunks is not None and len(block_id) == len(self.expected_chunks):
            expected = tuple(c[i] for c, i in zip(self.expected_chunks, block_id))
            if tuple(shape) != expected:
                raise BlockKernelError(
                    f"blockflow kernel {self.label!r} returned shape {tuple(shape)} for {where}, "
                    f"but Dask expects {expected} from the output chunks; pass chunks= to "
                    f"map_blocks to declare the block shapes it returns."
                )


class _ArrayKernelWithInfo(_ArrayKernel):
    def __call__(self, *blocks, block_id=None, block_info=None, **kwargs):
        return super().__call__(*blocks, block_id=block_id, block_info=block_info, **kwargs)


def _is_array(out) -> bool:
    """Whether a kernel's result is an array block (a duck array or a NumPy scalar)."""
    return is_arraylike(out) or all(hasattr(out, a) for a in ("shape", "dtype", "ndim"))


def _type_name(obj) -> str:
    """``NoneType``, ``list``, ``pandas.Series``: the type of a result, for error messages."""
    t = type(obj)
    return t.__name__ if t.__module__ == "builtins" else describe(obj)


class _PartitionKernel(_Kernel):
    def __init__(self, kernel, name, retries=0, working_set=None, placement=None):
        super().__init__(kernel, name, retries, working_set, placement)
        self.pass_info = _wants(kernel, "partition_info")
        # Set after the output collection is built (before any task runs) so each
        # partition's result can be checked against the output's meta; dtypes only when the
        # caller declared it (meta=): Dask's inferred meta is sometimes wrong about them.
        self.meta = None
        self.check_dtypes = False

    def __call__(self, *parts, partition_info=None, **kwargs):
        if self.pass_info:
            kwargs["partition_info"] = partition_info
        if partition_info is None:  # metadata emulation on sample partitions
            return self.func(*parts, **kwargs)
        where = f"partition {partition_info['number']}"
        out = self.run(lambda: where, *parts, **kwargs)
        if self.meta is not None:
            _check_partition(self.label, where, out, self.meta, self.check_dtypes)
        return out


def _frame_kind(obj) -> str | None:
    """``"DataFrame"``, ``"Series"`` or ``"Index"`` for pandas and cuDF objects alike."""
    if is_dataframe_like(obj):
        return "DataFrame"
    if is_series_like(obj):
        return "Series"
    if is_index_like(obj):
        return "Index"
    return None


def _check_partition(label: str, where: str, out, meta, check_dtypes: bool = True) -> None:
    """Check a partition against the output's meta: type, columns and (``check_dtypes``)
    dtypes; as Dask's ``apply_and_enforce``, empty results and Series outputs pass."""
    want = _frame_kind(meta)
    if want is None:  # the output is not a frame (e.g. arrays): Dask takes what comes
        return
    got = _frame_kind(out)
    if got is None and want == "Series" and out is not None:
        return
    declared = f"a DataFrame with columns {_names(meta.columns)}" if want == "DataFrame" \
        else f"a{'n' if want == 'Index' else ''} {want} of dtype {meta.dtype}"
    if got != want:
        raise BlockKernelError(
            f"blockflow kernel {label!r} returned a {_type_name(out)} for {where}, but the "
            f"output is declared {declared}; return a{'n' if want == 'Index' else ''} {want} "
            f"from the kernel, or pass meta= to map_blocks to declare what it returns."
        )
    if not len(out):
        return
    if want == "DataFrame":
        _check_columns(label, where, out, meta)
    if not check_dtypes:
        return
    if want == "DataFrame":
        diffs = [(c, g, w) for c, g, w in zip(meta.columns, out.dtypes, meta.dtypes)
                 if not _same_dtype(g, w)]
        if diffs:
            listed = ", ".join(f"column {c!r} is {g} but declared {w}" for c, g, w in diffs)
            casts = ", ".join(f"{c!r}: {str(w)!r}" for c, _, w in diffs)
            raise BlockKernelError(
                f"blockflow kernel {label!r} returned dtypes for {where} that differ from the "
                f"output's meta: {listed}; cast inside the kernel (e.g. "
                f"part.astype({{{casts}}})) or pass meta= to map_blocks with the dtypes it "
                f"returns."
            )
    elif not _same_dtype(out.dtype, meta.dtype):
        raise BlockKernelError(
            f"blockflow kernel {label!r} returned a {got} of dtype {out.dtype} for {where}, "
            f"but the output is declared {meta.dtype}; cast inside the kernel (e.g. "
            f"part.astype({str(meta.dtype)!r})) or pass meta= to map_blocks with the dtype it "
            f"returns."
        )


def _check_columns(label: str, where: str, out, meta) -> None:
    got, want = list(out.columns), list(meta.columns)
    if got == want:
        return
    missing = [c for c in want if c not in got]
    extra = [c for c in got if c not in want]
    if missing or extra:
        detail = ", ".join(part for part in (
            f"missing {_names(missing)}" if missing else "",
            f"unexpected {_names(extra)}" if extra else "") if part)
        fix = "return those columns from the kernel"
    else:
        detail = "the same columns in another order"
        fix = "select them in the declared order inside the kernel (part[columns])"
    raise BlockKernelError(
        f"blockflow kernel {label!r} returned columns {_names(got)} for {where}, but the "
        f"output is declared with columns {_names(want)} ({detail}); {fix}, or pass meta= "
        f"to map_blocks to declare the columns it returns."
    )


def _names(names, limit: int = 10) -> str:
    """``['a', 'b']``, shortened to the first ``limit`` names for wide frames."""
    names = list(names)
    if len(names) <= limit:
        return repr(names)
    return repr(names[:limit])[:-1] + f", ... ({len(names) - limit} more)]"


def _same_dtype(got, want) -> bool:
    """Exact dtype equality, except categoricals (any categories), object vs string, and
    datetime/timedelta units (not time zones), which pandas and Dask change."""
    try:
        if got == want:
            return True
    except TypeError:
        pass
    got_cat, want_cat = (getattr(d, "name", None) == "category" for d in (got, want))
    if got_cat or want_cat:
        return got_cat and want_cat
    if _is_text(got) and _is_text(want):
        return True
    return _time_kind(got) is not None and _time_kind(got) == _time_kind(want)


def _time_kind(dtype) -> tuple | None:
    """``("M", tz)`` for datetimes, ``("m", None)`` for timedeltas, whatever the unit."""
    tz = getattr(dtype, "tz", None)
    if tz is not None:
        return ("M", str(tz))
    kind = getattr(dtype, "kind", None)
    return (kind, None) if kind in ("M", "m") else None


def _is_text(dtype) -> bool:
    import pandas as pd  # a partition's check: array kernels' workers never load pandas

    try:
        return (pd.api.types.is_object_dtype(dtype) or isinstance(dtype, pd.StringDtype)
                or (isinstance(dtype, pd.ArrowDtype) and pd.api.types.is_string_dtype(dtype)))
    except TypeError:
        return False


class _XarrayKernel(_Kernel):
    def __call__(self, *objs, **kwargs):
        return self.run(lambda: f"the block at {_xarray_block_label(objs[0])}", *objs,
                         **kwargs)


def _xarray_block_label(obj) -> str:
    parts = []
    for dim in obj.dims:
        if dim in obj.indexes and obj.sizes[dim]:
            idx = obj.indexes[dim]
            parts.append(f"{dim}={idx[0]}..{idx[-1]}")
        else:
            parts.append(f"{dim}[{obj.sizes[dim]}]")
    return "{" + ", ".join(parts) + "}"
