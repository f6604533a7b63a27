"""blockflow.map_blocks on dask arrays, dask dataframes and xarray objects (real clusters).

Kernels record the real blocks they see in module-level lists: the cluster of conftest.py runs
its workers in this process (``processes=False``), so the lists are shared with the workers.
"""

from __future__ import annotations

import threading

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
import xarray as xr
from dask.utils import key_split
from hypothesis import given, settings
from hypothesis import strategies as st

import blockflow
from blockflow import BlockKernelError, EmptyCollectionError, map_blocks

_lock = threading.Lock()
SEEN: list = []


@pytest.fixture(autouse=True)
def _clear_seen():
    SEEN.clear()
    yield
    SEEN.clear()


def _see(item) -> None:
    with _lock:
        SEEN.append(item)


def inc(b):
    return b + 1


def _keys_of(collection) -> list[str]:
    """Names (first key element) of a collection's output keys."""
    keys = collection.__dask_keys__()
    flat = []

    def walk(k):
        if isinstance(k, list):
            for x in k:
                walk(x)
        else:
            flat.append(k[0] if isinstance(k, tuple) else k)

    walk(keys)
    return flat


# --- dask.array ------------------------------------------------------------------------


def record_array(b, block_id=None):
    if b.size:
        _see(block_id)
    return b * 2


def test_array_equals_numpy_and_keeps_metadata(client):
    a = np.arange(6 * 8, dtype="i4").reshape(6, 8)
    x = da.from_array(a, chunks=(4, 3))
    y = map_blocks(inc, x)
    assert isinstance(y, da.Array)
    assert y.dtype == np.dtype("i4") and y.chunks == ((4, 2), (3, 3, 2))
    assert type(y._meta) is np.ndarray and y._meta.ndim == 2
    assert all(n.startswith("blockflow-inc-") for n in _keys_of(y))
    got = client.compute(y).result()
    np.testing.assert_array_equal(got, a + 1)
    assert got.dtype == np.dtype("i4")


def test_array_is_lazy_and_runs_once_per_block(client):
    x = da.ones((6, 8), chunks=(4, 3), dtype="f8")
    y = map_blocks(record_array, x, dtype="f8")
    assert SEEN == []  # building the graph ran no block
    assert y.name.startswith("blockflow-record-array-")
    np.testing.assert_array_equal(client.compute(y).result(), np.full((6, 8), 2.0))
    assert sorted(SEEN) == [(i, j) for i in range(2) for j in range(3)]


def test_array_several_inputs_kwargs_and_block_info(client):
    a = np.arange(20.0).reshape(4, 5)
    x = da.from_array(a, chunks=(2, 5))

    def weighted(p, q, w=1.0, block_info=None):
        loc = block_info[0]["array-location"][0]
        return (p - q) * w + loc[0]

    y = map_blocks(weighted, x, x * 3, w=0.5, dtype="f8")
    want = (a - 3 * a) * 0.5 + np.array([0, 0, 2, 2])[:, None]
    np.testing.assert_array_equal(client.compute(y).result(), want)


def test_array_chunks_and_drop_axis_declared(client):
    x = da.ones((6, 4), chunks=(3, 4))
    y = map_blocks(lambda b: b.sum(axis=1), x, drop_axis=1, dtype="f8")
    assert y.chunks == ((3, 3),)
    np.testing.assert_array_equal(client.compute(y).result(), np.full(6, 4.0))


settings_fast = settings(max_examples=30, deadline=None)


@st.composite
def chunks_for(draw, n: int):
    cuts = draw(st.sets(st.integers(1, n - 1), max_size=n - 1)) if n > 1 else set()
    bounds = [0, *sorted(cuts), n]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


@settings_fast
@given(data=st.data())
def test_array_any_chunking_equals_numpy(data):
    shape = data.draw(st.tuples(st.integers(1, 12), st.integers(1, 12)))
    chunks = tuple(data.draw(chunks_for(n)) for n in shape)
    a = np.arange(np.prod(shape), dtype="f8").reshape(shape)
    y = map_blocks(lambda b, block_id=None: b * 10 + block_id[0], da.from_array(a, chunks),
                   dtype="f8")
    assert y.chunks == chunks
    rows = np.repeat(np.arange(len(chunks[0])), chunks[0])[:, None]
    with dask.config.set(scheduler="sync"):
        np.testing.assert_array_equal(y.compute(), a * 10 + rows)


def fail_on_block(b, block_id=None):
    if block_id == (1, 2):
        raise ZeroDivisionError("no data here")
    return b


def test_array_kernel_error_names_the_block(client):
    x = da.ones((6, 8), chunks=(4, 3))
    y = map_blocks(fail_on_block, x, dtype="f8")
    with pytest.raises(BlockKernelError) as e:
        client.compute(y).result()
    assert str(e.value) == (
        "blockflow kernel 'fail_on_block' failed on block (1, 2): ZeroDivisionError: no data here"
    )


def as_float32(b):
    return b.astype("f4")


def ravel(b):
    return b.ravel()


def first_row(b, block_id=None):
    return b[:1] if block_id == (1, 0) else b


