"""Pipeline parallelism beside ``torch.distributed.pipelining`` (issue 38's targets), one run.

1. **Equal workers vs torch** (``--only equal``): an MLP of 8 ``Linear(1024, 1024)`` + ReLU
   and a ``Linear(1024, 10)`` head, batch 256 in 4 micro-batches, two stages of equal layers,
   the same data and ``--pipe-steps`` steps, schedules 1F1B and GPipe. Plain torch: 2 ranks
   spawned by ``torch.multiprocessing`` (gloo, ``torch.set_num_threads(1)``, the environment
   without the ``MALLOC_TRIM_THRESHOLD_`` distributed puts in the client's, as a torchrun
   from a shell); blockflow: ``PipelineParallel`` on a 2-worker ``LocalCluster`` (processes,
   1 thread each), its default segments and checkpoints. Throughput as a user sees it: rows
   per second over the ranks' wall time (``init_process_group`` to the last step) for
   torch, over the whole ``fit`` call for blockflow (segments, group formation, data placed,
   checkpoints kept on two workers), and the median step inside the group (after
   ``--warmup`` steps) for both. torch and blockflow alternate (A B A B), medians of
   ``--repeat`` rounds.
2. **Uneven devices** (``--only uneven``; speeds 1, 1, 0.5, 0.25 of 4 simulated GPU workers,
   :func:`blockflow.testing.simulated_cluster`): 16
   :class:`blockflow.testing.torch_layers.SimulatedLinear` layers widening with depth (32 to
   160 features), work proportional to parameters; a layer keeps its worker's simulated
   device busy ``work / speed`` seconds forward and twice that backward. blockflow's
   ``"speed"`` partition (measured layer times, worker order and cut of least step time)
   beside the best contiguous split computed offline from the same measured layer times
   (every device order and cut, run too) and the baselines as their users get them, stage
   ``s`` on device ``s``: equal layer counts (``torch.distributed.pipelining``'s split) and
   equal parameters (DeepSpeed's ``partition_method="parameters"``). GPipe, m = 16, the
   best of ``--steps`` steps; throughput from the step's timeline (first start to last stop).
3. **Peak stashed activations** (``--only bubble``): equal layers on p = 2 and 4 devices,
   m = 4p, GPipe and 1F1B: ``PipelineResult.peak_activations`` per stage (1F1B <= p, GPipe
   <= m) and GPipe's bubble against ``(p - 1) / (m + p - 1)``.
4. **A model larger than any one device** (``--only memory``): ``--big-layers`` layers of
   ``--big-width``^2 float32 with Adam on simulated devices of ``--device-mib``: the stages'
   bytes of parameters, gradients and optimizer state (``pipe.stage_bytes()``, measured on
   the workers) against each device's budget.

    python benchmarks/parallelism.py                  # all four, ~6 min on 2 cores
    python benchmarks/parallelism.py --only equal --repeat 3 --pipe-steps 48
    python benchmarks/parallelism.py --steps 1 --pipe-steps 12 --repeat 1 \
        --bubble-layer-seconds 0.02                   # smoke
    python benchmarks/parallelism.py tensor           # tensor parallel beside torch TP

Correctness (float64 loss, gradients and parameters equal one process's to 1e-10) is checked
by ``tests/ml/test_parallel.py``, not here.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import socket
import statistics
import tempfile
import time

import numpy as np

import blockflow
from blockflow.scheduling.view import workers_info
from blockflow.testing import set_speed, simulated_cluster

MiB = 2**20


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


# --- 1. equal workers: blockflow beside plain torch.distributed.pipelining ------------------

WIDTH, LAYERS, BATCH, MICRO = 1024, 8, 256, 4


def _pipe_model(seed: int = 0):
    import torch

    torch.manual_seed(seed)
    layers = [m for _ in range(LAYERS) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))


def _pipe_cut() -> list[int]:
    """Two stages of equal Linear layers: the first 4 Linear+ReLU, the rest and the head."""
    n = 2 * LAYERS + 1
    return [0, n // 2 + (n // 2) % 2, n]


def _pipe_data(steps: int):
    g = np.random.default_rng(0)
    X = g.standard_normal((BATCH * steps, WIDTH)).astype(np.float32)
    return X, g.integers(0, 10, BATCH * steps)


def _torch_pipe_rank(rank: int, world: int, port: int, schedule: str, steps: int,
                     out: str) -> None:
    """A rank of a plain ``torch.distributed.pipelining`` script, as a user writes it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    start = time.time()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    cut = _pipe_cut()
    seq = torch.nn.Sequential()
    for name, m in list(_pipe_model().named_children())[cut[rank]:cut[rank + 1]]:
        seq.add_module(name, m)
    opt = torch.optim.SGD(seq.parameters(), lr=1e-3)
    stage = PipelineStage(seq, rank, world, torch.device("cpu"))
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    sched = cls(stage, MICRO, loss_fn=torch.nn.CrossEntropyLoss())
    X, y = _pipe_data(steps)
    X, y = torch.from_numpy(X), torch.from_numpy(y)
    times = []
    for k in range(steps):
        t0 = time.perf_counter()
        if rank == 0:
            sched.step(X[k * BATCH:(k + 1) * BATCH])
        else:
            sched.step(target=y[k * BATCH:(k + 1) * BATCH])
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    end = time.time()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"start": start, "end": end, "times": times}, f)
    dist.destroy_process_group()


