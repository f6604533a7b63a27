"""Checkpoints of pipeline stages and the rebuild of a stage whose worker was lost.

Every ``checkpoint_every`` steps each stage is kept on its worker and on another, so any one
lost worker leaves every stage a copy; :func:`recover` rebuilds lost stages on survivors,
rolling the others back, or raises :class:`~blockflow.errors.WorkerLostError`.
"""

from __future__ import annotations

import logging
import math
import time

from blockflow.errors import WorkerLostError
from blockflow.ml.parallel import _placement, _stage

__all__ = ["checkpoint", "holder", "recover"]

logger = logging.getLogger("blockflow.ml.parallel.pipeline")


def holder(pipe, s: int, alive: set[str]) -> str | None:
    """A worker other than stage ``s``'s for its checkpoint's copy (a spare first)."""
    mine = pipe.stage_workers[s]
    spares = sorted(w for w in alive if w not in pipe.stage_workers)
    if spares:
        return spares[s % len(spares)]
    others = [pipe.stage_workers[(s + k) % len(pipe.stage_workers)]
              for k in range(1, len(pipe.stage_workers))]
    return next((w for w in others if w != mine and w in alive), None)


def checkpoint(pipe) -> None:
    """Checkpoint every stage: a copy on its worker and one on :func:`holder`'s."""
    alive = pipe._alive()
    own = [pipe.client.submit(_stage.checkpoint, k, workers=[w], allow_other_workers=False,
                              pure=False)
           for k, w in zip(pipe._keys, pipe.stage_workers)]
    copies = []
    for s, f in enumerate(own):
        h = holder(pipe, s, alive)
        copies.append(None if h is None else pipe.client.submit(
            _stage.hold, f, workers=[h], allow_other_workers=False, pure=False))
    wait = own + [c for c in copies if c is not None]
    pipe._gather(wait, needed=set(pipe.stage_workers), what="checkpointing the stages")
    pipe._ckpt = list(zip(own, copies))
    pipe._ckpt_step = pipe.steps


def recover(pipe, lost: set[str], what: str) -> list[str]:
    """Rebuild the stages of ``lost`` workers on survivors from their checkpoints and
    roll every other stage back to the same checkpoint; returns the stages rebuilt."""
    deadline = time.monotonic() + 10
    while lost & pipe._alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = pipe._alive()
    placed: dict[str, int] = {}
    for s, w in enumerate(pipe.stage_workers):
        if w in alive:
            placed[w] = placed.get(w, 0) + pipe._stage_bytes[s]
    capacity = {w: c for w, c in _placement.capacity(pipe).items() if w in alive}
    for w in alive - set(capacity):
        capacity[w] = math.inf
    moves, rebuilt = {}, []
    for s, w in enumerate(pipe.stage_workers):
        if w in alive:
            continue
        copy = pipe._ckpt[s][1] if pipe._ckpt else None
        holder = None if copy is None else next(iter(
            pipe.client.who_has(copy).get(copy.key, ())), None)
        if holder is None or holder not in alive:
            raise WorkerLostError(
                f"blockflow: {what} failed: lost {pipe._stage_name(s)} on worker {w} "
                f"together with its checkpoint's copy, so nothing can rebuild it; keep "
                f"a spare worker (checkpoint copies go there first) and build the "
                f"PipelineParallel again.", lost=lost)
        need = pipe._stage_bytes[s]
        room = {v: capacity[v] - placed.get(v, 0) for v in alive}
        fits = [v for v in room if room[v] >= need]
        if not fits:
            best = max(room.values(), default=0)
            raise WorkerLostError(
                f"blockflow: {what} failed: lost {pipe._stage_name(s)} on worker {w}, "
                f"and no surviving worker has room for it ({need:,} bytes of "
                f"parameters and optimizer state; the most room left is "
                f"{int(best) if math.isfinite(best) else best:,} bytes); add a worker "
                f"and build the PipelineParallel again.", lost=lost)
        spare = [v for v in fits if v not in pipe.stage_workers]
        target = max(spare or fits, key=lambda v: (room[v], v))
        placed[target] = placed.get(target, 0) + need
        moves[s] = target
        rebuilt.append(pipe._stage_name(s))
    futs = []
    for s, w in enumerate(pipe.stage_workers):
        own, copy = pipe._ckpt[s]
        if s in moves:
            futs.append(pipe.client.submit(
                _stage.install, pipe._keys[s], _placement.stage_payload(pipe, s), pipe.optimizer,
                pipe.loss_fn, pipe.seed, s, copy, workers=[moves[s]],
                allow_other_workers=False, pure=False))
        else:
            futs.append(pipe.client.submit(_stage.restore, pipe._keys[s], own,
                                           workers=[w], allow_other_workers=False,
                                           pure=False))
    for s, t in moves.items():
        logger.warning("blockflow: %s was lost with worker %s; rebuilt on %s from the "
                       "checkpoint of step %d", pipe._stage_name(s),
                       pipe.stage_workers[s], t, pipe._ckpt_step)
        pipe.stage_workers[s] = t
    holders = {next(iter(pipe.client.who_has(pipe._ckpt[s][1]).get(
        pipe._ckpt[s][1].key, ())), None) for s in moves}
    pipe._gather(futs, needed=set(pipe.stage_workers) | (holders - {None}),
                 what="rebuilding the stages")
    pipe.steps = pipe._ckpt_step
    checkpoint(pipe)
    return rebuilt
