#!/usr/bin/env python3
"""One-shot GPU check of blockflow: inventory, round trips, blockwise kernels and tree
reductions on CuPy blocks, measured against one CuPy call and the device's copy bandwidth.

Meant to run once on a machine with an NVIDIA GPU (through ``benchmarks/gpu_check.sh``, which
installs carried wheels first), inside a few minutes:

1. report the environment (Python, packages, ``nvidia-smi``);
2. start GPU workers with ``blockflow.connect(gpu=True)`` (``dask_cuda.LocalCUDACluster``),
   falling back to a one-worker ``LocalCluster`` whose worker uses CuPy if dask-cuda cannot
   be imported or started (the reason is printed);
3. print ``blockflow.inventory(client)`` and check its NVML fields (name, UUID, memory);
4. round-trip a dask array and an xarray object through ``to_device`` / ``to_host``;
5. issue 40, the physical reference: at 1/16, 1/8 and 1/4 of device memory (largest first),
   side by side in one run on the same GPU: ``map_blocks`` (kernel ``2*x``, one pass) and
   ``tree_reduce`` (sum, sum along axis 0) as ONE CuPy call on the whole array (inside the
   worker process, CUDA events), the device's copy (memcpy and ``copyto``: the ceiling),
   blockflow at its default blocks (``blockflow.fit_blocks``), at a naive 256 MiB, and after
   following the advisory line; GB/s of bytes read + written, ratios to one call and to the
   copy, the issue's targets marked; the table also as CSV (:class:`BandwidthRun`);
6. run the pipeline generate -> ``blockflow.map_blocks`` (backend-generic kernel) ->
   ``blockflow.tree_reduce`` (total and per-column sums) on a few GiB of CuPy blocks, and
   check each step against NumPy on a subset small enough for the host;
7. run the same pipeline on NumPy blocks on a ``LocalCluster`` (1 GiB by default) and print a
   table: step, size, GPU time, CPU time, speedup, max abs error vs NumPy.

Every step is guarded: a failure is printed with its traceback and the script goes on.
A soft time budget (``--budget``) skips or shrinks later steps, and a hard watchdog dumps
the stacks and exits if something hangs. Results also go to ``$OUT/gpu_check.txt`` when
``OUT`` is set (or to ``--output``), written as they come, so a killed run still leaves them.

``--cpu-only`` skips every GPU step (a dry run on a CPU machine): step 5 then runs the same
code on NumPy blocks on one simulated GPU worker (``blockflow.testing.simulated_cluster``,
``--sim-device-memory``, default 128 MiB, so sizes of 8-32 MiB), "one call" being one NumPy
call, and step 7 on 64 MiB. ``--bw-only`` runs step 5 alone.
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
import warnings

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


# --- issue 40: blockflow beside one array call and the device's copy -----------------------
# One run, same device: each operation as ONE call of the array library on the whole array
# (no Dask; run inside the worker process, so the same device, memory pool and CUDA context),
# the device's copy bandwidth (the ceiling), and blockflow at its default blocks
# (blockflow.fit_blocks), at a naive block size and after following the advisory line.

MAP_KERNEL = "y = 2*x (float32; one elementwise pass, STREAM 'scale')"
BW_OPS = ("map_blocks", "tree_reduce sum", "tree_reduce axis=0")
TARGET_ONE_CALL = 0.80  # issue 40: blockflow >= 80 % of one call on the whole array
TARGET_COPY = 0.70  # ... and >= 70 % of the device copy bandwidth
TARGET_MIN_BYTES = 16 * GiB  # ... on arrays of 16 GiB and more


def scale2(block):
    """The section's ``map_blocks`` kernel: ``2 * x`` in one elementwise pass (reads and
    writes each element once)."""
    return block * block.dtype.type(2)


def fill_rows(xp, out, r0: int, c0: int = 0):
    """Fill 2-D ``out`` with :func:`gen_region` from row ``r0``, column ``c0``, in slabs of at
    most 128 MiB of float64 temporaries, so a block of any size needs little more memory than
    itself."""
    n, m = out.shape
    step = max(1, (128 * MiB) // max(1, m * 8))
    for i in range(0, n, step):
        j = min(n, i + step)
        out[i:j] = gen_region(xp, r0 + i, r0 + j, c0, c0 + m)
    return out


def gen_filled(block_info=None, xp_name="numpy", tag=""):
    """A dask block of :func:`gen_region` made by :func:`fill_rows` (``tag``: new keys)."""
    xp = importlib.import_module(xp_name)
    (r0, r1), (c0, c1) = block_info[None]["array-location"]
    return fill_rows(xp, xp.empty((r1 - r0, c1 - c0), dtype=DTYPE), r0, c0)


def free_device_pool() -> str:
    """Run on a worker: drop unused blocks of CuPy's memory pools; returns what was freed."""
    import gc

    gc.collect()
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return "no CuPy"
    pool = cupy.get_default_memory_pool()
    held = pool.total_bytes()
    pool.free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    return f"{fmt_bytes(held - pool.total_bytes())} freed"


