"""SIGUSR1: what the agent is doing, written to stderr (its log) while it goes on serving:
every thread's stack and every asyncio task's. A prefetch that stays queued, a push that
never ends: the dump says which task waits where (``kill -USR1 <pid>``)."""

from __future__ import annotations

import asyncio
import faulthandler
import io
import signal
import sys


def install(loop: asyncio.AbstractEventLoop) -> None:
    """The loop's handler (tasks can only be read from the loop) and, chained after it at
    the C level, faulthandler's (threads, written from the signal itself: even while the
    loop is blocked, which is when it matters most)."""
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=True)


def uninstall(loop: asyncio.AbstractEventLoop) -> None:
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
    sys.stderr.write(out.getvalue())
    sys.stderr.flush()
