"""The node's hot directory, ``<hot_dir>/<job>/step_<N>/``: where training saves and
prefetches land. One home for its layout: which entries are checkpoints (visible
directories with a job's and a step's name, no symlinks), which are committed (the commit
marker is there, and no share record: a partial copy is never the step), how a step's
directory is named, where a file may be written in one (never through a symlink:
``path_in_step_dir``), and how one is evicted (renamed to a hidden ``.<name>.evicting-*``
first, so training and prefetch never see half a directory; what a crash leaves of that is
swept at start).

Hidden entries (a leading dot: ``is_hidden``) are never checkpoints: the agent's state dir,
its lock file (``AGENT_LOCK``: one agent per hot dir, ``AgentLock``), pull staging dirs
(``.<name>.ferry-staging-*``), eviction leftovers and settle markers live beside them.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from transfer.errors import DestinationError, FerryError
from transfer.format.names import check_name, step_from_dirname
from transfer.format.share import SHARE_MARKER

EVICTING_MARK = ".evicting-"  # in a step dir's hidden name while an eviction deletes it
AGENT_LOCK = ".ferry-agent.lock"  # in the hot dir: flocked by the one agent running on it
#: names a trainer saves under before renaming the save to its step's name
#: (``step_000020.tmp``): such a save is warned about only once it has sat there, whole,
#: for IN_PROGRESS_SECONDS (a crash between the save and its rename)
IN_PROGRESS_SUFFIXES = (".tmp", ".partial", ".incomplete", ".inprogress", ".writing")
IN_PROGRESS_SECONDS = 600.0


class HotDirInUseError(FerryError):
    """Another agent holds the hot dir's lock."""


