#!/usr/bin/env python3
"""One-shot GPU check of blockflow: CPU-vs-GPU timings of a blockwise kernel and tree reductions.

Meant to run once on a machine with an NVIDIA GPU (through ``benchmarks/gpu_check.sh``, which
installs carried wheels first), inside a few minutes:

1. report the environment (Python, packages, ``nvidia-smi``);
2. start GPU workers with ``blockflow.connect(gpu=True)`` (``dask_cuda.LocalCUDACluster``),
   falling back to a one-worker ``LocalCluster`` whose worker uses CuPy if dask-cuda cannot
   be imported or started (the reason is printed);
3. print ``blockflow.inventory(client)`` and check its NVML fields (name, UUID, memory);
4. round-trip a dask array and an xarray object through ``to_device`` / ``to_host``;
5. run the pipeline generate -> ``blockflow.map_blocks`` (backend-generic kernel) ->
   ``blockflow.tree_reduce`` (total and per-column sums) on a few GiB of CuPy blocks, and
   check each step against NumPy on a subset small enough for the host;
6. run the same pipeline on NumPy blocks on a ``LocalCluster`` and print a table:
   step, size, GPU time, CPU time, speedup, max abs error vs NumPy.

Every step is guarded: a failure is printed with its traceback and the script goes on.
A soft time budget (``--budget``) skips or shrinks later steps, and a hard watchdog dumps
the stacks and exits if something hangs. Results also go to ``$OUT/gpu_check.txt`` when
``OUT`` is set (or to ``--output``), written as they come, so a killed run still leaves them.

``--cpu-only`` skips every GPU step (for a dry run on a CPU machine).
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback

GiB = 1024**3
MiB = 1024**2
N_COLS = 8192  # float32 columns: 32 KiB per row
DTYPE = "float32"


# --- output ---------------------------------------------------------------------------


class Report:
    """Prints lines and appends them to a file as they come (flushed each time)."""

    def __init__(self, path: str | None):
        self.path = path
        self.passed: list[str] = []
        self.failed: list[str] = []
        self.skipped: list[str] = []
        self._f = None
        if path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                self._f = open(path, "w", buffering=1)
            except OSError as e:
                print(f"[gpu_check] cannot write {path}: {e}", flush=True)

    def __call__(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        if self._f:
            self._f.write(line + "\n")
            self._f.flush()

    def section(self, title: str) -> None:
        self("")
        self(f"=== {title} " + "=" * max(3, 74 - len(title)))

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        (self.passed if ok else self.failed).append(name)
        self(f"[{'PASS' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}")
        return ok

    def skip(self, name: str, why: str) -> None:
        self.skipped.append(name)
        self(f"[SKIP] {name}: {why}")

    def error(self, name: str, exc: BaseException) -> None:
        self.failed.append(name)
        self(f"[FAIL] {name}: {type(exc).__name__}: {exc}")
        for line in traceback.format_exception(type(exc), exc, exc.__traceback__)[-8:]:
            for sub in line.rstrip().splitlines():
                self("    " + sub)

    def close(self) -> None:
        if self._f:
            self._f.close()


class Budget:
    """A soft time budget in seconds, counted from the script's start."""

    def __init__(self, seconds: float):
        self.t0 = time.monotonic()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# --- kernels (pickled by value to the workers; backend-generic) --------------------------


def gen_region(xp, r0: int, r1: int, c0: int, c1: int, dtype=DTYPE):
    """Deterministic test data for rows r0:r1, columns c0:c1 (values in [-1.5, 1.5]).

    The same formula on NumPy and CuPy, so any block can be rebuilt on the host to check a
    device result.
    """
    rows = xp.arange(r0, r1, dtype=xp.float64)[:, None]
    cols = xp.arange(c0, c1, dtype=xp.float64)[None, :]
    v = xp.sin(rows * 1.0e-4 + cols * 1.3e-3) + 0.5 * xp.cos(rows * 7.0e-3 - cols * 2.1e-4)
    return v.astype(dtype)


