"""blockflow.tree_reduce: the result dtype (and value) is what NumPy or pandas gives for the
same reduction of the whole input, for every bool, integer and float dtype, any chunking and
any tree depth; a user's ``dtype=`` wins; partials never narrow.

Issue 10, "Reduction dtypes": ``tree_reduce(da.ones(200, dtype="int8", chunks=50), np.sum)``
gave -56 because the input's dtype was handed to ``chunk``. Property tests run on Dask's
synchronous scheduler.
"""

from __future__ import annotations

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockflow import tree_reduce
from blockflow.reduction import result_dtypes

DTYPES = [np.dtype(t) for t in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "longdouble")]
FUNCS = [np.sum, np.prod, np.mean, np.var, np.std, np.min, np.max, np.any, np.all,
         np.count_nonzero]


def _sync():
    return dask.config.set(scheduler="sync")


# --- the reported cases, exactly ---------------------------------------------------------


def test_int8_ones_sum_to_200():
    out = tree_reduce(da.ones(200, dtype="int8", chunks=50), np.sum)
    assert out.dtype == np.int64
    with _sync():
        got = out.compute()
    assert got == 200 and got.dtype == np.int64


def test_bool_mask_sums_to_its_count():
    mask = np.zeros(8040, dtype=bool)
    mask[::2] = True  # 4,020 true
    with _sync():
        got = tree_reduce(da.from_array(mask, chunks=1000), np.sum).compute()
    assert got == 4020 and got.dtype == np.int64


def test_uint8_image_sums_to_819200():
    image = da.full((64, 128), 100, dtype="uint8", chunks=(16, 32))
    with _sync():
        got = tree_reduce(image, np.sum, split_every=2).compute()
    assert got == 819200 and got.dtype == np.uint64


def test_int16_sums_to_three_billion():
    x = da.full(100_000, 30_000, dtype="int16", chunks=10_000)
    with _sync():
        got = tree_reduce(x, np.sum).compute()
    assert got == 3_000_000_000 and got.dtype == np.int64


def test_the_same_on_the_cluster(client):
    assert client.compute(tree_reduce(da.ones(200, dtype="int8", chunks=50), np.sum)
                          ).result() == 200
    x = da.full(100_000, 30_000, dtype="int16", chunks=10_000)
    assert client.compute(tree_reduce(x, np.sum, split_every=3)).result() == 3_000_000_000


def test_xarray_follows_the_same_rules():
    xr = pytest.importorskip("xarray")
    arr = xr.DataArray(da.full((6, 4), 100, dtype="uint8", chunks=2), dims=("t", "x"))
    out = tree_reduce(arr, np.sum, dim="t", split_every=2)
    assert out.dtype == np.uint64
    with _sync():
        np.testing.assert_array_equal(out.values, np.full(4, 600, dtype=np.uint64))


# --- dtype=, partials, inference ---------------------------------------------------------


def test_user_dtype_wins_and_casts():
    x = da.ones(10, dtype="int8", chunks=3)
    with _sync():
        got = tree_reduce(x, np.sum, dtype="int16").compute()
        assert got == 10 and got.dtype == np.int16
        # np.max takes no dtype: the result is cast to the one asked for
        got = tree_reduce(da.ones(10, dtype="f8", chunks=3), np.max, dtype="f4").compute()
        assert got == 1.0 and got.dtype == np.float32
        # asking for int8 gives NumPy's np.sum(a, dtype="int8"): the sum modulo 2**8
        got = tree_reduce(da.ones(200, dtype="int8", chunks=50), np.sum, dtype="int8")
        assert got.compute() == np.sum(np.ones(200, "int8"), dtype="int8") == -56


