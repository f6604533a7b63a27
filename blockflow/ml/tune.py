"""Hyperparameter tuning: asynchronous successive halving (ASHA) with trials as Dask tasks.

Each trial is a configuration drawn (under a seed) from a search space; each *rung* of a
trial is one Dask task, ``train(config, epochs, checkpoint) -> (score, checkpoint)``, which
trains ``epochs`` more budget units from the trial's last checkpoint and reports a score.
Rung ``k`` brings a trial to ``min_budget * eta**k`` units (capped at ``max_budget``).

Search (Li et al. 2020, "A System for Massively Parallel Hyperparameter Tuning", Algorithm
2): there is no rung barrier. Whenever a worker thread frees, a trial in the top ``1/eta``
of the results its rung has so far, and not yet promoted, is promoted to the next rung
(highest rung first); otherwise a new configuration starts at rung 0. The worst trials are
never promoted: they are *stopped*.

Promotion order (a blockflow heuristic for a finite set of configurations): a promotion
ASHA makes on the results so far may be one that synchronous successive halving would not
make once the rung is complete; that work is wasted (about 20 % more work than SH on 81
configurations, eta 3). So promotions are taken in three tiers: first the *certain* ones,
trials sure to be in SH's top ``1/eta`` of their rung whatever the results still to come
(rank + results outstanding <= SH's quota), highest rung first; then new configurations
(work SH does too); then, only for a thread that would otherwise idle, ASHA's
*speculative* promotions. Each history row says which (``speculative``). A speculative
promotion that turns out certain is not run again.

Placement (a blockflow heuristic, earliest finish time list scheduling): exactly one trial
task per free worker thread, pinned with ``workers=``. Promotions are placed first, each on
the worker where it would finish earliest given the workers' speeds and when the busy ones
free: so a promotion goes to the fastest free worker, or waits for a faster busy one that
would still finish it sooner, while the free thread takes a new configuration (fastest
free thread first). No worker stays idle while a trial is ready for it. The speeds come
from the evidence there is, most trusted first: blockflow's scheduler plugin where it is
confident, the trials' own durations (the first rung's as soon as they exist), the record
earlier calls left on the cluster (:data:`SPEEDS_KEY`), the speeds the devices declare
(``blockflow-capacity``). Threads on workers none of these tells anything of run copies of
running trial tasks (:meth:`_Tuner._backups`), so that a second call never starts blind.

The synchronous successive-halving baseline (``synchronous=True``: every rung waits for all
its trials, then the top ``1/eta`` go on, placed by Dask itself) runs the same trials, as
dask-ml's ``SuccessiveHalvingSearchCV`` does.
"""

from __future__ import annotations

import math
import time
import traceback
import uuid
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from blockflow import _distributed, config
from blockflow.errors import WorkerLostError
from blockflow.scheduling.view import declared_speeds, learned_speeds
from blockflow.scheduling.wait import fetch, wait_any
from blockflow.scheduling.estimate import earliest_finish, prior_seconds_per_unit

__all__ = ["TuneResult", "choice", "loguniform", "randint", "sample_configs", "tune",
           "uniform"]

#: Prefix of the trial tasks' keys (the task stream and the dashboard group them by it).
TRIAL_PREFIX = "blockflow-trial"
#: Prefix of the keys of the tasks that hand a trial task's score to the client.
REPORT_PREFIX = "blockflow-score"
#: Scheduler metadata key under which a running tuner publishes its trials (dashboard).
METADATA_KEY = ("blockflow", "tune")
#: Scheduler metadata key of the cluster's speed record: worker address -> the relative
#: speed the trials showed there, kept across ``tune`` calls (a later call on the same
#: cluster starts from it, never blind twice).
SPEEDS_KEY = ("blockflow", "tune-speeds")


# --- search space ----------------------------------------------------------------------


@dataclass(frozen=True)
class uniform:  # noqa: N801  (named like scipy.stats / Optuna distributions)
    """A float drawn uniformly from ``[low, high)``."""

    low: float
    high: float

    def sample(self, rng: np.random.Generator) -> float:
        return float(rng.uniform(self.low, self.high))


@dataclass(frozen=True)
class loguniform:  # noqa: N801
    """A positive float whose logarithm is uniform on ``[log(low), log(high))``."""

    low: float
    high: float

    def __post_init__(self):
        if not 0 < self.low < self.high:
            raise ValueError(f"blockflow: loguniform needs 0 < low < high, got "
                             f"({self.low}, {self.high}).")

    def sample(self, rng: np.random.Generator) -> float:
        return float(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))


@dataclass(frozen=True)
class randint:  # noqa: N801
    """An integer drawn uniformly from ``[low, high)``."""

    low: int
    high: int

    def sample(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.low, self.high))