@pytest.mark.parametrize(
    "kernel, kwargs, message",
    [
        (as_float32, {"dtype": "f8"},
         "blockflow kernel 'as_float32' returned dtype float32 for block {b}, but the output "
         "is declared float64; cast inside the kernel or pass dtype=float32/meta= to "
         "map_blocks."),
        (ravel, {"dtype": "f8"},
         "blockflow kernel 'ravel' returned a 1-d block for block {b}, but the output is "
         "declared 2-d; pass chunks=/drop_axis=/new_axis= to map_blocks to declare the shape "
         "it returns."),
        (first_row, {"dtype": "f8"},
         "blockflow kernel 'first_row' returned shape (1, 4) for block (1, 0), but Dask "
         "expects (3, 4) from the output chunks; pass chunks= to map_blocks to declare the "
         "block shapes it returns."),
    ],
    ids=["dtype", "ndim", "shape"],
)
def test_array_kernel_returning_wrong_block(client, kernel, kwargs, message):
    x = da.ones((6, 4), chunks=(3, 4))
    y = map_blocks(kernel, x, **kwargs)
    with pytest.raises(BlockKernelError) as e:
        client.compute(y).result()
    # every block is wrong for dtype/ndim: whichever runs first is reported
    assert str(e.value) in {message.format(b=b) for b in ("(0, 0)", "(1, 0)")}


# --- dask.dataframe --------------------------------------------------------------------


def _frame(n=12, npartitions=3):
    pdf = pd.DataFrame({"k": np.arange(n) % 4, "v": np.arange(n, dtype="f8")},
                       index=pd.RangeIndex(n, name="i"))
    return pdf, dd.from_pandas(pdf, npartitions=npartitions)


def record_partition(p, partition_info=None):
    if partition_info is not None:
        _see(partition_info["number"])
    return p.assign(w=p["v"] * 2)


def test_dataframe_equals_pandas_keeps_meta_and_is_lazy(client):
    pdf, ddf = _frame()
    out = map_blocks(record_partition, ddf)
    assert SEEN == []  # meta emulation passes partition_info=None; no real partition ran
    assert isinstance(out, dd.DataFrame) and out.npartitions == 3
    assert list(out._meta.columns) == ["k", "v", "w"]
    assert dict(out.dtypes) == {"k": np.dtype("i8"), "v": np.dtype("f8"), "w": np.dtype("f8")}
    assert out.divisions == ddf.divisions
    assert all(n.startswith("blockflow-record-partition-") for n in _keys_of(out))
    got = client.compute(out).result()
    pd.testing.assert_frame_equal(got, pdf.assign(w=pdf["v"] * 2))
    assert sorted(SEEN) == [0, 1, 2]


def test_dataframe_series_and_explicit_meta(client):
    pdf, ddf = _frame()
    s = map_blocks(lambda v: (v > 3).astype("i1"), ddf["v"], meta=("v", "i1"))
    assert isinstance(s, dd.Series) and s.dtype == np.dtype("i1")
    pd.testing.assert_series_equal(client.compute(s).result(), (pdf["v"] > 3).astype("i1"))


def test_dataframe_two_inputs(client):
    pdf, ddf = _frame()
    out = map_blocks(lambda a, b: a[["v"]] + b[["v"]], ddf, ddf)
    pd.testing.assert_frame_equal(client.compute(out).result(), pdf[["v"]] * 2)


def fail_on_partition(p, partition_info=None):
    if partition_info and partition_info["number"] == 2:
        raise KeyError("bad key")
    return p


def test_dataframe_kernel_error_names_the_partition(client):
    _, ddf = _frame()
    out = map_blocks(fail_on_partition, ddf)
    with pytest.raises(BlockKernelError) as e:
        client.compute(out).result()
    assert str(e.value) == (
        "blockflow kernel 'fail_on_partition' failed on partition 2: KeyError: 'bad key'"
    )


# --- xarray ----------------------------------------------------------------------------


def _dataarray():
    time = pd.date_range("2001-01-01", periods=8, freq="D")
    lat = np.array([-45.0, 0.0, 45.0])
    return xr.DataArray(
        np.arange(24, dtype="f4").reshape(8, 3), dims=("time", "lat"),
        coords={"time": time, "lat": ("lat", lat, {"units": "degrees_north"}),
                "label": ("lat", ["s", "e", "n"])},
        name="t2m", attrs={"units": "K"},
    ).chunk({"time": 4})


def record_xarray(obj):
    if obj.size:
        _see(str(obj["time"].values[0])[:10])
    return obj * 2


def test_dataarray_equals_xarray_keeps_coords_and_is_lazy(client):
    arr = _dataarray()
    out = map_blocks(record_xarray, arr, template=arr)
    assert SEEN == []
    assert isinstance(out, xr.DataArray) and out.name == "t2m"
    assert out.chunks == arr.chunks and out.dtype == np.dtype("f4")
    assert out.attrs == {"units": "K"} and out["lat"].attrs == {"units": "degrees_north"}
    kernel_tasks = [k for k in out.__dask_graph__() if key_split(k) == "blockflow-record-xarray"]
    assert len(kernel_tasks) == 2
    got = client.compute(out).result()
    xr.testing.assert_identical(got, (arr * 2).compute())
    assert sorted(SEEN) == ["2001-01-01", "2001-01-05"]


def test_dataarray_template_inferred(client):
    arr = _dataarray()
    out = map_blocks(inc, arr)
    xr.testing.assert_identical(client.compute(out).result(), (arr + 1).compute())


