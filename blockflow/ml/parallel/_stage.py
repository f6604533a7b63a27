"""Pipeline stages on their workers: the worker-side half of :class:`PipelineParallel`.

A stage's modules, stash, gradients and optimizer state stay on its worker; a step is one
task per stage (:func:`run`), activations and gradients going worker to worker through
``blockflow_pipeline`` (:class:`PipePlugin`). Every function here runs on a worker.
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
from typing import Any, Callable, Sequence

import cloudpickle
import numpy as np
from distributed import secede
from distributed.protocol import to_serialize

from blockflow import _distributed
from blockflow._distributed import HandlerPlugin

__all__ = ["HANDLER", "PipePlugin", "checkpoint", "deliver", "drop", "has_handler", "hold",
           "install", "peaks", "probe", "restore", "run", "state"]

HANDLER = "blockflow_pipeline"
#: Seconds a stage waits for one input (an activation or a gradient) before it gives up,
#: when the step's plan does not say (``blockflow.parallel.stage-wait``, read by the client)
WAIT_TIMEOUT = 300.0

#: (worker address, stage key) -> _Stage
_STAGES: dict[tuple[str, str], "_Stage"] = {}
#: worker address -> most bytes of parameters, gradients and optimizer state held at once
_PEAK: dict[str, int] = {}
_LOCK = threading.Lock()
#: dropout draws from torch's global generator: a seeded forward holds it alone
_RNG_LOCK = threading.Lock()


def _here() -> str:
    worker = _distributed.current_worker()
    return worker.address if worker is not None else "local"


def _device():
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _tensor_bytes(module, optimizer) -> int:
    """Bytes of parameters, their gradients and the optimizer's state tensors."""
    import torch

    n = 0
    for p in module.parameters():
        n += p.numel() * p.element_size()
        if p.grad is not None:
            n += p.grad.numel() * p.grad.element_size()
    if optimizer is not None:
        for st in optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    n += v.numel() * v.element_size()
    return int(n)


def _note_peak(address: str) -> None:
    with _LOCK:
        held = sum(_tensor_bytes(s.module, s.optimizer) for (a, _), s in _STAGES.items()
                   if a == address)
        _PEAK[address] = max(_PEAK.get(address, 0), held)


def _has_dropout(module) -> bool:
    import torch
    return any(isinstance(m, (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d,
                              torch.nn.Dropout3d, torch.nn.AlphaDropout,
                              torch.nn.TransformerEncoderLayer,
                              torch.nn.TransformerDecoderLayer, torch.nn.MultiheadAttention))
               for m in module.modules())


class _Stage:
    """One stage on its worker: modules, optimizer, loss, stash and this step's measures."""

    def __init__(self, module, optimizer: Callable | None, loss_fn, seed: int, index: int):
        self.module = module.to(_device())
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = optimizer(params) if optimizer is not None and params else None
        self.loss_fn, self.seed, self.index = loss_fn, int(seed), int(index)
        self.dropout = _has_dropout(self.module)
        self.stash: dict[int, tuple] = {}
        self.peak_stash = 0
        self.loss_sum = 0.0


def _get(key: str) -> _Stage:
    try:
        return _STAGES[_here(), key]
    except KeyError:
        raise RuntimeError(f"blockflow: pipeline stage {key} is not on worker {_here()} "
                           f"(the worker restarted?); rebuild the PipelineParallel.") from None


def install(key: str, payload: bytes, optimizer, loss_fn, seed: int, index: int,
            ckpt: bytes | None = None) -> int:
    """Build the stage from ``payload`` (from checkpoint ``ckpt`` when given); returns its
    bytes."""
    stage = _Stage(cloudpickle.loads(payload), optimizer, loss_fn, seed, index)
    if ckpt is not None:
        _load(stage, ckpt)
    address = _here()
    with _LOCK:
        _STAGES[address, key] = stage
    _note_peak(address)
    return _tensor_bytes(stage.module, stage.optimizer)


def drop(key: str) -> None:
    """Forget the stage on this worker."""
    with _LOCK:
        _STAGES.pop((_here(), key), None)