def test_partials_never_narrow():
    seen = []

    def chunk(x, axis=None, keepdims=True, dtype=None):
        if dtype is not None:  # None: tree_reduce's one-element sample
            seen.append(("chunk", np.dtype(dtype)))
        return np.sum(x, axis=axis, keepdims=keepdims, dtype=dtype)

    def combine(x, axis=None, keepdims=True, dtype=None):
        if dtype is not None:
            seen.append(("combine", np.dtype(dtype)))
        return np.sum(x, axis=axis, keepdims=keepdims, dtype=dtype)

    x = da.full(64, 120, dtype="int8", chunks=1)
    with _sync():
        got = tree_reduce(x, chunk, combine, split_every=2).compute()
    assert got == 64 * 120 and got.dtype == np.int64
    assert {d for _, d in seen} == {np.dtype("int64")}
    assert {s for s, _ in seen} == {"chunk", "combine"}
    seen.clear()
    # a narrower dtype= asked for: the steps still accumulate in int64, the result is cast
    with _sync():
        got = tree_reduce(x, chunk, combine, split_every=2, dtype="int16").compute()
    assert got == 64 * 120 and got.dtype == np.int16
    assert {d for s, d in seen if s == "chunk"} == {np.dtype("int64")}


def test_result_dtypes_from_a_one_element_sample():
    x = da.ones(4, dtype="uint8", chunks=2)
    assert result_dtypes(x, np.sum) == (np.uint64, np.uint64)
    assert result_dtypes(x, np.max) == (np.uint8, np.uint8)
    assert result_dtypes(x, np.max, np.sum) == (np.uint8, np.uint64)
    assert result_dtypes(x, np.any) == (np.bool_, np.bool_)

    def fails(x, axis=None, keepdims=True):
        raise RuntimeError("no sample")

    assert result_dtypes(x, fails) == (None, None)


def test_a_function_that_fails_on_the_sample_keeps_its_own_dtypes():
    def needs_two(x, axis=None, keepdims=True):
        if x.size < 2:
            raise ValueError("needs two")
        return np.sum(x, axis=axis, keepdims=keepdims)

    out = tree_reduce(da.ones(8, dtype="int8", chunks=4), needs_two, np.sum, split_every=2)
    assert out.dtype == np.int8  # declared: the input's
    with _sync():
        assert out.compute() == 8  # no dtype handed to the steps: no wrap-around


@pytest.mark.parametrize("func, name", [(np.median, "median"), (np.argmax, "argmax"),
                                        (np.percentile, "percentile")])
def test_functions_that_do_not_combine_are_refused(func, name):
    with pytest.raises(ValueError) as e:
        tree_reduce(da.ones(8, chunks=2), func)
    assert str(e.value) == (
        f"blockflow.tree_reduce: numpy.{name} of block results is not numpy.{name} of the "
        f"whole input, so it cannot reduce on its own; use dask.array.{name}(x, ...) or pass "
        f"chunk, combine and aggregate functions that merge partial results."
    )


def test_numpy_mean_on_frames_is_refused():
    ddf = dd.from_pandas(pd.DataFrame({"a": range(8)}), npartitions=2)
    with pytest.raises(ValueError) as e:
        tree_reduce(ddf, np.mean)
    assert str(e.value) == (
        "blockflow.tree_reduce: numpy.mean of block results is not numpy.mean of the whole "
        "input, so it cannot reduce on its own; use the dataframe's own method (e.g. "
        "df.mean()) or pass chunk, combine and aggregate functions that merge partial "
        "results."
    )


def test_mean_of_uneven_blocks_is_the_mean():
    a = np.arange(10, dtype="int16")
    x = da.from_array(a, chunks=((1, 9),))  # block means 0 and 5: their mean would be 2.5
    with _sync():
        got = tree_reduce(x, np.mean).compute()
        assert got == 4.5 and got.dtype == np.float64
        assert tree_reduce(x, np.var).compute() == np.var(a) == 8.25
        got = tree_reduce(x, np.count_nonzero).compute()
        assert got == 9 and got.dtype == np.intp
        b = np.array([1.0, np.nan, 3.0, np.nan], dtype="f4")
        got = tree_reduce(da.from_array(b, chunks=1), np.nanmean, split_every=2).compute()
        assert got == 2.0 and got.dtype == np.float32


# --- property tests: arrays vs NumPy -------------------------------------------------------


def _bounds(dtype: np.dtype, func, n: int):
    """Value range near the dtype's limits where NumPy's own answer does not depend on the
    order of operations (float sums and products would otherwise overflow differently)."""
    if dtype.kind != "f":
        return None
    big = float(np.finfo(dtype).max)
    if func in (np.sum, np.mean):
        return big / (2 * n)
    if func in (np.var, np.std):
        return float(np.sqrt(big)) / (2 * n)
    if func is np.prod:
        return 2.0
    return big