def gen_block(block_info=None, xp_name="numpy", rep=0):
    """A dask block of :func:`gen_region` (``rep`` only makes the keys of each repeat new)."""
    xp = importlib.import_module(xp_name)
    (r0, r1), (c0, c1) = block_info[None]["array-location"]
    return gen_region(xp, r0, r1, c0, c1)


def transform(block):
    """The blockwise kernel under test: elementwise, a few transcendental ops per element."""
    import blockflow

    xp = blockflow.array_module(block)
    out = xp.tanh(block * 1.5) * 2.0 + xp.sqrt(xp.abs(block)) - xp.exp(-block * block)
    return out.astype(block.dtype, copy=False)


def sum_f64(block, axis=None, keepdims=False):
    """chunk/combine/aggregate of a float64 sum (a tree reduction step)."""
    import blockflow

    xp = blockflow.array_module(block)
    return xp.sum(block, axis=axis, keepdims=keepdims, dtype=xp.float64)


def device_sync() -> bool:
    """Run on a worker: wait until its GPU has finished the queued kernels."""
    try:
        import cupy

        cupy.cuda.runtime.deviceSynchronize()
        return True
    except Exception:
        return False


def to_numpy(x):
    import numpy as np

    if type(x).__module__.split(".")[0] == "cupy":
        return x.get()
    return np.asarray(x)


# --- pipeline -----------------------------------------------------------------------------


