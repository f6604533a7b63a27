"""GLMs of blockflow.ml against scikit-learn: same penalty, same coefficients."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("scipy")
sklearn_lm = pytest.importorskip("sklearn.linear_model")

import dask.array as da  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402
from sklearn.datasets import load_breast_cancer  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402

from blockflow.ml import LinearRegression, LogisticRegression, PoissonRegression  # noqa: E402
from blockflow.workloads.flights import read_table  # noqa: E402
from blockflow.workloads.train import N_FEATURES, flight_features  # noqa: E402

RTOL = 1e-4


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        yield c


@pytest.fixture(scope="module")
def cancer():
    X, y = load_breast_cancer(return_X_y=True)
    return StandardScaler().fit_transform(X), y.astype(float)


@pytest.fixture(scope="module")
def flights():
    data = flight_features(read_table("flights", nrows=20_000)).astype(np.float64)
    return data[:, :N_FEATURES], data[:, N_FEATURES]


#: scikit-learn's reference solver: Newton steps on the Cholesky-factored Hessian reach the
#: exact optimum (gradient norm 2e-16 on flights); its lbfgs stops at a gradient norm 16x
#: blockflow's L-BFGS, 1.4e-4 relative from the optimum on 50,000 flights.
NEWTON = "newton-cholesky"


def close(ours, theirs):
    """Coefficients and intercept equal to RTOL relative to the coefficient vector's size."""
    a = np.append(ours.coef_, ours.intercept_)
    b = np.append(np.ravel(theirs.coef_), theirs.intercept_)
    assert np.linalg.norm(a - b) <= RTOL * np.linalg.norm(b), (a, b)


def chunked(X, y, rows=100):
    return da.from_array(X, chunks=(rows, -1)), da.from_array(y, chunks=rows)


@pytest.mark.slow
def test_logistic_matches_scikit_learn_on_breast_cancer(client, cancer):
    X, y = cancer
    ours = LogisticRegression(C=0.5, client=client).fit(*chunked(X, y))
    theirs = sklearn_lm.LogisticRegression(C=0.5, tol=1e-12, max_iter=10_000,
                                           solver=NEWTON).fit(X, y)
    close(ours, theirs)
    assert ours.converged_
    assert ours.score(*chunked(X, y)) == pytest.approx(theirs.score(X, y), abs=1e-9)
    proba = ours.predict_proba(chunked(X, y)[0]).compute()
    np.testing.assert_allclose(proba, theirs.predict_proba(X), atol=1e-5)


@pytest.mark.slow
def test_linear_matches_ridge_on_breast_cancer(client, cancer):
    X, y = cancer
    ours = LinearRegression(alpha=2.0, client=client).fit(*chunked(X, y, 70))
    close(ours, sklearn_lm.Ridge(alpha=2.0).fit(X, y))


@pytest.mark.slow
def test_poisson_matches_scikit_learn_on_breast_cancer(client, cancer):
    X, _ = cancer
    counts = load_breast_cancer().data[:, 0].round()  # mean radius, a positive count-like target
    ours = PoissonRegression(alpha=0.01, client=client).fit(*chunked(X, counts))
    theirs = sklearn_lm.PoissonRegressor(alpha=0.01, tol=1e-12, max_iter=10_000,
                                         solver=NEWTON).fit(X, counts)
    close(ours, theirs)
    assert ours.score(*chunked(X, counts)) == pytest.approx(theirs.score(X, counts), abs=1e-6)


@pytest.mark.slow
def test_glms_match_scikit_learn_on_flights(client, flights):
    X, y = flights
    ours = LogisticRegression(C=1.0, client=client).fit(*chunked(X, y, 2_500))
    close(ours, sklearn_lm.LogisticRegression(C=1.0, tol=1e-12, max_iter=10_000,
                                              solver=NEWTON).fit(X, y))
    ours = LinearRegression(alpha=1.0, client=client).fit(*chunked(X, y, 2_500))
    close(ours, sklearn_lm.Ridge(alpha=1.0).fit(X, y))


def test_estimator_protocol(client):
    m = LogisticRegression(C=3.0, client=client)
    assert m.get_params()["C"] == 3.0
    assert m.set_params(C=0.1).C == 0.1
    with pytest.raises(ValueError, match=r"^blockflow: LogisticRegression has no parameter"):
        m.set_params(alpha=1)


def test_logistic_refuses_labels_other_than_0_1(client, cancer):
    X, y = cancer
    with pytest.raises(ValueError) as e:
        LogisticRegression(client=client).fit(*chunked(X, y * 2))
    n = int((y == 1).sum())
    assert str(e.value) == (f"blockflow: LogisticRegression needs labels 0/1; {n} labels are "
                            f"neither (encode the classes first).")


