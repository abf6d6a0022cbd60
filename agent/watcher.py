"""Watching the hot dir for committed checkpoints: ``<hot_dir>/<job>/<step dir>/``.

A step directory is committed once its commit marker exists: PyTorch DCP writes
``.metadata`` last (temp file + rename), after every shard, so its presence means the save
finished. Each committed directory is reported once per watcher; directories already there
at startup are reported too, so a restarted agent catches up (the push queue dedupes).

Polling, not inotify: it works on every filesystem (inotify misses changes made through
NFS/FUSE, and recursive watches need one watch per directory), and it costs one scandir of
the hot dir plus one per job per poll, and one ``stat`` per new step directory. The scan runs
in a thread so a slow or large tree never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from transfer.errors import FormatError
from transfer.format.names import check_name, step_from_dirname

log = logging.getLogger(__name__)

OnCommitted = Callable[[str, int, Path], Awaitable[None] | None]


@dataclass(frozen=True, slots=True)
class Committed:
    job: str
    step: int
    path: Path


def scan_hot_dir(
    hot_dir: Path, commit_marker: str, known: frozenset[Path] = frozenset()
) -> tuple[set[Path], list[Committed]]:
    """(every step directory present, the committed ones not in ``known``), oldest step first.

    Hidden entries are skipped: the agent's state dir and pull staging dirs
    (``.<name>.ferry-staging-*``) live beside checkpoints. So are job directories whose name
    is not a valid job name (they could not become store keys).
    """
    present: set[Path] = set()
    found: list[Committed] = []
    try:
        jobs = [e for e in os.scandir(hot_dir) if _visible_dir(e)]
    except FileNotFoundError:
        return present, found  # training has not created it yet
    for job_entry in jobs:
        try:
            job = check_name("job", job_entry.name)
            steps = [e for e in os.scandir(job_entry.path) if _visible_dir(e)]
        except (FormatError, OSError):  # gone, unreadable, or not a job: skip this poll
            continue
        for entry in steps:
            step = step_from_dirname(entry.name)
            if step is None:
                continue
            path = Path(entry.path)
            present.add(path)
            if path not in known and os.path.isfile(path / commit_marker):
                found.append(Committed(job, step, path))
    found.sort(key=lambda c: (c.step, c.job))
    return present, found


def _visible_dir(entry: os.DirEntry[str]) -> bool:
    return not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False)


async def watch_hot_dir(
    hot_dir: Path,
    commit_marker: str,
    on_committed: OnCommitted,
    *,
    poll_seconds: float = 1.0,
    stop: asyncio.Event,
) -> None:
    """Call ``on_committed(job, step, path)`` once for each committed step directory until
    ``stop`` is set. A callback error is logged and the checkpoint is offered again on the
    next poll; the watcher itself never dies of one (pushes would silently stop)."""
    reported: set[Path] = set()
    while not stop.is_set():
        try:
            present, found = await asyncio.to_thread(
                scan_hot_dir, hot_dir, commit_marker, frozenset(reported)
            )
        except OSError as exc:
            log.warning("cannot scan hot dir %s: %s", hot_dir, exc)
            present, found = set(reported), []
        # Forget deleted directories, so one re-created under the same name is reported again.
        reported &= present
        for c in found:
            try:
                outcome = on_committed(c.job, c.step, c.path)
                if inspect.isawaitable(outcome):
                    await outcome
            except Exception:
                log.exception("handling committed checkpoint %s failed", c.path)
                continue
            reported.add(c.path)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), poll_seconds)
