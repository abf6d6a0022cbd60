"""Turning a TaskGroup's ExceptionGroup back into the one error a user should read."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from transfer.errors import FerryError


def first_error(exc: BaseException) -> BaseException:
    """The most informative leaf: a FerryError if any, else the first non-cancel leaf."""
    leaves = _leaves(exc)
    for leaf in leaves:
        if isinstance(leaf, FerryError):
            return leaf
    for leaf in leaves:
        if not isinstance(leaf, asyncio.CancelledError):
            return leaf
    return leaves[0]


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


@contextlib.asynccontextmanager
async def one_error() -> AsyncIterator[None]:
    """Around a TaskGroup: its failure raised as the one error (first_error), as every other
    failure of the operation is, not as an ExceptionGroup its caller would not know for a
    store's or a chunk's (a prefetch took one for a crash and stayed "running")."""
    try:
        yield
    except BaseExceptionGroup as group:
        raise first_error(group) from None
