"""Generalised linear models fitted by full-batch gradients on resident shards and L-BFGS.

One pass over :class:`blockflow.ml.ResidentShards` per objective evaluation, SciPy's
L-BFGS-B on the client. Objectives are scikit-learn's (``Ridge``, ``LogisticRegression``,
``PoissonRegressor``). Guide: docs/guide/ai.md.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import dask
import dask.array as da
import numpy as np
from distributed import default_client

from blockflow.backends import array_module as _xp
from blockflow.errors import ConvergenceWarning, check_number
from blockflow.ml._passes import group_terms, merge_groups
from blockflow.ml._finite import FiniteCheck, column_names, drop_setting
from blockflow.ml._rows import as_row_blocks
from blockflow.ml._shards import ResidentShards

__all__ = ["LinearRegression", "LogisticRegression", "PoissonRegression"]


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def _glm_pass(blocks, rows, kind, coef, first):
    """On a worker: the (loss, gradient wrt [w, b]) terms of a block's rows (float64; the
    block starts at row ``first`` of the data) in fixed row groups
    (:func:`~blockflow.ml._passes.group_terms`), which the client sums
    (:func:`~blockflow.ml._passes.merge_groups`).

    Each row's terms depend on that row alone (``einsum``'s dot product, where BLAS's
    ``X @ c`` may add a row's products in another order at a block's edge), each group of
    rows is summed one way and the groups' sums are correctly rounded once: the same total
    whatever the blocks' boundaries, placement or order.
    """
    [(xb, yb)] = blocks
    xp = _xp(xb)
    c = xp.asarray(coef)
    xb = xb.astype(xp.float64, copy=False)
    yb = yb.astype(xp.float64, copy=False).reshape(-1)
    z = xp.einsum("ij,j->i", xb, c[:-1]) + c[-1]
    if kind == "linear":
        r = z - yb
        loss, d = r * r, 2 * r
    elif kind == "logistic":
        loss, d = xp.logaddexp(0, z) - yb * z, 1 / (1 + xp.exp(-z)) - yb
    else:  # poisson, log link: half deviance up to a constant in y
        mu = xp.exp(z)
        loss, d = mu - yb * z, mu - yb
    return group_terms([loss, (xb, d), d], first)


# The settings every GLM shares are keyword-only dataclass fields of the base class; each
# estimator declares only its penalty, which dataclasses put first in ``__init__``:
# ``LinearRegression(alpha=0.0, *, fit_intercept=True, ...)``. ``repr=False, eq=False`` keep
# the estimators' own repr and identity equality.
@dataclasses.dataclass(kw_only=True, repr=False, eq=False)
class _GLM:
    fit_intercept: bool = True
    max_iter: int = 500
    tol: float = 1e-10
    sharding: str = "speed"
    drop_nonfinite: bool | None = None
    client: Any = None

    _kind = ""

    def __post_init__(self):
        self._check_params()

    def _check_params(self) -> None:
        """Refuse a bad setting, naming the parameter, its meaning and the value."""
        f = f"blockflow.ml.{type(self).__name__}"
        check_number(self.max_iter, "max_iter", f, "L-BFGS iterations", integer=True, low=1)
        check_number(self.tol, "tol", f, "L-BFGS gradient tolerance", low=0)
        check_number(getattr(self, "alpha", 0.0), "alpha", f, "L2 penalty on the "
                     "coefficients; 0 for none", low=0)
        # as scikit-learn: C=inf is no penalty
        check_number(getattr(self, "C", 1.0), "C", f, "inverse penalty strength; np.inf "
                     "for none", low=0, low_open=True, finite=False)
        if not isinstance(self.fit_intercept, (bool, np.bool_)):
            raise ValueError(f"{f}: fit_intercept must be True or False, got "
                             f"{self.fit_intercept!r}.")
        if self.sharding not in ("speed", "equal"):
            raise ValueError(f"{f}: sharding must be 'speed' or 'equal', got "
                             f"{self.sharding!r}.")

    # scikit-learn's estimator protocol, without importing scikit-learn
    def get_params(self, deep: bool = True) -> dict:
        """Constructor parameters (scikit-learn's protocol)."""
        names = [p for p in inspect.signature(type(self).__init__).parameters if p != "self"]
        return {n: getattr(self, n) for n in names}

    def set_params(self, **params):
        """Set constructor parameters (scikit-learn's protocol); returns self."""
        for k, v in params.items():
            if k not in self.get_params():
                raise ValueError(f"blockflow: {type(self).__name__} has no parameter {k!r}; "
                                 f"valid ones: {sorted(self.get_params())}.")
            setattr(self, k, v)
        return self

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items() if k != "client")
        return f"{type(self).__name__}({args})"

    def _penalty(self, w: np.ndarray, n: int) -> tuple[float, np.ndarray]:
        raise NotImplementedError

    def fit(self, X, y):
        """Fit on ``X`` (n_samples x n_features, rows chunked) and ``y`` (n_samples).

        Parameters
        ----------
        X : dask.array.Array, dask.dataframe.DataFrame, or NumPy/CuPy array
        y : dask array / Series, or NumPy/CuPy array

        Raises
        ------
        ValueError
            If a setting is out of range, shapes disagree, ``y`` holds values the model
            cannot fit, or ``X``/``y`` hold a NaN or an infinity (unless
            ``drop_nonfinite``).

        Warns
        -----
        blockflow.ConvergenceWarning
            If L-BFGS stopped before converging (``converged_`` is then False).
        """
        from scipy.optimize import minimize

        self._check_params()
        client = self.client or default_client()
        check = FiniteCheck(drop=drop_setting(self.drop_nonfinite), columns=column_names(X))
        X, y = as_row_blocks(X, y)
        p = X.shape[1]
        self._check_y(y)
        shards = ResidentShards(client, X, y, sharding=self.sharding, check=check)
        n = sum(shards.block_rows)  # the rows kept (non-finite ones dropped, if asked)
        self.n_dropped_ = shards.dropped_rows
        self.n_passes_ = 0

        def objective(theta):
            coef = theta if self.fit_intercept else np.append(theta, 0.0)
            total = shards.map_sum(_glm_pass, None, (self._kind, coef), first_rows=True,
                                   merge=merge_groups)
            loss, grad = total[0], total[1:]
            self.n_passes_ += 1
            pen, pgrad = self._penalty(coef[:-1], n)
            g = grad / n
            g[:-1] += pgrad
            return loss / n + pen, (g if self.fit_intercept else g[:-1])

        try:
            x0 = np.zeros(p + 1 if self.fit_intercept else p)
            res = minimize(objective, x0, jac=True, method="L-BFGS-B",
                           options={"maxiter": self.max_iter, "gtol": self.tol,
                                    "ftol": 1e-15, "maxcor": 20})
        finally:
            shards.close()
        theta = res.x if self.fit_intercept else np.append(res.x, 0.0)
        self.coef_, self.intercept_ = theta[:-1], float(theta[-1])
        self.n_iter_, self.converged_ = int(res.nit), bool(res.success)
        self.n_features_in_ = p
        if not res.success:
            _warn_not_converged(type(self).__name__, res, self.max_iter)
        return self

    def _check_y(self, y) -> None:
        pass

    def decision_function(self, X):
        """Linear predictor ``X @ coef_ + intercept_`` (dask array in, dask array out)."""
        if isinstance(X, da.Array):  # not a bound method: the estimator holds the client
            return X.map_blocks(_linear, self.coef_, self.intercept_, drop_axis=1,
                                dtype=np.float64)
        return _linear(X, self.coef_, self.intercept_)


