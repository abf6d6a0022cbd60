"""SIGUSR1: what the agent is doing, written to stderr (its log) while it goes on serving:
every thread's stack and every asyncio task's. A prefetch that stays queued, a push that
never ends: the dump says which task waits where (``kill -USR1 <pid>``). Plain text, not
JSON, whatever ``log_format`` says: it is for a person reading a stuck agent's log."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import faulthandler
import io
import signal
import sys
import traceback
from types import FrameType
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
    """Every task of the running loop: its name, state and where it waits, the whole chain
    of coroutines it awaits, innermost last (``Task.print_stack`` gives a suspended task's
    outermost frame alone: every service showed only its guard's ``await coro``)."""
    out = io.StringIO()
    tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")
    print(f"--- SIGUSR1 at {now}: {len(tasks)} asyncio tasks ---", file=out)
    for task in tasks:
        print(f"task {task.get_name()}: {task!r:.300}", file=out)
        frames = _awaited(task.get_coro())
        out.writelines(traceback.StackSummary.extract((f, f.f_lineno) for f in frames).format())
    print("--- end of the asyncio tasks ---", file=out)
    if sys.stderr is not None:
        sys.stderr.write(out.getvalue())
        sys.stderr.flush()


def _awaited(coro: object, most: int = 40) -> list[FrameType]:
    """The frames of ``coro`` and of what it awaits, down to the innermost (a coroutine's
    ``cr_await``, a generator's ``gi_yieldfrom``); a future ends the chain."""
    frames: list[FrameType] = []
    while coro is not None and len(frames) < most:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:  # (finished, or not a coroutine: a future)
            break
        frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames


def _real_stderr() -> TextIO | None:
    """stderr, or the process's own, where it has a file descriptor; else None."""
    for stream in (sys.stderr, sys.__stderr__):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            if stream is not None and stream.fileno() >= 0:
                return stream
    return None
