"""The array-stats workload: generated field -> blockwise anomalies -> tree-reduced moments.

Real LocalClusters (fixtures in conftest.py); the NumPy oracle
(:func:`blockflow.workloads.reference.array_stats_reference`) is the reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import dask
import dask.array as da
import numpy as np
import pandas as pd
import pytest
import xarray as xr
from dask.utils import key_split
from distributed import Client, LocalCluster

import blockflow
from blockflow.workloads import dashboard_page
from blockflow.scheduling.view import workers_info
from blockflow.workloads import array_stats as A
from blockflow.workloads import field as F
from blockflow.workloads.reference import array_stats_reference

SMALL = A.SIZES["small"]


def _assert_stats_close(got: xr.Dataset, want: xr.Dataset) -> None:
    """Exact for count/min/max (no arithmetic), tight for float64 moments of float32 data."""
    assert list(got.data_vars) == list(want.data_vars) == ["count", "mean", "var", "min", "max"]
    for k in ("count", "min", "max"):
        assert got[k].dtype == want[k].dtype
        xr.testing.assert_equal(got[k], want[k])
    for k in ("mean", "var"):
        assert got[k].dtype == np.float64
        xr.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-13)


@pytest.fixture(scope="module")
def small_reference():
    return array_stats_reference("small", seed=0)


def test_small_run_equals_numpy_reference(client, small_reference):
    result = A.run(client, size="small", progress=False)
    _assert_stats_close(result.stats, small_reference)
    # the variance is the population variance (ddof=0), not the sample variance
    n = SMALL.shape[0]
    sample_var = small_reference["var"] * n / (n - 1)
    assert not np.allclose(result.stats["var"], sample_var, rtol=1e-6)
    assert result.stats["var"].attrs["ddof"] == 0
    assert result.stats["var"].attrs["units"] == "K2"
    assert int(result.stats["count"].min()) == int(result.stats["count"].max()) == n


@pytest.mark.parametrize("split_every", [2, 3])
def test_tree_with_combine_levels_equals_reference(client, small_reference, split_every):
    # 4 time blocks: split_every=2 gives chunk -> combine -> aggregate, 3 one combine of 3 + 1
    stats = A.build("small", seed=0, split_every=split_every)
    names = {key_split(k) for k in stats.__dask_graph__()}
    assert "blockflow-moments-partial" in names
    _assert_stats_close(client.compute(stats).result(), small_reference)


def test_result_metadata(client):
    result = A.run(client, size="small", progress=False)
    assert result.size == "small" and result.seed == 0
    assert result.shape == (120, 32, 64) and result.chunks == (30, 16, 64)
    assert result.nbytes == 120 * 32 * 64 * 4
    assert result.wall_time > 0
    assert result.bytes_per_second == pytest.approx(result.nbytes / result.wall_time)
    # one run's tasks: what the workers finished for it, never more than the graph has
    assert result.n_tasks == sum(result.task_counts.values())
    assert result.n_tasks <= len(A.build("small", 0).__dask_graph__())
    assert result.dashboard_link == dashboard_page(client.dashboard_link)
    workers = set(workers_info(client))
    assert result.task_counts and set(result.task_counts) <= workers
    # every counted task belongs to this run: at most the graph's tasks, at least one per block
    n_blocks = int(np.prod([len(c) for c in da.core.normalize_chunks(SMALL.chunks, SMALL.shape)]))
    assert 3 * n_blocks <= sum(result.task_counts.values()) <= result.n_tasks
    stats = result.stats
    assert dict(stats.sizes) == {"lat": 32, "lon": 64}
    np.testing.assert_array_equal(stats["lat"], A.generate_field("small")["lat"])
    assert stats["lat"].attrs["units"] == "degrees_north"
    assert stats["mean"].attrs["units"] == "K"
    assert "(120, 32, 64)" in repr(result)


@pytest.mark.slow
def test_summary_table(client):
    result = A.run(client, size="small", progress=False)
    table = result.summary()
    assert isinstance(table, pd.DataFrame)
    assert list(table.index) == ["mean", "var", "min", "max"]
    assert list(table.columns) == ["units", "grid_mean", "area_mean", "grid_min", "grid_max"]
    s = result.stats
    assert table.loc["var", "units"] == "K2"
    assert table.loc["mean", "grid_mean"] == pytest.approx(float(s["mean"].mean()))
    assert table.loc["max", "grid_max"] == pytest.approx(float(s["max"].max()))
    assert table.loc["min", "grid_min"] == pytest.approx(float(s["min"].min()))
    w = np.cos(np.deg2rad(s["lat"].values))[:, None] * np.ones(s.sizes["lon"])
    assert table.loc["var", "area_mean"] == pytest.approx(
        float((s["var"].values * w).sum() / w.sum())
    )


@pytest.mark.slow
def test_deterministic_for_a_seed(client):
    a = A.run(client, size="small", seed=7, progress=False).stats
    b = A.run(client, size="small", seed=7, progress=False).stats
    c = A.run(client, size="small", seed=8, progress=False).stats
    xr.testing.assert_identical(a, b)  # bitwise: fixed tree, per-block seeds
    assert not np.allclose(a["mean"], c["mean"])


def test_statistics_are_physical(small_reference):
    """The anomaly keeps the zonal wave (its time mean) and the noise (its variance); the
    seasonal cycle (up to +-15 K) is removed by the climatology."""
    s = small_reference
    lat, lon = s["lat"].values, s["lon"].values
    wave = F._zonal_wave(lat, lon)
    sigma2 = F._noise_std(lat) ** 2
    n = SMALL.shape[0]
    # time mean: within 4 standard errors of the wave at every point
    assert np.all(np.abs(s["mean"].values - wave) < 4 * np.sqrt(sigma2[:, None] / n))
    # variance, averaged along each latitude row of 64 points: within 10 % of sigma^2
    ratio = s["var"].mean("lon").values / sigma2
    assert np.all(np.abs(ratio - 1) < 0.1), ratio
    # without the climatology the seasonal cycle would dominate the variance at high latitudes
    assert s["var"].values.max() < 1.5 * sigma2.max()


def test_field_is_lazy_blockwise_and_seeded(client):
    field = A.generate_field("small", seed=3)
    assert field.dtype == np.float32 and field.dims == ("time", "lat", "lon")
    assert field.shape == SMALL.shape
    assert field.chunks == da.core.normalize_chunks(SMALL.chunks, SMALL.shape)
    assert field.attrs["units"] == "K"
    graph = field.data.__dask_graph__()
    assert len(graph) == 8 and all(key_split(k) == "blockflow-generate-field" for k in graph)
    block = field.data.blocks[1, 1, 0].compute()
    want = A._generate_block(seed=3, shape=SMALL.shape, block_id=(1, 1, 0),
                             location=[(30, 60), (16, 32), (0, 64)])
    np.testing.assert_array_equal(block, want)
    assert field.data.blocks[0, 0, 0].compute().std() > 0
    anom = A.anomalies(field, A.climatology("small"))
    assert anom.dtype == np.float32 and anom.chunks == field.chunks
    assert {key_split(k) for k in anom.__dask_graph__()} >= {"blockflow-anomaly"}


def test_climatology_matches_field_mean():
    clim = A.climatology("small")
    assert clim.dims == ("dayofyear", "lat") and clim.sizes["dayofyear"] == 366
    assert clim["dayofyear"].values[0] == 1 and clim.attrs["units"] == "K"
    # seasonal cycle: northern rows coldest in January, southern rows warmest
    assert int(np.argmin(clim.isel(lat=-1).values)) + 1 == 15
    assert int(np.argmax(clim.isel(lat=0).values)) + 1 == 15


def test_anomaly_kernel_day_of_year_on_leap_years(client):
    # day 1460 of the time axis (from 2001-01-01) is 2004-12-31, day 366 of a leap year
    t = np.arange(1455, 1465)
    assert list(F._dayofyear(t)) == [361, 362, 363, 364, 365, 366, 1, 2, 3, 4]
    time = A.START_DATE + t.astype("timedelta64[D]")
    assert list(pd.DatetimeIndex(time).day_of_year) == list(F._dayofyear(t))


def test_moment_kernels_chan_merge_is_numerically_sound():
    """Data with a large offset: E[x^2] - E[x]^2 loses all digits, Chan's merge does not."""
    rng = np.random.default_rng(0)
    x = 1e9 + rng.standard_normal((4000, 3))
    dx = da.from_array(x, chunks=(97, 2))
    with dask.config.set(scheduler="sync"):
        rec = blockflow.tree_reduce(
            dx, A.moment_chunk, A.moment_combine, A.moment_aggregate, axis=0,
            concatenate=False, dtype=A.STATS_DTYPE, split_every=2,
            meta=np.empty((0,), A.STATS_DTYPE),
        ).compute()
    np.testing.assert_allclose(rec["var"], x.var(axis=0), rtol=1e-6)
    np.testing.assert_allclose(rec["mean"], x.mean(axis=0), rtol=1e-15)
    naive = (x**2).mean(axis=0) - x.mean(axis=0) ** 2
    assert not np.allclose(naive, x.var(axis=0), rtol=1e-2)  # the failure being avoided