def _warn_not_converged(name: str, res, max_iter: int) -> None:
    """A :class:`blockflow.ConvergenceWarning` with SciPy's reason and the fix for it."""
    reason = res.message.decode() if isinstance(res.message, bytes) else str(res.message)
    fix = (f"raise max_iter (now {max_iter})" if res.nit >= max_iter else
           "scale the features (e.g. to zero mean and unit variance) or loosen tol")
    warnings.warn(f"blockflow: {name}'s L-BFGS stopped after {res.nit} iterations without "
                  f"converging (scipy: {reason}); the coefficients may be off: {fix}.",
                  ConvergenceWarning, stacklevel=3)


def _linear(xb, coef, intercept):
    xp = _xp(xb)
    return xb.astype(xp.float64) @ xp.asarray(coef) + intercept


@dataclasses.dataclass(repr=False, eq=False)
class LinearRegression(_GLM):
    """Least squares with an L2 penalty (scikit-learn's ``Ridge``; ``alpha=0``: OLS).

    Parameters
    ----------
    alpha : float, default 0
        Penalty on ``||w||^2`` (the intercept is not penalised).
    fit_intercept : bool, default True
    max_iter : int, default 500
        L-BFGS iterations (each one or more passes over the data).
    tol : float, default 1e-10
        L-BFGS projected-gradient tolerance on the objective divided by ``n_samples``.
    sharding : {"speed", "equal"}, default "speed"
    drop_nonfinite : bool, optional
        Drop rows holding a NaN or infinity instead of raising (``n_dropped_`` counts
        them); default ``blockflow.ml.drop-nonfinite``.
    client : distributed.Client, optional
    """
    alpha: float = 0.0

    _kind = "linear"

    def _penalty(self, w, n):
        return self.alpha * (w @ w) / n, 2 * self.alpha * w / n

    def predict(self, X):
        """Predicted values."""
        return self.decision_function(X)

    def score(self, X, y) -> float:
        """Coefficient of determination R^2."""
        pred, y = dask.compute(self.predict(X), y)
        y, pred = np.asarray(y, float).ravel(), _host(pred).ravel()
        return float(1 - ((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum())


@dataclasses.dataclass(repr=False, eq=False)
class LogisticRegression(_GLM):
    """Binary logistic regression with an L2 penalty (scikit-learn's ``LogisticRegression``).

    Parameters
    ----------
    C : float, default 1.0
        Inverse penalty strength: minimises ``C sum(log-loss) + ||w||^2 / 2``.
    fit_intercept, max_iter, tol, sharding, drop_nonfinite, client
        As :class:`LinearRegression`.
    """
    C: float = 1.0

    _kind = "logistic"

    def _penalty(self, w, n):
        return 0.5 * (w @ w) / (self.C * n), w / (self.C * n)

    def _check_y(self, y):
        # a NaN/inf label is the non-finite check's to name (with its row), or to drop
        bad = int((da.isfinite(y) & (y != 0) & (y != 1)).sum().compute())
        if bad:
            raise ValueError(f"blockflow: LogisticRegression needs labels 0/1; {bad} labels "
                             f"are neither (encode the classes first).")
        self.classes_ = np.array([0, 1])

    def predict_proba(self, X):
        """Probabilities of classes 0 and 1, shape (n_samples, 2)."""
        z = self.decision_function(X)
        p = 1 / (1 + (da.exp(-z) if isinstance(z, da.Array) else _xp(z).exp(-z)))
        stack = da.stack if isinstance(p, da.Array) else _xp(p).stack
        return stack([1 - p, p], axis=1)

    def predict(self, X):
        """Class labels 0/1."""
        return (self.decision_function(X) > 0).astype(np.int64)

    def score(self, X, y) -> float:
        """Accuracy (fraction 0-1)."""
        pred, y = dask.compute(self.predict(X), y)
        return float((_host(pred).ravel() == np.asarray(y).ravel()).mean())


@dataclasses.dataclass(repr=False, eq=False)
class PoissonRegression(_GLM):
    """Poisson regression, log link, L2 penalty (scikit-learn's ``PoissonRegressor``).

    Parameters
    ----------
    alpha : float, default 1.0
        Minimises ``sum(half deviance) / n + alpha ||w||^2 / 2``.
    fit_intercept, max_iter, tol, sharding, drop_nonfinite, client
        As :class:`LinearRegression`.
    """
    alpha: float = 1.0

    _kind = "poisson"

    def _penalty(self, w, n):
        return 0.5 * self.alpha * (w @ w), self.alpha * w

    def _check_y(self, y):
        bad = int((da.isfinite(y) & (y < 0)).sum().compute())  # -inf: the finite check's
        if bad:
            raise ValueError(f"blockflow: PoissonRegression needs counts >= 0; {bad} are "
                             f"negative.")

    def predict(self, X):
        """Expected counts ``exp(X @ coef_ + intercept_)``."""
        z = self.decision_function(X)
        return da.exp(z) if isinstance(z, da.Array) else _xp(z).exp(z)

    def score(self, X, y) -> float:
        """D^2, the fraction of Poisson deviance explained (scikit-learn's ``score``)."""
        mu, y = dask.compute(self.predict(X), y)
        y, mu = np.asarray(y, float).ravel(), _host(mu).ravel()

        def dev(m):
            with np.errstate(divide="ignore", invalid="ignore"):
                t = np.where(y > 0, y * np.log(y / m), 0.0)
            return 2 * (t - y + m).sum()
        return float(1 - dev(mu) / dev(np.full_like(y, y.mean())))
