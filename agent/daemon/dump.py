"""SIGUSR1: what the agent is doing, written to stderr (its log) while it goes on serving:
every thread's stack and every asyncio task's. A prefetch that stays queued, a push that
never ends: the dump says which task waits where (``kill -USR1 <pid>``). Plain text, not
JSON, whatever ``log_format`` says: it is for a person reading a stuck agent's log.

The threads are read by a Python-level handler, under the GIL (``sys._current_frames``),
not by ``faulthandler``'s C handler: that one walks the other threads' frames while they
run, and under load it crashed the agent (SIGSEGV, 2 dumps in 29 with the CPU busy) that
the operator only meant to look at."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import io
import os
import signal
import sys
import threading
import traceback
from types import FrameType
from typing import Any


def install(loop: asyncio.AbstractEventLoop) -> None:
    """A Python-level handler: it runs on the main thread at its next bytecode, also while
    the loop is blocked by a coroutine that never yields (when a dump matters most), and
    writes the threads' stacks at once; the tasks', which only the loop may read, are
    written by the loop when it next runs. (A main thread stuck inside one C call that
    never returns to Python is not dumped until it does.)"""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # (whatever goes wrong here would be raised in the code the signal interrupted: the
        # event loop itself, maybe; a dump is never worth the agent)
        with contextlib.suppress(Exception):
            _write(threads_text())
            loop.call_soon_threadsafe(dump_tasks)

    _previous.append(signal.signal(signal.SIGUSR1, on_signal))
    signal.siginterrupt(signal.SIGUSR1, False)  # (system calls restart, as they did)


#: the SIGUSR1 handlers ``install`` replaced, restored by ``uninstall``
_previous: list[Any] = []  # (signal.signal's handler type is private to typeshed)


def uninstall(loop: asyncio.AbstractEventLoop) -> None:
    """Undo ``install``: the handler before it again."""
    previous = _previous.pop() if _previous else None  # (None: not set from Python)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL if previous is None else previous)


def threads_text() -> str:
    """Every thread's stack, innermost last, with its name (``Thread.name``) and whether it
    is the one the signal interrupted."""
    out = io.StringIO()
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    current = threading.get_ident()
    print(f"--- SIGUSR1 at {_now()}: {len(frames)} threads ---", file=out)
    for ident, frame in frames.items():
        which = " (current thread)" if ident == current else ""
        print(f"thread {names.get(ident, '?')} {ident:#x}{which}:", file=out)
        out.writelines(traceback.format_stack(frame))
    print("--- end of the threads ---", file=out)
    return out.getvalue()


def dump_tasks() -> None:
    """Every task of the running loop: its name, state and where it waits, the whole chain
    of coroutines it awaits, innermost last (``Task.print_stack`` gives a suspended task's
    outermost frame alone: every service showed only its guard's ``await coro``)."""
    out = io.StringIO()
    tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    print(f"--- SIGUSR1 at {_now()}: {len(tasks)} asyncio tasks ---", file=out)
    for task in tasks:
        print(f"task {task.get_name()}: {task!r:.300}", file=out)
        frames = _awaited(task.get_coro())
        out.writelines(traceback.StackSummary.extract((f, f.f_lineno) for f in frames).format())
    print("--- end of the asyncio tasks ---", file=out)
    _write(out.getvalue())


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


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")


def _write(text: str) -> None:
    """To stderr's file descriptor where it has one: a signal handler that went through
    ``sys.stderr`` while the interrupted code was writing a log line there would raise (a
    buffered stream is not reentrant; stderr is line-buffered, so at most a part of a line
    is held back). Else (stderr captured by a test) to ``sys.stderr``."""
    if sys.stderr is None:
        return
    data = text.encode(errors="replace")
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        sys.stderr.write(text)
        return
    with contextlib.suppress(OSError):  # (a log that is gone: nothing to say it to)
        while data:
            data = data[os.write(fd, data) :]
