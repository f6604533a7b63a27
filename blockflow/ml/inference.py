"""Batch inference: apply a trained model to every block of a Dask collection.

:func:`predict` ships the model once per worker (:mod:`blockflow.ml.model_cache`) and cuts
each block into batches that fit the worker's free device memory. Models: a PyTorch
``nn.Module``, an ONNX model, a scikit-learn style estimator, any callable
``f(batch) -> array``, or a :class:`ModelFactory`. Guide: docs/guide/ai.md.
"""

from __future__ import annotations

from typing import Any

import dask.array as da
import numpy as np
import pandas as pd
import psutil
from dask.utils import is_dataframe_like

from blockflow import _distributed, config
from blockflow._distributed.metrics import GPU_MEMORY_TOTAL, GPU_MEMORY_USED
from blockflow.blockwise import map_blocks, validate_array
from blockflow.scheduling.speculation import cancelled
from blockflow.errors import describe
from blockflow.ml._models import ModelFactory, is_cupy
from blockflow.ml.model_cache import (ModelCache, ModelRef, _ship, cache_bound, cache_state,
                                      model_stats, ship_model)
from blockflow.scheduling.view import memory_of

__all__ = ["ModelCache", "ModelFactory", "ModelRef", "batch_rows", "cache_bound",
           "cache_state", "model_stats", "predict", "ship_model"]

#: Device bytes assumed per byte of a batch's input and output rows: a model's activations
#: take a few times its input (blockflow heuristic, generous for MLPs and linear models).
ACTIVATION_FACTOR = 4


def free_memory() -> int | None:
    """Free device memory of this worker, bytes; None on a CPU worker."""
    worker = _distributed.current_worker()
    if worker is None:
        return None
    used_fn = _distributed.worker_metric(worker, GPU_MEMORY_USED)
    total_fn = _distributed.worker_metric(worker, GPU_MEMORY_TOTAL)
    if used_fn is None or total_fn is None:
        return None
    try:
        metrics = {GPU_MEMORY_USED: used_fn(worker), GPU_MEMORY_TOTAL: total_fn(worker)}
    except Exception:  # a metric that fails to read means "unknown", never zero
        return None
    free = memory_of({"metrics": metrics}).device_free
    return None if free is None else int(free)


def batch_rows(n_rows: int, row_bytes: int, *, batch_size: int | None = None,
               memory_fraction: float | None = None, free: int | None = None,
               model_bytes: int = 0) -> tuple[int, int | None]:
    """Rows per batch so that a batch's working set fits free device memory.

    Parameters
    ----------
    n_rows : int
        Rows in the block.
    row_bytes : int
        Input plus output bytes of one row.
    batch_size : int, optional
        Explicit rows per batch (wins). Default: config ``blockflow.inference.batch-size``.
    memory_fraction : float, optional
        Fraction (0-1) of free device memory a batch may take; default config
        ``blockflow.inference.memory-fraction``.
    free : int, optional
        Free device memory, bytes; default :func:`free_memory`.
    model_bytes : int, default 0
        The loaded model's bytes, taken from the budget.

    Returns
    -------
    (rows, budget)
        Rows per batch (>= 1) and the byte budget (None for an explicit batch size); a
        batch takes ``ACTIVATION_FACTOR x rows x row_bytes`` (blockflow heuristic).
    """
    batch_size = config.get("inference.batch-size", batch_size)
    if batch_size is not None:
        return max(1, min(int(batch_size), max(n_rows, 1))), None
    fraction = float(config.get("inference.memory-fraction", memory_fraction))
    if free is None:
        free = free_memory()
    if free is None:
        free = int(psutil.virtual_memory().available)
    budget = max(int((free - model_bytes) * fraction), 0)
    rows = budget // max(ACTIVATION_FACTOR * row_bytes, 1)
    return max(1, min(int(rows), max(n_rows, 1))), budget


