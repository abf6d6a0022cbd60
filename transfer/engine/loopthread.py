"""An event loop in a daemon thread of its own, for synchronous callers of async code.

A DCP StorageReader (dcpreader_torch.py) is called synchronously, maybe from a thread
whose own loop is running (asyncio.run would refuse there), and its store's sessions
belong to the loop that opened them: so one loop for the reader's life, in its thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "ferry-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, coro: Coroutine[Any, Any, T]) -> Running[T]:
        """Start ``coro`` on the loop; its handle waits for it, or stops it."""
        return Running(self.loop, coro)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()

    def close(self) -> None:
        """Cancel what still runs on the loop, wait for it to end, stop the loop (again:
        nothing)."""
        if self._closed:
            return
        self._closed = True

        async def cancel_the_rest() -> None:
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_the_rest(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class Running(Generic[T]):
    """A coroutine running on a LoopThread's loop, as a task of its own. ``stop`` cancels
    it and returns only once the task has ended (a cancelled ``run_coroutine_threadsafe``
    future says "cancelled" at once, while its task may still be unwinding, and threads it
    started still at work)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> None:
        self._loop = loop
        self._future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._task: asyncio.Task[T] | None = None
        loop.call_soon_threadsafe(self._start, coro)

    def _start(self, coro: Coroutine[Any, Any, T]) -> None:
        self._task = self._loop.create_task(coro)
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[T]) -> None:
        if task.cancelled():  # (cancel, then notify: concurrent.futures.wait sees only a
            self._future.cancel()  # cancellation that was notified)
            self._future.set_running_or_notify_cancel()
        elif (exc := task.exception()) is not None:
            self._future.set_exception(exc)
        else:
            self._future.set_result(task.result())

    def result(self) -> T:
        return self._future.result()

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future[T]], object]) -> None:
        self._future.add_done_callback(fn)

    def stop(self) -> None:
        """Cancel the task (queued after its start: it exists by then) and wait for its end."""
        self._loop.call_soon_threadsafe(lambda: self._task is not None and self._task.cancel())
        concurrent.futures.wait([self._future])
