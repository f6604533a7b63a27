"""CPU-only: ``blockflow.connect(gpu=True)`` fails clearly and early where GPUs cannot be used.

Not marked ``gpu``: this runs on the CPU machines (developers', CI's). It skips only where an
NVIDIA GPU is actually visible, since there the call would succeed.
"""

from __future__ import annotations

import dask
import pytest

import blockflow
from blockflow.backends import gpu_device_count, has_package

pytestmark = pytest.mark.skipif(
    gpu_device_count() > 0,
    reason="an NVIDIA GPU is visible here, so connect(gpu=True) does not fail (see test_gpu.py)",
)


def expected_message() -> str:
    """The exact message of blockflow/cluster.py for this machine's missing pieces."""
    missing = ["no NVIDIA GPU is visible (NVML and the CUDA runtime report 0 devices)"]
    if not has_package("dask_cuda"):
        missing.append("dask-cuda is not installed")
    return (
        "blockflow.connect(gpu=True): this machine cannot start GPU workers: "
        + "; ".join(missing)
        + '. On a machine with an NVIDIA GPU install the GPU extra with '
        '`pip install "blockflow[gpu]"`, or pass gpu=\'auto\' or gpu=False to use CPU workers.'
    )


def test_expected_message_on_a_plain_cpu_machine():
    # Pins the literal text for the usual CPU machine (no GPU, no dask-cuda), independent of
    # the helper above, so that a change of wording shows up here.
    if has_package("dask_cuda"):
        pytest.skip("dask-cuda is installed here; the message lists one missing piece only")
    assert expected_message() == (
        "blockflow.connect(gpu=True): this machine cannot start GPU workers: no NVIDIA GPU is "
        "visible (NVML and the CUDA runtime report 0 devices); dask-cuda is not installed. "
        'On a machine with an NVIDIA GPU install the GPU extra with `pip install '
        '"blockflow[gpu]"`, or pass gpu=\'auto\' or gpu=False to use CPU workers.'
    )


def test_connect_gpu_true_raises_gpu_unavailable():
    with pytest.raises(blockflow.GPUUnavailableError) as info:
        blockflow.connect(gpu=True, dashboard_address=":0")
    assert str(info.value) == expected_message()
    # A RuntimeError too, so callers catching RuntimeError keep working.
    assert isinstance(info.value, RuntimeError)


def test_gpu_true_from_config_raises_the_same():
    with dask.config.set({"blockflow.cluster.gpu": True}):
        with pytest.raises(blockflow.GPUUnavailableError) as info:
            blockflow.connect(dashboard_address=":0")
    assert str(info.value) == expected_message()


def test_explicit_gpu_true_wins_over_config_false():
    with dask.config.set({"blockflow.cluster.gpu": False}):
        with pytest.raises(blockflow.GPUUnavailableError) as info:
            blockflow.connect(gpu=True, dashboard_address=":0")
    assert str(info.value) == expected_message()


def test_no_cluster_starts(monkeypatch):
    import blockflow.cluster.connection

    started = []
    monkeypatch.setattr(blockflow.cluster.connection, "_start_local_cluster",
                        lambda *a, **k: started.append((a, k)))
    with pytest.raises(blockflow.GPUUnavailableError):
        blockflow.connect(gpu=True, dashboard_address=":0")
    # The check comes before any cluster or client starts.
    assert started == []