class _Predictor:
    """The per-block kernel: cut the block into batches, run the model, concatenate."""

    def __init__(self, ref: ModelRef, out0, batch_size: int | None,
                 memory_fraction: float | None, columns=None, output=None):
        # out0: the model's output on two rows of zeros (the meta's probe): its dtype and
        # trailing shape are those of an empty block's output
        self.ref, self.out_dtype, self.out_tail = ref, out0.dtype, out0.shape[1:]
        self.out_row_bytes = out0.dtype.itemsize * int(np.prod(out0.shape[1:], dtype=int))
        self.batch_size, self.memory_fraction = batch_size, memory_fraction
        self.columns, self.output = columns, output  # dataframes: features in, names out
        self.__name__ = "predict"

    def __call__(self, block):
        if self.columns is not None:  # a partition: features to an array, output to a frame
            index = block.index
            x = _frame_values(block[self.columns] if self.columns else block)
            return _to_frame(self.run(x), index, self.output)
        return self.run(block)

    def run(self, x):
        n = x.shape[0]
        if n == 0:  # an empty block (a filter left nothing): no model call, no model load
            return _module(x).empty((0, *self.out_tail), dtype=self.out_dtype)
        loaded, stats = self.ref.resolve()
        row_bytes = int(x.dtype.itemsize * int(np.prod(x.shape[1:], dtype=int))
                        + self.out_row_bytes)
        rows, budget = batch_rows(n, row_bytes, batch_size=self.batch_size,
                                  memory_fraction=self.memory_fraction,
                                  model_bytes=loaded.nbytes)
        outs = []
        with loaded.lock:
            for start in range(0, n, rows):
                if cancelled():  # a backup copy of this block answered first: stop here
                    return None
                outs.append(loaded(x[start:start + rows]))
        if cancelled():  # overtaken while finishing: its result is dropped, not counted
            return None
        if stats is not None:
            stats.blocks += 1
            stats.batches += len(outs)
            stats.rows += n
            stats.max_batch_rows = max(stats.max_batch_rows, min(rows, n))
            stats.batch_budget = budget
        if len(outs) == 1:
            return outs[0]
        return _module(outs[0]).concatenate(outs, axis=0)


def _module(arr):
    if is_cupy(arr):
        import cupy

        return cupy
    return np


def _frame_values(frame):
    if type(frame).__module__.startswith("cudf"):
        return frame.to_cupy()
    return frame.to_numpy()


def _to_frame(out, index, output):
    name, columns = output
    if is_cupy(out):
        import cudf

        return (cudf.Series(out, index=index, name=name) if columns is None
                else cudf.DataFrame(out, index=index, columns=columns))
    if columns is None:
        return pd.Series(np.asarray(out).reshape(len(index)), index=index, name=name)
    return pd.DataFrame(np.asarray(out).reshape(len(index), len(columns)), index=index,
                        columns=columns)


# --- the public entry point ---------------------------------------------------------------


