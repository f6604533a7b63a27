"""Worker memory of a model shipped by blockflow.predict: before shipping, once arrived,
once loaded (after a predict), and after ``ModelRef.close()``.

A PyTorch ``nn.Module`` of ~40 MiB of parameters, a LocalCluster of 2 worker processes. Each
number is a worker's RSS (``psutil``) after ``gc.collect()`` and ``malloc_trim(0)``, so that
freed memory shows as freed; torch and blockflow are imported on the workers before the
first reading. Run ``python benchmarks/model_memory.py``; with an older blockflow (no
``close()``) the last reading is the run's end, the model left in place.
"""

from __future__ import annotations

import ctypes
import gc
import sys

import dask.array as da
import numpy as np
import psutil
from distributed import Client, LocalCluster

MiB = 2**20


def _rss_after_trim() -> int:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    return psutil.Process().memory_info().rss


def _warm():
    import torch  # noqa: F401

    import blockflow.ml.inference  # noqa: F401
    return _rss_after_trim()


def rss(client) -> list[float]:
    return [v / MiB for v in client.run(_rss_after_trim).values()]


def main() -> int:
    import torch

    import blockflow
    from blockflow.ml import inference

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1024, 5120), torch.nn.ReLU(),
                              torch.nn.Linear(5120, 1024))
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    x = da.from_array(np.random.default_rng(0).standard_normal((2000, 1024), np.float32),
                      chunks=(250, 1024))
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        client.run(_warm)
        rows = [("before shipping", rss(client))]
        ref = inference.ship_model(net, client=client)
        rows.append(("model arrived (bytes)", rss(client)))
        out = blockflow.predict(ref, x).compute()
        assert out.shape == (2000, 1024)
        rows.append(("after predict (loaded)", rss(client)))
        if hasattr(ref, "close"):
            state = inference.cache_state(client)
            ref.close()
            rows.append(("after ref.close()", rss(client)))
        else:
            state = None
            rows.append(("end of run (nothing frees it)", rss(client)))
    base = rows[0][1]
    print(f"model parameters: {params / MiB:.1f} MiB; worker RSS, MiB (2 workers)")
    for label, vals in rows:
        delta = ", ".join(f"{v - b:+.1f}" for v, b in zip(vals, base))
        print(f"  {label:32s} {', '.join(f'{v:.1f}' for v in vals)}   (vs before: {delta})")
    if state is not None:
        print("cache state after predict:",
              {w[-6:]: {t[:8]: m for t, m in s["models"].items()} for w, s in state.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
