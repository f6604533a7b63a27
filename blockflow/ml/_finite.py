"""Non-finite inputs: the check (or the drop) run by the task that first reads a block.

:class:`FiniteCheck` refuses a NaN or an infinity (as scikit-learn does) inside the task that
makes each block resident, or with ``drop_nonfinite=True`` (``blockflow.ml.drop-nonfinite``)
drops those rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockflow import config
from blockflow._distributed import quiet_task_failures
from blockflow.backends import array_module as _xp
from blockflow.errors import NonFiniteError

__all__ = ["FiniteCheck", "column_names", "drop_setting"]


def drop_setting(value: bool | None) -> bool:
    """``value``, or the setting ``blockflow.ml.drop-nonfinite`` where it is None."""
    return bool(config.get("ml.drop-nonfinite", value))


def column_names(X) -> tuple | None:
    """A dataframe's column names (for messages); None for arrays."""
    cols = getattr(X, "columns", None)
    return None if cols is None else tuple(cols)


def _scalar(v) -> str:
    v = v.item() if hasattr(v, "item") else v
    return repr(v) if isinstance(v, complex) else str(float(v))


def _bad_rows(a):
    """Boolean mask of the rows of ``a`` holding a non-finite value; None if none."""
    if a.dtype.kind not in "fc":
        return None  # integers and booleans: no NaN, nothing to look at
    xp = _xp(a)
    ok = xp.isfinite(a)
    if a.ndim > 1:
        ok = ok.reshape(len(a), -1).all(axis=1)
    if bool(ok.all()):
        return None
    return ~ok


def _first(mask) -> int:
    return int(_xp(mask).argmax(mask))


@dataclass(frozen=True)
class FiniteCheck:
    """What the task that first reads a block does with non-finite values.

    Parameters
    ----------
    drop : bool, default False
        Drop the rows holding a non-finite value (in ``X`` or ``y``) instead of raising.
    columns : tuple, optional
        ``X``'s column names (a dataframe's), named in the message beside the position.
    """

    drop: bool = False
    columns: tuple | None = None

    def __call__(self, x, y, block: int, offset: int):
        """``(x, y)`` of block ``block``, its non-finite rows dropped, or a
        :class:`~blockflow.errors.NonFiniteError` naming the first one."""
        bx, by = _bad_rows(x), None if y is None else _bad_rows(y)
        if bx is None and by is None:
            return x, y
        if self.drop:
            bad = bx if by is None else by if bx is None else bx | by
            keep = ~bad
            return x[keep], None if y is None else y[keep]
        rx = None if bx is None else _first(bx)
        ry = None if by is None else _first(by)
        if rx is not None and (ry is None or rx <= ry):
            row = x[rx].reshape(-1)
            col = _first(~_xp(row).isfinite(row))
            name = (f"{self.columns[col]!r} ({col})" if self.columns is not None
                    and col < len(self.columns) else str(col))
            what = f"X has a non-finite value ({_scalar(row[col])}) in column {name}, " \
                   f"row {offset + rx}"
        else:
            row = y[ry].reshape(-1)
            col = _first(~_xp(row).isfinite(row))
            where = f"column {col}, " if y.ndim > 1 else ""
            what = f"y has a non-finite label ({_scalar(row[col])}) in {where}row " \
                   f"{offset + ry}"
        quiet_task_failures(NonFiniteError)  # the caller hears it; no worker log of it
        raise NonFiniteError(f"blockflow: {what} (block {block}): drop or impute such rows, or "
                         f"pass drop_nonfinite=True (setting blockflow.ml.drop-nonfinite) to "
                         f"leave them out.")
