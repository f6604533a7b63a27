"""Data-parallel training and GLMs (issue 12): correctness, uneven devices, overhead.

Run: ``python benchmarks/training.py --repeat 3`` (needs ``blockflow[ai]``).

1. Correctness: an MLP on scikit-learn's digits on 4 workers against a single-process PyTorch
   loop over the same batches (max relative loss difference per step, held-out accuracy);
   GLMs against scikit-learn's coefficients on breast_cancer and a flights subset.
2. Uneven devices: a simulated cluster with speeds 1, 1, 0.5, 0.25; each gradient task's
   real compute time is stretched by its device's speed factor (``seconds x (1/speed - 1)``
   of sleep after it). Time to a held-out accuracy target for speed-weighted shards and for
   equal shards (synchronous data parallelism as DDP/xgboost.dask shard), on the same
   cluster; ideal = total reference work / total speed (sum over tasks of seconds x speed,
   divided by 2.75), i.e. no overhead and perfect balance.
3. Per-step overhead on identical CPU workers: median step wall time on 4 identical workers
   against the same step in one process.

Medians over ``--repeat`` repetitions are printed as tables.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import numpy as np

from blockflow._client import workers_info

SPEEDS = (1, 1, 0.5, 0.25)


def _stretch(seconds):
    """block_hook: scale this task's compute by the simulated device's speed."""
    from blockflow.testing.simulated import get_device
    dev = get_device()
    if dev is not None:
        time.sleep(seconds * (1 / dev.speed() - 1))


def mlp(hidden, seed=0, layers=1):
    """An MLP on the 64 digits pixels: ``layers`` hidden layers of ``hidden`` units."""
    import torch
    torch.manual_seed(seed)
    sizes = [64] + [hidden] * layers
    parts = []
    for a, b in zip(sizes, sizes[1:]):
        parts += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*parts, torch.nn.Linear(hidden, 10)).double()


def digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    X, y = load_digits(return_X_y=True)
    return train_test_split(X / 16.0, y, test_size=0.25, random_state=0)


def accuracy(model, X, y):
    import torch
    with torch.no_grad():
        return float((model(torch.as_tensor(X)).argmax(1).numpy() == y).mean())


def single_process(model, X, y, block_rows, batch, epochs, seed):
    import torch

    from blockflow.ml import batch_schedule
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    off = np.concatenate([[0], np.cumsum(block_rows)])
    losses, times = [], []
    for e in range(epochs):
        for rows in batch_schedule(block_rows, batch, e, seed):
            t0 = time.perf_counter()
            idx = np.concatenate([off[j] + r for j, r in enumerate(rows)])
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(torch.as_tensor(X[idx])),
                                                     torch.as_tensor(y[idx]))
            loss.backward()
            opt.step()
            losses.append(loss.item())
            times.append(time.perf_counter() - t0)
    return np.array(losses), times


def correctness(client, hidden):
    import dask.array as da
    import torch

    from blockflow.ml import DataParallelTrainer
    Xtr, Xte, ytr, yte = digits()
    model = mlp(hidden)
    ref = copy.deepcopy(model)
    tr = DataParallelTrainer(model, torch.nn.CrossEntropyLoss(),
                             lambda p: torch.optim.Adam(p, lr=0.01), batch_size=256,
                             epochs=14, seed=3, client=client)
    tr.fit(da.from_array(Xtr, chunks=100), da.from_array(ytr, chunks=100))
    expected, times = single_process(ref, Xtr, ytr, tr.shards_.block_rows, 256, 14, 3)
    rel = float(np.max(np.abs(tr.loss_curve() - expected) / np.abs(expected)))
    return {"max_rel_loss_diff": rel, "accuracy": accuracy(model, Xte, yte),
            "step_s": statistics.median(r["seconds"] for r in tr.history_),
            "single_step_s": statistics.median(times)}


def glms(client):
    import dask.array as da
    import sklearn.linear_model as sk
    from sklearn.datasets import load_breast_cancer
    from sklearn.preprocessing import StandardScaler

    from blockflow.ml import LinearRegression, LogisticRegression, PoissonRegression
    from blockflow.workloads.flights import read_table
    from blockflow.workloads.train import N_FEATURES, flight_features

    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    f = flight_features(read_table("flights", nrows=50_000)).astype(np.float64)
    counts = load_breast_cancer().data[:, 0].round()
    cases = [
        ("logistic, breast_cancer", LogisticRegression(C=0.5, client=client),
         sk.LogisticRegression(C=0.5, tol=1e-12, max_iter=10_000), X, y),
        ("ridge, breast_cancer", LinearRegression(alpha=2.0, client=client),
         sk.Ridge(alpha=2.0), X, y.astype(float)),
        ("poisson, breast_cancer", PoissonRegression(alpha=0.01, client=client),
         sk.PoissonRegressor(alpha=0.01, tol=1e-12, max_iter=10_000), X, counts),
        ("logistic, flights 50k", LogisticRegression(C=1.0, client=client),
         sk.LogisticRegression(C=1.0, tol=1e-12, max_iter=10_000), f[:, :N_FEATURES],
         f[:, N_FEATURES]),
    ]
    out = {}
    for name, ours, theirs, A, b in cases:
        t0 = time.perf_counter()
        ours.fit(da.from_array(A, chunks=(max(50, len(A) // 8), -1)),
                 da.from_array(b, chunks=max(50, len(A) // 8)))
        secs = time.perf_counter() - t0
        theirs.fit(A, b)
        a1 = np.append(ours.coef_, ours.intercept_)
        b1 = np.append(np.ravel(theirs.coef_), theirs.intercept_)
        out[name] = (float(np.linalg.norm(a1 - b1) / np.linalg.norm(b1)), secs,
                     ours.n_passes_)
    return out


def uneven(client, sharding, hidden, target, max_epochs, layers=1, lr=0.01):
    import dask.array as da
    import torch

    from blockflow.ml import DataParallelTrainer
    Xtr, Xte, ytr, yte = digits()
    speed_of = {}
    for a, w in workers_info(client).items():
        speed_of[a] = SPEEDS[int(w["name"])]
    model = mlp(hidden, layers=layers)
    t_start = time.perf_counter()
    reached = {}

    def stop(trainer, record):
        if record["step"] % 3 == 2 and accuracy(model, Xte, yte) >= target:
            reached["t"] = time.perf_counter() - t_start
            return True
        return False

    tr = DataParallelTrainer(model, torch.nn.CrossEntropyLoss(),
                             lambda p: torch.optim.Adam(p, lr=lr), batch_size=512,
                             epochs=max_epochs, seed=0, client=client, sharding=sharding,
                             block_hook=_stretch, callback=stop, rebalance_every=5)
    tr.fit(da.from_array(Xtr, chunks=25), da.from_array(ytr, chunks=25))
    wall = reached.get("t", float("nan"))
    work = sum(s * speed_of.get(a, 1) for r in tr.history_
               for a, s in r["worker_seconds"].items())
    ideal = work / sum(SPEEDS)
    return {"wall": wall, "ideal": ideal, "steps": len(tr.history_),
            "rows": sorted(tr.shards_.rows_per_worker().values())}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=1,
                   help="hidden layers of the uneven-devices MLP (more: more compute per step)")
    p.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate (uneven)")
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--max-epochs", type=int, default=30)
    p.add_argument("--only", choices=["correctness", "uneven"], default=None)
    args = p.parse_args()
    if args.only != "uneven":
        _correctness_tables(args)
    if args.only != "correctness":
        _uneven_table(args)


def _correctness_tables(args):
    from distributed import Client, LocalCluster

    rows = []
    with LocalCluster(n_workers=4, threads_per_worker=1, dashboard_address=":0") as c, \
            Client(c) as client:
        for _ in range(args.repeat):
            rows.append(correctness(client, args.hidden))
        g = glms(client)
    print("\n## Correctness and overhead (4 identical CPU workers; medians of "
          f"{args.repeat})")
    for k in rows[0]:
        print(f"{k:20s} {statistics.median(r[k] for r in rows):.3g}")
    print("\n## GLMs vs scikit-learn (relative coefficient difference, seconds, passes)")
    for name, (rel, secs, passes) in g.items():
        print(f"{name:26s} {rel:.2e}  {secs:6.1f} s  {passes} passes")


def _one_thread():
    import torch
    torch.set_num_threads(1)


def _uneven_table(args):
    from blockflow.testing import simulated_cluster

    res = {"speed": [], "equal": []}
    with simulated_cluster(speeds=SPEEDS) as client:
        # one intra-op thread per worker, as one process per device would have: 4 workers
        # with a thread per core each would fight over the cores
        client.run(_one_thread)
        uneven(client, "equal", args.hidden, 0.0, 1, args.layers)  # warm-up: imports, transfers
        for i in range(args.repeat):
            for sharding in (("speed", "equal") if i % 2 == 0 else ("equal", "speed")):
                res[sharding].append(uneven(client, sharding, args.hidden, args.target,
                                            args.max_epochs, args.layers, args.lr))
    print(f"\n## Uneven devices (speeds {SPEEDS}), time to {args.target:.0%} held-out "
          f"accuracy, medians of {args.repeat}; MLP {args.layers} x {args.hidden} hidden, "
          f"Adam lr {args.lr:g}, batch 512")
    print(f"{'sharding':10s} {'wall s':>8s} {'ideal s':>8s} {'wall/ideal':>10s} {'steps':>6s}")
    for k, rs in res.items():
        wall = statistics.median(r["wall"] for r in rs)
        ideal = statistics.median(r["ideal"] for r in rs)
        print(f"{k:10s} {wall:8.2f} {ideal:8.2f} {wall / ideal:10.2f} "
              f"{statistics.median(r['steps'] for r in rs):6.0f}  rows {rs[-1]['rows']}")
    sw = statistics.median(r["wall"] for r in res["speed"])
    ew = statistics.median(r["wall"] for r in res["equal"])
    print(f"equal / speed wall time: {ew / sw:.2f}x")


if __name__ == "__main__":
    main()
