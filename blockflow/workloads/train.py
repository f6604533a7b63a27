"""Workload: train a delay classifier on the 2013 NYC flights (``blockflow run train``) with
:class:`blockflow.ml.DataParallelTrainer`; is a flight more than 15 minutes late?"""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import dask
import dask.array as da
import numpy as np

from blockflow.errors import check_number
from blockflow.io import write_bytes as _write_file
from blockflow.scheduling.runs import run_scope
from blockflow.workloads._runner import run_workload

__all__ = ["CARRIERS", "ORIGINS", "TrainResult", "flight_features", "run"]

CARRIERS = ["9E", "AA", "AS", "B6", "DL", "EV", "F9", "FL", "HA", "MQ", "OO", "UA", "US",
            "VX", "WN", "YV"]
ORIGINS = ["EWR", "JFK", "LGA"]
N_FEATURES = 2 + len(CARRIERS) + len(ORIGINS) + 2


def flight_features(part) -> "np.ndarray":
    """Kernel: float32 features and label (last column, 1.0 when ``arr_delay`` > 15 min) of the
    flights with departure time and both delays."""
    part = part[part["dep_time"].notna() & part["dep_delay"].notna()
                & part["arr_delay"].notna()]
    dep = part["dep_time"].to_numpy(dtype=np.float64)
    hours = (dep // 100 + (dep % 100) / 60) * (2 * np.pi / 24)
    cols = [np.sin(hours), np.cos(hours)]
    carrier = part["carrier"].astype(str).to_numpy()
    origin = part["origin"].astype(str).to_numpy()
    cols += [(carrier == c).astype(np.float64) for c in CARRIERS]
    cols += [(origin == o).astype(np.float64) for o in ORIGINS]
    cols.append(part["distance"].to_numpy(dtype=np.float64) / 1000)
    cols.append(part["dep_delay"].to_numpy(dtype=np.float64) / 60)
    cols.append((part["arr_delay"].to_numpy(dtype=np.float64) > 15).astype(np.float64))
    return np.stack(cols, axis=1).astype(np.float32) if len(part) else \
        np.zeros((0, N_FEATURES + 1), np.float32)


def _holdout_mask(part, holdout: float):
    return (part["flight"].to_numpy() * 2654435761 % 1000) >= (1 - holdout) * 1000


def _split(part, holdout: float, test: bool):
    mask = _holdout_mask(part, holdout)
    return flight_features(part[mask if test else ~mask])


@dataclass
class TrainResult:
    """Outcome of one training run.

    Attributes
    ----------
    metrics : dict
        ``metrics.json``: ``test_accuracy``, ``majority_baseline_accuracy``, ``test_auc``, ...
    state_dict : dict
    history : list of dict
        :attr:`blockflow.ml.DataParallelTrainer.history_`.
    task_counts : dict of str to int, or None
    output : str, optional
    """

    metrics: dict
    state_dict: Any
    history: list
    task_counts: dict | None = None
    output: str | None = None

    def manifest(self) -> dict[str, Any]:
        """JSON-serialisable description of the run (what ``manifest.json`` holds)."""
        return {"workload": "train", "metrics": self.metrics,
                "n_tasks": None if self.task_counts is None else sum(
                    self.task_counts.values()),
                "task_counts": self.task_counts}

    def report(self) -> str:
        """A few lines for the terminal: the accuracy beside the majority class's."""
        m = self.metrics
        lines = [
            f"blockflow train: {m['n_train']:,} training rows, {m['steps']} steps "
            f"({m['epochs']} epochs of {m['batch_size']:,}) in {m['seconds']:.1f} s",
            f"Held-out accuracy {m['test_accuracy']:.4f} (majority class "
            f"{m['majority_baseline_accuracy']:.4f}), AUC {m['test_auc']:.4f}, log loss "
            f"{m['test_log_loss']:.4f}",
        ]
        if self.output:
            lines.append(f"Output: {self.output}")
        return "\n".join(lines)


def run(client, *, output: str | None = None, scale: int = 1, epochs: int = 2,
        batch_size: int = 4096, hidden: int = 32, lr: float = 0.01, seed: int = 0,
        holdout: float = 0.2, partitions_per_copy: int = 8, overwrite: bool = False,
        progress: bool | None = None) -> TrainResult:
    """Train the delay classifier and write model, metrics and loss curve atomically.

    Parameters
    ----------
    client : distributed.Client
    output : str, optional
        Folder (:func:`blockflow.io.atomic_output_dir`); None writes nothing.
    scale : int, default 1
    epochs : int, default 2
    batch_size : int, default 4096
    hidden : int, default 32
    lr : float, default 0.01
    seed : int, default 0
    holdout : float, default 0.2
        Fraction 0-1 of flight numbers held out.
    partitions_per_copy : int, default 8
    overwrite : bool, default False
    progress : bool, optional

    Returns
    -------
    TrainResult

    Raises
    ------
    ValueError
        An argument out of range.
    FileExistsError
        If ``output`` exists and ``overwrite`` is False.
    blockflow.io.OutputWriteError
        If the folder cannot be written.
    """
    f = "train"
    check_number(scale, "scale", f, "copies of the flights table", integer=True, low=1)
    check_number(epochs, "epochs", f, "passes over the training rows", integer=True, low=1)
    check_number(batch_size, "batch_size", f, "samples per step", integer=True, low=1)
    check_number(seed, "seed", f, "seed of the initialisation and the batches",
                 integer=True, low=0)
    check_number(hidden, "hidden", f, "width of the hidden layer", integer=True, low=1)
    check_number(lr, "lr", f, "Adam's learning rate", low=0, low_open=True)
    check_number(holdout, "holdout", f, "fraction of flight numbers held out", low=0,
                 low_open=True, high=1, high_open=True)
    check_number(partitions_per_copy, "partitions_per_copy", f,
                 "partitions per copy of the table", integer=True, low=1)

    def compute(job) -> TrainResult:
        return _train(job, scale=scale, epochs=epochs, batch_size=batch_size,
                      hidden=hidden, lr=lr, seed=seed, holdout=holdout,
                      partitions_per_copy=partitions_per_copy)

    return run_workload(client, f"training the delay classifier (scale {scale})", compute,
                        _write, name="train", output=output, overwrite=overwrite,
                        progress=progress)


def _train(job, *, scale, epochs, batch_size, hidden, lr, seed, holdout,
           partitions_per_copy) -> TrainResult:
    import torch

    from blockflow.ml import DataParallelTrainer
    from blockflow.workloads.flights import load_flights

    job.start()
    cols = ["dep_time", "dep_delay", "arr_delay", "carrier", "origin", "distance", "flight"]
    flights = load_flights(scale, partitions_per_copy, columns=cols)
    train, test = job.persist([_features(flights, holdout, test=False),
                               _features(flights, holdout, test=True)],
                              label="train [1/2] load flights, features")
    train, test = train.compute_chunk_sizes(), test.compute_chunk_sizes()

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(N_FEATURES, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 1))
    steps = epochs * math.ceil(int(train.shape[0]) / batch_size)
    bar = job.steps(f"train [2/2] {epochs} epochs", steps)

    def advance(trainer, record) -> bool:
        if bar is not None:
            bar.advance(loss=f"{record['loss']:.4f}")
        return False

    try:
        with run_scope(job.what, job.run_id):  # the steps' tasks count as this run's
            trainer = DataParallelTrainer(
                model, _bce, lambda ps: torch.optim.Adam(ps, lr=lr),
                batch_size=batch_size, epochs=epochs, seed=seed, client=job.client,
                callback=advance)
            trainer.fit(train[:, :N_FEATURES], train[:, N_FEATURES:])
    finally:
        if bar is not None:
            bar.finish()
    metrics = _metrics(model, test.compute(), trainer)
    seconds = job.stop()
    metrics.update(seconds=seconds, scale=scale, epochs=epochs, batch_size=batch_size,
                   hidden=hidden, lr=lr, seed=seed, n_train=int(train.shape[0]),
                   n_test=int(test.shape[0]))
    return TrainResult(metrics, model.state_dict(), trainer.history_, job.task_counts)


