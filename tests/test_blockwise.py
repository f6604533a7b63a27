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

    from blockflow._kernel import Kernel

    kernel = Kernel(_flaky(2), retries=2)
    assert pickle.loads(pickle.dumps(kernel)).run(lambda: "block (0,)", 1) == 2
    caplog.clear()
    with caplog.at_level("WARNING", logger="blockflow._kernel"):
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
    from blockflow._kernel import Kernel

    ran, real = [], Kernel.run

    def run(self, where, *args, **kwargs):
        ran.append((type(self).__module__, where(), self.retries))
        return real(self, where, *args, **kwargs)

    monkeypatch.setattr(Kernel, "run", run)
    x = map_blocks(np.negative, da.ones(8, chunks=4), retries=1)
    out = blockflow.tree_reduce(x, np.sum, split_every=2, retries=2)
    assert out.compute(scheduler="sync") == -8
    assert sorted(set(ran)) == [
        ("blockflow.blockwise", "block (0,)", 1), ("blockflow.blockwise", "block (1,)", 1),
        ("blockflow.reduction", "a tree_reduce aggregate step", 2),
        ("blockflow.reduction", "a tree_reduce chunk step", 2)]
