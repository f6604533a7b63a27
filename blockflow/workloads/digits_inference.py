"""Batch inference workload: a logistic-regression classifier of scikit-learn's digits applied with
:func:`blockflow.predict` to a replicated, chunked copy of them."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import dask.array as da
import numpy as np
import pandas as pd

from blockflow.scheduling.view import plugin_status
from blockflow.ml.inference import model_stats, predict, ship_model
from blockflow.io import write_parquet
from blockflow.workloads._runner import Job, run_workload

__all__ = ["InferenceResult", "run"]

logger = logging.getLogger(__name__)

N_TRAIN = 1200


@dataclass
class InferenceResult:
    """Outcome of one inference run.

    Attributes
    ----------
    predictions : pandas.DataFrame
        ``label``, ``probability``, ``truth`` per image.
    accuracy : float
        Held-out accuracy, 0-1.
    model_bytes : int
    workers : dict
        Address -> ``bytes_received``, ``loads``, ``blocks``, ``batches``, ``rows`` (a block
        with a finished backup copy counts on both workers).
    n_rows, n_blocks : int
    backup_copies : int
        Backup copies started (``blockflow.speculation``).
    wall_time : float
        Seconds.
    """

    predictions: pd.DataFrame
    accuracy: float
    model_bytes: int
    workers: dict
    n_rows: int
    n_blocks: int
    wall_time: float
    scale: int
    n_tasks: int | None = None
    task_counts: dict | None = None
    backup_copies: int = 0
    output: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def bytes_shipped(self) -> int:
        """Model bytes that reached the workers, all together."""
        return sum(int(w["bytes_received"]) for w in self.workers.values())

    def manifest(self) -> dict[str, Any]:
        """JSON-serialisable description of the run (``manifest.json``)."""
        return {
            "workload": "infer", "model": "logistic regression (digits)",
            "scale": self.scale, "n_rows": self.n_rows, "n_blocks": self.n_blocks,
            "held_out_accuracy": self.accuracy, "model_bytes": self.model_bytes,
            "model_bytes_shipped": self.bytes_shipped, "workers": self.workers,
            "wall_time_s": self.wall_time, "n_tasks": self.n_tasks,
            "task_counts": self.task_counts, "backup_copies": self.backup_copies,
        }

    def report(self) -> str:
        """Lines for the terminal."""
        lines = [f"blockflow infer: {self.n_rows:,} digits in {self.n_blocks} blocks "
                 f"(scale {self.scale})",
                 f"Held-out accuracy: {self.accuracy:.4f}",
                 f"Model: {self.model_bytes:,} bytes; shipped {self.bytes_shipped:,} bytes to "
                 f"{len(self.workers)} workers (once each, not once per block)"]
        for a, w in sorted(self.workers.items()):
            lines.append(f"  {a}: {w['blocks']} blocks, {w['batches']} batches, "
                         f"{w['rows']:,} rows")
        if self.backup_copies:
            lines.append(f"Backup copies of straggling blocks: {self.backup_copies}")
        lines.append(f"Wall time: {self.wall_time:.2f} s")
        return "\n".join(lines)


def train():
    """The digits classifier and the data: ``(model, X, y)``."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    X, y = load_digits(return_X_y=True)
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=500))
    model.fit(X[:N_TRAIN], y[:N_TRAIN])
    return model, X, y


def run(client, *, scale: int = 10, blocks: int = 20, output: str | None = None,
        overwrite: bool = False, progress: bool | None = None) -> InferenceResult:
    """Train the digits classifier here and classify ``scale`` copies of the digits on the cluster.

    Parameters
    ----------
    client : distributed.Client
    scale : int, default 10
    blocks : int, default 20
        Row blocks.
    output : str or path, optional
        Folder for ``predictions.parquet`` and ``manifest.json``.
    overwrite : bool, default False
    progress : bool, optional

    Returns
    -------
    InferenceResult

    Raises
    ------
    ValueError
        If ``scale`` or ``blocks`` is below 1.
    FileExistsError
        If ``output`` exists and ``overwrite`` is False.
    """
    if scale < 1 or blocks < 1:
        raise ValueError(f"infer: scale and blocks must be >= 1, got {scale} and {blocks}.")
    return run_workload(client, f"infer (scale {scale})",
                        functools.partial(_compute, scale=scale, blocks=blocks), _write,
                        name="infer", output=output, overwrite=overwrite, progress=progress)


def _compute(job: Job, *, scale: int, blocks: int) -> InferenceResult:
    model, X, y = train()
    data = np.tile(X, (scale, 1))
    truth = np.tile(y, scale)
    x = da.from_array(data, chunks=(-(-len(data) // blocks), X.shape[1]))
    ref = ship_model(model, method="predict_proba", client=job.client)
    copies_before = _backup_copies(job.client)
    job.start()
    proba = job.compute(predict(model, x, method="predict_proba"),
                        label=f"infer (scale {scale}) predict")
    wall = job.stop()
    backup_copies = _backup_copies(job.client) - copies_before
    label = proba.argmax(axis=1)
    held_out = np.tile(np.arange(len(X)) >= N_TRAIN, scale)
    frame = pd.DataFrame({"label": label.astype("int8"),
                          "probability": proba[np.arange(len(label)), label],
                          "truth": truth.astype("int8")})
    result = InferenceResult(
        predictions=frame, accuracy=float((label == truth)[held_out].mean()),
        model_bytes=0,
        workers=model_stats(job.client, ref), n_rows=len(data), n_blocks=x.numblocks[0],
        wall_time=wall, scale=scale, n_tasks=job.n_tasks, task_counts=job.task_counts,
        backup_copies=backup_copies)
    if result.workers:  # every worker received the same serialised model
        result.model_bytes = max(w["bytes_received"] for w in result.workers.values())
    logger.info("infer: %s", result.manifest())
    return result


def _backup_copies(client) -> int:
    """Backup copies the scheduler plugin has started so far (0 without the plugin)."""
    try:
        return int(plugin_status(client)["speculation"].get("launched", 0))
    except RuntimeError:  # no blockflow plugin on this scheduler: nothing is copied
        return 0


def _write(result: InferenceResult, directory: str) -> dict:
    write_parquet(result.predictions, f"{directory}/predictions.parquet")
    return {"files": ["predictions.parquet"]}
