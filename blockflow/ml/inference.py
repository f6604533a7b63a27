"""Batch inference: apply a trained model to every block of a Dask collection.

:func:`predict` ships the model **once per worker** and keeps it there: the model's bytes
travel inside a small worker plugin (:class:`ModelCache`, ``distributed``'s own way to give
every worker, including workers that join later, the same object), and each task carries only
a :class:`ModelRef` (the model's token). A plain ``map_blocks(model.predict)`` puts the model
into every task instead, so its bytes cross the network once per block.

Inside a task the block is cut into batches that fit the worker's free device memory (the
GPU metrics the worker reports; host memory on a CPU worker), the model runs on each batch,
and the outputs are concatenated, so the result has the input's row chunks.

A worker holds one copy of a model (its bytes until it is loaded, then the loaded model);
:meth:`ModelRef.close` frees it everywhere, and ``blockflow.inference.cache-bytes`` bounds what
each worker keeps of models nobody closes (least recently used evicted first; see
:func:`cache_state`). Blocks with no rows return empty outputs without calling the model.

Models: a PyTorch ``nn.Module`` (run under ``torch.no_grad()``, moved to the worker's GPU when
it has one), an ONNX model (``onnx.ModelProto``, its serialised bytes, or a path; run by
``onnxruntime``), a scikit-learn style estimator (``predict``/``predict_proba``/``transform``)
or any callable ``f(batch) -> array``; a :class:`ModelFactory` builds any of them on each worker
(for a model that cannot be pickled). PyTorch, ONNX Runtime and scikit-learn are imported only
when such a model is used.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import dask.array as da
import numpy as np
import pandas as pd
from dask.base import tokenize
from dask.utils import is_dataframe_like, parse_bytes
from distributed.diagnostics.plugin import WorkerPlugin

from blockflow import _distributed, config
from blockflow.core.speculation import cancelled
from blockflow.errors import describe
from blockflow.ml._models import (LoadedModel, LocalModel, ModelFactory, is_cupy, model_kind,
                                  serialise)
from blockflow.ml._pickling import dumps_or_explain
from blockflow.scheduling.view import memory_of
from blockflow._distributed.metrics import GPU_MEMORY_TOTAL, GPU_MEMORY_USED

__all__ = ["ModelCache", "ModelFactory", "ModelRef", "batch_rows", "cache_bound", "cache_state", "model_stats",
           "predict", "ship_model"]

#: Prefix of the worker plugins that carry models (``blockflow-model-<token>``).
PLUGIN_PREFIX = "blockflow-model-"

#: Device bytes assumed per byte of a batch's input and output rows: a model's activations
#: take a few times its input (blockflow heuristic, generous for MLPs and linear models).
ACTIVATION_FACTOR = 4

# --- shipping once per worker -----------------------------------------------------------


@dataclass
class _Stats:
    loads: int = 0
    bytes_received: int = 0
    blocks: int = 0
    batches: int = 0
    rows: int = 0
    max_batch_rows: int = 0
    batch_budget: int | None = None  # bytes, the last block's
    evictions: int = 0


def cache_bound() -> int | None:
    """Bytes of models a worker keeps (``blockflow.inference.cache-bytes``), None: no bound."""
    bound = config.get("inference.cache-bytes")
    return None if bound is None else parse_bytes(bound)


class _WorkerModels:
    """One worker's models, least recently used first, within :func:`cache_bound` bytes."""

    def __init__(self):
        self.order: OrderedDict[str, ModelCache] = OrderedDict()
        self.lock = threading.Lock()

    def touch(self, plugin: ModelCache) -> None:
        with self.lock:
            self.order[plugin.token] = plugin
            self.order.move_to_end(plugin.token)
            bound = cache_bound()
            if bound is None:
                return
            total = sum(p.held_bytes for p in self.order.values())
            for p in list(self.order.values()):
                if total <= bound:
                    break
                # never the model just used, nor one loading right now
                if p is plugin or p.held_bytes == 0 or p._lock.locked():
                    continue
                total -= p.held_bytes
                p.evict()

    def remove(self, plugin: ModelCache) -> None:
        with self.lock:
            if self.order.get(plugin.token) is plugin:
                del self.order[plugin.token]


