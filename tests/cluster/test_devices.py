"""blockflow.devices: NVML device lookup and own utilisation, with an injected fake NVML.

CPU first: NVML is faked by :class:`FakeNVML`, an object with the ``pynvml`` function names.
:class:`~blockflow.devices.OwnUtilization` and :func:`~blockflow.devices.capacity` take it as a
parameter; the lookups built on ``distributed.diagnostics.nvml`` see it through that module's
``pynvml`` attribute (the ``fake_nvml`` fixture), so distributed's own parsing of
``CUDA_VISIBLE_DEVICES`` and UUIDs runs for real. Real devices: tests/test_gpu.py.
"""

from __future__ import annotations

import os
from collections import namedtuple
from types import SimpleNamespace

import pytest
from distributed import Client, LocalCluster
from distributed.diagnostics.plugin import WorkerPlugin

from blockflow import _distributed
from blockflow import devices
from blockflow.scheduling.view import workers_info
from blockflow.devices import DeviceMetrics, OwnUtilization
from blockflow.cluster.inventory import _probe_device
from blockflow._distributed.metrics import CAPACITY_METRIC, OWN_UTILIZATION_METRIC

Sample = namedtuple("Sample", "pid timeStamp smUtil memUtil encUtil decUtil")

GPU_UUID = "GPU-9baca7f5-0f2f-01ac-6b05-8da14d6e9005"
MIG_UUID = "MIG-7feb6df5-eccf-5faa-ab00-9a441867e237"


class NVMLError(Exception):
    pass


class NVMLError_NotFound(NVMLError):  # noqa: N801 (pynvml's name)
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801
    pass


class FakeNVML:
    """The pynvml functions blockflow.devices and distributed's nvml helpers call.

    Two GPUs (index 0 and 1); GPU 1 holds one MIG instance. ``samples`` is what
    ``nvmlDeviceGetProcessUtilization`` returns (filtered by timestamp; raised, if an exception;
    called with the timestamp, if callable), ``device_util``
    what ``nvmlDeviceGetUtilizationRates().gpu`` returns (or raises).
    """

    NVMLError = NVMLError
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_NotSupported = NVMLError_NotSupported
    NVML_CLOCK_SM = 1
    NVML_DEVICE_MIG_DISABLE = 0
    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, samples=(), device_util=0):
        self.samples = samples
        self.device_util = device_util
        self.since: list[int] = []  # timestamps asked for
        self.uuids = {0: GPU_UUID, 1: GPU_UUID.replace("9baca7f5", "11111111")}

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, index):
        if index not in self.uuids:
            raise NVMLError("Invalid Argument")
        return ("gpu", index)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        uuid = uuid.decode()
        if uuid == MIG_UUID:
            return ("mig", 1)
        for index, u in self.uuids.items():
            if u == uuid:
                return ("gpu", index)
        raise NVMLError_NotFound("Not Found")

    def nvmlDeviceGetIndex(self, handle):
        if handle[0] == "mig":
            raise NVMLError("Invalid Argument")
        return handle[1]

    def nvmlDeviceGetUUID(self, handle):
        return MIG_UUID if handle[0] == "mig" else self.uuids[handle[1]]

    def nvmlDeviceGetName(self, handle):
        return "Fake MIG 1g.10gb" if handle[0] == "mig" else f"Fake GPU {handle[1]}"

    def nvmlDeviceGetMemoryInfo(self, handle):
        total = 10 * 2**30 if handle[0] == "mig" else 80 * 2**30
        return SimpleNamespace(total=total, used=2**30, free=total - 2**30)

    def nvmlDeviceGetMigMode(self, handle):
        if handle[0] == "mig":
            raise NVMLError_NotSupported("Not Supported")
        return [handle[1], handle[1]]  # GPU 1 is in MIG mode

    def nvmlDeviceGetNumGpuCores(self, handle):
        return 16896

    def nvmlDeviceGetMaxClockInfo(self, handle, clock):
        assert clock == self.NVML_CLOCK_SM
        return 1980

    def nvmlDeviceGetUtilizationRates(self, handle):
        if isinstance(self.device_util, Exception):
            raise self.device_util
        return SimpleNamespace(gpu=self.device_util, memory=0)

    def nvmlDeviceGetProcessUtilization(self, handle, last_seen):
        self.since.append(last_seen)
        if isinstance(self.samples, Exception):
            raise self.samples
        if callable(self.samples):
            return self.samples(last_seen)
        return [s for s in self.samples if s.timeStamp > last_seen]


