"""Hyperparameter tuning on uneven devices: blockflow's ASHA vs Optuna on Dask and synchronous SH.

The scenario of issue 12: a simulated cluster of 4 worker processes (1 thread each) at
speeds 1, 1, 0.5 and 0.25 (:func:`blockflow.testing.simulated_cluster`; the speed factor
is applied to the real compute time of each trial task by
:func:`blockflow.testing.slowed_to_device_speed`). The workload is the one ``blockflow run
tune`` runs: ``--configs`` MLP configurations on scikit-learn's bundled digits
(:mod:`blockflow.workloads.digits_tuning`, one epoch per budget unit), eta 3, budgets 1 to
``--max-epochs``. All methods run the same configurations on the same cluster, in
rotating order:

* **ASHA (blockflow)** (:func:`blockflow.tune.tune`): no rung barrier, one trial task per
  free worker, promotions placed by earliest finish time on the speeds the tuner learns,
  certain promotions first (``promotion="certain-first"``, the default);
* **ASHA, Li et al. order** (``promotion="asha"``): the same, any promotion before a new
  configuration, as in the paper's Algorithm 2;
* **Optuna SH pruner**: the baseline the issue names where dask-ml's ``HyperbandSearchCV``
  does not run with this Dask (it does not: dask-ml 2025.1.0's incremental searches call
  ``dask.persist`` inside their coroutine and fail with "Attempting to use an asynchronous
  Client in a synchronous context", dask/dask-ml#1016, open): Optuna with Dask's
  recommended storage, ``optuna_integration.DaskStorage``, one ``study.optimize(n_trials=1)``
  task per configuration placed by Dask (the pattern of Dask's and Optuna's examples), the
  81 configurations enqueued, ``SuccessiveHalvingPruner(min_resource=1,
  reduction_factor=eta)``, a score reported after every budget unit. Needs ``pip install
  optuna optuna-integration``; left out, with a note, where they are not installed;
* **synchronous SH** (``tune(..., synchronous=True)``): blockflow's own synchronous
  successive halving, a stricter baseline (dask-ml's ``SuccessiveHalvingSearchCV`` scheme
  with one task per trial and rung): every rung waits for all its trials, the top 1/eta go
  on, each from its checkpoint; Dask places the tasks.

Each budget unit is ``--epochs-per-unit`` epochs (10: one epoch takes 4-15 ms, below a
Dask task's own overhead), and each trial task takes ``k x CPU seconds / speed`` on its
device (``slowed_to_device_speed(clock="thread", scale=k)``; ``k`` is ``--device-scale``,
by default :func:`blockflow.testing.device_scale` at ``--device-fraction`` 0.7: 2 on a
2-core host, so that the four devices' real compute does not contend for the host's cores;
a larger ``k`` leaves more of the host to the scheduler and the client; the CPU seconds
of the trial's own thread, one BLAS thread each, not the worker process's: its event loop
serving checkpoint transfers and heartbeats meanwhile is no device work).

Measured per run: wall time, best validation accuracy, busy fraction (summed task time over
4 workers x wall time), and the run's work bound (its tasks' device-seconds x speed, over
the fleet's total speed 2.75). The table gives medians over ``--repeats`` runs.

    python benchmarks/tuning.py                      # 81 configs, up to 27 epochs, 3 repeats
    python benchmarks/tuning.py --configs 27 --max-epochs 9 --repeats 1   # smoke

Per-run lines go to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time


def units_of_epochs(config, units, checkpoint=None, *, k=10):
    """A trial task of ``units`` budget units, ``k`` digits epochs each."""
    from blockflow.workloads.digits_tuning import train_digits_mlp
    return train_digits_mlp(config, int(round(units * k)), checkpoint)


def optuna_objective(trial, configs, max_units, k, clock, scale):
    """One Optuna trial: configuration ``config_id`` (enqueued) trained one budget unit at a
    time (``k`` digits epochs, slowed to the simulated device's speed exactly as blockflow's
    trial tasks are), its validation accuracy reported after each unit to Optuna's
    successive-halving pruner; returns the accuracy at ``max_units``."""
    import optuna

    from blockflow.testing import slowed_to_device_speed

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # on the worker
    cfg = configs[trial.suggest_int("config_id", 0, len(configs) - 1)]
    step = slowed_to_device_speed(functools.partial(units_of_epochs, k=k), clock=clock,
                                  scale=scale)
    checkpoint = None
    for unit in range(1, max_units + 1):
        score, checkpoint = step(cfg, 1, checkpoint)
        trial.report(score, unit)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return score


def optuna_sh(client, configs, *, eta, max_units, k, clock, scale, speed_of):
    """Optuna's successive-halving pruner on Dask the way Dask recommends it: the study in
    ``optuna_integration.DaskStorage`` (on the scheduler), one ``study.optimize(n_trials=1)``
    task per configuration, placed by Dask. Returns ``(wall s, best validation accuracy,
    busy fraction, trial tasks, work bound s)``, busy time and work from Dask's task
    stream."""
    import optuna
    from distributed import get_task_stream, wait
    from optuna_integration import DaskStorage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        storage=DaskStorage(client=client), direction="maximize",
        sampler=optuna.samplers.RandomSampler(seed=0),
        pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=eta))
    for i in range(len(configs)):
        study.enqueue_trial({"config_id": i})
    objective = functools.partial(optuna_objective, configs=tuple(configs),
                                  max_units=max_units, k=k, clock=clock, scale=scale)
    with get_task_stream(client) as ts:
        t0 = time.time()
        futures = [client.submit(study.optimize, objective, n_trials=1, pure=False,
                                 key=f"optuna-trial-{i}") for i in range(len(configs))]
        wait(futures)
        wall = time.time() - t0
    client.gather(futures)  # raises a trial task's error
    busy = work = 0.0
    n = 0
    for task in ts.data:
        for ss in task["startstops"]:
            if ss["action"] == "compute":
                busy += ss["stop"] - ss["start"]
                if str(task["key"]).startswith("optuna-trial"):
                    n += 1
                    work += (ss["stop"] - ss["start"]) * speed_of[task["worker"]]
    threads = sum(client.nthreads().values())
    return (wall, float(study.best_value), busy / (threads * wall), n,
            work / sum(speed_of.values()))


def least_busy_until_last_start(h) -> float:
    """The least busy worker's share (0-1) of the time from the first trial task's start
    to the last configuration's start, from a tune history's started/finished times."""
    t0, t1 = h.started.min(), h.loc[h.rung == 0, "started"].max()
    if not t1 > t0:
        return math.nan
    busy = {w: sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in zip(g.started, g.finished))
            for w, g in h.groupby("worker")}
    return min(busy.values()) / (t1 - t0)


def _one_thread():
    """One BLAS thread per worker process, as one process per device would have."""
    from threadpoolctl import threadpool_limits
    threadpool_limits(1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", type=int, default=81)
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--max-epochs", type=int, default=27)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speeds", default="1,1,0.5,0.25")
    p.add_argument("--clock", choices=["thread", "cpu"], default="thread",
                   help="what a trial's device time is measured on: its thread's CPU "
                        "seconds, or its worker process's (event loop included)")
    p.add_argument("--epochs-per-unit", type=int, default=10,
                   help="epochs per budget unit: one digits epoch takes 4-15 ms, below a "
                        "Dask task's own overhead, so a unit of one epoch would measure "
                        "the overhead and not the placement")
    p.add_argument("--device-scale", type=float, default=None,
                   help="host-core seconds per simulated device-second at speed 1 "
                        "(default: blockflow.testing.device_scale(speeds, "
                        "--device-fraction))")
    p.add_argument("--device-fraction", type=float, default=0.7,
                   help="share 0-1 of the host's cores the simulated devices' real compute "
                        "may use, when --device-scale is not given")
    a = p.parse_args(argv)
    speeds = tuple(float(s) for s in a.speeds.split(","))

    from blockflow.testing import device_scale, simulated_cluster, slowed_to_device_speed
    from blockflow.ml.tune import sample_configs, tune
    from blockflow.workloads.digits_tuning import SPACE, train_digits_mlp

    scale = a.device_scale or device_scale(speeds, fraction=a.device_fraction)
    train = slowed_to_device_speed(functools.partial(units_of_epochs, k=a.epochs_per_unit),
                                   clock=a.clock, scale=scale)
    configs = sample_configs(SPACE, a.configs, a.seed)
    # the blockflow methods: tune()'s arguments
    methods = {"ASHA (blockflow)": {"promotion": "certain-first"},
               "ASHA, Li et al. order": {"promotion": "asha"},
               "synchronous SH": {"synchronous": True}}
    rows = {name: [] for name in methods}
    try:
        import optuna  # noqa: F401
        import optuna_integration  # noqa: F401
        rows["Optuna SH pruner"] = []
    except ImportError:
        print("optuna / optuna-integration are not installed (pip install optuna "
              "optuna-integration): the Optuna baseline is left out", file=sys.stderr)
    with simulated_cluster(speeds=speeds) as client:
        client.run(_one_thread)
        # warm every worker (imports, first allocations) so no method pays for them
        client.run(lambda: train_digits_mlp(configs[0], 1) and None)
        from blockflow.scheduling.view import workers_info
        speed_of = {addr: speeds[int(w["name"])] for addr, w in workers_info(client).items()}
        for rep in range(a.repeats):
            order = list(rows) if rep % 2 == 0 else list(rows)[::-1]
            for name in order:
                if name == "Optuna SH pruner":
                    out = optuna_sh(client, configs, eta=a.eta, max_units=a.max_epochs,
                                     k=a.epochs_per_unit, clock=a.clock, scale=scale,
                                     speed_of=speed_of)
                    rows[name].append(tuple(out) + (math.nan,))
                    print(f"rep {rep} {name}: wall {out[0]:.2f} s, best val accuracy "
                          f"{out[1]:.4f}, busy {out[2]:.0%}, {out[3]} trial tasks, "
                          f"work bound {out[4]:.2f} s", file=sys.stderr)
                    continue
                r = tune(train, configs, client=client, eta=a.eta, min_budget=1,
                         max_budget=a.max_epochs, publish=False, **methods[name])
                n_tasks = len(r.history)
                h = r.history.dropna(subset=["duration"])
                # the work done, in device-seconds at speed 1, spread over the whole fleet
                bound = float((h.duration * h.worker.map(speed_of)).sum()) / sum(speeds)
                early = least_busy_until_last_start(h)
                rows[name].append((r.wall_time, r.best_score, r.busy_fraction, n_tasks,
                                   bound, early))
                print(f"rep {rep} {name}: wall {r.wall_time:.2f} s, best val accuracy "
                      f"{r.best_score:.4f} (trial {r.best_trial}), busy "
                      f"{r.busy_fraction:.0%} (least busy worker until the last "
                      f"configuration started {early:.0%}), {n_tasks} trial tasks, work "
                      f"bound {bound:.2f} s", file=sys.stderr)
    med = {k: [statistics.median(x[i] for x in v) for i in range(6)] for k, v in rows.items()}
    base = med["synchronous SH"][0]
    opt = med["Optuna SH pruner"][0] if "Optuna SH pruner" in med else math.nan
    print(f"Tuning {a.configs} MLP configurations on digits, eta {a.eta}, budgets 1-"
          f"{a.max_epochs} units of {a.epochs_per_unit} epochs, simulated speeds {speeds} "
          f"at {scale:g} device-seconds per CPU-second; medians of {a.repeats} runs "
          f"({time.strftime('%Y-%m-%d')})")
    print("'bound s': the run's own work (device-seconds x speed) over the fleet's total "
          "speed, what no placement can beat without doing less work")
    print("'tasks': trial tasks: one per trial and rung (blockflow), one per trial (Optuna)")
    print("'early busy': the least busy worker's share of the time from the first trial "
          "task to the last configuration's start (a worker idle while configurations "
          "wait lowers it; tests/ml/test_tune.py checks the order of events instead)")
    print(f"{'method':<22} {'wall s':>8} {'vs Optuna':>10} {'vs sync':>8} {'bound s':>8} "
          f"{'wall/bound':>10} {'best val acc':>13} {'busy':>6} {'tasks':>6} "
          f"{'early busy':>10}")
    for k, (wall, best, busy, n, bound, early) in med.items():
        print(f"{k:<22} {wall:8.2f} {wall / opt:10.2f} {wall / base:8.2f} {bound:8.2f} "
              f"{wall / bound:10.2f} {best:13.4f} {busy:6.0%} {n:6.0f} {early:10.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
