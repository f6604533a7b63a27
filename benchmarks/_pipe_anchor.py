"""Plain ``torch.distributed.pipelining`` (spawned ranks, gloo) beside blockflow's
``PipelineParallel`` on the same model, split, schedule and cores: median step.

    python benchmarks/_pipe_anchor.py --steps 12     # the issue's anchor, 2 ranks
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

WIDTH, LAYERS, BATCH, MICRO = 1024, 8, 256, 4


def model(seed=0):
    import torch

    torch.manual_seed(seed)
    layers = [m for _ in range(LAYERS) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))


def _rank(rank, world, steps, port, out):
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    full = model()
    n = len(full)
    cut = [0, n // 2 + (n // 2) % 2, n][rank:rank + 2] if world == 2 else [0, n]
    seq = torch.nn.Sequential()
    for name, m in list(full.named_children())[cut[0]:cut[1]]:
        seq.add_module(name, m)
    opt = torch.optim.SGD(seq.parameters(), lr=1e-3)
    stage = PipelineStage(seq, rank, world, torch.device("cpu"))
    loss = torch.nn.CrossEntropyLoss()
    sched = Schedule1F1B(stage, MICRO, loss_fn=loss)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(BATCH, WIDTH, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        if rank == 0:
            sched.step(X)
        else:
            sched.step(target=y)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    if rank == world - 1:
        out.put(times)
    dist.destroy_process_group()


def torch_steps(steps: int) -> list[float]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(2, steps, 29533, q), nprocs=2, start_method="spawn")
    return q.get()


def blockflow_steps(steps: int) -> tuple[list[float], list]:
    import torch
    from distributed import Client, LocalCluster

    from blockflow.ml.parallel import PipelineParallel

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cl, Client(cl) as c:
        workers = sorted(c.scheduler_info()["workers"])
        n = 2 * LAYERS + 1
        cut = n // 2 + (n // 2) % 2
        pipe = PipelineParallel(c, model(), schedule="1f1b", partition=(workers, [0, cut, n]),
                                optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
                                loss=torch.nn.CrossEntropyLoss(), checkpoint_every=0)
        g = np.random.default_rng(0)
        X = g.standard_normal((BATCH * steps, WIDTH)).astype(np.float32)
        y = g.integers(0, 10, BATCH * steps)
        pipe.fit(X, y, epochs=1, batch_size=BATCH, n_micro_batches=MICRO, shuffle=False)
        peaks = pipe.run(X[:BATCH], y[:BATCH], n_micro_batches=MICRO,
                         publish=False).peak_activations
        return [h["seconds"] for h in pipe.history_], peaks


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    warm = max(1, args.steps // 4)
    t = torch_steps(args.steps)[warm:]
    b, peaks = blockflow_steps(args.steps)
    tm, bm = statistics.median(t), statistics.median(b[warm:])
    print(f"== Equal workers: MLP {LAYERS} x Linear({WIDTH}) + ReLU + head, batch {BATCH} in "
          f"{MICRO} micro-batches, 1F1B, 2 ranks of 1 thread, equal split, "
          f"{args.steps} steps ({warm} warm-up) ==")
    print(f"torch.distributed.pipelining (spawn, gloo): median step {tm * 1e3:.1f} ms")
    print(f"blockflow PipelineParallel (2 workers):      median step {bm * 1e3:.1f} ms "
          f"(step on the last rank, inside the group)")
    print(f"blockflow throughput / torch's: {tm / bm:.2f}x (target >= 0.95x)")
    print(f"peak stashed activations per stage (1F1B, m = {MICRO}): {peaks} (<= stages = 2)")


if __name__ == "__main__":
    main()
