"""GPU tests: real NVIDIA GPUs with CuPy (and dask-cuda / cuDF where a test says so).

The whole module skips on machines without CuPy or without a visible GPU, with a reason
that says which. Device counting goes through :func:`blockflow.backends.gpu_device_count`,
which returns 0 instead of raising when NVML or the CUDA runtime is missing.

Run on a GPU machine with ``pytest -m gpu tests/test_gpu.py``.
"""

from __future__ import annotations


import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from loadaware import wait_until

import blockflow
from blockflow.scheduling.view import workers_info
from blockflow.backends import gpu_device_count, has_package, is_device_block

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip(
    "cupy", reason="GPU tests need CuPy (pip install 'blockflow[gpu]') and an NVIDIA GPU"
)
if gpu_device_count() == 0:
    pytest.skip(
        "GPU tests need an NVIDIA GPU: NVML and the CUDA runtime report 0 devices",
        allow_module_level=True,
    )

xr = pytest.importorskip("xarray")

# Unit tests compute with the threaded scheduler in this process, so that they do not depend
# on a cluster (the cluster tests below use one explicitly).
LOCAL = {"scheduler": "threads"}


def to_numpy(x):
    """A NumPy copy of a NumPy or CuPy array (or scalar)."""
    return cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else np.asarray(x)


def backend_kernel(block):
    """A backend-generic blockwise kernel: the same code runs on NumPy and CuPy blocks."""
    xp = blockflow.array_module(block)
    return xp.tanh(block) * 2 + xp.sqrt(xp.abs(block))


def offset_kernel(block, block_id=None):
    """A kernel that uses its block index (passed through on GPU blocks too)."""
    if block_id is None:  # Dask's metadata inference on an empty block
        return block
    xp = blockflow.array_module(block)
    return block + xp.asarray(block_id[0] * 1000 + block_id[1], dtype=block.dtype)


def sum_f64(block, axis=None, keepdims=False):
    xp = blockflow.array_module(block)
    return xp.sum(block, axis=axis, keepdims=keepdims, dtype=xp.float64)


@pytest.fixture(autouse=True)
def _blocks_as_cut(request):
    """Unit tests check moves and kernels on the blocks they cut (some by block index): while
    the module's CUDA cluster is the default client, ``to_device`` would grow those blocks to
    the GPU workers' size, so GPU block sizing is off there (a target of one byte); the
    cluster tests size blocks."""
    if "gpu_client" in request.fixturenames:
        yield
        return
    with dask.config.set({"blockflow.blocks.device-max-fraction": 1e-12}):
        yield


@pytest.fixture
def host_array():
    rng = np.random.default_rng(42)
    x = rng.normal(size=(1000, 300))
    return x, da.from_array(x, chunks=(250, 100))


# --- dispatch ---------------------------------------------------------------------------


def test_array_module_is_cupy_for_cupy_blocks():
    assert blockflow.array_module(cupy.zeros((2, 3))) is cupy
    assert blockflow.array_module(cupy.zeros(())) is cupy
    assert blockflow.array_module(cupy.float32(1) + cupy.zeros(1)) is cupy
    assert blockflow.array_module(np.zeros(3)) is np
    assert is_device_block(cupy.zeros(1)) and not is_device_block(np.zeros(1))


def _is_cupy_block(block):
    xp = blockflow.array_module(block)
    return xp.full((1, 1), xp is cupy, dtype=bool)


def test_array_module_inside_a_dask_task(host_array):
    _, x = host_array
    seen = blockflow.map_blocks(_is_cupy_block, blockflow.to_device(x), chunks=(1, 1),
                                dtype=bool).compute(**LOCAL)
    assert isinstance(seen, cupy.ndarray) and seen.shape == (4, 3) and bool(seen.all())


# --- moving collections -----------------------------------------------------------------


def _frame():
    return pd.DataFrame({
        "a": np.arange(30, dtype="int64"),
        "b": np.linspace(0.0, 1.0, 30),
        "c": pd.Series(list("xyz") * 10, dtype="str"),
    })


