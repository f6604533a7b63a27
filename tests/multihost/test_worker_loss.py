"""A worker host whose link is cut as a job starts: the job goes on without it.

Three namespace hosts (:mod:`blockflow.testing.netns`): ``sched`` runs ``dask scheduler
--preload blockflow.scheduling.preload``, ``a`` and ``b`` a plain ``dask worker`` each (TCP).
``python -m blockflow run flights --address`` runs from the test's own host (the bridge); host
``b``'s link is cut as the job connects (its plugins' broadcasts and the inventory's probe
meet a worker that does not answer) or once it printed the inventory (the stages run). The
job exits 0 with the exact tables and names the worker it lost in one line, no traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pandas as pd
import pytest
from loadaware import scaled, wait_until

from blockflow.testing.netns import NamespaceCluster

from .conftest import skip_without_namespaces

pytestmark = pytest.mark.slow

#: The workers' side gives a cut host up after ~12 s (distributed's TCP timeout, 30 s by
#: default); the job's own settings are the defaults, as a user's are.
ENV = {"DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": "12s",
       "DASK_BLOCKFLOW__CLUSTER__POLICY": "dynamic"}


@pytest.fixture(scope="module")
def two_hosts():
    """The scheduler's host and two worker hosts ``a`` and ``b``."""
    skip_without_namespaces()
    with NamespaceCluster({"a": [], "b": []}, env=ENV, timeout=120) as cluster:
        yield cluster


@pytest.fixture
def cluster(two_hosts):
    """:func:`two_hosts` with both workers up (host ``b`` brought back after a test)."""
    with two_hosts.client(timeout=60) as client:
        if len(client.scheduler_info(n_workers=-1)["workers"]) < 2:
            _restart_b(two_hosts, client)
    yield two_hosts
    host = two_hosts.hosts["b"]
    host.restore()


def _restart_b(hosts, client) -> None:
    host = hosts.hosts["b"]
    host.restore()
    host.stop_processes()
    hosts.start_worker("b")
    wait_until(lambda: len(client.scheduler_info(n_workers=-1)["workers"]) == 2,
               timeout=scaled(60, at_most=180), message="host b's worker to rejoin")


@pytest.fixture(scope="module")
def reference():
    from blockflow.workloads.reference import flights_reference

    return flights_reference(1)


#: The clients the scheduler knows (a lambda: the cluster pickles it by value).
_n_clients = lambda dask_scheduler=None: len(dask_scheduler.clients)  # noqa: E731


def _run_and_cut(hosts, tmp_path, when: str) -> tuple[subprocess.CompletedProcess, str]:
    """Run the flights job against ``hosts``, cutting host ``b`` ``when`` (``"connect"``: as
    the job's client reaches the scheduler; ``"after-inventory"``: once it printed the
    inventory, as its stages start)."""
    out = tmp_path / "out"
    b = hosts.hosts["b"]
    with hosts.client(timeout=60) as watcher:
        b_address = next(a for a, w in watcher.scheduler_info(n_workers=-1)["workers"].items()
                         if w["name"] == "b")
        clients = watcher.run_on_scheduler(_n_clients)
        proc = subprocess.Popen(
            [sys.executable, "-m", "blockflow", "run", "flights", "--address", hosts.address,
             "--scale", "1", "--partitions-per-copy", "4", "--no-progress",
             "--output", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        lines: list[str] = []
        inventory_shown = threading.Event()

        def read() -> None:
            for line in proc.stdout:
                if not line.strip() and any(x.startswith("<blockflow.Inventory")
                                            for x in lines):
                    inventory_shown.set()  # the blank line after the inventory's table
                lines.append(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            if when == "connect":
                wait_until(lambda: watcher.run_on_scheduler(_n_clients) > clients
                           or proc.poll() is not None, interval=0.05,
                           message="the job's client to reach the scheduler")
            else:
                wait_until(lambda: inventory_shown.is_set() or proc.poll() is not None,
                           interval=0.05, message="the job's inventory")
            assert proc.poll() is None, f"the job ended before the cut: {proc.stderr.read()}"
            b.cut()
            stderr = proc.stderr.read()
            proc.wait(timeout=scaled(240, at_most=600))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        reader.join(timeout=10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(lines),
                                       stderr), b_address


@pytest.mark.parametrize("when", ["connect", "after-inventory"])
def test_a_worker_host_cut_as_the_job_runs_is_left_out_and_named(cluster, tmp_path,
                                                                   reference, when):
    done, b_address = _run_and_cut(cluster, tmp_path, when)
    print(done.stdout, done.stderr, sep="\n--- stderr ---\n")  # shown when it fails
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout, done.stderr
    out = tmp_path / "out"
    for name, table in reference.items():
        got = pd.read_parquet(out / f"{name}.parquet")
        pd.testing.assert_frame_equal(got, table, check_dtype=False, check_exact=False,
                                      rtol=1e-9)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["input_rows"] == 336_776 and manifest["clean_rows"] == 328_521
    # b is named, each time in one line (the inventory's probe, the run's end), and
    # nothing else is said
    warned = done.stderr.splitlines()
    assert warned and all(line.startswith("Warning: blockflow: ") for line in warned), warned
    assert any(b_address in line for line in warned), warned
    if when == "connect":  # the inventory's probe met it
        assert any(f"going on without worker {b_address}" in line for line in warned), warned
    else:  # its tasks ran again on host a
        assert any(f"{b_address} (host {cluster.hosts['b'].ip}) left during the run" in line
                   for line in warned), warned
