"""Data-parallel training (issue 38): blockflow's DataParallelTrainer beside torch DDP.

Run: ``python benchmarks/training.py`` (full) or ``--steps 12 --epochs 1`` (smoke).

1. Identical workers: torch DDP launched as torchrun would (``torch.multiprocessing.spawn``,
   gloo, 2 ranks x 1 thread) against ``DataParallelTrainer`` on a 2-worker LocalCluster (1
   thread each), same model (an MLP 512-2048-2048-10, 5.3 M parameters, and a small
   transformer), same data, same global batch (256) and the same per-rank rows (the equal
   round-robin blocks ``sharding="equal"`` gives): median step time after warm-up, fit wall
   time for the same epochs and held-out accuracy; ratios blockflow / DDP.
2. Uneven workers (simulated speeds 1, 1, 0.5, 0.25; each rank's step stretched to
   ``k x CPU seconds / speed``, ``k`` from :func:`blockflow.testing.device_scale`, in the
   block hook, before the rank's allreduce): time to a held-out accuracy with
   speed-weighted shares against DDP's equal local batches on the same ranks
   (``sharding="equal"``), final accuracies side by side.
3. A GLM pass's per-block work (issue 39): blockflow's row-independent terms and exact
   sums (the same coefficients on any block boundaries) beside plain NumPy/BLAS.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

SPEEDS = (1, 1, 0.5, 0.25)
FEATURES, CLASSES, BATCH = 512, 10, 256


def data(n, seed=0):
    """A separable-with-noise 10-class problem on 512 features (float32); one ``W`` for
    every seed (training and held-out rows of the same problem)."""
    W = np.random.default_rng(0).normal(size=(FEATURES, CLASSES)).astype(np.float32)
    rng = np.random.default_rng(seed + 1)
    X = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = (X @ W + 4 * rng.normal(size=(n, CLASSES))).argmax(1).astype(np.int64)
    return X, y


class Transformer:  # built lazily: torch imported in the ranks
    @staticmethod
    def build():
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = torch.nn.Linear(32, 64)
                layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0,
                                                         batch_first=True)
                self.encoder = torch.nn.TransformerEncoder(layer, 2)
                self.head = torch.nn.Linear(64, CLASSES)

            def forward(self, x):
                h = self.encoder(self.embed(x.reshape(len(x), 16, 32)))
                return self.head(h.mean(1))
        return Net()


def make(kind, seed=0):
    import torch
    torch.manual_seed(seed)
    if kind == "small":
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(),
                                   torch.nn.Linear(256, CLASSES))
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 2048), torch.nn.ReLU(),
                                   torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                                   torch.nn.Linear(2048, CLASSES))
    return Transformer.build()


def adam(params):
    import torch
    return torch.optim.Adam(params, lr=1e-3)


def accuracy(model, X, y):
    import torch
    with torch.no_grad():
        return float((model(torch.as_tensor(X)).argmax(1).numpy() == y).mean())


def _ddp_rank(rank, world, port, kind, X, y, block_rows, epochs, max_steps, out):
    import torch
    import torch.distributed as dist

    from blockflow.ml import batch_schedule
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    model = make(kind)
    net = torch.nn.parallel.DistributedDataParallel(model)
    opt = adam(model.parameters())
    off = np.concatenate([[0], np.cumsum(block_rows)])
    mine = [j for j in range(len(block_rows)) if j % world == rank]  # round robin
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y)
    times, t_fit, steps = [], time.perf_counter(), 0
    for e in range(epochs):
        for rows in batch_schedule(block_rows, BATCH, e, 0):
            n_g = sum(len(r) for r in rows)
            idx = np.concatenate([off[j] + rows[j] for j in mine])
            t0 = time.perf_counter()
            out_ = net(Xt[idx])
            loss = torch.nn.functional.cross_entropy(out_, yt[idx]) * (len(idx) * world / n_g)
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
            steps += 1
            if steps >= max_steps:
                break
    wall = time.perf_counter() - t_fit
    if rank == 0:
        torch.save({"times": times, "wall": wall, "state": model.state_dict()}, out)
    dist.destroy_process_group()


def ddp(kind, X, y, block_rows, epochs, max_steps):
    import tempfile

    import torch
    import torch.multiprocessing as mp
    from distributed.utils import open_port
    out = os.path.join(tempfile.mkdtemp(), "ddp.pt")
    # a LocalCluster leaves MALLOC_TRIM_THRESHOLD_ in this process's environment (Dask's
    # nanny setting); torchrun from a shell would not pass it to the ranks
    trim = os.environ.pop("MALLOC_TRIM_THRESHOLD_", None)
    t0 = time.perf_counter()
    try:
        mp.spawn(_ddp_rank, args=(2, open_port(), kind, X, y, block_rows, epochs, max_steps,
                                  out), nprocs=2)
    finally:
        if trim is not None:
            os.environ["MALLOC_TRIM_THRESHOLD_"] = trim
    launch = time.perf_counter() - t0
    r = torch.load(out, weights_only=False)
    model = make(kind)
    model.load_state_dict(r["state"])
    return r["times"], r["wall"], launch, model


def _stretch(seconds, cpu_seconds, rows, per_row=1e-3):
    """block_hook: the rank's local step takes ``per_row x rows / speed`` seconds in all
    (worker name i has speed SPEEDS[i]; its real compute counts towards it), before it
    waits on its peers: a device whose work is its rows, as 4 ranks on 2 shared cores
    cannot show by their CPU seconds."""
    from distributed import get_worker
    speed = SPEEDS[int(get_worker().name)]
    time.sleep(max(0.0, per_row * rows / speed - seconds))


def blockflow_fit(client, kind, X, y, epochs, max_steps, sharding="equal", hook=None,
                  every=None):
    import dask.array as da
    import torch
    from distributed import wait

    from blockflow.ml import DataParallelTrainer
    model = make(kind)

    def stop(trainer, rec):  # ends at the end of a segment: segments of max_steps here
        return rec["step"] + 1 >= max_steps

    trainer = DataParallelTrainer(model, torch.nn.CrossEntropyLoss(), adam, batch_size=BATCH,
                                  epochs=epochs, client=client, sharding=sharding,
                                  block_hook=hook, callback=stop,
                                  checkpoint_every=every or max_steps)
    # the data already in the cluster's memory, as the DDP ranks have theirs (a user
    # loading with Dask); the fit's own placement of blocks on the ranks is timed
    Xd, yd = client.persist([da.from_array(X, chunks=(64, -1)), da.from_array(y, chunks=64)])
    wait([Xd, yd])
    t0 = time.perf_counter()
    trainer.fit(Xd, yd)
    wall = time.perf_counter() - t0
    return trainer, wall, model


def equal_section(args, out):
    from distributed import Client, LocalCluster
    X, y = data(args.rows)
    Xte, yte = data(2000, seed=1)
    block_rows = [64] * (len(X) // 64) + ([len(X) % 64] if len(X) % 64 else [])
    out("## identical workers: 2 ranks x 1 thread, global batch 256 (median step after "
        f"2 warm-up steps; medians of {args.repeat} alternated runs)")
    out("DDP fit s: its ranks' training loop, after their processes started and joined "
        "(launch s: spawn to exit); blockflow fit s: fit() from the call, blocks placed on "
        "the ranks, group formed, the model back on the client")
    out("| model | params | torch DDP step ms | blockflow step ms | ratio | DDP fit s | "
        "blockflow fit s | ratio | DDP launch s | DDP acc | blockflow acc |")
    out("|---|---|---|---|---|---|---|---|---|---|---|")
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        for kind in ("mlp", "transformer"):
            n_params = sum(p.numel() for p in make(kind).parameters())
            blockflow_fit(client, kind, X[:1024], y[:1024], 1, 3)  # warm the workers
            runs = []
            for _ in range(args.repeat):  # alternated: a load change hits both sides
                times, wall, launch, m_ddp = ddp(kind, X, y, block_rows, args.epochs,
                                                 args.steps)
                tr, bwall, m_bf = blockflow_fit(client, kind, X, y, args.epochs, args.steps)
                runs.append((statistics.median(times[2:]) * 1e3,
                             statistics.median([r["seconds"] for r in tr.history_[2:]]) * 1e3,
                             wall, bwall, launch))
            d, b, wall, bwall, launch = (statistics.median(c) for c in zip(*runs))
            out(f"| {kind} | {n_params / 1e6:.2f} M | {d:.1f} | {b:.1f} | {b / d:.2f}x | "
                f"{wall:.2f} | {bwall:.2f} | {bwall / wall:.2f}x | {launch:.2f} | "
                f"{accuracy(m_ddp, Xte, yte):.4f} | {accuracy(m_bf, Xte, yte):.4f} |")


def uneven_section(args, out):
    from distributed import Client, LocalCluster
    X, y = data(args.rows)
    Xte, yte = data(2000, seed=1)
    out("\n## uneven workers: simulated speeds 1, 1, 0.5, 0.25 (4 ranks, 1 ms per row at "
        "speed 1), MLP 512-256-10, "
        f"{args.uneven_epochs} epochs")
    out("| shares | fit s | steps | final held-out acc | rows per worker (speed order) |")
    out("|---|---|---|---|---|")
    res = {}
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        blockflow_fit(client, "small", X[:1024], y[:1024], 1, 3)  # warm the workers
        names = None
        for sharding in ("equal", "speed"):
            tr, wall, model = blockflow_fit(client, "small", X, y, args.uneven_epochs,
                                               10 ** 9, sharding=sharding, hook=_stretch,
                                               every=args.segment)
            if names is None:
                from blockflow.scheduling.view import workers_info
                names = {a: int(w["name"]) for a, w in workers_info(client).items()}
            rows = tr.shards_.rows_per_worker()
            order = [rows.get(a, 0) for a in sorted(rows, key=lambda a: names[a])]
            acc = accuracy(model, Xte, yte)
            res[sharding] = (wall, acc)
            out(f"| {sharding} | {wall:.2f} | {len(tr.history_)} | {acc:.4f} | {order} |")
    (we, ae), (ws, as_) = res["equal"], res["speed"]
    out(f"\nspeed-weighted vs DDP equal local batches: {we / ws:.2f}x faster to the same "
        f"epochs (ideal 2.75x); accuracy {as_:.4f} vs {ae:.4f} "
        f"(difference {abs(as_ - ae) * 100:.2f} %)")


def _kill_at(flag, step, seconds, cpu_seconds, rows):
    """block_hook: worker named 1 kills its own process at its ``step``-th step of the
    fit (once: the flag file); 1 ms per row of device time on every worker."""
    from distributed import get_worker
    time.sleep(max(0.0, 1e-3 * rows - seconds))
    if get_worker().name != 1 or os.path.exists(flag):
        return
    _kill_at.calls = getattr(_kill_at, "calls", 0) + 1
    if _kill_at.calls == step:
        open(flag, "w").close()
        os.kill(os.getpid(), 9)


def fault_section(args, out):
    """A worker killed mid-epoch: the fit's time against a fault-free one (same cluster
    size, same data and seed), parameters compared (float64)."""
    import functools
    import tempfile

    import dask.array as da
    import torch
    from distributed import Client, LocalCluster, wait

    from blockflow.ml import DataParallelTrainer
    X, y = data(args.rows)
    out("\n## a worker killed mid-epoch (3 workers, MLP 512-256-10 in float64, "
        f"{args.fault_epochs} epochs, checkpoint_every {args.segment})")
    out("| run | fit s | steps | recoveries | max abs parameter difference |")
    out("|---|---|---|---|---|")
    flag = os.path.join(tempfile.mkdtemp(), "killed")
    models, walls = [], []
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        Xd, yd = client.persist([da.from_array(X.astype(np.float64), chunks=(64, -1)),
                                 da.from_array(y, chunks=64)])
        wait([Xd, yd])
        steps = args.fault_epochs * (len(X) // BATCH)
        for i, kill in enumerate((None, steps // 2, None)):
            model = make("small").double()
            hook = functools.partial(_kill_at, flag if kill else flag + "-none",
                                     kill or 10 ** 9)
            if kill is None:
                open(flag + "-none", "w").close()
            tr = DataParallelTrainer(model, torch.nn.CrossEntropyLoss(), adam,
                                     batch_size=BATCH, epochs=args.fault_epochs,
                                     client=client, sharding="equal", block_hook=hook,
                                     checkpoint_every=args.segment)
            t0 = time.perf_counter()
            tr.fit(Xd, yd)
            walls.append(time.perf_counter() - t0)
            models.append(torch.nn.utils.parameters_to_vector(model.parameters()).detach())
            diff = float((models[-1] - models[0]).abs().max())
            name = "warm-up, fault-free" if i == 0 else "killed" if kill else "fault-free"
            out(f"| {name} | {walls[-1]:.2f} | {len(tr.history_)} | "
                f"{tr.recoveries_ if kill else '-'} | {diff:.1e} |")
    out(f"\nkilled / fault-free: {walls[1] / walls[2]:.2f}x (target <= 2x plus the restart)")


def _blas_pass(xb, yb, coef):
    """The anchor: a logistic GLM's per-block sums as NumPy and BLAS give them."""
    z = xb @ coef[:-1] + coef[-1]
    d = 1 / (1 + np.exp(-z)) - yb
    return float((np.logaddexp(0, z) - yb * z).sum()), xb.T @ d, float(d.sum())


