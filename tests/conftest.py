"""Shared fixtures: real distributed clusters (no mocks of Dask)."""

from __future__ import annotations

import gc

import pytest
from distributed import Client, LocalCluster

import blockflow
from blockflow.backends import gpu_device_count, has_package

#: Fixtures that start a cluster of worker processes (nannies, spawned interpreters): tens of
#: seconds on a loaded 2-core machine. Every test using one is marked slow, so that
#: ``pytest -m "not slow"`` (the fast subset) runs on in-process clusters only.
PROCESS_CLUSTER_FIXTURES = frozenset({"proc_client", "healthy", "embedded", "tls_client"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if PROCESS_CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _restarted_workers_are_kept():
    """A nanny restarts a killed worker; distributed's SpecCluster closes that nanny for good
    when the scheduler has not seen a worker of its name again within
    ``distributed.deploy.lost-worker-timeout`` (15 s). On a loaded 2-core machine a restart
    (a new interpreter importing blockflow, its plugins started) can take longer. The tests
    kill workers on purpose and wait for their replacements: 5 minutes. (This does not
    explain every lost nanny: one was still dropped with it set; see
    ``tests/reliability/conftest.py``.)"""
    import dask

    with dask.config.set({"distributed.deploy.lost-worker-timeout": "300s"}):
        yield


requires_gpu = pytest.mark.skipif(
    gpu_device_count() == 0 or not has_package("cupy"),
    reason="needs an NVIDIA GPU and CuPy (pip install 'blockflow[gpu]')",
)


@pytest.fixture
def gc_paused():
    """The garbage collector paused for the test. CPython 3.11.7's ``ast.parse`` can fail
    with a spurious "AST constructor recursion depth mismatch" when Python code runs in the
    middle of it (a finalizer the collector calls, which may hand the GIL to another thread
    parsing too: python/cpython#106905); tests that parse blockflow's sources pause it."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(scope="module")
def cluster():
    """An in-process LocalCluster: 2 workers x 1 thread, dashboard on a free port."""
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0",
    ) as c:
        yield c


@pytest.fixture
def client(cluster):
    """A client on the module's cluster with blockflow's scheduler plugin registered."""
    with Client(cluster) as c:
        c.register_plugin(blockflow.scheduling.Rebalancer(policy="off"))
        yield c
