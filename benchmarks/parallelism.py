"""Model (tensor) parallelism and pipeline parallelism on simulated devices (issue 13's targets).

One cluster of 4 simulated GPU workers (worker processes, 1 thread each), one run, side by
side:

1. **Tensor parallelism** (:class:`blockflow.TensorParallelMLP`), weak scaling: ``--blocks``
   Megatron MLP blocks of width ``--d-model`` with ``--hidden`` hidden columns *per shard* on
   1, 2 and 4 shards (all devices at speed 1), weights generated on the workers
   (:func:`blockflow.parallel.random_blocks`). Each shard's kernel also keeps its simulated
   device busy for ``flops x --seconds-per-gflop`` (sleep), so time scales with the work as on
   a GPU rather than with this 2-core machine's load. Reported: forward+backward seconds
   (median of ``--repeats``), weak-scaling efficiency ``t(1) / t(n)``, and per worker the peak
   bytes of weight blocks held while the passes ran (``who_has`` x ``nbytes``, sampled every
   20 ms) against its shard. At 4 shards the model is larger than any one device
   (``--device-mib``).
2. **Pipeline bubble** (:class:`blockflow.PipelineParallel`): ``--layers`` layers of equal cost
   (forward ``--bubble-layer-seconds``, backward twice that), equal stages on p = 2 and 4 devices
   of speed 1, m = 4p micro-batches; measured idle fraction of the timeline against GPipe's
   ``(p - 1) / (m + p - 1)``.
3. **Uneven devices** (speeds 1, 1, 0.5, 0.25 set at run time): the partition from measured
   layer times against equal layer counts, m = 16, layers of ``--layer-seconds``; throughput (rows per second through
   forward+backward) and each one's bubble.

    python benchmarks/parallelism.py               # ~2 min here
    python benchmarks/parallelism.py --repeats 1 --bubble-layer-seconds 0.02   # smoke

Correctness (forward and gradients equal single-device PyTorch to 1e-6) is checked by
``tests/ml/test_parallel.py``, not here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import blockflow
from blockflow.cluster.identity import workers_info
from blockflow.ml.parallel import Linear, random_blocks
from blockflow.testing import set_speed, simulated_cluster, simulated_kernel

MiB = 2**20


class FlopClock:
    """Decorator for the tensor-parallel shard functions: run them, then keep the simulated
    device busy for their floating-point operations x ``seconds_per_gflop``."""

    def __init__(self, seconds_per_gflop: float):
        self.spg = seconds_per_gflop

    def __call__(self, fn):
        return _Timed(fn, self.spg)


class _Timed:
    def __init__(self, fn, spg):
        self.fn, self.spg = fn, spg

    def __call__(self, A, second, third, fourth, activation):
        out = self.fn(A, second, third, fourth, activation)
        if self.fn.__name__ == "_shard_forward":  # (A, a, B, x): 2 matmuls
            rows = fourth.shape[0]
            flops = 2 * rows * A.shape[1] * (A.shape[0] + second.shape[0] * 0 + third.shape[1])
        else:  # (A, B, saved, dy): 4 matmuls
            rows = fourth.shape[0]
            flops = 4 * rows * A.shape[1] * (A.shape[0] + second.shape[1])
        simulated_kernel(op=lambda: None, work=flops / 1e9 * self.spg)
        return out


class SleepyLinear(Linear):
    """A linear layer whose forward takes ``work`` reference-seconds on the worker's simulated
    device (``work / speed`` seconds of sleep) and whose backward takes twice that."""

    def __init__(self, W, b=None, work=0.02):
        super().__init__(W, b)
        self.work = work

    def forward(self, x):
        simulated_kernel(op=lambda: None, work=self.work)
        return super().forward(x)

    def backward(self, saved, dy):
        simulated_kernel(op=lambda: None, work=2 * self.work)
        return super().backward(saved, dy)


def _speeds(client, speeds):
    by_name = {info["name"]: a for a, info in workers_info(client)
               .items()}
    for i, s in enumerate(speeds):
        client.run(set_speed, s, workers=[by_name[i]])
    return [by_name[i] for i in range(len(speeds))]


def tensor_parallel(client, args, workers) -> list[dict]:
    rows = []
    t1 = None
    for n in (1, 2, 4):
        sizes = [args.d_model] * (args.blocks + 1)
        blocks = random_blocks(sizes, args.hidden * n, seed=n, chunk_columns=256)
        model = blockflow.TensorParallelMLP(client, blocks, workers=workers[:n],
                                            kernel=FlopClock(args.seconds_per_gflop))
        X = np.random.default_rng(0).standard_normal((args.rows, args.d_model))
        G = np.ones((args.rows, args.d_model)) / args.rows
        times = []
        with model.track_weight_bytes(interval=0.02) as tracker:
            for _ in range(args.repeats):
                start = time.perf_counter()
                model.forward(X)
                grads = model.backward(G)
                client.gather([f for g in grads for v in g.values()
                               for f in _futures(v)])
                times.append(time.perf_counter() - start)
        t = statistics.median(times)
        t1 = t1 or t
        ratio = max(tracker.peak[w] / model.shard_bytes[w] for w in model.workers)
        total = sum(model.shard_bytes.values())
        rows.append({"shards": n, "model_MiB": total / MiB,
                     "shard_MiB": max(model.shard_bytes.values()) / MiB,
                     "seconds": t, "efficiency": t1 / t, "peak/shard": ratio,
                     "larger_than_a_device": total > args.device_mib * MiB})
        print(f"  tensor parallel, {n} shards: {t:.2f} s {[round(x, 2) for x in times]}, "
              f"peak/shard {ratio:.3f}", flush=True)
        model.close()
    return rows


def _futures(arr):
    from distributed import futures_of
    return futures_of(arr)


def _layers(n, width, work, seed=0):
    rng = np.random.default_rng(seed)
    return [SleepyLinear(rng.standard_normal((width, width)) / np.sqrt(width), work=work)
            for _ in range(n)]


def bubble(client, args, workers) -> list[dict]:
    rows = []
    layers = _layers(args.layers, 32, args.bubble_layer_seconds)
    for p in (2, 4):
        m = 4 * p
        pipe = blockflow.PipelineParallel(client, layers, workers=workers[:p],
                                          partition="equal")
        X = np.random.default_rng(1).standard_normal((8 * m, 32))
        r = pipe.run(X, np.zeros_like(X), n_micro_batches=m, name=f"bubble-p{p}")
        rows.append({"stages": p, "micro_batches": m, "bubble": r.bubble,
                     "gpipe": r.ideal_bubble, "rel_diff": r.bubble / r.ideal_bubble - 1,
                     "makespan": r.makespan})
        print(f"  bubble p={p} m={m}: {r.bubble:.3f} vs {r.ideal_bubble:.3f} "
              f"({r.makespan:.1f} s)", flush=True)
    return rows


def uneven(client, args, workers) -> list[dict]:
    layers = _layers(args.layers, 32, args.layer_seconds, seed=2)
    X = np.random.default_rng(3).standard_normal((128, 32))
    rows = []
    t0 = time.perf_counter()
    speed = blockflow.PipelineParallel(client, layers, workers=workers, probe_repeats=1)
    probe = time.perf_counter() - t0
    equal = blockflow.PipelineParallel(client, layers, workers=workers, partition="equal")
    for label, pipe in (("equal layers", equal), ("measured speed", speed)):
        r = pipe.run(X, np.zeros_like(X), n_micro_batches=16, name=label)
        sizes = [int(n) for n in np.diff(pipe.bounds)]
        rows.append({"partition": label, "layers_per_stage": sizes,
                     "stage_speeds": [args.speeds[workers.index(w)]
                                      for w in pipe.stage_workers],
                     "makespan": r.makespan, "rows_per_s": r.throughput,
                     "bubble": r.bubble})
        print(f"  {label}: {sizes} {r.makespan:.1f} s", flush=True)
    rows[1]["probe_s"] = probe
    return rows


def _table(rows: list[dict]) -> str:
    import pandas as pd
    return pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.3f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["tensor", "bubble", "uneven"], default=None)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048, help="hidden columns per shard")
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--seconds-per-gflop", type=float, default=2.0)
    ap.add_argument("--device-mib", type=float, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--layer-seconds", type=float, default=0.02,
                    help="forward reference-seconds per layer, uneven-device section")
    ap.add_argument("--bubble-layer-seconds", type=float, default=0.05,
                    help="forward reference-seconds per layer, bubble section")
    ap.add_argument("--speeds", type=float, nargs=4, default=[1, 1, 0.5, 0.25])
    args = ap.parse_args(argv)
    start = time.perf_counter()
    with simulated_cluster(speeds=(1, 1, 1, 1), device_memory=f"{args.device_mib}MiB") as c:
        workers = _speeds(c, [1, 1, 1, 1])
        want = {args.only} if args.only else {"tensor", "bubble", "uneven"}
        tp = bb = un = None
        if "tensor" in want:
            print("Tensor parallelism, weak scaling (hidden columns per shard constant):",
                  flush=True)
            tp = tensor_parallel(c, args, workers)
        if "bubble" in want:
            print("Pipeline bubble, equal devices and stages:", flush=True)
            bb = bubble(c, args, workers)
        if "uneven" in want:
            _speeds(c, args.speeds)
            print(f"Pipeline on uneven devices {args.speeds}:", flush=True)
            un = uneven(c, args, workers)
    print()
    if tp:
        print(f"== Tensor parallelism: {args.blocks} blocks, d_model {args.d_model}, "
              f"{args.hidden} hidden columns per shard, {args.rows} rows, devices of "
              f"{args.device_mib:g} MiB (x 0.8 usable) ==")
        print(_table(tp))
        print(f"peak weight bytes / shard bytes, worst worker: "
              f"{max(r['peak/shard'] for r in tp):.3f} (target <= 1.1)")
    if bb:
        print(f"\n== Pipeline bubble: equal stages on speed-1 devices, m = 4p, {args.layers} "
              f"layers of {args.bubble_layer_seconds:g} s forward, 2x backward ==")
        print(_table(bb))
        worst = max(abs(r["rel_diff"]) for r in bb)
        print(f"bubble: largest relative difference from (p-1)/(m+p-1): {worst:.1%} "
              f"(target <= 10 %)")
    if un:
        print(f"\n== Pipeline on speeds {args.speeds}: measured-speed vs equal-layer "
              f"partition, {args.layers} layers of {args.layer_seconds:g} s forward, m = 16 ==")
        print(_table(un))
        ratio = un[1]["rows_per_s"] / un[0]["rows_per_s"]
        print(f"throughput, measured-speed partition / equal layers: {ratio:.2f}x "
              f"(target >= 1.25x)")
    print(f"total run {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
