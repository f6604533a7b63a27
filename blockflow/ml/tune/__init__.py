"""Hyperparameter tuning: asynchronous successive halving (ASHA) with trials as Dask tasks.

ASHA (Li et al. 2020, "A System for Massively Parallel Hyperparameter Tuning", Algorithm 2)
without a rung barrier, trials placed by earliest finish time on learned worker speeds (a
blockflow heuristic). ``synchronous=True`` runs synchronous successive halving, as dask-ml's
``SuccessiveHalvingSearchCV``. Guide: docs/guide/ai.md.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd
from distributed import default_client

from blockflow import config
from blockflow.ml.tune.runner import TRIAL_PREFIX, Tuner  # noqa: F401
from blockflow.ml.tune.space import choice, loguniform, randint, sample_configs, uniform

__all__ = ["TuneResult", "choice", "loguniform", "randint", "sample_configs", "tune",
           "uniform"]


@dataclass
class TuneResult:
    """What :func:`tune` returns.

    Attributes
    ----------
    trials : pandas.DataFrame
        One row per configuration (index ``trial``): its parameters, ``config``, ``rung``,
        ``budget``, ``score``, ``status`` (``"completed"``, ``"stopped"``, ``"failed"``,
        ``"pending"``), ``worker``, ``error``, ``started``/``finished`` (s since the epoch)
        and ``duration`` (s).
    history : pandas.DataFrame
        One row per trial task: ``trial``, ``rung``, ``budget``, ``epochs``, ``score``,
        ``status``, ``worker``, ``promotion``, ``speculative``, ``backup``, ``speed``,
        ``fastest_free``, ``submitted``/``started``/``finished``, ``reported`` (the
        client's clock when the tuner took the result in, s since the epoch), ``duration``
        (s), ``error``.
    best_trial : int or None
        The trial with the best score at the highest rung any trial completed.
    best_config : dict or None
    best_score : float
    best_checkpoint : object
        The best trial's last checkpoint.
    wall_time : float
        Seconds from the first submission to the last result.
    busy_fraction : float
        Summed task time over (worker threads x wall time), 0-1.
    promotion : str
        ``"certain-first"``, ``"asha"`` or ``"synchronous"``.
    """

    trials: Any
    history: Any
    best_trial: int | None
    best_config: dict | None
    best_score: float
    best_checkpoint: Any
    wall_time: float
    busy_fraction: float
    promotion: str = "certain-first"


def tune(train: Callable, space: Mapping[str, Any] | Sequence[Mapping[str, Any]], *,
         client=None, n_configs: int | None = None, eta: int | None = None,
         min_budget: float | None = None, max_budget: float | None = None,
         mode: str = "max", seed: int = 0, synchronous: bool = False,
         promotion: str | None = None, publish: bool = True,
         name: str = "tune") -> TuneResult:
    """Tune hyperparameters by asynchronous successive halving, trials as Dask tasks.

    Parameters
    ----------
    train : callable
        ``train(config, epochs, checkpoint) -> (score, checkpoint)``, run on a worker:
        train ``epochs`` more budget units from ``checkpoint`` (None at rung 0). An
        exception marks the trial ``"failed"``.
    space : mapping or sequence of mappings
        A search space for :func:`sample_configs`, or the configurations themselves.
    client : distributed.Client, optional
        Default: the current client.
    n_configs : int, optional
        Configurations drawn from ``space`` (config ``blockflow.tune.n-configs``).
    eta : int, optional
        Reduction factor: the top ``1/eta`` of a rung is promoted (config
        ``blockflow.tune.eta``).
    min_budget, max_budget : float, optional
        Budget units of rung 0 and of the top rung (config ``blockflow.tune.min-budget``,
        ``blockflow.tune.max-budget``).
    mode : {"max", "min"}, default "max"
        Whether a higher or a lower score is better.
    seed : int, default 0
        Seed of the configurations drawn.
    synchronous : bool, default False
        Run synchronous successive halving instead (the baseline).
    promotion : {"certain-first", "asha"}, optional
        Promotions synchronous SH is sure to make first (a blockflow heuristic), or Li et
        al.'s order; config ``blockflow.tune.promotion``.
    publish : bool, default True
        Publish the running trials for blockflow's dashboard.
    name : str, default "tune"
        Shown on the dashboard.

    Returns
    -------
    TuneResult

    Raises
    ------
    ValueError
        For ``eta`` not a whole number >= 2, a bad ``mode`` or ``promotion``, budgets out
        of order, or no configurations.
    RuntimeError
        If every worker leaves while trials are still to run.

    Warns
    -----
    RuntimeWarning
        When every trial failed (the result holds their errors) or scored NaN.
    """
    eta = config.get("tune.eta", eta)
    if isinstance(eta, bool) or not float(eta).is_integer() or eta < 2:
        raise ValueError(f"blockflow: tune needs a whole number eta >= 2 (config "
                         f"blockflow.tune.eta), got {eta!r}.")
    eta = int(eta)
    if mode not in ("max", "min"):
        raise ValueError(f"blockflow: tune mode must be 'max' or 'min', got {mode!r}.")
    promotion = config.get("tune.promotion", promotion)
    if promotion not in ("certain-first", "asha"):
        raise ValueError(f"blockflow: tune promotion must be 'certain-first' or 'asha', got "
                         f"{promotion!r} (config blockflow.tune.promotion).")
    min_budget = config.get("tune.min-budget", min_budget)
    max_budget = config.get("tune.max-budget", max_budget)
    if isinstance(space, Mapping):
        configs = sample_configs(space, int(config.get("tune.n-configs", n_configs)), seed)
    else:
        configs = [dict(c) for c in space]
    if not configs:
        raise ValueError("blockflow: tune got no configurations to try; pass a non-empty "
                         "list of configurations, or a search space with n_configs >= 1.")
    client = client or default_client()
    tuner = Tuner(client, train, configs, eta=eta, min_budget=min_budget,
                  max_budget=max_budget, mode=mode, synchronous=synchronous,
                  publish=publish, name=name, promotion=promotion)
    t0 = time.time()
    try:
        tuner.run_sync() if synchronous else tuner.run_async()
    finally:
        tuner.cancel_all()
        if publish:
            try:
                tuner.publish_progress(force=True)
            except Exception:  # the client may be closing: the table is only for display
                pass
    result = _result(tuner, time.time() - t0)
    _warn_if_nothing_scored(result.trials)
    return result



def _result(tuner: Tuner, wall: float) -> TuneResult:
    """The trials, the history and the best trial of ``tuner``, after ``wall`` seconds."""
    names = list(dict.fromkeys(n for t in tuner.trials for n in t.config))
    rows = [{"trial": i, **{n: t.config.get(n) for n in names}, "config": t.config,
             "rung": t.rung, "budget": tuner.budgets[t.rung] if t.rung >= 0 else 0,
             "score": t.score, "status": t.status, "worker": t.worker,
             "error": t.error, "started": t.started, "finished": t.finished,
             "duration": t.duration} for i, t in enumerate(tuner.trials)]
    trials = pd.DataFrame(rows).set_index("trial")
    cols = ["trial", "rung", "budget", "epochs", "score", "status", "worker", "promotion",
            "speculative", "speed", "fastest_free", "submitted", "started", "finished",
            "reported", "duration", "error", "backup"]
    history = pd.DataFrame(tuner.history, columns=cols)
    threads = max(sum(tuner.workers.values()), 1)
    busy = float(np.nansum(history["duration"])) / (threads * wall) if wall > 0 else 0.0
    best = tuner.rungs.best()
    return TuneResult(
        trials=trials, history=history, best_trial=best,
        best_config=None if best is None else dict(tuner.trials[best].config),
        best_score=math.nan if best is None else tuner.trials[best].score,
        best_checkpoint=None if best is None else tuner.best_checkpoint(best),
        wall_time=wall, busy_fraction=min(busy, 1.0),
        promotion="synchronous" if tuner.synchronous else tuner.promotion)


def _warn_if_nothing_scored(trials) -> None:
    """Warn once when no trial gave a score (every trial failed or scored NaN)."""
    n = len(trials)
    failed = trials["status"] == "failed" if n else None
    if not n or not (failed | trials["score"].isna()).all():
        return
    k = int(failed.sum())
    if k == n:
        what = f"every one of the {n} trials failed; the first error: " \
               f"{trials['error'].iloc[0]}"
    else:
        what = (f"every one of the {n} trials " + (f"failed ({k}) or " if k else "")
                + "scored NaN (a diverged model, or NaN in the data it scored on); the "
                "best trial is arbitrary: check the score your train function returns")
        if k:
            what += f"; the first error: {trials.loc[failed, 'error'].iloc[0]}"
    warnings.warn(f"blockflow: {what}", RuntimeWarning, stacklevel=3)