@pytest.mark.gpu
def test_logistic_on_cupy_blocks_matches_numpy(client, cancer):
    cupy = pytest.importorskip("cupy")
    from blockflow.backends import gpu_device_count
    if gpu_device_count() == 0:
        pytest.skip("no NVIDIA GPU visible")
    X, y = cancer
    dx = da.from_array(X, chunks=(100, -1)).map_blocks(cupy.asarray)
    dy = da.from_array(y, chunks=100).map_blocks(cupy.asarray)
    ours = LogisticRegression(client=client).fit(dx, dy)
    ref = LogisticRegression(client=client).fit(*chunked(X, y))
    np.testing.assert_allclose(ours.coef_, ref.coef_, rtol=1e-8)


@pytest.mark.parametrize("cls, kw, message", [
    (LogisticRegression, dict(C=0), "C must be a number > 0 (inverse penalty strength; "
                                    "np.inf for none), got 0."),
    (LogisticRegression, dict(C=-1.0), "C must be a number > 0 (inverse penalty strength; "
                                       "np.inf for none), got -1.0."),
    (LinearRegression, dict(alpha=-0.5), "alpha must be a finite number >= 0 (L2 penalty on "
                                         "the coefficients; 0 for none), got -0.5."),
    (PoissonRegression, dict(alpha=float("inf")), "alpha must be a finite number >= 0 (L2 "
                                                  "penalty on the coefficients; 0 for none), "
                                                  "got inf."),
    (PoissonRegression, dict(max_iter=0), "max_iter must be an integer >= 1 (L-BFGS "
                                          "iterations), got 0."),
    (LinearRegression, dict(max_iter=10.5), "max_iter must be an integer >= 1 (L-BFGS "
                                            "iterations), got 10.5."),
    (LogisticRegression, dict(tol=-1e-3), "tol must be a finite number >= 0 (L-BFGS "
                                          "gradient tolerance), got -0.001."),
    (LinearRegression, dict(sharding="fast"), "sharding must be 'speed' or 'equal', got "
                                              "'fast'."),
])
def test_bad_glm_settings_are_refused_at_construction(cls, kw, message):
    with pytest.raises(ValueError) as e:
        cls(**kw)
    assert str(e.value) == f"blockflow.ml.{cls.__name__}: {message}"


def test_bad_glm_settings_given_by_set_params_are_refused_by_fit(client, cancer):
    model = LogisticRegression().set_params(C=0.0)
    with pytest.raises(ValueError, match=r"^blockflow.ml.LogisticRegression: C must be"):
        model.fit(*chunked(*cancer))


def test_a_glm_is_bitwise_the_same_whatever_the_placement_and_timing(client, cancer):
    """Partial sums are added in block order, not in the order workers answer: three fits,
    and fits on another placement, give the same coefficients to the last bit."""
    X, y = cancer
    fits = [LogisticRegression(C=0.5, client=client, sharding=s).fit(*chunked(X, y, 37))
            for s in ("speed", "speed", "speed", "equal")]
    first = np.append(fits[0].coef_, fits[0].intercept_)
    for other in fits[1:]:
        assert np.array_equal(first, np.append(other.coef_, other.intercept_))


@pytest.mark.filterwarnings("ignore::blockflow.errors.ConvergenceWarning")
@pytest.mark.parametrize("cls", [LinearRegression, LogisticRegression, PoissonRegression])
def test_a_glm_is_bitwise_the_same_whatever_the_block_boundaries(client, cancer, cls):
    """NumPy input and Dask input cut at other rows (even and uneven blocks) give the same
    coefficients to the last bit (25 L-BFGS steps: every pass's sums must agree): each
    row's value depends on that row alone and the rows are summed in fixed row groups,
    correctly rounded once, not block by block (2.8e-10 apart before)."""
    X, y = cancer  # 0/1 labels: counts for the Poisson model too
    fits = [cls(client=client, max_iter=25).fit(X, y)]
    for chunks in (37, (13, 200, 56, 300)):
        if isinstance(chunks, tuple):
            chunks = chunks[:-1] + (len(X) - sum(chunks[:-1]),)
        fits.append(cls(client=client, max_iter=25).fit(
            da.from_array(X, chunks=(chunks, -1)), da.from_array(y, chunks=(chunks,))))
    first = np.append(fits[0].coef_, fits[0].intercept_)
    for other in fits[1:]:
        assert np.array_equal(first, np.append(other.coef_, other.intercept_)), \
            np.abs(first - np.append(other.coef_, other.intercept_)).max()