#: Worker address -> its models (several in-process workers may share this process).
_WORKER_MODELS: dict[str, _WorkerModels] = {}
_WORKER_MODELS_LOCK = threading.Lock()


def _models_of(address: str) -> _WorkerModels:
    with _WORKER_MODELS_LOCK:
        return _WORKER_MODELS.setdefault(address, _WorkerModels())


class ModelCache(WorkerPlugin):
    """Worker plugin that carries one model's bytes to every worker and keeps it loaded.

    Registered by :func:`ship_model` (so by :func:`predict` and :class:`blockflow.Router`)
    under ``blockflow-model-<token>``; the scheduler hands it to workers that join later too.
    The model is deserialised once per worker, at its first batch, and reused by every task.
    A worker holds **one copy**: the serialised bytes until the model is loaded, then the
    loaded model alone. Each worker keeps at most ``blockflow.inference.cache-bytes`` of
    models: past it, the least recently used ones are evicted, and fetched again from the
    scheduler if a later task needs them. :meth:`ModelRef.close` removes the model from
    every worker and the scheduler. :func:`cache_state` shows what each worker holds.

    Parameters
    ----------
    token : str
        ``dask.base.tokenize`` of the model and method.
    payload : bytes
        The serialised model (``torch.save`` for PyTorch, the ONNX protobuf, else pickle).
    kind : str
        ``"torch"``, ``"onnx"``, ``"estimator"`` or ``"callable"``.
    method : str or None
        The estimator's method (``"predict"``, ``"predict_proba"``, ``"transform"``).
    """

    idempotent = True  # registering the same model again sends nothing

    def __init__(self, token: str, payload: bytes, kind: str, method: str | None,
                 factory: bool = False):
        self.token, self.payload, self.kind, self.method = token, payload, kind, method
        self.factory = factory
        self.name = PLUGIN_PREFIX + token
        self._loaded = None
        self._lock = threading.Lock()
        self._models: _WorkerModels | None = None
        self.stats = _Stats()

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items()
                if k not in ("_loaded", "_lock", "_models")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._loaded, self._lock, self._models = None, threading.Lock(), None

    def setup(self, worker) -> None:
        self.stats = _Stats(bytes_received=len(self.payload or b""))
        self._models = _models_of(worker.address)
        self._models.touch(self)  # the bytes count against the bound from now on

    def teardown(self, worker) -> None:
        if self._models is not None:
            self._models.remove(self)
        self._loaded = self.payload = None

    @property
    def serialised_bytes(self) -> int:
        """Bytes of the serialised model this worker holds (0 once it is loaded)."""
        payload = self.payload
        return len(payload) if payload is not None else 0

    @property
    def held_bytes(self) -> int:
        """Bytes this worker holds for the model: its serialised bytes, plus the loaded
        model's (counted as its serialised size, or its tensors' for a factory's); 0 once
        evicted."""
        loaded = self._loaded
        return self.serialised_bytes + (loaded.nbytes if loaded is not None else 0)

    @property
    def state(self) -> str:
        """``"bytes"`` (arrived, not loaded), ``"loaded"`` (the loaded model alone),
        ``"evicted"`` (neither), or ``"bytes+loaded"`` (both: never once a load is done)."""
        loaded, payload = self._loaded is not None, self.payload is not None
        if loaded and payload:
            return "bytes+loaded"
        return "loaded" if loaded else "bytes" if payload else "evicted"

    def evict(self) -> None:
        """Drop the model from this worker (a later task fetches it again)."""
        self._loaded = self.payload = None
        self.stats.evictions += 1

    def model(self) -> LoadedModel:
        with self._lock:
            loaded = self._loaded
            if loaded is None:
                payload = self.payload
                if payload is None:  # evicted: the scheduler keeps the registered plugin
                    payload = self._fetch_again()
                loaded = self._loaded = LoadedModel(payload, self.kind, self.method,
                                                    self.factory)
                self.payload = payload = None  # one copy per worker: the loaded model
                self.stats.loads += 1
        if self._models is not None:
            self._models.touch(self)
        return loaded

    def _fetch_again(self) -> bytes:
        from distributed.protocol.pickle import loads

        data = _distributed.registered_worker_plugin(_current_worker(), self.name)
        if data is None:
            raise RuntimeError(
                f"blockflow: model {self.token[:12]} was closed (ModelRef.close) while tasks "
                f"still used it; close it after their results are computed.")
        payload = (loads(data) if isinstance(data, bytes) else data).payload
        self.stats.bytes_received += len(payload)
        return payload


