"""Digits tuning workload: tune a small MLP on scikit-learn's bundled digits by ASHA
(:func:`blockflow.tune.tune`); ``best_model.pkl`` is a pickle: load it only from a trusted source.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from blockflow.io import write_parquet
from blockflow.ml.tune import choice, loguniform, tune
from blockflow.scheduling.runs import run_scope
from blockflow.workloads import JobFailed
from blockflow.workloads._runner import Job, run_workload

__all__ = ["SPACE", "DigitsTuneResult", "digits_split", "run", "train_digits_mlp"]

#: The search space: hidden units, Adam's step size, L2 penalty, mini-batch rows, seed.
SPACE = {
    "hidden": choice([16, 32, 64, 128]),
    "learning_rate": loguniform(1e-4, 3e-2),
    "alpha": loguniform(1e-6, 1e-1),
    "batch_size": choice([16, 32, 64, 128]),
    "init_seed": choice(list(range(1000))),
}


@functools.lru_cache(maxsize=1)
def digits_split(seed: int = 0):
    """``(X_train, y_train, X_val, y_val, X_test, y_test)``: the bundled digits, pixels
    scaled to 0-1, split 60/20/20, stratified, with ``seed`` (cached per process)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    X_tr, X_rest, y_tr, y_rest = train_test_split(X, y, test_size=0.4, stratify=y,
                                                  random_state=seed)
    X_val, X_te, y_val, y_te = train_test_split(X_rest, y_rest, test_size=0.5,
                                                stratify=y_rest, random_state=seed)
    return X_tr, y_tr, X_val, y_val, X_te, y_te


