"""Backends: NumPy/CuPy and pandas/cuDF dispatch, moving collections to and from the device.

CPU first: the CuPy/cuDF parametrisations skip with a reason where there is no GPU or the
package is missing; the GPU-missing errors are checked where the package is absent.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
import xarray as xr

from blockflow import GPUUnavailableError, array_module, dataframe_module, to_device, to_host
from blockflow.backends import _block_to_host, gpu_device_count, has_package, is_device_block

_NO_GPU = gpu_device_count() == 0
requires_cupy = [
    pytest.mark.gpu,
    pytest.mark.skipif(not has_package("cupy") or _NO_GPU,
                       reason="needs an NVIDIA GPU and CuPy (pip install 'blockflow[gpu]')"),
]
requires_cudf = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (has_package("cudf") and has_package("dask_cudf")) or _NO_GPU,
                       reason="needs an NVIDIA GPU, cuDF and dask-cudf "
                              "(pip install 'blockflow[gpu]')"),
]

GPU_MESSAGE = (
    "blockflow.to_device needs the package {!r}, which is not installed. Install blockflow's "
    'GPU extra: pip install "blockflow[gpu]"'
)


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=requires_cupy)])
def xp(request):
    return pytest.importorskip(request.param)


@pytest.fixture(params=["pandas", pytest.param("cudf", marks=requires_cudf)])
def xdf(request):
    return pytest.importorskip(request.param)


def _to_numpy(a):
    return a.get() if is_device_block(a) else np.asarray(a)


def _to_pandas(df):
    return df.to_pandas() if is_device_block(df) else df


# --- dispatch ------------------------------------------------------------------------------


def test_array_module_dispatch(xp):
    assert array_module(xp.ones((2, 3))) is xp
    assert array_module(xp.ones(())) is xp


@pytest.mark.parametrize("scalar", [3, 2.5, 1j, True, [1, 2], (1,), np.float32(1), np.int64(2)])
def test_array_module_of_python_and_numpy_scalars_is_numpy(scalar):
    assert array_module(scalar) is np


def test_dataframe_module_dispatch(xdf):
    frame = xdf.DataFrame({"a": [1, 2], "b": [0.5, 1.5]})
    assert dataframe_module(frame) is xdf
    assert dataframe_module(frame["a"]) is xdf
    assert dataframe_module(frame.index) is xdf


def test_dispatch_refuses_the_wrong_kind():
    with pytest.raises(TypeError, match="No dispatch for <class 'pandas.*Series'>"):
        array_module(pd.Series([1.0]))
    with pytest.raises(TypeError, match="No dispatch for <class 'numpy.ndarray'>"):
        dataframe_module(np.ones(2))


def test_is_device_block_on_host_data():
    for block in (np.ones(2), pd.DataFrame({"a": [1]}), pd.Series([1.0]), 3.0):
        assert not is_device_block(block)


@pytest.mark.slow
def test_importing_blockflow_imports_no_gpu_package():
    code = textwrap.dedent(
        """
        import sys
        import numpy as np, pandas as pd, dask.array as da
        import blockflow
        import blockflow.workloads.array_stats
        blockflow.array_module(np.ones(2))
        blockflow.dataframe_module(pd.DataFrame({"a": [1]}))
        blockflow.to_host(da.ones(4, chunks=2)).compute()
        gpu = sorted(m for m in sys.modules
                     if m.split(".")[0] in ("cupy", "cudf", "dask_cuda", "dask_cudf", "rmm"))
        assert not gpu, gpu
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


# --- to_host on host collections: values, metadata and blocks unchanged ----------------------


def test_to_host_on_numpy_backed_array():
    a = np.arange(24, dtype="i2").reshape(4, 6)
    x = da.from_array(a, chunks=(2, 4))
    h = to_host(x)
    assert isinstance(h, da.Array)
    assert h.dtype == x.dtype and h.chunks == x.chunks and type(h._meta) is np.ndarray
    np.testing.assert_array_equal(h.compute(scheduler="sync"), a)
    block = np.ones((2, 2))
    assert _block_to_host(block) is block  # host blocks pass through, no copy


def test_to_host_on_pandas_backed_frame():
    pdf = pd.DataFrame({"a": np.arange(9), "b": list("abcdefghi")},
                       index=pd.RangeIndex(9, name="i"))
    ddf = dd.from_pandas(pdf, npartitions=3)
    h = to_host(ddf)
    assert isinstance(h, dd.DataFrame)
    assert h.npartitions == 3 and h.divisions == ddf.divisions
    pd.testing.assert_series_equal(h.dtypes, ddf.dtypes)
    # against dask's own result: from_pandas converts str columns to pyarrow strings
    pd.testing.assert_frame_equal(h.compute(scheduler="sync"), ddf.compute(scheduler="sync"))
    pd.testing.assert_frame_equal(h.compute(scheduler="sync"), pdf, check_dtype=False)
    s = to_host(ddf["a"])
    assert isinstance(s, dd.Series)
    pd.testing.assert_series_equal(s.compute(scheduler="sync"), pdf["a"])


