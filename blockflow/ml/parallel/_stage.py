"""The rank side of :class:`PipelineParallel`: stages run by ``torch.distributed.pipelining``.

:func:`run_segment` runs in one rank task of :func:`blockflow.ml._group.run_group`: it
builds the rank's stages (``PipelineStage``) from the layers and the last checkpoint, runs
the steps of a segment with torch's schedule (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``; activations and gradients go point to point over the group)
and returns the stages' new checkpoint, kept in worker memory. :func:`probe` times layers
(a plain task). Every function here runs on a worker.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import cloudpickle
import numpy as np

from blockflow import _distributed

__all__ = ["part", "probe", "run_segment"]


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


def _has_dropout(module) -> bool:
    import torch
    return any(isinstance(m, (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d,
                              torch.nn.Dropout3d, torch.nn.AlphaDropout,
                              torch.nn.TransformerEncoderLayer,
                              torch.nn.TransformerDecoderLayer, torch.nn.MultiheadAttention))
               for m in module.modules())


def _as_tensor(x, device, like=None):
    """``x`` as a tensor on ``device``; floating data cast to ``like``'s dtype."""
    import torch

    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    if like is not None and t.is_floating_point() and t.dtype != like:
        t = t.to(like)
    return t.to(device)


def _padded(t, sizes: Sequence[int]):
    """``t`` (``sum(sizes)`` rows) as ``len(sizes)`` equal micro-batches of ``max(sizes)``
    rows, zero rows after each shorter one (torch's schedules need equal micro-batches)."""
    import torch

    size = max(sizes)
    if all(s == size for s in sizes):
        return t
    out = t.new_zeros((size * len(sizes),) + tuple(t.shape[1:]))
    lo = 0
    for j, s in enumerate(sizes):
        out[j * size: j * size + s] = t[lo: lo + s]
        lo += s
    return torch.as_tensor(out)


def _unpadded(t, sizes: Sequence[int]):
    import torch

    size = max(sizes)
    if all(s == size for s in sizes):
        return t
    return torch.cat([t[j * size: j * size + s] for j, s in enumerate(sizes)])


class _Loss:
    """The user's loss on a micro-batch's real rows, weighted by its share of the batch
    (``rows / total`` for a ``"mean"`` loss), so summed gradients equal the batch's."""

    def __init__(self, fn):
        self.fn, self.sizes, self.total = fn, [1], 1
        reduction = getattr(fn, "reduction", "mean")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"blockflow: the loss's reduction must be 'mean' or 'sum', got "
                             f"{reduction!r}.")
        self.mean = reduction == "mean"

    def __call__(self, out, target):
        size = max(self.sizes)
        row = max(1, target[0].numel()) if target.dim() else 1
        j = target.storage_offset() // (row * size)  # which micro-batch: torch's views
        r = self.sizes[j] if 0 <= j < len(self.sizes) else out.shape[0]
        out, target = out[:r], target[:r]
        if target.is_floating_point() and target.dtype != out.dtype:
            target = target.to(out.dtype)
        loss = self.fn(out, target)
        return loss * (r / self.total) if self.mean else loss


def _stage_class():
    """``PipelineStage`` measuring its passes: a timeline and the peak stash."""
    import torch
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        def __init__(self, *a, seed=0, dropout=False, **kw):
            super().__init__(*a, **kw)
            self.records: list[tuple] = []
            self.peak, self.seed, self.dropout, self.step_no = 0, int(seed), dropout, 0

        def forward_one_chunk(self, fwd_chunk_id, *a, **kw):
            start = time.time()
            if self.dropout and self.submod.training:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed((self.seed * 1_000_003 + self.step_no * 10_007
                                       + fwd_chunk_id * 101 + self.stage_index) % (2**63))
                    out = super().forward_one_chunk(fwd_chunk_id, *a, **kw)
            else:
                out = super().forward_one_chunk(fwd_chunk_id, *a, **kw)
            self.records.append(("forward", fwd_chunk_id, start, time.time()))
            if self.has_backward:
                self.peak = max(self.peak, len(self.fwd_cache))
            return out

        def backward_one_chunk(self, bwd_chunk_id, *a, **kw):
            start = time.time()
            out = super().backward_one_chunk(bwd_chunk_id, *a, **kw)
            self.records.append(("backward", bwd_chunk_id, start, time.time()))
            return out

    return Stage