def device_memory_info():
    """Run on a worker: ``(free, total)`` device bytes from CUDA, or None without CuPy."""
    try:
        import cupy

        return tuple(int(v) for v in cupy.cuda.runtime.memGetInfo())
    except Exception:
        return None


def one_call_pass(rows: int, xp_name: str, inner: int = 3) -> dict:
    """Run on a worker as one task (no Dask inside): each operation as one call of the array
    library on the whole ``(rows, N_COLS)`` array, and the device's copy.

    Seconds are the median of ``inner`` timed calls after an untimed one (which compiles the
    kernel): CUDA events on the current stream for CuPy (device time only), ``perf_counter``
    for NumPy. ``map_blocks`` writes into a preallocated output (no allocation timed).
    """
    import gc
    import statistics

    xp = importlib.import_module(xp_name)
    cupy = xp if xp_name == "cupy" else None
    free_device_pool()  # whole-array buffers: no cached blocks of other sizes in the way
    x = fill_rows(xp, xp.empty((rows, N_COLS), dtype=DTYPE), 0)
    y = xp.empty_like(x)
    two = x.dtype.type(2)
    if cupy is not None:
        cupy.cuda.runtime.deviceSynchronize()

    def timed(fn):
        fn()
        seconds = []
        for _ in range(inner):
            if cupy is None:
                t0 = time.perf_counter()
                fn()
                seconds.append(time.perf_counter() - t0)
                continue
            stream = cupy.cuda.get_current_stream()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            seconds.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
        return statistics.median(seconds)

    def measure(x, y) -> dict:
        t = {"map_blocks": timed(lambda: xp.multiply(x, two, out=y)),
             "tree_reduce sum": timed(lambda: xp.sum(x, dtype=xp.float64)),
             "tree_reduce axis=0": timed(lambda: xp.sum(x, axis=0, dtype=xp.float64)),
             "copy (copyto)": timed(lambda: xp.copyto(y, x))}
        if cupy is not None:
            try:  # cudaMemcpyAsync device to device on the current stream
                t["copy (memcpy D2D)"] = timed(lambda: y.data.copy_from_device_async(
                    x.data, x.nbytes))
            except Exception as e:
                print(f"[gpu_check] memcpy D2D not measured: {type(e).__name__}: {e}")
        return t

    t = measure(x, y)
    total = float(xp.sum(x, dtype=xp.float64))
    cols = xp.sum(x, axis=0, dtype=xp.float64)
    cols = cols.get() if cupy is not None else cols
    del x, y
    gc.collect()
    free_device_pool()
    return {"times": t, "total": total, "cols": cols}


def noop() -> int:
    return 0


class _AdviceLog(logging.Handler):
    def __init__(self, lines: list):
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record):
        msg = record.getMessage()
        if "rechunk" in msg:
            self.lines.append(f"log {record.name}: {msg}")


def is_advice(w: warnings.WarningMessage) -> bool:
    """A block-size advisory line: ``blockflow.BlockSizeWarning`` or a warning naming
    ``rechunk``."""
    import blockflow

    cls = getattr(blockflow, "BlockSizeWarning", None)
    return (cls is not None and issubclass(w.category, cls)) or "rechunk" in str(w.message)


class capture_advice:
    """Collect the advisory lines (warnings, blockflow log records) shown inside the block."""

    def __init__(self):
        self.lines: list[str] = []
        self._warn = warnings.catch_warnings(record=True)
        self._handler = _AdviceLog(self.lines)

    def __enter__(self):
        self._caught = self._warn.__enter__()
        warnings.simplefilter("always")
        logging.getLogger("blockflow").addHandler(self._handler)
        return self

    def __exit__(self, *exc):
        logging.getLogger("blockflow").removeHandler(self._handler)
        self._warn.__exit__(*exc)
        for w in self._caught:
            if is_advice(w):
                self.lines.append(f"{w.category.__name__}: {w.message}")
            else:  # not ours to swallow
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return False