def _as_tensor(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.to(_device())
    return torch.as_tensor(np.asarray(x)).to(_device())


def _seeded(stage: _Stage, step: int, j: int):
    """A context holding torch's generator seeded for (stage, step, micro-batch)."""
    import torch

    if not stage.dropout or not stage.module.training:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def ctx():
        with _RNG_LOCK, torch.random.fork_rng(devices=[]):
            torch.manual_seed((stage.seed * 1_000_003 + step * 10_007 + j * 101
                               + stage.index) % (2**63))
            yield
    return ctx()


def _forward(stage: _Stage, x, step: int, j: int, train: bool):
    """Forward of micro-batch ``j`` (stashed in training); returns the output, detached."""
    import torch

    x = _as_tensor(x)
    if train:
        stage.module.train()
        leaf = x.detach().requires_grad_(x.is_floating_point() and stage.index > 0)
        with _seeded(stage, step, j):
            y = stage.module(leaf)
        stage.stash[j] = (leaf, y)
        stage.peak_stash = max(stage.peak_stash, len(stage.stash))
    else:
        stage.module.eval()
        with torch.no_grad():
            y = stage.module(x)
    return y.detach().cpu() if y.device.type != "cpu" else y.detach()


def _backward(stage: _Stage, dy, j: int, weight: float | None):
    """Backward of micro-batch ``j``: ``dy`` is the target on the last stage (loss times
    ``weight``), else the next stage's gradient; returns the input's gradient or None."""
    import torch

    leaf, y = stage.stash.pop(j)
    # a first stage without parameters (a reshape, an input scaling) has no graph: nothing
    # to differentiate there
    if weight is not None:
        loss = stage.loss_fn(y, _as_tensor(dy)) * weight
        if loss.requires_grad:
            torch.autograd.backward(loss)
        stage.loss_sum += float(loss.detach())
    elif y.requires_grad:
        torch.autograd.backward(y, _as_tensor(dy))
    if leaf.grad is None:
        return None
    g = leaf.grad
    return g.cpu() if g.device.type != "cpu" else g


def _finish(stage: _Stage, step: bool, want_grads: bool) -> dict:
    """End of a training step: summed loss, peak stash, gradients; the optimizer steps."""
    grads = None
    if want_grads:
        grads = {n: (p.grad.detach().cpu().clone() if p.grad is not None else None)
                 for n, p in stage.module.named_parameters()}
    if step and stage.optimizer is not None:
        stage.optimizer.step()
    _note_peak(_here())
    held = _tensor_bytes(stage.module, stage.optimizer)  # gradients included
    stage.module.zero_grad(set_to_none=True)
    out = {"loss": stage.loss_sum, "peak_stash": stage.peak_stash, "grads": grads,
           "bytes": held}
    stage.stash.clear()
    stage.loss_sum, stage.peak_stash = 0.0, 0
    return out


# --- worker-to-worker transfers: each stage's mailbox ----------------------------------


class _Cancelled(Exception):
    """The client cancelled the step (a stage's worker was lost)."""


class _Mailbox:
    """Inputs sent to one stage on this worker: ``(token, kind, j) -> value``."""

    def __init__(self):
        self.cond = threading.Condition()
        self.values: dict[tuple, Any] = {}
        self.cancelled: set[str] = set()

    def put(self, token: str, kind: str | None, j: int | None, value: Any,
            cancel: bool) -> None:
        with self.cond:
            if cancel:
                self.cancelled.add(token)
            else:
                self.values[token, kind, j] = value
            self.cond.notify_all()

    def begin(self, token: str) -> None:
        """A step starts: what earlier steps left (a cancelled step's inputs) goes."""
        with self.cond:
            for k in [k for k in self.values if k[0] != token]:
                del self.values[k]
            self.cancelled &= {token}

    def take(self, token: str, kind: str, j: int, what: str, sends: list,
             wait: float = WAIT_TIMEOUT) -> Any:
        deadline = time.monotonic() + wait
        with self.cond:
            while (token, kind, j) not in self.values:
                if token in self.cancelled:
                    raise _Cancelled
                for f in sends:  # a send of this stage failed: say so, do not wait
                    if f.done() and f.exception() is not None:
                        raise f.exception()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"blockflow: {what} waited {wait:g} s for the "
                        f"{'activation' if kind == 'F' else 'gradient'} of micro-batch {j} "
                        f"from its {'previous' if kind == 'F' else 'next'} stage; that "
                        f"stage's worker is stuck or gone: build the PipelineParallel again.")
                self.cond.wait(min(left, 1.0))
            return self.values.pop((token, kind, j))

    def end(self, token: str) -> None:
        with self.cond:
            for k in [k for k in self.values if k[0] == token]:
                del self.values[k]
            self.cancelled.discard(token)


