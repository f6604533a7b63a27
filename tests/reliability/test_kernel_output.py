"""What kernels return, and how reduction functions fail: each wrong result or failure raises
one ``BlockKernelError`` whose exact message names the kernel, the block or partition, what
is wrong and how to fix it.

Every case runs twice: on ``proc_client``'s worker processes (the kernel runs on a worker
and the error crosses a process boundary) and with Dask's local threaded scheduler.
"""

from __future__ import annotations

import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

import blockflow
from blockflow.errors import BlockKernelError, DeviceMemoryError


@pytest.fixture(params=[pytest.param("workers", marks=pytest.mark.slow), "local"])
def compute(request):
    """Compute a collection on proc_client's worker processes, or locally (threads)."""
    if request.param == "workers":
        client = request.getfixturevalue("proc_client")
        return lambda c: client.compute(c).result()
    return lambda c: c.compute(scheduler="threads")


def raises_exactly(compute, collection, message: str) -> BlockKernelError:
    with pytest.raises(BlockKernelError) as info:
        compute(collection)
    assert str(info.value) == message
    return info.value


ARRAY_FIX = ("not an array; return one array per block from the kernel (a NumPy or CuPy "
             "array: wrap scalars and lists with np.asarray, or cupy.asarray on GPU).")


# --- array kernels: one array per block ----------------------------------------------------


def returns_none(b):
    return None


def none_on_block_2(b, block_id=None):
    return None if block_id == (2, 0) else b


def list_on_block_2(b, block_id=None):
    return b.tolist() if block_id == (2, 0) else b


def scalar_on_block_2(b, block_id=None):
    return float(b.sum()) if block_id == (2, 0) else b


def frame_on_block_2(b, block_id=None):
    return pd.DataFrame(b) if block_id == (2, 0) else b


@pytest.mark.parametrize("kernel, returned", [
    (none_on_block_2, "NoneType"),
    (list_on_block_2, "list"),
    (scalar_on_block_2, "float"),
    (frame_on_block_2, "pandas.DataFrame"),
])
@pytest.mark.slow
def test_an_array_kernel_returning_no_array_names_the_block_and_the_type(compute, kernel,
                                                                         returned):
    y = blockflow.map_blocks(kernel, da.ones((100, 10), chunks=(25, 10)), dtype=float)
    raises_exactly(compute, y, f"blockflow kernel {kernel.__name__!r} returned a {returned} "
                               f"for block (2, 0), {ARRAY_FIX}")


def test_a_kernel_returning_none_everywhere_no_longer_gives_an_empty_array(compute):
    # the user trial's case: this computed array([], dtype=float64) before
    y = blockflow.map_blocks(returns_none, da.ones((100, 10), chunks=(25, 10)), dtype=float)
    with pytest.raises(BlockKernelError) as info:
        compute(y)
    assert str(info.value) in {
        f"blockflow kernel 'returns_none' returned a NoneType for block ({i}, 0), {ARRAY_FIX}"
        for i in range(4)}


def block_total(b):
    return b.sum()  # a NumPy scalar


def block_total_0d(b):
    return np.asarray(b.sum())


def python_total(b):
    return float(b.sum())


@pytest.mark.parametrize("kernel", [block_total, block_total_0d])
def test_numpy_scalars_and_0d_arrays_are_blocks_of_a_0d_output(compute, kernel):
    x = da.ones((10, 4), chunks=(10, 4))
    y = blockflow.map_blocks(kernel, x, drop_axis=[0, 1], dtype=float)
    assert y.ndim == 0
    assert compute(y) == 40.0


def test_a_python_scalar_is_not_a_block_even_of_a_0d_output(compute):
    y = blockflow.map_blocks(python_total, da.ones((10, 4), chunks=(10, 4)), drop_axis=[0, 1],
                             dtype=float)
    raises_exactly(compute, y, f"blockflow kernel 'python_total' returned a float for block "
                               f"(), {ARRAY_FIX}")


def row_sums(b):
    return b.sum(axis=1)


