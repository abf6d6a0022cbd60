"""Graceful stop of background tasks: a deadline to finish, then cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any


async def drain_tasks(tasks: Collection[asyncio.Task[Any]], seconds: float) -> None:
    """Let ``tasks`` finish for up to ``seconds``, cancel the rest, and wait for all of them
    (their exceptions are swallowed: each task reports its own outcome)."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=seconds)
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