def predict(model: Any, data: Any, *, method: str | None = None, columns=None,
            batch_size: int | None = None, memory_fraction: float | None = None,
            output_name: str = "prediction", client=None, **placement):
    """Apply a trained model to every row of a Dask collection, lazily.

    Parameters
    ----------
    model : torch.nn.Module, ONNX model, estimator, callable, ModelFactory or ModelRef
        The trained model, a :class:`ModelFactory`, or a :class:`ModelRef`; sent once per
        worker, never put into the task graph.
    data : dask.array.Array, dask DataFrame or xarray.DataArray
        Rows are samples: a 2-d array, a dataframe (``columns`` selects features) or a
        2-d DataArray.
    method : str, optional
        Estimators: ``"predict"`` (default), ``"predict_proba"``, ``"transform"``...
    columns : list of str, optional
        Dataframes: the feature columns, in the model's order.
    batch_size : int, optional
        Rows per model call; default config ``blockflow.inference.batch-size`` (null:
        :func:`batch_rows`).
    memory_fraction : float, optional
        Fraction (0-1) of free device memory one batch may take; default config
        ``blockflow.inference.memory-fraction``.
    output_name : str, default "prediction"
        Name of the output Series (``<name>_0``.. for several) or DataArray.
    client : distributed.Client or False, optional
        Default the current client; False keeps the model in this process.
    **placement
        ``resources=``, ``workers=``, ``allow_other_workers=``, ``retries=``: as in
        :func:`blockflow.map_blocks`.

    Returns
    -------
    dask.array.Array, dask Series/DataFrame or xarray.DataArray
        Same row chunks as ``data``: shape ``(samples,)`` or ``(samples, k)``; dtype from
        running the model on two rows of zeros.

    Raises
    ------
    TypeError
        For an unsupported model or collection, or a model that cannot be pickled.
    ValueError
        For an array that is not 2-d or has unknown chunk sizes, or a closed ModelRef.
    """
    ref = model if isinstance(model, ModelRef) else _ship(
        model, method, client, "blockflow.predict", handle=False)
    local = ref._local
    if ref.closed:
        raise ValueError("blockflow.predict: this ModelRef is closed (its model left the "
                         "workers); ship the model again with ship_model(model).")
    if local is None:
        raise ValueError("blockflow.predict: this ModelRef was unpickled and no longer holds "
                         "the model; pass the model itself (it is shipped once per worker).")
    if _is_xarray(data):
        return _predict_xarray(ref, data, batch_size, memory_fraction, output_name,
                               placement)
    if is_dataframe_like(data):
        cols = list(columns) if columns is not None else list(data.columns)
        sample = data._meta[cols]
        out0 = _out_sample(ref, np.result_type(*sample.dtypes), len(cols))
        k = 1 if out0.ndim == 1 else out0.shape[1]
        out_cols = None if out0.ndim == 1 else [f"{output_name}_{i}" for i in range(k)]
        meta = (pd.Series(np.empty(0, out0.dtype), name=output_name) if out_cols is None
                else pd.DataFrame(np.empty((0, k), out0.dtype), columns=out_cols))
        meta.index = data._meta.index[:0]
        kernel = _Predictor(ref, out0, batch_size, memory_fraction,
                            columns=cols, output=(output_name, out_cols))
        return map_blocks(kernel, data, name="blockflow-predict", meta=meta, **placement)
    if isinstance(data, da.Array):
        return _predict_array(ref, data, batch_size, memory_fraction, placement)
    raise TypeError(
        f"blockflow.predict: data must be a dask array, a dask DataFrame or a dask-backed "
        f"xarray.DataArray, got {describe(data)}; wrap NumPy/pandas data with "
        f"dask.array.from_array / dask.dataframe.from_pandas."
    )


def _out_sample(ref: ModelRef, dtype, n_features: int):
    """The model's output on two rows of zeros (the meta's probe)."""
    x0 = np.zeros((2, n_features), dtype=dtype)
    return np.asarray(ref.local_model()(x0))


def _predict_array(ref, x, batch_size, memory_fraction, placement):
    if x.ndim != 2:
        raise ValueError(f"blockflow.predict: data must be 2-d (samples, features), got "
                         f"{x.ndim}-d of shape {x.shape}; reshape it first.")
    validate_array(x, "blockflow.predict", "data")  # the message names predict's data
    if x.numblocks[1] != 1:
        x = x.rechunk({1: -1})
    out0 = _out_sample(ref, x.dtype, x.shape[1])
    k = 1 if out0.ndim == 1 else out0.shape[1]
    kernel = _Predictor(ref, out0, batch_size, memory_fraction)
    xp_meta = getattr(x, "_meta", np.empty(0))
    if out0.ndim == 1:
        meta = _module(xp_meta).empty((0,), dtype=out0.dtype)
        return map_blocks(kernel, x, name="blockflow-predict", dtype=out0.dtype, meta=meta,
                          drop_axis=1, **placement)
    meta = _module(xp_meta).empty((0, 0), dtype=out0.dtype)
    return map_blocks(kernel, x, name="blockflow-predict", dtype=out0.dtype, meta=meta,
                      chunks=(x.chunks[0], (k,)), **placement)


def _is_xarray(obj) -> bool:
    return type(obj).__module__.startswith("xarray")


def _predict_xarray(ref, arr, batch_size, memory_fraction, output_name, placement):
    import xarray as xr

    if not isinstance(arr, xr.DataArray):
        raise TypeError("blockflow.predict: pass an xarray.DataArray (samples, features); for "
                        "a Dataset use ds[names].to_dataarray('feature').transpose().")
    if arr.ndim != 2 or not isinstance(arr.data, da.Array):
        raise ValueError(f"blockflow.predict: the DataArray must be 2-d (samples, features) "
                         f"and dask-backed (.chunk()), got dims {arr.dims}.")
    out = _predict_array(ref, arr.data, batch_size, memory_fraction, placement)
    sample = arr.dims[0]
    coords = {sample: arr[sample]} if sample in arr.coords else {}
    dims = (sample,) if out.ndim == 1 else (sample, "output")
    return xr.DataArray(out, dims=dims, coords=coords, name=output_name)