def _write(result: TrainResult, directory) -> dict[str, Any]:
    import torch

    # serialised in memory, written by Python: torch.save's own file writer reports a full
    # disk as RuntimeError("basic_ios::clear: iostream error"), not the OS error it is
    buf = io.BytesIO()
    torch.save(result.state_dict, buf)
    _write_file(os.path.join(directory, "model.pt"), buf.getvalue())
    _write_file(os.path.join(directory, "metrics.json"),
                (json.dumps(result.metrics, indent=2) + "\n").encode())
    lines = ["step,epoch,loss,samples"] + [
        f"{r['step']},{r['epoch']},{r['loss']:.9g},{r['samples']}" for r in result.history]
    _write_file(os.path.join(directory, "loss_curve.csv"), ("\n".join(lines) + "\n").encode())
    return {"files": ["model.pt", "metrics.json", "loss_curve.csv"]}


def _bce(out, y):
    import torch
    return torch.nn.functional.binary_cross_entropy_with_logits(out, y)


def _features(flights, holdout: float, test: bool):
    blocks = [da.from_delayed(d, shape=(np.nan, N_FEATURES + 1), dtype=np.float32)
              for d in _feature_delayeds(flights, holdout, test)]
    return da.concatenate(blocks, allow_unknown_chunksizes=True)


def _feature_delayeds(flights, holdout, test):
    split = dask.delayed(_split, pure=True)
    return [split(d, holdout, test) for d in flights.to_delayed()]


def _metrics(model, test: np.ndarray, trainer) -> dict[str, Any]:
    import torch
    with torch.no_grad():
        logits = model(torch.as_tensor(test[:, :N_FEATURES])).numpy().ravel()
    y = test[:, N_FEATURES]
    p = 1 / (1 + np.exp(-logits))
    eps = 1e-12
    base = float(max(y.mean(), 1 - y.mean())) if len(y) else float("nan")
    return {
        "test_accuracy": float(((p > 0.5) == (y > 0.5)).mean()),
        "majority_baseline_accuracy": base,
        "test_log_loss": float(-(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps)).mean()),
        "test_auc": _auc(y, p),
        "final_train_loss": float(trainer.history_[-1]["loss"]),
        "steps": len(trainer.history_),
        "recoveries": len(trainer.shards_.recoveries),
        "rows_per_worker": trainer.shards_.rows_per_worker(),
    }


def _auc(y: np.ndarray, score: np.ndarray) -> float:
    """Area under the ROC curve by the rank statistic (Mann-Whitney U)."""
    pos, n = int((y > 0.5).sum()), len(y)
    if pos in (0, n):
        return float("nan")
    ranks = np.empty(n)
    ranks[np.argsort(score, kind="mergesort")] = np.arange(1, n + 1)
    return float((ranks[y > 0.5].sum() - pos * (pos + 1) / 2) / (pos * (n - pos)))