def test_arrays_of_the_declared_shape_still_pass(compute):
    x = da.ones((100, 10), chunks=(25, 10))
    np.testing.assert_array_equal(
        compute(blockflow.map_blocks(row_sums, x, drop_axis=1, dtype=float)), np.full(100, 10.0))
    np.testing.assert_array_equal(
        compute(blockflow.map_blocks(np.negative, x)), -np.ones((100, 10)))


# --- dataframe kernels: partitions as declared by meta --------------------------------------


def _frame(npartitions=4):
    pdf = pd.DataFrame({"k": np.arange(12) % 3, "v": np.arange(12, dtype="f8"),
                        "name": [f"n{i}" for i in range(12)]})
    return pdf, dd.from_pandas(pdf, npartitions=npartitions)


def series_on_2(p, partition_info=None):
    return p["v"] if partition_info["number"] == 2 else p[["k", "v"]]


def frame_on_2(p, partition_info=None):
    return p[["v"]] if partition_info["number"] == 2 else p["v"]


def none_on_2(p, partition_info=None):
    return None if partition_info["number"] == 2 else p[["k", "v"]]


def extra_column_on_2(p, partition_info=None):
    out = p[["k", "v"]]
    return out.assign(w=1.0) if partition_info["number"] == 2 else out


def renamed_on_2(p, partition_info=None):
    out = p[["k", "v"]]
    return out.rename(columns={"v": "value"}) if partition_info["number"] == 2 else out


def reordered_on_2(p, partition_info=None):
    return p[["v", "k"]] if partition_info["number"] == 2 else p[["k", "v"]]


def floats_on_2(p, partition_info=None):
    out = p[["k", "v"]]
    return out.astype({"k": "f8", "v": "f4"}) if partition_info["number"] == 2 else out


def int_series_on_2(p, partition_info=None):
    return p["v"].astype("i8") if partition_info["number"] == 2 else p["v"]


def float_ints(p, partition_info=None):
    return p[["k", "v"]].astype("f8")  # all partitions, against a declared int64 "k"


KV_META = pd.DataFrame({"k": pd.Series(dtype="i8"), "v": pd.Series(dtype="f8")})
V_META = pd.Series(dtype="f8", name="v")
FRAME_FIX = "or pass meta= to map_blocks to declare what it returns."


@pytest.mark.parametrize("kernel, meta, message", [
    pytest.param(
        series_on_2, KV_META,
        "blockflow kernel 'series_on_2' returned a pandas.Series for partition 2, but the "
        "output is declared a DataFrame with columns ['k', 'v']; return a DataFrame from the "
        f"kernel, {FRAME_FIX}", id="series-for-dataframe"),
    pytest.param(
        frame_on_2, V_META,
        "blockflow kernel 'frame_on_2' returned a pandas.DataFrame for partition 2, but the "
        "output is declared a Series of dtype float64; return a Series from the kernel, "
        f"{FRAME_FIX}", id="dataframe-for-series"),
    pytest.param(
        none_on_2, KV_META,
        "blockflow kernel 'none_on_2' returned a NoneType for partition 2, but the output is "
        "declared a DataFrame with columns ['k', 'v']; return a DataFrame from the kernel, "
        f"{FRAME_FIX}", id="none"),
    pytest.param(
        extra_column_on_2, KV_META,
        "blockflow kernel 'extra_column_on_2' returned columns ['k', 'v', 'w'] for partition "
        "2, but the output is declared with columns ['k', 'v'] (unexpected ['w']); return "
        "those columns from the kernel, or pass meta= to map_blocks to declare the columns it "
        "returns.", id="extra-column"),
    pytest.param(
        renamed_on_2, KV_META,
        "blockflow kernel 'renamed_on_2' returned columns ['k', 'value'] for partition 2, but "
        "the output is declared with columns ['k', 'v'] (missing ['v'], unexpected "
        "['value']); return those columns from the kernel, or pass meta= to map_blocks to "
        "declare the columns it returns.", id="renamed-column"),
    pytest.param(
        reordered_on_2, KV_META,
        "blockflow kernel 'reordered_on_2' returned columns ['v', 'k'] for partition 2, but "
        "the output is declared with columns ['k', 'v'] (the same columns in another order); "
        "select them in the declared order inside the kernel (part[columns]), or pass meta= "
        "to map_blocks to declare the columns it returns.", id="column-order"),
    pytest.param(
        floats_on_2, KV_META,
        "blockflow kernel 'floats_on_2' returned dtypes for partition 2 that differ from the "
        "output's meta: column 'k' is float64 but declared int64, column 'v' is float32 but "
        "declared float64; cast inside the kernel (e.g. part.astype({'k': 'int64', 'v': "
        "'float64'})) or pass meta= to map_blocks with the dtypes it returns.",
        id="dtypes"),
    pytest.param(
        int_series_on_2, V_META,
        "blockflow kernel 'int_series_on_2' returned a Series of dtype int64 for partition 2, "
        "but the output is declared float64; cast inside the kernel (e.g. "
        "part.astype('float64')) or pass meta= to map_blocks with the dtype it returns.",
        id="series-dtype"),
])
def test_a_partition_unlike_the_declared_meta_names_it_and_what_differs(compute, kernel, meta,
                                                                        message):
    _, ddf = _frame()
    out = blockflow.map_blocks(kernel, ddf, meta=meta)
    raises_exactly(compute, out, message)