@pytest.fixture
def fake_nvml(monkeypatch):
    """A FakeNVML as distributed's (initialised) NVML bindings, in this process only."""
    from distributed.diagnostics import nvml

    fake = FakeNVML()
    monkeypatch.setattr(nvml, "pynvml", fake)
    monkeypatch.setattr(nvml, "NVML_STATE", nvml.NVMLState.INITIALIZED)
    monkeypatch.setattr(nvml, "NVML_OWNER_PID", os.getpid())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake


def sample(pid, ts, sm):
    return Sample(pid=pid, timeStamp=ts, smUtil=sm, memUtil=0, encUtil=0, decUtil=0)


ME = os.getpid()
OTHER = ME + 1


# --- own utilisation: None, never 0.0, when NVML cannot attribute it ------------------------


def test_own_utilization_from_samples_with_our_pid():
    nv = FakeNVML(samples=[sample(ME, 10, 30), sample(ME, 20, 45), sample(OTHER, 15, 90)],
                  device_util=99)
    own = OwnUtilization(("gpu", 0), pynvml=nv)
    assert own() == 45.0
    # the next call asks only for samples newer than the newest seen
    nv.samples = [*nv.samples, sample(ME, 30, 250)]
    assert own() == 100.0  # clipped to a percent
    assert nv.since == [0, 20]


@pytest.mark.parametrize("error", [NVMLError("Unknown Error"), NVMLError_NotSupported("MIG"),
                                   RuntimeError("driver gone")])
def test_own_utilization_is_none_when_nvml_raises(error):
    nv = FakeNVML(samples=error, device_util=0)  # even on an idle device
    assert OwnUtilization(("gpu", 0), pynvml=nv)() is None


def test_own_utilization_is_none_for_foreign_pids_on_a_busy_device():
    # a container where NVML reports host PIDs: our own kernels show under another PID
    nv = FakeNVML(samples=[sample(OTHER, 10, 70), sample(OTHER + 1, 11, 5)], device_util=75)
    assert OwnUtilization(("gpu", 0), pynvml=nv)() is None


def test_own_utilization_is_none_for_foreign_busy_samples_even_if_device_reads_idle():
    nv = FakeNVML(samples=[sample(OTHER, 10, 70)], device_util=0)
    assert OwnUtilization(("gpu", 0), pynvml=nv)() is None


def test_own_utilization_is_zero_for_foreign_idle_samples_on_an_idle_device():
    nv = FakeNVML(samples=[sample(OTHER, 10, 0)], device_util=0)
    assert OwnUtilization(("gpu", 0), pynvml=nv)() == 0.0
    nv = FakeNVML(samples=[sample(OTHER, 10, 0)], device_util=40)
    assert OwnUtilization(("gpu", 0), pynvml=nv)() is None


def test_own_utilization_not_found_means_idle_only_on_an_idle_device():
    # NVML_ERROR_NOT_FOUND: no sample newer than the timestamp, i.e. no process ran kernels
    nv = FakeNVML(samples=NVMLError_NotFound("Not Found"), device_util=0)
    assert OwnUtilization(("gpu", 0), pynvml=nv)() == 0.0
    nv.device_util = 1
    assert OwnUtilization(("gpu", 0), pynvml=nv)() == 0.0  # IDLE_UTILIZATION
    nv.device_util = 60  # busy, but nothing to attribute it by
    assert OwnUtilization(("gpu", 0), pynvml=nv)() is None
    nv.device_util = NVMLError("Unknown Error")  # cannot tell whether the device is idle
    assert OwnUtilization(("gpu", 0), pynvml=nv)() is None


def test_own_utilization_empty_samples_count_as_not_found():
    assert OwnUtilization(("gpu", 0), pynvml=FakeNVML(samples=[], device_util=0))() == 0.0
    assert OwnUtilization(("gpu", 0), pynvml=FakeNVML(samples=[], device_util=50))() is None


def test_own_utilization_malformed_sample_is_none():
    nv = FakeNVML(samples=[SimpleNamespace(pid=ME, timeStamp=5, smUtil="n/a")], device_util=0)
    nv.nvmlDeviceGetProcessUtilization = lambda handle, last: nv.samples
    assert OwnUtilization(("gpu", 0), pynvml=nv)() is None


def test_own_utilization_without_nvml_is_none():
    if devices._nvml() is not None:
        pytest.skip("NVML is available here")
    assert OwnUtilization(("gpu", 0))() is None


