"""Cluster handling: start or connect, discover resources, report what a run did.

* :mod:`blockflow.cluster.connection` — :func:`~blockflow.connect` (a ``LocalCUDACluster``,
  a ``LocalCluster`` or an address), plugin registration, worker-loss handling;
* :mod:`blockflow.cluster.inventory` — resource discovery (workers, CPUs, GPUs, memory);
* :mod:`blockflow.cluster.report` — run reports;
* :mod:`blockflow.cluster.rebalance` — evening out device memory on request;
* :mod:`blockflow.cluster.handshake`, :mod:`blockflow.cluster.main_guard` — connection details
  (TLS probes, spawned workers' ``__main__``).

Pool clusters are in :mod:`blockflow.pools`; device probes in :mod:`blockflow.devices`.

The public names are re-exported from :mod:`blockflow`.
"""