#: (worker address, stage key) -> _Mailbox
_BOXES: dict[tuple[str, str], _Mailbox] = {}


def _box(address: str, key: str) -> _Mailbox:
    with _LOCK:
        box = _BOXES.get((address, key))
        if box is None:
            box = _BOXES[address, key] = _Mailbox()
        return box


def deliver(address: str, key: str, token: str, kind: str | None = None,
            j: int | None = None, value: Any = None, cancel: bool = False) -> None:
    """Put input ``kind`` (``"F"``/``"B"``) of micro-batch ``j`` of step ``token`` in stage
    ``key``'s mailbox at ``address``, or cancel that step there."""
    _box(address, key).put(token, kind, j, value, cancel)


def _serve(worker, key: str, token: str, kind: str | None = None, j: int | None = None,
           value: Any = None, cancel: bool = False) -> str:
    deliver(worker.address, key, token, kind, j, value, cancel)
    return "OK"


class PipePlugin(HandlerPlugin):
    """Worker plugin serving the ``blockflow_pipeline`` comm handler."""

    name = "blockflow-pipeline"

    def handlers(self):
        return {HANDLER: _serve}


def has_handler(dask_worker=None) -> bool:
    """Whether this worker serves ``blockflow_pipeline``."""
    return dask_worker is not None and _distributed.has_worker_handler(dask_worker, HANDLER)


def run(key: str, token: str, step: int, plan: dict, inputs: Sequence | None = None,
        targets: Sequence | None = None) -> dict:
    """One step of stage ``key``: its forward and backward passes in the order
    ``plan["order"]`` (``("F", j)`` / ``("B", j)``), as a loop on this worker.

    ``plan`` holds ``train``, ``order``, ``prev``/``next`` (``(address, key)`` or None),
    ``weights``, ``want_output``, ``want_grads``, ``step_optimizer`` and ``name``.

    Returns
    -------
    dict
        ``records`` (``(phase, j, start, stop)``), ``clock`` (offset to the scheduler's
        clock), ``outputs``, ``wait`` (seconds), ``cancelled``, and in training ``loss``,
        ``peak_stash``, ``grads``, ``bytes``.
    """
    stage = _get(key)
    worker = _distributed.current_worker()
    address = _here()
    box = _box(address, key)
    box.begin(token)
    clock = _distributed.worker_scheduler_clock(worker)
    train, prev, nxt = plan["train"], plan["prev"], plan["next"]
    patience = float(plan.get("wait", WAIT_TIMEOUT))
    records: list[tuple] = []
    outputs: dict[int, Any] = {}
    sends: list = []
    wait = 0.0

    def send(to, kind, j, value):
        if worker is None:  # outside a worker (a test calling it directly)
            deliver(to[0], to[1], token, kind, j, value)
            return
        sends.append(_distributed.call_worker_threadsafe(
            worker, to[0], HANDLER, key=to[1], token=token, kind=kind, j=j,
            value=None if value is None else to_serialize(value)))

    try:
        # the loop waits on its neighbours: out of the worker's thread pool, so a second
        # stage on this worker (after a rebuild) or another task is never blocked by it
        secede()
    except (KeyError, ValueError, AttributeError):  # not on a worker's task thread
        pass
    try:
        for kind, j in plan["order"]:
            t0 = time.perf_counter()
            if kind == "F":
                x = inputs[j] if prev is None else box.take(token, "F", j, plan["name"],
                                                                sends, patience)
            else:
                x = targets[j] if nxt is None else box.take(token, "B", j, plan["name"],
                                                                sends, patience)
            start = time.time()
            wait += time.perf_counter() - t0
            if kind == "F":
                y = _forward(stage, x, step, j, train)
                stop = time.time()
                if nxt is not None:
                    send(nxt, "F", j, y)
                elif plan["want_output"]:
                    outputs[j] = y
                records.append(("forward", j, start, stop))
            else:
                g = _backward(stage, x, j, plan["weights"][j] if nxt is None else None)
                stop = time.time()
                if prev is not None:
                    send(prev, "B", j, g)
                records.append(("backward", j, start, stop))
        for f in sends:  # every send arrived (a failed one raises here)
            f.result(timeout=patience)
    except _Cancelled:
        stage.stash.clear()
        stage.module.zero_grad(set_to_none=True)
        stage.loss_sum, stage.peak_stash = 0.0, 0
        return {"cancelled": True, "records": records, "outputs": {}, "wait": wait,
                "clock": clock}
    finally:
        box.end(token)
        _distributed.add_task_wait(wait)  # waiting is not work (the speed model)
    out = {"cancelled": False, "records": records, "wait": wait, "clock": clock,
           "outputs": [outputs[j] for j in sorted(outputs)]}
    if train:
        out.update(_finish(stage, plan["step_optimizer"], plan["want_grads"]))
    return out


