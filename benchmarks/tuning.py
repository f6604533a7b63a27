"""Hyperparameter tuning on uneven devices: blockflow's ASHA vs synchronous successive halving.

The scenario of issue 12: a simulated cluster of 4 worker processes (1 thread each) at
speeds 1, 1, 0.5 and 0.25 (:func:`blockflow.testing.simulated_cluster`; the speed factor
is applied to the real compute time of each trial task by
:func:`blockflow.testing.slowed_to_device_speed`). The workload is the one ``blockflow run
tune`` runs: ``--configs`` MLP configurations on scikit-learn's bundled digits
(:mod:`blockflow.workloads.digits_tuning`, one epoch per budget unit), eta 3, budgets 1 to
``--max-epochs``. Both methods run the same configurations on the same cluster, in
alternating order:

* **ASHA** (:func:`blockflow.tune.tune`): no rung barrier, one trial task per free worker,
  promotions placed by earliest finish time on the speeds the tuner learns;
* **synchronous SH** (``tune(..., synchronous=True)``): every rung waits for all its trials,
  the top 1/eta go on; Dask places the tasks (dask-ml's ``SuccessiveHalvingSearchCV``
  scheme; dask-ml itself does not install beside this Dask release).

Measured per run: wall time, best validation accuracy, busy fraction (summed task time over
4 workers x wall time). The table gives medians over ``--repeats`` runs.

    python benchmarks/tuning.py                      # 81 configs, up to 27 epochs, 3 repeats
    python benchmarks/tuning.py --configs 27 --max-epochs 9 --repeats 1   # smoke

Per-run lines go to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", type=int, default=81)
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--max-epochs", type=int, default=27)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speeds", default="1,1,0.5,0.25")
    a = p.parse_args(argv)
    speeds = tuple(float(s) for s in a.speeds.split(","))

    from blockflow.testing import simulated_cluster, slowed_to_device_speed
    from blockflow.tune import sample_configs, tune
    from blockflow.workloads.digits_tuning import SPACE, train_digits_mlp

    train = slowed_to_device_speed(train_digits_mlp)
    configs = sample_configs(SPACE, a.configs, a.seed)
    rows = {"ASHA (blockflow)": [], "synchronous SH": []}
    with simulated_cluster(speeds=speeds) as client:
        # warm every worker (imports, first allocations) so no method pays for them
        client.run(lambda: train_digits_mlp(configs[0], 1) and None)
        for rep in range(a.repeats):
            order = list(rows) if rep % 2 == 0 else list(rows)[::-1]
            for name in order:
                r = tune(train, configs, client=client, eta=a.eta, min_budget=1,
                         max_budget=a.max_epochs, synchronous=name != "ASHA (blockflow)",
                         publish=False)
                n_tasks = len(r.history)
                rows[name].append((r.wall_time, r.best_score, r.busy_fraction, n_tasks))
                print(f"rep {rep} {name}: wall {r.wall_time:.2f} s, best val accuracy "
                      f"{r.best_score:.4f} (trial {r.best_trial}), busy "
                      f"{r.busy_fraction:.0%}, {n_tasks} trial tasks", file=sys.stderr)
    med = {k: [statistics.median(x[i] for x in v) for i in range(4)] for k, v in rows.items()}
    base = med["synchronous SH"][0]
    print(f"Tuning {a.configs} MLP configurations on digits, eta {a.eta}, 1-{a.max_epochs} "
          f"epochs, simulated speeds {speeds}; medians of {a.repeats} runs "
          f"({time.strftime('%Y-%m-%d')})")
    print(f"{'method':<18} {'wall s':>8} {'vs sync':>8} {'best val acc':>13} "
          f"{'busy':>6} {'tasks':>6}")
    for k, (wall, best, busy, n) in med.items():
        print(f"{k:<18} {wall:8.2f} {wall / base:8.2f} {best:13.4f} {busy:6.0%} {n:6.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
