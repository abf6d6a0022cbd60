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
from collections.abc import Awaitable, Callable
from pathlib import Path

from agent.node.hotdir import HotDir, LocalCheckpoint

log = logging.getLogger(__name__)

OnCommitted = Callable[[str, int, Path], Awaitable[None] | None]


def scan_hot_dir(
    hot: HotDir, known: frozenset[Path] = frozenset()
) -> tuple[set[Path], list[LocalCheckpoint]]:
    """(every step directory present, the committed ones not in ``known``), oldest step
    first. Hidden entries and directories that are no job's are skipped (hotdir.py)."""
    present: set[Path] = set()
    found: list[LocalCheckpoint] = []
    for job in hot.jobs():
        steps = hot.step_dirs(job)
        for step_dir in steps:
            present.add(step_dir.path)
            if step_dir.path not in known and hot.is_committed(step_dir.path):
                found.append(step_dir)
                _warn_of_twins(step_dir, steps)
    found.sort(key=lambda c: (c.step, c.job))
    return present, found


def _warn_of_twins(new: LocalCheckpoint, steps: list[LocalCheckpoint]) -> None:
    """Two directories of a job that name one step (``step_000010``, ``checkpoint-10``):
    only one of them can be pushed as that step, so say so (once: when the new one is
    first seen); hot retention keeps both (hotretention.py)."""
    twins = sorted(c.path.name for c in steps if c.step == new.step and c.path != new.path)
    if twins:
        log.warning(
            "%s names step %d of job %s, as %s does: only one of them is pushed as the "
            "step; rename the other", new.path, new.step, new.job, ", ".join(twins)
        )  # fmt: skip


async def watch_hot_dir(
    hot: HotDir,
    on_committed: OnCommitted,
    *,
    poll_seconds: float = 1.0,
    stop: asyncio.Event,
) -> None:
    """Call ``on_committed(job, step, path)`` once for each committed step directory until
    ``stop`` is set. A callback error is logged and the checkpoint is offered again on the
    next poll; the watcher itself never dies of one (pushes would silently stop)."""
    reported: set[Path] = set()
    warned: set[Path] = set()  # saves said to be where they are never pushed (once each)
    while not stop.is_set():
        try:
            present, found = await asyncio.to_thread(scan_hot_dir, hot, frozenset(reported))
            misplaced: list[tuple[Path, str]] | None = await asyncio.to_thread(hot.misplaced)
        except OSError as exc:
            log.warning("cannot scan hot dir %s: %s", hot.root, exc)
            present, found, misplaced = set(reported), [], None
        if misplaced is not None:  # (a failed scan forgets nothing said)
            for path, why in misplaced:
                if path not in warned:
                    log.warning("%s: %s", path, why)
            warned = {path for path, _ in misplaced}
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
