"""blockflow's device-memory policy for distributed's Active Memory Manager.

:class:`DeviceMemoryAMMPolicy` relieves workers above the device-memory high-water mark
(the ``memory`` policy), or evens out device bytes by capacity (:func:`blockflow.rebalance`).
Guide: :doc:`/guide/scheduling`, "Evening out device memory".
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dask.utils import parse_bytes

from blockflow import config
from blockflow._distributed import AMMPolicy, HeldResult, MemorySuggestion, WorkerView

__all__ = ["DeviceBytes", "DeviceMemoryAMMPolicy"]

#: Plans after which a copy that never landed is forgotten (and its block planned afresh).
_MAX_AGE = 2


@dataclass(frozen=True)
class DeviceBytes:
    """Device bytes held per worker (``held``, each replica counted) against capacity-weighted
    targets (``target``, by ``gpu-memory-total``), the ``largest_block`` and the ``tolerance``
    (bytes off target allowed).
    """

    held: dict[str, int]
    target: dict[str, float]
    largest_block: int
    tolerance: int

    @property
    def deviation(self) -> dict[str, float]:
        """Worker address -> held minus target bytes (positive: over its share)."""
        return {a: self.held[a] - self.target[a] for a in self.held}

    @property
    def max_deviation(self) -> float:
        """Largest absolute deviation from a target, bytes."""
        return max((abs(d) for d in self.deviation.values()), default=0.0)

    @property
    def balanced(self) -> bool:
        """Whether every worker is within ``tolerance`` bytes of its target."""
        return self.max_deviation <= self.tolerance

    @property
    def within_one_block(self) -> bool:
        """Whether every worker is within ``largest_block`` (+1) bytes of its target."""
        return self.max_deviation <= self.largest_block + 1


@dataclass
class _Move:
    source: str
    target: str
    nbytes: int
    age: int = 0


class DeviceMemoryAMMPolicy(AMMPolicy):
    """Active Memory Manager policy for device memory: relieve full devices, or even out the
    device bytes by capacity.

    Default: results on a worker at or above ``memory_high`` are copied to roomy workers (below
    ``memory_low``) and dropped the next cycle, largest first. ``even=True``: a greedy descent
    on the squared deviations from capacity-weighted targets (cf. ``Client.rebalance``), ending
    within one block of them unless blocks cannot move. blockflow heuristics; moves are logged
    as ``memory-move``.

    Parameters
    ----------
    memory_high, memory_low : float, optional
        Device-memory fractions 0-1; default ``blockflow.rebalancer.memory-high`` / ``-low``.
    even : bool, default False
    keys, workers : iterable, optional
        With ``even``: keys to balance (``nbytes`` cannot tell device from host results) and
        workers to balance among; default all on / reporting ``gpu-memory-total``.
    tolerance : int or str, optional
        With ``even``: bytes (``"512MiB"``) off target allowed; default half the largest block.

    Raises
    ------
    ValueError
        If ``tolerance`` is negative.

    Attributes
    ----------
    pending : dict
        Key -> move copied, not yet dropped from its source.
    moves : list of dict
        Completed moves: ``{"key", "source", "target", "nbytes"}``.

    Examples
    --------
    In distributed's configuration::

        distributed:
          scheduler:
            active-memory-manager:
              policies:
              - class: blockflow.scheduling.device_memory.DeviceMemoryAMMPolicy
                even: true
    """

    def __init__(self, memory_high: float | None = None, memory_low: float | None = None, *,
                 even: bool = False, keys: Iterable | None = None,
                 workers: Iterable[str] | None = None, tolerance: int | str | None = None):
        self.even = bool(even)
        self.memory_high = float(config.get("rebalancer.memory-high", memory_high))
        self.memory_low = float(config.get("rebalancer.memory-low", memory_low))
        self.keys = None if keys is None else frozenset(
            tuple(k) if isinstance(k, list) else k for k in keys)
        self.workers = None if workers is None else frozenset(workers)
        tol = None if tolerance is None else parse_bytes(tolerance)
        if tol is not None and tol < 0:
            raise ValueError(f"DeviceMemoryAMMPolicy: tolerance must be >= 0 bytes, "
                             f"got {tolerance!r}.")
        self.tolerance = tol
        self.pending: dict[Any, _Move] = {}
        self.moves: list[dict[str, Any]] = []

    def __repr__(self) -> str:
        if not self.even:
            return (f"DeviceMemoryAMMPolicy(memory_high={self.memory_high}, "
                    f"memory_low={self.memory_low})")
        return (f"DeviceMemoryAMMPolicy(even=True, "
                f"keys={'all' if self.keys is None else len(self.keys)}, "
                f"workers={None if self.workers is None else sorted(self.workers)}, "
                f"tolerance={self.tolerance})")

    def plan(self, workers: dict[str, WorkerView], held: Mapping[str, list[HeldResult]]):
        return (self._even if self.even else self._relieve)(workers, held)

    def _relieve(self, workers: dict[str, WorkerView], held: Mapping[str, list[HeldResult]]):
        """Suggestions that move results off the workers above the high-water mark."""
        roomy = {a for a, w in workers.items() if w.status == "running"
                 and w.metrics.gpu_memory_fraction is not None
                 and w.metrics.gpu_memory_fraction < self.memory_low}
        for addr, w in workers.items():
            m = w.metrics
            frac = m.gpu_memory_fraction
            if frac is None or frac < self.memory_high or not roomy - {addr}:
                continue
            to_free = m.gpu_memory_used - self.memory_low * m.gpu_memory_total
            seen = {"gpu_memory_fraction": frac}
            for r in held.get(addr, ()):
                if to_free <= 0:
                    break
                if any(other in roomy for other in r.holders if other != addr):
                    chosen = yield MemorySuggestion("drop", r.key, frozenset({addr}))
                    if chosen is not None:
                        to_free -= r.nbytes
                        self.log("memory-move", addr, f"drop {r.nbytes} B result now held "
                                 f"elsewhere (device memory {frac:.0%})", seen, key=str(r.key))
                else:
                    chosen = yield MemorySuggestion("replicate", r.key, frozenset(roomy - {addr}))
                    if chosen is not None:
                        to_free -= r.nbytes
                        self.log("memory-move", addr, f"copy {r.nbytes} B result off (device "
                                 f"memory {frac:.0%} >= {self.memory_high:.0%})", seen,
                                 key=str(r.key), target=chosen)

    # --- plain-data measures ----------------------------------------------------------------

    def capacities(self, workers: Mapping[str, WorkerView]) -> dict[str, float]:
        """Address -> device memory capacity, bytes, of the workers balanced among."""
        return {a: float(w.metrics.gpu_memory_total) for a, w in sorted(workers.items())
                if w.status == "running" and w.metrics.has_gpu
                and (self.workers is None or a in self.workers)}

    def _blocks(self, caps: Mapping[str, float],
                held: Mapping[str, list[HeldResult]]) -> dict[Any, tuple[int, set[str]]]:
        """Key -> (nbytes, holders among ``caps``) of the results counted."""
        blocks: dict[Any, tuple[int, set[str]]] = {}
        for addr in caps:
            for r in held.get(addr, ()):
                if self.keys is not None and r.key not in self.keys:
                    continue
                if r.key not in blocks:
                    blocks[r.key] = (int(r.nbytes), {a for a in r.holders if a in caps})
        return blocks

    def _measure(self, caps, blocks) -> DeviceBytes:
        held = dict.fromkeys(caps, 0)
        for nbytes, holders in blocks.values():
            for a in holders:
                held[a] += nbytes
        total, cap_sum = sum(held.values()), sum(caps.values())
        target = {a: total * c / cap_sum for a, c in caps.items()} if cap_sum else {}
        largest = max((n for n, _ in blocks.values()), default=0)
        tol = largest // 2 if self.tolerance is None else self.tolerance
        return DeviceBytes(held, target, largest, tol)

    def device_bytes(self, workers: Mapping[str, WorkerView],
                     held: Mapping[str, list[HeldResult]]) -> DeviceBytes:
        """Device bytes held per worker and their targets, as the policy counts them."""
        caps = self.capacities(workers)
        return self._measure(caps, self._blocks(caps, held))

    # --- the plan -----------------------------------------------------------------------------

    def _even(self, workers: dict[str, WorkerView], held: Mapping[str, list[HeldResult]]):
        """Suggestions that even out the device bytes by capacity."""
        caps = self.capacities(workers)
        if len(caps) < 2:
            return
        blocks = self._blocks(caps, held)

        # 1. Finish the moves whose copy has landed: drop the source's replica.
        for key, mv in list(self.pending.items()):
            block = blocks.get(key)
            if block is None or mv.target not in caps or mv.source not in caps:
                del self.pending[key]  # result released, or a worker left
                continue
            nbytes, holders = block
            if mv.target not in holders:
                mv.age += 1
                if mv.age > _MAX_AGE:
                    del self.pending[key]  # the copy never landed: plan the block afresh
                    continue
            elif mv.source in holders:
                chosen = yield MemorySuggestion("drop", key, frozenset({mv.source}))
                if chosen is None:
                    mv.age += 1  # e.g. a task needing it runs there: try again next cycle
                    if mv.age > _MAX_AGE:
                        del self.pending[key]
                        continue
                else:
                    self.log("memory-move", mv.source, f"drop {nbytes} B block: its copy has "
                             f"landed on {mv.target}", {"nbytes": nbytes},
                             key=str(key), target=mv.target)
                    self._done(key, mv)
            else:
                self._done(key, mv)  # dropped by someone else already
            # Count the block where it is going (a move in progress is a move made).
            holders.discard(mv.source)
            holders.add(mv.target)

        # 2. Plan new moves on the bytes as they will be, then suggest the net moves: a block
        # the descent moves twice (a -> b -> c) is copied once (a -> c), or not at all.
        m = self._measure(caps, blocks)
        excess = m.deviation
        free = {a: (workers[a].metrics.gpu_memory_free
                    if workers[a].metrics.gpu_memory_free is not None else caps[a])
                for a in caps}
        # Per worker, its single-copy blocks by size; among equal sizes the first held
        # sorts last, so "largest first" takes it first.
        movable: dict[str, list[tuple[int, int, Any]]] = {a: [] for a in caps}
        origin: dict[Any, str] = {}
        for i, (key, (nbytes, holders)) in enumerate(blocks.items()):
            if len(holders) == 1 and key not in self.pending:
                (origin[key],) = holders
                movable[origin[key]].append((nbytes, -i, key))
        for lst in movable.values():
            lst.sort()
        where: dict[Any, tuple[str, int, int]] = {}  # key -> (holder now, nbytes, order)
        for _ in range(10 * len(origin) + 10):  # a bound; the descent ends well before
            if max(abs(e) for e in excess.values()) <= m.tolerance:
                break
            move = _choose(excess, movable, free)
            if move is None:
                break
            entry, src, dst = move
            movable[src].remove(entry)
            bisect.insort(movable[dst], entry)
            nbytes, order, key = entry
            where[key] = (dst, nbytes, order)
            excess[src] -= nbytes
            excess[dst] += nbytes
            free[dst] -= nbytes
        net = sorted(((nbytes, order, key, dst) for key, (dst, nbytes, order) in where.items()
                      if dst != origin[key]), key=lambda t: (-t[0], -t[1]))
        for nbytes, _, key, dst in net:
            src = origin[key]
            seen = {"device_bytes": m.held[src], "target_bytes": round(m.target[src]),
                    "receiver_device_bytes": m.held[dst],
                    "receiver_target_bytes": round(m.target[dst])}
            chosen = yield MemorySuggestion("replicate", key, frozenset({dst}))
            if chosen is None:
                continue  # declined (e.g. the result is being released): it stays put
            self.pending[key] = _Move(src, chosen, nbytes)
            self.log("memory-move", src, f"copy {nbytes} B block to {chosen}: {src} holds "
                     f"{m.held[src]} B of device blocks against a capacity-weighted target "
                     f"of {round(m.target[src])} B (tolerance {m.tolerance} B)", seen,
                     key=str(key), target=chosen)

    def _done(self, key, mv: _Move) -> None:
        self.moves.append({"key": key, "source": mv.source, "target": mv.target,
                           "nbytes": mv.nbytes})
        del self.pending[key]


def _choose(excess: dict[str, float], movable: dict[str, list[tuple[int, int, Any]]],
            free: dict[str, float]):
    """The next move ``(block, source, receiver)`` that lowers the squared deviations, or None.

    The largest block that fits a receiver's deficit and free memory; else the one closest to
    half the gap.
    """
    # A byte of slack everywhere: targets are fractional, and float rounding must not turn
    # an even swap (block == gap) into a "gain".
    sources = sorted((a for a in excess if excess[a] >= 1 and movable[a]),
                     key=lambda a: -excess[a])
    receivers = sorted((a for a in excess if excess[a] <= -1), key=lambda a: excess[a])
    for s in sources:
        sizes = [b[0] for b in movable[s]]
        for r in receivers:
            # Fits the deficit: below -excess[r], hence below the gap too.
            i = bisect.bisect_right(sizes, min(-excess[r], free[r])) - 1
            if i >= 0 and sizes[i] > 0:
                return movable[s][i], s, r
    for s in sources:
        sizes = [b[0] for b in movable[s]]
        for r in receivers:
            gap = excess[s] - excess[r]
            # Overshoots the receiver's target but still narrows the gap: size < gap.
            hi = min(bisect.bisect_left(sizes, gap - 1), bisect.bisect_right(sizes, free[r]))
            j = bisect.bisect_left(sizes, gap / 2, 0, hi)
            best = min((i for i in (j - 1, j) if 0 <= i < hi and sizes[i] > 0),
                       key=lambda i: abs(sizes[i] - gap / 2), default=None)
            if best is not None:
                best = bisect.bisect_right(sizes, sizes[best], 0, hi) - 1  # first held
                return movable[s][best], s, r
    return None
