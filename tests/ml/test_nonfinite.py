"""Inputs that would give a silently wrong result are refused, or handled as asked.

Non-finite values in X or y (every estimator and trainer, arrays and dataframes), an
L-BFGS that stops short, a tuning run whose every score is NaN, filtered inputs of unknown
row counts, a pipeline asked for more micro-batches than rows. Real clusters, no mocks.
"""

from __future__ import annotations

import logging

import re

import numpy as np
import pytest

pytest.importorskip("scipy")
sklearn_lm = pytest.importorskip("sklearn.linear_model")
torch = pytest.importorskip("torch")

import dask.array as da  # noqa: E402
import dask.dataframe as dd  # noqa: E402
import pandas as pd  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402
from sklearn.datasets import load_breast_cancer  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402

import blockflow  # noqa: E402
from blockflow.ml import (  # noqa: E402
    DataParallelTrainer,
    LinearRegression,
    LogisticRegression,
    PoissonRegression,
    as_row_blocks,
)
from blockflow.ml.tune import tune  # noqa: E402

#: as tests/ml/test_ml_glm.py: coefficients within 1e-4 of scikit-learn's exact solver
RTOL = 1e-4
NEWTON = "newton-cholesky"
FIX = ("drop or impute such rows, or pass drop_nonfinite=True (setting "
       "blockflow.ml.drop-nonfinite) to leave them out.")


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        yield c


@pytest.fixture(scope="module")
def cancer():
    X, y = load_breast_cancer(return_X_y=True)
    return StandardScaler().fit_transform(X), y.astype(float)


def trainer(client, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 1)).double()
    return DataParallelTrainer(model, lambda out, t: torch.nn.functional.mse_loss(
        out.reshape(-1), t), batch_size=64, epochs=1, client=client, **kw)


ESTIMATORS = {
    "logistic": lambda c, **kw: LogisticRegression(client=c, **kw),
    "linear": lambda c, **kw: LinearRegression(client=c, **kw),
    "poisson": lambda c, **kw: PoissonRegression(client=c, **kw),
    "trainer": trainer,
}


def collections(X, y, kind, rows=100):
    if kind == "array":
        return da.from_array(X, chunks=(rows, -1)), da.from_array(y, chunks=rows)
    cols = [f"f{i}" for i in range(X.shape[1])]
    return (dd.from_pandas(pd.DataFrame(X, columns=cols), chunksize=rows),
            dd.from_pandas(pd.Series(y, name="label"), chunksize=rows))


@pytest.mark.parametrize("kind", ["array", "dataframe"])
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_a_nan_in_X_is_refused_naming_column_block_and_row(client, cancer, name, kind,
                                                           caplog):
    X, y = cancer
    X = X.copy()
    X[207, 3] = np.nan
    X[450, 1] = np.inf  # a later one: the first is named
    with caplog.at_level(logging.ERROR, logger="distributed.worker"):
        with pytest.raises(blockflow.NonFiniteError) as e:  # a ValueError
            ESTIMATORS[name](client).fit(*collections(X, y, kind))
    col = "3" if kind == "array" else "'f3' (3)"
    assert str(e.value) == (f"blockflow: X has a non-finite value (nan) in column {col}, "
                            f"row 207 (block 2): {FIX}")
    assert isinstance(e.value, ValueError)
    # said once, to the caller: the (in-process) workers log no failed task with a traceback
    assert not [r for r in caplog.records if "Compute Failed" in str(r.msg)], caplog.text


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_a_non_finite_label_is_refused_naming_block_and_row(client, cancer, name, value):
    X, y = cancer
    y = y.copy()
    y[450] = value
    with pytest.raises(ValueError) as e:
        ESTIMATORS[name](client).fit(*collections(X, y, "array"))
    assert str(e.value) == (f"blockflow: y has a non-finite label ({value}) in row 450 "
                            f"(block 4): {FIX}")


def test_integer_features_are_not_looked_at_and_fit(client, cancer):
    X, y = cancer
    m = LinearRegression(alpha=1.0, client=client).fit(
        *collections(np.round(X * 10).astype(np.int64), y, "array"))
    ref = sklearn_lm.Ridge(alpha=1.0).fit(np.round(X * 10).astype(np.int64), y)
    a, b = np.append(m.coef_, m.intercept_), np.append(ref.coef_, ref.intercept_)
    assert np.linalg.norm(a - b) <= RTOL * np.linalg.norm(b)


def with_holes(X, y):
    X, y = X.copy(), y.copy()
    X[[5, 207, 333], [0, 3, 29]] = [np.nan, np.inf, np.nan]
    y[[333, 450]] = [np.nan, -np.inf]
    keep = np.isfinite(X).all(axis=1) & np.isfinite(y)
    assert keep.sum() == len(y) - 4
    return X, y, keep


def close(ours, theirs):
    a = np.append(ours.coef_, ours.intercept_)
    b = np.append(np.ravel(theirs.coef_), theirs.intercept_)
    assert np.linalg.norm(a - b) <= RTOL * np.linalg.norm(b), (a, b)


@pytest.mark.parametrize("kind", ["array", "dataframe"])
def test_dropping_non_finite_rows_gives_scikit_learns_logistic_model(client, cancer, kind):
    X, y, keep = with_holes(*cancer)
    ours = LogisticRegression(C=0.5, drop_nonfinite=True, client=client).fit(
        *collections(X, y, kind))
    theirs = sklearn_lm.LogisticRegression(C=0.5, tol=1e-12, max_iter=10_000,
                                           solver=NEWTON).fit(X[keep], y[keep])
    close(ours, theirs)
    assert ours.converged_ and ours.n_dropped_ == 4


