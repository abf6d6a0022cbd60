"""What this node already holds: checkpoint directories under the hot dir, matched to their
committed manifests, so a prefetch or an estimate knows which chunks need no transfer."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from transfer.format.names import check_name, step_from_dirname


@dataclass(frozen=True)
class LocalCheckpoint:
    job: str
    step: int
    path: Path


def local_checkpoints(hot_dir: Path, job: str, commit_marker: str) -> list[LocalCheckpoint]:
    """Committed (marker present) step directories of ``job``, newest first. Hidden entries
    (staging directories of pulls in progress) are skipped."""
    check_name("job", job)
    root = hot_dir / job
    found = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
            continue
        step = step_from_dirname(entry.name)
        if step is not None and (Path(entry.path) / commit_marker).exists():
            found.append(LocalCheckpoint(job, step, Path(entry.path)))
    found.sort(key=lambda c: c.step, reverse=True)
    return found


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"