def _torch_pipe(schedule: str, steps: int) -> tuple[float, list[float]]:
    """Wall seconds (from ``init_process_group``, once both ranks reach it, to the last
    rank's last step: the spawned processes' imports, skewed on a loaded machine, are not
    counted) and the last rank's step seconds."""
    import torch.multiprocessing as mp

    with socket.socket() as s_:
        s_.bind(("127.0.0.1", 0))
        port = s_.getsockname()[1]
    # distributed set this in the client's environment when the cluster started; torchrun
    # from a shell has no such setting (it makes every tensor above 128 KiB an mmap)
    trim = os.environ.pop("MALLOC_TRIM_THRESHOLD_", None)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rank")
            mp.spawn(_torch_pipe_rank, args=(2, port, schedule, steps, out), nprocs=2)
            got = []
            for r in range(2):
                with open(f"{out}.{r}") as f:
                    got.append(json.load(f))
    finally:
        if trim is not None:
            os.environ["MALLOC_TRIM_THRESHOLD_"] = trim
    return max(g["end"] for g in got) - max(g["start"] for g in got), got[-1]["times"]


def _blockflow_pipe(client, workers, schedule: str, X, y) -> tuple[float, float, list, list]:
    """Seconds to construct and to ``fit`` (one epoch, batch 256, no shuffle), the steps'
    seconds on the last stage's rank, and the peak stashed activations of one more step."""
    import torch

    from blockflow.ml.parallel import PipelineParallel

    t0 = time.perf_counter()
    pipe = PipelineParallel(client, _pipe_model(), schedule=schedule,
                            partition=(workers, _pipe_cut()),
                            optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
                            loss=torch.nn.CrossEntropyLoss())
    t1 = time.perf_counter()
    pipe.fit(X, y, epochs=1, batch_size=BATCH, n_micro_batches=MICRO, shuffle=False)
    t2 = time.perf_counter()
    peaks = pipe.run(X[:BATCH], y[:BATCH], n_micro_batches=MICRO, publish=False,
                     return_output=False).peak_activations
    steps = [h["seconds"] for h in pipe.history_]
    pipe.close()
    return t1 - t0, t2 - t1, steps, peaks