def test_dropping_non_finite_rows_gives_scikit_learns_ridge_and_poisson(client, cancer):
    X, y, keep = with_holes(*cancer)
    ours = LinearRegression(alpha=2.0, drop_nonfinite=True, client=client).fit(
        *collections(X, y, "array", rows=70))
    close(ours, sklearn_lm.Ridge(alpha=2.0).fit(X[keep], y[keep]))
    counts = load_breast_cancer().data[:, 0].round()
    counts[450] = np.nan
    ours = PoissonRegression(alpha=0.01, drop_nonfinite=True, client=client).fit(
        *collections(X, counts, "array"))
    theirs = sklearn_lm.PoissonRegressor(alpha=0.01, tol=1e-12, max_iter=10_000,
                                         solver=NEWTON).fit(X[keep], counts[keep])
    close(ours, theirs)


def test_the_drop_setting_is_the_default_and_the_argument_wins(client, cancer):
    import dask

    X, y, keep = with_holes(*cancer)
    with dask.config.set({"blockflow.ml.drop-nonfinite": True}):
        m = LinearRegression(alpha=2.0, client=client).fit(*collections(X, y, "array"))
        assert m.n_dropped_ == 4
        with pytest.raises(ValueError, match="^blockflow: X has a non-finite value"):
            LinearRegression(drop_nonfinite=False, client=client).fit(
                *collections(X, y, "array"))


def test_dropping_every_row_is_refused(client, cancer):
    X, y = cancer
    with pytest.raises(ValueError) as e:
        LinearRegression(drop_nonfinite=True, client=client).fit(
            *collections(X, np.full_like(y, np.nan), "array"))
    assert str(e.value) == ("blockflow: every one of the 569 rows holds a non-finite value in "
                            "X or y; nothing is left to fit after dropping them (impute them "
                            "instead).")


def test_trainer_dropping_rows_equals_training_on_the_finite_rows(client, cancer):
    X, y, keep = with_holes(*cancer)
    dropped = trainer(client, drop_nonfinite=True).fit(*collections(X, y, "array"))
    # the finite rows, chunked as the drop leaves them: the same batches, the same steps
    kept = [int(keep[i:i + 100].sum()) for i in range(0, len(y), 100)]
    assert dropped.shards_.block_rows == kept and dropped.shards_.dropped_rows == 4
    clean = trainer(client).fit(da.from_array(X[keep], chunks=(tuple(kept), -1)),
                                da.from_array(y[keep], chunks=(tuple(kept),)))
    a = torch.nn.utils.parameters_to_vector(dropped.model.parameters()).detach().numpy()
    b = torch.nn.utils.parameters_to_vector(clean.model.parameters()).detach().numpy()
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def test_an_lbfgs_that_stops_short_warns_with_scipys_reason(client, cancer):
    X, y = cancer
    with pytest.warns(blockflow.ConvergenceWarning) as w:
        m = LogisticRegression(max_iter=2, client=client).fit(*collections(X, y, "array"))
    assert not m.converged_ and len(w) == 1
    assert re.fullmatch(
        r"blockflow: LogisticRegression's L-BFGS stopped after 2 iterations without "
        r"converging \(scipy: .*ITERATIONS REACHED LIMIT\); the coefficients may be off: "
        r"raise max_iter \(now 2\)\.", str(w[0].message)), str(w[0].message)
    assert issubclass(blockflow.ConvergenceWarning, blockflow.BlockflowWarning)


def scores_nan(cfg, epochs, checkpoint):
    return float("nan"), None


def test_tune_with_every_score_nan_warns_as_when_every_trial_fails(client):
    configs = [{"x": float(x)} for x in range(3)]
    with pytest.warns(RuntimeWarning) as w:
        tune(scores_nan, configs, client=client, eta=3, min_budget=1, max_budget=3,
             publish=False)
    assert [str(m.message) for m in w] == [
        "blockflow: every one of the 3 trials scored NaN (a diverged model, or NaN in the "
        "data it scored on); the best trial is arbitrary: check the score your train "
        "function returns"]


def test_filtered_inputs_are_compared_on_computed_row_counts(client, cancer):
    X, y = cancer
    dX, dy = collections(X, y, "array")
    mask = dX[:, 0] > 0
    assert np.isnan(dX[mask].shape[0]) and np.isnan(dy[mask].shape[0])
    ours = LinearRegression(alpha=2.0, client=client).fit(dX[mask], dy[mask])
    keep = X[:, 0] > 0
    close(ours, sklearn_lm.Ridge(alpha=2.0).fit(X[keep], y[keep]))
    # a real mismatch is named with both counts, whichever side was filtered
    with pytest.raises(ValueError) as e:
        as_row_blocks(dX[mask], dy)
    assert str(e.value) == (f"blockflow: X has {keep.sum()} rows but y has {len(y)}; pass "
                            f"labels for every sample.")
    with pytest.raises(ValueError) as e:
        as_row_blocks(dX, dy[mask])
    assert str(e.value) == (f"blockflow: X has {len(y)} rows but y has {keep.sum()}; pass "
                            f"labels for every sample.")
