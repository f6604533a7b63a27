"""The router's policy, free of Dask: requests held per caller, sent where they finish first.

:class:`FairQueue` holds requests centrally, one queue per caller, served by deficit round
robin on cost (Shreedhar and Varghese 1996), so a caller that floods cannot starve a light
one. :func:`dispatch` takes requests off it, in that order, each to the device where it is
expected to finish first (shortest expected finish on learned seconds per unit), only while
that device has room (by default the running task and one more), so no request is committed
to a device queue it would leave later and a slow device gets work only when it would finish
it first. :func:`simulate` runs the policy, or per-device queues by shortest expected finish,
on given arrivals (benchmarks and tests). Guide: docs/guide/ai.md ("Routing").
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence

__all__ = ["FairQueue", "Lane", "dispatch", "simulate"]


class FairQueue:
    """Requests waiting to be sent, one FIFO per caller, served by deficit round robin on cost.

    Each visit tops a caller's deficit up by the largest waiting head cost and serves it while
    its deficit covers its head request, then the next caller's turn comes: callers share the
    devices by cost, whatever rate each sends at. Requests given back (their worker was lost)
    go before every caller's. ``dead(item)`` marks items to drop unsent (answered already).
    """

    def __init__(self, dead: Callable[[Any], bool] | None = None):
        self._dead = dead or (lambda item: False)
        self._queues: dict[Hashable, deque] = {}  # caller -> deque of (item, cost)
        self._order: deque = deque()  # callers with requests, in turn order
        self._deficit: dict[Hashable, float] = {}
        self._topped = False  # whether the caller at the front has had this visit's quantum
        self._first: deque = deque()  # (item, cost) given back: sent before any caller's
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def callers(self) -> dict[Hashable, int]:
        """Requests waiting per caller."""
        return {c: len(q) for c, q in self._queues.items()}

    def push(self, item, caller: Hashable, cost: float) -> None:
        """Queue ``item`` of ``cost`` (>= 0) behind ``caller``'s earlier requests."""
        if caller not in self._queues:
            self._queues[caller] = deque()
            self._deficit[caller] = 0.0
            self._order.append(caller)
        self._queues[caller].append((item, float(cost)))
        self._n += 1

    def push_first(self, item, cost: float) -> None:
        """Queue ``item`` before every caller's requests (it was sent and came back)."""
        self._first.append((item, float(cost)))
        self._n += 1

    def _drop_dead(self) -> None:
        while self._first and self._dead(self._first[0][0]):
            self._first.popleft()
            self._n -= 1
        for c in list(self._order):
            q = self._queues[c]
            while q and self._dead(q[0][0]):
                q.popleft()
                self._n -= 1
            if not q:
                self._forget(c)

    def _forget(self, caller) -> None:
        if self._order and self._order[0] == caller:
            self._topped = False
        self._order.remove(caller)
        del self._queues[caller], self._deficit[caller]

    def _next(self) -> tuple[Hashable | None, tuple]:
        """The caller whose turn it is and its head ``(item, cost)`` (None: given back)."""
        self._drop_dead()
        if self._first:
            return None, self._first[0]
        if not self._order:
            raise IndexError("FairQueue is empty")
        quantum = max(q[0][1] for q in self._queues.values())
        while True:
            c = self._order[0]
            head = self._queues[c][0]
            if not self._topped:
                self._deficit[c] += quantum
                self._topped = True
            if self._deficit[c] >= head[1] - 1e-12:
                return c, head
            self._order.rotate(-1)  # its turn is over; its deficit carries to the next
            self._topped = False

    def peek(self) -> tuple[Any, float]:
        """The next ``(item, cost)`` to send, left queued; IndexError when none waits."""
        return self._next()[1]

    def pop(self) -> tuple[Any, float]:
        """Take the next ``(item, cost)`` to send; IndexError when none waits."""
        c, head = self._next()
        self._n -= 1
        if c is None:
            return self._first.popleft()
        q = self._queues[c]
        q.popleft()
        self._deficit[c] -= head[1]
        if not q:
            self._forget(c)
        elif self._deficit[c] < q[0][1] - 1e-12:  # its turn is over: the next caller's
            self._order.rotate(-1)
            self._topped = False
        return head

    def peek_caller(self, caller: Hashable) -> tuple[Any, float]:
        """``caller``'s next ``(item, cost)``, left queued; IndexError when none waits."""
        self._drop_dead()
        q = self._queues.get(caller)
        if not q:
            raise IndexError(f"no request of {caller!r} waits")
        return q[0]

    def pop_caller(self, caller: Hashable) -> tuple[Any, float]:
        """Take ``caller``'s next ``(item, cost)`` out of turn, its deficit charged;
        IndexError when it has none waiting."""
        self._drop_dead()
        q = self._queues.get(caller)
        if not q:
            raise IndexError(f"no request of {caller!r} waits")
        head = q.popleft()
        self._n -= 1
        self._deficit[caller] = max(self._deficit[caller] - head[1], 0.0)
        if not q:
            self._forget(caller)
        return head

    def upcoming(self) -> Iterator[float]:
        """The costs of the requests to send, in order, left queued (do not change the queue
        while iterating)."""
        self._drop_dead()
        for _, c in self._first:
            yield c
        if not self._order:
            return
        order, deficit, topped = deque(self._order), dict(self._deficit), self._topped
        pos = dict.fromkeys(order, 0)
        quantum = max(q[0][1] for q in self._queues.values())
        while order:
            c = order[0]
            q = self._queues[c]
            if not topped:
                deficit[c] += quantum
                topped = True
            cost = q[pos[c]][1]
            if deficit[c] < cost - 1e-12:
                order.rotate(-1)
                topped = False
                continue
            yield cost
            deficit[c] -= cost
            pos[c] += 1
            if pos[c] == len(q):
                order.popleft()
                topped = False
            elif deficit[c] < q[pos[c]][1] - 1e-12:
                order.rotate(-1)
                topped = False

    def items(self) -> list:
        """Every waiting item (given back first, then by caller), for cancelling."""
        return [i for i, _ in self._first] + [i for q in self._queues.values() for i, _ in q]

    def clear(self) -> None:
        self.__init__(self._dead)


