"""``blockflow run JOB --objective/--deadline/--budget`` and the pools of the ``blockflow.pools``
setting, run as a user runs them: ``python -m blockflow`` in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from loadaware import scaled

import blockflow
from blockflow.cli import run_group

#: Two pools on two providers, as a user's Dask config file declares them.
POOLS = [
    {"name": "cheap", "provider": "onprem", "price": 0.5, "workers": 2},
    {"name": "fast", "provider": "gcp", "price": 4.0, "egress": 0.12, "speed": 2,
     "workers": 1},
]


#: pytest's own bound on each test here: above the load-scaled subprocess bounds (``scaled``
#: stretches up to 10x), so that the scaled bound, which says what was waited for, fails.
pytestmark = pytest.mark.timeout(3600)


def _blockflow(*args: str, config_dir=None, env: dict | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m blockflow ARGS`` in a fresh process, reading the Dask config files of
    ``config_dir`` (DASK_CONFIG), dashboard on a free port."""
    full = {**os.environ, "DASK_BLOCKFLOW__CLUSTER__DASHBOARD_ADDRESS": "127.0.0.1:0",
            **(env or {})}
    if config_dir is not None:
        full["DASK_CONFIG"] = str(config_dir)
    return subprocess.run([sys.executable, "-m", "blockflow", *args], capture_output=True,
                          text=True, timeout=scaled(timeout), env=full)


def _config(tmp_path, pools) -> os.PathLike:
    """A Dask config folder holding ``pools.yaml`` with ``blockflow.pools: pools``."""
    folder = tmp_path / "dask-config"
    folder.mkdir()
    (folder / "pools.yaml").write_text(yaml.safe_dump({"blockflow": {"pools": pools}}))
    return folder


def _one_error_line(proc, message: str, status: int) -> None:
    assert proc.returncode == status, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr == message + "\n", proc.stderr


UNPRICED_DEFAULT = ("Error: {option} needs each pool's price, but the embedded cluster's "
                    "workers are all in the pool 'default', which has none; declare pools "
                    "with prices in the blockflow.pools setting (a Dask config file: "
                    "docs/guide/pools.md, 'Pools in a config file'), or run on a cluster "
                    "with priced pools (--address).")


def test_every_run_job_is_covered():
    assert sorted(run_group.commands) == ["array-stats", "flights", "infer", "pipeline",
                                          "train", "tune"]


@pytest.mark.parametrize("args, option", [
    (["--objective", "cost", "--deadline", "10m"], "--objective cost"),
    (["--objective", "makespan", "--budget", "2.5"], "--budget"),
])
def test_an_objective_needing_prices_on_the_unpriced_embedded_cluster_is_one_line(
        tmp_path, args, option):
    # the pools guide's own command: exit status 1 after starting a cluster, the message
    # twice and a 54-line traceback
    out = tmp_path / "out"
    proc = _blockflow("run", "flights", *args, "--n-workers", "2", "--no-progress",
                      "--output", str(out))
    _one_error_line(proc, UNPRICED_DEFAULT.format(option=option), 2)
    assert proc.stdout == ""  # no cluster was started: no dashboard line, no inventory
    assert not out.exists()