@st.composite
def arrays_for(draw, dtype: np.dtype, func, n: int):
    if dtype.kind == "b":
        return np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        edge = st.sampled_from([info.min, info.min + 1, info.max - 1, info.max, 0, 1])
        values = st.one_of(edge, st.integers(int(info.min), int(info.max)))
        return np.array(draw(st.lists(values, min_size=n, max_size=n)), dtype=dtype)
    bound = _bounds(dtype, func, n)
    if func is np.prod:  # magnitudes 1/2 to 2: products of <= 12 stay finite in float16
        mags = st.floats(0.5, 2.0)
        vals = draw(st.lists(st.tuples(mags, st.booleans()), min_size=n, max_size=n))
        return np.array([m if s else -m for m, s in vals], dtype=dtype)
    edge = st.sampled_from([bound, -bound, 0.0, bound / 3])
    values = st.one_of(edge, st.floats(-bound, bound, allow_nan=False, width=64))
    return np.array(draw(st.lists(values, min_size=n, max_size=n)), dtype=dtype)


@st.composite
def chunks_for(draw, n: int):
    """Any chunking of an axis of length n (sizes >= 1), often all 1-element blocks."""
    if n > 1 and draw(st.booleans()):
        return (1,) * n
    cuts = draw(st.sets(st.integers(1, n - 1), max_size=min(n - 1, 12))) if n > 1 else set()
    bounds = [0, *sorted(cuts), n]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _assert_matches(got, want, a, func, declared):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype == declared, (func.__name__, got.dtype, want.dtype, declared)
    assert got.shape == want.shape
    if want.dtype.kind != "f" or func in (np.min, np.max):
        np.testing.assert_array_equal(got, want)
        return
    # float round-off: the tree sums in another order (and wider) than NumPy
    n = a.size
    eps = float(np.finfo(want.dtype).eps)
    scale = float(np.max(np.abs(a.astype(np.longdouble)))) if n else 0.0
    if func is np.prod:
        np.testing.assert_allclose(got, want, rtol=4 * (n + 1) * eps)
    elif func is np.var:
        np.testing.assert_allclose(got, want, rtol=0, atol=16 * (n + 1) * eps * scale ** 2)
    elif func is np.std:  # compare variances: sqrt magnifies round-off near zero
        np.testing.assert_allclose(got.astype("f8") ** 2, want.astype("f8") ** 2, rtol=0,
                                   atol=16 * (n + 1) * eps * scale ** 2)
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=4 * (n + 1) * eps * scale)


def _check(a, chunks, func, axis, split_every):
    x = da.from_array(a, chunks=chunks)
    out = tree_reduce(x, func, axis=axis, split_every=split_every)
    with _sync(), np.errstate(all="ignore"):
        got = out.compute()
        want = func(a, axis=axis)
    _assert_matches(got, want, a, func, out.dtype)


@pytest.mark.parametrize("func", FUNCS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_function_at_the_limits(dtype, func):
    """The whole matrix, deterministically: values at the dtype's limits, 1-element blocks,
    fan-in 2 (four levels of combine for 12 blocks)."""
    n = 12
    if dtype.kind == "b":
        a = np.arange(n) % 3 == 0
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        a = np.array([info.max, info.min, info.max - 1, 1, 0, info.max] * 2, dtype=dtype)
    elif func is np.prod:
        a = np.array([2.0, -0.5, 1.5, 2.0, -2.0, 0.75] * 2, dtype=dtype)
    else:
        bound = _bounds(dtype, func, n)
        a = np.array([bound, -bound / 3, bound, bound / 2, 0.0, -bound] * 2, dtype=dtype)
    _check(a, (1,) * n, func, None, 2)
    _check(a.reshape(3, 4), (1, 3), func, 1, 2)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), func=st.sampled_from(FUNCS),
       split_every=st.integers(2, 5))
