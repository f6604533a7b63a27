"""Models shipped once per worker: the worker-side cache and the references tasks carry.

A model's bytes travel inside a worker plugin (:class:`ModelCache`); each task carries only
a :class:`ModelRef`. :meth:`ModelRef.close` frees a model everywhere, and
``blockflow.inference.cache-bytes`` bounds what each worker keeps (least recently used
evicted first). Guide: docs/guide/ai.md.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from dask.base import tokenize
from dask.utils import parse_bytes
from distributed import default_client
from distributed.diagnostics.plugin import WorkerPlugin

from blockflow import _distributed, config
from blockflow.errors import describe
from blockflow.ml._models import LoadedModel, LocalModel, ModelFactory, model_kind, serialise
from blockflow.ml._pickling import dumps_or_explain
from blockflow.scheduling.wait import add_worker_plugin, remove_worker_plugin, run_each

__all__ = ["ModelCache", "ModelRef", "cache_bound", "cache_state", "model_stats",
           "ship_model"]

#: Prefix of the worker plugins that carry models (``blockflow-model-<token>``).
PLUGIN_PREFIX = "blockflow-model-"


@dataclass
class _Stats:
    """What one worker did with one model (see :func:`model_stats`)."""

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

    Registered by :func:`ship_model` under ``blockflow-model-<token>``; the model is
    deserialised once per worker and evicted least recently used past
    ``blockflow.inference.cache-bytes``. ``payload`` is the serialised model
    (:func:`~blockflow.ml._models.serialise`) or a pickled
    :class:`~blockflow.ml._models.ModelFactory`.
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
        """Bytes this worker holds for the model (serialised plus loaded); 0 once evicted."""
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
        """The loaded model, deserialised at the first call (RuntimeError if closed)."""
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
        data = _distributed.registered_worker_plugin(_distributed.current_worker(), self.name)
        if data is None:
            raise RuntimeError(
                f"blockflow: model {self.token[:12]} was closed (ModelRef.close) while tasks "
                f"still used it; close it after their results are computed.")
        payload = (_distributed.unpickle(data) if isinstance(data, bytes) else data).payload
        self.stats.bytes_received += len(payload)
        return payload


#: (id(client), token) -> open ModelRefs: the model leaves the workers when the last closes.
_OPEN_REFS: Counter = Counter()
_OPEN_LOCK = threading.Lock()


class ModelRef:
    """What a task carries instead of the model: its token, resolved to the worker's
    :class:`ModelCache`; in the shipping process also the handle that frees the model
    (:meth:`close`, or ``with ship_model(model) as ref:``).
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
        """Free the model on the cluster when this is the last open reference to it.
        Idempotent."""
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
                remove_worker_plugin(client, PLUGIN_PREFIX + self.token,
                                     what="releasing a model from the workers")
            except ValueError:  # already gone (the cluster was restarted)
                pass

    def local_model(self) -> LocalModel:
        """The model of the process that shipped it, ready to run a batch."""
        return LocalModel(self._local, self.kind, self.method, owned=self._built)

    def resolve(self) -> tuple[LoadedModel, _Stats | None]:
        """The model this task runs and this worker's stats for it.

        Raises
        ------
        RuntimeError
            If the worker has no such model (not shipped to this cluster, or closed).
        """
        worker = _distributed.current_worker()
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


def _default_client():
    try:
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
        Also the handle that frees the model: ``ref.close()`` or ``with``.

    Raises
    ------
    TypeError
        If the model cannot be pickled (naming the attribute), before anything is sent.
    """
    return _ship(model, method, client, entry, handle=True)


def _ship(model, method, client, entry, *, handle: bool) -> ModelRef:
    """ship_model's work; ``handle``: the reference can close the model."""
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
    add_worker_plugin(client, ModelCache(token, payload, kind, method, factory=bool(factory)),
                      what="shipping a model to the workers")
    return ModelRef(token, kind, method, local=model, client=client if handle else None,
                    built=bool(factory))


def model_stats(client, ref: ModelRef | str) -> dict[str, dict[str, Any]]:
    """Per worker: how often the model arrived and was loaded, and what ran with it.

    Parameters
    ----------
    client : distributed.Client
    ref : ModelRef or str
        From :func:`ship_model`, or its token.

    Returns
    -------
    dict
        Worker address -> ``bytes_received``, ``loads``, ``evictions``, ``blocks``,
        ``batches``, ``rows``, ``max_batch_rows``, ``batch_budget`` (bytes), ``state`` and
        ``held_bytes``. Workers without the model are absent.
    """
    token = ref.token if isinstance(ref, ModelRef) else str(ref)
    return {a: s for a, s in run_each(client, _worker_stats, token,
                                      what="the model cache's counters").items()
            if isinstance(s, dict)}


def _worker_stats(token: str, dask_worker=None):
    plugin = _distributed.worker_plugins(dask_worker).get(PLUGIN_PREFIX + token)
    if plugin is None:
        return None
    return {**plugin.stats.__dict__, "state": plugin.state, "held_bytes": plugin.held_bytes}


def cache_state(client) -> dict[str, dict[str, Any]]:
    """What each worker holds of the models shipped to it (``client``'s workers).

    Returns
    -------
    dict
        Worker address -> ``bound`` (bytes or None), ``held_bytes``, ``models``: token ->
        ``state`` (``"bytes"``, ``"loaded"``, ``"evicted"``, ``"bytes+loaded"``),
        ``held_bytes``, ``serialised_bytes`` and ``kind``, least recently used first.
    """
    return {a: s for a, s in run_each(client, _worker_cache_state,
                                      what="the model cache's state").items()
            if isinstance(s, dict)}


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