def advised_chunks(lines: list[str], lazy):
    """``(chunks, "rechunk(...)")`` from the first advisory line whose ``rechunk(...)``
    argument applies to ``lazy``; ``(None, None)`` when none does."""
    import ast

    for text in lines:
        start = 0
        while (i := text.find("rechunk(", start)) >= 0:
            j = k = i + len("rechunk(")
            depth = 1
            while k < len(text) and depth:
                depth += {"(": 1, ")": -1}.get(text[k], 0)
                k += 1
            start = k
            arg = text[j:k - 1].strip()
            if arg.startswith("chunks="):
                arg = arg[len("chunks="):]
            try:
                return lazy.rechunk(ast.literal_eval(arg)).chunks, f"rechunk({arg})"
            except Exception:
                continue
    return None, None


def fitted(x, client):
    """``blockflow.fit_blocks(x)`` (the array, whichever form the function returns)."""
    import blockflow

    out = blockflow.fit_blocks(x, client=client)
    return out[0] if isinstance(out, tuple) else out


def describe_chunks(chunks) -> str:
    rows = chunks[0]
    n = len(rows) * len(chunks[1])
    big = max(rows) * max(chunks[1]) * 4
    even = len(set(rows)) == 1 and len(chunks[1]) == 1
    return f"{n} x {fmt_bytes(big)}" + ("" if even else " (largest)")


def median(values):
    import statistics

    return statistics.median(values) if values else None