@dataclass
class Lane:
    """One device as :func:`dispatch` sees it.

    ``ready``: seconds until the work already sent to it ends (per thread); ``spu``: its
    seconds per unit of cost; ``room``: tasks it may still be sent (its running task and one
    waiting behind it, less those in flight); ``cap``: requests it may still be sent (None:
    no bound); ``order``: tie-break key (equal finishes go to the lowest).
    """

    ready: float
    spu: float
    room: int
    cap: int | None = None
    order: Any = 0
    sent: list = field(default_factory=list)  # batches sent by this dispatch: [items, seconds]


def dispatch(queue: FairQueue, lanes: Mapping[str, Lane], *, batch_size: int,
             batch_seconds: float, caller: Callable[[Any], Hashable] | None = None
             ) -> dict[str, list[tuple[list, float]]]:
    """Take requests off ``queue``, in its order, for the devices with room that finish them
    first.

    A request of ``cost`` is expected to finish on lane ``w`` at ``ready_w + spu_w x cost``.
    The next requests in fair order (enough to fill every device) are planned each on its
    earliest lane, full or not; a lane with room then takes as many as it was planned,
    the first in fair order, into batches of at most ``batch_size`` requests and
    ``batch_seconds`` of expected work (one request whatever its cost). Requests planned on
    full lanes wait for them: a device is never idle while a request it would finish first
    waits, a slow device takes a request only when it would finish it before a faster one
    gets to it, and no request is committed to a device queue it would leave later.
    With ``caller`` (item -> its caller), a batch holds one caller's requests: a light
    caller's request is not answered only once a flood's batch around it is done.
    Shortest expected finish (join the shortest expected delay, Whitt 1986) on central
    queues, a blockflow heuristic.

    Returns
    -------
    dict
        Lane -> batches ``(items, expected seconds)`` to send, in order; ``lanes`` are updated.
    """
    lanes = {w: lane for w, lane in lanes.items() if lane.spu > 0}
    if not any(lane.room > 0 and lane.cap != 0 for lane in lanes.values()):
        return {}
    ready, want = {w: lane.ready for w, lane in lanes.items()}, Counter()
    # the lanes with room take at most their room's batches now: plan until each is past that
    open_ = {w: lane.ready + batch_seconds * lane.room for w, lane in lanes.items()
             if lane.room > 0 and lane.cap != 0}
    limit = batch_size * sum(max(lane.room, 0) + 1 for lane in lanes.values())
    for cost in itertools.islice(queue.upcoming(), limit):  # each where it finishes first
        best = min(lanes, key=lambda w: (ready[w] + lanes[w].spu * cost,
                                         lanes[w].room <= 0, lanes[w].order))
        ready[best] += lanes[best].spu * cost
        want[best] += 1
        if best in open_ and ready[best] >= open_[best]:
            del open_[best]
            if not open_:
                break
    while len(queue):
        try:
            item, cost = queue.peek()
        except IndexError:  # only answered items were left
            break
        fits = {}
        for w, lane in lanes.items():
            if want[w] <= 0 or lane.cap == 0:
                continue
            b = lane.sent[-1] if lane.sent else None
            if b is not None and len(b[0]) < batch_size and (
                    b[1] + lane.spu * cost <= batch_seconds) and (
                    caller is None or caller(item) == caller(b[0][0])):
                fits[w] = b
            elif lane.room > 0:
                fits[w] = None
        if not fits:
            break
        best = min(fits, key=lambda w: (lanes[w].ready + lanes[w].spu * cost, lanes[w].order))
        lane, b = lanes[best], fits[best]
        if b is None:
            lane.room -= 1
            b = [[], 0.0]
            lane.sent.append(b)
        queue.pop()
        b[0].append(item)
        b[1] += lane.spu * cost
        lane.ready += lane.spu * cost
        want[best] -= 1
        if lane.cap is not None:
            lane.cap -= 1
    return {w: [(b[0], b[1]) for b in lane.sent] for w, lane in lanes.items() if lane.sent}


