"""The move rule: hand waiting tasks from the workers that will finish last to those free
soonest."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from blockflow._distributed import TaskView, WorkerView
from blockflow.scheduling import estimate
from blockflow.scheduling.actions import Action, Decision, Record, Recorded
from blockflow.scheduling.rules.base import Rule, RuleContext, fmt_bytes, fmt_seconds
from blockflow.scheduling.rules.hold import pessimistic_speed

__all__ = ["MoveRule", "best_target"]


class MoveRule(Rule):
    """Moves of waiting tasks, latest projected finish first.

    A greedy list-scheduling repair (after LPT, Graham 1969), a blockflow heuristic: the last
    waiting task of the worker finishing last moves to the worker that would finish it soonest
    (``place``, inputs' transfer included) when that gains more than ``min_gain`` and twice the
    transfer (:func:`~blockflow.scheduling.estimate.move_pays`). A task moves once between
    busy workers (:attr:`moved_off`); tasks on paused workers move at once, outside the
    budget (distributed#5235), but those of a worker held back for slowness (it runs them,
    slowly) move as any, judged at its pessimistic speed; restricted tasks (resources,
    workers) fill idle allowed threads before their duration is measured; a move refused for
    its transfer is logged as ``keep``. Guide: :doc:`/guide/scheduling`, "Moving tasks".

    Parameters
    ----------
    place : callable
        The earliest-finish placement, :func:`best_target`'s signature.
    move_budget : int
        Most tasks moved per tick between running workers.
    min_gain : float
        Smallest gain in projected finish time, seconds, worth a move.
    slowed : callable, optional
        ``slowed(snapshot, address)``: an evidently slowed worker takes no moved work.
    moved_memory : int, default 10000
        Tasks remembered in :attr:`moved_off`.
    """

    #: A balancing move's input transfer may take at most this share of the task's compute
    #: time on the target; within it the gain must pay twice for the transfer
    #: (:func:`~blockflow.scheduling.estimate.move_pays`). It was 0.25: with 32 MiB inputs
    #: of 0.3 s tasks every move was refused while distributed's stealing was suspended, and
    #: nothing balanced (1.36x plain Dask, benchmarks/stragglers.py large-inputs). Tasks
    #: stuck on paused workers move whatever their inputs.
    max_transfer_share = 1.0
    #: The same bound while speeds are not known to differ (filling idle threads): only
    #: tasks whose inputs are cheap to send move then.
    max_fill_transfer_share = 0.05
    #: A move refused for its transfer is logged once per tick at most, and again for the
    #: same two workers only after this many seconds.
    refusal_interval = 30.0

    def __init__(self, place: Callable, move_budget: int, min_gain: float,
                 slowed: Callable[[Any, str], bool] | None = None, moved_memory: int = 10_000):
        self.place = place
        self.move_budget = move_budget
        self.min_gain = min_gain
        self.slowed = slowed
        self.moved_memory = moved_memory
        # key -> workers the task was moved off (bounded, oldest first out)
        self.moved_off: OrderedDict[Any, set[str]] = OrderedDict()
        # kept up to date from the changed workers only (nothing_to_move): stopped workers
        # holding tasks, running workers with a free thread, with more tasks than threads
        self._index: dict[str, bool] = {}
        self.blocked: set[str] = set()
        self.free: set[str] = set()
        self.over: set[str] = set()
        # (worker, target) -> when a move between them was last refused for its transfer
        # and logged (bounded, oldest first out)
        self.refused: OrderedDict[tuple[str, str], float] = OrderedDict()

    def run(self, snap, context: RuleContext) -> list[Decision]:
        if snap.event != "tick":
            return []
        out = self.moves(snap, context.paused_now)
        context.taken |= {d.target for d in out}
        return out

    def _update_index(self, snap) -> None:
        """Update :attr:`blocked`, :attr:`free` and :attr:`over` from the workers that changed."""
        workers = snap.workers
        if snap.changed is None or len(self._index) > 2 * len(workers) + 16:
            self._index.clear()
            self.blocked.clear(), self.free.clear(), self.over.clear()
            todo = workers
        else:
            todo = snap.changed
        blocked, free, over = self.blocked, self.free, self.over
        for a in todo:
            w = workers.get(a)
            if w is None:
                continue
            self._index[a] = True
            blocked.discard(a), free.discard(a), over.discard(a)
            if w.status != "running":
                # (a stopped worker's tasks wait unless they run: moves take only those)
                if w.processing > w.executing:
                    blocked.add(a)
            elif w.processing < w.nthreads:
                free.add(a)
            elif w.processing > w.nthreads:
                over.add(a)

    def nothing_to_move(self, snap, paused_now) -> bool:
        """Whether this snapshot certainly gives no move, judged from the changed workers only (a
        tick's cost grows with the workers that changed).
        """
        self._update_index(snap)
        workers = snap.workers
        stuck = any(a in workers for a in self.blocked) or any(
            workers[a].processing > workers[a].executing for a in paused_now if a in workers)
        if stuck:
            return False
        if snap.queued:
            return True
        if snap.balancing:
            return False
        return not (any(a in workers for a in self.free)
                    and any(a in workers and a not in paused_now for a in self.over))

    def moves(self, snap, paused_now) -> list[Decision]:
        if self.nothing_to_move(snap, paused_now):
            return []
        views = snap.workers
        # a worker evidently slowed right now (see the hold rule) takes no moved work
        thieves = [w for w in views.values()
                   if w.status == "running" and w.address not in paused_now
                   and not (self.slowed is not None and self.slowed(snap, w.address))]
        if not thieves:
            return []
        blocked = {a for a, w in views.items() if w.status != "running" or a in paused_now}
        # A worker held back for slowness (the hold rule) still runs the tasks it holds,
        # slowly: they move when the gain pays for sending their inputs, as any move
        # (rescued whatever their inputs, they paid transfers plain Dask never makes)
        held = {a for a in blocked if a not in snap.stopped and (
            a in snap.held or (not views[a].paused_by_blockflow and self.slowed is not None
                               and self.slowed(snap, a)))}
        finish = {a: (math.inf if a in blocked and a not in held else w.projected_finish)
                  for a, w in views.items()}
        for a in held:  # at its pessimistic speed
            w = views[a]
            finish[a] = w.occupancy / max(w.nthreads, 1) / max(pessimistic_speed(snap, a),
                                                                1e-6)
        rate = {a: max(w.speed, 1e-6) * max(w.nthreads, 1) for a, w in views.items()}
        occupancy = {a: w.occupancy for a, w in views.items()}
        # A backup copy runs outside the scheduler's count: its worker is busy for it.
        copying = set(snap.backups.values())
        for t in (t for tasks in snap.running.values() for t in tasks if t.key in snap.backups):
            target = snap.backups[t.key]
            if target in finish:
                finish[target] += t.duration / rate[target]
        # threads with nothing to run, as this tick's moves fill them
        free = {t.address: t.nthreads - t.processing for t in thieves
                if t.processing < t.nthreads and t.address not in copying}
        # Free thread slots of idle workers, filled while speeds are not known to differ.
        fill: dict[str, int] | None = None
        if snap.queued:
            victims = [views[a] for a in blocked]  # the rest pull from the queue
        elif snap.balancing:
            victims = list(views.values())
        else:
            # distributed's stealing balances; blockflow only hands measured work to idle
            # workers (stealing does too, but slowly: cold starts)
            victims = list(views.values())
            fill = dict(free)
        candidates: dict[str, Iterator] = {}
        out: list[Decision] = []
        exhausted: set[str] = set()
        rescued = 0  # rescues off paused workers: outside the budget
        refusal: Decision | None = None  # one move refused for its transfer, per tick
        sending: dict[tuple[str, str], float] = {}  # (from, to) -> seconds of inputs sent
        while len(out) - rescued < self.move_budget:
            # a paused worker's waiting tasks say themselves which of its tasks wait (on one
            # that paused itself, all not started: no thread of it takes one); elsewhere the
            # first ``nthreads`` tasks are about to start
            live = [v for v in victims if v.address not in exhausted
                    and v.processing > (0 if v.address in blocked else v.nthreads)]
            if not live:
                break
            v = max(live, key=lambda w: finish[w.address])
            it = candidates.get(v.address)
            if it is None:
                it = candidates[v.address] = iter(snap.waiting.get(v.address, ()))
            task = next(it, None)
            if task is None:
                exhausted.add(v.address)
                continue
            d = task.duration
            rescue = v.address in blocked and v.address not in held
            # moved before: estimates shift after every move, and chasing a task from busy
            # worker to busy worker only churns; it moves again only to a worker with a
            # free thread that it was never moved off (an idle thread gains for sure)
            moved_off = None if rescue else self.moved_off.get(task.key)
            if moved_off is not None and not any(
                    n > 0 and a not in moved_off for a, n in free.items()):
                continue
            if not rescue and fill is not None and not (
                    fill and (task.duration_measured or task.restricted)):
                # nothing measured to hand out, or nobody idle. A restricted task (resources,
                # workers) is handed out unmeasured: distributed neither queues nor spreads
                # those, it piles them where their input is (distributed#8177), and an idle
                # allowed thread gains for sure when the input is cheap to send (below)
                exhausted.add(v.address)
                continue
            # inputs this tick's moves already send from this worker: a transfer waits
            # behind them on the same link
            queued = {t: secs for (src, t), secs in sending.items() if src == v.address}
            best, best_finish = self.place(
                task, v, thieves, finish, rate, rescue=rescue, fill=fill, moved_off=moved_off,
                free=free, max_transfer_share=self.max_transfer_share,
                max_fill_transfer_share=self.max_fill_transfer_share, sending=queued)
            stay = finish[v.address]
            base_margin = max(self.min_gain, 0.1 * d / rate[v.address])
            if best is None or not (rescue or estimate.move_pays(
                    stay, best_finish, task.comm_cost.get(best.address, 0.0)
                    + queued.get(best.address, 0.0), base_margin)):
                if refusal is None and not rescue and task.comm_cost:
                    refusal = self._refusal(task, v, thieves, finish, rate, stay, base_margin,
                                            fill, moved_off, free)
                    last = None if refusal is None else self.refused.get(
                        (refusal.worker, refusal.target))
                    if last is not None and snap.time - last < self.refusal_interval:
                        refusal = None
                if best is not None:
                    exhausted.add(v.address)  # later tasks on this worker gain even less
                continue
            seen = v.seen()
            seen["input_bytes"] = task.input_bytes
            seen.update(self._transfer(task, best.address))
            if rescue and v.address in snap.stopped:
                here = "never here (worker paused itself: it starts no task)"
            else:
                here = f"{fmt_seconds(stay)} here"
            sent = ""
            if seen["transfer_bytes"]:
                sent = (f"; inputs {fmt_bytes(seen['transfer_bytes'])} in "
                        f"{fmt_seconds(seen['transfer_seconds'])} over a "
                        f"{_rate(seen['link_bandwidth'])} link")
            out.append(Decision(
                Action.MOVE, v.address,
                f"projected finish {here} vs {fmt_seconds(best_finish)} on target{sent}",
                seen, target=best.address, key=task.key))
            rescued += rescue
            if task.comm_cost.get(best.address):
                link = (v.address, best.address)
                sending[link] = sending.get(link, 0.0) + task.comm_cost[best.address]
            self.moved_off.setdefault(task.key, set()).add(v.address)
            self.moved_off.move_to_end(task.key)
            while len(self.moved_off) > self.moved_memory:
                self.moved_off.popitem(last=False)
            if not math.isinf(finish[v.address]):
                # (at the speed the worker is expected to have by the end of its queue)
                occupancy[v.address] = max(occupancy[v.address] - d, 0.0)
                finish[v.address] = v.finish_at(occupancy[v.address])
            finish[best.address] = best_finish
            if best.address in free:
                free[best.address] -= 1
            if fill is not None and best.address in fill:
                fill[best.address] -= 1
                if fill[best.address] <= 0:
                    del fill[best.address]
        if refusal is not None:
            self.refused[refusal.worker, refusal.target] = snap.time
            self.refused.move_to_end((refusal.worker, refusal.target))
            while len(self.refused) > self.moved_memory:
                self.refused.popitem(last=False)
            out.append(refusal)
        return out

    @staticmethod
    def _transfer(task, target: str) -> dict[str, Any]:
        """Bytes, seconds and link bandwidth (bytes per second; None if nothing is sent) of sending
        ``task``'s inputs to ``target``.
        """
        seconds = float(task.comm_cost.get(target, 0.0))
        nbytes = int(task.comm_bytes.get(target, 0))
        return {"transfer_bytes": nbytes, "transfer_seconds": round(seconds, 4),
                "link_bandwidth": round(nbytes / seconds) if seconds > 0 and nbytes else None}

    def _refusal(self, task, v, thieves, finish, rate, stay, margin, fill, moved_off,
                 free) -> Decision | None:
        """A ``keep`` record when ``task`` would move were its inputs free to send."""
        free_task = replace(task, comm_cost={})
        alt, alt_finish = self.place(
            free_task, v, thieves, finish, rate, rescue=False, fill=fill, moved_off=moved_off,
            free=free, max_transfer_share=self.max_transfer_share,
            max_fill_transfer_share=self.max_fill_transfer_share)
        if alt is None or not stay - alt_finish > margin:
            return None  # no move for other reasons: nothing about links to say
        transfer = self._transfer(task, alt.address)
        if not transfer["transfer_seconds"]:
            return None
        compute = task.duration / max(alt.speed, 1e-6)
        share = self.max_transfer_share if fill is None else self.max_fill_transfer_share
        gain = stay - alt_finish - transfer["transfer_seconds"]
        seen = {**v.seen(), "input_bytes": task.input_bytes, **transfer,
                "compute_seconds": round(compute, 4), "gain_seconds": round(gain, 4)}
        return Record(
            Recorded.KEEP, v.address,
            f"move to {alt.address} refused: inputs {fmt_bytes(transfer['transfer_bytes'])} "
            f"take {fmt_seconds(transfer['transfer_seconds'])} over a "
            f"{_rate(transfer['link_bandwidth'])} link, more than {share:.0%} of its "
            f"{fmt_seconds(compute)} compute or half its {fmt_seconds(gain)} gain",
            seen, target=alt.address, key=task.key)


def _rate(bytes_per_second: float | None) -> str:
    return "?" if not bytes_per_second else f"{fmt_bytes(bytes_per_second)}/s"


def best_target(task: TaskView, v: WorkerView, thieves: list[WorkerView],
                finish: dict[str, float], rate: dict[str, float], *, rescue: bool,
                fill: dict[str, int] | None, moved_off: set[str] | None,
                free: dict[str, int], max_transfer_share: float,
                max_fill_transfer_share: float,
                sending: dict[str, float] | None = None) -> tuple[WorkerView | None, float]:
    """The worker of ``thieves`` that would finish ``task`` (waiting on ``v``) soonest, and when;
    ``(None, inf)`` if none may take it.

    HEFT's selection step (Topcuoglu et al. 2002) through
    :func:`blockflow.scheduling.estimate.earliest_finish`, within
    :class:`~blockflow.scheduling.rules.MoveRule`'s limits: allowed workers, idle threads while
    filling, never back to a worker it was moved off, and (unless rescued) inputs sent within
    ``max_transfer_share`` (``max_fill_transfer_share`` while filling) of its compute time;
    ``sending``: target -> seconds of inputs already on their way there from ``v`` (the
    transfer waits behind them).
    """
    sending = sending or {}
    d = task.duration
    eligible = {}
    for t in thieves:
        if t is v or (
                task.allowed_workers is not None and t.address not in task.allowed_workers):
            continue
        if not rescue and fill is not None and t.address not in fill:
            continue
        if moved_off is not None and (free.get(t.address, 0) <= 0
                                      or t.address in moved_off):
            continue
        comm = task.comm_cost.get(t.address, 0.0)
        share = max_transfer_share if fill is None else max_fill_transfer_share
        if not rescue and comm > share * d / max(t.speed, 1e-6):
            continue  # data-bound: balance by moving compute, not data
        eligible[t.address] = t
    placed = estimate.earliest_finish(
        1, {a: finish[a] for a in eligible},
        lambda _, a: d / rate[a] + task.comm_cost.get(a, 0.0) + sending.get(a, 0.0))
    if not placed or not placed[0].finish < math.inf:
        return None, math.inf
    return eligible[placed[0].worker], placed[0].finish