def equal(args) -> str:
    """Section 1; returns the printed report."""
    from distributed import Client, LocalCluster

    steps, warm = args.pipe_steps, args.warmup
    X, y = _pipe_data(steps)
    rows_total = steps * BATCH
    res = {s: {"torch": [], "blockflow": []} for s in ("1f1b", "gpipe")}
    lines = [f"load average at start: {_load()} ({os.cpu_count()} cores)"]
    report = None
    try:
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                          dashboard_address=None) as cluster, Client(cluster) as c:
            workers = sorted(c.scheduler_info()["workers"])
            _blockflow_pipe(c, workers, "1f1b", X[:2 * BATCH], y[:2 * BATCH])  # workers import
            for rnd in range(args.repeat):
                for schedule in ("1f1b", "gpipe"):
                    wall, t = _torch_pipe(schedule, steps)
                    res[schedule]["torch"].append({"wall": wall, "step": np.median(t[warm:]),
                                                   "load": os.getloadavg()[0]})
                    ctor, fit, b, peaks = _blockflow_pipe(c, workers, schedule, X, y)
                    res[schedule]["blockflow"].append({"wall": fit, "ctor": ctor,
                                                       "step": np.median(b[warm:]),
                                                       "peaks": peaks,
                                                       "load": os.getloadavg()[0]})
                    tr, br = res[schedule]["torch"][-1], res[schedule]["blockflow"][-1]
                    print(f"  round {rnd + 1} {schedule}: torch wall {tr['wall']:.2f} s, step "
                          f"{tr['step'] * 1e3:.1f} ms; blockflow fit {fit:.2f} s (+ {ctor:.2f} s "
                          f"constructing), step {br['step'] * 1e3:.1f} ms; load {_load()}",
                          flush=True)
            rows = []
            for schedule, r in res.items():
                tw = statistics.median(x["wall"] for x in r["torch"])
                bw = statistics.median(x["wall"] for x in r["blockflow"])
                bc = statistics.median(x["wall"] + x["ctor"] for x in r["blockflow"])
                ts = statistics.median(x["step"] for x in r["torch"])
                bs = statistics.median(x["step"] for x in r["blockflow"])
                per = [t["wall"] / b["wall"] for t, b in zip(r["torch"], r["blockflow"])]
                rows.append({"schedule": schedule, "torch wall s": tw, "blockflow fit s": bw,
                             "torch rows/s": rows_total / tw, "blockflow rows/s": rows_total / bw,
                             "throughput bf/torch": tw / bw,
                             "per-round bf/torch": " ".join(f"{v:.2f}" for v in per),
                             "median per-round": statistics.median(per),
                             "with ctor bf/torch": tw / bc,
                             "torch step ms": ts * 1e3, "bf step ms": bs * 1e3,
                             "step throughput bf/torch": ts / bs})
            lines += [f"MLP {LAYERS} x Linear({WIDTH}) + ReLU + Linear({WIDTH}, 10), batch "
                      f"{BATCH} in "
                      f"{MICRO} micro-batches, 2 stages of equal layers {_pipe_cut()}, SGD, "
                      f"{steps} steps ({rows_total:,} rows, the same data), {args.repeat} rounds "
                      f"alternating torch and blockflow; medians",
                      _table(rows),
                      "torch: 2 ranks spawned (torch.multiprocessing, gloo, 1 thread, no "
                      "MALLOC_TRIM_THRESHOLD_), wall = init_process_group (once both ranks "
                      "are there, "
                      "imports not counted) to the last step; "
                      "blockflow: PipelineParallel on a LocalCluster of 2 worker processes x 1 "
                      "thread, wall = the fit call (default segments: group formed per "
                      "segment, data "
                      "placed, checkpoint kept on two workers); 'with ctor' adds the "
                      "PipelineParallel(...) construction; step = median step on the last rank "
                      f"after {warm} warm-up steps (blockflow: inside the group)",
                      "target: blockflow throughput >= 0.95x torch's (the rounds' median ratio: "
                      "torch and blockflow of a round ran back to back, under the same load)"]
            peaks = {s: r["blockflow"][-1]["peaks"] for s, r in res.items()}
            lines.append(f"peak stashed activations per stage, this model (m = {MICRO}, 2 stages): "
                         f"1F1B {peaks['1f1b']} (<= 2), GPipe {peaks['gpipe']} (<= {MICRO})")
            lines.append(f"load average at end: {_load()}")
            report = "\n".join(lines)
            print("\n== Equal workers: blockflow PipelineParallel beside torch.distributed."
                  "pipelining ==\n" + report + "\n", flush=True)
    except TimeoutError:  # the workers' slow shutdown on a loaded machine, report printed
        if report is None:
            raise
    return report


# --- 2-4. simulated devices ------------------------------------------------------------------


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