def test_dataset_equals_xarray_keeps_coords(client):
    ds = xr.Dataset({"a": _dataarray(), "b": _dataarray() * 10})
    ds.attrs["title"] = "two fields"
    out = map_blocks(lambda d, c=0: d + c, ds, c=1)
    assert isinstance(out, xr.Dataset)
    assert out.chunks == ds.chunks and set(out.data_vars) == {"a", "b"}
    kernel_tasks = [k for k in out.__dask_graph__() if key_split(k) == "blockflow-lambda"]
    assert len(kernel_tasks) == 2
    xr.testing.assert_identical(client.compute(out).result(), (ds + 1).compute())


def xarray_two_inputs(a, b):
    return a - b.mean("time")


def test_xarray_two_inputs(client):
    arr = _dataarray()
    out = map_blocks(xarray_two_inputs, arr, arr * 10)
    assert out.sizes == arr.sizes and out.chunks == arr.chunks
    a = arr.compute()
    want = xr.concat([a[:4] - 10 * a[:4].mean("time"), a[4:] - 10 * a[4:].mean("time")], "time")
    xr.testing.assert_allclose(client.compute(out).result(), want)


def fail_late(obj):
    if obj.sizes["time"] and str(obj["time"].values[0]).startswith("2001-01-05"):
        raise ValueError("bad values")
    return obj


def test_dataarray_kernel_error_names_the_coordinate_range(client):
    arr = _dataarray()
    out = map_blocks(fail_late, arr, template=arr)
    with pytest.raises(BlockKernelError) as e:
        client.compute(out).result()
    assert str(e.value) == (
        "blockflow kernel 'fail_late' failed on the block at "
        "{time=2001-01-05 00:00:00..2001-01-08 00:00:00, lat=-45.0..45.0}: "
        "ValueError: bad values"
    )


def test_dataset_kernel_error_names_the_coordinate_range(client):
    ds = xr.Dataset({"a": _dataarray()})
    out = map_blocks(fail_late, ds, template=ds)
    with pytest.raises(BlockKernelError) as e:
        client.compute(out).result()
    assert str(e.value).startswith(
        "blockflow kernel 'fail_late' failed on the block at {time=2001-01-05 00:00:00.."
    )
    assert str(e.value).endswith("ValueError: bad values")


# --- bad input -------------------------------------------------------------------------


def test_in_memory_inputs_are_refused_with_the_fix():
    with pytest.raises(TypeError) as e:
        map_blocks(inc, np.ones(3))
    assert str(e.value) == (
        "blockflow.map_blocks: argument 0 is a numpy.ndarray, not a Dask collection; wrap it "
        "with dask.array.from_array(x, chunks=...)."
    )
    with pytest.raises(TypeError) as e:
        map_blocks(inc, pd.DataFrame({"a": [1]}))
    assert str(e.value) == (
        "blockflow.map_blocks: argument 0 is a pandas.DataFrame, not a Dask collection; wrap "
        "it with dask.dataframe.from_pandas(df, npartitions=...)."
    )
    with pytest.raises(TypeError) as e:
        map_blocks(inc, _dataarray().compute())
    assert str(e.value) == (
        "blockflow.map_blocks: argument 0 is a xarray.DataArray, not a Dask collection; chunk "
        "it with obj.chunk(...) so that it is backed by dask."
    )
    with pytest.raises(TypeError) as e:
        map_blocks(inc, da.ones(3, chunks=1), pd.Series([1.0]))
    assert str(e.value) == (
        "blockflow.map_blocks: argument 1 is a pandas.Series, not a Dask collection; wrap it "
        "with dask.dataframe.from_pandas(df, npartitions=...)."
    )


def test_mixed_kinds_and_missing_collection():
    _, ddf = _frame()
    with pytest.raises(TypeError) as e:
        map_blocks(inc, da.ones(3, chunks=1), ddf)
    assert str(e.value) == (
        "blockflow.map_blocks: all inputs must be of one kind, got ['array', 'dataframe']; "
        "convert them first (e.g. xarray_obj.data for its dask array)."
    )
    with pytest.raises(TypeError) as e:
        map_blocks(inc)
    assert str(e.value) == (
        "blockflow.map_blocks: give at least one Dask collection after the kernel."
    )


def test_non_callable_kernel():
    with pytest.raises(TypeError) as e:
        map_blocks(da.ones(3, chunks=1), da.ones(3, chunks=1))
    assert str(e.value) == (
        "blockflow.map_blocks: the kernel must be callable, got dask.Array; call "
        "map_blocks(kernel, *collections)."
    )


def test_unknown_chunk_sizes():
    x = da.arange(10, chunks=4)
    with pytest.raises(ValueError) as e:
        map_blocks(inc, x[x > 3])
    assert str(e.value) == (
        "blockflow.map_blocks: argument 0 has unknown (NaN) chunk sizes along axis 0; call "
        "x = x.compute_chunk_sizes() first so blocks can be placed and sized."
    )


def test_empty_array():
    with pytest.raises(EmptyCollectionError) as e:
        map_blocks(inc, da.ones((0, 3), chunks=2))
    assert str(e.value) == (
        "blockflow.map_blocks: argument 0 is empty (shape (0, 3)); there are no blocks to run on."
    )
    assert isinstance(e.value, ValueError)