def test_every_partition_of_the_wrong_dtype_is_refused(compute):
    # the user trial's case: float "k" against a declared int64 was accepted silently
    _, ddf = _frame()
    out = blockflow.map_blocks(float_ints, ddf, meta=KV_META)
    with pytest.raises(BlockKernelError) as info:
        compute(out)
    assert str(info.value) in {
        f"blockflow kernel 'float_ints' returned dtypes for partition {i} that differ from the "
        f"output's meta: column 'k' is float64 but declared int64; cast inside the kernel "
        f"(e.g. part.astype({{'k': 'int64'}})) or pass meta= to map_blocks with the dtypes it "
        f"returns." for i in range(4)}


def int_k_except_on_1(p, partition_info=None):
    out = p[["k", "v"]]
    return out.astype({"k": "f8"}) if partition_info and partition_info["number"] == 1 else out


def test_an_inferred_meta_checks_columns_not_dtypes(compute):
    """Dask's inferred meta can be wrong about dtypes, so only a declared meta= checks them;
    columns are checked either way (as Dask itself does)."""
    _, ddf = _frame()
    out = compute(blockflow.map_blocks(int_k_except_on_1, ddf))  # sample meta: int64 "k"
    assert out["k"].tolist() == ddf.compute()["k"].tolist()


def identity(part):
    return part


@pytest.mark.slow
def test_a_kernel_that_changes_nothing_passes_where_dasks_meta_is_wrong(compute):
    """The first user trial's false positives: Dask's meta says float64 for an int64 column
    after dd.to_datetime, int64 for a float64 column after a left merge with missing keys."""
    pdf = pd.DataFrame({"a": np.arange(20), "d": ["2013-01-01 05:17"] * 20,
                        "k": list("abcd") * 5})
    ddf = dd.from_pandas(pdf, npartitions=4)
    lookup = pd.DataFrame({"k": list("abc"), "v": [1, 2, 3]})
    for frame in (ddf.assign(t=dd.to_datetime(ddf.d)),
                  ddf.merge(lookup, on="k", how="left"),
                  ddf.assign(c=ddf.a.where(ddf.a > 1))):
        pd.testing.assert_frame_equal(compute(blockflow.map_blocks(identity, frame)),
                                      frame.compute())


def to_datetime_d(part):
    return part.assign(t=pd.to_datetime(part["d"]))