@pytest.mark.parametrize("kind", [
    "array",
    "xarray-dataarray",
    "xarray-dataset",
    pytest.param("dataframe", marks=pytest.mark.skipif(
        not (has_package("cudf") and has_package("dask_cudf")),
        reason="needs cuDF and dask-cudf (pip install 'blockflow[gpu]')",
    )),
])
def test_to_device_to_host_round_trip(kind, host_array):
    x_np, x = host_array
    if kind == "array":
        dev = blockflow.to_device(x)
        assert isinstance(dev._meta, cupy.ndarray) and dev.chunks == x.chunks
        assert isinstance(dev.blocks[0, 0].compute(**LOCAL), cupy.ndarray)
        back = blockflow.to_host(dev)
        assert isinstance(back._meta, np.ndarray) and back.chunks == x.chunks
        out = back.compute(**LOCAL)
        assert isinstance(out, np.ndarray)
        np.testing.assert_array_equal(out, x_np)
    elif kind == "xarray-dataarray":
        arr = xr.DataArray(
            x, dims=("time", "space"), name="field", attrs={"units": "K"},
            coords={"time": np.arange(1000), "space": np.linspace(0, 1, 300)},
        )
        dev = blockflow.to_device(arr)
        assert isinstance(dev.data._meta, cupy.ndarray)
        assert dev.attrs == {"units": "K"} and dev.name == "field"
        assert isinstance(dev.isel(time=slice(0, 2)).data.compute(**LOCAL), cupy.ndarray)
        back = blockflow.to_host(dev).compute(**LOCAL)
        assert isinstance(back.data, np.ndarray)
        xr.testing.assert_identical(back, arr.compute(**LOCAL))
    elif kind == "xarray-dataset":
        ds = xr.Dataset(
            {"u": (("time", "space"), x), "v": (("time", "space"), x * 2),
             "label": ("time", np.arange(1000))},  # in memory: stays as it is
            coords={"time": np.arange(1000)}, attrs={"source": "test"},
        )
        dev = blockflow.to_device(ds)
        assert isinstance(dev["u"].data._meta, cupy.ndarray)
        assert isinstance(dev["label"].data, np.ndarray)
        assert dev.attrs == {"source": "test"}
        back = blockflow.to_host(dev).compute(**LOCAL)
        assert isinstance(back["v"].data, np.ndarray)
        xr.testing.assert_identical(back, ds.compute(**LOCAL))
    else:
        import cudf

        pdf = _frame()
        ddf = dd.from_pandas(pdf, npartitions=3)
        dev = blockflow.to_device(ddf)
        assert isinstance(dev._meta, cudf.DataFrame) and dev.npartitions == 3
        assert blockflow.dataframe_module(dev.partitions[0].compute(**LOCAL)) is cudf
        back = blockflow.to_host(dev)
        assert isinstance(back._meta, pd.DataFrame)
        pd.testing.assert_frame_equal(back.compute(**LOCAL), pdf, check_dtype=False)


# --- blockwise kernels and tree reductions ------------------------------------------------


