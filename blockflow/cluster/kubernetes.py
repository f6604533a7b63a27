"""Kubernetes through dask-kubernetes' operator: ``DaskCluster`` / ``DaskWorkerGroup`` manifests
with blockflow's scheduler preload, worker resources and GPU limits."""

from __future__ import annotations

from typing import Any, Mapping

from blockflow.cluster.hpc import _resources_arg
from blockflow.scheduling.policies import POLICIES

__all__ = ["cluster_spec", "worker_group_spec"]

PRELOAD = "blockflow.scheduling.preload"

_MISSING = ("blockflow.cluster.kubernetes needs dask-kubernetes, which is not installed; "
            "pip install dask-kubernetes")


def _operator():
    try:
        from dask_kubernetes import operator
    except ImportError:
        raise ImportError(_MISSING) from None
    return operator


def _resource_args(worker_resources: Mapping[str, float] | None) -> list[str]:
    return _resources_arg(worker_resources)


def _container_resources(gpus: int, container_resources: Mapping | None,
                         gpu_resource: str) -> dict | None:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise ValueError(f"gpus_per_worker must be an integer >= 0, got {gpus!r}.")
    out = {k: dict(v) for k, v in (container_resources or {}).items()}
    bad = set(out) - {"limits", "requests"}
    if bad:
        raise ValueError(f"container_resources takes 'limits' and 'requests' (Kubernetes' "
                         f"container resources), got {sorted(bad)}.")
    if gpus:
        out.setdefault("limits", {})[gpu_resource] = gpus
    return out or None


def _env(env: Mapping[str, str] | None) -> list[dict] | None:
    if not env:
        return None
    return [{"name": str(k), "value": str(v)} for k, v in env.items()]


def _check_count(n: int, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {n!r}.")
    return n


def _worker(spec: dict, worker_resources, gpus, container_resources, gpu_resource) -> dict:
    (container,) = [c for c in spec["spec"]["containers"] if c.get("name") == "worker"]
    container["args"] = list(container["args"]) + _resource_args(worker_resources)
    container["resources"] = _container_resources(gpus, container_resources, gpu_resource)
    return spec


def cluster_spec(name: str, image: str, n_workers: int = 1, *,
                 worker_resources: Mapping[str, float] | None = None,
                 gpus_per_worker: int = 0, policy: str | None = None,
                 env: Mapping[str, str] | None = None,
                 container_resources: Mapping[str, Mapping] | None = None,
                 gpu_resource: str = "nvidia.com/gpu", **operator_kwargs: Any) -> dict:
    """A dask-kubernetes ``DaskCluster`` manifest whose scheduler runs blockflow's plugin.

    Parameters
    ----------
    name : str
        A Kubernetes name.
    image : str
        Container image with blockflow installed.
    n_workers : int, default 1
    worker_resources : dict, optional
        Dask worker resources (``{"GPU": 1}``).
    gpus_per_worker : int, default 0
    policy : str, optional
        A built-in name or the dotted path of a policy class on the scheduler's image;
        default ``blockflow.cluster.policy``.
    env : dict, optional
    container_resources : dict, optional
        Kubernetes ``limits`` / ``requests`` of the worker containers.
    gpu_resource : str, default "nvidia.com/gpu"
    **operator_kwargs
        Passed to ``dask_kubernetes.operator.make_cluster_spec``.

    Returns
    -------
    dict
        The ``kubernetes.dask.org/v1`` ``DaskCluster`` resource.

    Raises
    ------
    ImportError
        If dask-kubernetes is not installed.
    ValueError
        For an invalid argument.

    Examples
    --------
    >>> spec = cluster_spec("etl", "ghcr.io/me/blockflow:latest", n_workers=4,
    ...                     worker_resources={"GPU": 1}, gpus_per_worker=1)  # doctest: +SKIP
    >>> cluster = KubeCluster(custom_cluster_spec=spec)                      # doctest: +SKIP
    """
    operator = _operator()
    _check_count(n_workers, "n_workers")
    spec = operator.make_cluster_spec(name, image=image, n_workers=n_workers, env=_env(env),
                                      **operator_kwargs)
    (scheduler,) = [c for c in spec["spec"]["scheduler"]["spec"]["containers"]
                    if c.get("name") == "scheduler"]
    args = list(scheduler["args"]) + ["--preload", PRELOAD]
    if policy is not None:
        if policy not in POLICIES and "." not in policy:  # a dotted path loads there
            raise ValueError(f"cluster_spec: unknown policy {policy!r}; choose one of "
                             f"{', '.join(POLICIES)}.")
        args += ["--blockflow-policy", policy]
    scheduler["args"] = args
    _worker(spec["spec"]["worker"], worker_resources, gpus_per_worker, container_resources,
            gpu_resource)
    return spec


def worker_group_spec(cluster: str, name: str, image: str, n_workers: int = 1, *,
                      worker_resources: Mapping[str, float] | None = None,
                      gpus_per_worker: int = 0, env: Mapping[str, str] | None = None,
                      container_resources: Mapping[str, Mapping] | None = None,
                      gpu_resource: str = "nvidia.com/gpu",
                      worker_command: str = "dask-worker") -> dict:
    """A ``DaskWorkerGroup`` manifest named ``<cluster>-<name>``: more workers for a DaskCluster.

    Other parameters and errors as for :func:`cluster_spec`."""
    operator = _operator()
    _check_count(n_workers, "n_workers")
    worker = operator.make_worker_spec(image=image, n_workers=n_workers, env=_env(env),
                                       worker_command=worker_command)
    _worker(worker, worker_resources, gpus_per_worker, container_resources, gpu_resource)
    return {
        "apiVersion": "kubernetes.dask.org/v1",
        "kind": "DaskWorkerGroup",
        "metadata": {"name": f"{cluster}-{name}"},
        "spec": {"cluster": cluster, "worker": worker},
    }
