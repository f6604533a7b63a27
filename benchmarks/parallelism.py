"""Pipeline parallelism of PyTorch models on simulated devices (issue 30's targets).

One cluster of 4 simulated GPU workers (worker processes, 1 thread each), one run, side by
side. Layers are :class:`blockflow.testing.torch_layers.SimulatedLinear`: a real
``nn.Linear`` whose forward also keeps its simulated device busy for ``work / speed``
seconds and whose backward for twice that, so stage times follow the devices' speeds, not
this 2-core machine's load.

1. **Uneven devices** (speeds 1, 1, 0.5, 0.25 set at run time, devices 0-3 in that order):
   16 linear layers widening with depth (32 to 160 features), work proportional to each
   layer's parameters. Three partitions of the same model, each trained for ``--steps``
   GPipe steps of m = 16 micro-batches: blockflow's (measured forward+backward time of every
   layer on every worker; the worker order and cut of least step time), and the two
   baselines as their users get them, stage ``s`` on device ``s`` (ranks in
   ``torch.distributed.pipelining`` and DeepSpeed): equal layer counts, and DeepSpeed's
   ``partition_method="parameters"`` (equal parameter counts). Throughput: rows per second
   through the step's forward and backward passes (first start to last stop on the workers),
   best step. Beside them, computed from the layers' declared work: the step of the best
   contiguous split (every device order and cut), the ideal (total work over the summed
   speeds, no bubble), and the equal split in its most favourable device order.
2. **Bubble and activation memory** (all speeds 1): ``--layers`` equal layers on p = 2 and 4
   devices, m = 4p micro-batches, equal stages, the best of ``--steps`` steps after a warm-up
   one: GPipe's measured idle fraction against
   ``(p - 1) / (m + p - 1)``; the most micro-batches of activations each stage held at once,
   measured on the workers, GPipe against 1F1B.
3. **A model larger than any one device**: ``--big-layers`` layers of ``--big-width`` x
   ``--big-width`` float32 with Adam (parameters, gradients and two moments: 16 bytes per
   parameter) on devices of ``--device-mib``; stages cut within each device's free memory
   (x ``blockflow.parallel.memory-fraction``); peak bytes of parameters, gradients and
   optimizer state each worker held (measured on the worker, probe included) against its
   stage's.

    python benchmarks/parallelism.py            # ~4 min here
    python benchmarks/parallelism.py --steps 1 --bubble-layer-seconds 0.02   # smoke

Correctness (loss, gradients and parameters equal single-device PyTorch to 1e-10) is checked
by ``tests/ml/test_parallel.py``, not here.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import numpy as np

import blockflow
from blockflow.scheduling.view import workers_info
from blockflow.testing import set_speed, simulated_cluster

MiB = 2**20


def _speeds(client, speeds):
    by_name = {info["name"]: a for a, info in workers_info(client).items()}
    for i, s in enumerate(speeds):
        client.run(set_speed, s, workers=[by_name[i]])
    return [by_name[i] for i in range(len(speeds))]


def _uneven_model(layers: int, work_per_kparam: float, seed: int = 0):
    import torch

    from blockflow.testing.torch_layers import SimulatedLinear

    torch.manual_seed(seed)
    dims = [32 + 8 * i for i in range(layers + 1)]  # wider with depth: 1,024 to 19,200
    mods = []
    for i in range(layers):
        params = dims[i] * dims[i + 1]
        mods.append(SimulatedLinear(dims[i], dims[i + 1], work=work_per_kparam * params / 1000))
    return torch.nn.Sequential(*mods), dims


def _declared(args) -> dict:
    """The step times the layers' declared work gives (GPipe/1F1B with a flush, m = 16):
    the best contiguous split over every device order and cut, the equal split in device
    order and in its best order, DeepSpeed's parameter split in device order, the ideal."""
    import itertools

    from blockflow.ml.parallel.partition import (
        equal_stages,
        flush_makespan,
        parameter_stages,
        partition_stages,
        stage_times,
    )

    m = 16
    model, dims = _uneven_model(args.layers, args.work_per_kparam)
    work = [3 * layer.work for layer in model]  # forward + backward, reference-seconds
    speeds = {f"device {i}": sp for i, sp in enumerate(args.speeds)}
    times = {d: [w / sp for w in work] for d, sp in speeds.items()}
    devices = list(speeds)

    def step(order, bounds):
        return flush_makespan(stage_times(times, bounds, order), m)

    equal = equal_stages(len(work), devices)[1]
    best_equal = min(step(list(o), equal) for o in itertools.permutations(devices))
    params = parameter_stages([sum(p.numel() for p in layer.parameters()) for layer in model],
                              devices)[1]
    order, bounds = partition_stages(times, n_micro_batches=m)
    ideal = m * sum(work) / sum(args.speeds)
    return {"best split": step(order, bounds), "best split order": [speeds[d] for d in order],
            "best split layers": [int(v) for v in np.diff(bounds)],
            "equal, device order": step(devices, equal), "equal, best order": best_equal,
            "parameters, device order": step(devices, params), "ideal": ideal}


