"""blockflow.tree_reduce: same result as NumPy/pandas for any chunking and any fan-in, the
memory-aware choice of ``split_every``, and exact messages for bad input.

Property tests run on Dask's synchronous scheduler so hypothesis stays fast; a handful of
fixed cases run on the shared LocalCluster of conftest.py.
"""

from __future__ import annotations

import logging

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
import xarray as xr
from dask.utils import key_split
from distributed import Client, Scheduler, SpecCluster, Worker, WorkerPlugin
from hypothesis import given, settings
from hypothesis import strategies as st
from loadaware import wait_until

import blockflow
from blockflow import EmptyCollectionError, choose_split_every, tree_reduce
from blockflow.reduction import smallest_worker_memory

MiB, GiB = 2**20, 2**30
property_settings = settings(max_examples=30, deadline=None)


# --- reductions under test ---------------------------------------------------------------


def _depth(nested) -> int:
    return 1 + _depth(nested[0]) if isinstance(nested, list) else 0


def _flat(nested) -> list:
    return [x for n in nested for x in _flat(n)] if isinstance(nested, list) else [nested]


# Dask's convention for non-array partials: with computing_meta=True (metadata inference on
# empty blocks) return the input unchanged.


def mean_chunk(x, axis=None, keepdims=True, computing_meta=False):
    if computing_meta:
        return x
    n = np.sum(np.ones_like(x, dtype="i8"), axis=axis, keepdims=True)
    return {"s": np.sum(x, axis=axis, keepdims=True, dtype="f8"), "n": n}


def mean_combine(parts, axis=None, keepdims=True, computing_meta=False):
    if computing_meta:
        return parts
    # concatenate=False: one level of nesting per reduced axis
    assert _depth(parts) == len(axis), (parts, axis)
    flat = _flat(parts)
    return {"s": sum(p["s"] for p in flat), "n": sum(p["n"] for p in flat)}


def mean_aggregate(parts, axis=None, keepdims=False, computing_meta=False):
    if computing_meta:
        return np.sum(parts, axis=axis, keepdims=keepdims).astype("f8")
    m = mean_combine(parts, axis=axis)
    out = m["s"] / m["n"]
    return out if keepdims else out.squeeze(axis=axis)


def _reduce(x, op, axis, keepdims, split_every):
    if op == "sum":
        return tree_reduce(x, np.sum, axis=axis, keepdims=keepdims, split_every=split_every)
    if op == "max":
        return tree_reduce(x, np.max, axis=axis, keepdims=keepdims, split_every=split_every)
    return tree_reduce(x, mean_chunk, mean_combine, mean_aggregate, axis=axis,
                       keepdims=keepdims, split_every=split_every, concatenate=False,
                       dtype="f8")


def _numpy(a, op, axis, keepdims):
    return {"sum": np.sum, "max": np.max, "mean": np.mean}[op](a, axis=axis, keepdims=keepdims)


# --- strategies --------------------------------------------------------------------------


@st.composite
def chunks_for(draw, n: int):
    """Any chunking of an axis of length n: sizes >= 1 summing to n."""
    cuts = draw(st.sets(st.integers(1, n - 1), max_size=min(n - 1, 12))) if n > 1 else set()
    bounds = [0, *sorted(cuts), n]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


split_everys = st.one_of(st.none(), st.integers(2, 9))
ops = st.sampled_from(["sum", "max", "mean"])


@property_settings
@given(data=st.data(), op=ops, split_every=split_everys, keepdims=st.booleans())
def test_any_chunking_1d_equals_numpy(data, op, split_every, keepdims):
    n = data.draw(st.integers(1, 40), label="n")
    chunks = data.draw(chunks_for(n), label="chunks")
    axis = data.draw(st.sampled_from([None, 0, (0,)]), label="axis")
    a = np.random.default_rng(n).integers(-50, 50, n)
    x = da.from_array(a, chunks=(chunks,))
    with dask.config.set(scheduler="sync"):
        got = _reduce(x, op, axis, keepdims, split_every).compute()
    want = _numpy(a, op, axis, keepdims)
    assert np.shape(got) == np.shape(want)
    np.testing.assert_allclose(got, want, rtol=1e-12)


