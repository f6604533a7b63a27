"""Device time against wall time, per GPU worker and run, from the workers' heartbeats.

A GPU worker reports ``blockflow-device-seconds``: the seconds its device was busy with its
tasks, overlapping tasks counted once (:mod:`blockflow.device_streams` on a real GPU, the
busy time of a simulated one). Each tick the scheduler plugin keeps the latest value of each
worker with the times that bracket it (:meth:`DeviceTime.sample`); a run's device seconds on
a worker are the difference between the last value taken before the run's first task there
started and the first value taken after its last task there stopped. When a run ends, each
of its GPU workers gets one ``device-time`` record (logged, never acted on): device seconds
against the run's wall time on that worker (first start to last stop) and its tasks' compute
time (their durations summed, more than the wall time with several threads). Guide:
:doc:`/guide/scheduling`, "Decisions".
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping
from typing import Any

from blockflow.scheduling.actions import Record, Recorded

__all__ = ["DeviceTime"]


class DeviceTime:
    """Heartbeat samples of the workers' device seconds, and the runs' figures from them.

    Parameters
    ----------
    keep : int, default 512
        Samples kept per worker (the oldest forgotten first).
    patience : float, default 10.0
        Seconds after a run's end to wait for a worker's heartbeat taken after it; a worker
        still without one then is left out of the run's records.
    recent : int, default 16
        Most recently active runs looked at each tick.
    """

    def __init__(self, keep: int = 512, patience: float = 10.0, recent: int = 16):
        self.keep, self.patience, self.recent = int(keep), float(patience), int(recent)
        # worker -> (after, before, seconds): taken after ``after`` (the worker's clock)
        # and before ``before`` (the scheduler's), seconds since the epoch; oldest first
        self.samples: dict[str, deque] = {}
        self.first: dict[str, tuple] = {}  # worker -> its first sample (kept: cumulative)
        self.recorded: OrderedDict[str, int] = OrderedDict()  # run id -> graphs at record

    def sample(self, samples: Mapping[str, tuple[float, float, float]]) -> None:
        """Keep each worker's latest ``(after, before, seconds)`` (a heartbeat seen twice:
        once). O(workers)."""
        for worker, s in samples.items():
            q = self.samples.get(worker)
            if q is None:
                q = self.samples[worker] = deque(maxlen=self.keep)
                self.first[worker] = tuple(s)
            if not q or q[-1] != s:
                q.append(tuple(s))

    def forget(self, worker: str) -> None:
        """``worker`` left the cluster."""
        self.samples.pop(worker, None)
        self.first.pop(worker, None)

    def _before(self, worker: str, t: float) -> float | None:
        """Device seconds at a time surely not after ``t``; 0.0 when the worker's first
        sample is 0 (it did nothing before); None if unknown."""
        q = self.samples.get(worker)
        if not q:
            return None
        best = None
        for _, before, value in q:
            if before > t:
                break
            best = value
        return 0.0 if best is None and q[0][2] == 0.0 else best

    def _after(self, worker: str, t: float) -> float | None:
        """Device seconds at a time surely not before ``t``, or None if none came yet."""
        for after, _, value in self.samples.get(worker, ()):
            if after >= t:
                return value
        return None

    def figures(self, run, worker: str, *, final: bool = True) -> dict[str, float] | None:
        """``run``'s figures on ``worker``: ``device_seconds`` (at most ``wall_seconds``),
        ``wall_seconds`` (first start to last stop there), ``compute_seconds`` (its tasks'
        durations summed) and ``device_busy`` (device / wall, 0-1); None where the worker
        ran none of its tasks, reports no device seconds or, ``final``, no heartbeat after
        the run's last task there came yet. Not ``final`` (a run going on): to the worker's
        latest heartbeat."""
        span = run.spans.get(worker)
        q = self.samples.get(worker)
        if not span or not q:
            return None
        start, stop = span
        first = self._before(worker, start)
        if final:
            last = self._after(worker, stop)
        else:
            last, stop = q[-1][2], max(stop, q[-1][0])
        if first is None or last is None:
            return None
        wall = max(stop - start, 0.0)
        device = min(max(last - first, 0.0), wall)
        return {"device_seconds": round(device, 6), "wall_seconds": round(wall, 6),
                "compute_seconds": round(float(run.busy.get(worker, 0.0)), 6),
                "device_busy": round(device / wall, 4) if wall > 0 else 0.0}

    def cumulative(self) -> dict[str, dict[str, float]]:
        """Per worker, since its first sample: ``device_seconds`` (all the worker reported),
        ``wall_seconds`` and ``device_busy`` (device / wall, 0-1) between its first and
        latest samples."""
        out = {}
        for worker, q in self.samples.items():
            (t0, _, v0), (t1, _, v1) = self.first.get(worker, q[0]), q[-1]
            wall = max(t1 - t0, 0.0)
            device = min(max(v1 - v0, 0.0), wall)
            out[worker] = {"device_seconds": round(v1, 6), "wall_seconds": round(wall, 6),
                           "device_busy": round(device / wall, 4) if wall > 0 else 0.0}
        return out

    def run_figures(self, run) -> dict[str, dict[str, float]]:
        """Worker -> :meth:`figures` of ``run`` (final once it ended), for the workers that
        have them."""
        final = run.ended is not None and run.pending <= 0
        out = {}
        for worker in sorted(run.spans):
            f = self.figures(run, worker, final=final)
            if f is not None:
                out[worker] = f
        return out

    def records(self, runs, now: float) -> Iterator[Record]:
        """One ``device-time`` record per GPU worker of each run that ended since the last
        call (looked at: the :attr:`recent` most recently active runs of ``runs``, a
        :class:`~blockflow.scheduling.runs.RunTracker`); a run given more work after its
        records is recorded again when it ends again. ``now``: seconds since the epoch."""
        for n, run in enumerate(reversed(runs.runs.values())):
            if n >= self.recent:
                break
            if run.ended is None or run.pending > 0 or self.recorded.get(run.id) == run.graphs:
                continue
            gpu = [w for w in sorted(run.spans) if self.samples.get(w)]
            figures = {w: self.figures(run, w) for w in gpu}
            if any(f is None for f in figures.values()) and now - run.ended < self.patience:
                continue  # a heartbeat after the run's end is still to come
            self.recorded[run.id] = run.graphs
            self.recorded.move_to_end(run.id)
            while len(self.recorded) > 1000:
                self.recorded.popitem(last=False)
            for worker, f in figures.items():
                if f is not None:
                    yield _record(run, worker, f)


def _record(run, worker: str, f: dict[str, Any]) -> Record:
    return Record(
        Recorded.DEVICE_TIME, worker,
        f"run {run.name!r}: the device was busy {f['device_busy']:.0%} of the run's "
        f"{f['wall_seconds']:.3g} s on this worker ({f['device_seconds']:.3g} device seconds; "
        f"its tasks computed {f['compute_seconds']:.3g} s)",
        {"run": run.id, **f})
