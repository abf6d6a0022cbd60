"""SIGUSR1: what the agent is doing, written to stderr (its log) while it goes on serving:
every thread's stack and every asyncio task's. A prefetch that stays queued, a push that
never ends: the dump says which task waits where (``kill -USR1 <pid>``). Plain text, not
JSON, whatever ``log_format`` says: it is for a person reading a stuck agent's log."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import io
import signal
import sys
from typing import TextIO


def install(loop: asyncio.AbstractEventLoop) -> None:
    """The loop's handler (tasks can only be read from the loop) and, chained after it at
    the C level, faulthandler's (threads, written from the signal itself: even while the
    loop is blocked, which is when it matters most) where stderr is a real file (an agent
    served in-process under a test's captured stderr dumps its tasks alone)."""
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
    out = _real_stderr()
    if out is not None:
        faulthandler.register(signal.SIGUSR1, file=out, all_threads=True, chain=True)


def uninstall(loop: asyncio.AbstractEventLoop) -> None:
    """Undo ``install`` (or as much of it as was done)."""
    faulthandler.unregister(signal.SIGUSR1)
    loop.remove_signal_handler(signal.SIGUSR1)


def dump_tasks() -> None:
    """Every task of the running loop: its name, state and stack, innermost frame last."""
    out = io.StringIO()
    tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    print(f"--- {len(tasks)} asyncio tasks ---", file=out)
    for task in tasks:
        print(f"task {task.get_name()}: {task!r:.300}", file=out)
        task.print_stack(limit=12, file=out)
    if sys.stderr is not None:
        sys.stderr.write(out.getvalue())
        sys.stderr.flush()


def _real_stderr() -> TextIO | None:
    """stderr, or the process's own, where it has a file descriptor; else None."""
    for stream in (sys.stderr, sys.__stderr__):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            if stream is not None and stream.fileno() >= 0:
                return stream
    return None