# --- capacity -------------------------------------------------------------------------------


def test_capacity_is_cores_times_max_sm_clock():
    assert devices.capacity(("gpu", 0), pynvml=FakeNVML()) == 16896 * 1980.0


def test_capacity_is_none_when_unknown():
    nv = FakeNVML()

    def unsupported(handle):
        raise NVMLError_NotSupported("Not Supported")

    nv.nvmlDeviceGetNumGpuCores = unsupported
    assert devices.capacity(("gpu", 0), pynvml=nv) is None
    assert devices.capacity(None, pynvml=FakeNVML()) is None


# --- which device, through distributed's nvml helpers -----------------------------------------


@pytest.mark.parametrize("env, expected", [
    (None, 0), ("1", 1), ("1,0", 1), (f"{GPU_UUID},1", GPU_UUID), (MIG_UUID, MIG_UUID),
    ("", None), ("bogus", None),
])
def test_visible_device(monkeypatch, env, expected):
    if env is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert devices.visible_device() == expected


def test_device_count_clipped_to_visible_devices(fake_nvml, monkeypatch):
    assert devices.device_count() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert devices.device_count() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert devices.device_count() == 0


def test_device_count_is_zero_when_nvml_raises(fake_nvml, monkeypatch):
    def broken():
        raise NVMLError("Driver/library version mismatch")

    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetCount", broken)
    if devices.importlib.util.find_spec("cupy") is None:
        assert devices.device_count() == 0
    else:
        assert isinstance(devices.device_count(), int)


def test_device_count_without_nvml_never_raises():
    assert isinstance(devices.device_count(), int) and devices.device_count() >= 0


def test_device_info_by_index(fake_nvml, monkeypatch):
    assert devices.device_info() == devices.DeviceInfo(
        index=0, name="Fake GPU 0", uuid=GPU_UUID, mig=False, memory_total=80 * 2**30)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    info = devices.device_info()
    assert (info.index, info.name, info.mig) == (1, "Fake GPU 1", True)
    assert devices.memory_total() == 80 * 2**30


def test_device_info_by_uuid(fake_nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", GPU_UUID)
    assert devices.device_info().to_dict() == {
        "index": 0, "name": "Fake GPU 0", "uuid": GPU_UUID, "mig": False,
        "memory_total": 80 * 2**30}


def test_device_info_of_a_mig_instance(fake_nvml, monkeypatch):
    # NVML gives no index for a MIG handle here; the rest is still known
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG_UUID)
    assert devices.device_info() == devices.DeviceInfo(
        index=None, name="Fake MIG 1g.10gb", uuid=MIG_UUID, mig=True, memory_total=10 * 2**30)


@pytest.mark.parametrize("env", ["7", "GPU-00000000-0000-0000-0000-000000000000", "", "bogus"])
def test_device_info_is_none_for_a_device_nvml_cannot_find(fake_nvml, monkeypatch, env):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert devices.device_handle() is None
    assert devices.device_info() is None
    assert devices.memory_total() is None


def test_device_info_without_nvml_is_none():
    if devices._nvml() is not None:
        pytest.skip("NVML is available here")
    assert devices.device_handle() is None and devices.device_info() is None


# --- the worker plugin and the inventory probe, on an in-process cluster ----------------------


def read_device_metrics(dask_worker=None) -> dict:
    return {key: (None if fn is None else fn(dask_worker))
            for key in (OWN_UTILIZATION_METRIC, CAPACITY_METRIC)
            for fn in [_distributed.worker_metric(dask_worker, key)]}


def test_device_metrics_plugin_reports_and_removes_only_its_own(fake_nvml):
    # a new sample at every read; in-process workers share this process's PID
    fake_nvml.samples = lambda last: [sample(ME, last + 1, 42)]
    fake_nvml.device_util = 50
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        client.register_plugin(DeviceMetrics())
        values = client.run(read_device_metrics)
        assert len(values) == 2
        for v in values.values():
            assert v[CAPACITY_METRIC] == 16896 * 1980.0
            assert v[OWN_UTILIZATION_METRIC] == 42.0
        a, b = sorted(values)

        async def heartbeat(dask_worker=None):
            await _distributed.worker_heartbeat(dask_worker)

        client.run(heartbeat)
        seen = workers_info(client)
        assert [seen[w]["metrics"][OWN_UTILIZATION_METRIC] for w in (a, b)] == [42.0, 42.0]

        def replace_own(dask_worker=None):
            _distributed.set_worker_metric(dask_worker, OWN_UTILIZATION_METRIC, lambda w: 7.0)

        client.run(replace_own, workers=[a])
        client.unregister_worker_plugin(DeviceMetrics.name)
        after = client.run(read_device_metrics)
        # worker a keeps the metric another plugin set since; the plugin's own are gone
        assert after[a] == {OWN_UTILIZATION_METRIC: 7.0, CAPACITY_METRIC: None}
        assert after[b] == {OWN_UTILIZATION_METRIC: None, CAPACITY_METRIC: None}