def test_mismatched_chunks_and_partitions():
    x = da.ones((3, 4), chunks=(2, 2))
    with pytest.raises(ValueError) as e:
        map_blocks(np.add, x, x.rechunk((3, 2)))
    assert str(e.value) == (
        "blockflow.map_blocks: arguments 0 and 1 have different chunks along axis 0: (2, 1) vs "
        "(3,); rechunk one to match, e.g. y = y.rechunk(x.chunks)."
    )
    _, ddf = _frame()
    with pytest.raises(ValueError) as e:
        map_blocks(lambda a, b: a, ddf, ddf.repartition(npartitions=2))
    assert str(e.value) == (
        "blockflow.map_blocks: arguments 0 and 1 have 3 and 2 partitions; repartition one to "
        "match, e.g. b = b.repartition(npartitions=a.npartitions)."
    )


def test_task_prefix_and_custom_name():
    x = da.ones(4, chunks=2)
    assert map_blocks(inc, x, name="Scale_Up").name.startswith("blockflow-scale-up-")
    assert map_blocks(inc, x, name="blockflow-already").name.startswith("blockflow-already-")
    assert blockflow.blockwise.kernel_name(lambda b: b) == "blockflow-lambda"


# --- the kernel wrapper shared with tree_reduce (blockflow/_kernel.py) ------------------


def flaky(x, *, calls, failures):
    """Raises on its first ``failures`` calls (counted in the list ``calls``), then x + 1."""
    calls.append(x)
    if len(calls) <= failures:
        raise ConnectionResetError(f"flaky call {len(calls)}")
    return x + 1


def _flaky(failures):
    import functools

    return functools.partial(flaky, calls=[], failures=failures)


def test_the_kernel_wrapper_retries_in_place_and_names_the_block(caplog):
    import pickle

    from blockflow.core.kernel import Kernel

    kernel = Kernel(_flaky(2), retries=2)
    assert pickle.loads(pickle.dumps(kernel)).run(lambda: "block (0,)", 1) == 2
    caplog.clear()
    with caplog.at_level("WARNING", logger="blockflow.core.kernel"):
        assert kernel.run(lambda: "block (0,)", 1) == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"blockflow kernel 'flaky' failed on block (0,) (attempt {i} of 3), retrying: "
        f"ConnectionResetError: flaky call {i}" for i in (1, 2)]
    with pytest.raises(BlockKernelError) as info:
        Kernel(_flaky(3), retries=1).run(lambda: "partition 7", 1)
    assert str(info.value) == ("blockflow kernel 'flaky' failed on partition 7 after 2 "
                               "attempts: ConnectionResetError: flaky call 2")
    assert isinstance(info.value.__cause__, ConnectionResetError)
    with pytest.raises(BlockKernelError) as info:
        Kernel(_flaky(1), step="combine").run(lambda: "a tree_reduce combine step", 1)
    assert str(info.value) == ("blockflow tree_reduce: combine function 'flaky' failed: "
                               "ConnectionResetError: flaky call 1")


def test_map_blocks_and_tree_reduce_run_kernels_through_one_wrapper(monkeypatch):
    from blockflow.core.kernel import Kernel

    ran, real = [], Kernel.run

    def run(self, where, *args, **kwargs):
        ran.append((type(self).__module__, where(), self.retries))
        return real(self, where, *args, **kwargs)

    monkeypatch.setattr(Kernel, "run", run)
    x = map_blocks(np.negative, da.ones(8, chunks=4), retries=1)
    out = blockflow.tree_reduce(x, np.sum, split_every=2, retries=2)
    assert out.compute(scheduler="sync") == -8
    assert sorted(set(ran)) == [
        ("blockflow.block_kernels", "block (0,)", 1), ("blockflow.block_kernels", "block (1,)", 1),
        ("blockflow.reduction", "a tree_reduce aggregate step", 2),
        ("blockflow.reduction", "a tree_reduce chunk step", 2)]


# --- one call per block: drop_axis, new_axis, broadcasting, xarray extras (issue 10) ---------


def _sync_compute(collection):
    with dask.config.set(scheduler="sync"):
        return collection.compute()


def record_block_sum(b, block_id=None):
    if b.size:
        _see(block_id)
    return b.sum(axis=0)


DROP_REFUSED = "Dask would join them into one kernel call, but map_blocks runs one call per " \
               "block. Rechunk that axis to one block first (x = x.rechunk({{{a}: -1}})) or " \
               "reduce along it with blockflow.tree_reduce."


@pytest.mark.parametrize(
    "shape, chunks, drop_axis, head",
    [
        ((6, 4), (2, 4), 0, "drop_axis=0 drops axis 0, along which argument 0 has 3 blocks "
                            "(2, 2, 2)"),
        ((6, 4), (2, 4), -2, "drop_axis=-2 drops axis 0, along which argument 0 has 3 blocks "
                             "(2, 2, 2)"),
        ((6, 4), (6, 3), -1, "drop_axis=-1 drops axis 1, along which argument 0 has 2 blocks "
                             "(3, 1)"),
        ((6, 4), (6, 3), (0, 1), "drop_axis=(0, 1) drops axis 1, along which argument 0 has 2 "
                                 "blocks (3, 1)"),
        ((6, 4), (2, 2), [1, 0], "drop_axis=[1, 0] drops axis 0, along which argument 0 has 3 "
                                 "blocks (2, 2, 2)"),
        ((2, 6, 4), (2, 6, 2), np.int64(2), "drop_axis=np.int64(2) drops axis 2, along which "
                                            "argument 0 has 2 blocks (2, 2)"),
    ],
    ids=["int", "negative", "negative-last", "tuple", "list", "numpy-int"],
)
def test_drop_axis_split_into_blocks_is_refused(shape, chunks, drop_axis, head):
    """The issue: drop_axis=0 over 3 blocks ran the kernel once on all three, joined."""
    x = da.ones(shape, chunks=chunks)
    a = int(head.split("drops axis ")[1][0])
    with pytest.raises(ValueError) as e:
        map_blocks(record_block_sum, x, drop_axis=drop_axis)
    assert str(e.value) == f"blockflow.map_blocks: {head}; " + DROP_REFUSED.format(a=a)
    assert SEEN == []