def train_digits_mlp(config: dict, epochs: int, checkpoint=None):
    """One trial task: ``epochs`` more epochs of the MLP from ``checkpoint`` (None: a new one).

    ``config`` holds ``hidden``, ``learning_rate``, ``alpha``, ``batch_size`` and ``init_seed``.
    Returns ``(validation accuracy 0-1, estimator)``."""
    from sklearn.neural_network import MLPClassifier

    X_tr, y_tr, X_val, y_val, _, _ = digits_split()
    clf = checkpoint
    if clf is None:
        clf = MLPClassifier(hidden_layer_sizes=(int(config["hidden"]),), solver="adam",
                            learning_rate_init=float(config["learning_rate"]),
                            alpha=float(config["alpha"]),
                            batch_size=int(config["batch_size"]),
                            random_state=int(config["init_seed"]))
    classes = np.arange(10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a huge step size may overflow: it scores badly
        for _ in range(int(epochs)):
            clf.partial_fit(X_tr, y_tr, classes=classes)
    return float(clf.score(X_val, y_val)), clf


@dataclass
class DigitsTuneResult:
    """Outcome of one digits tuning run.

    Attributes
    ----------
    tuned : blockflow.tune.TuneResult
    test_accuracy : float
        0-1.
    n_configs, eta, max_budget, seed : int
    wall_time : float
        Seconds.
    task_counts : dict of str to int, or None
    output : str, optional
    """

    tuned: Any
    test_accuracy: float
    n_configs: int
    eta: int
    max_budget: int
    seed: int
    wall_time: float
    task_counts: dict | None
    output: str | None = None

    def manifest(self) -> dict[str, Any]:
        """JSON-serialisable description of the run (what ``manifest.json`` holds)."""
        t = self.tuned
        return {
            "workload": "tune",
            "model": "sklearn MLPClassifier (one hidden layer, Adam) on the bundled digits",
            "search": "asynchronous successive halving (Li et al. 2020)",
            "promotion": t.promotion,
            "n_configs": self.n_configs, "eta": self.eta, "min_budget_epochs": 1,
            "max_budget_epochs": self.max_budget,
            "seed": self.seed,
            "best_trial": t.best_trial, "best_config": t.best_config,
            "best_validation_accuracy": t.best_score, "test_accuracy": self.test_accuracy,
            "trials_by_status": {k: int(v) for k, v in t.trials.status.value_counts().items()},
            "trial_tasks": len(t.history), "busy_fraction": t.busy_fraction,
            "wall_time_s": self.wall_time, "task_counts": self.task_counts,
            "n_tasks": None if self.task_counts is None else sum(self.task_counts.values()),
        }

    def report(self) -> str:
        """A few lines for the terminal."""
        t = self.tuned
        counts = t.trials.status.value_counts()
        lines = [
            f"blockflow tune: {self.n_configs} MLP configurations on digits, eta {self.eta}, "
            f"up to {self.max_budget} epochs, seed {self.seed}",
            "Trials: " + ", ".join(f"{int(v)} {k}" for k, v in counts.items())
            + f"; {len(t.history)} trial tasks",
            f"Best trial {t.best_trial}: validation accuracy {t.best_score:.4f}, "
            f"test accuracy {self.test_accuracy:.4f}",
            "  " + json.dumps(t.best_config, sort_keys=True),
            f"Workers busy: {t.busy_fraction:.0%} of the wall time",
            f"Wall time: {self.wall_time:.2f} s",
        ]
        if self.output:
            lines.append(f"Output: {self.output}")
        return "\n".join(lines)


def _write(result: DigitsTuneResult, directory) -> dict[str, Any]:
    trials = result.tuned.trials.copy()
    trials["config"] = trials["config"].map(lambda c: json.dumps(c, sort_keys=True))
    write_parquet(trials, os.path.join(directory, "trials.parquet"), index=True)
    write_parquet(result.tuned.history, os.path.join(directory, "history.parquet"))
    with open(os.path.join(directory, "best_model.pkl"), "wb") as f:
        pickle.dump(result.tuned.best_checkpoint, f)
    return {"files": ["trials.parquet", "history.parquet", "best_model.pkl"]}


def run(client, *, n_configs: int = 81, eta: int = 3, max_budget: int = 27, seed: int = 0,
        promotion: str | None = None, output: str | None = None,
        overwrite: bool = False, progress: bool | None = None) -> DigitsTuneResult:
    """Tune the digits MLP on a cluster; write the trials and the best model atomically.

    Parameters
    ----------
    client : distributed.Client
    n_configs : int, default 81
        Configurations drawn from :data:`SPACE`.
    eta : int, default 3
    max_budget : int, default 27
        Epochs of the top rung.
    seed : int, default 0
    promotion : {"certain-first", "asha"}, optional
        Default ``blockflow.tune.promotion``.
    output : str, optional
    overwrite : bool, default False
    progress : bool, optional
        Progress bars (the trials draw none yet).

    Returns
    -------
    DigitsTuneResult

    Raises
    ------
    FileExistsError
        If ``output`` exists and ``overwrite`` is False.
    blockflow.workloads.JobFailed
        If every trial failed (nothing is written).
    """
    what = f"tuning the digits MLP ({n_configs} configurations)"

    def compute(job: Job) -> DigitsTuneResult:
        job.start()
        with run_scope(what, job.run_id), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all failed: raised below
            tuned = tune(train_digits_mlp, SPACE, client=job.client, n_configs=n_configs,
                         eta=eta, min_budget=1, max_budget=max_budget, seed=seed,
                         promotion=promotion,
                         name=what)
        job.stop()
        _, _, _, _, X_te, y_te = digits_split()
        if tuned.best_checkpoint is None:
            first = tuned.trials["error"].dropna()
            raise JobFailed(
                f"blockflow: every tuning trial failed, so there is no model to write; the "
                f"first error: {first.iloc[0] if len(first) else 'unknown'} (scikit-learn "
                f"must be installed where the workers run: pip install 'blockflow[ai]').")
        acc = float(tuned.best_checkpoint.score(X_te, y_te))
        return DigitsTuneResult(tuned, acc, n_configs, eta, max_budget, seed, job.wall_time,
                                job.task_counts)

    return run_workload(client, what, compute, _write, name="tune", output=output,
                        overwrite=overwrite, progress=progress)