def test_device_metrics_plugin_reports_none_for_foreign_load(fake_nvml):
    fake_nvml.samples = lambda last: [sample(OTHER, last + 1, 80)]
    fake_nvml.device_util = 80
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        client.register_plugin(DeviceMetrics())
        (v,) = client.run(read_device_metrics).values()
        assert v[OWN_UTILIZATION_METRIC] is None


class ModelledDevice(WorkerPlugin):
    """A device-owning plugin by the agreed protocol (not a blockflow test double)."""

    name = "test-modelled-device"

    def __init__(self, description):
        self.description = description

    def describe_device(self):
        return self.description


def test_probe_finds_a_device_plugin_by_describe_device(fake_nvml):
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        # no modelling plugin: NVML (the fake) answers
        (probe,) = client.run(_probe_device).values()
        assert probe == {"gpu_name": "Fake GPU 0", "gpu_uuid": GPU_UUID, "gpu_mig": False}
        # a plugin that models no device here: still NVML
        client.register_plugin(ModelledDevice({}))
        (probe,) = client.run(_probe_device).values()
        assert probe["gpu_name"] == "Fake GPU 0"
        client.unregister_worker_plugin(ModelledDevice.name)
        client.register_plugin(ModelledDevice(
            {"gpu_name": "Model T", "gpu_uuid": "SIM-1", "simulated": True}))
        (probe,) = client.run(_probe_device).values()
        assert probe == {"gpu_name": "Model T", "gpu_uuid": "SIM-1", "simulated": True}


def test_probe_on_a_cpu_worker_is_empty():
    if devices._nvml() is not None:
        pytest.skip("NVML is available here")
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        assert list(client.run(_probe_device).values()) == [{}]
    assert _probe_device() == {}


def test_device_metrics_plugin_reports_the_memory_bandwidth(fake_nvml):
    from blockflow._distributed.metrics import BANDWIDTH_METRIC

    sm_clock = fake_nvml.nvmlDeviceGetMaxClockInfo
    fake_nvml.NVML_CLOCK_MEM = 2  # an H100 SXM's HBM3: 5120 bits at 2619 MHz
    fake_nvml.nvmlDeviceGetMemoryBusWidth = lambda handle: 5120
    fake_nvml.nvmlDeviceGetMaxClockInfo = (
        lambda handle, clock: 2619 if clock == 2 else sm_clock(handle, clock))

    def bandwidth(dask_worker=None):
        return _distributed.worker_metric(dask_worker, BANDWIDTH_METRIC)(dask_worker)

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        client.register_plugin(DeviceMetrics())
        assert list(client.run(bandwidth).values()) == [5120 / 8 * 2619e6 * 2]


def test_memory_a_worker_pool_holds_unused_is_free_to_its_blocks():
    """NVML counts a memory pool's cached bytes as used; the worker reports them
    (``blockflow-device-pool-free``) and they count as free, for block sizing and the
    scheduler alike."""
    from blockflow._distributed.metrics import (
        GPU_MEMORY_TOTAL, GPU_MEMORY_USED, POOL_FREE_METRIC, read_metrics)
    from blockflow.scheduling.view import memory_of

    gib = 2**30
    metrics = {GPU_MEMORY_TOTAL: 80 * gib, GPU_MEMORY_USED: 50 * gib, "gpu_utilization": 0}
    assert read_metrics(metrics).gpu_memory_free == 30 * gib
    pooled = {**metrics, POOL_FREE_METRIC: 35 * gib}
    assert read_metrics(pooled).gpu_memory_used == 15 * gib
    assert memory_of({"metrics": pooled}).device_free == 65 * gib
    # a pool reporting more than NVML's use (samples taken apart): nothing below 0
    assert read_metrics({**metrics, POOL_FREE_METRIC: 60 * gib}).gpu_memory_used == 0
    for bad in (-1, "lots", None, float("nan")):
        assert read_metrics({**metrics, POOL_FREE_METRIC: bad}).gpu_memory_used == 50 * gib