def _best_split(times: dict, devices: list, m: int, *, subsets: bool = False
                ) -> tuple[float, list, list]:
    """The contiguous split of least flush makespan, by exhaustive search: every order of
    the devices (of every subset of them with ``subsets``) and every cut."""
    from blockflow.ml.parallel.partition import flush_makespan, stage_times

    n = len(next(iter(times.values())))
    best = (float("inf"), None, None)
    for p in (range(1, len(devices) + 1) if subsets else [len(devices)]):
        for order in itertools.permutations(devices, p):
            for cuts in itertools.combinations(range(1, n), p - 1):
                bounds = [0, *cuts, n]
                t = flush_makespan(stage_times(times, bounds, order), m)
                if t < best[0]:
                    best = (t, list(order), bounds)
    return best


def _declared(args) -> dict:
    """The step times the layers' declared work gives (GPipe with a flush, m = 16): the
    best contiguous split over every device order and cut, the equal split in device order
    and in its best order, DeepSpeed's parameter split in device order, the ideal."""
    from blockflow.ml.parallel.partition import (
        equal_stages,
        flush_makespan,
        parameter_stages,
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
    best, order, bounds = _best_split(times, devices, m)
    ideal = m * sum(work) / sum(args.speeds)
    return {"best split": best, "best split order": [speeds[d] for d in order],
            "best split layers": [int(v) for v in np.diff(bounds)],
            "equal, device order": step(devices, equal), "equal, best order": best_equal,
            "parameters, device order": step(devices, params), "ideal": ideal}


def uneven(client, args, workers) -> tuple[list[dict], dict]:
    import torch

    from blockflow.ml.parallel.partition import flush_makespan, stage_times

    model, dims = _uneven_model(args.layers, args.work_per_kparam)
    rng = np.random.default_rng(3)
    X = rng.standard_normal((128, dims[0])).astype(np.float32)
    T = rng.standard_normal((128, dims[-1])).astype(np.float32)
    sgd = functools.partial(torch.optim.SGD, lr=1e-3)
    rows, placed, offline = [], [], {}
    todo = [("measured speed (blockflow)", "speed"), ("equal layers (torch)", "equal"),
            ("parameters (DeepSpeed)", "parameters")]
    while todo:
        label, partition = todo.pop(0)
        t0 = time.perf_counter()
        pipe = blockflow.PipelineParallel(client, model, optimizer=sgd, partition=partition,
                                          workers=workers, sample=X, checkpoint_every=0)
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
        if partition == "speed":  # every layer on every worker, by blockflow's probe
            measured = pipe.layer_times
            t, order, bounds = _best_split(measured, list(workers), 16)
            t_any, order_any, bounds_any = _best_split(measured, list(workers), 16,
                                                      subsets=True)
            offline = {"step": t, "order": [args.speeds[workers.index(w)] for w in order],
                       "layers": [int(v) for v in np.diff(bounds)],
                       "any_step": t_any,
                       "any_order": [args.speeds[workers.index(w)] for w in order_any],
                       "any_layers": [int(v) for v in np.diff(bounds_any)]}
            if (list(order), list(bounds)) != (list(pipe.stage_workers), list(pipe.bounds)):
                todo.insert(0, ("best split, offline (measured)", (order, bounds)))
            else:
                offline["same"] = True
        print(f"  {label}: {sizes} {[round(r.makespan, 2) for r in results]} s", flush=True)
        pipe.close()
    for row, (order, bounds) in zip(rows, placed):  # what the probe's times predicted
        row["predicted_s"] = flush_makespan(stage_times(measured, bounds, order), 16)
    return rows, offline


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
            runs = [pipe.run(X, np.zeros_like(X), n_micro_batches=m,
                             name=f"{schedule}-p{p}", return_output=False)
                    for _ in range(1 + args.steps)]
            r = min(runs, key=lambda r: r.bubble)
            peak = [max(x.peak_activations[s] for x in runs) for s in range(p)]
            rows.append({"schedule": schedule, "stages": p, "micro_batches": m,
                         "bubble": r.bubble, "gpipe_formula": r.ideal_bubble,
                         "rel_diff": r.bubble / r.ideal_bubble - 1,
                         "peak_activations": peak, "max_peak": max(peak),
                         "makespan": r.makespan})
            print(f"  {schedule} p={p} m={m}: bubble {r.bubble:.3f} vs {r.ideal_bubble:.3f}, "
                  f"activations held {peak} ({r.makespan:.1f} s)", flush=True)
            pipe.close()
    return rows


def big_model(client, args, workers) -> tuple[list[dict], int]:
    import torch

    from blockflow import config

    torch.manual_seed(0)
    w = args.big_width
    model = torch.nn.Sequential(*[m for _ in range(args.big_layers)
                                  for m in (torch.nn.Linear(w, w), torch.nn.GELU())])
    total = sum(p.numel() for p in model.parameters()) * 16  # params, grads, Adam moments
    X = np.random.default_rng(2).standard_normal((64, w)).astype(np.float32)
    pipe = blockflow.PipelineParallel(client, model, optimizer=torch.optim.Adam,
                                      workers=workers, sample=X, probe_repeats=1,
                                      checkpoint_every=0)
    for _ in range(args.steps):
        pipe.run(X, np.zeros_like(X), n_micro_batches=8, return_output=False,
                 name="big-model")
    budget = args.device_mib * float(config.get("parallel.memory-fraction"))
    rows = []
    for s, b in enumerate(pipe.stage_bytes()):
        rows.append({"stage": s, "layers": int(pipe.bounds[s + 1] - pipe.bounds[s]),
                     "stage_MiB": b / MiB, "device_MiB": args.device_mib,
                     "budget_MiB": budget, "stage/budget": b / MiB / budget})
    print(f"  model {total / MiB:.1f} MiB on devices of {args.device_mib:g} MiB: stages "
          f"{[round(r['stage_MiB'], 1) for r in rows]} MiB", flush=True)
    pipe.close()
    return rows, total


def _table(rows: list[dict]) -> str:
    import pandas as pd
    return pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.3f}")