def test_one_moments_merge_for_arrays_and_grouped_frames():
    """blockflow.core.moments.merge_moments serves stacked arrays and grouped rows alike: same
    numbers as NumPy on the whole data; parts with n = 0 (NaN mean) carry no weight."""
    from blockflow.core.moments import merge_moments

    rng = np.random.default_rng(3)
    x = 1e6 + rng.standard_normal((40, 5))
    cuts = [0, 7, 7, 19, 40]  # the second part is empty
    parts = [x[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    n = np.array([len(p) for p in parts], dtype=np.int64)[:, None]
    with np.errstate(invalid="ignore"), pytest.warns(RuntimeWarning, match="Mean of empty"):
        mean = np.stack([p.mean(axis=0) for p in parts])
    m2 = np.stack([((p - p.mean(axis=0)) ** 2).sum(axis=0) if len(p) else np.zeros(5)
                   for p in parts])
    count, merged_mean, merged_m2 = merge_moments(n, mean, m2, lambda a: a.sum(axis=0))
    assert count.item() == 40
    np.testing.assert_allclose(merged_mean, x.mean(axis=0), rtol=1e-15)
    np.testing.assert_allclose(merged_m2 / 40, x.var(axis=0), rtol=1e-9)
    # The same parts as rows of a frame, grouped by column: one group per column of x.
    frame = pd.DataFrame({"g": np.tile(np.arange(5), len(parts)), "n": np.repeat(n[:, 0], 5),
                          "mean": mean.ravel(), "m2": m2.ravel()})
    group = frame["g"]
    count, merged_mean, merged_m2 = merge_moments(
        frame["n"], frame["mean"], frame["m2"], lambda s: s.groupby(group).transform("sum"))
    assert (count == 40).all()
    np.testing.assert_allclose(merged_mean.to_numpy(), x.mean(axis=0)[group], rtol=1e-15)
    np.testing.assert_allclose(merged_m2.to_numpy() / 40, x.var(axis=0)[group], rtol=1e-9)
    # No values at all: mean NaN, M2 0.
    count, merged_mean, merged_m2 = merge_moments(
        np.zeros((2, 1), np.int64), np.full((2, 1), np.nan), np.zeros((2, 1)),
        lambda a: a.sum(axis=0))
    assert count.item() == 0 and np.isnan(merged_mean.item()) and merged_m2.item() == 0


def test_reference_is_the_oracle_module():
    """The oracle lives in blockflow.workloads.reference only, off the production path: the
    workloads keep no ``reference`` shim, and importing the oracles loads no distributed
    workload (they share the field's and the flights' definitions instead)."""
    from blockflow.workloads import flights

    assert "reference" not in A.__all__
    assert not hasattr(A, "reference") and not hasattr(flights, "reference")
    code = ("import sys, blockflow.workloads.reference; "
            "print(sorted(m for m in sys.modules if m.startswith('blockflow.workloads')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout
    assert "array_stats" not in loaded and "blockflow.workloads.flights'" not in loaded, loaded


@pytest.mark.parametrize("axis", [0, 1, (0, 2), (0, 1, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_moment_kernels_any_axes(axis, keepdims):
    """combine/aggregate get nested lists of dict partials, one level per reduced axis."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((9, 7, 5)).astype(np.float32)
    dx = da.from_array(x, chunks=(2, 3, 2))
    with dask.config.set(scheduler="sync"):
        rec = blockflow.tree_reduce(
            dx, A.moment_chunk, A.moment_combine, A.moment_aggregate, axis=axis,
            keepdims=keepdims, concatenate=False, dtype=A.STATS_DTYPE, split_every=4,
        ).compute()
    kw = dict(axis=axis, keepdims=keepdims)
    np.testing.assert_allclose(rec["mean"], x.mean(dtype=np.float64, **kw), rtol=1e-12)
    np.testing.assert_allclose(rec["var"], x.var(dtype=np.float64, **kw), rtol=1e-12)
    np.testing.assert_array_equal(rec["min"], x.min(**kw))
    np.testing.assert_array_equal(rec["max"], x.max(**kw))
    n = x.size // x.mean(**kw).size
    assert np.all(rec["count"] == n)


def test_unknown_size():
    with pytest.raises(ValueError) as e:
        A.generate_field("huge")
    assert str(e.value) == (
        "array-stats: unknown size 'huge'; choose one of small, medium, large."
    )


@pytest.mark.parametrize("seed", [-1, 1.5, "0", True])
def test_bad_seed_fails_before_any_work(seed):
    with pytest.raises(ValueError) as e:
        A.run(None, size="small", seed=seed)  # no client needed: checked first
    assert str(e.value) == f"array-stats: seed must be a non-negative int, got {seed!r}."


def test_sizes_are_as_documented():
    assert A.SIZES["small"].shape == (120, 32, 64)
    assert 240e6 < A.SIZES["medium"].nbytes < 260e6
    assert A.SIZES["large"].nbytes == 3650 * 360 * 720 * 4
    for name in ("medium", "large"):
        assert 30e6 <= A.SIZES[name].block_nbytes <= 130e6, name  # ~32-128 MB blocks


def test_progress_bar_on_request(client, capsys):
    result = A.run(client, size="small", progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""  # bars go to stderr: stdout stays the program's output
    label = "array-stats (small) generate, anomalies, moments"
    assert f"{label}: 100%" in captured.err
    assert f"{result.n_tasks}/{result.n_tasks}" in captured.err
    A.run(client, size="small", progress=None)  # pytest's captured stderr is not a tty
    assert capsys.readouterr() == ("", "")


def test_task_counts_none_without_blockflow_plugin():
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        result = A.run(c, size="small", progress=False)
    assert result.task_counts is None
    assert result.stats["count"].shape == (32, 64)


@pytest.mark.slow
def test_output_parquet_and_manifest(client, tmp_path):
    out = tmp_path / "stats"
    result = A.run(client, size="small", output=out, progress=False, seed=2)
    assert result.output == os.path.abspath(out)
    assert sorted(os.listdir(out)) == ["manifest.json", "stats.parquet"]
    assert os.listdir(tmp_path) == ["stats"]  # nothing temporary left beside it
    table = pd.read_parquet(out / "stats.parquet")
    pd.testing.assert_frame_equal(table, result.stats.to_dataframe())
    assert list(table.index.names) == ["lat", "lon"] and len(table) == 32 * 64
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["workload"] == "array-stats" and manifest["seed"] == 2
    assert manifest["shape"] == {"time": 120, "lat": 32, "lon": 64}
    assert manifest["nbytes"] == result.nbytes
    assert manifest["n_tasks"] == result.n_tasks
    assert manifest["task_counts"] == result.task_counts
    assert manifest["statistics"]["var"]["ddof"] == 0
    assert manifest["files"] == {"stats": "stats.parquet"}
    assert manifest["versions"]["blockflow"] == blockflow.__version__
    assert "created" in manifest

    before = blockflow.task_counts(client)
    with pytest.raises(FileExistsError) as e:
        A.run(client, size="small", output=out, progress=False, seed=3)
    assert blockflow.task_counts(client) == before  # refused before any task ran
    assert str(e.value).startswith(f"Output {os.fspath(out)!r} already exists; pass --overwrite")
    assert json.loads((out / "manifest.json").read_text())["seed"] == 2  # untouched
    A.run(client, size="small", output=out, overwrite=True, progress=False, seed=3)
    assert json.loads((out / "manifest.json").read_text())["seed"] == 3
