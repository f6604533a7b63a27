"""Kubernetes manifests rendered by blockflow.cluster.kubernetes (no cluster needed)."""

from __future__ import annotations

import sys

import pytest
import yaml

from blockflow.cluster.kubernetes import cluster_spec, worker_group_spec

pytest.importorskip("dask_kubernetes", reason="pip install dask-kubernetes")


def _container(spec: dict, role: str) -> dict:
    (c,) = [c for c in spec["spec"]["containers"] if c["name"] == role]
    return c


def test_cluster_spec_preloads_blockflow_and_declares_worker_resources():
    spec = cluster_spec("etl", "ghcr.io/me/blockflow:1", n_workers=3,
                        worker_resources={"GPU": 1}, gpus_per_worker=1, policy="dynamic",
                        env={"DASK_BLOCKFLOW__CLUSTER__POLICY": "dynamic"},
                        container_resources={"limits": {"memory": "16Gi"}})
    rendered = yaml.safe_load(yaml.safe_dump(spec))  # what kubectl apply -f gets
    assert rendered == spec
    assert spec["apiVersion"] == "kubernetes.dask.org/v1" and spec["kind"] == "DaskCluster"
    assert spec["metadata"]["name"] == "etl"
    scheduler = _container(spec["spec"]["scheduler"], "scheduler")
    assert scheduler["args"] == ["dask-scheduler", "--host", "0.0.0.0", "--preload",
                                 "blockflow.scheduling.preload", "--blockflow-policy",
                                 "dynamic"]
    assert scheduler["resources"] is None  # no GPU for the scheduler
    assert scheduler["image"] == "ghcr.io/me/blockflow:1"
    worker_group = spec["spec"]["worker"]
    assert worker_group["replicas"] == 3
    worker = _container(worker_group, "worker")
    assert worker["args"][-2:] == ["--resources", "GPU=1"]
    assert worker["args"][0] == "dask-worker"
    assert worker["resources"] == {"limits": {"memory": "16Gi", "nvidia.com/gpu": 1}}
    assert worker["env"] == [{"name": "DASK_BLOCKFLOW__CLUSTER__POLICY", "value": "dynamic"}]


def test_cpu_cluster_spec_has_no_gpu_and_no_resources_flag():
    spec = cluster_spec("cpu", "img", n_workers=2)
    worker = _container(spec["spec"]["worker"], "worker")
    assert "--resources" not in worker["args"] and worker["resources"] is None
    scheduler = _container(spec["spec"]["scheduler"], "scheduler")
    assert scheduler["args"][-2:] == ["--preload", "blockflow.scheduling.preload"]


def test_worker_group_spec_for_a_heterogeneous_cluster():
    group = worker_group_spec("etl", "gpu", "img:gpu", n_workers=2,
                              worker_resources={"GPU": 1, "MEM": 2}, gpus_per_worker=1,
                              gpu_resource="amd.com/gpu")
    assert group["kind"] == "DaskWorkerGroup"
    assert group["metadata"] == {"name": "etl-gpu"}
    assert group["spec"]["cluster"] == "etl"
    worker = _container(group["spec"]["worker"], "worker")
    assert group["spec"]["worker"]["replicas"] == 2 and worker["image"] == "img:gpu"
    assert worker["args"][-2:] == ["--resources", "GPU=1 MEM=2"]
    assert worker["resources"] == {"limits": {"amd.com/gpu": 1}}
    assert yaml.safe_load(yaml.safe_dump(group)) == group


@pytest.mark.parametrize("kwargs, message", [
    ({"n_workers": -1}, "n_workers must be an integer >= 0, got -1."),
    ({"gpus_per_worker": 0.5}, "gpus_per_worker must be an integer >= 0, got 0.5."),
    ({"worker_resources": {"GPU": 0}}, "worker_resources: GPU must be a number > 0, got 0."),
    ({"policy": "nope"}, "cluster_spec: unknown policy 'nope'; choose one of "),
    ({"container_resources": {"limit": {}}},
     "container_resources takes 'limits' and 'requests' (Kubernetes' container resources), "
     "got ['limit']."),
])
def test_bad_input_is_one_line(kwargs, message):
    with pytest.raises(ValueError) as e:
        cluster_spec("x", "img", **kwargs)
    assert str(e.value).startswith(message)


def test_without_dask_kubernetes_one_line_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "dask_kubernetes", None)  # as if not installed
    for build in (lambda: cluster_spec("x", "img"),
                  lambda: worker_group_spec("x", "g", "img")):
        with pytest.raises(ImportError) as e:
            build()
        assert str(e.value) == ("blockflow.cluster.kubernetes needs dask-kubernetes, which "
                                "is not installed; pip install dask-kubernetes")