def test_drop_axis_of_a_broadcast_argument_names_its_own_axis():
    x, y = da.ones((4, 6), chunks=(4, 3)), da.ones(6, chunks=3)
    with pytest.raises(ValueError) as e:
        map_blocks(lambda p, q: p.sum(axis=1) + q.sum(), x, y, drop_axis=1)
    assert str(e.value) == (
        "blockflow.map_blocks: drop_axis=1 drops axis 1, along which argument 0 has 2 blocks "
        "(3, 3); " + DROP_REFUSED.format(a=1))
    # argument 0 broadcasts along axis 1 (length 1); argument 1 is split along it
    with pytest.raises(ValueError) as e:
        map_blocks(lambda p, q: p.sum(axis=1) + q.sum(), da.ones((4, 1), chunks=(2, 1)), y,
                   drop_axis=-1)
    assert str(e.value) == (
        "blockflow.map_blocks: drop_axis=-1 drops axis 1 (its axis 0), along which argument 1 "
        "has 2 blocks (3, 3); " + DROP_REFUSED.format(a=0))


def test_drop_axis_split_in_a_lower_dimensional_argument():
    x = da.ones((4, 6), chunks=(2, 6))
    y = da.ones(6, chunks=2)  # axis 0 of y is axis 1 of the output
    with pytest.raises(ValueError) as e:
        map_blocks(lambda p, q: p.sum(axis=1), x, y.rechunk(6).rechunk(2), drop_axis=1)
    assert str(e.value) == (
        "blockflow.map_blocks: arguments 0 and 1 have different chunks along axis 1 of the "
        "output (axis 1 of argument 0, axis 0 of argument 1; axes align from the right, as in "
        "NumPy broadcasting): (6,) vs (2, 2, 2); rechunk one to match, e.g. "
        "y = y.rechunk({0: x.chunks[1]}).")
    x = da.ones((1, 6), chunks=(1, 2))
    with pytest.raises(ValueError) as e:
        map_blocks(lambda p, q: p.sum(axis=1), x, y, drop_axis=1)
    assert str(e.value) == (
        "blockflow.map_blocks: drop_axis=1 drops axis 1, along which argument 0 has 3 blocks "
        "(2, 2, 2); " + DROP_REFUSED.format(a=1))
    with pytest.raises(ValueError) as e:
        map_blocks(lambda p, q: p.sum(axis=1), da.ones((1, 6), chunks=(1, 6)),
                   da.ones(6, chunks=2).rechunk(6), da.ones(6, chunks=2), drop_axis=1)
    assert str(e.value).startswith("blockflow.map_blocks: arguments 0 and 2 have different "
                                   "chunks along axis 1 of the output")


@pytest.mark.parametrize(
    "drop_axis, new_axis, error, message",
    [
        (2, None, ValueError, "blockflow.map_blocks: drop_axis=2 is out of range for the 2-d "
                              "input; give axes from -2 to 1."),
        ((0, -2), None, ValueError, "blockflow.map_blocks: drop_axis=(0, -2) names an axis "
                                    "more than once; give each axis once."),
        ("0", None, TypeError, "blockflow.map_blocks: drop_axis= must be an int or a sequence "
                               "of ints, got '0'; e.g. drop_axis=0 or drop_axis=(0, 1)."),
        (1.0, None, TypeError, "blockflow.map_blocks: drop_axis= must be an int or a sequence "
                               "of ints, got 1.0; e.g. drop_axis=0 or drop_axis=(0, 1)."),
        (None, -4, ValueError, "blockflow.map_blocks: new_axis=-4 is out of range for the 3-d "
                               "output; give axes from -3 to 2."),
        (None, [0, 4], ValueError, "blockflow.map_blocks: new_axis=[0, 4] is out of range for "
                                   "the 4-d output; give axes from -4 to 3."),
        (None, [1, -3], ValueError, "blockflow.map_blocks: new_axis=[1, -3] names an axis more "
                                    "than once; give each axis once."),
        (None, "x", TypeError, "blockflow.map_blocks: new_axis= must be an int or a sequence of "
                               "ints, got 'x'; e.g. new_axis=0 or new_axis=(0, 1)."),
    ],
    ids=["drop-out-of-range", "drop-twice", "drop-str", "drop-float", "new-out-of-range",
         "new-list-out-of-range", "new-twice", "new-str"],
)
def test_bad_axes_are_refused(drop_axis, new_axis, error, message):
    x = da.ones((6, 4), chunks=(6, 4))
    with pytest.raises(error) as e:
        map_blocks(inc, x, drop_axis=drop_axis, new_axis=new_axis)
    assert str(e.value) == message