#: (id(client), token) -> open ModelRefs: the model leaves the workers when the last closes.
_OPEN_REFS: Counter = Counter()
_OPEN_LOCK = threading.Lock()


class ModelRef:
    """What a task carries instead of the model: its token (and, in the process that made
    it, the model itself, never pickled), resolved to the worker's :class:`ModelCache`.

    In the process that shipped it, the reference is also the handle that frees the model:
    :meth:`close` (or ``with ship_model(model) as ref:``) removes it from every worker and
    from the scheduler once no other open reference to the same model remains.
    """

    def __init__(self, token: str, kind: str, method: str | None, local: Any = None,
                 client=None, built: bool = False):
        self.token, self.kind, self.method = token, kind, method
        self._local = local
        self._client = client
        self._built = built  # the local model was built by a ModelFactory: ours to change
        self.closed = False

    def __reduce__(self):
        return ModelRef, (self.token, self.kind, self.method)

    def __repr__(self) -> str:
        return f"<blockflow ModelRef {self.kind} {self.token[:12]}>"

    def __enter__(self) -> ModelRef:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Free the model: unregister its :class:`ModelCache` from the cluster (its workers
        drop it at once, the scheduler forgets it) when this is the last open reference to
        it from this client. Compute the results that use it first. Idempotent."""
        if self.closed:
            return
        self.closed = True
        client, self._local = self._client, None
        self.__dict__.pop("_local_loaded", None)
        if client is None:
            return
        key = (id(client), self.token)
        with _OPEN_LOCK:
            _OPEN_REFS[key] -= 1
            last = _OPEN_REFS[key] <= 0
            if last:
                del _OPEN_REFS[key]
        if last and client.status == "running":
            try:
                client.unregister_worker_plugin(PLUGIN_PREFIX + self.token)
            except ValueError:  # already gone (the cluster was restarted)
                pass

    def local_model(self) -> LocalModel:
        """The model of the process that shipped it, ready to run a batch."""
        return LocalModel(self._local, self.kind, self.method, owned=self._built)

    def resolve(self) -> tuple[LoadedModel, _Stats | None]:
        worker = _current_worker()
        if worker is not None:
            plugin = _distributed.worker_plugins(worker).get(PLUGIN_PREFIX + self.token)
            if plugin is not None:
                return plugin.model(), plugin.stats
        if self._local is not None:  # the local schedulers: same process, no shipping
            loaded = getattr(self, "_local_loaded", None)
            if loaded is None:
                loaded = self._local_loaded = self.local_model()
            return loaded, None
        raise RuntimeError(
            f"blockflow: worker has no model {self.token[:12]} (its ModelCache plugin is "
            f"missing, or the model was closed); call blockflow.predict with the Client of "
            f"this cluster as client=, and close the ModelRef only after its results are "
            f"computed."
        )


def _current_worker():
    try:
        from distributed import get_worker

        return get_worker()
    except ValueError:
        return None


def _default_client():
    try:
        from distributed import default_client

        return default_client()
    except ValueError:
        return None


def ship_model(model: Any, *, method: str | None = None, client=None,
               entry: str = "blockflow.predict") -> ModelRef:
    """Send ``model`` to every worker once (a :class:`ModelCache` plugin) and return the
    reference tasks carry. Without a distributed client the reference holds the model.

    Parameters
    ----------
    model : nn.Module, ONNX model, estimator or callable
    method : str, optional
        Estimators: the method to call, default ``"predict"``.
    client : distributed.Client or False, optional
        Default: the current client, if any; False: ship nothing (Dask's local schedulers).
    entry : str, default "blockflow.predict"
        The entry point named in error messages.

    Returns
    -------
    ModelRef
        Also the handle that frees the model on the cluster: ``ref.close()``, or use it as a
        context manager (``with ship_model(model) as ref: blockflow.predict(ref, x)...``).

    Raises
    ------
    TypeError
        If the model cannot be pickled (naming the attribute that cannot, e.g.
        ``model.transform_.fn``), before anything is sent.
    """
    return _ship(model, method, client, entry, handle=True)


def _ship(model, method, client, entry, *, handle: bool) -> ModelRef:
    """ship_model's work; ``handle``: the reference can close the model (predict's own
    reference, never handed out, cannot: the cache bound frees what it leaves)."""
    factory = isinstance(model, ModelFactory)
    if factory:  # built here once: its kind and (in predict) the output's meta
        factory, model = model, model()
    kind = model_kind(model)
    method = (method or "predict") if kind == "estimator" else None
    if kind == "estimator" and not callable(getattr(model, method, None)):
        raise TypeError(f"blockflow.predict: the {describe(model)} has no method {method!r}; "
                        f"pass method='predict', 'predict_proba' or 'transform'.")
    payload = (dumps_or_explain(factory, entry, root="factory") if factory
               else serialise(model, kind, entry))
    token = tokenize(payload, kind, method)
    client = _default_client() if client is None else client
    if client is False or client is None:
        return ModelRef(token, kind, method, local=model, built=bool(factory))
    if handle:
        with _OPEN_LOCK:
            _OPEN_REFS[(id(client), token)] += 1
    client.register_plugin(ModelCache(token, payload, kind, method, factory=bool(factory)))
    return ModelRef(token, kind, method, local=model, client=client if handle else None,
                    built=bool(factory))


def model_stats(client, ref: ModelRef | str) -> dict[str, dict[str, Any]]:
    """Per worker: how often the model arrived and was loaded, and what ran with it.

    Parameters
    ----------
    client : distributed.Client
    ref : ModelRef or str
        From :func:`ship_model`, or the token; ``predict(...).attrs``-free: use
        :func:`ship_model` and pass ``model=ref`` to :func:`predict` to keep the reference.

    Returns
    -------
    dict
        Worker address -> ``bytes_received`` (bytes of the model that reached the worker),
        ``loads`` (times deserialised), ``evictions`` (times dropped by the cache bound),
        ``blocks``, ``batches``, ``rows`` (non-empty blocks run and their batches and rows),
        ``max_batch_rows``, ``batch_budget`` (bytes), ``state`` and ``held_bytes`` (as in
        :func:`cache_state`). Workers without the model are absent.
    """
    token = ref.token if isinstance(ref, ModelRef) else str(ref)
    return {a: s for a, s in client.run(_worker_stats, token).items() if s is not None}


def _worker_stats(token: str, dask_worker=None):
    plugin = _distributed.worker_plugins(dask_worker).get(PLUGIN_PREFIX + token)
    if plugin is None:
        return None
    return {**plugin.stats.__dict__, "state": plugin.state, "held_bytes": plugin.held_bytes}


def cache_state(client) -> dict[str, dict[str, Any]]:
    """What each worker holds of the models shipped to it (the worker-side model cache).

    Parameters
    ----------
    client : distributed.Client

    Returns
    -------
    dict
        Worker address -> ``bound`` (``blockflow.inference.cache-bytes`` there, bytes or
        None), ``held_bytes`` (all its models), ``models``: token -> ``state`` (``"bytes"``:
        the serialised model arrived, not loaded yet; ``"loaded"``: the loaded model alone,
        its bytes dropped; ``"evicted"``: neither, fetched again when next used;
        ``"bytes+loaded"``: both, which blockflow never leaves), ``held_bytes`` (all it
        holds for the model), ``serialised_bytes`` (of that, the serialised model's) and
        ``kind``, least recently used first.
    """
    return client.run(_worker_cache_state)


def _worker_cache_state(dask_worker=None) -> dict[str, Any]:
    plugins = {name[len(PLUGIN_PREFIX):]: p
               for name, p in _distributed.worker_plugins(dask_worker).items()
               if name.startswith(PLUGIN_PREFIX)}
    models = _models_of(dask_worker.address)
    with models.lock:
        order = [t for t in models.order if t in plugins]
    order += [t for t in plugins if t not in order]
    out = {t: {"state": plugins[t].state, "held_bytes": plugins[t].held_bytes,
               "serialised_bytes": plugins[t].serialised_bytes, "kind": plugins[t].kind}
           for t in order}
    return {"bound": cache_bound(), "models": out,
            "held_bytes": sum(m["held_bytes"] for m in out.values())}


# --- batches sized to free device memory ------------------------------------------------


def free_memory() -> int | None:
    """Free device memory of this worker, bytes: its reported GPU metrics (NVML or a
    simulated device); None where it reports none (a CPU worker)."""
    worker = _current_worker()
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
        Free device memory, bytes (default :func:`free_memory`; host memory available on a
        CPU worker).
    model_bytes : int, default 0
        The loaded model's bytes, taken from the budget.

    Returns
    -------
    (rows, budget)
        Rows per batch (>= 1) and the byte budget used (None for an explicit batch size).

    Notes
    -----
    A batch's working set is ``ACTIVATION_FACTOR x rows x row_bytes`` (blockflow heuristic).
    """
    batch_size = config.get("inference.batch-size", batch_size)
    if batch_size is not None:
        return max(1, min(int(batch_size), max(n_rows, 1))), None
    fraction = float(config.get("inference.memory-fraction", memory_fraction))
    if free is None:
        free = free_memory()
    if free is None:
        import psutil

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
            return _squeeze(outs[0])
        xp = _module(outs[0])
        return _squeeze(xp.concatenate(outs, axis=0))


def _squeeze(out):
    # (n, 1) from a single-output regressor: keep it (n, 1) only if declared so; estimators
    # return (n,), torch/onnx models (n, k). The declared shape is checked by map_blocks.
    return out


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
        The trained model (see the module docstring), a :class:`ModelFactory` that builds it
        on each worker, or a :class:`ModelRef` from :func:`ship_model` (which can free it:
        ``ref.close()``). It is sent once per worker and cached there, never put into the
        task graph.
    data : dask.array.Array, dask DataFrame or xarray.DataArray
        Rows are samples: a 2-d array ``(samples, features)`` (axis 1 is rechunked to one
        block if needed), a dataframe (``columns`` selects the features, default all), or a
        2-d dask-backed DataArray whose first dimension is the sample dimension.
    method : str, optional
        Estimators: ``"predict"`` (default), ``"predict_proba"``, ``"transform"``...
    columns : list of str, optional
        Dataframes: the feature columns, in the model's order.
    batch_size : int, optional
        Rows per model call; default config ``blockflow.inference.batch-size`` (null: sized
        from free device memory, see :func:`batch_rows`).
    memory_fraction : float, optional
        Fraction (0-1) of free device memory one batch may take; default config
        ``blockflow.inference.memory-fraction``.
    output_name : str, default "prediction"
        Dataframes: name of the output Series (columns ``<name>_0``.. for several outputs);
        xarray: the name of the DataArray.
    client : distributed.Client or False, optional
        The cluster to ship the model to; default the current client. None found, or
        False: the model stays in this process, for Dask's local schedulers.
    **placement
        ``resources=``, ``workers=``, ``allow_other_workers=``, ``retries=``: as in
        :func:`blockflow.map_blocks`.

    Returns
    -------
    dask.array.Array, dask Series/DataFrame or xarray.DataArray
        Same row chunks (partitions) as ``data``: shape ``(samples,)`` for one output per
        row, ``(samples, k)`` otherwise; dtype and meta from running the model on two rows
        of zeros here. A block with no rows gives an empty output of that dtype and shape
        (columns for a dataframe), without calling the model.

    Raises
    ------
    TypeError
        For an unsupported model or collection, or a model that cannot be pickled (the
        message names the attribute, e.g. ``model.transform_.fn``), before anything runs.
    ValueError
        For an array that is not 2-d or has unknown chunk sizes, or a closed ModelRef.
    """
    from blockflow.blockwise import map_blocks

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
        x0 = np.zeros((2, len(cols)), dtype=np.result_type(*sample.dtypes))
        out0 = np.asarray(ref.local_model()(x0))
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
    x0 = np.zeros((2, n_features), dtype=dtype)
    return np.asarray(ref.local_model()(x0))


def _predict_array(ref, x, batch_size, memory_fraction, placement):
    from blockflow.blockwise import map_blocks, validate_array

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