@pytest.mark.slow
def test_any_dtype_chunking_and_depth_equals_numpy(data, dtype, func, split_every):
    n = data.draw(st.integers(1, 12 if func is np.prod else 30), label="n")
    a = data.draw(arrays_for(dtype, func, n), label="a")
    chunks = data.draw(chunks_for(n), label="chunks")
    _check(a, (chunks,), func, None, split_every)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), func=st.sampled_from(FUNCS),
       split_every=st.integers(2, 4), axis=st.sampled_from([0, 1, None]))
def test_2d_any_axis_equals_numpy(data, dtype, func, split_every, axis):
    rows, cols = data.draw(st.integers(1, 6), label="rows"), data.draw(st.integers(1, 5))
    a = data.draw(arrays_for(dtype, func, rows * cols), label="a").reshape(rows, cols)
    chunks = (data.draw(chunks_for(rows)), data.draw(chunks_for(cols)))
    _check(a, chunks, func, axis, split_every)


# --- property tests: dataframes vs pandas --------------------------------------------------

FRAME_DTYPES = [d for d in DTYPES if d != np.dtype("longdouble")]  # pandas has no float128
FRAME_OPS = ["sum", "prod", "min", "max", "any", "all", "count"]


def _frame_reduce(obj, op, split_every):
    if op == "count":  # a count of counts is not a count: sum the partial counts
        return tree_reduce(obj, lambda p: p.count(), lambda p: p.sum(),
                           split_every=split_every)
    return tree_reduce(obj, lambda p: getattr(p, op)(), split_every=split_every)


def _frame_values(draw, dtype, op, n):
    func = {"sum": np.sum, "prod": np.prod}.get(op, np.max)  # value ranges as for arrays
    return draw(arrays_for(dtype, func, n))


def _assert_same(got, want, op):
    # scalars: pandas gives a Python float NaN for no rows, the tree np.float64(nan)
    assert np.asarray(got).dtype == np.asarray(want).dtype, (op, got, want)
    assert isinstance(got, pd.Series) == isinstance(want, pd.Series)
    if isinstance(want, pd.Series):
        pd.testing.assert_series_equal(got, want, check_exact=False, rtol=1e-2)
    elif np.asarray(want).dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=1e-2)  # float16 sums in another order
    else:
        assert got == want


@settings(max_examples=50, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(FRAME_DTYPES), op=st.sampled_from(FRAME_OPS),
       npartitions=st.integers(1, 6), split_every=st.integers(2, 4),
       series=st.booleans(), drop=st.integers(0, 12))
@pytest.mark.slow
def test_frame_reductions_equal_pandas(data, dtype, op, npartitions, split_every, series,
                                       drop):
    """Per-column (DataFrame) and scalar (Series) reductions, with partitions left empty by
    a filter (``drop`` rows removed from the front), vs pandas on the whole frame."""
    n = data.draw(st.integers(1, 10 if op == "prod" else 24), label="n")
    pdf = pd.DataFrame({"a": _frame_values(data.draw, dtype, op, n),
                        "b": _frame_values(data.draw, dtype, op, n), "i": np.arange(n)})
    ddf = dd.from_pandas(pdf, npartitions=npartitions)
    ddf, pdf = ddf[ddf.i >= drop][["a", "b"]], pdf[pdf.i >= drop][["a", "b"]]
    if series:
        ddf, pdf = ddf["a"], pdf["a"]
    out = _frame_reduce(ddf, op, split_every)
    with _sync(), np.errstate(all="ignore"):
        got = out.compute()
        want = getattr(pdf, op)()
    _assert_same(got, want, op)


@pytest.mark.parametrize("op, want", [("min", np.int8(6)), ("max", np.int8(11)),
                                      ("sum", np.int64(51)), ("any", np.True_),
                                      ("count", np.int64(6))])
def test_empty_partitions_keep_the_dtype(op, want):
    """A filter empties the first partitions: int8 minima stayed float64 (6.0) before."""
    pdf = pd.DataFrame({"a": np.arange(12, dtype="int8")})
    ddf = dd.from_pandas(pdf, npartitions=4)
    ddf = ddf[ddf.a > 5]
    with _sync():
        got = _frame_reduce(ddf, op, 2).compute()
        got_series = _frame_reduce(ddf["a"], op, 2).compute()
    assert got["a"] == want and got.dtype == want.dtype
    assert got_series == want and type(got_series) is type(want)