def _schedule(kind: str, stages: list, m: int, loss):
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    if kind == "interleaved1f1b":
        return ScheduleInterleaved1F1B(stages, m, loss_fn=loss, scale_grads=False)
    cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    return cls(stages[0], m, loss_fn=loss, scale_grads=False)


def _optim_state(opt, names: list[str]) -> dict:
    """The optimizer's state keyed by parameter name (placement-free)."""
    sd = opt.state_dict()
    return {"state": {names[i]: v for i, v in sd["state"].items()},
            "group": {k: v for k, v in sd["param_groups"][0].items() if k != "params"}}


def _load_optim(opt, names: list[str], saved: dict) -> None:
    state = {i: saved["state"][n] for i, n in enumerate(names) if n in saved["state"]}
    opt.load_state_dict({"state": state,
                         "param_groups": [dict(saved["group"], params=list(range(len(names))))]})


def _build(plan: dict, s: int, payloads: list, ckpts: list, device):
    """Stage ``s``'s modules from the layers' payloads and the checkpoints holding them."""
    import torch

    seq = torch.nn.Sequential()
    for name, payload in zip(plan["names"][plan["bounds"][s]:plan["bounds"][s + 1]],
                             payloads):
        seq.add_module(name, cloudpickle.loads(payload))
    seq = seq.to(device)
    own = set(seq.state_dict())
    model: dict = {}
    optim: dict = {"state": {}, "group": None}
    for c in ckpts:
        c = _loads(c, device)
        model.update({k: v for k, v in c["model"].items() if k in own})
        if c.get("optim"):
            optim["state"].update({k: v for k, v in c["optim"]["state"].items() if k in own})
            optim["group"] = c["optim"]["group"]
    if model:
        seq.load_state_dict(model, strict=False)
    names = [n for n, p in seq.named_parameters() if p.requires_grad]
    params = [p for n, p in seq.named_parameters() if p.requires_grad]
    opt = plan["optimizer"](params) if plan["optimizer"] is not None and params else None
    if opt is not None and optim["group"] is not None:
        _load_optim(opt, names, optim)
    return seq, opt, names


def run_segment(rank, plan: dict, payloads: list, ckpts: list, inputs: list | None,
                targets: list | None) -> dict:
    """Run a segment's steps as rank ``rank.rank`` (a :class:`~blockflow.ml._group.Rank`).

    Parameters
    ----------
    plan : dict
        ``stages`` (this rank's stage indices), ``n_stages``, ``bounds``, ``names``,
        ``schedule``, ``optimizer``, ``loss``, ``seed``, ``first_step``, ``steps`` (per step
        its micro-batch ``sizes``), ``train``, ``want_grads``, ``want_output``, and
        ``budget`` (seconds, optional: after two steps the ranks run only the steps that fit
        it, at the second step's pace, rank 0's measure).
    payloads : list of list of bytes
        Per stage of this rank, its layers pickled.
    ckpts : list of list of dict
        Per stage, the checkpoints holding its layers (empty: the layers as given).
    inputs, targets : list of arrays, optional
        Per step, the batch (first stage's rank) and the target (last stage's rank).

    Returns
    -------
    dict
        ``state`` (per stage: ``model`` and ``optim`` by parameter name, on the CPU),
        ``losses``, ``seconds``, ``records`` and ``peak`` per stage, ``outputs``, ``grads``,
        ``bytes`` per stage, ``clock``.
    """
    import torch

    device = rank.device
    Stage = _stage_class()
    mods, opts = [], []
    for s, pay, ck in zip(plan["stages"], payloads, ckpts):
        seq, opt, _ = _build(plan, s, pay, ck, device)
        seq.train(plan["train"])
        mods.append(seq)
        opts.append(opt)
    loss = _Loss(plan["loss"]) if plan["train"] else None
    first_dtype = next((p.dtype for p in mods[0].parameters() if p.is_floating_point()), None)
    last = plan["n_stages"] - 1
    schedules: dict = {}
    losses, seconds, outputs, grads, held = [], [], [], None, []
    records = [[] for _ in mods]
    peaks = [0] * len(mods)
    clock = _distributed.worker_scheduler_clock(_distributed.current_worker())
    limit = len(plan["steps"])
    for k, sizes in enumerate(plan["steps"]):
        if k >= limit:
            break
        m, size = len(sizes), max(sizes)
        key = (m, size)
        if key not in schedules:
            stages = [Stage(mod, s, plan["n_stages"], device, seed=plan["seed"],
                            dropout=_has_dropout(mod))
                      for s, mod in zip(plan["stages"], mods)]
            schedules[key] = (stages, _schedule(plan["schedule"], stages, m, loss))
        stages, sched = schedules[key]
        for st in stages:
            st.records, st.peak, st.step_no = [], 0, plan["first_step"] + k
        if loss is not None:
            loss.sizes, loss.total = list(sizes), sum(sizes)
        args = ()
        if 0 in plan["stages"]:
            args = (_padded(_as_tensor(inputs[k], device, first_dtype), sizes),)
        target = None
        if last in plan["stages"] and plan["train"]:
            target = _padded(_as_tensor(targets[k], device), sizes)
        mb_losses: list = []
        t0 = time.perf_counter()
        if plan["train"]:
            out = sched.step(*args, target=target, losses=mb_losses,
                             return_outputs=plan["want_output"])
        else:
            with torch.no_grad():
                out = sched.eval(*args)
        if last in plan["stages"]:
            if plan["train"]:
                losses.append(float(sum(float(v.detach()) for v in mb_losses)))
            if out is not None and plan["want_output"]:
                outputs.append(_portable(_unpadded(out.detach(), sizes).cpu()))
        if plan["train"]:
            if plan["want_grads"]:
                grads = {n: (_portable(p.grad.detach().cpu().clone()) if p.grad is not None
                             else None)
                         for mod in mods for n, p in mod.named_parameters()}
            for opt in opts:
                if opt is not None:
                    opt.step()
        seconds.append(time.perf_counter() - t0)
        for i, st in enumerate(stages):
            records[i] = st.records
            peaks[i] = max(peaks[i], st.peak)
        held = [_tensor_bytes(mod, opt) for mod, opt in zip(mods, opts)]
        for mod in mods:
            mod.zero_grad(set_to_none=True)
        if k == 1 and plan.get("budget") and limit > 2:
            limit = _steps_within(plan["budget"], seconds[-1], limit, device)
    state = []
    for mod, opt in zip(mods, opts):
        names = [n for n, p in mod.named_parameters() if p.requires_grad]
        state.append(_dumps({"model": mod.state_dict(),
                             "optim": _optim_state(opt, names) if opt is not None else None}))
    return {"state": state, "losses": losses, "seconds": seconds, "records": records,
            "peak": peaks, "outputs": outputs, "grads": grads, "clock": clock,
            "bytes": held, "stages": list(plan["stages"])}