@dataclass(frozen=True)
class choice:  # noqa: N801
    """One of ``values``, each equally likely (a plain list in a space means the same)."""

    values: tuple

    def __init__(self, values: Sequence):
        if len(values) == 0:
            raise ValueError("blockflow: choice needs at least one value.")
        object.__setattr__(self, "values", tuple(values))

    def sample(self, rng: np.random.Generator) -> Any:
        v = self.values[int(rng.integers(len(self.values)))]
        return v.item() if isinstance(v, np.generic) else v


def sample_configs(space: Mapping[str, Any], n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` configurations drawn from ``space``, the same ones for the same seed.

    Parameters
    ----------
    space : mapping
        Parameter name to a distribution (:class:`uniform`, :class:`loguniform`,
        :class:`randint`, :class:`choice` or anything with ``sample(rng)``), a list or
        tuple (a choice), or a fixed value.
    n : int
        Number of configurations.
    seed : int, default 0
        Seed of the NumPy generator; parameters are drawn in the order of ``space``.

    Returns
    -------
    list of dict
    """
    rng = np.random.default_rng(seed)

    def draw(spec):
        if hasattr(spec, "sample"):
            return spec.sample(rng)
        if isinstance(spec, (list, tuple)):
            return choice(spec).sample(rng)
        return spec

    return [{name: draw(spec) for name, spec in space.items()} for _ in range(n)]


# --- results -----------------------------------------------------------------------------


@dataclass
class TuneResult:
    """What :func:`tune` returns.

    Attributes
    ----------
    trials : pandas.DataFrame
        One row per configuration (index ``trial``): its parameters (one column each),
        ``config`` (dict), ``rung`` (highest rung reached), ``budget`` (units trained),
        ``score`` (at that rung; NaN if none), ``status`` (``"completed"``: reached the top
        rung; ``"stopped"``: not promoted; ``"failed"``: its task raised; ``"pending"``:
        never started), ``worker`` (of its last task), ``error``, ``started`` /
        ``finished`` (s since the epoch) and ``duration`` (s, all its tasks).
    history : pandas.DataFrame
        One row per trial task: ``trial``, ``rung``, ``budget``, ``epochs``, ``score``,
        ``status`` (``"ok"``/``"failed"``), ``worker``, ``promotion`` (rung > 0),
        ``speculative`` (a promotion ASHA's rule made before it was certain that
        synchronous successive halving makes it too), ``backup`` (a copy of a trial task
        run on a worker whose speed nothing told yet: its time is evidence; status
        ``"cancelled"`` when the run ended before it),
        ``speed`` (the worker's estimated speed at dispatch), ``fastest_free`` (the fastest
        free worker's estimated speed then), ``submitted``/``started``/``finished``
        (s since the epoch), ``duration`` (s), ``error``.
    best_trial : int or None
        The trial with the best score at the highest rung any trial completed.
    best_config : dict or None
    best_score : float
    best_checkpoint : object
        The best trial's last checkpoint.
    wall_time : float
        Seconds from the first submission to the last result.
    busy_fraction : float
        Summed task time over (worker threads x wall time), 0-1.
    promotion : str
        The promotion order used (``"certain-first"``, ``"asha"``; ``"synchronous"`` for
        ``synchronous=True``).
    """

    trials: Any
    history: Any
    best_trial: int | None
    best_config: dict | None
    best_score: float
    best_checkpoint: Any
    wall_time: float
    busy_fraction: float
    promotion: str = "certain-first"


def _run_trial(train: Callable, cfg: dict, epochs: float, previous: tuple | None) -> tuple:
    """The trial task: train ``epochs`` more units from the checkpoint of the trial's
    ``previous`` task (its ``(report, checkpoint)`` result; None at rung 0) and time it."""
    from distributed import get_worker

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
    """The small part of a trial task's result the client reads (the checkpoint stays on
    the worker, for the trial's next rung wherever it runs)."""
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
    promoted_from: set = field(default_factory=set)  # rungs it was promoted from


class _Tuner:
    def __init__(self, client, train, configs, *, eta, min_budget, max_budget, mode,
                 synchronous, publish, name, promotion="certain-first"):
        self.client = client
        self.promotion = promotion
        self.train = train
        self.eta = eta
        self.mode = mode
        self.synchronous = synchronous
        self.publish = publish
        self.name = name
        self.budgets = _rung_budgets(min_budget, max_budget, eta)
        self.top_rung = len(self.budgets) - 1
        self.trials = [_Trial(dict(c)) for c in configs]
        self.next_new = 0
        self.results: list[dict[int, float]] = [{} for _ in self.budgets]  # rung -> trial: score
        self.retry: list[_Job] = []  # jobs whose worker left before they finished
        self.running: dict[Any, _Running] = {}  # report future -> what it runs
        self.outputs: dict[Any, Any] = {}  # report future -> (report, checkpoint) future
        self.history: list[dict] = []
        self.workers: dict[str, int] = {}  # address -> threads
        self.samples: list[tuple[str, float, float, int]] = []  # worker, seconds, epochs, rung
        self.cold_samples: list[tuple[str, float, float, int]] = []  # a worker's first trial
        self.declared: dict[str, float] = {}  # nominal speeds the devices declare
        self.record: dict[str, float] = {}  # speeds earlier tune calls saw on this cluster
        self.decided: set[tuple[int, int]] = set()  # (trial, rung) with a result or failure
        self.twinned: set[tuple[int, int]] = set()  # (trial, rung) with a backup copy
        self.trial_samples: dict[int, list[tuple[str, float, float]]] = {}  # same, per trial
        self.warm: set[str] = set()  # workers that finished a trial
        self.lost_checkpoints = 0  # checkpoints lost with a worker (trained again)
        self.plugin_speeds: dict[str, float] = {}  # the plugin's, known with confidence
        self._speeds_read = 0.0
        self._refreshed = 0.0
        self._published = 0.0

    # --- scores, speeds, estimates -------------------------------------------------

    def _key(self, score: float) -> float:
        """Sort key, best first; a NaN score (a diverged trial) ranks below every number."""
        if math.isnan(score):
            return math.inf
        return -score if self.mode == "max" else score

    def _refresh(self, now: float) -> None:
        self._refreshed = now
        before = set(self.workers)
        self.workers = {a: int(n) for a, n in self.client.nthreads().items()}
        if before - set(self.workers):
            self._forget_lost_checkpoints()
        if set(self.workers) - before:  # new workers: what their devices declare
            self.declared = declared_speeds(self.client)
        if now - self._speeds_read >= 1.0:
            self._speeds_read = now
            self.plugin_speeds = learned_speeds(self.client).known
        # a trial pinned to a worker that left runs nowhere: run it again elsewhere
        for fut, r in list(self.running.items()):
            if r.worker is not None and r.worker not in self.workers:
                self.outputs.pop(fut).cancel()
                fut.cancel()
                del self.running[fut]
                if r.backup or (r.job.trial, r.job.rung) in self.decided:
                    continue  # a copy: the job runs (or ran) elsewhere
                job = r.job
                if job.rung and self.trials[job.trial].checkpoint is None:
                    job = self._job(job.trial, job.rung)  # its checkpoint went with the worker
                self.retry.append(job)

    def _forget_lost_checkpoints(self) -> None:
        """Checkpoints held only by workers that left are gone (their tasks were pinned
        there, so Dask cannot recompute them elsewhere): those trials train their next
        rung from scratch, which gives the same model when ``train`` is deterministic."""
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
                self.lost_checkpoints += 1
        for fut, r in list(self.running.items()):  # waiting for a lost checkpoint
            if r.job.checkpoint is not None and r.job.checkpoint.key in lost:
                self.outputs.pop(fut).cancel()
                fut.cancel()
                del self.running[fut]
                self.retry.append(self._job(r.job.trial, r.job.rung))

    def _job(self, trial: int, rung: int) -> _Job:
        """Trial ``trial`` to rung ``rung``: from its checkpoint, or from scratch without."""
        ckpt = self.trials[trial].checkpoint
        if ckpt is None:
            return _Job(trial, rung, self.budgets[rung], None)
        return _Job(trial, rung, self.budgets[rung] - self.budgets[rung - 1], ckpt)

    def own_speeds(self) -> dict[str, float]:
        """The trials' own evidence: each worker's time per unit against the median of its
        rung, from its warm trials, or from its first (cold) trial while it has no other
        (the first rung's durations count as soon as they exist)."""
        per_rung: dict[int, list[float]] = {}
        seen: dict[int, set] = {}
        for w, secs, epochs, rung in self.samples + self.cold_samples:
            per_rung.setdefault(rung, []).append(secs / epochs)
            seen.setdefault(rung, set()).add(w)
        # only a rung two workers ran compares them (a rung of one says 1.0 of anyone)
        ref = {k: median(v) for k, v in per_rung.items() if len(seen[k]) >= 2}
        warm = {w for w, _, _, rung in self.samples if rung in ref}
        use = [s for s in self.samples if s[3] in ref] + [
            s for s in self.cold_samples if s[3] in ref and s[0] not in warm]
        own: dict[str, list[float]] = {}
        for w, secs, epochs, rung in use:
            if ref[rung] > 0 and secs > 0:
                own.setdefault(w, []).append(math.log(secs / epochs / ref[rung]))
        return {w: math.exp(-median(v)) for w, v in own.items()}

    def speeds(self) -> dict[str, float]:
        """Each worker's speed, from the evidence there is, most trusted first: the
        scheduler plugin's learned speed where it is known
        (:attr:`blockflow.scheduling.view.LearnedSpeeds.known`: the one confidence rule),
        else the trials' own evidence (:meth:`own_speeds`), else the speed earlier ``tune``
        calls saw on this cluster (:data:`SPEEDS_KEY`), else the speed its device declares
        (:func:`blockflow.scheduling.view.declared_speeds`), else 1.0. Each lower source
        is put on the scale of those above through the workers both know."""
        known = _layered(self.workers, {**self.own_speeds(), **self.plugin_speeds},
                         self.record, self.declared)
        return {w: known.get(w, 1.0) for w in self.workers}

    def _blind(self, worker: str) -> bool:
        """Whether nothing at all tells ``worker``'s speed yet."""
        return not (worker in self.plugin_speeds or worker in self.record
                    or worker in self.declared
                    or any(s[0] == worker for s in self.samples + self.cold_samples))

    def _unit_seconds(self, speeds: Mapping[str, float]) -> float:
        """Seconds one budget unit takes at speed 1 (median over finished tasks)."""
        v = [secs * speeds.get(w, 1.0) / epochs
             for w, secs, epochs, _ in self.samples or self.cold_samples]
        return median(v) if v else 1.0

    def _cost(self, job: _Job, speeds: Mapping[str, float], unit: float) -> float:
        """Seconds ``job`` takes at speed 1: its epochs times the trial's own seconds per
        unit at speed 1 on its earlier rungs (configurations differ: a wide network on small
        mini-batches took 3.5x the units of a narrow one on large), else ``unit``."""
        own = self.trial_samples.get(job.trial)
        if not own:
            return job.epochs * unit
        return job.epochs * median(secs * speeds.get(w, 1.0) / epochs
                                   for w, secs, epochs in own)

    # --- ASHA --------------------------------------------------------------------------

    def _promotable(self) -> list[_Job]:
        """Trials in the top 1/eta of their rung's results, not yet promoted, highest rung
        first, best first (Li et al. 2020, Algorithm 2)."""
        jobs = []
        for k in range(self.top_rung - 1, -1, -1):
            done = self.results[k]
            n_top = len(done) // self.eta
            if n_top == 0:
                continue
            ranked = sorted(done, key=lambda t: (self._key(done[t]), t))[:n_top]
            for t in ranked:
                if k not in self.trials[t].promoted_from:
                    jobs.append(self._job(t, k + 1))
        return jobs

    def _certain(self) -> list[set[int]]:
        """``sets[k]``: the trials sure to be in synchronous successive halving's rung ``k``
        whatever the results still to come (``sets[0]``: all).

        SH takes ``q[k+1] = max(q[k] // eta, 1)`` trials to rung ``k + 1``, the best of rung
        ``k`` (ties to the lower trial number, as :meth:`run_sync`). A trial of ``sets[k]``
        with a result at rung ``k`` is sure to be among them when its rank among the
        results of ``sets[k]`` plus the results of rung ``k`` SH still awaits is within the
        quota: no result to come can push it out. Trials of ``sets[k]`` that failed at rung
        ``k`` await nothing (a failure also shrinks SH's quota, which this does not
        foresee: at worst a promotion it called certain is one SH would not make)."""
        quota = [len(self.trials)]
        for _ in range(self.top_rung):
            quota.append(max(quota[-1] // self.eta, 1))
        sets = [set(range(len(self.trials)))]
        for k in range(self.top_rung):
            done = self.results[k]
            scored = [t for t in sets[k] if t in done]
            failed = sum(1 for t in sets[k] if t not in done
                         and self.trials[t].status == "failed")
            outstanding = quota[k] - failed - len(scored)
            room = quota[k + 1] - max(outstanding, 0)
            ranked = sorted(scored, key=lambda t: (self._key(done[t]), t))
            sets.append(set(ranked[:max(room, 0)]))
        return sets

    def _certain_jobs(self) -> list[_Job]:
        """The certain promotions not yet made, highest rung first, best first."""
        sets = self._certain()
        jobs = []
        for k in range(self.top_rung - 1, -1, -1):
            done = self.results[k]
            for t in sorted(sets[k + 1], key=lambda t: (self._key(done[t]), t)):
                if k not in self.trials[t].promoted_from:
                    jobs.append(self._job(t, k + 1))
        return jobs

    def _new_job(self) -> _Job | None:
        if self.next_new >= len(self.trials):
            return None
        t = self.next_new
        self.next_new += 1
        return _Job(t, 0, self.budgets[0], None)

    def _submit(self, job: _Job, worker: str | None, speed: float, fastest: float,
                estimate: float, backup: bool = False) -> None:
        trial = self.trials[job.trial]
        if job.rung > 0:
            trial.promoted_from.add(job.rung - 1)
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

    def _dispatch(self) -> None:
        """One trial task per free worker thread: promotions by earliest finish time, then
        new configurations (see the module doc)."""
        now = time.time()
        speeds = self.speeds()
        unit = self._unit_seconds(speeds)
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

        def take(slot, job):
            fastest = speeds[free[0][1]]  # free is sorted fastest first
            free[:] = [s for s in free if s is not slot]
            slots[:] = [s for s in slots if s is not slot]
            est = self._cost(job, speeds, unit) / speeds[slot[1]]
            self._submit(job, slot[1], speeds[slot[1]], fastest, est)

        def place(jobs):
            for job in jobs:
                if not free:
                    return
                cost = self._cost(job, speeds, unit)
                # earliest finish over the slots (ties: a free slot, then the faster worker)
                ready: dict[str, list] = {}
                for s in slots:
                    ready.setdefault(s[1], []).append(s)
                p = earliest_finish(1, {w: [s[0] for s in v] for w, v in ready.items()},
                                    lambda _, w: cost / speeds[w],
                                    tie=lambda w, k: (not ready[w][k][2], -speeds[w]))[0]
                best = ready[p.worker][p.slot]
                if best[2]:
                    take(best, job)
                else:  # reserved: a faster busy worker finishes it sooner
                    best[0] += cost / speeds[best[1]]

        for job in self.retry[:]:
            if not free:
                return
            self.retry.remove(job)
            take(free[0], job)
        certain = self._certain_jobs()
        sure = {(j.trial, j.rung) for j in certain}
        if self.promotion == "asha":  # Li et al.: any promotion before a new configuration
            # (the certain ones too: a rung with fewer than eta results promotes none by
            # ASHA's rule, and a small run would never reach the top rung)
            place(certain + [replace(j, speculative=True) for j in self._promotable()
                             if (j.trial, j.rung) not in sure])
        else:
            place(certain)
        while free:
            job = self._new_job()
            if job is None:
                break
            take(free[0], job)
        if free and self.promotion != "asha":  # nothing certain left: ASHA's speculation
            place([replace(j, speculative=True) for j in self._promotable()
                   if (j.trial, j.rung) not in sure])
        self._backups(free, speeds)

    def _backups(self, free: list, speeds: Mapping[str, float]) -> None:
        """Threads still free on workers nothing is known of yet (a fresh cluster whose
        devices declare no speed, and more threads than trials) each take a copy of a
        running trial task (the oldest without one). The first copy to finish gives the
        trial's result; the other's time is evidence of its worker's speed, for this run
        and for the next (:data:`SPEEDS_KEY`): a blind start is never repeated, and it
        costs no more than threads that would idle (a blockflow heuristic, cf. backup
        tasks in MapReduce, Dean and Ghemawat 2004)."""
        for slot in [s for s in free if self._blind(s[1])]:
            twins = sorted((r for r in self.running.values()
                            if not r.backup and r.worker != slot[1]
                            and (r.job.trial, r.job.rung) not in self.twinned
                            and (r.job.trial, r.job.rung) not in self.decided),
                           key=lambda r: r.submitted)
            if not twins:
                return
            job = twins[0].job
            self.twinned.add((job.trial, job.rung))
            fastest = speeds[free[0][1]]
            self._submit(job, slot[1], speeds[slot[1]], fastest, twins[0].estimate,
                         backup=True)

    # --- results -------------------------------------------------------------------

    def _sample(self, worker: str, secs: float, job: _Job) -> None:
        """A trial task's time on ``worker``: speed evidence (a worker's first trial pays
        its imports: kept apart, used only while the worker has no other)."""
        if worker in self.warm:
            self.samples.append((worker, secs, job.epochs, job.rung))
            self.trial_samples.setdefault(job.trial, []).append((worker, secs, job.epochs))
        else:
            self.cold_samples.append((worker, secs, job.epochs, job.rung))
        self.warm.add(worker)

    def _row(self, r: _Running) -> dict:
        job = r.job
        return {"trial": job.trial, "rung": job.rung, "budget": self.budgets[job.rung],
                "epochs": job.epochs, "promotion": job.rung > 0,
                "speculative": job.speculative, "speed": r.speed,
                "fastest_free": r.fastest_free, "submitted": r.submitted,
                "backup": r.backup}

    def _record(self, fut, r: _Running) -> None:
        job, trial = r.job, self.trials[r.job.trial]
        row = self._row(r)
        output = self.outputs.pop(fut)
        if (job.trial, job.rung) in self.decided:
            # the slower copy of a job the other copy finished: its time is evidence only
            out = self._fetch(fut) if fut.status == "finished" else None
            if out is not None:
                secs = out["finished"] - out["started"]
                self._sample(out["worker"], secs, job)
                row.update(score=out["score"], status="ok", worker=out["worker"],
                           started=out["started"], finished=out["finished"], duration=secs,
                           error=None)
            else:
                row.update(score=math.nan, status="failed", worker=r.worker,
                           started=math.nan, finished=time.time(), duration=math.nan,
                           error=None)
            self.history.append(row)
            return
        if fut.status == "finished":
            out = self._fetch(fut)
            if out is None:
                # the result went with its worker before it was fetched: the future is
                # pending again, pinned to a worker that left; back among the running,
                # where _refresh runs the trial again elsewhere
                self.outputs[fut], self.running[fut] = output, r
                return
            score = out["score"]
            self.decided.add((job.trial, job.rung))
            self.results[job.rung][job.trial] = score
            trial.rung, trial.score = job.rung, score
            trial.checkpoint = output  # a future of (report, checkpoint), on a worker
            trial.worker = out["worker"]
            trial.status = "completed" if job.rung == self.top_rung else "stopped"
            trial.started = min(trial.started, out["started"]) if job.rung else out["started"]
            trial.finished = out["finished"]
            trial.duration += out["finished"] - out["started"]
            self._sample(out["worker"], out["finished"] - out["started"], job)
            row.update(score=score, status="ok", worker=out["worker"],
                       started=out["started"], finished=out["finished"],
                       duration=out["finished"] - out["started"], error=None)
        else:
            from distributed import KilledWorker

            exc = fut.exception()
            self.decided.add((job.trial, job.rung))
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
            row.update(score=math.nan, status="failed", worker=r.worker, started=math.nan,
                       finished=trial.finished, duration=math.nan, error=err)
        self.history.append(row)

    def _best_checkpoint(self, best: int):
        """The best trial's model, fetched from the worker that holds it; a worker that
        left with it is named with the trial, never by the checkpoint's internal key."""
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
        """A finished trial's result, or None when it was lost before it was fetched
        (:func:`blockflow.scheduling.wait.fetch`: a trial pinned to a killed worker
        would never run again; the tuner hung in CI, a worker SIGKILLed as trials were
        promoted)."""
        try:
            return fetch(fut, timeout=timeout)
        except WorkerLostError:
            return None

    def _publish(self, force: bool = False) -> None:
        """Running trials for the dashboard page (scheduler metadata; at most 4 a second)."""
        now = time.time()
        if not self.publish or (not force and now - self._published < 0.25):
            return
        self._published = now
        running = [{"trial": r.job.trial, "rung": r.job.rung, "epochs": r.job.epochs,
                    "worker": r.worker, "since": r.submitted,
                    "config": _plain(self.trials[r.job.trial].config)}
                   for r in self.running.values()]
        done = [t for t in self.trials if t.status in ("completed", "stopped", "failed")]
        best = self._best()
        self.client.set_metadata(list(METADATA_KEY), {
            "name": self.name, "time": now, "running": running,
            "n_trials": len(self.trials), "n_done": len(done),
            "n_failed": sum(t.status == "failed" for t in self.trials),
            "best_score": None if best is None else self.trials[best].score,
            "best_trial": best, "finished": not self.running and force,
        })

    def _best(self) -> int | None:
        for k in range(self.top_rung, -1, -1):
            if self.results[k]:
                return min(self.results[k], key=lambda t: (self._key(self.results[k][t]), t))
        return None

    # --- the loops -------------------------------------------------------------------

    def _wait(self, timeout: float = 1.0) -> list:
        return [f for f in wait_any(self.running, timeout=timeout) if f in self.running]

    def _work_left(self) -> bool:
        """Whether a trial task is still to run (a new configuration, a promotion)."""
        return (self.next_new < len(self.trials) or bool(self.retry)
                or bool(self._certain_jobs()) or bool(self._promotable()))

    def _end_copies(self) -> None:
        """Cancel the slower copies still running once nothing else is left: each ran
        ``now - submitted`` seconds without finishing, a bound on its worker's speed kept
        as evidence (the work cancelled runs on only as long as its task does)."""
        now = time.time()
        for fut, r in list(self.running.items()):
            self.outputs.pop(fut).cancel()
            fut.cancel()
            del self.running[fut]
            if r.worker is not None:
                self._sample(r.worker, now - r.submitted, r.job)
            row = self._row(r)
            row.update(score=math.nan, status="cancelled", worker=r.worker,
                       started=math.nan, finished=now, duration=math.nan, error=None)
            self.history.append(row)

    def read_record(self) -> None:
        """The speeds earlier ``tune`` calls saw on this cluster (:data:`SPEEDS_KEY`)."""
        try:
            record = self.client.get_metadata(list(SPEEDS_KEY), default=None)
        except Exception:  # an old or closing scheduler: no record, not an error
            record = None
        self.record = {a: float(v) for a, v in (record or {}).items()
                       if isinstance(v, (int, float)) and math.isfinite(v) and v > 0}

    def write_record(self) -> None:
        """Keep what this run's trials showed of each worker's speed for the next call:
        this run's evidence over the earlier record, on one scale (:func:`_layered`)."""
        own = self.own_speeds()
        if not own:
            return
        merged = _layered(set(own) | set(self.record), own, self.record)
        self.client.set_metadata(list(SPEEDS_KEY), merged)

    def run_async(self) -> None:
        self.read_record()
        self._refresh(time.time())
        while True:
            self._dispatch()
            self._publish()
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

    def _await_workers(self) -> None:
        """Every worker is gone (a trial that kills its worker, run as a copy too, can take
        the last one): wait for workers to come back (nannies restart killed worker
        processes, autoscalers add workers) for ``blockflow.cluster.worker-loss-timeout``,
        as every blockflow wait does, before giving up."""
        from dask.utils import parse_timedelta

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
        """Synchronous successive halving: rung k starts when all of rung k-1 is done."""
        self._refresh(time.time())
        alive = list(range(len(self.trials)))
        for k in range(self.top_rung + 1):
            epochs = self.budgets[k] - (self.budgets[k - 1] if k else 0)
            for t in alive:
                self._submit(_Job(t, k, epochs, self.trials[t].checkpoint), None, 1.0, 1.0, 0)
            while self.running:
                self._publish()
                for fut in self._wait():
                    self._record(fut, self.running.pop(fut))
            done = self.results[k]
            alive = sorted(done, key=lambda t: (self._key(done[t]), t))[:max(
                len(done) // self.eta, 1)]
            if k < self.top_rung:
                for t in alive:
                    self.trials[t].promoted_from.add(k)

    def result(self, wall: float) -> TuneResult:
        import pandas as pd

        names = list(dict.fromkeys(n for t in self.trials for n in t.config))
        rows = []
        for i, t in enumerate(self.trials):
            row = {"trial": i, **{n: t.config.get(n) for n in names}, "config": t.config,
                   "rung": t.rung, "budget": self.budgets[t.rung] if t.rung >= 0 else 0,
                   "score": t.score, "status": t.status, "worker": t.worker,
                   "error": t.error, "started": t.started, "finished": t.finished,
                   "duration": t.duration}
            rows.append(row)
        trials = pd.DataFrame(rows).set_index("trial")
        cols = ["trial", "rung", "budget", "epochs", "score", "status", "worker", "promotion",
                "speculative", "speed", "fastest_free", "submitted", "started", "finished",
                "duration", "error", "backup"]
        history = pd.DataFrame(self.history, columns=cols)
        threads = max(sum(self.workers.values()), 1)
        busy = float(np.nansum(history["duration"])) / (threads * wall) if wall > 0 else 0.0
        best = self._best()
        return TuneResult(
            trials=trials, history=history, best_trial=best,
            best_config=None if best is None else dict(self.trials[best].config),
            best_score=math.nan if best is None else self.trials[best].score,
            best_checkpoint=None if best is None else self._best_checkpoint(best),
            wall_time=wall, busy_fraction=min(busy, 1.0),
            promotion="synchronous" if self.synchronous else self.promotion)


def _layered(workers, *sources: Mapping[str, float]) -> dict[str, float]:
    """Relative speeds of ``workers`` from sources of evidence, most trusted first: each
    worker's speed from the first source that has it, a lower source put on the scale of
    those above through the workers both know
    (:func:`blockflow.scheduling.estimate.prior_seconds_per_unit`; as is when none is
    shared). Workers no source knows are left out."""
    workers = set(workers)
    known: dict[str, float] = {}
    for source in sources:
        source = {w: float(v) for w, v in source.items() if w in workers and v and v > 0}
        if not known:
            known = source
            continue
        if not source:
            continue
        if not set(source) & set(known):  # nothing to anchor on: the scales as they are
            known = {**source, **known}
            continue
        spu = prior_seconds_per_unit(set(known) | set(source),
                                     {w: 1.0 / v for w, v in known.items()}, source)
        known = {w: 1.0 / v for w, v in spu.items()}
    return known


def _plain(cfg: Mapping) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
            for k, v in cfg.items()}


def _rung_budgets(min_budget: float, max_budget: float, eta: int) -> list[float]:
    if not 0 < min_budget <= max_budget:
        raise ValueError(f"blockflow: tune needs 0 < min_budget <= max_budget, got "
                         f"{min_budget} and {max_budget}.")
    budgets = [min_budget]
    # within a relative 1e-9 a budget is max_budget (0.7 * 3 is 2.0999999999999996, not 2.1)
    while budgets[-1] * eta < max_budget * (1 - 1e-9):
        budgets.append(budgets[-1] * eta)
    if budgets[-1] < max_budget * (1 - 1e-9):
        budgets.append(max_budget)
    return [int(b) if float(b).is_integer() else b for b in budgets]


def tune(train: Callable, space: Mapping[str, Any] | Sequence[Mapping[str, Any]], *,
         client=None, n_configs: int | None = None, eta: int | None = None,
         min_budget: float | None = None, max_budget: float | None = None,
         mode: str = "max", seed: int = 0, synchronous: bool = False,
         promotion: str | None = None, publish: bool = True,
         name: str = "tune") -> TuneResult:
    """Tune hyperparameters by asynchronous successive halving, trials as Dask tasks.

    Parameters
    ----------
    train : callable
        ``train(config, epochs, checkpoint) -> (score, checkpoint)``, run on a worker: train
        ``epochs`` more budget units (epochs, say) from ``checkpoint`` (None at rung 0) and
        return the score and the new checkpoint (picklable). It must be deterministic given
        its inputs for a run to be repeatable. An exception marks the trial ``"failed"``;
        the run goes on.
    space : mapping or sequence of mappings
        A search space for :func:`sample_configs`, or the configurations themselves.
    client : distributed.Client, optional
        Default: the current client.
    n_configs : int, optional
        Configurations drawn from ``space`` (config ``blockflow.tune.n-configs``).
    eta : int, optional
        Reduction factor: the top ``1/eta`` of a rung is promoted, and each rung trains
        ``eta`` times the budget of the one below (config ``blockflow.tune.eta``).
    min_budget, max_budget : float, optional
        Budget units of rung 0 and of the top rung (config ``blockflow.tune.min-budget``,
        ``blockflow.tune.max-budget``).
    mode : {"max", "min"}, default "max"
        Whether a higher or a lower score is better.
    seed : int, default 0
        Seed of the configurations drawn.
    synchronous : bool, default False
        Run synchronous successive halving instead (rung barrier, Dask's placement): the
        baseline ASHA is measured against.
    promotion : {"certain-first", "asha"}, optional
        Order of promotions (config ``blockflow.tune.promotion``, default
        ``"certain-first"``, see the module doc): promotions synchronous SH is sure to make
        first, then new configurations, then ASHA's speculative promotions for threads that
        would idle (SH's work without its barriers); or ``"asha"``, Li et al.'s order (any
        promotion before a new configuration: more work, busier devices).
    publish : bool, default True
        Publish the running trials in the scheduler's metadata for blockflow's dashboard
        page.
    name : str, default "tune"
        Shown on the dashboard.

    Returns
    -------
    TuneResult

    Raises
    ------
    ValueError
        For ``eta`` not a whole number >= 2, a bad ``mode`` or ``promotion``, budgets out
        of order, or no configurations.
    RuntimeError
        If every worker leaves while trials are still to run.

    Warns
    -----
    RuntimeWarning
        When every trial failed (the result holds their errors) or scored NaN.

    Notes
    -----
    Source: ASHA, Li et al. 2020 (MLSys), Algorithm 2; placement by earliest finish time on
    learned worker speeds is a blockflow heuristic (see the module doc).
    """
    from distributed import default_client

    eta = config.get("tune.eta", eta)
    if isinstance(eta, bool) or not float(eta).is_integer() or eta < 2:
        raise ValueError(f"blockflow: tune needs a whole number eta >= 2 (config "
                         f"blockflow.tune.eta), got {eta!r}.")
    eta = int(eta)
    if mode not in ("max", "min"):
        raise ValueError(f"blockflow: tune mode must be 'max' or 'min', got {mode!r}.")
    promotion = config.get("tune.promotion", promotion)
    if promotion not in ("certain-first", "asha"):
        raise ValueError(f"blockflow: tune promotion must be 'certain-first' or 'asha', got "
                         f"{promotion!r} (config blockflow.tune.promotion).")
    min_budget = config.get("tune.min-budget", min_budget)
    max_budget = config.get("tune.max-budget", max_budget)
    if isinstance(space, Mapping):
        configs = sample_configs(space, int(config.get("tune.n-configs", n_configs)), seed)
    else:
        configs = [dict(c) for c in space]
    if not configs:
        raise ValueError("blockflow: tune got no configurations to try; pass a non-empty "
                         "list of configurations, or a search space with n_configs >= 1.")
    client = client or default_client()
    tuner = _Tuner(client, train, configs, eta=eta, min_budget=min_budget,
                   max_budget=max_budget, mode=mode, synchronous=synchronous,
                   publish=publish, name=name, promotion=promotion)
    t0 = time.time()
    try:
        tuner.run_sync() if synchronous else tuner.run_async()
        if not synchronous:
            tuner.write_record()
    finally:
        for fut in list(tuner.running):
            tuner.outputs.pop(fut).cancel()
            fut.cancel()
        if publish:
            try:
                tuner._publish(force=True)
            except Exception:  # the client may be closing: the table is only for display
                pass
    result = tuner.result(time.time() - t0)
    _warn_if_nothing_scored(result.trials)
    return result


def _warn_if_nothing_scored(trials) -> None:
    """One warning when no trial gave a score to rank by: every trial failed or scored NaN
    (a diverged model, NaN-holding data); ``best_*`` then mean nothing."""
    import warnings

    n = len(trials)
    failed = trials["status"] == "failed" if n else None
    if not n or not (failed | trials["score"].isna()).all():
        return
    k = int(failed.sum())
    if k == n:
        what = f"every one of the {n} trials failed; the first error: " \
               f"{trials['error'].iloc[0]}"
    else:
        what = (f"every one of the {n} trials " + (f"failed ({k}) or " if k else "")
                + "scored NaN (a diverged model, or NaN in the data it scored on); the "
                "best trial is arbitrary: check the score your train function returns")
        if k:
            what += f"; the first error: {trials.loc[failed, 'error'].iloc[0]}"
    warnings.warn(f"blockflow: {what}", RuntimeWarning, stacklevel=3)
