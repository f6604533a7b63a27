"""Models blockflow runs on workers: their kinds, serialisation, and a loaded model running
one batch."""

from __future__ import annotations

import copy
import io
import os
import threading
import warnings
from typing import Any

import cloudpickle
import numpy as np

from blockflow import _distributed
from blockflow.errors import describe
from blockflow.ml._pickling import dumps_or_explain

__all__ = ["LoadedModel", "LocalModel", "ModelFactory", "is_cupy", "model_kind", "serialise"]


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
    """``model``'s bytes for shipping: an ONNX model's protobuf, ``torch.save`` for PyTorch,
    else cloudpickle (TypeError naming the attribute that cannot be pickled)."""
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
    import torch

    buf = io.BytesIO()
    torch.save(model, buf, pickle_module=cloudpickle)
    return buf.getvalue()


class LoadedModel:
    """A model deserialised on a worker, ready to run batches (``__call__(batch)``)."""

    def __init__(self, payload: bytes, kind: str, method: str | None, factory: bool = False):
        self.kind, self.method, self.device = kind, method, None
        self.nbytes = len(payload)
        built = _distributed.unpickle(payload)() if factory else None
        if kind == "onnx" and factory:
            payload = serialise(built, kind)
        if kind == "torch":
            import torch

            model = built if factory else torch.load(io.BytesIO(payload), weights_only=False)
            if torch.cuda.is_available():  # a GPU worker: run there
                self.device = "cuda"
                model = model.to("cuda")
            self.model = model.eval()
            params = list(model.parameters())
            self.dtype = params[0].dtype if params else torch.float32
            if factory:  # its size is that of its tensors, not of the factory's bytes
                self.nbytes = max(self.nbytes, sum(
                    t.numel() * t.element_size()
                    for t in [*model.parameters(), *model.buffers()]))
        elif kind == "onnx":
            import onnxruntime as ort

            providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider")
                         if p in ort.get_available_providers()]
            self.model = ort.InferenceSession(payload, providers=providers)
            inp = self.model.get_inputs()[0]
            self.input_name = inp.name
            self.dtype = _ONNX_TYPES.get(inp.type, np.float32)
            self.nbytes = max(self.nbytes, len(payload))
        else:
            self.model = built if factory else _distributed.unpickle(payload)
            self.dtype = None
        self.lock = threading.Lock()  # one batch at a time per worker: the device is shared

    def __call__(self, batch):
        if self.kind == "torch":
            import torch

            with torch.no_grad(), warnings.catch_warnings():
                # a read-only block (a frame's values): the model only reads it
                warnings.filterwarnings("ignore", "The given NumPy array is not writable")
                xt = torch.as_tensor(batch).to(dtype=self.dtype, device=self.device or "cpu")
                out = self.model(xt)
            if out.dtype == torch.bfloat16:  # NumPy and CuPy have no bfloat16: float32
                out = out.float()            # holds every bfloat16 value exactly
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
    """Whether ``x`` is a CuPy array (without importing CuPy)."""
    return type(x).__module__.startswith("cupy")


class LocalModel(LoadedModel):
    """The model in the process that holds it (no (de)serialisation)."""

    def __init__(self, model, kind, method, owned: bool = False):  # noqa: D107
        self.kind, self.method, self.device, self.nbytes = kind, method, None, 0
        self.lock = threading.Lock()
        if kind == "onnx":
            LoadedModel.__init__(self, serialise(model, kind), kind, method)
        elif kind == "torch":
            import torch

            # never switch the user's model's mode
            self.model = (model if owned else copy.deepcopy(model)).eval()
            params = list(model.parameters())
            self.dtype = params[0].dtype if params else torch.float32
            self.device = params[0].device.type if params else None
        else:
            self.model, self.dtype = model, None


class ModelFactory:
    """Build the model on each worker instead of shipping it (one that cannot be pickled,
    or is cheaper to build than to send); accepted wherever a model is.

    Parameters
    ----------
    build : callable
        ``build(*args, **kwargs) -> model``, picklable.
    *args, **kwargs
        Passed to ``build``.
    state_dict : mapping, optional
        PyTorch: the trained weights, loaded into the built module.

    Examples
    --------
    >>> weights = net.state_dict()  # doctest: +SKIP
    >>> blockflow.predict(ModelFactory(Net, state_dict=weights), x)  # doctest: +SKIP
    """

    def __init__(self, build, *args, state_dict=None, **kwargs):
        if not callable(build):
            raise TypeError(f"blockflow.ml.inference.ModelFactory: build must be callable, got "
                            f"{describe(build)}.")
        self.build, self.args, self.kwargs, self.state_dict = build, args, kwargs, state_dict

    def __call__(self):
        model = self.build(*self.args, **self.kwargs)
        if self.state_dict is not None:
            model.load_state_dict(self.state_dict)
        return model

    def __repr__(self) -> str:
        return f"ModelFactory({getattr(self.build, '__qualname__', self.build)!r})"