def simulate(arrivals: Sequence[float], speeds: Sequence[float], *, seconds: float = 0.01,
             callers: Sequence[Hashable] | None = None, policy: str = "router",
             batch_size: int = 64, batch_seconds: float = 0.05, overhead: float = 0.0,
             ) -> dict[str, Any]:
    """Latencies of requests of ``seconds`` (at speed 1) arriving at ``arrivals`` (seconds).

    ``policy="router"``: :func:`dispatch` from a :class:`FairQueue` (a batch's answers come
    back together at its end, ``overhead`` seconds after); ``"sef"``: each request, on
    arrival, joins the FIFO of the device where it finishes first and is answered when done.
    Speeds are known exactly. Returns ``latency`` (per request), ``device`` (its index) and
    ``log`` (per dispatch: the time, requests waiting after it and devices idle).
    """
    n, k = len(arrivals), len(speeds)
    callers = callers or [0] * n
    latency, device, log = [0.0] * n, [0] * n, []
    if policy == "sef":
        free = [0.0] * k
        for i, t in enumerate(arrivals):
            w = min(range(k), key=lambda w: (max(free[w], t) + seconds / speeds[w], w))
            free[w] = max(free[w], t) + seconds / speeds[w]
            latency[i], device[i] = free[w] + overhead - t, w
        return {"latency": latency, "device": device, "log": log}
    queue, tasks = FairQueue(), [deque() for _ in range(k)]  # per device: [end, items]
    events = [(t, 0, i) for i, t in enumerate(arrivals)]
    heapq.heapify(events)
    while events:
        now, kind, i = heapq.heappop(events)
        if kind == 0:
            queue.push(i, callers[i], 1.0)
        else:  # device i's running task ended: its answers come back
            _, items = tasks[i].popleft()
            for r in items:
                latency[r] = now + overhead - arrivals[r]
            if tasks[i]:  # the next one starts now
                tasks[i][0][0] = now + sum(seconds / speeds[i] for _ in tasks[i][0][1])
                heapq.heappush(events, (tasks[i][0][0], 1, i))
        lanes = {w: Lane(ready=max(tasks[w][0][0] - now, 0.0) + sum(
                     len(b[1]) * seconds / speeds[w] for b in list(tasks[w])[1:])
                     if tasks[w] else 0.0, spu=seconds / speeds[w],
                     room=2 - len(tasks[w]), order=(-speeds[w], w)) for w in range(k)}
        for w, batches in dispatch(queue, lanes, batch_size=batch_size,
                                   batch_seconds=batch_seconds).items():
            for items, est in batches:
                for r in items:
                    device[r] = w
                tasks[w].append([now + est if not tasks[w] else None, items])
                if len(tasks[w]) == 1:
                    heapq.heappush(events, (now + est, 1, w))
        log.append((now, len(queue), [w for w in range(k) if not tasks[w]]))
    return {"latency": latency, "device": device, "log": log}
