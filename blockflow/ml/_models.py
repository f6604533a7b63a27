"""Models blockflow runs on workers: their kinds, how they are serialised, and a loaded
model running one batch (:class:`LoadedModel` on a worker, :class:`LocalModel` in the process
that holds the model). Used by :mod:`blockflow.ml.inference` and :mod:`blockflow.ml.routing`.
"""

from __future__ import annotations

import io
import os
import threading
from typing import Any

import numpy as np

from blockflow.errors import describe
from blockflow.ml._pickling import dumps_or_explain

__all__ = ["LoadedModel", "LocalModel", "is_cupy", "model_kind", "serialise"]


def model_kind(model: Any) -> str:
    """``"torch"``, ``"onnx"``, ``"estimator"`` or ``"callable"`` (TypeError otherwise)."""
    mod = type(model).__module__ or ""
    if mod.startswith("torch") or any(c.__module__.startswith("torch.nn")
                                      for c in type(model).__mro__):
        return "torch"
    if mod.startswith("onnx") or isinstance(model, (bytes, bytearray)) or (
            isinstance(model, (str, os.PathLike)) and str(model).endswith(".onnx")):
        return "onnx"
    if any(hasattr(model, m) for m in ("predict", "predict_proba", "transform")):
        return "estimator"
    if callable(model):
        return "callable"
    raise TypeError(
        f"blockflow.predict: cannot run a {describe(model)} as a model; pass a PyTorch "
        f"nn.Module, an ONNX model (onnx.ModelProto, its bytes or a .onnx path), an estimator "
        f"with predict/predict_proba/transform, or a callable f(batch) -> array."
    )


def serialise(model: Any, kind: str, entry: str = "blockflow.predict") -> bytes:
    if kind == "onnx":
        if isinstance(model, (bytes, bytearray)):
            return bytes(model)
        if isinstance(model, (str, os.PathLike)):
            with open(model, "rb") as f:
                return f.read()
        return model.SerializeToString()
    if kind == "torch":
        return dumps_or_explain(model, entry, dumps=_torch_dumps)
    return dumps_or_explain(model, entry)


def _torch_dumps(model) -> bytes:
    # torch.save's zip format, pickled by cloudpickle (as distributed pickles): a lambda
    # attribute ships by value here as it does in DataParallelTrainer's scatter
    import cloudpickle
    import torch

    buf = io.BytesIO()
    torch.save(model, buf, pickle_module=cloudpickle)
    return buf.getvalue()


class LoadedModel:
    """A model deserialised on a worker, ready to run batches (``__call__(batch)``)."""

    def __init__(self, payload: bytes, kind: str, method: str | None):
        self.kind, self.method, self.device = kind, method, None
        if kind == "torch":
            import torch

            model = torch.load(io.BytesIO(payload), weights_only=False)
            if torch.cuda.is_available():  # a GPU worker: run there
                self.device = "cuda"
                model = model.to("cuda")
            self.model = model.eval()
            params = list(model.parameters())
            self.dtype = params[0].dtype if params else torch.float32
        elif kind == "onnx":
            import onnxruntime as ort

            providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider")
                         if p in ort.get_available_providers()]
            self.model = ort.InferenceSession(payload, providers=providers)
            inp = self.model.get_inputs()[0]
            self.input_name = inp.name
            self.dtype = _ONNX_TYPES.get(inp.type, np.float32)
        else:
            from distributed.protocol.pickle import loads

            self.model = loads(payload)
            self.dtype = None
        self.nbytes = len(payload)
        self.lock = threading.Lock()  # one batch at a time per worker: the device is shared

    def __call__(self, batch):
        if self.kind == "torch":
            import torch

            with torch.no_grad():
                xt = torch.as_tensor(batch).to(dtype=self.dtype, device=self.device or "cpu")
                out = self.model(xt)
            if is_cupy(batch):
                import cupy

                return cupy.asarray(out)
            return out.detach().cpu().numpy()
        if self.kind == "onnx":
            host = batch.get() if is_cupy(batch) else batch
            return self.model.run(None, {self.input_name: np.asarray(host, dtype=self.dtype)})[0]
        if self.kind == "estimator":
            return getattr(self.model, self.method)(batch)
        return self.model(batch)


_ONNX_TYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64,
               "tensor(int64)": np.int64, "tensor(int32)": np.int32,
               "tensor(float16)": np.float16}


def is_cupy(x) -> bool:
    return type(x).__module__.startswith("cupy")


class LocalModel(LoadedModel):
    def __init__(self, model, kind, method):  # noqa: D107  (no (de)serialisation locally)
        self.kind, self.method, self.device, self.nbytes = kind, method, None, 0
        self.lock = threading.Lock()
        if kind == "onnx":
            LoadedModel.__init__(self, serialise(model, kind), kind, method)
        elif kind == "torch":
            import copy

            self.model = copy.deepcopy(model).eval()  # never switch the user's model's mode
            params = list(model.parameters())
            import torch

            self.dtype = params[0].dtype if params else torch.float32
            self.device = params[0].device.type if params else None
        else:
            self.model, self.dtype = model, None