@property_settings
@given(data=st.data(), op=ops, split_every=split_everys, keepdims=st.booleans())
def test_any_chunking_2d_equals_numpy(data, op, split_every, keepdims):
    shape = data.draw(st.tuples(st.integers(1, 14), st.integers(1, 14)), label="shape")
    chunks = tuple(data.draw(chunks_for(n), label="chunks") for n in shape)
    axis = data.draw(st.sampled_from([None, 0, 1, -1, (0, 1), (1, 0)]), label="axis")
    a = np.random.default_rng(sum(shape)).integers(-50, 50, shape)
    x = da.from_array(a, chunks=chunks)
    with dask.config.set(scheduler="sync"):
        got = _reduce(x, op, axis, keepdims, split_every).compute()
    want = _numpy(a, op, axis, keepdims)
    assert np.shape(got) == np.shape(want)
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_tree_depth_follows_split_every():
    x = da.ones(64, chunks=1)  # 64 blocks
    for split_every, levels in [(2, 5), (4, 2), (8, 1), (64, 0)]:
        graph = tree_reduce(x, np.sum, split_every=split_every).__dask_graph__()
        layers = {key_split(k) for k in graph}
        partial = [k for k in graph if key_split(k) == "blockflow-sum-partial"]
        # levels of combine (partial) tasks = ceil(log_s(64)) - 1
        assert len({k[0] for k in partial}) == levels, (split_every, layers)
        assert "blockflow-sum-aggregate" in layers


def groupby_chunk(df):
    return df.groupby("k").sum()


def groupby_combine(df):
    return df.groupby(level=0).sum()


@property_settings
@given(
    n=st.integers(1, 60), npartitions=st.integers(1, 8), split_every=split_everys,
    seed=st.integers(0, 2**16),
)
@pytest.mark.slow
def test_dataframe_groupby_sum_equals_pandas(n, npartitions, split_every, seed):
    rng = np.random.default_rng(seed)
    pdf = pd.DataFrame({"k": rng.integers(0, 5, n), "v": rng.integers(-9, 9, n)})
    ddf = dd.from_pandas(pdf, npartitions=npartitions)
    out = tree_reduce(ddf, groupby_chunk, groupby_combine, split_every=split_every)
    with dask.config.set(scheduler="sync"):
        got = out.compute()
    pd.testing.assert_frame_equal(got.sort_index(), pdf.groupby("k").sum())


# --- the same on the cluster -------------------------------------------------------------


@pytest.mark.parametrize(
    "op, shape, chunks, axis, split_every",
    [
        ("sum", (50,), (7,), None, 2),
        ("max", (12, 9), (5, 2), 1, 3),
        ("mean", (12, 9), (1, 4), (0, 1), 4),
        ("mean", (30, 4), (3, 4), 0, None),
    ],
)
def test_on_the_cluster_equals_numpy(client, op, shape, chunks, axis, split_every):
    a = np.random.default_rng(0).standard_normal(shape)
    got = client.compute(_reduce(da.from_array(a, chunks=chunks), op, axis, False,
                                 split_every)).result()
    np.testing.assert_allclose(got, _numpy(a, op, axis, False), rtol=1e-12)


def test_dataframe_on_the_cluster_equals_pandas(client):
    pdf = pd.DataFrame({"k": np.arange(100) % 7, "v": np.arange(100.0)})
    ddf = dd.from_pandas(pdf, npartitions=10)
    out = tree_reduce(ddf, groupby_chunk, groupby_combine, split_every=3)
    got = client.compute(out).result()
    pd.testing.assert_frame_equal(got.sort_index(), pdf.groupby("k").sum())


def dict_chunk(x, axis=None, keepdims=True):  # no computing_meta keyword
    return {"s": np.sum(x, axis=axis, keepdims=True)}