def uneven(client, args, workers) -> list[dict]:
    import torch

    from blockflow.ml.parallel.partition import flush_makespan, stage_times

    model, dims = _uneven_model(args.layers, args.work_per_kparam)
    rng = np.random.default_rng(3)
    X = rng.standard_normal((128, dims[0])).astype(np.float32)
    T = rng.standard_normal((128, dims[-1])).astype(np.float32)
    sgd = functools.partial(torch.optim.SGD, lr=1e-3)
    rows, placed = [], []
    for label, partition in (("measured speed (blockflow)", "speed"),
                             ("equal layers", "equal"),
                             ("parameters (DeepSpeed)", "parameters")):
        t0 = time.perf_counter()
        pipe = blockflow.PipelineParallel(client, model, optimizer=sgd, partition=partition,
                                          workers=workers, sample=X,
                                          checkpoint_every=0)
        place = time.perf_counter() - t0
        results = [pipe.run(X, T, n_micro_batches=16, name=label, return_output=False)
                   for _ in range(args.steps)]
        best = min(results, key=lambda r: r.makespan)
        sizes = [int(n) for n in np.diff(pipe.bounds)]
        rows.append({"partition": label, "layers_per_stage": sizes,
                     "stage_speeds": [args.speeds[workers.index(w)]
                                      for w in pipe.stage_workers],
                     "makespan": best.makespan, "rows_per_s": best.throughput,
                     "bubble": best.bubble, "place_s": place})
        placed.append((pipe.stage_workers, pipe.bounds))
        if partition == "speed":
            measured = pipe.layer_times  # every layer on every worker, by blockflow's probe
        print(f"  {label}: {sizes} {[round(r.makespan, 2) for r in results]} s", flush=True)
        pipe.close()
    for row, (order, bounds) in zip(rows, placed):  # what the probe's times predicted
        row["predicted_s"] = flush_makespan(stage_times(measured, bounds, order), 16)
    return rows


def bubble(client, args, workers) -> list[dict]:
    import torch

    from blockflow.testing.torch_layers import SimulatedLinear

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[SimulatedLinear(32, 32, work=args.bubble_layer_seconds)
                                  for _ in range(args.layers)])
    sgd = functools.partial(torch.optim.SGD, lr=1e-3)
    rows = []
    for p in (2, 4):
        m = 4 * p
        X = np.random.default_rng(1).standard_normal((8 * m, 32)).astype(np.float32)
        for schedule in ("gpipe", "1f1b"):
            pipe = blockflow.PipelineParallel(client, model, optimizer=sgd, partition="equal",
                                              workers=workers[:p], schedule=schedule,
                                              checkpoint_every=0)
            r = min((pipe.run(X, np.zeros_like(X), n_micro_batches=m,
                              name=f"{schedule}-p{p}", return_output=False)
                     for _ in range(1 + args.steps)), key=lambda r: r.bubble)
            rows.append({"schedule": schedule, "stages": p, "micro_batches": m,
                         "bubble": r.bubble, "gpipe_formula": r.ideal_bubble,
                         "rel_diff": r.bubble / r.ideal_bubble - 1,
                         "peak_activations": r.peak_activations,
                         "max_peak": max(r.peak_activations), "makespan": r.makespan})
            print(f"  {schedule} p={p} m={m}: bubble {r.bubble:.3f} vs {r.ideal_bubble:.3f}, "
                  f"activations held {r.peak_activations} ({r.makespan:.1f} s)", flush=True)
            pipe.close()
    return rows


