"""The one owner of the agent's background work: every long-lived loop (hot-dir watcher, push
queue, standby poller, retention) and every per-request job (prefetches) is a task of one
``asyncio.TaskGroup``, entered when the agent starts and left when it stops, so no task the
agent made is still pending once its cleanup has run.

Shutdown order (``Services.close``, run by the app's cleanup context after aiohttp has stopped
accepting requests and finished the ones in flight):

1. ``stop`` is set: the watcher, the standby poller and the retention loop return at their
   next look; each drain hook runs (the push queue stops taking work and cancels its retry
   timers).
2. Up to ``seconds`` (the config's ``drain_seconds``, one deadline shared by all) for what is
   in flight to finish: the current push, the running prefetches, a prefetch the standby's
   last poll started meanwhile, a retention run.
3. At the deadline every task still running is cancelled (a push or prefetch cancelled there
   resumes at the next start; a retention run leaves every store consistent), then all of them
   are awaited as the group exits. (An idle push worker is cancelled at once: it never
   returns by itself.) Then agent/rpc/app.py closes the journal, the peer client, the stores and
   the hot dir's lock, in that order.

A failed start cancels what it had started at once (no drain), and its error propagates as is.

Errors: a service that raises is logged (with its trace) and ends; it neither cancels the
others nor stops the agent (a TaskGroup's default, which the agent never had). Loops that log
a failure and carry on still do so themselves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Spawn(Protocol):
    """Start ``coro`` as a background task named ``name`` and return its handle."""

    def __call__(self, coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]: ...


def own_task(coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]:
    """A task its caller owns (and drains itself): a push queue or prefetcher used on its own,
    outside an agent (tests, benchmarks). In the agent, ``Services.spawn`` owns them."""
    return asyncio.create_task(coro, name=name)


class Services:
    """One TaskGroup for everything the agent runs in the background (see the module doc)."""

    def __init__(self, drain_seconds: float) -> None:
        self.drain_seconds = drain_seconds
        #: set first at shutdown: the long-lived loops return when they see it
        self.stop = asyncio.Event()
        self._group = asyncio.TaskGroup()
        self._tasks: set[asyncio.Task[None]] = set()
        self._drains: list[Callable[[float], Awaitable[None]]] = []
        self._entered = self._cancelling = False

    def spawn(self, coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]:
        """Start ``coro`` in the group (before shutdown reaches its deadline). The handle may
        be cancelled by its caller (DELETE /v1/prefetch/{id}); the group still awaits it."""
        if not self._entered or self._cancelling:
            coro.close()
            raise RuntimeError(f"cannot start {name}: the agent's services are not running")
        task = self._group.create_task(self._guarded(coro, name), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def on_drain(self, drain: Callable[[float], Awaitable[None]]) -> None:
        """Run ``drain(seconds)`` at shutdown, beside the wait for the tasks (step 1-2): how
        a service that never returns by itself (the push queue's worker) stops."""
        self._drains.append(drain)

    @property
    def running(self) -> list[asyncio.Task[None]]:
        """The tasks not finished yet."""
        return [t for t in self._tasks if not t.done()]

    async def __aenter__(self) -> Services:
        await self._group.__aenter__()
        self._entered = True
        return self

    async def __aexit__(
        self,
        et: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # a failed start (or a cancelled one) stops at once, and its error propagates as it
        # is (not wrapped in the group's ExceptionGroup); a normal stop drains
        await self.close(self.drain_seconds if exc is None else 0.0)
        await self._group.__aexit__(None, None, None)

    async def close(self, seconds: float) -> None:
        """Steps 1-3 of the module doc; the group's exit then awaits every task."""
        self.stop.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        await asyncio.gather(*(drain(seconds) for drain in self._drains), self._finish(deadline))
        self._cancelling = True
        for task in self.running:
            task.cancel()

    async def _finish(self, deadline: float) -> None:
        """Wait until no task runs or ``deadline`` passes; tasks started meanwhile count."""
        loop = asyncio.get_running_loop()
        while (running := self.running) and (left := deadline - loop.time()) > 0:
            await asyncio.wait(running, timeout=left)

    async def _guarded(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        try:
            await coro
        except Exception:  # logged, never silent; it must not cancel the others
            log.exception("background task %s failed", name)


async def wait_for_any(*events: asyncio.Event) -> None:
    """Return once any of ``events`` is set; the waiters it starts are cancelled and awaited
    before it returns, however it ends (a timeout around it included): none outlives it."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)


__all__ = ["Services", "Spawn", "own_task", "wait_for_any"]