def test_map_blocks_same_result_on_cupy_and_numpy(host_array):
    x_np, x = host_array
    on_cpu = blockflow.map_blocks(backend_kernel, x).compute(**LOCAL)
    on_gpu = blockflow.map_blocks(backend_kernel, blockflow.to_device(x))
    assert isinstance(on_gpu._meta, cupy.ndarray)
    out = on_gpu.compute(**LOCAL)
    assert isinstance(out, cupy.ndarray)
    np.testing.assert_allclose(to_numpy(out), on_cpu, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(on_cpu, np.tanh(x_np) * 2 + np.sqrt(np.abs(x_np)), rtol=1e-12)
    assert on_gpu.name.startswith("blockflow-backend-kernel")


def test_map_blocks_block_id_on_cupy(host_array):
    _, x = host_array
    on_cpu = blockflow.map_blocks(offset_kernel, x, dtype=x.dtype).compute(**LOCAL)
    on_gpu = blockflow.map_blocks(offset_kernel, blockflow.to_device(x),
                                  dtype=x.dtype).compute(**LOCAL)
    assert on_cpu[250, 100] == x.compute(**LOCAL)[250, 100] + 1001
    np.testing.assert_array_equal(to_numpy(on_gpu), on_cpu)


def test_map_blocks_kernel_error_names_the_block_on_gpu(host_array):
    _, x = host_array

    def bad(block, block_id=None):
        if block_id == (1, 2):
            raise ValueError("boom")
        return block

    with pytest.raises(blockflow.BlockKernelError, match=r"failed on block \(1, 2\): "
                       r"ValueError: boom"):
        blockflow.map_blocks(bad, blockflow.to_device(x)).compute(**LOCAL)


@pytest.mark.parametrize("axis", [None, 0, 1, (0, 1)])
@pytest.mark.parametrize("split_every", [2, 3, 16])
def test_tree_reduce_on_cupy_equals_numpy(host_array, axis, split_every):
    x_np, x = host_array
    expected = x_np.sum(axis=axis, dtype=np.float64)
    on_gpu = blockflow.tree_reduce(blockflow.to_device(x), sum_f64, axis=axis,
                                   split_every=split_every, dtype=np.float64)
    out = on_gpu.compute(**LOCAL)
    assert isinstance(out, cupy.ndarray)
    np.testing.assert_allclose(to_numpy(out), expected, rtol=1e-12, atol=1e-9)
    on_cpu = blockflow.tree_reduce(x, sum_f64, axis=axis, split_every=split_every,
                                   dtype=np.float64).compute(**LOCAL)
    np.testing.assert_allclose(to_numpy(out), on_cpu, rtol=1e-12, atol=1e-9)


def test_tree_reduce_xarray_on_cupy(host_array):
    x_np, x = host_array
    arr = xr.DataArray(x, dims=("time", "space"), coords={"space": np.arange(300)},
                       name="field")
    out = blockflow.tree_reduce(blockflow.to_device(arr), sum_f64, dim="time",
                                split_every=2, dtype=np.float64)
    assert out.dims == ("space",) and out.name == "field"
    got = out.data.compute(**LOCAL)
    np.testing.assert_allclose(to_numpy(got), x_np.sum(axis=0), rtol=1e-12)


# --- a real LocalCUDACluster ------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_client():
    try:
        import dask_cuda  # noqa: F401
    except ImportError as e:  # also "cannot import name 'bindings' from 'cuda'"
        pytest.skip(f"needs dask-cuda with its CUDA bindings (pip install 'blockflow[gpu]'): "
                    f"{type(e).__name__}: {e}")
    client = blockflow.connect(gpu=True, dashboard_address=":0", policy="off")
    try:
        client.wait_for_workers(gpu_device_count(), timeout=120)
        yield client
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()


def _inventory_with_gpus(client, timeout=15.0):
    """The inventory once every worker's heartbeat has reported its GPU (0.5-2 s apart)."""

    def complete():
        inv = blockflow.inventory(client)
        return inv if len(inv) and inv.n_gpus == len(inv) and all(w.gpu_uuid for w in inv) \
            else None

    return wait_until(complete, timeout=timeout, interval=0.25,
                      message=lambda: f"every worker's GPU: {blockflow.inventory(client)!r}")


def test_connect_gpu_starts_local_cuda_cluster(gpu_client):
    from dask_cuda import LocalCUDACluster

    assert isinstance(gpu_client.cluster, LocalCUDACluster)
    # dask-cuda starts one worker per visible GPU
    assert len(workers_info(gpu_client)) == gpu_device_count()


def test_inventory_reports_real_gpus(gpu_client):
    import pynvml

    inv = _inventory_with_gpus(gpu_client)
    assert len(inv) == gpu_device_count() and inv.n_gpus == len(inv), repr(inv)
    pynvml.nvmlInit()
    try:
        for w in inv:
            assert w.device == "gpu" and not w.simulated
            assert isinstance(w.gpu_name, str) and w.gpu_name.strip(), w
            assert w.gpu_uuid.startswith("GPU-"), w
            assert w.gpu_memory_total > 0 and w.gpu_memory_used >= 0, w
            assert w.gpu_memory_used <= w.gpu_memory_total
            assert w.gpu_utilization is None or 0 <= w.gpu_utilization <= 100
            # the same device as NVML sees it from this process
            handle = pynvml.nvmlDeviceGetHandleByUUID(w.gpu_uuid.encode())
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            assert w.gpu_name == name
            assert w.gpu_memory_total == pynvml.nvmlDeviceGetMemoryInfo(handle).total
    finally:
        pynvml.nvmlShutdown()
    text = repr(inv)
    assert f"{len(inv)} GPUs>" in text and inv.workers[0].gpu_name in text
    df = inv.to_pandas()
    assert (df["device"] == "gpu").all() and (df["gpu_memory_total"] > 0).all()


def test_pipeline_on_the_cuda_cluster(gpu_client, host_array):
    x_np, x = host_array
    dev = blockflow.to_device(x)
    y = blockflow.map_blocks(backend_kernel, dev)
    total = blockflow.tree_reduce(y, sum_f64, split_every=2, dtype=np.float64)
    y_out, total_out = gpu_client.compute([y, total], sync=True)
    assert isinstance(y_out, cupy.ndarray)
    expected = np.tanh(x_np) * 2 + np.sqrt(np.abs(x_np))
    # CuPy's tanh and NumPy's may differ in the last bit (seen on an H200: 1.1e-16 absolute);
    # where 2 tanh(x) + sqrt(|x|) cancels to ~1e-4 that is 1.4e-12 relative, hence the atol
    np.testing.assert_allclose(to_numpy(y_out), expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(float(to_numpy(total_out)), expected.sum(), rtol=1e-12)
    counts = blockflow.task_counts(gpu_client, kernels_only=True)
    assert sum(counts.values()) > 0


def test_gpu_workers_report_own_utilization_and_capacity(gpu_client):
    """blockflow's DeviceMetrics worker plugin: NVML per-process utilisation and capacity."""
    def probe(dask_worker):
        return {k: dask_worker.metrics[k](dask_worker) if k in dask_worker.metrics else None
                for k in ("blockflow-gpu-own-utilization", "blockflow-capacity")}

    for values in gpu_client.run(probe).values():
        own = values["blockflow-gpu-own-utilization"]
        assert own is not None and 0 <= own <= 100
        assert values["blockflow-capacity"] is None or values["blockflow-capacity"] > 0


def test_device_module_sees_each_workers_gpu(gpu_client):
    """blockflow.devices on each worker: the device it uses, as the inventory lists it."""
    from blockflow import devices

    def describe():
        info = devices.device_info()
        return None if info is None else info.to_dict()

    infos = gpu_client.run(describe)
    inv = _inventory_with_gpus(gpu_client)
    assert all(i is not None for i in infos.values()), infos
    assert {w.gpu_uuid for w in inv} == {i["uuid"] for i in infos.values()}
    for i in infos.values():
        assert i["name"] and i["memory_total"] > 0 and i["mig"] in (False, True), i
    assert devices.device_count() == gpu_device_count() > 0