def dict_aggregate(parts, axis=None, keepdims=False):
    return np.sum([p["s"] for p in _flat(parts)], axis=0).sum(axis=axis, keepdims=keepdims)


def dict_combine(parts, axis=None, keepdims=True):
    return {"s": np.sum([p["s"] for p in _flat(parts)], axis=0)}


def test_dict_partials_without_computing_meta():
    x = da.ones((6, 4), chunks=2)
    out = tree_reduce(x, dict_chunk, dict_combine, dict_aggregate, axis=0, concatenate=False,
                      split_every=2)
    np.testing.assert_array_equal(out.compute(scheduler="sync"), np.full(4, 6.0))


def _groupby_frame():
    pdf = pd.DataFrame({"k": np.arange(20) % 3, "v": np.arange(20)})
    return pdf, dd.from_pandas(pdf, npartitions=5)


def test_array_task_names_start_with_blockflow():
    x = da.ones((8, 8), chunks=2)
    names = {key_split(k) for k in tree_reduce(x, np.max, split_every=2).__dask_graph__()}
    assert names == {"ones_like", "blockflow-max", "blockflow-max-partial",
                     "blockflow-max-aggregate"}
    names = {key_split(k) for k in
             tree_reduce(x, np.max, split_every=2, name="peak").__dask_graph__()}
    assert "blockflow-peak-aggregate" in names


# --- choosing split_every ----------------------------------------------------------------


def test_choose_split_every_math():
    # fan-in x block bytes <= 25 % (default) of the worker's memory
    assert choose_split_every(100 * MiB, 4 * GiB) == 10  # floor(1024 MiB / 100 MiB)
    assert choose_split_every(100 * MiB, 4 * GiB, memory_fraction=0.5) == 20
    assert choose_split_every(64 * MiB, 16 * GiB) == 32  # 64, clamped to max-split-every
    assert choose_split_every(3 * GiB, 4 * GiB) == 2  # 0, clamped to min 2
    assert choose_split_every(0, 4 * GiB) == 32  # no bytes: as wide as allowed
    assert choose_split_every(MiB, GiB, min_split_every=4, max_split_every=6) == 6
    assert choose_split_every(GiB, GiB, min_split_every=4, max_split_every=6) == 4
    assert choose_split_every(GiB, GiB, min_split_every=1) == 2  # never below 2
    with dask.config.set({"blockflow.reduction.max-split-every": 16,
                          "blockflow.reduction.memory-fraction": 0.125}):
        assert choose_split_every(100 * MiB, 4 * GiB) == 5
        assert choose_split_every(1, 4 * GiB) == 16


class _FakeDeviceMemory(WorkerPlugin):
    """Reports distributed's NVML key ``gpu-memory-total`` on one worker (no GPU needed)."""

    name = "test-fake-device-memory"

    def __init__(self, nbytes: int, worker_name: str):
        self.nbytes = nbytes
        self.worker_name = worker_name

    def setup(self, worker):
        if worker.name == self.worker_name:
            nbytes = self.nbytes
            worker.metrics["gpu-memory-total"] = lambda w: nbytes


@pytest.fixture(scope="module")
def uneven_client():
    """Two in-process workers with 1 GiB and 3 GiB of host memory."""
    spec = {
        "scheduler": {"cls": Scheduler, "options": {"dashboard_address": ":0"}},
        "workers": {
            "small": {"cls": Worker, "options": {"nthreads": 1, "memory_limit": "1GiB"}},
            "big": {"cls": Worker, "options": {"nthreads": 1, "memory_limit": "3GiB"}},
        },
    }
    # In-process workers measure the whole test process's memory against their 1 GiB and
    # 3 GiB limits: late in a long suite that can pause them (a computation then waits
    # forever). Their limits are only there to be read, so memory management is off.
    no_memory_management = {f"distributed.worker.memory.{k}": False
                            for k in ("target", "spill", "pause", "terminate")}
    # not the default client: tests opt in with client.as_current()
    with dask.config.set(no_memory_management):  # read when the workers start
        cluster = SpecCluster(**spec)
    with cluster, Client(cluster, set_as_default=False) as c:
        yield c