def big_model(client, args, workers) -> list[dict]:
    import torch

    torch.manual_seed(0)
    w = args.big_width
    model = torch.nn.Sequential(*[m for _ in range(args.big_layers)
                                  for m in (torch.nn.Linear(w, w), torch.nn.GELU())])
    total = sum(p.numel() for p in model.parameters()) * 16  # params, grads, Adam moments
    from blockflow.ml.parallel import _stage

    client.run(_stage.peaks, True)
    X = np.random.default_rng(2).standard_normal((64, w)).astype(np.float32)
    pipe = blockflow.PipelineParallel(client, model, optimizer=torch.optim.Adam,
                                      workers=workers, sample=X, probe_repeats=1,
                                      checkpoint_every=0)
    for _ in range(args.steps):
        pipe.run(X, np.zeros_like(X), n_micro_batches=8, return_output=False,
                 name="big-model")
    peaks = pipe.memory_peaks()
    rows = []
    for s, (wk, b) in enumerate(zip(pipe.stage_workers, pipe.stage_bytes())):
        rows.append({"stage": s, "layers": int(pipe.bounds[s + 1] - pipe.bounds[s]),
                     "stage_MiB": b / MiB, "peak_MiB": peaks[wk] / MiB,
                     "peak/stage": peaks[wk] / b, "device_MiB": args.device_mib})
    print(f"  model {total / MiB:.1f} MiB on devices of {args.device_mib:g} MiB: stages "
          f"{[round(r['stage_MiB'], 1) for r in rows]} MiB", flush=True)
    pipe.close()
    return rows, total


def _table(rows: list[dict]) -> str:
    import pandas as pd
    return pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.3f}")


def _print_uneven(un, args) -> None:
    print(f"\n== Speeds {args.speeds} (devices 0-3): {args.layers} layers widening with "
          f"depth (work proportional to parameters), m = 16, GPipe, best of {args.steps} "
          f"steps; baselines with stage s on device s ==")
    print(_table(un))
    ours = un[0]["rows_per_s"]
    print(f"throughput, blockflow / equal layers: {ours / un[1]['rows_per_s']:.2f}x; "
          f"blockflow / parameters (DeepSpeed): {ours / un[2]['rows_per_s']:.2f}x "
          f"(target >= 1.25x each)")
    d = _declared(args)
    print(f"From the declared work (step seconds, m = 16, flush makespan): best contiguous "
          f"split {d['best split']:.3f} (layers {d['best split layers']} on speeds "
          f"{d['best split order']}), ideal (total work / summed speeds x m, no bubble) "
          f"{d['ideal']:.3f}; equal layers in device order {d['equal, device order']:.3f}, "
          f"in its best device order {d['equal, best order']:.3f}; parameters in device "
          f"order {d['parameters, device order']:.3f}.")
    print(f"Best possible throughput ratios: best split / equal in device order "
          f"{d['equal, device order'] / d['best split']:.2f}x, / equal in its best order "
          f"{d['equal, best order'] / d['best split']:.2f}x (ideal: "
          f"{d['equal, best order'] / d['ideal']:.2f}x), / parameters "
          f"{d['parameters, device order'] / d['best split']:.2f}x\n", flush=True)


def _print_bubble(bb, args) -> None:
    print(f"\n== Bubble and activations held: equal stages on speed-1 devices, m = 4p, "
          f"{args.layers} layers of {args.bubble_layer_seconds:g} s forward, 2x backward ==")
    print(_table(bb))
    worst = max(abs(r["rel_diff"]) for r in bb if r["schedule"] == "gpipe")
    print(f"GPipe bubble: largest relative difference from (p-1)/(m+p-1): {worst:.1%} "
          f"(target <= 10 %)")
    ok = all(r["max_peak"] <= r["stages"] for r in bb if r["schedule"] == "1f1b")
    gp = all(r["max_peak"] == r["micro_batches"] for r in bb if r["schedule"] == "gpipe")
    print(f"1F1B: every stage held <= p micro-batches: {ok}; GPipe held m: {gp}\n",
          flush=True)


def _print_big(rows, total, args) -> None:
    print(f"\n== A {total / MiB:.1f} MiB model (parameters, gradients, Adam) on "
          f"{args.device_mib:g} MiB devices ==")
    print(_table(rows))
    print(f"peak / stage bytes, worst worker: {max(r['peak/stage'] for r in rows):.3f} "
          f"(target <= 1.1); model larger than any one device: "
          f"{total > args.device_mib * MiB}\n", flush=True)

# --- tensor parallelism (issue 38): blockflow beside plain torch TP ------------------------


def _tp_block(d: int, hidden: int, dtype, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.GELU(),
                               torch.nn.Linear(hidden, d)).to(dtype)


def _tp_data(rows: int, d: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, d)), rng.standard_normal((rows, d))