def _dataarray():
    return xr.DataArray(
        np.arange(12.0).reshape(4, 3), dims=("time", "lat"),
        coords={"time": pd.date_range("2001-01-01", periods=4),
                "lat": ("lat", [-30.0, 0.0, 30.0], {"units": "degrees_north"}),
                "zone": ("lat", ["s", "e", "n"])},
        name="t2m", attrs={"units": "K"},
    ).chunk({"time": 2})


def test_to_host_on_xarray():
    arr = _dataarray()
    h = to_host(arr)
    assert isinstance(h, xr.DataArray) and h.chunks == arr.chunks
    xr.testing.assert_identical(h.compute(scheduler="sync"), arr.compute())
    ds = xr.Dataset({"a": arr, "b": arr * 2, "static": ("lat", np.ones(3))},
                    attrs={"title": "t"})
    hd = to_host(ds)
    assert isinstance(hd, xr.Dataset) and hd.chunks == ds.chunks
    xr.testing.assert_identical(hd.compute(scheduler="sync"), ds.compute())


def test_to_host_on_host_collections_returns_them_unchanged():
    x = da.ones((4, 4), chunks=2)
    assert to_host(x) is x


def test_to_host_keeps_dask_backed_coordinates_lazy():
    arr = _dataarray()
    assert isinstance(arr["zone"].data, da.Array)  # .chunk() chunks non-index coords too
    h = to_host(arr)
    # host blocks already: the same dask arrays come back, coordinates included
    assert h.data is arr.data
    assert h["zone"].data is arr["zone"].data


# --- to_device without a GPU stack: exact errors --------------------------------------------


@pytest.mark.skipif(has_package("cupy"), reason="CuPy is installed")
def test_to_device_array_without_cupy():
    for collection in (da.ones(4, chunks=2), _dataarray(), _dataarray().to_dataset()):
        with pytest.raises(GPUUnavailableError) as e:
            to_device(collection)
        assert str(e.value) == GPU_MESSAGE.format("cupy")
        assert isinstance(e.value, RuntimeError)


@pytest.mark.skipif(has_package("cudf"), reason="cuDF is installed")
def test_to_device_frame_without_cudf():
    ddf = dd.from_pandas(pd.DataFrame({"a": [1, 2]}), npartitions=1)
    for collection in (ddf, ddf["a"]):
        with pytest.raises(GPUUnavailableError) as e:
            to_device(collection)
        assert str(e.value) == GPU_MESSAGE.format("cudf")


@pytest.mark.parametrize("move", [to_device, to_host])
@pytest.mark.parametrize(
    "obj, shown",
    [
        (np.ones(3), "numpy.ndarray"),
        (pd.DataFrame({"a": [1]}), f"{pd.DataFrame.__module__}.DataFrame"),  # pandas 2 vs 3
        ([1, 2], "builtins.list"),
    ],
)
def test_moving_in_memory_data_is_refused(move, obj, shown):
    with pytest.raises(TypeError) as e:
        move(obj)
    assert str(e.value) == (
        f"Expected a dask.array.Array, dask.dataframe.DataFrame/Series or an xarray object "
        f"backed by dask, got {shown}. Wrap in-memory data first, e.g. "
        f"dask.array.from_array(x, chunks=...) or dask.dataframe.from_pandas(df, "
        f"npartitions=...)."
    )


def test_moving_in_memory_xarray_is_refused():
    with pytest.raises(TypeError):
        to_device(_dataarray().compute())


# --- round trips on a GPU ---------------------------------------------------------------------


def test_array_round_trip(xp):
    a = np.arange(12.0).reshape(3, 4)
    x = da.from_array(a, chunks=2)
    d = to_device(x) if xp is not np else x
    assert array_module(d._meta) is xp
    assert array_module(d.blocks[0, 0].compute(scheduler="sync")) is xp
    h = to_host(d)
    assert type(h._meta) is np.ndarray
    back = h.compute(scheduler="sync")
    assert type(back) is np.ndarray
    np.testing.assert_array_equal(_to_numpy(back), a)


def test_frame_round_trip(xdf):
    pdf = pd.DataFrame({"a": np.arange(6), "b": np.arange(6.0)})
    ddf = dd.from_pandas(pdf, npartitions=2)
    d = to_device(ddf) if xdf is not pd else ddf
    assert dataframe_module(d._meta) is xdf
    h = to_host(d)
    assert dataframe_module(h._meta) is pd
    pd.testing.assert_frame_equal(_to_pandas(h.compute(scheduler="sync")), pdf)