def test_datetimes_match_a_declared_meta_whatever_their_unit(compute):
    """pandas 3 parses to datetime64[us]; a meta written with datetime64[ns] still matches."""
    pdf = pd.DataFrame({"d": ["2013-01-01 05:17"] * 8})
    ddf = dd.from_pandas(pdf, npartitions=2)
    meta = pdf.iloc[:0].assign(t=pd.Series([], dtype="datetime64[ns]"))
    out = compute(blockflow.map_blocks(to_datetime_d, ddf, meta=meta))
    assert out["t"].dt.year.tolist() == [2013] * 8
    tz_meta = pdf.iloc[:0].assign(t=pd.Series([], dtype="datetime64[ns, UTC]"))
    with pytest.raises(BlockKernelError, match=r"column 't' is datetime64\[\w+\] but declared "
                                               r"datetime64\[ns, UTC\]"):
        compute(blockflow.map_blocks(to_datetime_d, ddf, meta=tz_meta))


def count_and_sum(part):
    return (len(part), int(part["k"].sum()))


def test_a_tuple_per_partition_makes_a_series_as_in_dask(compute):
    _, ddf = _frame()
    out = compute(blockflow.map_blocks(count_and_sum, ddf)).tolist()
    whole = ddf.compute()
    assert len(out) == ddf.npartitions
    assert (sum(n for n, _ in out), sum(t for _, t in out)) == (len(whole), whole["k"].sum())


def count_rows(p):
    return len(p)


def categories(p):
    return p.assign(k=p["k"].astype("category"))


def with_label(p):
    return p.assign(label=p["k"].map(str))


def keep_big(p):
    out = p[p["v"] > 100]  # empty everywhere
    return out.apply(lambda r: r, axis=1)  # pandas gives an empty frame, its own dtypes


@pytest.mark.slow
def test_what_dask_accepts_still_passes(compute):
    pdf, ddf = _frame()
    # a scalar per partition for a Series output (Dask makes it a one-row Series)
    assert list(compute(blockflow.map_blocks(count_rows, ddf))) == [3, 3, 3, 3]
    # categoricals: the categories differ per partition and from the meta's
    got = compute(blockflow.map_blocks(categories, ddf))
    assert isinstance(got["k"].dtype, pd.CategoricalDtype)
    # a meta built from the pandas frame: its string dtype differs from Dask's partitions
    meta = pdf.assign(label=pdf["name"]).iloc[:0]
    got = compute(blockflow.map_blocks(with_label, ddf, meta=meta))
    assert list(got["label"]) == [str(k) for k in pdf["k"]]
    # an empty result is replaced by the meta, as Dask does
    assert len(compute(blockflow.map_blocks(keep_big, ddf, meta=pdf.iloc[:0]))) == 0


# --- tree_reduce: the failing step, the function and the attempts ---------------------------


def bad(x, axis=None, keepdims=False):
    return 1 / 0


def total(x, axis=None, keepdims=False):
    return np.sum(x, axis=axis, keepdims=keepdims)


@pytest.mark.parametrize("funcs, stage", [
    ((bad,), "chunk"),
    ((total, bad, total), "combine"),
    ((total, total, bad), "aggregate"),
])
@pytest.mark.parametrize("retries", [0, 1])
def test_a_failing_reduction_step_is_named_with_its_attempts(compute, funcs, stage, retries):
    x = da.ones((8, 3), chunks=2)
    out = blockflow.tree_reduce(x, *funcs, split_every=2, retries=retries)
    after = " after 2 attempts" if retries else ""
    err = raises_exactly(compute, out, f"blockflow tree_reduce: {stage} function 'bad' "
                                       f"failed{after}: ZeroDivisionError: division by zero")
    if isinstance(err.__cause__, BaseException):  # the traceback survives locally
        assert isinstance(err.__cause__, ZeroDivisionError)


def test_the_original_error_is_chained():
    out = blockflow.tree_reduce(da.ones(8, chunks=2), bad, retries=1)
    with pytest.raises(BlockKernelError) as info:
        out.compute(scheduler="sync")
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def frame_sum(p):
    return p.sum().to_frame().T


def bad_merge(p):
    raise KeyError("no such group")


