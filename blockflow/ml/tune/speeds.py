"""What tells the tuner each worker's relative speed, and what a trial task will cost.

Sources, most trusted first: the scheduler plugin's confident speeds, the trials' own
durations, the record earlier calls left (:data:`SPEEDS_KEY`) and declared speeds, each put
on the scale of those above (:func:`layered`).
"""

from __future__ import annotations

import math
from statistics import median
from typing import Mapping

from blockflow.scheduling.estimate import prior_seconds_per_unit

__all__ = ["SPEEDS_KEY", "SpeedEvidence", "layered"]

#: Scheduler metadata key of the cluster's speed record: worker address -> the relative
#: speed the trials showed there, kept across ``tune`` calls.
SPEEDS_KEY = ("blockflow", "tune-speeds")


class SpeedEvidence:
    """Each worker's speed as the evidence tells it (speed 1: the median worker's)."""

    def __init__(self):
        self.samples: list[tuple[str, float, float, int]] = []  # worker, s, epochs, rung
        self.cold: list[tuple[str, float, float, int]] = []  # a worker's first: pays imports
        self.per_trial: dict[int, list[tuple[str, float, float]]] = {}  # warm, per trial
        self.warm: set[str] = set()
        self.plugin: dict[str, float] = {}  # worker -> speed, known with confidence
        self.record: dict[str, float] = {}  # earlier calls' (SPEEDS_KEY)
        self.declared: dict[str, float] = {}  # the devices' declared speeds

    def add(self, worker: str, seconds: float, epochs: float, rung: int, trial: int) -> None:
        """A trial task of ``epochs`` units at ``rung`` took ``seconds`` on ``worker``."""
        if worker in self.warm:
            self.samples.append((worker, seconds, epochs, rung))
            self.per_trial.setdefault(trial, []).append((worker, seconds, epochs))
        else:
            self.cold.append((worker, seconds, epochs, rung))
        self.warm.add(worker)

    def own(self) -> dict[str, float]:
        """Each worker's time per unit against the median of its rung, from its warm
        tasks."""
        per_rung: dict[int, list[float]] = {}
        seen: dict[int, set] = {}
        for w, secs, epochs, rung in self.samples + self.cold:
            per_rung.setdefault(rung, []).append(secs / epochs)
            seen.setdefault(rung, set()).add(w)
        ref = {k: median(v) for k, v in per_rung.items() if len(seen[k]) >= 2}
        warm = {w for w, _, _, rung in self.samples if rung in ref}
        use = [s for s in self.samples if s[3] in ref] + [
            s for s in self.cold if s[3] in ref and s[0] not in warm]
        own: dict[str, list[float]] = {}
        for w, secs, epochs, rung in use:
            if ref[rung] > 0 and secs > 0:
                own.setdefault(w, []).append(math.log(secs / epochs / ref[rung]))
        return {w: math.exp(-median(v)) for w, v in own.items()}

    def speeds(self, workers) -> dict[str, float]:
        """Each of ``workers``' speed from the first source that knows it, else 1.0."""
        known = layered(workers, {**self.own(), **self.plugin}, self.record, self.declared)
        return {w: known.get(w, 1.0) for w in workers}

    def blind(self, worker: str) -> bool:
        """Whether nothing at all tells ``worker``'s speed yet."""
        return not (worker in self.plugin or worker in self.record or worker in self.declared
                    or any(s[0] == worker for s in self.samples + self.cold))

    def unit_seconds(self, speeds: Mapping[str, float]) -> float:
        """Seconds one budget unit takes at speed 1 (1.0 before any task)."""
        v = [secs * speeds.get(w, 1.0) / epochs for w, secs, epochs, _ in self.samples
             or self.cold]
        return median(v) if v else 1.0

    def cost(self, trial: int, epochs: float, speeds: Mapping[str, float],
             unit: float) -> float:
        """Seconds ``epochs`` units of ``trial`` take at speed 1."""
        own = self.per_trial.get(trial)
        if not own:
            return epochs * unit
        return epochs * median(secs * speeds.get(w, 1.0) / e for w, secs, e in own)

    def read_record(self, client) -> None:
        """Load the speeds earlier ``tune`` calls saw on this cluster (:data:`SPEEDS_KEY`)."""
        try:
            record = client.get_metadata(list(SPEEDS_KEY), default=None)
        except Exception:  # an old or closing scheduler: no record, not an error
            record = None
        self.record = {a: float(v) for a, v in (record or {}).items()
                       if isinstance(v, (int, float)) and math.isfinite(v) and v > 0}

    def write_record(self, client) -> None:
        """Merge this run's evidence into the record (:data:`SPEEDS_KEY`)."""
        own = self.own()
        if own:
            client.set_metadata(list(SPEEDS_KEY),
                                layered(set(own) | set(self.record), own, self.record))


def layered(workers, *sources: Mapping[str, float]) -> dict[str, float]:
    """Relative speeds of ``workers`` from sources of evidence, most trusted first.

    Each worker's speed comes from the first source that has it, rescaled through shared
    workers (:func:`blockflow.scheduling.estimate.prior_seconds_per_unit`).
    """
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
