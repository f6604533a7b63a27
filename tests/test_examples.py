"""The scripts in examples/ run as real processes: on an embedded cluster and against a
separately started LocalCluster (``--address``), and write correct Parquet outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from distributed import Client, LocalCluster

from blockflow.scheduling.view import workers_info
from blockflow.workloads import array_stats
from blockflow.workloads.reference import array_stats_reference, flights_reference

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EMBEDDED = ["--n-workers", "2", "--threads-per-worker", "1", "--dashboard-address", ":0"]
ENV = {**os.environ, "DASK_BLOCKFLOW__CLUSTER__GPU": "false"}  # CPU workers on any machine


def _run(script: str, *args: str, cwd: Path, timeout: float = 150) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True,
                         text=True, cwd=cwd, timeout=timeout, env=ENV)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def cluster():
    """A cluster started apart from the scripts, as a user's running scheduler would be."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, protocol="tcp",
                      dashboard_address=":0") as c:
        yield c


@pytest.fixture(scope="module")
def flights_expected():
    return flights_reference(1)


@pytest.fixture(scope="module")
def array_expected():
    """NumPy statistics of the small field, and its anomaly in memory."""
    ref = array_stats_reference("small", seed=0)
    field = array_stats.generate_field("small", seed=0)
    anom = array_stats.anomalies(field, array_stats.climatology("small"))
    return ref, anom.compute(scheduler="sync").values


def _check_flights(out: Path, expected: dict[str, pd.DataFrame]) -> None:
    assert sorted(p.name for p in out.iterdir()) == [
        "by_carrier.parquet", "by_origin_month.parquet", "by_route.parquet", "manifest.json"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp folders
    for name, table in expected.items():
        got = pd.read_parquet(out / f"{name}.parquet")
        pd.testing.assert_frame_equal(got, table, check_dtype=False, rtol=1e-9)
    routes = pd.read_parquet(out / "by_route.parquet")
    assert routes["flights"].min() >= 100
    assert routes["arr_delay_mean"].is_monotonic_decreasing
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["input_rows"] == 336_776 and manifest["clean_rows"] == 328_521
    assert sum(manifest["task_counts"].values()) > 0
    assert sorted(manifest["files"]) == ["by_carrier", "by_origin_month", "by_route"]


def _check_array(out: Path, expected) -> None:
    ref, anom = expected
    assert sorted(p.name for p in out.iterdir()) == ["grid.parquet", "manifest.json",
                                                     "zonal.parquet"]
    grid = pd.read_parquet(out / "grid.parquet").set_index(["lat", "lon"])
    want = ref.to_dataframe()
    assert grid.index.equals(want.index)
    for c in ("count", "mean", "var", "min", "max"):
        np.testing.assert_allclose(grid[c], want[c], rtol=1e-6, err_msg=c)
    np.testing.assert_allclose(grid["std"], np.sqrt(want["var"]), rtol=1e-6)
    np.testing.assert_array_equal(grid["days_above"], (anom > 3.0).sum(axis=0).ravel())
    zonal = pd.read_parquet(out / "zonal.parquet")
    assert len(zonal) == 32 and zonal["lat"].is_monotonic_increasing
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["shape"] == {"time": 120, "lat": 32, "lon": 64}


def test_etl_flights_embedded(tmp_path, flights_expected):
    out = tmp_path / "results" / "flights-out"
    proc = _run("etl_flights.py", "--output", str(out), *EMBEDDED, cwd=tmp_path)
    _check_flights(out, flights_expected)
    assert "336,776 flights read, 328,521 after dropping cancelled ones" in proc.stdout
    assert "Dashboard: http://" in proc.stdout


def test_array_pipeline_embedded(tmp_path, array_expected):
    out = tmp_path / "stats-out"
    proc = _run("array_pipeline.py", "--output", str(out), "--split-every", "2", *EMBEDDED,
                cwd=tmp_path)
    _check_array(out, array_expected)
    assert f"manifest.json to {out}" in proc.stdout


@pytest.mark.parametrize("script", ["etl_flights.py", "array_pipeline.py"])
def test_example_against_running_cluster(script, tmp_path, cluster, flights_expected,
                                         array_expected):
    out = tmp_path / "out"
    _run(script, "--address", cluster.scheduler_address, "--output", str(out), cwd=tmp_path)
    if script == "etl_flights.py":
        _check_flights(out, flights_expected)
    else:
        _check_array(out, array_expected)
    with Client(cluster) as client:  # the script closed its client, not the cluster
        assert client.submit(sum, [1, 2]).result() == 3
        assert len(workers_info(client)) == 2


def test_existing_output_fails_before_any_work(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, str(EXAMPLES / "array_pipeline.py"), "--output",
                           str(out), "--address", "tcp://127.0.0.1:1"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"Error: Output {str(out)!r} already exists; pass --overwrite")
    assert os.listdir(out) == []


def test_embedded_options_with_address_are_a_usage_error(tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLES / "etl_flights.py"), "--output",
                           str(tmp_path / "out"), "--address", "tcp://127.0.0.1:1",
                           "--n-workers", "2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "configure the embedded cluster; drop them with --address." in proc.stderr
