"""Pipeline schedules (GPipe, Huang et al., 2019; 1F1B, Narayanan et al., 2021; torch's
interleaved 1F1B) and :class:`PipelineResult`, what a
:class:`~blockflow.parallel.PipelineParallel` step gives (its timeline measured on the
ranks by hooks on torch's ``PipelineStage``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

__all__ = ["SCHEDULES", "PipelineResult", "bubble_fraction", "timeline"]

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


def bubble_fraction(timeline: pd.DataFrame) -> float:
    """Idle fraction of a pipeline run: ``1 - busy / (stages x span)``.

    Parameters
    ----------
    timeline : pandas.DataFrame
        With columns ``stage``, ``start``, ``stop`` (seconds), one row per task.

    Returns
    -------
    float
        Fraction 0-1 of the stages' time between first start and last stop spent idle.
    """
    if timeline.empty:
        return 0.0
    span = float(timeline.stop.max() - timeline.start.min())
    busy = float((timeline.stop - timeline.start).sum())
    p = timeline.stage.nunique()
    return max(0.0, 1.0 - busy / (p * span)) if span > 0 else 0.0


@dataclass
class PipelineResult:
    """What one pipeline step gave (see :meth:`PipelineParallel.run`).

    Attributes
    ----------
    output : numpy.ndarray
        The model's output for the whole batch.
    loss : float or None
        The loss of the batch, when a target was given.
    grads : dict of str to numpy.ndarray or None
        Gradients by ``state_dict()`` name, before the optimizer stepped
        (``return_grads=True`` only).
    timeline : pandas.DataFrame
        One row per stage task: ``stage``, ``worker``, ``micro_batch``, ``phase``
        (``"forward"``/``"backward"``), ``start``, ``stop`` (seconds).
    makespan : float
        Seconds from the first task start to the last stop.
    n_micro_batches, n_stages : int
    rows : int
        Rows of the batch.
    micro_batch_rows : list of int
        Rows of each micro-batch (they may differ by one).
    schedule : str
    peak_activations : list of int
        Per stage, the most micro-batches whose activations it held at once.
    recovered : list of str
        Stages rebuilt after their worker was lost during this step.
    """

    output: np.ndarray | None
    loss: float | None
    grads: dict | None
    timeline: pd.DataFrame = field(repr=False)
    makespan: float
    n_micro_batches: int
    n_stages: int
    rows: int
    micro_batch_rows: list = field(default_factory=list)
    schedule: str = "gpipe"
    peak_activations: list = field(default_factory=list)
    recovered: list = field(default_factory=list)

    @property
    def bubble(self) -> float:
        """Measured idle fraction 0-1 (:func:`bubble_fraction` of the timeline)."""
        return bubble_fraction(self.timeline)

    @property
    def ideal_bubble(self) -> float:
        """GPipe's bubble for equal stages, ``(p - 1) / (m + p - 1)``."""
        p, m = self.n_stages, self.n_micro_batches
        return (p - 1) / (m + p - 1)

    @property
    def throughput(self) -> float:
        """Rows per second through the pipeline (forward and backward when both ran)."""
        return self.rows / self.makespan if self.makespan > 0 else float("inf")

    def plot(self):
        """Bokeh Gantt chart of the timeline: one row per stage, a bar per task."""
        from bokeh.models import ColumnDataSource, HoverTool
        from bokeh.plotting import figure

        t = self.timeline.assign(
            y=lambda d: [f"stage {s}" for s in d.stage],
            color=lambda d: np.where(d.phase == "forward", "#1f77b4", "#ff7f0e"))
        stages = [f"stage {s}" for s in sorted(t.stage.unique(), reverse=True)]
        fig = figure(y_range=stages, height=60 + 40 * len(stages), width=700,
                     title=f"Pipeline ({self.schedule}): {self.n_stages} stages, "
                           f"{self.n_micro_batches} micro-batches, bubble {self.bubble:.1%}",
                     x_axis_label="seconds")
        fig.hbar(y="y", left="start", right="stop", height=0.7, color="color",
                 source=ColumnDataSource(t), line_color="white")
        fig.add_tools(HoverTool(tooltips=[("phase", "@phase"), ("micro-batch", "@micro_batch"),
                                          ("worker", "@worker")]))
        return fig


def timeline(records: list[list[tuple]], workers: list[str]) -> pd.DataFrame:
    """Rows of a step's passes from each stage's records, seconds since the first start."""
    rows = [{"stage": s, "worker": workers[s], "micro_batch": int(j), "phase": phase,
             "start": float(a), "stop": float(b)}
            for s, recs in enumerate(records) for phase, j, a, b in recs]
    df = pd.DataFrame(rows, columns=["stage", "worker", "micro_batch", "phase", "start",
                                     "stop"])
    if len(df):
        t0 = df.start.min()
        df = df.assign(start=df.start - t0, stop=df.stop - t0).sort_values(
            ["stage", "start"]).reset_index(drop=True)
    return df