def _print_uneven(un, offline, args) -> None:
    print(f"\n== Speeds {args.speeds} (devices 0-3): {args.layers} layers widening with "
          f"depth (work proportional to parameters), m = 16, GPipe, best of {args.steps} "
          f"steps; baselines with stage s on device s ==")
    print(_table(un))
    by = {r["partition"]: r for r in un}
    ours = by["measured speed (blockflow)"]["rows_per_s"]
    best_row = by.get("best split, offline (measured)", by["measured speed (blockflow)"])
    print(f"Best contiguous split computed offline from blockflow's measured layer times "
          f"(every device order and cut): layers {offline['layers']} on speeds "
          f"{offline['order']}, predicted step {offline['step']:.3f} s"
          + (" = blockflow's own choice" if offline.get("same") else
             f", measured {best_row['makespan']:.3f} s")
          + f"; on any subset of the devices: layers {offline['any_layers']} on speeds "
            f"{offline['any_order']}, {offline['any_step']:.3f} s")
    print(f"throughput, blockflow / best split: {ours / best_row['rows_per_s']:.2f}x "
          f"(target >= 0.90x); blockflow / equal layers: "
          f"{ours / by['equal layers (torch)']['rows_per_s']:.2f}x; blockflow / parameters "
          f"(DeepSpeed): {ours / by['parameters (DeepSpeed)']['rows_per_s']:.2f}x (target "
          f">= 1.25x where the bound allows)")
    d = _declared(args)
    print(f"From the declared work (step seconds, m = 16, flush makespan): best contiguous "
          f"split {d['best split']:.3f} (layers {d['best split layers']} on speeds "
          f"{d['best split order']}), ideal (total work / summed speeds x m, no bubble) "
          f"{d['ideal']:.3f}; equal layers in device order {d['equal, device order']:.3f}, "
          f"in its best device order {d['equal, best order']:.3f}; parameters in device "
          f"order {d['parameters, device order']:.3f}.")
    print(f"Bound on the ratios (declared work): best split / equal in device order "
          f"{d['equal, device order'] / d['best split']:.2f}x, / equal in its best order "
          f"{d['equal, best order'] / d['best split']:.2f}x (ideal: "
          f"{d['equal, best order'] / d['ideal']:.2f}x), / parameters "
          f"{d['parameters, device order'] / d['best split']:.2f}x\n", flush=True)