def test_smallest_worker_memory_reads_the_cluster(uneven_client):
    assert smallest_worker_memory(uneven_client) == (GiB, "host")
    with uneven_client.as_current():
        assert smallest_worker_memory() == (GiB, "host")  # the current client


def test_smallest_worker_memory_without_a_cluster():
    assert smallest_worker_memory() == (4 * GiB, "config")
    with dask.config.set({"blockflow.reduction.default-worker-memory": "2GiB"}):
        assert smallest_worker_memory() == (2 * GiB, "config")


def test_auto_split_every_is_logged_and_sized_from_the_smallest_worker(uneven_client, caplog):
    x = da.ones((20, 4096), chunks=(1, 4096), dtype="f8")  # 20 blocks of 32 KiB
    with uneven_client.as_current(), caplog.at_level(logging.INFO, logger="blockflow.reduction"):
        wide = tree_reduce(x, np.sum, axis=0)
        narrow = tree_reduce(x, np.sum, axis=0, block_bytes=16 * MiB)
    assert [r.getMessage() for r in caplog.records] == [
        # 25 % of 1 GiB / 32 KiB = 8192, clamped to max-split-every
        f"tree_reduce of {x.name}: split_every=32 (32 x 32.00 kiB blocks within 25% of the "
        f"smallest worker's host memory, 1.00 GiB)",
        # 25 % of 1 GiB / 16 MiB = 16
        f"tree_reduce of {x.name}: split_every=16 (16 x 16.00 MiB blocks within 25% of the "
        f"smallest worker's host memory, 1.00 GiB)",
    ]
    # 20 blocks: one aggregate step with a fan-in of 32, a combine level first with 16
    assert "blockflow-sum-partial" not in {key_split(k) for k in wide.__dask_graph__()}
    assert "blockflow-sum-partial" in {key_split(k) for k in narrow.__dask_graph__()}
    np.testing.assert_array_equal(uneven_client.compute(narrow).result(), np.full(4096, 20.0))
    caplog.clear()
    with uneven_client.as_current(), caplog.at_level(logging.INFO, logger="blockflow.reduction"):
        tree_reduce(x, np.sum, split_every=4)
    assert caplog.records == []  # an explicit fan-in is not logged


def test_device_memory_counts_on_gpu_workers(uneven_client):
    uneven_client.register_plugin(_FakeDeviceMemory(512 * MiB, "big"))
    wait_until(lambda: smallest_worker_memory(uneven_client)[1] == "device",  # next heartbeat
               timeout=10, message="the device-memory metric to reach the scheduler")
    assert smallest_worker_memory(uneven_client) == (512 * MiB, "device")
    uneven_client.unregister_worker_plugin(_FakeDeviceMemory.name)


def test_configured_split_every_wins():
    x = da.ones(64, chunks=1)
    with dask.config.set({"blockflow.reduction.split-every": 2}):
        graph = tree_reduce(x, np.sum).__dask_graph__()
    assert len({k[0] for k in graph if key_split(k) == "blockflow-sum-partial"}) == 5


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [1, 0, -3])
def test_split_every_too_small(bad):
    with pytest.raises(ValueError) as e:
        tree_reduce(da.ones(4, chunks=2), np.sum, split_every=bad)
    assert str(e.value) == (
        f"blockflow.tree_reduce: split_every={bad} is too small; a tree reduction combines at "
        f"least 2 blocks per step (use split_every >= 2, or None to size it from worker memory)."
    )


@pytest.mark.parametrize("bad, shown", [(2.5, "2.5"), ("4", "'4'"), (True, "True")])
def test_split_every_not_an_int(bad, shown):
    with pytest.raises(TypeError) as e:
        tree_reduce(da.ones(4, chunks=2), np.sum, split_every=bad)
    assert str(e.value) == (
        f"blockflow.tree_reduce: split_every must be an int >= 2 or None, got {shown}."
    )


