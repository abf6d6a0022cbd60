"""N workers over one shared iterator: the engine's way to keep a window of requests busy."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, TypeVar

from transfer.engine.taskgroup_errors import first_error

T = TypeVar("T")


async def run_workers(
    items: Iterable[T],
    worker: Callable[[Iterator[T]], Coroutine[Any, Any, None]],
    count: int,
    *,
    errors_as_group: bool = False,
) -> None:
    """Run ``count`` copies of ``worker`` at once, each given the same iterator over
    ``items`` and taking from it until it runs dry: every item goes to exactly one worker,
    whichever is free, and a worker may keep state (a buffer) from item to item.

    Returns when every worker is done. The first failure cancels the other workers and is
    raised on its own (errors.first_error), or with ``errors_as_group`` as the TaskGroup's
    ExceptionGroup (for callers whose own callers have always been given the group)."""
    pending = iter(items)
    try:
        async with asyncio.TaskGroup() as tasks:
            for _ in range(count):
                tasks.create_task(worker(pending))
    except BaseExceptionGroup as group:
        if errors_as_group:
            raise
        raise first_error(group) from None