def _torch_tp_rank(rank: int, world: int, port: int, d: int, hidden: int, batch: int,
                   steps: int, out: str) -> None:
    """Plain torch TP, as a user launches it (torch.multiprocessing spawn, gloo, 1 thread):
    the same MLP block Colwise then Rowwise, the same batch every step, SGD."""
    import json

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    model = _tp_block(d, hidden, torch.float32)
    parallelize_module(model, init_device_mesh("cpu", (world,)),
                       {"0": ColwiseParallel(), "2": RowwiseParallel()})
    X, Y = (torch.tensor(a, dtype=torch.float32) for a in _tp_data(batch, d))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(X), Y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def _one_process_steps(d: int, hidden: int, batch: int, steps: int) -> list[float]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = _tp_block(d, hidden, torch.float32)
    X, Y = (torch.tensor(a, dtype=torch.float32) for a in _tp_data(batch, d))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(X), Y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    torch.set_num_threads(threads)
    return times


def _torch_tp_steps(d: int, hidden: int, batch: int, steps: int) -> tuple[list, float]:
    import json
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s_:
        s_.bind(("127.0.0.1", 0))
        port = s_.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        t0 = time.perf_counter()
        mp.spawn(_torch_tp_rank, args=(2, port, d, hidden, batch, steps, out), nprocs=2)
        wall = time.perf_counter() - t0
        with open(out) as f:
            return json.load(f), wall


def _float64_check(c) -> tuple[float, float]:
    """20 SGD-momentum steps of a float64 MLP block on 2 workers against one process."""
    import functools

    import torch

    from blockflow.ml.parallel import TensorParallel

    want = _tp_block(16, 64, torch.float64, seed=3)
    Xf, Yf = _tp_data(80, 16, seed=4)
    tp = TensorParallel(c, _tp_block(16, 64, torch.float64, seed=3),
                        optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    tp.fit(Xf, Yf, epochs=5, batch_size=20)
    opt = torch.optim.SGD(want.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(5):
        for i in range(0, 80, 20):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(want(torch.tensor(Xf[i:i + 20])),
                                                torch.tensor(Yf[i:i + 20]))
            loss.backward()
            opt.step()
            losses.append(loss.item())
    state = tp.state_dict()
    return (float(np.abs(np.subtract(tp.history_, losses)).max()),
            max(float((state[n] - p).abs().max()) for n, p in want.state_dict().items()))


def tensor_parallel(args) -> str:
    """blockflow ``TensorParallel`` (2 worker processes of 1 thread) beside plain torch TP
    (2 spawned gloo ranks of 1 thread) and one process of 1 thread: the same MLP block and
    batch, ``--rounds`` rounds each running the three in turn (the load of a shared machine
    drifts), median step after ``--warmup`` steps; and float64 losses and parameters over 20
    steps against one process. Returns the printed report."""
    import functools

    import torch
    from distributed import Client, LocalCluster

    from blockflow.ml.parallel import TensorParallel

    d, hidden, batch, steps = args.tp_dim, args.tp_hidden, args.tp_batch, args.tp_steps
    total, w = steps + args.warmup, args.warmup
    params = 2 * d * hidden + hidden + d
    lines = [f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())} "
             f"({os.cpu_count()} cores)",
             f"MLP block Linear({d}, {hidden}) -> GELU -> Linear({hidden}, {d}), {params:,} "
             f"parameters, float32, batch {batch}, SGD; per round {steps} timed steps after "
             f"{w} warm-up, {args.rounds} rounds"]
    one, ref, bf, walls, rounds = [], [], [], {"torch": [], "blockflow": []}, []
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as c:
        sgd = functools.partial(torch.optim.SGD, lr=1e-3)
        tp = TensorParallel(c, _tp_block(d, hidden, torch.float32), optimizer=sgd)
        Xb, Yb = _tp_data(batch, d)
        Xs, Ys = np.tile(Xb, (total, 1)), np.tile(Yb, (total, 1))  # the same batch each step
        tp.forward(Xb[:2])  # the workers import torch's distributed modules once
        for _ in range(args.rounds):
            o = _one_process_steps(d, hidden, batch, total)[w:]
            r, wall = _torch_tp_steps(d, hidden, batch, total)
            t0 = time.perf_counter()
            tp.fit(Xs, Ys, epochs=1, batch_size=batch)
            walls["blockflow"].append(time.perf_counter() - t0)
            walls["torch"].append(wall)
            b = tp.step_seconds_[-total:][w:]
            one += o
            ref += r[w:]
            bf += b
            rounds.append((np.median(o), np.median(r[w:]), np.median(b),
                           os.getloadavg()[0]))
        loss_diff, param_diff = _float64_check(c)

    def ms(ts):
        return float(np.median(ts)) * 1e3

    per = [b / r for _, r, b, _ in rounds]
    rows = [{"run": "one process (1 thread)", "median step ms": f"{ms(one):.2f}",
             "wall s (median)": "", "/ torch TP": f"{ms(one) / ms(ref):.2f}"},
            {"run": "torch TP (spawn, gloo, 2 ranks x 1 thread)",
             "median step ms": f"{ms(ref):.2f}",
             "wall s (median)": f"{np.median(walls['torch']):.2f}", "/ torch TP": "1.00"},
            {"run": "blockflow TensorParallel (2 workers x 1 thread)",
             "median step ms": f"{ms(bf):.2f}",
             "wall s (median)": f"{np.median(walls['blockflow']):.2f}",
             "/ torch TP": f"{ms(bf) / ms(ref):.2f}"}]
    lines += [_table(rows),
              "per round (median step ms: one process, torch TP, blockflow; blockflow / "
              "torch TP; load): " + "; ".join(
                  f"{o * 1e3:.1f}, {r * 1e3:.1f}, {b * 1e3:.1f}; {b / r:.2f}x; {la:.1f}"
                  for o, r, b, la in rounds),
              f"median of the rounds' ratios blockflow / torch TP: {np.median(per):.2f}x",
              "wall s: torch TP from spawn to join (process start, group, all steps); "
              "blockflow: one fit call (group formed on the workers, data shipped, all "
              "steps, the checkpoint kept on the workers)",
              f"float64, MLP 16-64-16 over 2 workers, 20 SGD-momentum steps against one "
              f"process: max |loss difference| {loss_diff:.1e}, max |parameter difference| "
              f"{param_diff:.1e} (target <= 1e-10)",
              f"load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}"]
    report = "\n".join(lines)
    print(report, flush=True)
    return report