class AgentLock:
    """One agent per hot dir: an exclusive ``flock`` on ``<hot_dir>/.ferry-agent.lock``,
    held for the agent's lifetime (before its journal opens or anything in the hot dir is
    touched, wherever its state dir is); the file says who holds it (pid, listen address)
    for the refusal a second agent prints. The kernel drops the lock when its holder dies,
    so a file a dead agent left behind is simply taken over (never deleted: deleting it
    could let two agents lock two different files)."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path

    @classmethod
    def acquire(cls, root: Path, holder: str) -> AgentLock:
        """Lock ``root`` (made if missing, as a prefetch into it would) for ``holder``, a
        line of text naming this agent; HotDirInUseError names the agent that holds it."""
        root.mkdir(parents=True, exist_ok=True)
        path = root / AGENT_LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "still starting"
            os.close(fd)
            raise HotDirInUseError(
                f"hot dir {root} is in use by another agent ({other}; its lock: {path}): "
                "one agent per hot dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, (holder.strip() + "\n").encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)  # the lock goes with the last descriptor of the open file


@dataclass(frozen=True)
class LocalCheckpoint:
    """A step directory of a job in the hot dir: what ``step_dirs`` lists, committed or not
    (the watcher reports it once committed); ``checkpoints`` lists the committed ones and
    ``shares`` the partial copies."""

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

    def step_dirs(self, job: str) -> list[LocalCheckpoint]:
        """Every step directory of ``job``, committed or not, in no order."""
        found = []
        for entry in _visible_dirs(self.job_path(job)):
            step = step_from_dirname(entry.name, strict=True)  # (not llama-7b: step 7)
            if step is not None:
                found.append(LocalCheckpoint(job, step, Path(entry.path)))
        return found

    def misplaced(self) -> list[tuple[Path, str]]:
        """Saves the watcher will never push, each with why: a step directory right in the
        hot dir (no job's directory around it), or in a directory whose name is no valid
        job name, or a save in a job's directory under a name that names no step
        (``latest``). (Hidden entries and symlinks are left alone, as everywhere.)"""
        found: list[tuple[Path, str]] = []
        for entry in _visible_dirs(self.root):
            path = Path(entry.path)
            if self._holds_a_save(path):  # (a job named like a step, sweep-3, holds none)
                found.append((path, "a save right in the hot dir: put it in its job's "
                              f"directory ({self.root}/<job>/step_<N>)"))  # fmt: skip
                continue
            try:
                check_name("job", entry.name)
            except FerryError as exc:
                if any(self._holds_a_save(Path(e.path)) for e in _visible_dirs(path)):
                    found.append((path, f"not a job name ({exc}): its saves are not pushed"))
                continue
            for inner in _visible_dirs(path):
                save = Path(inner.path)
                if step_from_dirname(inner.name, strict=True) is not None:
                    continue
                if inner.name.lower().endswith(IN_PROGRESS_SUFFIXES):
                    if self._whole_for(save, IN_PROGRESS_SECONDS):  # (else: renamed next)
                        found.append((save, f"a save under a temporary name, whole for "
                                      f"{IN_PROGRESS_SECONDS / 60:.0f} minutes and not renamed "
                                      "to its step's name: not pushed"))  # fmt: skip
                elif self._holds_a_save(save):
                    found.append((save, "a save under a name that names no step "
                                  "(step_000120, checkpoint-120): not pushed"))  # fmt: skip
        return found

    def _holds_a_save(self, path: Path) -> bool:
        return bool(self.commit_marker) and os.path.isfile(path / self.commit_marker)

    def _whole_for(self, path: Path, seconds: float) -> bool:
        """A save whose commit marker was written at least ``seconds`` ago."""
        try:
            written = os.stat(path / self.commit_marker).st_mtime if self.commit_marker else None
        except OSError:
            return False
        return written is not None and time.time() - written >= seconds

    def is_committed(self, step_dir: Path) -> bool:
        """A save that is whole here: its commit marker is there, and it is not a partial
        copy (a share pulled for some ranks: share.py), which is never pushed, served to a
        peer, or counted as holding the step."""
        if self.is_share(step_dir):
            return False
        if not self.commit_marker:  # a node without .metadata in a node-local multi-node
            return _holds_a_file(step_dir)  # save: its files are the part (pushed once quiet)
        return os.path.isfile(step_dir / self.commit_marker)

    def is_share(self, step_dir: Path) -> bool:
        """A partial copy: the share some ranks read, recorded by the pull that made it."""
        return os.path.lexists(step_dir / SHARE_MARKER)

    def checkpoints(self, job: str) -> list[LocalCheckpoint]:
        """Committed step directories of ``job``, newest first."""
        found = [d for d in self.step_dirs(job) if self.is_committed(d.path)]
        found.sort(key=lambda c: c.step, reverse=True)
        return found

    def shares(self) -> list[LocalCheckpoint]:
        """Partial copies (shares) of every job, newest first within a job."""
        found = [d for job in self.jobs() for d in self.step_dirs(job) if self.is_share(d.path)]
        found.sort(key=lambda c: (c.job, -c.step))
        return found

    def all_checkpoints(self) -> list[LocalCheckpoint]:
        """Committed step directories of every job."""
        return [c for job in self.jobs() for c in self.checkpoints(job)]

    def evict(self, step_dir: Path) -> None:
        """Delete a step directory: renamed to a hidden name first (atomic: training and
        prefetch never see half a directory), then deleted. A crash in between leaves the
        hidden ``.<name>.evicting-<hex>`` directory, which ``sweep_evictions`` deletes."""
        shutil.rmtree(self.hide(step_dir))

    def hide(self, step_dir: Path) -> Path:
        """The first half of ``evict``: rename the directory to its hidden name (one
        rename: from then on no listing shows it) and return that name; ``shutil.rmtree``
        it next (a crash in between: ``sweep_evictions``)."""
        hidden = step_dir.with_name(f".{step_dir.name}{EVICTING_MARK}{secrets.token_hex(4)}")
        os.rename(step_dir, hidden)
        return hidden

    def sweep_evictions(self) -> list[Path]:
        """Delete the directories an eviction renamed but did not finish deleting (a
        crash); returns them."""
        swept = []
        for job in self.jobs():
            for entry in _dirs(self.job_path(job)):
                if is_hidden(entry.name) and EVICTING_MARK in entry.name:
                    shutil.rmtree(entry.path, ignore_errors=True)
                    swept.append(Path(entry.path))
        return swept


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def path_in_step_dir(step_dir: Path, rel: str) -> Path:
    """``step_dir / rel`` (``rel`` a validated relative path), refusing a symlink (or a
    file) where a parent directory should be: a link planted in a step dir must not carry
    restored files out of the hot dir."""
    here = step_dir
    for part in rel.split("/")[:-1]:
        here = here / part
        if here.is_symlink() or (here.exists() and not here.is_dir()):
            raise DestinationError(
                f"{here} is a symlink or not a directory; refusing to write through it"
            )
    return step_dir / rel


def _holds_a_file(step_dir: Path) -> bool:
    try:
        return any(e.is_file(follow_symlinks=False) for e in os.scandir(step_dir))
    except OSError:
        return False


def is_hidden(name: str) -> bool:
    return name.startswith(".")


def _visible_dirs(path: Path, *, strict: bool = False) -> list[os.DirEntry[str]]:
    """Directories in ``path`` that are neither hidden nor symlinks (see ``_dirs``)."""
    return [e for e in _dirs(path, strict=strict) if not is_hidden(e.name)]


def _dirs(path: Path, *, strict: bool = False) -> list[os.DirEntry[str]]:
    """Directories in ``path`` that are not symlinks; none if it does not exist (training
    has not made it yet). Unreadable: an OSError when ``strict`` (the hot dir itself: the
    watcher says so), else none (a job's dir: skipped this poll)."""
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return []
    except OSError:
        if strict:
            raise
        return []
    return [e for e in entries if e.is_dir(follow_symlinks=False)]
