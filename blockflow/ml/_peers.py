"""Calls to a pass's peer workers that end as soon as the scheduler drops the peer.

A call to a dead worker retries until ``distributed.comm.timeouts.connect``; a
:class:`Peers` ends it as soon as the scheduler drops the peer, or after
``blockflow.ml.peer-timeout``. A blockflow heuristic over distributed's public RPCs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from dask.utils import parse_timedelta

from blockflow import config
from blockflow._distributed import listed_workers

__all__ = ["PeerGone", "Peers", "peer_timeout"]


def peer_timeout(value: float | str | None = None) -> float:
    """Seconds a call to a peer worker may go unanswered: ``value``, else
    ``blockflow.ml.peer-timeout``."""
    return float(parse_timedelta(config.get("ml.peer-timeout", value), default="s"))


class PeerGone(ConnectionError):
    """The scheduler no longer lists the worker called (it left, or was lost)."""

    def __init__(self, address: str):
        super().__init__(f"blockflow: worker {address} is no longer one of the "
                         f"scheduler's workers.")
        self.address = address


class Peers:
    """The peers of one pass that the scheduler still lists, and bounded calls to them.

    Parameters
    ----------
    node : distributed.Worker or distributed.Client
        What asks the scheduler (its ``scheduler`` RPC); the calls run on its event loop.
    addresses : iterable of str
        The pass's peers, as it was submitted.
    timeout : float
        Seconds a call may go unanswered while its peer is still listed.
    poll : float, default 0.1
        Seconds between the scheduler checks while a call has no answer.
    """

    def __init__(self, node, addresses: Iterable[str], timeout: float, poll: float = 0.1):
        self.node = node
        self.addresses = list(addresses)
        self.gone: set[str] = set()
        self.timeout = float(timeout)
        self.poll = float(poll)
        self._refreshing: asyncio.Future | None = None
        self.checked = False  # the scheduler's word came once

    @property
    def live(self) -> list[str]:
        """The peers not known to be gone, in their given order."""
        return [a for a in self.addresses if a not in self.gone]

    async def refresh(self) -> None:
        """Ask the scheduler which peers it still lists; drop the others."""
        await asyncio.shield(self.start_refresh())

    def start_refresh(self) -> asyncio.Future:
        """Start :meth:`refresh` (or join the one under way) without waiting."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._ask_scheduler())
        return self._refreshing

    async def _ask_scheduler(self) -> None:
        ask = self.live
        if not ask:
            return
        try:
            listed = await asyncio.wait_for(listed_workers(self.node, ask), self.timeout)
        except Exception:  # the scheduler is busy or away: nothing learned (and not
            # asked again before each call: a call is bounded by ``timeout`` anyway)
            self.checked = True
            return
        self.gone.update(a for a in ask if a not in listed)
        self.checked = True

    def refresh_soon(self) -> None:
        """Start :meth:`refresh` without waiting for it, from any thread."""
        self.node.loop.add_callback(self.refresh)

    async def ready(self) -> None:
        """Wait for the scheduler's word on the peers once."""
        if not self.checked:
            await self.refresh()

    async def call(self, address: str, make: Callable[[], Awaitable[Any]],
                   confirm: bool = False) -> Any:
        """``await make()``, a call to the peer at ``address``, bounded; with ``confirm`` a
        failed call waits for the scheduler's word on the peer.

        Raises
        ------
        PeerGone
            The scheduler no longer lists the peer (before the call, or while it ran).
        TimeoutError
            No answer within ``timeout`` seconds, the peer still listed.
        """
        if address in self.gone:
            raise PeerGone(address)
        end = time.monotonic() + self.timeout
        task = asyncio.ensure_future(make())
        try:
            while not task.done():
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"blockflow: worker {address} did not answer "
                                       f"within {self.timeout:g} s (blockflow.ml."
                                       f"peer-timeout).")
                waits = {task}
                if self._refreshing is not None and not self._refreshing.done():
                    waits.add(self._refreshing)  # a refresh under way may drop the peer
                done, _ = await asyncio.wait(waits, timeout=min(self.poll, left),
                                             return_when=asyncio.FIRST_COMPLETED)
                if task.done():
                    break
                if address in self.gone:
                    raise PeerGone(address)
                if not done:  # slow to answer: ask the scheduler (awaited with the call)
                    self.start_refresh()
            if task.exception() is None:
                return task.result()
            if confirm:  # lost (the scheduler drops it soon), or out of this node's reach
                while address not in self.gone and time.monotonic() < end:
                    await self.refresh()
                    if address not in self.gone:
                        await asyncio.sleep(min(self.poll, max(0.0, end - time.monotonic())))
                if address in self.gone:
                    raise PeerGone(address) from task.exception()
            return task.result()  # raises the call's own error
        finally:
            if not task.done():
                # a call that ends with its own error after the cancel (a comm turning the
                # cancel into a TimeoutError) is not left for asyncio to log as unretrieved
                task.add_done_callback(_retrieve)
                task.cancel()


def _retrieve(task: asyncio.Future) -> None:
    """Read a finished call's outcome (nobody awaits it any more)."""
    if not task.cancelled():
        task.exception()