def checkpoint(key: str) -> bytes:
    """The stage's modules and optimizer state (``torch.save`` bytes)."""
    import torch

    stage = _get(key)
    buf = io.BytesIO()
    torch.save({"module": stage.module.state_dict(),
                "optimizer": stage.optimizer.state_dict() if stage.optimizer else None}, buf)
    return buf.getvalue()


def _load(stage: _Stage, ckpt: bytes) -> None:
    import torch

    saved = torch.load(io.BytesIO(ckpt), map_location=_device(), weights_only=False)
    stage.module.load_state_dict(saved["module"])
    if stage.optimizer is not None and saved["optimizer"] is not None:
        stage.optimizer.load_state_dict(saved["optimizer"])
    stage.module.zero_grad(set_to_none=True)
    stage.stash.clear()
    stage.loss_sum, stage.peak_stash = 0.0, 0


def restore(key: str, ckpt: bytes) -> None:
    """Roll the stage back to checkpoint ``ckpt``, in place."""
    _load(_get(key), ckpt)


def state(key: str) -> dict:
    """The stage's ``state_dict()``, on the CPU."""
    return {k: v.detach().cpu().clone() for k, v in _get(key).module.state_dict().items()}


def peaks(reset: bool = False, dask_worker=None) -> int:
    """Most bytes of parameters, gradients and optimizer state this worker held at once."""
    address = dask_worker.address if dask_worker is not None else _here()
    with _LOCK:
        value = _PEAK.get(address, 0)
        if reset:
            _PEAK[address] = sum(_tensor_bytes(s.module, s.optimizer)
                                 for (a, _), s in _STAGES.items() if a == address)
        return value


def probe(payloads: Sequence[bytes], x, repeats: int, optimizer) -> tuple[list, list, list]:
    """Each module's forward+backward seconds on this worker (least of ``repeats``), its
    bytes after one optimizer step, and its output's bytes on ``x``."""
    import torch

    times, sizes, outs = [], [], []
    h = _as_tensor(x)
    address = _here()
    for payload in payloads:
        module = cloudpickle.loads(payload).to(_device())
        module.train()
        params = [p for p in module.parameters() if p.requires_grad]
        opt = optimizer(params) if optimizer is not None and params else None
        best = float("inf")
        for r in range(repeats + 1):
            leaf = h.detach().requires_grad_(h.is_floating_point())
            start = time.perf_counter()
            y = module(leaf)
            if y.requires_grad:
                torch.autograd.backward(y, torch.ones_like(y))
            if r:
                best = min(best, time.perf_counter() - start)
        if opt is not None:
            opt.step()
        size = _tensor_bytes(module, opt)
        with _LOCK:
            _PEAK[address] = max(_PEAK.get(address, 0), size)
        times.append(best)
        sizes.append(size)
        outs.append(int(y.numel() * y.element_size()))
        h = y.detach()
        del module, opt
    return times, sizes, outs


def hold(value: Any) -> Any:
    """A copy of ``value`` on this task's worker (a checkpoint kept off its stage's)."""
    return value
