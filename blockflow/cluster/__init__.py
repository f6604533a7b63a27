"""Cluster handling: start or connect, discover resources, rebalance, report what a run did.

Public names are re-exported from :mod:`blockflow`; see the clusters guide. Pools are in
:mod:`blockflow.pools`, device probes in :mod:`blockflow.devices`."""