def _steps_within(budget: float, step: float, most: int, device) -> int:
    """Steps of a segment that fit ``budget`` seconds at ``step`` seconds each (2 to
    ``most``), rank 0's measure broadcast so that every rank runs as many."""
    import torch
    import torch.distributed as dist

    n = torch.tensor([max(2, min(most, int(budget / max(step, 1e-6))))], device=device)
    dist.broadcast(n, src=0)
    return int(n.item())


def _portable(t):
    """``t`` as Dask can send it: bfloat16 (no NumPy dtype) widened to float32."""
    import torch
    return t.float() if t.dtype == torch.bfloat16 else t


def _dumps(state: dict) -> bytes:
    """A checkpoint as ``torch.save`` bytes: every dtype (bfloat16 too) travels as bytes."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _loads(data: bytes, device="cpu") -> dict:
    import io

    import torch
    return torch.load(io.BytesIO(data), map_location=device, weights_only=False)


def model_state(data: bytes) -> bytes:
    """A checkpoint's model tensors, as ``torch.save`` bytes."""
    return _dumps(_loads(data)["model"])


def part(result: dict, name: str, i: int | None = None) -> Any:
    """``result[name]`` (``[i]``): a piece of a rank's result, on its worker."""
    return result[name] if i is None else result[name][i]


def probe(payloads: Sequence[bytes], x, repeats: int, optimizer: Callable | None
          ) -> tuple[list, list, list]:
    """Each module's forward+backward seconds on this worker (least of ``repeats``), its
    bytes after one optimizer step, and its output's bytes on ``x``."""
    import torch

    times, sizes, outs = [], [], []
    device = _device()
    h = None
    for payload in payloads:
        module = cloudpickle.loads(payload).to(device)
        module.train()
        if h is None:
            dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()),
                         None)
            h = _as_tensor(x, device, dtype)
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
        times.append(best)
        sizes.append(_tensor_bytes(module, opt))
        outs.append(int(y.numel() * y.element_size()))
        h = y.detach()
        del module, opt
    return times, sizes, outs