def test_new_axis_split_into_blocks_is_refused():
    x = da.zeros(4, chunks=2)
    with pytest.raises(ValueError) as e:
        map_blocks(lambda b: np.repeat(b[:, None], 3, axis=1), x, new_axis=1,
                   chunks=((2, 2), (3, 3)))
    assert str(e.value) == (
        "blockflow.map_blocks: chunks= splits new axis 1 into 2 blocks (3, 3), so the kernel "
        "would run 2 times on each input block, but map_blocks runs one call per block. Give "
        "the new axis one block (chunks (6,) along it) and rechunk the result afterwards if "
        "needed (y = y.rechunk({1: 3})).")
    with pytest.raises(ValueError) as e:  # new axes inferred from chunks= (Dask's rule)
        map_blocks(lambda b: b[None], x, chunks=((1, 1), (2, 2)))
    assert str(e.value).startswith(
        "blockflow.map_blocks: chunks= splits new axis 0 into 2 blocks (1, 1), so the kernel "
        "would run 2 times on each input block")


def test_one_block_dropped_and_new_axes_equal_numpy_one_call_per_block():
    a = np.arange(6 * 4, dtype="f8").reshape(6, 4)
    # the fix the message gives: one block along the dropped axis
    x = da.from_array(a, chunks=(2, 2)).rechunk({0: -1})
    y = map_blocks(record_block_sum, x, drop_axis=0, dtype="f8")
    assert y.chunks == ((2, 2),)
    np.testing.assert_array_equal(_sync_compute(y), a.sum(axis=0))
    assert sorted(SEEN) == [(0,), (1,)]
    SEEN.clear()
    # negative drop_axis; a tuple dropping every axis of a one-block array gives a 0-d result
    x = da.from_array(a, chunks=(2, 4))
    y = map_blocks(lambda b: b.sum(axis=1), x, drop_axis=-1, dtype="f8")
    np.testing.assert_array_equal(_sync_compute(y), a.sum(axis=1))
    total = map_blocks(lambda b: np.asarray(b.sum()), da.from_array(a, chunks=(6, 4)),
                       drop_axis=(0, -1), dtype="f8")
    assert total.ndim == 0 and _sync_compute(total) == a.sum() == 276.0
    # drop_axis and new_axis together: replace axis 1 (one block) by an axis of length 3
    y = map_blocks(lambda b: np.repeat(b.sum(axis=1, keepdims=True), 3, axis=1), x,
                   drop_axis=1, new_axis=1, chunks=((2, 2, 2), (3,)), dtype="f8")
    np.testing.assert_array_equal(_sync_compute(y), np.repeat(a.sum(1, keepdims=True), 3, 1))
    # a negative new_axis counts from the end of the output (Dask inserts it one too early)
    y = map_blocks(lambda b: b[..., None], x, new_axis=-1, dtype="f8")
    assert y.shape == (6, 4, 1) and y.chunks == ((2, 2, 2), (4,), (1,))
    np.testing.assert_array_equal(_sync_compute(y), a[..., None])
    y = map_blocks(lambda b: b[None], x, new_axis=[-3], dtype="f8")
    assert y.chunks == ((1,), (2, 2, 2), (4,))
    np.testing.assert_array_equal(_sync_compute(y), a[None])
    y = map_blocks(lambda b: b[None, ..., None], x, new_axis=[0, -1], dtype="f8")
    assert y.chunks == ((1,), (2, 2, 2), (4,), (1,))
    np.testing.assert_array_equal(_sync_compute(y), a[None, ..., None])


def test_broadcast_arrays_pair_their_blocks():
    a, b = np.arange(24.0).reshape(6, 4), np.arange(4.0) * 100
    x = da.from_array(a, chunks=(2, 2))
    # lower-dimensional argument chunked like the trailing axis
    y = map_blocks(np.add, x, da.from_array(b, chunks=2))
    assert y.chunks == x.chunks
    np.testing.assert_array_equal(_sync_compute(y), a + b)
    # an axis of length 1 broadcasts (its one block goes with every block)
    y = map_blocks(np.add, x, da.from_array(b[None, :], chunks=(1, 2)))
    np.testing.assert_array_equal(_sync_compute(y), a + b)
    y = map_blocks(np.add, da.from_array(b[None, :], chunks=(1, 2)), x)
    assert y.chunks == x.chunks
    np.testing.assert_array_equal(_sync_compute(y), a + b)


@pytest.mark.parametrize("bchunks", [(1, 1, 1, 1), (3, 1), (4,)])
def test_broadcast_arrays_with_other_chunks_are_refused(bchunks):
    x = da.ones((6, 4), chunks=(2, 2))
    with pytest.raises(ValueError) as e:
        map_blocks(np.add, x, da.ones(4, chunks=bchunks))
    assert str(e.value) == (
        f"blockflow.map_blocks: arguments 0 and 1 have different chunks along axis 1 of the "
        f"output (axis 1 of argument 0, axis 0 of argument 1; axes align from the right, as "
        f"in NumPy broadcasting): (2, 2) vs {bchunks}; rechunk one to match, e.g. "
        f"y = y.rechunk({{0: x.chunks[1]}}).")