class BandwidthRun:
    """The issue-40 section: configurations alternated round by round at each array size."""

    def __init__(self, client, backend: str, args, report: Report, budget: Budget):
        self.client = client
        self.backend = backend
        self.args = args
        self.report = report
        self.budget = budget
        self.rows_out: list[dict] = []  # the table
        self.advice_ok: dict[float, bool] = {}

    # -- cluster helpers
    def sync(self):
        if self.backend == "cupy":
            self.client.run(device_sync)

    def drained(self, keep=None, timeout: float = 15.0) -> None:
        """Wait until the workers hold no data but the blocks of ``keep`` (cancelled keys
        freed)."""
        import dask

        def norm(k):  # keys may come back as lists
            return tuple(norm(i) for i in k) if isinstance(k, (list, tuple)) else k

        allowed = set() if keep is None else {norm(k) for k in dask.core.flatten(
            keep.__dask_keys__())}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            held = {norm(k) for keys in self.client.has_what().values() for k in keys}
            if held <= allowed:
                return
            time.sleep(0.05)
        self.report("  (workers still hold data after cancel; going on)")

    def free(self) -> None:
        self.drained()
        freed = self.client.run(free_device_pool)
        self.report(f"  memory pools: {', '.join(sorted(set(freed.values())))}")

    def timeout(self) -> float:
        return max(30.0, self.budget.left())

    # -- set-up
    def device_memory(self) -> tuple[int, int | None, str]:
        """(total, free, source) of the smallest worker device."""
        import blockflow

        if self.backend == "cupy":
            info = [v for v in self.client.run(device_memory_info).values() if v]
            if info:
                free, total = min(info, key=lambda ft: ft[1])
                return total, free, "CUDA memGetInfo on the worker"
        inv = blockflow.inventory(self.client)
        totals = [w.gpu_memory_total for w in inv if w.gpu_memory_total]
        if totals:
            used = [w.gpu_memory_used or 0 for w in inv if w.gpu_memory_total]
            return min(totals), min(totals) - max(used), "inventory (worker metrics)"
        return int(self.args.sim_device_memory), None, "--sim-device-memory"

    def print_target(self) -> None:
        try:
            from blockflow.block_sizing import device_block_target
        except ImportError as e:
            self.report(f"device block target: n/a (blockflow.block_sizing.device_block_target "
                        f"missing: {e})")
            return
        for passes in (2, 1):
            try:
                t = device_block_target(self.client, passes=passes)
            except Exception as e:
                self.report.error(f"device_block_target(passes={passes})", e)
                continue
            if t is None:
                self.report(f"device block target (passes={passes}): None (no GPU workers)")
                continue
            g = lambda k: getattr(t, k, None)  # noqa: E731
            ov, bw, share = g("overhead"), g("bandwidth"), g("share")
            self.report(
                f"device block target (passes={passes}): {fmt_bytes(g('nbytes'))} per block; "
                f"measured per-task overhead "
                f"{'n/a' if ov is None else f'{ov * 1e3:.2f} ms'}, bandwidth "
                f"{'n/a' if bw is None else f'{bw / 1e9:.0f} GB/s'}, threads {g('threads')}, "
                f"device memory {fmt_bytes(g('device_memory'))}, overhead share at that size "
                f"{'n/a' if share is None else f'{share:.1%}'}, worker {g('worker')}")

    def fixed_costs(self) -> None:
        """Median cost of the round trips a timed Dask pass includes."""
        costs = {}
        for name, fn in (("client.run(device sync)", lambda: self.client.run(device_sync)),
                         ("one tiny task", lambda: self.client.submit(
                             noop, pure=False).result(timeout=30))):
            ts = []
            for _ in range(7):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            costs[name] = median(ts[2:])
        self.report("fixed round trips (median): " + ", ".join(
            f"{k} {v * 1e3:.2f} ms" for k, v in costs.items()))

    # -- one configuration, one pass
    def dask_pass(self, rows: int, chunks, tag: str) -> tuple[dict, float, object, list]:
        """generate (persisted, untimed) -> map_blocks persisted until the device is done ->
        tree_reduce sum and axis=0 returned to the client. Returns seconds, sums, advice."""
        import dask.array as da
        import numpy as np
        from distributed import wait

        import blockflow

        xp = importlib.import_module(self.backend)
        x = da.map_blocks(gen_filled, xp_name=self.backend, tag=tag, dtype=np.dtype(DTYPE),
                          chunks=chunks, meta=xp.empty((0, 0), dtype=DTYPE),
                          name=f"bw-gen-{tag}")
        t: dict[str, float] = {}
        y = None
        self.client.run(free_device_pool)  # sizes and block sizes change between passes
        with capture_advice() as advice:
            try:
                t0 = time.perf_counter()
                x = x.persist()
                wait(x, timeout=self.timeout())
                self.sync()
                t["generate"] = time.perf_counter() - t0

                # untimed: the same map once, so the pool holds the output's memory (a
                # pipeline's steady state; the pools were emptied before this configuration)
                # NumPy blocks (--cpu-only dry run on a simulated GPU) run on the device only
                # when the stage says so: a declared working set, so the advice path runs
                device = {} if self.backend == "cupy" else {"working_set": 1}
                y = blockflow.map_blocks(scale2, x, dtype=np.dtype(DTYPE),
                                         name="scale2-warm", **device).persist()
                wait(y, timeout=self.timeout())
                self.client.cancel(y)
                self.drained(keep=x)

                t0 = time.perf_counter()
                y = blockflow.map_blocks(scale2, x, dtype=np.dtype(DTYPE), **device).persist()
                wait(y, timeout=self.timeout())
                self.sync()
                t["map_blocks"] = time.perf_counter() - t0
                self.client.cancel(y)
                y = None

                t0 = time.perf_counter()
                total = self.client.compute(blockflow.tree_reduce(
                    x, sum_f64, dtype=np.float64)).result(timeout=self.timeout())
                t["tree_reduce sum"] = time.perf_counter() - t0

                t0 = time.perf_counter()
                cols = self.client.compute(blockflow.tree_reduce(
                    x, sum_f64, axis=0, dtype=np.float64)).result(timeout=self.timeout())
                t["tree_reduce axis=0"] = time.perf_counter() - t0
            finally:
                self.client.cancel([f for f in (x, y) if f is not None])
        self.drained()
        return t, float(to_numpy(total)), to_numpy(cols), advice.lines

    def one_call(self, rows: int) -> tuple[dict, float, object]:
        addr = sorted(self.client.scheduler_info()["workers"])[0]
        r = self.client.submit(one_call_pass, rows, self.backend, pure=False, workers=[addr],
                               allow_other_workers=False).result(timeout=self.timeout())
        return r["times"], r["total"], r["cols"]

    # -- one size
    def plan(self, nbytes: int, naive_rows: int) -> tuple[int, object, dict]:
        """(rows, lazy input at the naive blocks, chunks per configuration) for one size:
        a whole number of naive blocks; the default is ``blockflow.fit_blocks`` of it."""
        rows = max(naive_rows, int(nbytes // (naive_rows * N_COLS * 4)) * naive_rows)
        lazy = self._lazy(rows, ((naive_rows,) * (rows // naive_rows), (N_COLS,)))
        chunks = {"naive": lazy.chunks}
        try:
            chunks["default"] = fitted(lazy, self.client).chunks
        except Exception as e:
            self.report.error(f"fit_blocks at {fmt_bytes(rows * N_COLS * 4)}", e)
        return rows, lazy, chunks

    def run_size(self, rows: int, lazy, chunks: dict) -> None:
        import numpy as np

        size = rows * N_COLS * 4
        self.report(f"-- {fmt_bytes(size)} ({rows} x {N_COLS} float32): naive blocks "
                    f"{describe_chunks(chunks['naive'])}; default (fit_blocks) "
                    + (describe_chunks(chunks['default']) if 'default' in chunks else 'n/a'))
        times: dict[str, dict[str, list]] = {}
        sums: dict[str, tuple] = {}
        advice_lines: list[str] = []
        advised_from = None
        rounds = 1 + self.args.bw_repeat
        est = None
        for rnd in range(rounds):
            if rnd and est and self.budget.left() < self.args.bw_reserve + est:
                self.report(f"  (time budget: stopped after {rnd - 1} timed round(s))")
                break
            if rnd == 1 and "advised" not in chunks:
                found, spec = advised_chunks(advice_lines, lazy)
                if found is not None:
                    chunks["advised"], advised_from = found, f"the line's {spec}"
                elif "default" in chunks:
                    chunks["advised"], advised_from = chunks["default"], "fit_blocks (no " \
                        "rechunk in a line)"
            configs = ["one call", "naive"] + [c for c in ("default", "advised")
                                               if c in chunks]
            # alternate: each round starts one configuration later (round 0 warms up)
            order = configs[rnd % len(configs):] + configs[:rnd % len(configs)] if rnd \
                else configs
            t_round = time.perf_counter()
            for cfg in order:
                same = next((c for c in ("naive", "default") if c != cfg and c in chunks
                             and cfg in chunks and chunks[c] == chunks[cfg]
                             and configs.index(c) < configs.index(cfg)), None)
                if same:
                    times[cfg] = {"same as": same}
                    continue
                try:
                    if cfg == "one call":
                        t, total, cols = self.one_call(rows)
                    else:
                        t, total, cols, lines = self.dask_pass(
                            rows, chunks[cfg], f"{cfg.replace(' ', '')}-{rows}-{rnd}")
                        if cfg == "naive":
                            advice_lines += lines
                except Exception as e:
                    self.report.error(f"{cfg} at {fmt_bytes(size)} (round {rnd})", e)
                    self._finish_size(size, rows, chunks, times, advice_lines, advised_from)
                    return
                sums.setdefault(cfg, (total, cols))
                if rnd:
                    for op, s in t.items():
                        times.setdefault(cfg, {}).setdefault(op, []).append(s)
            est = time.perf_counter() - t_round
            self.report(f"  round {rnd}{' (warm-up)' if rnd == 0 else ''}: {est:.1f} s; "
                        f"order {', '.join(order)}")
        # the same data under every configuration: the sums agree
        ref = sums.get("one call")
        for cfg, (total, cols) in sums.items():
            if ref is None or cfg == "one call":
                continue
            rel = abs(total - ref[0]) / max(abs(ref[0]), 1)
            rel_cols = float(np.max(np.abs(cols - ref[1]) / np.maximum(np.abs(ref[1]), 1)))
            self.report.check(f"{fmt_bytes(size)} {cfg}: sums equal one call's",
                              rel <= 1e-9 and rel_cols <= 1e-9,
                              f"rel diff {rel:.2g}, axis=0 {rel_cols:.2g}")
        self._finish_size(size, rows, chunks, times, advice_lines, advised_from)

    def _lazy(self, rows, chunks):
        import dask.array as da
        import numpy as np

        xp = importlib.import_module(self.backend)
        return da.map_blocks(gen_filled, xp_name=self.backend, dtype=np.dtype(DTYPE),
                             chunks=chunks, meta=xp.empty((0, 0), dtype=DTYPE),
                             name=f"bw-plan-{rows}")

    def _finish_size(self, size, rows, chunks, times, advice_lines, advised_from) -> None:
        """Rows of the table for one size, printed as soon as they are known."""
        advice = bool(advice_lines)
        self.advice_ok[size] = advice
        self.report("  advisory line at the naive size: "
                    + (f"yes: {advice_lines[0][:300]}" if advice else "none seen in the client"))
        if "advised" in chunks:
            self.report(f"  advised blocks {describe_chunks(chunks['advised'])} from "
                        f"{advised_from}")
        one = times.get("one call", {})
        cols_bytes = N_COLS * 8
        moved = {"map_blocks": 2 * size, "tree_reduce sum": size + 8,
                 "tree_reduce axis=0": size + cols_bytes}
        copy_gbs = {k: 2 * size / median(one[k]) / 1e9 for k in ("copy (copyto)",
                    "copy (memcpy D2D)") if one.get(k)}
        ceiling_gbs = max(copy_gbs.values()) if copy_gbs else None
        for k, g in copy_gbs.items():
            self._row(size, "copy", f"1 x {fmt_bytes(size)}", k, median(one[k]), g, None,
                      ceiling_gbs, "ceiling" if g == ceiling_gbs else "")
        for cfg in ("one call", "default", "naive", "advised"):
            if cfg not in times and cfg != "one call":
                continue
            src = times.get(cfg, {})
            alias = src.get("same as") if isinstance(src.get("same as"), str) else None
            if alias:
                src = times.get(alias, {})
            blocks = f"1 x {fmt_bytes(size)}" if cfg == "one call" else \
                describe_chunks(chunks[cfg]) + (f" (= {alias})" if alias else "")
            for op in BW_OPS:
                s = median(src.get(op, []))
                gbs = moved[op] / s / 1e9 if s else None
                base = median(one.get(op, []))
                base_gbs = moved[op] / base / 1e9 if base else None
                verdict = ""
                if cfg in ("default", "advised") and gbs and base_gbs and ceiling_gbs:
                    ok = gbs >= TARGET_ONE_CALL * base_gbs and gbs >= TARGET_COPY * ceiling_gbs
                    verdict = ("PASS" if ok else "FAIL") if size >= TARGET_MIN_BYTES else \
                        ("(pass)" if ok else "(fail)")
                elif cfg == "naive" and op == "map_blocks":
                    verdict = f"advice {'PASS' if advice else 'FAIL'}" \
                        if size >= TARGET_MIN_BYTES else f"(advice {'yes' if advice else 'no'})"
                self._row(size, cfg, blocks, op, s, gbs,
                          None if cfg == "one call" else base_gbs, ceiling_gbs, verdict,
                          n=len(src.get(op, [])))

    def _row(self, size, cfg, blocks, op, s, gbs, base_gbs, ceiling_gbs, verdict, n=None):
        row = {"size": size, "config": cfg, "blocks": blocks, "op": op, "s": s, "gbs": gbs,
               "vs_one": gbs / base_gbs if gbs and base_gbs else None,
               "vs_copy": gbs / ceiling_gbs if gbs and ceiling_gbs else None,
               "verdict": verdict, "n": n}
        self.rows_out.append(row)
        self.report("  " + self._fmt(row))

    HEAD = (f"{'size':>10s} {'config':9s} {'blocks':26s} {'operation':19s} {'ms':>9s} "
            f"{'GB/s':>8s} {'/1 call':>8s} {'/copy':>7s}  target")

    @staticmethod
    def _fmt(r) -> str:
        def num(v, spec):
            return "n/a" if v is None else format(v, spec)

        def pct(v):
            return "" if v is None else f"{v:.0%}"

        ms = None if r["s"] is None else r["s"] * 1e3
        return (f"{fmt_bytes(r['size']):>10s} {r['config']:9s} {r['blocks'][:26]:26s} "
                f"{r['op']:19s} {num(ms, '.2f'):>9s} {num(r['gbs'], '.1f'):>8s} "
                f"{pct(r['vs_one']):>8s} {pct(r['vs_copy']):>7s}  {r['verdict']}")

    # -- the whole section
    def run(self) -> None:
        total, free, source = self.device_memory()
        self.report(f"device memory {fmt_bytes(total)} ({source}), free now {fmt_bytes(free)}; "
                    f"map_blocks kernel: {MAP_KERNEL}")
        self.print_target()
        self.fixed_costs()
        naive = int(self.args.naive_block)
        naive_rows = max(1, naive // (N_COLS * 4))
        sizes = sorted({int(total * f) for f in self.args.bw_fractions}, reverse=True)
        self.report(f"sizes: {', '.join(fmt_bytes(s) for s in sizes)} (fractions "
                    f"{', '.join(f'{f:g}' for f in self.args.bw_fractions)} of device memory, "
                    f"largest first); naive block {fmt_bytes(naive_rows * N_COLS * 4)}; "
                    f"{self.args.bw_repeat} timed rounds after a warm-up, configurations "
                    f"alternated")
        plans = []  # all planned before any big data (fit_blocks reads free device memory)
        for nbytes in sizes:
            plan = self.plan(nbytes, naive_rows)
            if all(plan[0] != p[0] for p in plans):
                plans.append(plan)
        last = None
        for rows, lazy, chunks in plans:
            nbytes = rows * N_COLS * 4
            need = (last[1] * nbytes / last[0]) if last else 0
            if self.budget.left() < self.args.bw_reserve + need:
                self.report.skip(f"bandwidth at {fmt_bytes(nbytes)}",
                                 f"time budget ({self.budget.left():.0f} s left)")
                continue
            t0 = time.perf_counter()
            try:
                self.run_size(rows, lazy, chunks)
            except Exception as e:
                self.report.error(f"bandwidth at {fmt_bytes(nbytes)}", e)
            try:
                self.free()
            except Exception as e:
                self.report.error("freeing the memory pools", e)
            last = (nbytes, time.perf_counter() - t0)
        self.table()

    def table(self) -> None:
        r = self.report
        r.section("issue 40 table: blockflow vs one call vs the device's copy")
        r(f"backend {self.backend}; map_blocks kernel {MAP_KERNEL}; tree_reduce: float64 sum "
          f"of float32 (chunk/combine/aggregate sum_f64), split_every blockflow's choice")
        r("bytes moved = read + written: map 2 x nbytes, reduce nbytes + output; GB/s = 1e9 "
          "B/s; ms = median of the timed rounds")
        r("one call / copy: inside the worker process, one library call on the whole array, "
          "device time (CUDA events; NumPy: perf_counter), map into a preallocated output")
        r("blockflow rows: wall time from building the graph to results complete: map_blocks "
          "= persist + wait + device synchronise on every worker (client.run); tree_reduce = "
          "compute until the result is on the client; input blocks persisted beforehand; "
          "memory pools emptied before each configuration, then one untimed map over the "
          "same blocks so the pool holds the output (a pipeline's steady state)")
        r(f"targets (issue 40, default and advised blocks, arrays >= {fmt_bytes(TARGET_MIN_BYTES)}"
          f"): >= {TARGET_ONE_CALL:.0%} of one call and >= {TARGET_COPY:.0%} of the copy "
          f"ceiling; lower-case (pass)/(fail): below that size, for information")
        r(self.HEAD)
        r("-" * len(self.HEAD))
        for row in self.rows_out:
            r(self._fmt(row))
        r("")
        r("csv:")
        r("size_bytes,config,blocks,operation,median_s,timed_rounds,GBps,vs_one_call,vs_copy,"
          "target")
        for x in self.rows_out:
            r(",".join(str(v) for v in (
                x["size"], x["config"], f'"{x["blocks"]}"', x["op"],
                "" if x["s"] is None else f"{x['s']:.6g}", "" if x["n"] is None else x["n"],
                "" if x["gbs"] is None else f"{x['gbs']:.2f}",
                "" if x["vs_one"] is None else f"{x['vs_one']:.3f}",
                "" if x["vs_copy"] is None else f"{x['vs_copy']:.3f}", x["verdict"])))
        big = [x for x in self.rows_out if x["size"] >= TARGET_MIN_BYTES
               and x["verdict"] in ("PASS", "FAIL")]
        adv = [x for x in self.rows_out if x["size"] >= TARGET_MIN_BYTES
               and x["verdict"].startswith("advice")]
        if big or adv:
            met = sum(x["verdict"] == "PASS" for x in big)
            r(f"issue 40 targets at >= {fmt_bytes(TARGET_MIN_BYTES)}: {met} of {len(big)} "
              f"bandwidth rows met; advisory line at the naive size: "
              + ", ".join(x["verdict"] for x in adv))
        else:
            r(f"issue 40 targets: no array of {fmt_bytes(TARGET_MIN_BYTES)} or more measured "
              f"in this run (no verdict)")


def step_bandwidth(client, backend: str, args, report: Report, budget: Budget) -> None:
    report.section(f"issue 40: bandwidth ({backend} blocks)")
    BandwidthRun(client, backend, args, report, budget).run()


def step_simulated_bandwidth(args, report: Report, budget: Budget) -> None:
    """The bandwidth section's code paths on a CPU machine: NumPy blocks on one worker
    (2 threads) with a simulated GPU of ``--sim-device-memory`` (so ``fit_blocks`` and the
    device block target size from device memory); "one call" is one NumPy call."""
    from blockflow.testing.cluster import simulated_cluster

    report.section("simulated GPU worker (dry run)")
    t0 = time.perf_counter()
    with simulated_cluster(speeds=(1,), device_memory=args.sim_device_memory,
                           threads_per_worker=2) as client:
        report(f"simulated_cluster: 1 worker x 2 threads, simulated device memory "
               f"{fmt_bytes(args.sim_device_memory)}, up in {time.perf_counter() - t0:.1f} s")
        step_bandwidth(client, "numpy", args, report, budget)


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


def _fractions(text: str) -> list[float]:
    from fractions import Fraction

    out = [float(Fraction(v.strip())) for v in text.split(",") if v.strip()]
    if not out or not all(0 < f <= 0.45 for f in out):
        raise argparse.ArgumentTypeError(f"fractions in (0, 0.45] of device memory, got {text!r}")
    return out


def _bytes(text: str) -> int:
    from dask.utils import parse_bytes

    return int(parse_bytes(text))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " See the module docstring for the steps.",
    )
    p.add_argument("--gb", type=float, default=4.0,
                   help="GiB of float32 data on the GPU (default 4)")
    p.add_argument("--cpu-gb", type=float, default=None,
                   help="GiB on the CPU path (default 1, 1/16 with --cpu-only; speedups are "
                        "per byte)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="threads of the CPU worker (default: all CPUs)")
    p.add_argument("--repeat", type=int, default=2, help="timed passes per backend (best kept)")
    p.add_argument("--split-every", type=int, default=None,
                   help="tree_reduce fan-in (default: blockflow's memory-based choice)")
    p.add_argument("--policy", default="off",
                   help="blockflow scheduler policy for the clusters (default off: timing)")
    p.add_argument("--cpu-only", action="store_true",
                   help="skip every GPU step (dry run): the bandwidth section runs on NumPy "
                        "blocks on a simulated GPU worker (--sim-device-memory)")
    p.add_argument("--skip-cpu", action="store_true", help="skip the CPU timings")
    p.add_argument("--skip-bw", action="store_true", help="skip the issue-40 bandwidth section")
    p.add_argument("--bw-only", action="store_true",
                   help="only the bandwidth section (no round trip, no pipelines)")
    p.add_argument("--bw-fractions", type=_fractions, default=_fractions("1/16,1/8,1/4"),
                   help="array sizes of the bandwidth section as fractions of device memory "
                        "(default 1/16,1/8,1/4)")
    p.add_argument("--bw-repeat", type=int, default=3,
                   help="timed rounds per size after a warm-up round (median; default 3)")
    p.add_argument("--bw-reserve", type=float, default=None,
                   help="seconds of the budget kept for the steps after the bandwidth section "
                        "(default 60; 0 with --cpu-only or --bw-only)")
    p.add_argument("--naive-block", type=_bytes, default=None,
                   help="the block size a user would naively pick (default 256MiB; 512KiB "
                        "with --cpu-only)")
    p.add_argument("--sim-device-memory", type=_bytes, default=_bytes("128MiB"),
                   help="--cpu-only: memory of the simulated GPU (default 128MiB)")
    p.add_argument("--budget", type=float, default=180.0,
                   help="soft time budget in seconds (default 180; the watchdog ends the run "
                        "60 s after it); later steps shrink or skip")
    p.add_argument("--output", default=None,
                   help="results file (default $OUT/gpu_check.txt when OUT is set)")
    args = p.parse_args(argv)
    if args.naive_block is None:
        args.naive_block = _bytes("512KiB" if args.cpu_only else "256MiB")
    if args.bw_reserve is None:
        args.bw_reserve = 0.0 if (args.cpu_only or args.bw_only) else 60.0
    if args.cpu_only and args.cpu_gb is None:
        args.cpu_gb = 1 / 16
    return args


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
            if not args.bw_only:
                try:
                    step_round_trip(client, report)
                except Exception as e:
                    report.error("round trip", e)
            if not args.skip_bw:
                try:
                    step_bandwidth(client, "cupy", args, report, budget)
                except Exception as e:
                    report.error("bandwidth section", e)
                report(f"(elapsed {budget.elapsed():.0f} s)")
            if not args.bw_only:
                report.section(f"GPU pipeline ({mode})")
                try:
                    gpu = run_backend(client, "cupy", args.gb * GiB, args, report, budget)
                except Exception as e:
                    report.error("GPU pipeline", e)
                if gpu:
                    gpu.release(keep_results=True)
            close_client(client, report)
        report(f"(elapsed {budget.elapsed():.0f} s)")

    elif not args.skip_bw:
        try:
            step_simulated_bandwidth(args, report, budget)
        except Exception as e:
            report.error("bandwidth section (simulated GPU)", e)

    if not args.skip_cpu and not args.bw_only:
        cpu_bytes = (args.cpu_gb if args.cpu_gb is not None else 1.0) * GiB
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