@pytest.mark.parametrize("args", [
    ["--objective", "cost"],
    ["--objective", "makespan", "--deadline", "10m"],
    ["--objective", "cost", "--deadline", "10m", "--budget", "3"],
    ["--deadline", "10m", "--budget", "3"],
])
def test_a_bad_combination_is_one_line_from_the_real_command(tmp_path, args):
    proc = _blockflow("run", "array-stats", *args, "--output", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("Error: --")


def test_a_pool_without_a_price_in_the_setting_is_named(tmp_path):
    pools = [POOLS[0], {"name": "spot", "workers": 1}]
    proc = _blockflow("run", "array-stats", "--objective", "cost", "--deadline", "10m",
                      "--output", str(tmp_path / "out"), config_dir=_config(tmp_path, pools))
    _one_error_line(proc, "Error: --objective cost needs each pool's price, but pool 'spot' "
                          "of the blockflow.pools setting has none; give it price: <dollars "
                          "per worker-hour>.", 2)


def test_a_bad_pool_in_the_setting_names_the_pool_and_the_field(tmp_path):
    pools = [POOLS[0], {**POOLS[1], "price": -4}]
    folder = _config(tmp_path, pools)
    proc = _blockflow("run", "array-stats", "--output", str(tmp_path / "out"),
                      config_dir=folder)
    _one_error_line(proc, f"Error: Invalid blockflow setting 'blockflow.pools[1].price' of pool "
                          f"'fast' (from the Dask config file {folder / 'pools.yaml'}): -4 is "
                          f"less than the minimum of 0. See "
                          f"{os.path.dirname(sys.modules['blockflow'].__file__)}"
                          f"/blockflow-schema.yaml for the allowed values.", 2)


def test_n_workers_other_than_the_pools_workers_is_one_line(tmp_path):
    proc = _blockflow("run", "array-stats", "--n-workers", "2", "--output",
                      str(tmp_path / "out"), config_dir=_config(tmp_path, POOLS))
    _one_error_line(proc, "Error: --n-workers is 2 but the blockflow.pools setting puts 3 "
                          "workers in pools (cheap: 2, fast: 1); leave --n-workers out, or "
                          "change the pools' workers.", 2)


@pytest.mark.slow
@pytest.mark.parametrize("args, kind", [
    (["--objective", "cost", "--deadline", "10m"], "cost"),
    (["--budget", "5"], "makespan"),
])
def test_pools_from_a_config_file_give_the_embedded_cluster_prices_for_an_objective(
        tmp_path, args, kind):
    out = tmp_path / "out"
    proc = _blockflow("run", "array-stats", *args, "--no-progress", "--output", str(out),
                      config_dir=_config(tmp_path, POOLS))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "<blockflow.Inventory: 3 workers" in proc.stdout  # the pools' workers, summed
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("tcp://")]
    assert sorted((r[-3], r[-2], r[-1]) for r in rows) == [
        ("cheap", "onprem", "0.5"), ("cheap", "onprem", "0.5"), ("fast", "gcp", "4")]
    cost = json.loads((out / "manifest.json").read_text())["cost"]
    assert cost["objective"]["kind"] == kind  # the job's graphs ran under the objective
    assert set(cost["pools"]) <= {"cheap", "fast"}


@pytest.mark.slow
def test_an_objective_refused_mid_job_is_one_error_line(tmp_path):
    # a deadline no pool sizes meet: the scheduler refuses the graph; its ERROR log line
    # (printed here: the embedded scheduler runs in this process) came before the traceback
    proc = _blockflow("run", "flights", "--objective", "cost", "--deadline", "1ms",
                      "--no-progress", "--output", str(tmp_path / "out"),
                      config_dir=_config(tmp_path, POOLS))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [x for x in proc.stderr.splitlines() if "cannot be met: needs" in x]
    assert len(errors) == 1 and errors[0].startswith(
        "Error: blockflow.objective: deadline 0.001s cannot be met"), proc.stderr
    assert proc.stderr.splitlines()[-1] == errors[0]
    assert not (tmp_path / "out").exists()


def test_a_running_clusters_unpriced_pool_is_one_line_before_any_task(client, tmp_path):
    from click.testing import CliRunner

    from blockflow.cli import cli

    address = client.scheduler.address  # the test cluster, in this process
    before = sum(blockflow.plugin_status(client)["task_counts"].values())
    result = CliRunner().invoke(cli, ["run", "array-stats", "--address", address,
                                      "--objective", "cost", "--deadline", "10m",
                                      "--output", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.output.splitlines()[-1] == (
        f"Error: --objective cost needs each pool's price, but pool 'default' of the cluster "
        f"at {address} has none; start its workers with `--preload blockflow.pools.preload "
        f"--pool default --price <dollars per worker-hour>`, or leave out --objective cost.")
    assert sum(blockflow.plugin_status(client)["task_counts"].values()) == before
    assert not (tmp_path / "out").exists()
