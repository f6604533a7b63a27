"""The trial runner: trial tasks placed on the workers, their results, and the loops.

Each rung of a trial is one Dask task pinned to a worker, where its checkpoint stays;
:class:`Tuner` keeps one trial task per free worker thread and runs trials again whose
worker left.
"""

from __future__ import annotations

import math
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from dask.utils import parse_timedelta
from distributed import KilledWorker, get_worker

from blockflow import _distributed, config
from blockflow.errors import WorkerLostError
from blockflow.ml.tune.asha import Rungs, rung_budgets
from blockflow.ml.tune.speeds import SpeedEvidence
from blockflow.scheduling.estimate import earliest_finish
from blockflow.scheduling.view import declared_speeds, learned_speeds
from blockflow.scheduling.wait import fetch, wait_any

__all__ = ["METADATA_KEY", "REPORT_PREFIX", "TRIAL_PREFIX", "Tuner"]

#: Prefix of the trial tasks' keys (the task stream and the dashboard group them by it).
TRIAL_PREFIX = "blockflow-trial"
#: Prefix of the keys of the tasks that hand a trial task's score to the client.
REPORT_PREFIX = "blockflow-score"
#: Scheduler metadata key under which a running tuner publishes its trials (dashboard).
METADATA_KEY = ("blockflow", "tune")


def _run_trial(train: Callable, cfg: dict, epochs: float, previous: tuple | None) -> tuple:
    """The trial task: train ``epochs`` more units from ``previous``'s checkpoint, timed."""
    checkpoint = None if previous is None else previous[1]
    started = time.time()
    score, checkpoint = train(cfg, epochs, checkpoint)
    finished = time.time()
    try:
        worker = get_worker().address
    except ValueError:
        worker = None
    return {"score": float(score), "worker": worker, "started": started,
            "finished": finished}, checkpoint


def _report(out: tuple) -> dict:
    """The part of a trial task's result the client reads (the checkpoint stays put)."""
    return out[0]


@dataclass
class _Job:
    trial: int
    rung: int
    epochs: float
    checkpoint: Any = None
    speculative: bool = False


@dataclass
class _Running:
    job: _Job
    worker: str | None
    submitted: float
    estimate: float
    speed: float
    fastest_free: float
    backup: bool = False  # a copy of a job already running elsewhere (see _backups)


@dataclass
class _Trial:
    config: dict
    rung: int = -1
    score: float = math.nan
    checkpoint: Any = None
    status: str = "pending"
    worker: str | None = None
    error: str | None = None
    started: float = math.nan
    finished: float = math.nan
    duration: float = 0.0


