"""Pipeline segments driven from the client: one torch.distributed group per segment.

A segment is up to ``checkpoint_every`` steps run by one group of rank tasks
(:func:`blockflow.ml._group.run_group`, :func:`blockflow.ml.parallel._stage.run_segment`);
it ends with every stage's checkpoint kept in worker memory (replicated on a second
worker). A lost worker ends the segment; :mod:`~blockflow.ml.parallel._recovery` re-places
the stages on the survivors and the segment runs again from the last checkpoint.
"""

from __future__ import annotations

import time
from concurrent.futures import CancelledError

import dask.array as da
import numpy as np
from distributed import futures_of

from dask.utils import parse_timedelta

from blockflow import config
from blockflow.errors import WorkerLostError
from blockflow.ml._group import first_kept, gone_workers, keep_copies, run_group
from blockflow.ml.parallel import _recovery, _stage
from blockflow.ml.parallel.schedule import PipelineResult, timeline

__all__ = ["METADATA_KEY", "first", "micro_batches", "micro_sizes", "run_steps"]

#: Scheduler metadata key under which the latest pipeline run publishes its timeline.
METADATA_KEY = ("blockflow", "pipeline")


def micro_batches(pipe, n_rows: int, n_micro_batches: int | None) -> int:
    """Micro-batches for a batch of ``n_rows``: ``n_micro_batches`` checked, or by default
    stages x ``blockflow.parallel.micro-batches-per-stage``, at most the rows.

    Raises
    ------
    ValueError
        If ``n_micro_batches`` is not an integer between 1 and ``n_rows``.
    """
    if n_micro_batches is None:
        p = pipe.n_stages
        return max(1, min(p * int(config.get("parallel.micro-batches-per-stage")), n_rows))
    m = n_micro_batches
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or not 1 <= m <= n_rows:
        # each micro-batch needs a row: fewer would run than asked, silently
        raise ValueError(f"blockflow: n_micro_batches={n_micro_batches!r} for a batch of "
                         f"{n_rows} rows; a micro-batch needs at least one row: pass "
                         f"n_micro_batches between 1 and {n_rows}.")
    m = int(m)
    if pipe.schedule == "interleaved1f1b":
        rounds = max(1, m // max(1, len(pipe.ranks) or pipe.n_stages))
        if m % rounds:
            raise ValueError(f"blockflow: the interleaved 1F1B schedule runs micro-batches "
                             f"in rounds of the {len(pipe.ranks)} ranks; {m} is not a "
                             f"multiple of {rounds} rounds: pass a multiple of "
                             f"{len(pipe.ranks)}.")
    return m


def micro_sizes(rows: int, m: int) -> list[int]:
    """Rows of each of ``m`` micro-batches of a ``rows`` batch (differing by at most one)."""
    return [len(a) for a in np.array_split(np.arange(rows), m)]


def first(x):
    """``x`` computed if it is a dask array."""
    return x.compute() if isinstance(x, da.Array) else x


def _place_data(client, parts: list, worker: str) -> list:
    """Futures of ``parts`` on ``worker``: dask slices computed there, the rest scattered."""
    # loose: a slice pinned to a worker that has since left would wait for ever
    if all(isinstance(a, da.Array) for a in parts):
        done = client.persist([a.rechunk(-1) for a in parts], workers=[worker],
                              allow_other_workers=True)
        return [futures_of(d)[0] for d in done]
    return client.scatter([np.asarray(a) if not hasattr(a, "detach") else a for a in parts],
                          workers=[worker], hash=False)


def _segment(pipe, batches: list, *, train: bool, want_grads: bool, want_output: bool,
             budget: float | None = None) -> tuple[list, list]:
    """One group over ``batches`` (``(x, target, sizes)`` each; with ``budget`` seconds the
    ranks run the first of them that fit it): the ranks' summaries and the new checkpoint
    futures (per stage)."""
    c = pipe.client
    ranks, n, W = pipe.ranks, pipe.n_stages, len(pipe.ranks)
    xs = _place_data(c, [b[0] for b in batches], pipe.stage_workers[0])
    ts = _place_data(c, [b[1] for b in batches], pipe.stage_workers[-1]) if train else None
    common = {"n_stages": n, "bounds": list(pipe.bounds), "names": [m for m, _ in pipe._named],
              "schedule": pipe.schedule, "optimizer": pipe.optimizer, "loss": pipe.loss_fn,
              "seed": pipe.seed, "first_step": pipe.steps, "train": train,
              "steps": [b[2] for b in batches], "want_grads": want_grads,
              "want_output": want_output, "budget": budget}
    args = []
    for r in range(W):
        mine = [s for s in range(n) if s % W == r]
        payloads = [[pipe._layer_futs[k] for k in range(pipe.bounds[s], pipe.bounds[s + 1])]
                    for s in mine]
        ckpts = [[first_kept(k) for a, b, k in pipe._ckpt
                  if a < pipe.bounds[s + 1] and b > pipe.bounds[s]]
                 for s in mine]
        args.append((dict(common, stages=mine), payloads, ckpts,
                     xs if 0 in mine else None, ts if n - 1 in mine else None))
    futs = run_group(c, ranks, _stage.run_segment, args, name="pipeline-rank",
                     what="the pipeline", gather=False)
    # the summaries, the checkpoint's pieces and their copies asked for together: one
    # round trip to the scheduler, not three, at every segment's end
    summaries = [c.submit(_summary, f, workers=[w], pure=False) for f, w in zip(futs, ranks)]
    ckpt = []
    if train:
        for s in range(n):
            r = s % W
            ckpt.append((pipe.bounds[s], pipe.bounds[s + 1], c.submit(
                _stage.part, futs[r], "state", s // W, workers=[ranks[r]], pure=False)))
        kept = keep_copies(c, [f for _, _, f in ckpt], sorted(pipe._alive()),
                           [ranks[s % W] for s in range(n)])
        ckpt = [(a, b, k) for (a, b, _), k in zip(ckpt, kept)]
    # the ranks' own workers hold their results: one that leaves is a lost worker, not a
    # wait for ever
    summaries = pipe._gather(summaries, needed=set(ranks), what="the pipeline's ranks")
    del futs
    return summaries, ckpt


def _summary(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "state"}


def run_steps(pipe, batches: list, *, train: bool, want_grads: bool = False,
              want_output: bool = False, callback=None, what: str = "the pipeline step"
              ) -> list[dict]:
    """Run ``batches`` (``(x, target, sizes)``) in segments of ``checkpoint_every`` steps,
    recovering from lost workers; returns per segment the last-rank summary and timing."""
    fixed = pipe.checkpoint_every
    interval = float(parse_timedelta(config.get("ml.checkpoint-seconds")))
    step_seconds = None  # measured on the ranks, the last segment's median
    out: list[dict] = []
    i = 0
    while i < len(batches) or (not batches and not out):
        budget = None
        if fixed is not None:
            every = fixed or len(batches) or 1
        elif step_seconds is None:  # the ranks time two steps and run what fits the budget
            every, budget = _first_segment(batches[i:]), interval
        else:  # segments of about checkpoint-seconds: a checkpoint's cost stays small
            every = max(1, int(interval / step_seconds))
        seg = batches[i:i + every]
        t0 = time.perf_counter()
        gone = set(pipe.ranks) - pipe._alive()
        if gone:  # lost between segments (or calls): re-place before sending anything
            _recovery.recover(pipe, gone, what, redone=0)
        try:
            summaries, ckpt = _segment(pipe, seg, train=train, want_grads=want_grads,
                                       want_output=want_output, budget=budget)
        except WorkerLostError as e:  # a group's rank lost (at most the segment ran)
            gone = set(e.lost) or gone_workers(pipe.client, pipe.ranks)
            if not gone:
                raise
        except (CancelledError, OSError, KeyError):  # data sent to a worker that just died
            # (a scatter to a worker the scheduler has just dropped is a KeyError there)
            gone = gone_workers(pipe.client, pipe.ranks)
            if not gone:
                raise
        else:
            gone = None
        if gone is not None:  # out of the except: no internal error chained to the user's
            _recovery.recover(pipe, gone, what, redone=len(seg) if train else 0)
            continue
        wall = time.perf_counter() - t0
        seg = seg[:min(len(s["seconds"]) for s in summaries)] if budget else seg
        per_step = [t for s in summaries for t in s.get("seconds", ())]
        if per_step:
            step_seconds = max(float(np.median(per_step)), 1e-6)
        if train:
            pipe._ckpt = ckpt
            pipe.steps += len(seg)
            held = [0] * pipe.n_stages
            for s in summaries:
                for k, st in enumerate(s["stages"]):
                    held[st] = int(s["bytes"][k]) if k < len(s["bytes"]) else 0
            pipe._stage_bytes = held
        out.append({"summaries": summaries, "wall": wall, "first": i})
        if callback is not None:
            callback(i, summaries)
        i += len(seg)
        if not batches:
            break
    return out


def _first_segment(batches: list, most: int = 64, most_bytes: int = 256 * 2**20) -> int:
    """Batches given to a first segment (the ranks run those that fit the checkpoint
    interval): up to ``most``, their inputs within ``most_bytes``."""
    x = batches[0][0] if batches else None
    size = getattr(x, "nbytes", None) or 1
    return max(2, min(most, len(batches), most_bytes // int(size)))


def result_of(pipe, seg: dict, sizes: list[int], train: bool, schedule: str) -> PipelineResult:
    """A :class:`PipelineResult` for the last step of a segment's summaries."""
    sums = seg["summaries"]
    last = next(s for s in sums if pipe.n_stages - 1 in s["stages"])
    hosts = {h.split("://")[-1].rsplit(":", 1)[0] for h in pipe.ranks}
    records, workers = [None] * pipe.n_stages, [None] * pipe.n_stages
    peaks = [0] * pipe.n_stages
    for s in sums:
        for i, st in enumerate(s["stages"]):
            recs = s["records"][i]
            records[st] = [(ph, j, a + s["clock"], b + s["clock"]) for ph, j, a, b in recs] \
                if len(hosts) > 1 else recs
            workers[st] = pipe.stage_workers[st]
            peaks[st] = int(s["peak"][i])
    tasks = timeline(records, workers)
    makespan = float(tasks.stop.max()) if len(tasks) else 0.0
    grads = None
    if any(s["grads"] is not None for s in sums):
        grads = {k: (None if v is None else v.numpy()) for s in sums
                 for k, v in (s["grads"] or {}).items()}
    output = None
    if last["outputs"]:
        output = np.concatenate([o.float().numpy() if str(o.dtype) in (
            "torch.bfloat16", "torch.float16") else o.numpy() for o in last["outputs"]])
    return PipelineResult(output=output, loss=last["losses"][-1] if last["losses"] else None,
                          grads=grads, timeline=tasks, makespan=makespan,
                          n_micro_batches=len(sizes), n_stages=pipe.n_stages, rows=sum(sizes),
                          micro_batch_rows=list(sizes), schedule=schedule if train else "gpipe",
                          peak_activations=peaks if train else [])


def publish_timeline(pipe, result: PipelineResult, name: str) -> None:
    """Put a step's timeline in the scheduler's metadata under :data:`METADATA_KEY`."""
    t = result.timeline
    pipe.client.set_metadata(list(METADATA_KEY), {
        "name": name, "time": time.time(), "stages": result.n_stages,
        "micro_batches": result.n_micro_batches, "makespan": result.makespan,
        "bubble": result.bubble, "ideal_bubble": result.ideal_bubble,
        "workers": list(pipe.stage_workers), "bounds": list(pipe.bounds),
        "timeline": {k: t[k].tolist() for k in t.columns},
    })
