"""Bad input, one table: each case raises a given error with an exact message that says what
is wrong and how to fix it.

Many of these messages are also pinned where their feature is tested (test_blockwise.py,
test_reduction.py, test_cluster.py, test_connect_gpu_errors.py, test_config.py); this table
keeps the whole list in one place. Cases that would fail on some machines for a good reason
(a GPU is visible, CuPy is installed) are skipped there.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from loadaware import scaled

import blockflow
from blockflow import config
from blockflow.backends import GPUUnavailableError, gpu_device_count, has_package
from blockflow.errors import BlockKernelError, EmptyCollectionError
from blockflow.workloads import flights

SCHEMA = config.SCHEMA_PATH
GPU_HINT = 'pip install "blockflow[gpu]"'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT = _free_port()  # nothing listens here


def as_float32(b):
    return b.astype("f4")


def first_row(b, block_id=None):
    return b[:1] if block_id == (1, 0) else b


def _unknown_chunks():
    x = da.arange(4, chunks=2)
    return x[x > 1]  # boolean indexing: chunk sizes are NaN until computed


def _sync(collection):
    return collection.compute(scheduler="sync")


def _field_plus_offsets_chunked_otherwise():
    import xarray as xr

    field = xr.DataArray(np.zeros(6), dims="x").chunk({"x": 2})
    offsets = xr.DataArray(np.arange(6.0), dims="x").chunk({"x": 3})
    return blockflow.map_blocks(np.add, field, offsets)


def _gpu_message() -> str:
    missing = ["no NVIDIA GPU is visible (NVML and the CUDA runtime report 0 devices)"]
    if not has_package("dask_cuda"):
        missing.append("dask-cuda is not installed")
    return ("blockflow.connect(gpu=True): this machine cannot start GPU workers: "
            + "; ".join(missing) + f". On a machine with an NVIDIA GPU install the GPU extra "
            f"with `{GPU_HINT}`, or pass gpu='auto' or gpu=False to use CPU workers.")


def _connect_with(settings):
    with dask.config.set(settings):
        blockflow.connect(dashboard_address=":0")


no_gpu = pytest.mark.skipif(gpu_device_count() > 0, reason="a GPU is visible here")
no_cupy = pytest.mark.skipif(has_package("cupy"), reason="CuPy is installed here")

CASES = [
    pytest.param(
        lambda: blockflow.map_blocks(np.negative, np.ones(3)), TypeError,
        "blockflow.map_blocks: argument 0 is a numpy.ndarray, not a Dask collection; wrap it "
        "with dask.array.from_array(x, chunks=...).", id="numpy-array"),
    pytest.param(
        lambda: blockflow.map_blocks(len, pd.DataFrame({"a": [1]})), TypeError,
        "blockflow.map_blocks: argument 0 is a pandas.DataFrame, not a Dask collection; wrap "
        "it with dask.dataframe.from_pandas(df, npartitions=...).", id="pandas-frame"),
    pytest.param(
        lambda: blockflow.tree_reduce(pd.Series([1.0]), np.sum), TypeError,
        "blockflow.tree_reduce: the collection is a pandas.Series, not a Dask collection; wrap "
        "it with dask.dataframe.from_pandas(df, npartitions=...).", id="pandas-series-reduce"),
    pytest.param(
        lambda: blockflow.tree_reduce(_unknown_chunks(), np.sum), ValueError,
        "blockflow.tree_reduce: the collection has unknown (NaN) chunk sizes along axis 0; "
        "call x = x.compute_chunk_sizes() first so blocks can be placed and sized.",
        id="nan-chunks"),
    pytest.param(
        lambda: blockflow.map_blocks(np.negative, da.ones((0, 3), chunks=2)),
        EmptyCollectionError,
        "blockflow.map_blocks: argument 0 is empty (shape (0, 3)); there are no blocks to run "
        "on.", id="empty"),
    pytest.param(
        lambda: blockflow.map_blocks(np.add, da.ones((3, 4), chunks=2),
                                     da.ones((3, 4), chunks=(3, 2))), ValueError,
        "blockflow.map_blocks: arguments 0 and 1 have different chunks along axis 0: (2, 1) vs "
        "(3,); rechunk one to match, e.g. y = y.rechunk(x.chunks).", id="mismatched-chunks"),
    pytest.param(
        lambda: blockflow.map_blocks(np.add, da.ones((3, 4), chunks=2), da.ones(4, chunks=4)),
        ValueError,
        "blockflow.map_blocks: arguments 0 and 1 have different chunks along axis 1 of the "
        "output (axis 1 of argument 0, axis 0 of argument 1; axes align from the right, as in "
        "NumPy broadcasting): (2, 2) vs (4,); rechunk one to match, e.g. "
        "y = y.rechunk({0: x.chunks[1]}).", id="mismatched-broadcast-chunks"),
    pytest.param(
        _field_plus_offsets_chunked_otherwise, ValueError,
        "blockflow.map_blocks: arguments 0 and 1 have different chunks along dimension 'x': "
        "(2, 2, 2) vs (3, 3); chunk one to match, e.g. y = y.chunk({'x': (2, 2, 2)}).",
        id="xarray-mismatched-chunks"),
    pytest.param(
        lambda: blockflow.map_blocks(np.sum, da.ones((6, 4), chunks=(2, 4)), drop_axis=0),
        ValueError,
        "blockflow.map_blocks: drop_axis=0 drops axis 0, along which argument 0 has 3 blocks "
        "(2, 2, 2); Dask would join them into one kernel call, but map_blocks runs one call "
        "per block. Rechunk that axis to one block first (x = x.rechunk({0: -1})) or reduce "
        "along it with blockflow.tree_reduce.", id="drop-axis-of-several-blocks"),
    pytest.param(
        lambda: blockflow.map_blocks(np.negative, da.ones(4, chunks=2), new_axis=1,
                                     chunks=((2, 2), (3, 3))), ValueError,
        "blockflow.map_blocks: chunks= splits new axis 1 into 2 blocks (3, 3), so the kernel "
        "would run 2 times on each input block, but map_blocks runs one call per block. Give "
        "the new axis one block (chunks (6,) along it) and rechunk the result afterwards if "
        "needed (y = y.rechunk({1: 3})).", id="new-axis-of-several-blocks"),
    pytest.param(
        lambda: blockflow.map_blocks(len, dd.from_pandas(pd.DataFrame({"a": [1]}),
                                                         npartitions=1), dtype="f8"),
        TypeError,
        "blockflow.map_blocks: dtype= is not used for dataframe inputs; declare the output "
        "with meta= instead.", id="declaration-of-another-kind"),
    pytest.param(
        lambda: blockflow.tree_reduce(da.ones(8, chunks=2), np.sum, split_every=1), ValueError,
        "blockflow.tree_reduce: split_every=1 is too small; a tree reduction combines at least "
        "2 blocks per step (use split_every >= 2, or None to size it from worker memory).",
        id="split-every-1"),
    pytest.param(
        lambda: _sync(blockflow.map_blocks(as_float32, da.ones((3, 4), chunks=(3, 4)),
                                           dtype="f8")), BlockKernelError,
        "blockflow kernel 'as_float32' returned dtype float32 for block (0, 0), but the output "
        "is declared float64; cast inside the kernel or pass dtype=float32/meta= to "
        "map_blocks.", id="kernel-dtype"),
    pytest.param(
        lambda: _sync(blockflow.map_blocks(first_row, da.ones((6, 4), chunks=(3, 4)),
                                           dtype="f8")), BlockKernelError,
        "blockflow kernel 'first_row' returned shape (1, 4) for block (1, 0), but Dask expects "
        "(3, 4) from the output chunks; pass chunks= to map_blocks to declare the block shapes "
        "it returns.", id="kernel-shape"),
    pytest.param(
        lambda: blockflow.connect(gpu=True, dashboard_address=":0"), GPUUnavailableError,
        _gpu_message(), id="gpu-on-cpu-machine", marks=no_gpu),
    pytest.param(
        lambda: blockflow.to_device(da.ones(4, chunks=2)), GPUUnavailableError,
        f"blockflow.to_device needs the package 'cupy', which is not installed. Install "
        f"blockflow's GPU extra: {GPU_HINT}", id="missing-optional-package", marks=no_cupy),
    pytest.param(
        lambda: blockflow.connect(f"tcp://127.0.0.1:{PORT}", timeout=1), OSError,
        f"blockflow.connect: nothing is listening at 'tcp://127.0.0.1:{PORT}' (connection "
        f"refused for 1 s). Start a scheduler there (`dask scheduler --preload "
        f"blockflow.scheduling.preload`) or check the address and port; to wait longer for a "
        f"scheduler that is still starting, raise timeout= (CLI: --timeout; setting "
        f"blockflow.cluster.connect-timeout).", id="unreachable-scheduler"),
    pytest.param(
        lambda: blockflow.connect(f"tls://127.0.0.1:{PORT}", timeout=1), ValueError,
        f"blockflow.connect: the scheduler at 'tls://127.0.0.1:{PORT}' talks TLS, but no "
        f"credentials were given; pass security=distributed.Security(tls_ca_file=..., "
        f"tls_client_cert=..., tls_client_key=..., require_encryption=True) with that "
        f"cluster's certificates, or set distributed.comm.tls.* in the Dask config.",
        id="tls-without-credentials"),
    pytest.param(
        lambda: blockflow.connect(f"tls://127.0.0.1:{PORT}", security="temporary"), ValueError,
        f"blockflow.connect: security='temporary' makes new self-signed credentials, which "
        f"only an embedded cluster can use; to connect to 'tls://127.0.0.1:{PORT}' pass "
        f"security=distributed.Security(...) with the credentials that cluster trusts.",
        id="temporary-security-with-address"),
    pytest.param(
        lambda: blockflow.connect(security="yes"), TypeError,
        "blockflow.connect: security must be a distributed.Security, 'temporary' or None, got "
        "builtins.str.", id="security-type"),
    pytest.param(
        lambda: _connect_with({"blockflow.rebalancer.hot-high": 500}), ValueError,
        f"Invalid blockflow setting 'blockflow.rebalancer.hot-high': 500 is greater than the "
        f"maximum of 100. See {SCHEMA} for the allowed values.", id="config-at-connect"),
    pytest.param(
        lambda: _connect_with({"blockflow.cluster.policy": "fastest"}), ValueError,
        f"Invalid blockflow setting 'blockflow.cluster.policy': 'fastest' is not one of "
        f"['dynamic', 'memory', 'static-round-robin', 'static-capacity', 'off']. See {SCHEMA} "
        f"for the allowed values.", id="config-policy"),
    pytest.param(
        lambda: flights.run(None, scale=0), ValueError,
        "flights: scale must be an integer >= 1 (copies of the 336,776-row 2013 NYC flights "
        "table), got 0.", id="flights-scale"),
]


@pytest.mark.parametrize("make, error, message", CASES)
def test_bad_input_is_refused_with_what_and_how_to_fix(make, error, message):
    start = time.monotonic()
    with pytest.raises(error) as info:
        make()
    if isinstance(message, re.Pattern):
        assert message.fullmatch(str(info.value)), str(info.value)
    else:
        assert str(info.value) == message
    assert time.monotonic() - start < scaled(15)  # refused fast; never hangs (unreachable: 1 s)


@pytest.mark.slow
def test_invalid_setting_from_the_environment_fails_where_settings_are_used():
    """Importing never fails; connect() (and the CLI, the plugin) name the bad setting."""
    env = dict(os.environ, DASK_BLOCKFLOW__REBALANCER__HOT_HIGH="500")
    out = subprocess.run(
        [sys.executable, "-c", "import blockflow; print('imported', flush=True); "
         "blockflow.connect(n_workers=1, threads_per_worker=1)"],
        env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stdout == "imported\n"
    assert out.stderr.strip().splitlines()[-1] == (
        "ValueError: Invalid blockflow setting 'blockflow.rebalancer.hot-high' (from the "
        "environment variable DASK_BLOCKFLOW__REBALANCER__HOT_HIGH='500'): 500 is greater "
        f"than the maximum of 100. See {SCHEMA} for the allowed values.")


@pytest.mark.slow
def test_a_valid_setting_from_the_environment_is_accepted():
    env = dict(os.environ, DASK_BLOCKFLOW__REBALANCER__HOT_HIGH="70")
    out = subprocess.run(
        [sys.executable, "-c", "import blockflow, dask; "
         "print(dask.config.get('blockflow.rebalancer.hot-high'))"],
        env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "70"