def test_split_every_per_axis_is_for_arrays_only():
    ddf = dd.from_pandas(pd.DataFrame({"a": range(8)}), npartitions=4)
    with pytest.raises(TypeError) as e:
        tree_reduce(ddf, lambda p: p.sum(), split_every={0: 2})
    assert str(e.value) == (
        "blockflow.tree_reduce: split_every must be an int >= 2 or None, got {0: 2}."
    )


def test_split_every_numpy_int_is_accepted():
    assert tree_reduce(da.ones(9, chunks=2), np.sum, split_every=np.int64(2)).compute(
        scheduler="sync") == 9


def test_configured_split_every_is_validated_too():
    with dask.config.set({"blockflow.reduction.split-every": 1}):
        with pytest.raises(ValueError, match=r"^blockflow.tree_reduce: split_every=1 is too"):
            tree_reduce(da.ones(4, chunks=2), np.sum)


def test_empty_and_unknown_chunks():
    with pytest.raises(EmptyCollectionError) as e:
        tree_reduce(da.ones((3, 0), chunks=2), np.sum, split_every=2)
    assert str(e.value) == (
        "blockflow.tree_reduce: the collection is empty (shape (3, 0)); there are no blocks to "
        "run on."
    )
    x = da.arange(10, chunks=3)
    with pytest.raises(ValueError) as e:
        tree_reduce(x[x > 4], np.sum, split_every=2)
    assert str(e.value) == (
        "blockflow.tree_reduce: the collection has unknown (NaN) chunk sizes along axis 0; call "
        "x = x.compute_chunk_sizes() first so blocks can be placed and sized."
    )


def test_in_memory_inputs_are_refused():
    with pytest.raises(TypeError) as e:
        tree_reduce(np.ones(3), np.sum, split_every=2)
    assert str(e.value) == (
        "blockflow.tree_reduce: the collection is a numpy.ndarray, not a Dask collection; wrap "
        "it with dask.array.from_array(x, chunks=...)."
    )
    with pytest.raises(TypeError) as e:
        tree_reduce(pd.Series([1.0]), np.sum, split_every=2)
    assert str(e.value) == (
        "blockflow.tree_reduce: the collection is a pandas.Series, not a Dask collection; wrap "
        "it with dask.dataframe.from_pandas(df, npartitions=...)."
    )


# --- xarray --------------------------------------------------------------------------------


def _field():
    rng = np.random.default_rng(3)
    return xr.DataArray(
        rng.standard_normal((10, 4, 6)), dims=("time", "lat", "lon"),
        coords={
            "time": pd.date_range("2001-01-01", periods=10),
            "lat": ("lat", [-60.0, -20.0, 20.0, 60.0], {"units": "degrees_north"}),
            "lon": np.arange(6) * 60.0,
            "zone": ("lat", ["S", "s", "n", "N"]),
            "doy": ("time", np.arange(1, 11)),
            "run": 7,
        },
        name="t2m", attrs={"units": "K"},
    ).chunk({"time": 3, "lat": 2})


@pytest.mark.parametrize("dim", ["time", ("time", "lon"), "lat"])
def test_xarray_dim_reduction_keeps_coords(client, dim):
    arr = _field()
    out = tree_reduce(arr, np.sum, dim=dim, split_every=2)
    assert isinstance(out, xr.DataArray) and out.name == "t2m"
    want = arr.compute().sum(dim)
    got = client.compute(out).result()
    assert got.dims == want.dims
    xr.testing.assert_allclose(got, want, rtol=1e-12)
    assert set(got.coords) == set(want.coords)  # coords along reduced dims are dropped
    assert got.attrs == {"units": "K"}
    if "lat" in got.dims:
        assert got["lat"].attrs == {"units": "degrees_north"}
        assert list(got["zone"].values) == ["S", "s", "n", "N"]


def test_xarray_all_dims_and_unnamed():
    arr = _field().rename(None)
    out = tree_reduce(arr, np.max, split_every=3)
    assert out.dims == () and out.name is None
    assert float(out.compute(scheduler="sync")) == float(arr.max())