def _print_bubble(bb, args) -> None:
    print(f"\n== Peak stashed activations and bubble: equal stages on speed-1 devices, "
          f"m = 4p, {args.layers} layers of {args.bubble_layer_seconds:g} s forward, 2x "
          f"backward; peaks from PipelineResult.peak_activations (most of {1 + args.steps} "
          f"steps) ==")
    print(_table(bb))
    worst = max(abs(r["rel_diff"]) for r in bb if r["schedule"] == "gpipe")
    print(f"GPipe bubble: largest relative difference from (p-1)/(m+p-1): {worst:.1%}")
    ok = all(r["max_peak"] <= r["stages"] for r in bb if r["schedule"] == "1f1b")
    gp = all(r["max_peak"] <= r["micro_batches"] for r in bb if r["schedule"] == "gpipe")
    print(f"1F1B: every stage held <= p micro-batches: {ok}; GPipe: <= m: {gp}\n",
          flush=True)


def _print_big(rows, total, args) -> None:
    print(f"\n== A {total / MiB:.1f} MiB model (parameters, gradients, Adam) on "
          f"{args.device_mib:g} MiB devices ==")
    print(_table(rows))
    print(f"stage bytes (pipe.stage_bytes(), measured on the workers after the last step) / "
          f"device budget, worst stage: {max(r['stage/budget'] for r in rows):.3f} (target "
          f"<= 1); model larger than any one device: {total > args.device_mib * MiB}\n",
          flush=True)

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
    times = _timed_steps(model, batch, d, steps)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def _one_process_steps(d: int, hidden: int, batch: int, steps: int) -> list[float]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = _timed_steps(_tp_block(d, hidden, torch.float32), batch, d, steps)
    torch.set_num_threads(threads)
    return times


def _timed_steps(model, batch: int, d: int, steps: int) -> list[float]:
    """Seconds of each SGD step of ``model`` on the benchmark's data (MSE)."""
    import torch

    X, Y = (torch.tensor(a, dtype=torch.float32) for a in _tp_data(batch, d))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(X), Y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
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
    ap.add_argument("--only", choices=["equal", "uneven", "bubble", "memory"], default=None)
    ap.add_argument("--pipe-steps", type=int, default=48, help="steps, equal section")
    ap.add_argument("--warmup", type=int, default=4, help="steps before the median step")
    ap.add_argument("--repeat", type=int, default=3, help="rounds, equal section")
    ap.add_argument("--steps", type=int, default=2, help="steps, simulated sections")
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
    print(f"load average at start: {_load()} ({os.cpu_count()} cores); arguments "
          f"{vars(args)}", flush=True)
    want = {args.only} if args.only else {"equal", "uneven", "bubble", "memory"}
    if "equal" in want:
        equal(args)
    if want - {"equal"}:
        # tables are printed as each section ends, inside the cluster: a slow shutdown of a
        # loaded machine's worker processes cannot lose them
        try:
            with simulated_cluster(speeds=(1, 1, 1, 1),
                                   device_memory=f"{args.device_mib}MiB") as c:
                workers = _speeds(c, [1, 1, 1, 1])
                if "bubble" in want:
                    print("Peak stashed activations and bubble, equal devices and stages:",
                          flush=True)
                    _print_bubble(bubble(c, args, workers), args)
                if "memory" in want:
                    print("A model larger than any one device:", flush=True)
                    _print_big(*big_model(c, args, workers), args)
                if "uneven" in want:
                    _speeds(c, args.speeds)
                    print(f"Pipeline on uneven devices {args.speeds}:", flush=True)
                    _print_uneven(*uneven(c, args, workers), args)
        except TimeoutError:  # the workers' slow shutdown: every table is printed
            print("(the simulated cluster's workers were slow to close)")
    print(f"total run {time.perf_counter() - start:.0f} s; load average at end: {_load()}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["tensor"]:
        tensor_parallel_main(sys.argv[2:])
    else:
        main()
