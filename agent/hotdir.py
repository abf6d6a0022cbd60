"""The node's hot directory, ``<hot_dir>/<job>/step_<N>/``: where training saves and
prefetches land. One home for its layout: which entries are checkpoints (visible
directories with a job's and a step's name, no symlinks), which are committed (the commit
marker is there), and how a step's directory is named.

Hidden entries (a leading dot) are never checkpoints: the agent's state dir, pull staging
dirs (``.<name>.ferry-staging-*``), eviction leftovers and settle markers live beside them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from transfer.errors import FerryError
from transfer.format.names import check_name, step_from_dirname


@dataclass(frozen=True)
class LocalCheckpoint:
    job: str
    step: int
    path: Path


@dataclass(frozen=True)
class StepDir:
    """A step directory, committed or not (the watcher reports it once committed)."""

    job: str
    step: int
    path: Path


@dataclass(frozen=True)
class HotDir:
    root: Path
    commit_marker: str

    def job_path(self, job: str) -> Path:
        return self.root / check_name("job", job)

    def step_path(self, job: str, step: int) -> Path:
        return self.job_path(job) / step_dir_name(step)

    def jobs(self) -> list[str]:
        """Jobs with a directory here, sorted (a directory whose name is not a valid job
        name is skipped: it could not become a store key). OSError if the hot dir cannot
        be read."""
        jobs = []
        for entry in _visible_dirs(self.root, strict=True):
            try:
                jobs.append(check_name("job", entry.name))
            except FerryError:
                continue
        return sorted(jobs)

    def step_dirs(self, job: str) -> list[StepDir]:
        """Every step directory of ``job``, committed or not, in no order."""
        found = []
        for entry in _visible_dirs(self.job_path(job)):
            step = step_from_dirname(entry.name)
            if step is not None:
                found.append(StepDir(job, step, Path(entry.path)))
        return found

    def is_committed(self, step_dir: Path) -> bool:
        return os.path.isfile(step_dir / self.commit_marker)

    def checkpoints(self, job: str) -> list[LocalCheckpoint]:
        """Committed step directories of ``job``, newest first."""
        found = [
            LocalCheckpoint(d.job, d.step, d.path)
            for d in self.step_dirs(job)
            if self.is_committed(d.path)
        ]
        found.sort(key=lambda c: c.step, reverse=True)
        return found

    def all_checkpoints(self) -> list[LocalCheckpoint]:
        """Committed step directories of every job."""
        return [c for job in self.jobs() for c in self.checkpoints(job)]


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def is_hidden(name: str) -> bool:
    return name.startswith(".")


def _visible_dirs(path: Path, *, strict: bool = False) -> list[os.DirEntry[str]]:
    """Directories in ``path`` that are neither hidden nor symlinks; none if it does not
    exist (training has not made it yet). Unreadable: an OSError when ``strict`` (the hot
    dir itself: the watcher says so), else none (a job's dir: skipped this poll)."""
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return []
    except OSError:
        if strict:
            raise
        return []
    return [e for e in entries if not is_hidden(e.name) and e.is_dir(follow_symlinks=False)]