def glm_section(args, out):
    """One GLM pass's per-block work: blockflow's row-independent terms and exact sums
    (:func:`blockflow.ml.glm._glm_pass`) beside plain NumPy/BLAS, alternated."""
    from blockflow.ml._passes import merge_groups
    from blockflow.ml.glm import _glm_pass

    rng = np.random.default_rng(0)
    X = rng.standard_normal((args.glm_rows, 20))
    y = (rng.random(args.glm_rows) > 0.5).astype(float)
    coef = rng.standard_normal(21) * 0.1
    times = {"blockflow": [], "NumPy/BLAS": []}
    for rep in range(2 * args.repeat):
        for name in (("blockflow", "NumPy/BLAS") if rep % 2 else ("NumPy/BLAS", "blockflow")):
            t = time.perf_counter()
            if name == "blockflow":
                merge_groups([_glm_pass([(X, y)], [None], "logistic", coef, 0)])
            else:
                _blas_pass(X, y, coef)
            times[name].append(time.perf_counter() - t)
    b, n = statistics.median(times["blockflow"]), statistics.median(times["NumPy/BLAS"])
    out(f"\n3. A logistic GLM pass over one block of {args.glm_rows:,} x 20 float64 rows "
        f"(median of {2 * args.repeat}, alternated): blockflow (fixed row groups, "
        f"the same bits on any block boundaries) {b * 1e3:.1f} ms, NumPy/BLAS {n * 1e3:.1f} ms: "
        f"{b / n:.2f}x")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=3, help="alternated runs per model (1.)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=48, help="steps per fit in section 1")
    p.add_argument("--uneven-epochs", type=int, default=3)
    p.add_argument("--segment", type=int, default=100,
                   help="checkpoint_every (section 2; blockflow.ml.checkpoint-every)")
    p.add_argument("--fault-epochs", type=int, default=2)
    p.add_argument("--glm-rows", type=int, default=1_000_000, help="rows of section 3")
    p.add_argument("--only", choices=["equal", "uneven", "fault", "glm"], default=None)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    lines = []

    def out(s):
        print(s, flush=True)
        lines.append(s)

    load = os.getloadavg()
    out(f"# {time.strftime('%Y-%m-%d')} {' '.join(sys.argv)}; load {load[0]:.1f} at start")
    if args.only in (None, "equal"):
        equal_section(args, out)
    if args.only in (None, "uneven"):
        uneven_section(args, out)
    if args.only in (None, "fault"):
        fault_section(args, out)
    if args.only in (None, "glm"):
        glm_section(args, out)
    out(f"load {os.getloadavg()[0]:.1f} at the end")
    if args.output:
        with open(args.output, "a") as f:
            f.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