class Tuner:
    """One ``tune`` call: its trials, their tasks in flight, and the loops that run them.

    Parameters are those of :func:`blockflow.tune.tune`.
    """

    def __init__(self, client, train, configs, *, eta, min_budget, max_budget, mode,
                 synchronous, publish, name, promotion="certain-first"):
        self.client, self.train, self.promotion = client, train, promotion
        self.synchronous, self.publish, self.name = synchronous, publish, name
        self.budgets = rung_budgets(min_budget, max_budget, eta)
        self.trials = [_Trial(dict(c)) for c in configs]
        self.rungs = Rungs(len(self.trials), self.budgets, eta, mode)
        self.evidence = SpeedEvidence()
        self.next_new = 0
        self.retry: list[_Job] = []  # jobs whose worker left before they finished
        self.running: dict[Any, _Running] = {}  # report future -> what it runs
        self.outputs: dict[Any, Any] = {}  # report future -> (report, checkpoint) future
        self.history: list[dict] = []
        self.workers: dict[str, int] = {}  # address -> threads
        self.decided: set[tuple[int, int]] = set()  # (trial, rung) with a result or failure
        self.twinned: set[tuple[int, int]] = set()  # (trial, rung) with a backup copy
        self._speeds_read = self._refreshed = self._published = 0.0

    # --- the cluster -----------------------------------------------------------------

    def _refresh(self, now: float) -> None:
        """Read the workers and speeds; run again trial tasks whose worker left."""
        self._refreshed = now
        before = set(self.workers)
        self.workers = {a: int(n) for a, n in self.client.nthreads().items()}
        if before - set(self.workers):
            self._forget_lost_checkpoints()
        if set(self.workers) - before:
            self.evidence.declared = declared_speeds(self.client)
        if now - self._speeds_read >= 1.0:
            self._speeds_read = now
            self.evidence.plugin = learned_speeds(self.client).known
        for fut, r in list(self.running.items()):
            if r.worker is not None and r.worker not in self.workers:
                self._cancel(fut)
                if r.backup or (r.job.trial, r.job.rung) in self.decided:
                    continue  # a copy: the job runs (or ran) elsewhere
                job = r.job
                if job.rung and self.trials[job.trial].checkpoint is None:
                    job = self._job(job.trial, job.rung)  # its checkpoint went with the worker
                self.retry.append(job)

    def _forget_lost_checkpoints(self) -> None:
        """Trials whose checkpoints were only on workers that left restart from scratch."""
        held = {t: tr.checkpoint for t, tr in enumerate(self.trials)
                if tr.checkpoint is not None}
        if not held:
            return
        who = _distributed.data_holders(self.client, held.values())
        lost = set()
        for t, fut in held.items():
            if not who.get(fut.key):
                lost.add(fut.key)
                self.trials[t].checkpoint = None
        for fut, r in list(self.running.items()):  # waiting for a lost checkpoint
            if r.job.checkpoint is not None and r.job.checkpoint.key in lost:
                self._cancel(fut)
                self.retry.append(self._job(r.job.trial, r.job.rung))

    def _cancel(self, fut) -> _Running:
        self.outputs.pop(fut).cancel()
        fut.cancel()
        return self.running.pop(fut)

    # --- placing trial tasks -----------------------------------------------------------

    def _job(self, trial: int, rung: int, speculative: bool = False) -> _Job:
        """Trial ``trial`` to rung ``rung``: from its checkpoint, or from scratch without."""
        ckpt = self.trials[trial].checkpoint
        if ckpt is None:
            return _Job(trial, rung, self.budgets[rung], None, speculative)
        return _Job(trial, rung, self.budgets[rung] - self.budgets[rung - 1], ckpt,
                    speculative)

    def _new_job(self) -> _Job | None:
        if self.next_new >= len(self.trials):
            return None
        self.next_new += 1
        return _Job(self.next_new - 1, 0, self.budgets[0], None)

    def _submit(self, job: _Job, worker: str | None, speed: float, fastest: float,
                estimate: float, backup: bool = False) -> None:
        trial = self.trials[job.trial]
        if job.rung > 0:
            self.rungs.promoted[job.trial].add(job.rung - 1)
        if not backup:
            trial.status = "running"
        token = f"{job.trial}-r{job.rung}-{uuid.uuid4().hex[:8]}"
        kw = {"workers": [worker], "allow_other_workers": False} if worker else {}
        out = self.client.submit(_run_trial, self.train, trial.config, job.epochs,
                                 job.checkpoint, key=f"{TRIAL_PREFIX}-{token}", pure=False,
                                 **kw)
        # the score comes back alone; the checkpoint stays in ``out`` on the worker
        fut = self.client.submit(_report, out, key=f"{REPORT_PREFIX}-{token}", pure=False,
                                 **kw)
        self.outputs[fut] = out
        self.running[fut] = _Running(job, worker, time.time(), estimate, speed, fastest,
                                     backup)

    def dispatch(self) -> None:
        """One trial task per free worker thread, earliest finish time first (a blockflow
        heuristic): reruns, promotions, then new configurations."""
        now = time.time()
        speeds = self.evidence.speeds(self.workers)
        unit = self.evidence.unit_seconds(speeds)
        busy: dict[str, list[float]] = {w: [] for w in self.workers}
        for r in self.running.values():
            if r.worker in busy:
                busy[r.worker].append(max(r.submitted + r.estimate, now))
        # a slot is [available at, worker, free now]; busy slots that overran their
        # estimate count as available now but are still busy
        slots = []
        for w, n in self.workers.items():
            ends = sorted(busy[w])[:n]
            slots += [[now, w, True] for _ in range(n - len(ends))]
            slots += [[e, w, False] for e in ends]
        free = sorted((s for s in slots if s[2]), key=lambda s: -speeds[s[1]])
        if not free:
            return

        def cost(job):
            return self.evidence.cost(job.trial, job.epochs, speeds, unit)

        def take(slot, job):
            fastest = speeds[free[0][1]]  # free is sorted fastest first
            free[:] = [s for s in free if s is not slot]
            slots[:] = [s for s in slots if s is not slot]
            self._submit(job, slot[1], speeds[slot[1]], fastest, cost(job) / speeds[slot[1]])

        def place(jobs):
            for job in jobs:
                if not free:
                    return
                c = cost(job)
                # earliest finish over the slots (ties: a free slot, then the faster worker)
                ready: dict[str, list] = {}
                for s in slots:
                    ready.setdefault(s[1], []).append(s)
                p = earliest_finish(1, {w: [s[0] for s in v] for w, v in ready.items()},
                                    lambda _, w: c / speeds[w],
                                    tie=lambda w, k: (not ready[w][k][2], -speeds[w]))[0]
                best = ready[p.worker][p.slot]
                if best[2]:
                    take(best, job)
                else:  # reserved: a faster busy worker finishes it sooner
                    best[0] += c / speeds[best[1]]

        for job in self.retry[:]:
            if not free:
                return
            self.retry.remove(job)
            take(free[0], job)
        certain = self.rungs.certain()
        sure = set(certain)

        def speculative():
            return [self._job(t, k, speculative=True) for t, k in self.rungs.promotable()
                    if (t, k) not in sure]

        certain = [self._job(t, k) for t, k in certain]
        if self.promotion == "asha":
            # the certain ones too: a rung with fewer than eta results promotes none by
            # ASHA's rule, and a small run would never reach the top rung
            place(certain + speculative())
        else:
            place(certain)
        while free:
            job = self._new_job()
            if job is None:
                break
            take(free[0], job)
        if free and self.promotion != "asha":  # nothing certain left: ASHA's speculation
            place(speculative())
        self._backups(free, speeds)

    def _backups(self, free: list, speeds: Mapping[str, float]) -> None:
        """Free threads on workers of unknown speed take a copy of a running trial task
        (a blockflow heuristic, after MapReduce's backup tasks, Dean and Ghemawat 2004)."""
        for slot in [s for s in free if self.evidence.blind(s[1])]:
            twins = sorted((r for r in self.running.values()
                            if not r.backup and r.worker != slot[1]
                            and (r.job.trial, r.job.rung) not in self.twinned
                            and (r.job.trial, r.job.rung) not in self.decided),
                           key=lambda r: r.submitted)
            if not twins:
                return
            job = twins[0].job
            self.twinned.add((job.trial, job.rung))
            self._submit(job, slot[1], speeds[slot[1]], speeds[free[0][1]],
                         twins[0].estimate, backup=True)

    # --- results -------------------------------------------------------------------

    def _row(self, r: _Running, **outcome) -> dict:
        job = r.job
        return {"trial": job.trial, "rung": job.rung, "budget": self.budgets[job.rung],
                "epochs": job.epochs, "promotion": job.rung > 0,
                "speculative": job.speculative, "speed": r.speed,
                "fastest_free": r.fastest_free, "submitted": r.submitted,
                "reported": time.time(), "backup": r.backup, **outcome}

    def _ok_row(self, r: _Running, out: dict) -> dict:
        """The history row of a task that gave ``out``; its time is speed evidence."""
        secs = out["finished"] - out["started"]
        self.evidence.add(out["worker"], secs, r.job.epochs, r.job.rung, r.job.trial)
        return self._row(r, score=out["score"], status="ok", worker=out["worker"],
                         started=out["started"], finished=out["finished"], duration=secs,
                         error=None)

    def _lost_row(self, r: _Running, status: str, finished: float, error=None) -> dict:
        return self._row(r, score=math.nan, status=status, worker=r.worker, started=math.nan,
                         finished=finished, duration=math.nan, error=error)

    def _record(self, fut, r: _Running) -> None:
        """Take a finished (or failed) trial task's result into the run's records."""
        job, trial = r.job, self.trials[r.job.trial]
        output = self.outputs.pop(fut)
        finished = fut.status == "finished"
        out = self._fetch(fut) if finished else None
        if (job.trial, job.rung) in self.decided:
            # the slower copy of a job the other copy finished: its time is evidence only
            self.history.append(self._ok_row(r, out) if out is not None
                                else self._lost_row(r, "failed", time.time()))
            return
        if finished:
            if out is None:
                # the result went with its worker before it was fetched: back among the
                # running, where _refresh runs the trial again elsewhere
                self.outputs[fut], self.running[fut] = output, r
                return
            self.decided.add((job.trial, job.rung))
            self.rungs.scores[job.rung][job.trial] = out["score"]
            trial.rung, trial.score = job.rung, out["score"]
            trial.checkpoint = output  # a future of (report, checkpoint), on a worker
            trial.worker = out["worker"]
            trial.status = "completed" if job.rung == self.rungs.top else "stopped"
            trial.started = min(trial.started, out["started"]) if job.rung else out["started"]
            trial.finished = out["finished"]
            trial.duration += out["finished"] - out["started"]
            self.history.append(self._ok_row(r, out))
            return
        exc = fut.exception()
        self.decided.add((job.trial, job.rung))
        self.rungs.failed.add(job.trial)
        err = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        if isinstance(exc, KilledWorker):  # on an internal key: name the trial
            last = getattr(exc.last_worker, "address", exc.last_worker)
            n = exc.allowed_failures + 1
            err = (f"WorkerLostError: the workers running trial {job.trial} (rung "
                   f"{job.rung}, {job.epochs:g} epochs) died {n} time"
                   f"{'s' if n != 1 else ''} (the last was {last}); a trial that kills "
                   f"its worker usually runs it out of memory: check the worker logs, "
                   f"give workers more memory (memory_limit=), or raise "
                   f"distributed.scheduler.allowed-failures if the deaths had nothing "
                   f"to do with the trial.")
        trial.status, trial.error, trial.worker = "failed", err, r.worker
        trial.finished = time.time()
        self.history.append(self._lost_row(r, "failed", trial.finished, err))

    def best_checkpoint(self, best: int):
        """The best trial's model, fetched from the worker that holds it.

        Raises
        ------
        WorkerLostError
            If that worker left with it.
        """
        trial = self.trials[best]
        try:
            return fetch(trial.checkpoint, timeout=10.0, deadline=60.0)[1]
        except WorkerLostError:
            raise WorkerLostError(
                f"blockflow.tune: the best trial's model (trial {best}, score "
                f"{trial.score:.6g}, on worker {trial.worker}) was lost with its worker "
                f"before it could be fetched; the trials' scores are known, the model is "
                f"not: run tune again (or retrain trial {best}'s config, "
                f"{_plain(trial.config)}).", lost=[str(trial.worker)]) from None

    @staticmethod
    def _fetch(fut, timeout: float = 10.0):
        """A finished trial's result, or None when it was lost first."""
        try:
            return fetch(fut, timeout=timeout)
        except WorkerLostError:
            return None

    def publish_progress(self, force: bool = False) -> None:
        """Running trials for the dashboard (:data:`METADATA_KEY`; at most 4 times a
        second unless ``force``)."""
        now = time.time()
        if not self.publish or (not force and now - self._published < 0.25):
            return
        self._published = now
        running = [{"trial": r.job.trial, "rung": r.job.rung, "epochs": r.job.epochs,
                    "worker": r.worker, "since": r.submitted,
                    "config": _plain(self.trials[r.job.trial].config)}
                   for r in self.running.values()]
        done = [t for t in self.trials if t.status in ("completed", "stopped", "failed")]
        best = self.rungs.best()
        self.client.set_metadata(list(METADATA_KEY), {
            "name": self.name, "time": now, "running": running,
            "n_trials": len(self.trials), "n_done": len(done),
            "n_failed": sum(t.status == "failed" for t in self.trials),
            "best_score": None if best is None else self.trials[best].score,
            "best_trial": best, "finished": not self.running and force,
        })

    # --- the loops -------------------------------------------------------------------

    def _wait(self, timeout: float = 1.0) -> list:
        return [f for f in wait_any(self.running, timeout=timeout) if f in self.running]

    def _work_left(self) -> bool:
        """Whether a trial task is still to run (a new configuration, a promotion)."""
        return (self.next_new < len(self.trials) or bool(self.retry)
                or bool(self.rungs.certain()) or bool(self.rungs.promotable()))

    def _end_copies(self) -> None:
        """Cancel the slower copies still running once nothing else is left."""
        now = time.time()
        for fut in list(self.running):
            r = self._cancel(fut)
            if r.worker is not None:
                self.evidence.add(r.worker, now - r.submitted, r.job.epochs, r.job.rung,
                                  r.job.trial)
            self.history.append(self._lost_row(r, "cancelled", now))

    def cancel_all(self) -> None:
        """Cancel every trial task still in flight (they stay listed as running)."""
        for fut in self.running:
            self.outputs.pop(fut).cancel()
            fut.cancel()

    def run_async(self) -> None:
        """ASHA: no rung barrier, a trial task for each thread that frees."""
        self.evidence.read_record(self.client)
        self._refresh(time.time())
        while True:
            self.dispatch()
            self.publish_progress()
            live = [f for f, r in self.running.items()
                    if (r.job.trial, r.job.rung) not in self.decided]
            if not live and not self._work_left():
                self._end_copies()
                break
            if not self.running:
                if not self.retry:
                    break
                if not self.workers:
                    self._await_workers()
            done = self._wait()
            for fut in done:
                self._record(fut, self.running.pop(fut))
            # a freed thread gets its next trial first; the cluster's workers and speeds
            # are read again at most twice a second while results flow, else at once
            now = time.time()
            if not done or now - self._refreshed >= 0.5:
                self._refresh(now)
        self.evidence.write_record(self.client)

    def _await_workers(self) -> None:
        """Every worker is gone: wait ``blockflow.cluster.worker-loss-timeout`` for some,
        else RuntimeError."""
        limit = parse_timedelta(config.get("cluster.worker-loss-timeout"))
        since = time.monotonic()
        while not self.workers:
            if time.monotonic() - since >= limit:
                raise RuntimeError(
                    f"blockflow: tune has no workers left to run its trials on (none for "
                    f"{limit:g} s, blockflow.cluster.worker-loss-timeout); add workers and "
                    f"call tune() again.")
            time.sleep(0.2)
            self._refresh(time.time())

    def run_sync(self) -> None:
        """Synchronous successive halving: rung k starts when all of rung k-1 is done,
        placed by Dask itself."""
        self._refresh(time.time())
        alive = list(range(len(self.trials)))
        for k in range(self.rungs.top + 1):
            epochs = self.budgets[k] - (self.budgets[k - 1] if k else 0)
            for t in alive:
                self._submit(_Job(t, k, epochs, self.trials[t].checkpoint), None, 1.0, 1.0, 0)
            while self.running:
                self.publish_progress()
                for fut in self._wait():
                    self._record(fut, self.running.pop(fut))
            alive = self.rungs.survivors(k)
            if k < self.rungs.top:
                for t in alive:
                    self.rungs.promoted[t].add(k)


def _plain(cfg: Mapping) -> dict:
    """``cfg`` with values that are not plain scalars as their repr (for metadata, messages)."""
    return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
            for k, v in cfg.items()}