def test_a_failing_dataframe_reduction_step_is_named(compute):
    _, ddf = _frame()
    out = blockflow.tree_reduce(ddf[["k", "v"]], frame_sum, bad_merge, frame_sum, split_every=2,
                                retries=1, meta=KV_META.astype("f8"))
    raises_exactly(compute, out, "blockflow tree_reduce: combine function 'bad_merge' failed "
                                 "after 2 attempts: KeyError: 'no such group'")


class OutOfMemoryError(MemoryError):
    """Named like CuPy's, so blockflow takes it for a device out-of-memory error."""


def needs_a_big_device(x, axis=None, keepdims=False):
    raise OutOfMemoryError("Out of memory allocating 1,024 bytes (allocated so far: 0 bytes)")


def test_a_reduction_step_out_of_device_memory_is_a_device_memory_error(compute):
    out = blockflow.tree_reduce(da.ones(8, chunks=2), needs_a_big_device, split_every=2)
    with pytest.raises(DeviceMemoryError) as info:
        compute(out)
    assert str(info.value).startswith(
        "blockflow kernel 'needs_a_big_device' ran out of device memory on a tree_reduce chunk "
        "step: it asked for 1,024 bytes (1.00 kiB) of device memory, but the largest free "
        "device memory of any worker is unknown")
    assert info.value.working_set == 1024


# --- tree_reduce: axis= checked up front ----------------------------------------------------


@pytest.mark.parametrize("axis, error, message", [
    (5, ValueError, "blockflow.tree_reduce: axis 5 is out of range for the collection's 2 "
                    "dimensions; use an axis from -2 to 1."),
    (-3, ValueError, "blockflow.tree_reduce: axis -3 is out of range for the collection's 2 "
                     "dimensions; use an axis from -2 to 1."),
    ((0, 2), ValueError, "blockflow.tree_reduce: axis 2 is out of range for the collection's "
                         "2 dimensions; use an axis from -2 to 1."),
    ((0, -2), ValueError, "blockflow.tree_reduce: axis (0, -2) names axis 0 twice (the "
                          "collection has 2 dimensions); name each axis once."),
    ((1, 1), ValueError, "blockflow.tree_reduce: axis (1, 1) names axis 1 twice (the "
                         "collection has 2 dimensions); name each axis once."),
    ("x", TypeError, "blockflow.tree_reduce: axis must be an int or a tuple of ints, got 'x'."),
    ((0, 1.0), TypeError, "blockflow.tree_reduce: axis must be an int or a tuple of ints, got "
                          "(0, 1.0)."),
    (True, TypeError, "blockflow.tree_reduce: axis must be an int or a tuple of ints, got "
                      "True."),
])
def test_a_bad_axis_is_refused_before_anything_runs(axis, error, message):
    with pytest.raises(error) as info:
        blockflow.tree_reduce(da.ones((8, 3), chunks=2), np.sum, axis=axis, split_every=2)
    assert str(info.value) == message


@pytest.mark.parametrize("axis, want", [
    (-1, np.full(8, 3.0)), (np.int64(0), np.full(3, 8.0)), ([0, 1], 24.0), ((-2, 1), 24.0),
    ((), np.ones((8, 3))),
])
def test_good_axes_still_reduce(axis, want):
    out = blockflow.tree_reduce(da.ones((8, 3), chunks=2), np.sum, axis=axis, split_every=2)
    np.testing.assert_array_equal(out.compute(scheduler="sync"), want)


def double(b):
    return b * 2


def test_a_1d_meta_declares_the_dtype_of_a_2d_output(compute):
    """meta=np.array((), dtype=...) is Dask's idiom whatever the output's dimensions."""
    x = da.arange(24, chunks=6).reshape(4, 6).rechunk((2, 3)).astype(float)
    out = blockflow.map_blocks(double, x, meta=np.array((), dtype=float))
    np.testing.assert_array_equal(compute(out), 2 * np.arange(24.0).reshape(4, 6))
