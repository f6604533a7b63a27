"""A cluster over network-namespace hosts, shared by the module's tests.

Three hosts on a private ``/24`` behind a bridge (:mod:`blockflow.testing.netns`): ``sched``
runs ``dask scheduler --preload blockflow.scheduling.preload``, ``cpu`` a plain ``dask
worker`` and ``gpu`` a ``dask worker --resources GPU=1`` whose simulated device reports
distributed's NVML metric keys. The test process is a fourth host (the bridge's address).
The cluster talks TLS only (self-signed credentials made for it): every test crosses hosts
over TLS.
Skipped, with the reason, where namespaces cannot be created (not root, no iproute2).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
from loadaware import wait_until

import blockflow
from blockflow.errors import BlockflowWarning
from blockflow.testing import SimulatedDevice, SimulatedGPU
from blockflow.testing.netns import NamespaceCluster, netns_unavailable

pytestmark = pytest.mark.slow

#: Settings of the cluster's processes: a host whose link is cut is given up after ~12 s
#: (distributed's TCP keepalive, 30 s by default), tasks needing a resource no worker
#: declares any more fail after 3 s (20 s by default).
CLUSTER_ENV = {
    "DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": "12s",
    "DASK_BLOCKFLOW__RESOURCES__UNSATISFIABLE_TIMEOUT": "3s",
    "DASK_BLOCKFLOW__CLUSTER__POLICY": "dynamic",
    # the tests' own functions travel by reference: the cluster imports them as pytest does
    "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]),
                                                os.environ.get("PYTHONPATH")])),
}
WORKERS = {"cpu": [], "gpu": ["--resources", "GPU=1"]}


def skip_without_namespaces() -> None:
    reason = netns_unavailable()
    if reason:
        pytest.skip(f"multi-host tests need network namespaces: {reason}")


def install_gpu(client) -> None:
    """The simulated device of host ``gpu`` (its worker, and the ones that replace it), once
    its metrics reached the scheduler."""
    client.register_plugin(SimulatedGPU({"gpu": SimulatedDevice()}))
    wait_until(lambda: n_gpus(client) == 1, interval=0.5,
               message="the simulated GPU's metrics to reach the scheduler")


def n_gpus(client) -> int:
    """The inventory's GPUs, asked again and again while workers start: a worker still
    starting on a loaded host may miss the probe's bound (its warning says so; the next
    poll asks it again)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BlockflowWarning)
        return blockflow.inventory(client).n_gpus


@pytest.fixture(scope="module")
def hosts():
    """The three-host cluster (a :class:`~blockflow.testing.netns.NamespaceCluster`)."""
    skip_without_namespaces()
    with NamespaceCluster(WORKERS, env=CLUSTER_ENV, timeout=120, tls=True) as cluster:
        with cluster.client(timeout=60) as client:
            install_gpu(client)
        yield cluster