def tensor_parallel_main(argv=None) -> None:
    """``python benchmarks/parallelism.py tensor [--tp-steps N] [--out PATH]``."""
    ap = argparse.ArgumentParser(description="tensor parallelism: blockflow beside torch TP")
    ap.add_argument("--tp-dim", type=int, default=512)
    ap.add_argument("--tp-hidden", type=int, default=2048)
    ap.add_argument("--tp-batch", type=int, default=256)
    ap.add_argument("--tp-steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the report here")
    args = ap.parse_args(argv)
    report = tensor_parallel(args)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["uneven", "bubble", "memory"], default=None)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--work-per-kparam", type=float, default=0.0015,
                    help="forward reference-seconds per 1,000 parameters, uneven section")
    ap.add_argument("--bubble-layer-seconds", type=float, default=0.025,
                    help="forward reference-seconds per layer, bubble section")
    ap.add_argument("--big-layers", type=int, default=8)
    ap.add_argument("--big-width", type=int, default=512)
    ap.add_argument("--device-mib", type=float, default=12)
    ap.add_argument("--speeds", type=float, nargs=4, default=[1, 1, 0.5, 0.25])
    args = ap.parse_args(argv)
    start = time.perf_counter()
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())} "
          f"({os.cpu_count()} cores)", flush=True)
    want = {args.only} if args.only else {"uneven", "bubble", "memory"}
    # tables are printed as each section ends, inside the cluster: a slow shutdown of a
    # loaded machine's worker processes cannot lose them
    with simulated_cluster(speeds=(1, 1, 1, 1), device_memory=f"{args.device_mib}MiB") as c:
        workers = _speeds(c, [1, 1, 1, 1])
        if "bubble" in want:
            print("Bubble and activations held, equal devices and stages:", flush=True)
            _print_bubble(bubble(c, args, workers), args)
        if "memory" in want:
            print("A model larger than any one device:", flush=True)
            _print_big(*big_model(c, args, workers), args)
        if "uneven" in want:
            _speeds(c, args.speeds)
            print(f"Pipeline on uneven devices {args.speeds}:", flush=True)
            _print_uneven(uneven(c, args, workers), args)
    print(f"total run {time.perf_counter() - start:.0f} s; load average at end: "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["tensor"]:
        tensor_parallel_main(sys.argv[2:])
    else:
        main()