def test_xarray_bad_input():
    arr = _field()
    with pytest.raises(ValueError) as e:
        tree_reduce(arr, np.sum, dim="depth", split_every=2)
    assert str(e.value) == (
        "blockflow.tree_reduce: dim ['depth'] not in the DataArray's dims ('time', 'lat', 'lon')."
    )
    with pytest.raises(TypeError) as e:
        tree_reduce(arr.to_dataset(), np.sum, dim="time", split_every=2)
    assert str(e.value) == (
        "blockflow.tree_reduce: pass one xarray.DataArray (e.g. ds['var']), not a Dataset; "
        "reduce each variable separately."
    )
    with pytest.raises(TypeError) as e:
        tree_reduce(arr.compute(), np.sum, dim="time", split_every=2)
    assert str(e.value) == (
        "blockflow.tree_reduce: the collection is a xarray.DataArray, not a Dask collection; "
        "chunk it with obj.chunk(...) so that it is backed by dask."
    )


@pytest.mark.slow
def test_kernel_then_tree_reduce_is_one_task_per_block_plus_the_tree(client):
    """Dask fuses a block's producer into the reduction's first step and leaves an alias task
    per block; tree_reduce's graph has none: blocks + tree, no more."""
    from blockflow._distributed.graph import alias_target

    x = da.random.default_rng(0).random(2560, chunks=10)  # 256 blocks
    y = blockflow.map_blocks(lambda b: b * 2, x)
    out = tree_reduce(y, np.sum, split_every=8)
    (opt,) = dask.optimize(out)
    graph = dict(opt.__dask_graph__())
    assert not any(alias_target(t) is not None for t in graph.values())
    assert len(graph) == 256 + 32 + 4 + 1  # blocks, two partial levels, the aggregate
    (plain,) = dask.optimize(y.sum(split_every=8))
    assert len(dict(plain.__dask_graph__())) > 2 * 256  # what plain Dask builds
    assert client.compute(out).result() == pytest.approx(2 * x.sum().compute())


def test_xarray_reduction_refuses_axis_and_keepdims():
    arr = xr.DataArray(da.ones((4, 6), chunks=2), dims=("t", "x"))
    for kwargs in ({"axis": 0}, {"keepdims": True}):
        with pytest.raises(TypeError) as e:
            tree_reduce(arr, np.sum, **kwargs)
        assert str(e.value) == (
            "blockflow.tree_reduce: for xarray objects name the dimensions with dim=... "
            "(axis= and keepdims= apply to dask arrays only).")


def test_xarray_results_mix_with_other_dask_variables():
    arr = xr.DataArray(da.ones((6, 4), chunks=2), dims=("t", "x"))
    ds = xr.Dataset({"s": tree_reduce(arr, np.sum, dim="t", split_every=2),
                     "m": arr.mean("t")})
    out = ds.compute(scheduler="sync")
    np.testing.assert_array_equal(out["s"].values, np.full(4, 6.0))
    np.testing.assert_array_equal(out["m"].values, np.ones(4))


def test_split_every_per_axis_as_in_dask():
    x = da.ones((64, 64), chunks=(4, 8))
    narrow = tree_reduce(x, np.sum, axis=0, split_every={0: 2})
    wide = tree_reduce(x, np.sum, axis=0, split_every={0: 16})
    np.testing.assert_array_equal(narrow.compute(), np.full(64, 64.0))
    # 16 blocks along axis 0: four levels of fan-in 2, one of 16
    assert len(narrow.__dask_graph__()) > len(wide.__dask_graph__())
    with pytest.raises(ValueError, match=r"names axis 5, which the collection's 2 dimensions "
                                         r"do not have; use axes from -2 to 1\.$"):
        tree_reduce(x, np.sum, axis=0, split_every={5: 2})
    with pytest.raises(ValueError, match=r"gives axis 0 a fan-in of 1; each must be an int "
                                         r">= 2\.$"):
        tree_reduce(x, np.sum, axis=0, split_every={0: 1})