def layout(nbytes: float) -> tuple[int, int]:
    """(rows, rows per block) for about ``nbytes`` of float32 data: >= 8 blocks of <= 256 MiB."""
    row_bytes = N_COLS * 4
    block_bytes = min(256 * MiB, max(nbytes / 8, row_bytes))
    rows_per_block = max(1, int(block_bytes // row_bytes))
    n_blocks = max(1, round(nbytes / (rows_per_block * row_bytes)))
    return n_blocks * rows_per_block, rows_per_block


class Pipeline:
    """generate -> map_blocks -> tree_reduce (total, axis=0) on one cluster and backend."""

    STEPS = ("generate", "map_blocks", "tree_reduce sum", "tree_reduce axis=0")

    def __init__(self, client, backend: str, nbytes: float, split_every, report: Report,
                 budget: Budget):
        self.client = client
        self.backend = backend  # "cupy" or "numpy"
        self.rows, self.rows_per_block = layout(nbytes)
        self.nbytes = self.rows * N_COLS * 4
        self.split_every = split_every
        self.report = report
        self.budget = budget
        self.times: dict[str, float] = {}
        self.results: dict[str, object] = {}
        self.errors: dict[str, float] = {}
        self.rel_errors: dict[str, float] = {}

    def _meta(self):
        xp = importlib.import_module(self.backend)
        return xp.empty((0, 0), dtype=DTYPE)

    def build_input(self, rep: int):
        import dask.array as da
        import numpy as np

        return da.map_blocks(
            gen_block, xp_name=self.backend, rep=rep, dtype=np.dtype(DTYPE),
            chunks=((self.rows_per_block,) * (self.rows // self.rows_per_block), (N_COLS,)),
            meta=self._meta(), name=f"gen-{self.backend}-{rep}-{self.rows}",
        )

    def _sync(self):
        if self.backend == "cupy":
            self.client.run(device_sync)

    def _timeout(self) -> float:
        return max(10.0, self.budget.left())

    def run_once(self, rep: int) -> dict[str, float]:
        """One timed pass; returns seconds per step, keeps the last results."""
        import numpy as np
        from distributed import wait

        import blockflow

        t = {}
        t0 = time.perf_counter()
        x = self.build_input(rep).persist()
        wait(x, timeout=self._timeout())
        self._sync()
        t["generate"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        y = blockflow.map_blocks(transform, x, dtype=np.dtype(DTYPE)).persist()
        wait(y, timeout=self._timeout())
        self._sync()
        t["map_blocks"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        total = blockflow.tree_reduce(y, sum_f64, dtype=np.float64, split_every=self.split_every)
        total = self.client.compute(total).result(timeout=self._timeout())
        t["tree_reduce sum"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        cols = blockflow.tree_reduce(y, sum_f64, axis=0, dtype=np.float64,
                                     split_every=self.split_every)
        cols = self.client.compute(cols).result(timeout=self._timeout())
        t["tree_reduce axis=0"] = time.perf_counter() - t0

        self.results = {"x": x, "y": y, "total": float(to_numpy(total)),
                        "cols": to_numpy(cols)}
        return t

    def warm_up(self) -> None:
        """Untimed small pass: starts CUDA contexts and compiles the CuPy kernels."""
        small = Pipeline(self.client, self.backend, 2 * 8 * N_COLS * 4, self.split_every,
                         self.report, self.budget)
        small.run_once(rep=-1)
        small.release()

    def run(self, repeats: int) -> None:
        for rep in range(repeats):
            if rep and self.budget.left() < 4 * sum(self.times.values()) + 30:
                self.report(f"  ({self.backend}: repeat {rep + 1} skipped, time budget)")
                break
            if rep:
                self.release(keep_results=False)
            t = self.run_once(rep)
            self.report(f"  {self.backend} pass {rep + 1}: "
                        + ", ".join(f"{k} {v:.3f} s" for k, v in t.items()))
            for k, v in t.items():
                self.times[k] = min(v, self.times.get(k, float("inf")))

    def check_against_numpy(self) -> None:
        """Max abs error of each step vs NumPy on a host-sized subset (the first blocks)."""
        import numpy as np

        import blockflow

        x, y = self.results["x"], self.results["y"]
        n_blocks = self.rows // self.rows_per_block
        fit = max(1, (256 * MiB) // (self.rows_per_block * N_COLS * 4))
        sub_rows = self.rows_per_block * min(n_blocks, max(2, fit))  # >= 2 blocks: a tree
        x_ref = gen_region(np, 0, sub_rows, 0, N_COLS)
        y_ref = transform(x_ref)

        # Kernels: the backend's blocks vs the same formula in NumPy (float32 rounding apart).
        got_x = to_numpy(self.client.compute(x[:sub_rows]).result(timeout=self._timeout()))
        self.errors["generate"] = float(np.max(np.abs(got_x.astype(np.float64) - x_ref)))
        got_y = to_numpy(self.client.compute(y[:sub_rows]).result(timeout=self._timeout()))
        self.errors["map_blocks"] = float(np.max(np.abs(got_y.astype(np.float64) - y_ref)))

        # Reductions: tree_reduce over the backend's blocks vs NumPy's sum of the same values,
        # so that only the order of summation differs.
        ref_total = float(np.sum(got_y, dtype=np.float64))
        sub_total = blockflow.tree_reduce(y[:sub_rows], sum_f64, dtype=np.float64,
                                          split_every=self.split_every or 2)
        got_total = float(to_numpy(self.client.compute(sub_total).result(
            timeout=self._timeout())))
        self.errors["tree_reduce sum"] = abs(got_total - ref_total)
        self.rel_errors["tree_reduce sum"] = abs(got_total - ref_total) / max(abs(ref_total), 1)

        ref_cols = np.sum(got_y, axis=0, dtype=np.float64)
        sub_cols = blockflow.tree_reduce(y[:sub_rows], sum_f64, axis=0, dtype=np.float64,
                                         split_every=self.split_every or 2)
        got_cols = to_numpy(self.client.compute(sub_cols).result(timeout=self._timeout()))
        self.errors["tree_reduce axis=0"] = float(np.max(np.abs(got_cols - ref_cols)))
        self.rel_errors["tree_reduce axis=0"] = float(
            np.max(np.abs(got_cols - ref_cols) / np.maximum(np.abs(ref_cols), 1)))

        tol = {"generate": 1e-6, "map_blocks": 1e-5}
        for step in self.STEPS:
            err = self.errors[step]
            rel = self.rel_errors.get(step)
            ok = (err <= tol[step]) if step in tol else (rel is not None and rel <= 1e-9)
            self.report.check(
                f"{self.backend} {step} vs NumPy ({fmt_bytes(sub_rows * N_COLS * 4)} subset)",
                ok, f"max abs err {err:.3g}" + (f", rel {rel:.3g}" if rel is not None else ""),
            )

    def release(self, keep_results: bool = False) -> None:
        try:
            futs = [v for k, v in self.results.items() if k in ("x", "y")]
            if futs:
                self.client.cancel(futs)
        except Exception:
            pass
        if not keep_results:
            self.results = {}


# --- steps --------------------------------------------------------------------------------


def package_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return "not installed"


def step_environment(report: Report) -> None:
    report.section("environment")
    report(f"python {sys.version.split()[0]} ({sys.executable}) on {platform.platform()}")
    try:
        import psutil

        mem = fmt_bytes(psutil.virtual_memory().total)
    except Exception:
        mem = "unknown"
    report(f"cpus {os.cpu_count()}, memory {mem}, "
           f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}")
    for name in ("blockflow", "dask", "distributed", "dask-cuda", "rapids-dask-dependency",
                 "numpy", "pandas", "pyarrow", "xarray", "bokeh", "cupy-cuda13x",
                 "cupy-cuda12x", "cuda-core", "cuda-bindings", "nvidia-ml-py", "cudf-cu13",
                 "cudf-cu12", "numba", "numba-cuda", "torch"):
        report(f"  {name:24s} {package_version(name)}")
    for mod in ("dask_cuda", "cupy", "cudf", "pynvml"):
        try:
            m = importlib.import_module(mod)
            report(f"  import {mod:17s} ok ({getattr(m, '__file__', '')})")
        except Exception as e:
            report(f"  import {mod:17s} FAILED: {type(e).__name__}: {e}")
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=index,name,uuid,memory.total,memory.used,"
                 "driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30,
            )
            for line in (out.stdout or out.stderr).strip().splitlines():
                report(f"  nvidia-smi: {line}")
        except Exception as e:
            report(f"  nvidia-smi failed: {e}")
    else:
        report("  nvidia-smi: not on PATH")


def start_gpu_client(args, report: Report):
    """LocalCUDACluster through blockflow.connect(gpu=True), else LocalCluster + CuPy."""
    import blockflow
    from blockflow.backends import gpu_device_count

    report.section("GPU cluster")
    n = gpu_device_count()
    report(f"blockflow.backends.gpu_device_count() = {n}")
    t0 = time.perf_counter()
    try:
        client = blockflow.connect(gpu=True, dashboard_address=":0", policy=args.policy)
        report(f"blockflow.connect(gpu=True) -> {type(client.cluster).__name__} in "
               f"{time.perf_counter() - t0:.1f} s")
        report.check("connect(gpu=True) starts LocalCUDACluster",
                     type(client.cluster).__name__ == "LocalCUDACluster")
        return client, "LocalCUDACluster"
    except Exception as e:
        report.error("connect(gpu=True)", e)
    if n == 0:
        report("no GPU visible: no fallback possible")
        return None, None
    try:
        import cupy  # noqa: F401
    except Exception as e:
        report.error("import cupy for the fallback", e)
        return None, None
    report("falling back to a LocalCluster with one worker (1 thread) whose tasks use CuPy")
    t0 = time.perf_counter()
    try:
        # memory_limit=0: no host-memory spilling or pausing, which would count the CuPy
        # blocks as host data and write them to disk
        client = blockflow.connect(gpu=False, n_workers=1, threads_per_worker=1,
                                   memory_limit=0, dashboard_address=":0", policy=args.policy)
        report(f"LocalCluster fallback up in {time.perf_counter() - t0:.1f} s")
        return client, "LocalCluster+CuPy (fallback)"
    except Exception as e:
        report.error("LocalCluster fallback", e)
        return None, None


def step_inventory(client, report: Report, expect_gpu: bool) -> None:
    import blockflow

    report.section("inventory")
    deadline = time.monotonic() + 15
    inv = blockflow.inventory(client)
    while expect_gpu and time.monotonic() < deadline and not (
        len(inv) and inv.n_gpus == len(inv) and all(w.gpu_uuid for w in inv)
    ):
        time.sleep(0.5)  # GPU metrics arrive with the workers' heartbeats
        inv = blockflow.inventory(client)
    report(repr(inv))
    for w in inv:
        report(f"  {w.address}: device={w.device} name={w.gpu_name!r} uuid={w.gpu_uuid!r} "
               f"memory total={w.gpu_memory_total} used={w.gpu_memory_used} "
               f"util={w.gpu_utilization} threads={w.threads} host limit="
               f"{fmt_bytes(w.memory_limit)} simulated={w.simulated}")
    if not expect_gpu:
        return
    report.check("inventory: every worker has device 'gpu'",
                 len(inv) > 0 and all(w.device == "gpu" for w in inv))
    report.check("inventory: GPU name", all(bool(w.gpu_name) for w in inv),
                 ", ".join(str(w.gpu_name) for w in inv))
    report.check("inventory: UUID starts 'GPU-'",
                 all(str(w.gpu_uuid).startswith("GPU-") for w in inv),
                 ", ".join(str(w.gpu_uuid) for w in inv))
    report.check("inventory: device memory total > 0 and used >= 0",
                 all((w.gpu_memory_total or 0) > 0 and w.gpu_memory_used is not None
                     and w.gpu_memory_used >= 0 for w in inv),
                 ", ".join(f"{fmt_bytes(w.gpu_memory_used)} / {fmt_bytes(w.gpu_memory_total)}"
                           for w in inv))
    report.check("inventory: not simulated", not any(w.simulated for w in inv))


def step_round_trip(client, report: Report) -> None:
    import dask.array as da
    import numpy as np

    import blockflow

    report.section("to_device / to_host round trip")
    x_np = np.random.default_rng(0).normal(size=(2000, 500))
    x = da.from_array(x_np, chunks=(500, 250))
    dev = blockflow.to_device(x)
    block = client.compute(dev.blocks[0, 0]).result(timeout=60)
    report.check("to_device: blocks are CuPy", type(block).__module__.startswith("cupy"),
                 type(block).__module__ + "." + type(block).__name__)
    back = client.compute(blockflow.to_host(dev)).result(timeout=60)
    report.check("dask array round trip", isinstance(back, np.ndarray)
                 and np.array_equal(back, x_np))
    try:
        import xarray as xr
    except ImportError as e:
        report.skip("xarray round trip", str(e))
        return
    arr = xr.DataArray(x, dims=("t", "s"), coords={"t": np.arange(2000)}, name="f",
                       attrs={"units": "K"})
    devx = blockflow.to_device(arr)
    report.check("xarray to_device: CuPy meta", type(devx.data._meta).__module__ == "cupy")
    backx = blockflow.to_host(devx).compute()
    report.check("xarray round trip", isinstance(backx.data, np.ndarray)
                 and backx.identical(arr.compute()))


def start_cpu_client(args, report: Report):
    import blockflow

    report.section("CPU cluster")
    threads = args.cpu_threads or os.cpu_count() or 1
    t0 = time.perf_counter()
    # memory_limit=0: no spilling or pausing, so the timings measure compute only (the
    # machine's reported memory can start low and grow as it is used)
    client = blockflow.connect(gpu=False, n_workers=1, threads_per_worker=threads,
                               memory_limit=0, dashboard_address=":0", policy=args.policy)
    report(f"LocalCluster: 1 worker x {threads} threads (NumPy blocks, no memory limit), up in "
           f"{time.perf_counter() - t0:.1f} s")
    return client


def close_client(client, report: Report) -> None:
    if client is None:
        return
    try:
        cluster = client.cluster
        client.close(timeout=20)
        if cluster is not None:
            cluster.close(timeout=30)
    except Exception as e:
        report(f"  (closing the cluster: {type(e).__name__}: {e})")


def run_backend(client, backend: str, nbytes: float, args, report: Report, budget: Budget):
    """Warm up, time and check one backend's pipeline; returns the Pipeline (or None)."""
    from blockflow.reduction import choose_split_every, smallest_worker_memory

    p = Pipeline(client, backend, nbytes, args.split_every, report, budget)
    mem, source = smallest_worker_memory(client)
    fan_in = args.split_every or choose_split_every(p.rows_per_block * N_COLS * 4, mem)
    n_blocks = p.rows // p.rows_per_block
    report(f"{backend}: {fmt_bytes(p.nbytes)} float32, shape ({p.rows}, {N_COLS}), "
           f"{n_blocks} blocks of {fmt_bytes(p.rows_per_block * N_COLS * 4)}; tree_reduce "
           f"split_every={fan_in} ({'given' if args.split_every else 'blockflow heuristic'}, "
           f"smallest worker {source} memory {fmt_bytes(mem)})")
    t0 = time.perf_counter()
    try:
        p.warm_up()
        report(f"  warm-up (compiles kernels): {time.perf_counter() - t0:.2f} s")
    except Exception as e:
        report.error(f"{backend} warm-up", e)
        return None
    try:
        p.run(args.repeat)
    except Exception as e:
        report.error(f"{backend} pipeline", e)
        return p if p.times else None
    try:
        p.check_against_numpy()
    except Exception as e:
        report.error(f"{backend} check vs NumPy", e)
    return p


def print_table(report: Report, gpu, cpu, mode: str | None) -> None:
    report.section("results")
    if mode:
        report(f"GPU path: {mode}")
    head = (f"{'step':20s} {'size':>10s} {'GPU (s)':>9s} {'CPU (s)':>9s} {'speedup':>9s} "
            f"{'GPU GB/s':>9s} {'CPU GB/s':>9s} {'max abs err vs NumPy':>21s}")
    report(head)
    report("-" * len(head))
    for step in Pipeline.STEPS:
        gt = gpu.times.get(step) if gpu else None
        ct = cpu.times.get(step) if cpu else None
        gb = gpu.nbytes if gpu else None
        cb = cpu.nbytes if cpu else None
        size = fmt_bytes(gb if gb else cb)
        if gb and cb and gb != cb:
            size = f"{fmt_bytes(gb)}|{fmt_bytes(cb)}"
        speed = "n/a"
        if gt and ct:
            # per byte, so that different GPU and CPU sizes still compare
            speed = f"{(ct / cb) / (gt / gb):.1f}x"
        err_src = gpu if (gpu and step in gpu.errors) else cpu
        err = err_src.errors.get(step) if err_src else None
        err_txt = "n/a" if err is None else f"{err:.3g}"
        if err_src is cpu and err is not None and gpu is not None:
            err_txt += " (CPU)"
        report(f"{step:20s} {size:>10s} "
               f"{(f'{gt:.4f}' if gt else 'n/a'):>9s} {(f'{ct:.4f}' if ct else 'n/a'):>9s} "
               f"{speed:>9s} {(f'{gb / gt / 1e9:.1f}' if gt else 'n/a'):>9s} "
               f"{(f'{cb / ct / 1e9:.1f}' if ct else 'n/a'):>9s} {err_txt:>21s}")
    if gpu and cpu and gpu.results and cpu.results and gpu.nbytes == cpu.nbytes:
        g, c = gpu.results["total"], cpu.results["total"]
        rel = abs(g - c) / max(abs(c), 1)
        report(f"full-size tree_reduce sum: GPU {g!r} vs CPU {c!r} (rel diff {rel:.3g})")
        # The kernels' float32 results differ by rounding between CuPy and NumPy.
        report.check("full-size sum: GPU agrees with CPU to float32 rounding (rel 1e-5)",
                     rel <= 1e-5, f"rel diff {rel:.3g}")
    report("times: best of the timed passes; GPU steps end with a device synchronise; "
           "tree_reduce includes returning the result to the client.")


# --- main ---------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " See the module docstring for the steps.",
    )
    p.add_argument("--gb", type=float, default=4.0,
                   help="GiB of float32 data on the GPU (default 4)")
    p.add_argument("--cpu-gb", type=float, default=None,
                   help="GiB on the CPU path (default: same as --gb; speedups are per byte)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="threads of the CPU worker (default: all CPUs)")
    p.add_argument("--repeat", type=int, default=2, help="timed passes per backend (best kept)")
    p.add_argument("--split-every", type=int, default=None,
                   help="tree_reduce fan-in (default: blockflow's memory-based choice)")
    p.add_argument("--policy", default="off",
                   help="blockflow scheduler policy for the clusters (default off: timing)")
    p.add_argument("--cpu-only", action="store_true", help="skip every GPU step (dry run)")
    p.add_argument("--skip-cpu", action="store_true", help="skip the CPU timings")
    p.add_argument("--budget", type=float, default=200.0,
                   help="soft time budget in seconds (default 200); later steps shrink or skip")
    p.add_argument("--output", default=None,
                   help="results file (default $OUT/gpu_check.txt when OUT is set)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.output or (os.path.join(os.environ["OUT"], "gpu_check.txt")
                          if os.environ.get("OUT") else None)
    report = Report(out)
    budget = Budget(args.budget)
    # Hard stop: dump every thread's stack and exit if the run hangs well past its budget.
    faulthandler.dump_traceback_later(args.budget + 60, exit=True)
    # Quieter Dask logs (INFO lines of every cancel and close) here and in worker processes.
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
    logging.getLogger("distributed").setLevel(logging.WARNING)
    report(f"blockflow GPU check, {time.strftime('%Y-%m-%d %H:%M:%S')}, budget {args.budget:g} s"
           + (" (--cpu-only)" if args.cpu_only else ""))

    try:
        step_environment(report)
    except Exception as e:
        report.error("environment", e)
    try:
        import blockflow  # noqa: F401
    except Exception as e:
        report.error("import blockflow", e)
        report.close()
        return 2

    gpu = cpu = None
    mode = None
    if not args.cpu_only:
        client = None
        try:
            client, mode = start_gpu_client(args, report)
        except Exception as e:
            report.error("GPU cluster", e)
        if client is not None:
            try:
                step_inventory(client, report, expect_gpu=True)
            except Exception as e:
                report.error("inventory", e)
            try:
                step_round_trip(client, report)
            except Exception as e:
                report.error("round trip", e)
            report.section(f"GPU pipeline ({mode})")
            try:
                gpu = run_backend(client, "cupy", args.gb * GiB, args, report, budget)
            except Exception as e:
                report.error("GPU pipeline", e)
            if gpu:
                gpu.release(keep_results=True)
            close_client(client, report)
        report(f"(elapsed {budget.elapsed():.0f} s)")

    if not args.skip_cpu:
        cpu_bytes = (args.cpu_gb if args.cpu_gb is not None else args.gb) * GiB
        if budget.left() < 60:
            cpu_bytes = min(cpu_bytes, GiB / 4)
            report(f"(time budget: CPU path shrunk to {fmt_bytes(cpu_bytes)})")
        if budget.left() < 15:
            report.skip("CPU pipeline", "time budget spent")
        else:
            client = None
            try:
                client = start_cpu_client(args, report)
                if args.cpu_only:
                    step_inventory(client, report, expect_gpu=False)
                report.section("CPU pipeline (LocalCluster, NumPy)")
                cpu = run_backend(client, "numpy", cpu_bytes, args, report, budget)
                if cpu:
                    cpu.release(keep_results=True)
            except Exception as e:
                report.error("CPU pipeline", e)
            close_client(client, report)

    try:
        print_table(report, gpu, cpu, mode)
    except Exception as e:
        report.error("results table", e)
    report("")
    report(f"SUMMARY: {len(report.passed)} passed, {len(report.failed)} failed, "
           f"{len(report.skipped)} skipped in {budget.elapsed():.0f} s"
           + (f"; failed: {', '.join(report.failed)}" if report.failed else ""))
    if out:
        report(f"(written to {out})")
    faulthandler.cancel_dump_traceback_later()
    report.close()
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