@settings_fast
@given(data=st.data())
def test_broadcast_and_dropped_axes_any_chunking_equal_numpy(data):
    rows, cols = data.draw(st.integers(1, 8)), data.draw(st.integers(2, 8))
    rchunks, cchunks = data.draw(chunks_for(rows)), data.draw(chunks_for(cols))
    a = np.arange(rows * cols, dtype="f8").reshape(rows, cols)
    b = np.arange(cols, dtype="f8") * 1000
    x, y = da.from_array(a, (rchunks, cchunks)), da.from_array(b, (cchunks,))
    out = map_blocks(np.add, x, y)
    assert out.chunks == x.chunks
    np.testing.assert_array_equal(_sync_compute(out), a + b)
    if len(rchunks) > 1:
        with pytest.raises(ValueError, match="drop_axis=0 drops axis 0"):
            map_blocks(lambda p, q: p.sum(axis=0) + q, x, y, drop_axis=0)
    summed = map_blocks(lambda p, q: p.sum(axis=0) + q, x.rechunk({0: -1}), y, drop_axis=0)
    assert summed.chunks == (cchunks,)
    np.testing.assert_array_equal(_sync_compute(summed), a.sum(axis=0) + b)


# xarray: every argument is split like argument 0


def _field():
    return xr.DataArray(np.arange(24.0).reshape(6, 4), dims=("x", "y"),
                        coords={"x": np.arange(6), "y": [10, 20, 30, 40]},
                        name="field").chunk({"x": 2, "y": 2})


def _offsets():
    return xr.DataArray(np.arange(6.0) * 100, dims="x", coords={"x": np.arange(6)},
                        name="offsets")


def add_blocks(a, b):
    return a + b


def add_var(a, ds):
    return a + ds["offsets"]


def add_member_sum(a, b):
    return a + b.sum("member")


@pytest.mark.parametrize(
    "extra, kernel, message",
    [
        (_offsets().chunk({"x": 3}), add_blocks,
         "blockflow.map_blocks: arguments 0 and 1 have different chunks along dimension 'x': "
         "(2, 2, 2) vs (3, 3); chunk one to match, e.g. y = y.chunk({'x': (2, 2, 2)})."),
        (_offsets().chunk({"x": 3}).to_dataset(), add_var,
         "blockflow.map_blocks: arguments 0 and 1 have different chunks along dimension 'x': "
         "(2, 2, 2) vs (3, 3); chunk one to match, e.g. y = y.chunk({'x': (2, 2, 2)})."),
        (xr.DataArray(np.ones((6, 4)), dims=("x", "y")).chunk({"x": 2, "y": 4}), add_blocks,
         "blockflow.map_blocks: arguments 0 and 1 have different chunks along dimension 'y': "
         "(2, 2) vs (4,); chunk one to match, e.g. y = y.chunk({'y': (2, 2)})."),
        (xr.DataArray(np.ones((3, 6)), dims=("member", "x"),
                      coords={"x": np.arange(6)}).chunk({"member": 1, "x": 2}), add_member_sum,
         "blockflow.map_blocks: arguments 0 and 1 have different chunks along dimension "
         "'member': one block (argument 0 does not have that dimension) vs (1, 1, 1); xarray "
         "would hand each call only one of those blocks. Put it in one block, e.g. "
         "y = y.chunk({'member': -1})."),
    ],
    ids=["dataarray", "dataset", "second-dim", "dim-argument-0-lacks"],
)
def test_xarray_extra_with_other_chunks_is_refused(extra, kernel, message):
    """The issue: field + offsets with other chunks gave one block's offset everywhere."""
    with pytest.raises(ValueError) as e:
        map_blocks(kernel, _field(), extra)
    assert str(e.value) == message
    with pytest.raises(ValueError) as e:  # the same with a Dataset as argument 0
        map_blocks(kernel, _field().to_dataset(), extra)
    assert str(e.value) == message


def test_xarray_dataset_argument_0_held_in_memory_along_a_dim_is_one_block():
    ds = xr.Dataset({"a": _field(), "w": ("z", np.arange(3.0))})
    with pytest.raises(ValueError) as e:
        map_blocks(lambda d, w: d, ds, xr.DataArray(np.ones(3), dims="z").chunk(1))
    assert str(e.value) == (
        "blockflow.map_blocks: arguments 0 and 1 have different chunks along dimension 'z': "
        "(3,) vs (1, 1, 1); chunk one to match, e.g. y = y.chunk({'z': (3,)}).")


def test_xarray_with_a_dask_array_extra_is_refused():
    with pytest.raises(TypeError) as e:
        map_blocks(add_blocks, _field(), da.ones(4, chunks=2))
    assert str(e.value) == (
        "blockflow.map_blocks: all inputs must be of one kind, got ['xarray', 'array']; "
        "convert them first (e.g. xarray_obj.data for its dask array).")


def record_add(a, b):
    if a.size:
        _see((int(a["x"][0]), int(a["y"][0])))
    return a + b


