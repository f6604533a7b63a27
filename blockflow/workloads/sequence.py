"""Pipeline-parallel training workload: a small transformer on a synthetic sequence task, cut into
stages by :class:`blockflow.PipelineParallel`."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from blockflow.io import write_parquet
from blockflow.scheduling.runs import run_scope
from blockflow.workloads._runner import Job, run_workload

__all__ = ["PipelineTrainingResult", "run"]

logger = logging.getLogger(__name__)


@dataclass
class PipelineTrainingResult:
    """Outcome of one pipeline-parallel training run.

    Attributes
    ----------
    accuracy : float
        Held-out, 0-1.
    history : pandas.DataFrame
        ``epoch``, ``step``, ``loss``, ``seconds`` per step.
    stages : list of dict
        ``worker``, ``layers``, ``bytes`` per stage.
    bubble : float
        Idle fraction 0-1 of the last step.
    wall_time : float
        Seconds.
    """

    accuracy: float
    history: pd.DataFrame
    stages: list
    bubble: float
    wall_time: float
    schedule: str
    n_train: int
    epochs: int
    state_dict: dict = field(repr=False, default_factory=dict)
    task_counts: dict | None = None
    output: str | None = None

    def manifest(self) -> dict[str, Any]:
        """JSON-serialisable description of the run (``manifest.json``)."""
        return {"workload": "pipeline", "model": "transformer (4 encoder layers)",
                "task": "which of tokens 1 and 2 occurs more often", "n_train": self.n_train,
                "epochs": self.epochs, "schedule": self.schedule,
                "held_out_accuracy": self.accuracy, "stages": self.stages,
                "bubble": self.bubble, "steps": len(self.history),
                "final_loss": float(self.history.loss.iloc[-1]) if len(self.history) else None,
                "wall_time_s": self.wall_time, "task_counts": self.task_counts}

    def report(self) -> str:
        """Lines for the terminal."""
        lines = [f"blockflow pipeline: a transformer in {len(self.stages)} stages "
                 f"({self.schedule}), {self.epochs} epochs on {self.n_train:,} sequences",
                 f"Held-out accuracy: {self.accuracy:.4f}",
                 f"Loss: {self.history.loss.iloc[0]:.4f} -> {self.history.loss.iloc[-1]:.4f} "
                 f"in {len(self.history)} steps; last step's bubble {self.bubble:.1%}"]
        for s, st in enumerate(self.stages):
            lines.append(f"  stage {s}: layers {st['layers'][0]}-{st['layers'][1]} on "
                         f"{st['worker']} ({st['bytes']:,} bytes)")
        return "\n".join(lines)


def run(client, *, n_train: int = 2000, epochs: int = 4, batch_size: int = 100,
        n_micro_batches: int = 4, schedule: str = "1f1b", lr: float = 3e-3, seed: int = 0,
        output: str | None = None, overwrite: bool = False,
        progress: bool | None = None) -> PipelineTrainingResult:
    """Train the transformer pipeline-parallel on the cluster and evaluate it.

    Parameters
    ----------
    client : distributed.Client
    n_train : int, default 2000
        Training sequences (500 more held out).
    epochs, batch_size, n_micro_batches : int
    schedule : {"gpipe", "1f1b"}, default "1f1b"
    lr : float, default 3e-3
    seed : int, default 0
    output : str or path, optional
        Folder for ``model.pt``, ``history.parquet`` and ``manifest.json``.
    overwrite : bool, default False
    progress : bool, optional
        Unused.

    Returns
    -------
    PipelineTrainingResult

    Raises
    ------
    ValueError
        If a count is below 1.
    """
    for name, v in (("n_train", n_train), ("epochs", epochs), ("batch_size", batch_size),
                    ("n_micro_batches", n_micro_batches)):
        if v < 1:
            raise ValueError(f"pipeline: {name} must be >= 1, got {v}.")
    compute = functools.partial(_compute, n_train=n_train, epochs=epochs,
                                batch_size=batch_size, n_micro_batches=n_micro_batches,
                                schedule=schedule, lr=lr, seed=seed)
    return run_workload(client, "pipeline training", compute, _write, name="pipeline",
                        output=output, overwrite=overwrite, progress=progress)


def _compute(job: Job, *, n_train, epochs, batch_size, n_micro_batches, schedule, lr,
             seed) -> PipelineTrainingResult:
    import dask.array as da
    import torch

    from blockflow.ml.parallel import PipelineParallel
    from blockflow.workloads.models import sequence_task, transformer

    X, y = sequence_task(n_train, seed=seed)
    Xt, yt = sequence_task(500, seed=seed + 1)
    job.start()
    with run_scope(job.what, job.run_id):  # the stages' tasks count as this run's
        pipe = PipelineParallel(job.client, transformer(seed=seed), schedule=schedule,
                                optimizer=functools.partial(torch.optim.Adam, lr=lr),
                                loss=torch.nn.CrossEntropyLoss(), seed=seed)
        rows = max(1, -(-n_train // 4))
        pipe.fit(da.from_array(X, chunks=(rows, X.shape[1])), da.from_array(y, chunks=rows),
                 epochs=epochs, batch_size=batch_size, n_micro_batches=n_micro_batches)
        accuracy = float((pipe.predict(Xt).argmax(1) == yt).mean())
        last = pipe.run(X[:batch_size], y[:batch_size], n_micro_batches=n_micro_batches,
                        return_output=False, name="pipeline-transformer")
        state = pipe.state_dict()
        stages = [{"worker": w, "layers": [int(pipe.bounds[s]), int(pipe.bounds[s + 1] - 1)],
                   "bytes": int(b)}
                  for s, (w, b) in enumerate(zip(pipe.stage_workers, pipe.stage_bytes()))]
        pipe.close()
    wall = job.stop()
    history = pd.DataFrame(pipe.history_)[["epoch", "step", "loss", "seconds"]]
    result = PipelineTrainingResult(
        accuracy=accuracy, history=history, stages=stages, bubble=float(last.bubble),
        wall_time=wall, schedule=schedule, n_train=n_train, epochs=epochs, state_dict=state,
        task_counts=job.task_counts)
    logger.info("pipeline: %s", result.manifest())
    return result


def _write(result: PipelineTrainingResult, directory: str) -> dict:
    import torch

    torch.save(result.state_dict, f"{directory}/model.pt")
    write_parquet(result.history.assign(epoch=lambda d: d.epoch.astype(np.int64)),
                  f"{directory}/history.parquet")
    return {"files": ["model.pt", "history.parquet"]}
