"""Workload: train a delay classifier on the 2013 NYC flights (``blockflow run train``).

Predicts whether a flight arrives more than 15 minutes late from its departure time (hour
of day, as sine and cosine), carrier (one-hot over the 16 carriers), origin (one-hot over
EWR, JFK, LGA) and distance (thousands of miles), with a small MLP trained data-parallel by
:class:`blockflow.ml.DataParallelTrainer` on row blocks resident on the workers. Rows whose
flight number hashes into the last ``holdout`` fraction are held out for the metrics.
Writes ``model.pt`` (the ``state_dict``), ``metrics.json``, ``loss_curve.csv`` and
``manifest.json`` into one folder, atomically.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

__all__ = ["CARRIERS", "ORIGINS", "flight_features", "run"]

CARRIERS = ["9E", "AA", "AS", "B6", "DL", "EV", "F9", "FL", "HA", "MQ", "OO", "UA", "US",
            "VX", "WN", "YV"]
ORIGINS = ["EWR", "JFK", "LGA"]
N_FEATURES = 2 + len(CARRIERS) + len(ORIGINS) + 1


def flight_features(part) -> "np.ndarray":
    """Kernel: features and label of the flights that departed and arrived.

    Parameters
    ----------
    part : pandas.DataFrame
        Rows of the flights table (columns ``dep_time``, ``arr_delay``, ``carrier``,
        ``origin``, ``distance``).

    Returns
    -------
    numpy.ndarray, float32, shape (n, 22)
        Columns: sin and cos of the departure hour, 16 carrier indicators, 3 origin
        indicators, distance in thousands of miles, and last the label (1.0 when the arrival
        delay exceeds 15 minutes), for rows with both a departure time and an arrival delay.
    """
    part = part[part["dep_time"].notna() & part["arr_delay"].notna()]
    dep = part["dep_time"].to_numpy(dtype=np.float64)
    hours = (dep // 100 + (dep % 100) / 60) * (2 * np.pi / 24)
    cols = [np.sin(hours), np.cos(hours)]
    carrier = part["carrier"].astype(str).to_numpy()
    origin = part["origin"].astype(str).to_numpy()
    cols += [(carrier == c).astype(np.float64) for c in CARRIERS]
    cols += [(origin == o).astype(np.float64) for o in ORIGINS]
    cols.append(part["distance"].to_numpy(dtype=np.float64) / 1000)
    cols.append((part["arr_delay"].to_numpy(dtype=np.float64) > 15).astype(np.float64))
    return np.stack(cols, axis=1).astype(np.float32) if len(part) else \
        np.zeros((0, N_FEATURES + 1), np.float32)


def _holdout_mask(part, holdout: float):
    return (part["flight"].to_numpy() * 2654435761 % 1000) >= (1 - holdout) * 1000


def _split(part, holdout: float, test: bool):
    mask = _holdout_mask(part, holdout)
    return flight_features(part[mask if test else ~mask])


def run(client, *, output: str, scale: int = 1, epochs: int = 2, batch_size: int = 4096,
        hidden: int = 32, lr: float = 0.01, seed: int = 0, holdout: float = 0.2,
        partitions_per_copy: int = 8, overwrite: bool = False) -> dict[str, Any]:
    """Train the delay classifier and write model, metrics and loss curve atomically.

    Parameters
    ----------
    client : distributed.Client
    output : str
        Output folder (written atomically; see :func:`blockflow.io.atomic_output_dir`).
    scale : int, default 1
        Copies of the 336,776-row table.
    epochs : int, default 2
    batch_size : int, default 4096
        Samples per step.
    hidden : int, default 32
        Width of the MLP's hidden layer.
    lr : float, default 0.01
        Adam's learning rate.
    seed : int, default 0
        Seeds the initialisation and the batches.
    holdout : float, default 0.2
        Fraction 0-1 of flight numbers held out for the metrics.
    partitions_per_copy : int, default 8
    overwrite : bool, default False

    Returns
    -------
    dict
        The metrics written to ``metrics.json``.

    Raises
    ------
    blockflow.io.OutputWriteError
        If the folder cannot be written (the old output, if any, stays).
    """
    import torch

    from blockflow.io import atomic_output_dir, check_output_dir, write_manifest
    from blockflow.ml import DataParallelTrainer
    from blockflow.workloads.flights import load_flights

    check_output_dir(output, overwrite)
    t0 = time.perf_counter()
    cols = ["dep_time", "arr_delay", "carrier", "origin", "distance", "flight"]
    flights = load_flights(scale, partitions_per_copy, columns=cols)
    train = _features(client, flights, holdout, test=False)
    test = _features(client, flights, holdout, test=True)

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(N_FEATURES, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 1))
    trainer = DataParallelTrainer(
        model, _bce, lambda ps: torch.optim.Adam(ps, lr=lr), batch_size=batch_size,
        epochs=epochs, seed=seed, client=client)
    trainer.fit(train[:, :N_FEATURES], train[:, N_FEATURES:])
    metrics = _metrics(model, test.compute(), trainer)
    metrics.update(seconds=time.perf_counter() - t0, scale=scale, epochs=epochs,
                   batch_size=batch_size, seed=seed, n_train=int(train.shape[0]),
                   n_test=int(test.shape[0]))
    with atomic_output_dir(output, overwrite) as tmp:
        torch.save(model.state_dict(), tmp / "model.pt")
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        lines = ["step,epoch,loss,samples"] + [
            f"{r['step']},{r['epoch']},{r['loss']:.9g},{r['samples']}"
            for r in trainer.history_]
        (tmp / "loss_curve.csv").write_text("\n".join(lines) + "\n")
        write_manifest(tmp, {"workload": "train", "metrics": metrics,
                             "files": ["model.pt", "metrics.json", "loss_curve.csv"]})
    return metrics


def _bce(out, y):
    import torch
    return torch.nn.functional.binary_cross_entropy_with_logits(out, y)


def _features(client, flights, holdout: float, test: bool):
    import dask.array as da
    blocks = [da.from_delayed(d, shape=(np.nan, N_FEATURES + 1), dtype=np.float32)
              for d in _feature_delayeds(flights, holdout, test)]
    arr = da.concatenate(blocks, allow_unknown_chunksizes=True)
    arr = client.persist(arr)
    return arr.compute_chunk_sizes()


def _feature_delayeds(flights, holdout, test):
    import dask
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