def test_xarray_extras_chunked_like_argument_0_equal_xarray_whole():
    field, offsets = _field(), _offsets()
    want = (field + offsets).compute()
    # the fix the message gives, for a DataArray and for a Dataset extra
    aligned = offsets.chunk({"x": (2, 2, 2)})
    got = _sync_compute(map_blocks(record_add, field, aligned))
    xr.testing.assert_identical(got, want)
    np.testing.assert_array_equal(got.values,
                                  np.arange(24.0).reshape(6, 4) + np.arange(6.0)[:, None] * 100)
    assert sorted(SEEN) == [(x, y) for x in (0, 2, 4) for y in (10, 30)]  # one call per block
    out = map_blocks(add_var, field, aligned.to_dataset())
    xr.testing.assert_identical(_sync_compute(out), want)
    # a dimension argument 0 lacks, in one block
    member = xr.DataArray(np.arange(18.0).reshape(3, 6), dims=("member", "x"),
                          coords={"x": np.arange(6)})
    out = map_blocks(add_member_sum, field, member.chunk({"member": -1, "x": 2}))
    xr.testing.assert_identical(_sync_compute(out), (field + member.sum("member")).compute())


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: map_blocks(inc, da.ones(4, chunks=2), template=da.ones(4, chunks=2)),
         "blockflow.map_blocks: template= is not used for dask array inputs; declare the "
         "output with dtype=, meta=, chunks=, drop_axis= or new_axis= instead."),
        (lambda: map_blocks(inc, _frame()[1], dtype="f8", chunks=(2,)),
         "blockflow.map_blocks: dtype=, chunks= are not used for dataframe inputs; declare "
         "the output with meta= instead."),
        (lambda: map_blocks(inc, _field(), drop_axis=0),
         "blockflow.map_blocks: drop_axis= is not used for xarray inputs; declare the output "
         "with template= instead."),
        (lambda: map_blocks(inc, _field(), meta=np.array(())),
         "blockflow.map_blocks: meta= is not used for xarray inputs; declare the output with "
         "template= instead."),
    ],
    ids=["template-for-arrays", "dtype-for-frames", "drop-axis-for-xarray", "meta-for-xarray"],
)
def test_declarations_of_another_kind_are_refused_not_ignored(make, message):
    with pytest.raises(TypeError) as e:
        make()
    assert str(e.value) == message


# --- output inference: the kernel runs once at most in the client (issue 39) ---------------


class _Counting:
    """A kernel counting the calls made while the graph is built (no cluster: none run)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0
        self.__name__ = "counting"

    def __call__(self, *blocks, **kwargs):
        self.calls += 1
        return self.fn(*blocks, **kwargs)


def _with_block_id(b, block_id=None):
    return b * 2


def _with_block_info(b, block_info=None):
    return b * 2


@pytest.mark.parametrize("fn", [lambda b: b * 2, _with_block_id, _with_block_info],
                         ids=["plain", "block_id", "block_info"])
@pytest.mark.parametrize("declared, calls", [({}, 1), ({"dtype": "f8"}, 0),
                                              ({"meta": np.empty((0, 0))}, 0)],
                         ids=["inferred", "dtype", "meta"])
def test_array_output_is_inferred_with_one_kernel_call_at_most(fn, declared, calls):
    # Dask's map_blocks calls a kernel twice without dtype= (meta, then dtype), and twice with
    # dtype= alone when the kernel takes block_id: with a 1 s kernel, 2 s before submitting
    kernel = _Counting(fn)
    x = da.ones((6, 4), chunks=(3, 2), dtype="f8")
    y = map_blocks(kernel, x, **declared)
    assert kernel.calls == calls
    assert (y.dtype, y.ndim, type(y._meta)) == (np.dtype("f8"), 2, np.ndarray)
    np.testing.assert_array_equal(y.compute(scheduler="sync"), np.full((6, 4), 2.0))


def test_array_dtype_inference_falls_back_to_a_one_element_block():
    # a kernel that refuses empty blocks: its one-element block gives the dtype, as in Dask
    def refuses_empty(b):
        if b.size == 0:
            raise ValueError("no data")
        return (b * 2).astype("i4")

    kernel = _Counting(refuses_empty)
    y = map_blocks(kernel, da.ones(6, chunks=3))
    assert kernel.calls == 2 and y.dtype == np.dtype("i4") and y._meta.ndim == 1
    np.testing.assert_array_equal(y.compute(scheduler="sync"), np.full(6, 2, "i4"))


@pytest.mark.parametrize("declared, calls", [({}, 1), ("meta", 0)])
def test_dataframe_output_is_inferred_with_one_kernel_call_at_most(declared, calls):
    df = dd.from_pandas(pd.DataFrame({"a": np.arange(6.0)}), npartitions=2)
    kernel = _Counting(lambda p: p + 1)
    map_blocks(kernel, df, **({"meta": df._meta} if declared == "meta" else declared))
    assert kernel.calls == calls


def test_dataarray_output_is_inferred_with_one_kernel_call_at_most():
    a = xr.DataArray(da.ones((4, 4), chunks=2), dims=("x", "y"))
    kernel = _Counting(lambda b: b * 2)
    map_blocks(kernel, a)
    assert kernel.calls == 1
    kernel.calls = 0
    map_blocks(kernel, a, template=a)
    assert kernel.calls == 0


def test_tree_reduce_runs_each_step_once_to_infer_its_output():
    steps = {s: _Counting(lambda b, axis=None, keepdims=False: b.sum(axis=axis,
                                                                     keepdims=keepdims))
             for s in ("chunk", "combine", "aggregate")}
    x = da.ones((6, 4), chunks=(3, 2))
    out = blockflow.tree_reduce(x, steps["chunk"], steps["combine"], steps["aggregate"])
    assert {s: k.calls for s, k in steps.items()} == {"chunk": 1, "combine": 1,
                                                      "aggregate": 1}
    assert float(out.compute(scheduler="sync")) == 24.0
