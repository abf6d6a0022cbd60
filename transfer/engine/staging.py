"""The hidden staging directory a restore is written into, beside its destination, and
renamed into place only when every chunk is verified (pull.py).

A restore that dies (killed, the store down, cancelled) leaves its staging directory
behind, and the next restore into the same destination adopts it: what it already holds is
hash-checked in place and only the rest is fetched (``PullResult.chunks_resumed``). Each
restore holds an ``flock`` on its staging directory, so a leftover is adopted only when no
living process writes it. One restore into a destination at a time: each holds a lock
file beside it (``lock_destination``, ``.<dest>.ferry-lock``: the holder's pid and host in
it, removed by the holder as it ends), and one that finds it held, or a leftover locked (a
restore of an older version), does not start beside it (``StagingBusy``: pull.py waits,
then adopts what it left or finds the destination whole): two at once moved every byte
twice, and the one that lost the rename failed and left its staging behind. A leftover is
swept when its destination exists (a restore removes its destination's other leftovers
before it lands), when it is older than ``RESUME_KEEP_SECONDS``, or when a newer one of
the same destination is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import functools
import os
import re
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transfer.codec.transforms import Buffer
from transfer.directio import open_direct, write_at
from transfer.durable import fsync_dir
from transfer.engine.restorenames import (
    LOCK_MARK,
    STAGING_MARK,
    lock_path,
    marker_path,
    staging_path,
)
from transfer.engine.settle import boot_id, fsync_tree, mark_unsynced
from transfer.engine.warmcache import warm_range
from transfer.engine.writeback import start_writeback
from transfer.errors import AccessDeniedError, DestinationError, FerryError, StoreError
from transfer.format.manifest import FileEntry

#: a restore's leftover is kept this long for the next restore of the same destination
RESUME_KEEP_SECONDS = 24 * 3600.0
_SUFFIX = re.compile(r"[0-9a-f]{8}\Z")  # a restore's own staging (not fill-/unsynced- ones)


class StagingBusy(FerryError):
    """A living restore into the same destination holds ``path`` (its lock file, or a
    staging directory of an older version's restore): wait for it rather than start a
    second one. ``holder``: what the lock file says of it (pid and host), if anything."""

    def __init__(self, path: Path, holder: str = "") -> None:
        by = f" ({holder})" if holder else ""
        super().__init__(f"another restore{by} holds {path}")
        self.path, self.holder = path, holder


@dataclass
class DestinationLock:
    """The one restore into a destination at a time (``lock_destination``)."""

    path: Path
    _fd: int

    def release(self) -> None:
        """Remove the lock file, then let go (a waiter that locked the removed file looks
        again). Idempotent."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                if _still_at(self._fd, self.path):
                    self.path.unlink()
            os.close(self._fd)
            self._fd = -1


@dataclass
class Staging:
    path: Path
    #: a killed restore's leftover, taken over: its files may already hold chunks
    adopted: bool
    _lock_fd: int
    destination: DestinationLock | None = None

    def release(self) -> None:
        """Give up the locks (the directory is renamed into place, removed, or kept)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self.destination is not None:
            self.destination.release()


def lock_destination(dest: Path) -> DestinationLock:
    """Lock ``dest`` for one restore: ``StagingBusy`` while another holds it."""
    path = lock_path(dest.absolute())
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise DestinationError(f"cannot lock {path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip()
            os.close(fd)
            raise StagingBusy(path, holder) from None
        except OSError as exc:  # (ENOLCK: a file system without locks)
            os.close(fd)
            raise DestinationError(f"cannot lock {path}: {exc.strerror or exc}") from None
        if _still_at(fd, path):  # (the holder before us may have removed it since we opened it)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
            return DestinationLock(path, fd)
        os.close(fd)


def leftovers(dest: Path) -> list[Path]:
    """Staging directories earlier restores into ``dest`` left, newest first."""
    prefix = f".{dest.name}{STAGING_MARK}"
    try:
        found = [
            p
            for p in dest.parent.iterdir()
            if p.name.startswith(prefix) and _SUFFIX.fullmatch(p.name[len(prefix) :])
        ]
    except FileNotFoundError:
        return []
    found = [p for p in found if p.is_dir() and not p.is_symlink()]
    return sorted(found, key=_mtime, reverse=True)


def _still_at(fd: int, path: Path) -> bool:
    """Whether the file ``fd`` has open is still the one at ``path``."""
    try:
        here = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (here.st_dev, here.st_ino)


def open_staging(dest: Path, destination: DestinationLock | None = None) -> Staging:
    """The staging directory for a restore into ``dest``: the newest leftover of an earlier
    one, or a new directory; locked until ``release`` (with ``destination``, the lock of
    ``dest`` its caller took: released with it). ``StagingBusy`` when a living restore of
    an older version holds a leftover."""
    dest = dest.absolute()
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise DestinationError(f"{dest} exists and is not a directory")
    if dest.is_dir() and any(dest.iterdir()):
        raise DestinationError(f"{dest} is not empty; pull into a new or empty directory")
    taken: list[tuple[Path, int]] = []
    try:
        for leftover in leftovers(dest):
            try:
                taken.append((leftover, _take(leftover)))
            except (BlockingIOError, FileNotFoundError):  # (gone: renamed into place now)
                raise StagingBusy(leftover) from None
            except OSError:
                continue  # not ours to open: nothing to adopt, nor to wait for
    except BaseException:
        for _, fd in taken:
            os.close(fd)
        raise
    for _, fd in taken[1:]:
        os.close(fd)  # (older ones: swept before this restore lands)
    if taken:
        leftover, fd = taken[0]
        os.utime(leftover)  # its age counts from this restore now
        return Staging(leftover, True, fd, destination)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        path = staging_path(dest)
        path.mkdir(mode=0o700)
        fd = _take(path)
    except OSError as exc:
        raise DestinationError(f"cannot create {dest}: {exc.strerror or exc}") from None
    return Staging(path, False, fd, destination)


def discard_leftovers(dest: Path) -> list[Path]:
    """Remove the unlocked leftovers of restores into ``dest`` (one cancelled on purpose)."""
    return [p for p in leftovers(dest.absolute()) if _remove_unless_locked(p)]


def _remove_unless_locked(path: Path) -> bool:
    """Remove ``path`` unless a living restore holds it; whether it was removed."""
    fd = _lock(path)
    if fd is None:
        return False
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)
    return True


def _lock(path: Path) -> int | None:
    """``path`` locked (its descriptor), or None: held by a living restore, or gone."""
    try:
        return _take(path)
    except OSError:
        return None


def _take(path: Path) -> int:
    """``path`` opened and locked; BlockingIOError when a living restore holds it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def sweep_stale_staging(parent: Path, now: float | None = None) -> list[Path]:
    """Remove what no restore will adopt under ``parent``: leftovers whose destination
    exists, older than RESUME_KEEP_SECONDS, or behind a newer leftover of the same
    destination, every other kind of staging directory, and the lock files of restores
    killed while they held them (call it only when no restore into ``parent`` can be
    starting, e.g. when an agent starts; locked ones are skipped)."""
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        entries = [e for e in parent.iterdir() if e.name.startswith(".")]
    except FileNotFoundError:
        return removed
    kept: set[str] = set()
    for entry in sorted(entries, key=_mtime, reverse=True):
        if entry.name.endswith(LOCK_MARK) and not entry.is_symlink():
            try:
                lock = lock_destination(parent / entry.name[1 : -len(LOCK_MARK)])
            except FerryError:  # (held: a restore is running)
                continue
            lock.release()  # (removes it)
            removed.append(entry)
            continue
        if STAGING_MARK not in entry.name or not entry.is_dir() or entry.is_symlink():
            continue
        name, _, suffix = entry.name[1:].partition(STAGING_MARK)
        resumable = (
            _SUFFIX.fullmatch(suffix) is not None
            and name not in kept
            and not (parent / name).exists()
            and now - _mtime(entry) < RESUME_KEEP_SECONDS
        )
        if resumable:
            kept.add(name)
        elif _remove_unless_locked(entry):  # (one in use is left alone)
            removed.append(entry)
    return removed


def create_files(
    staging: Staging, files: list[FileEntry], targets: dict[str, list[tuple[int, int]]]
) -> None:
    """Create every file at its final size (an adopted one keeps what it holds); reserve
    disk only for the non-zero chunks."""
    root = staging.path
    need = sum(c.size for f in files for c in f.chunks if c.id in targets)
    free = shutil.disk_usage(root).free
    if need > free and not staging.adopted:  # (an adopted one already holds part of it)
        raise DestinationError(
            f"not enough space under {root.parent}: need {need} bytes, {free} free"
        )
    exclusive = 0 if staging.adopted else os.O_EXCL
    if staging.adopted:
        _prune(root, {f.path for f in files})
    for f in files:
        path = root / f.path  # validated relative path: cannot leave staging
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | exclusive | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, f.size)
            for offset, c in f.chunk_offsets():
                if c.id in targets:
                    try:
                        os.posix_fallocate(fd, offset, c.size)
                    except OSError as exc:
                        if exc.errno == errno.ENOSPC:
                            raise DestinationError(f"no space left under {root.parent}") from None
                        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                            raise
        finally:
            os.close(fd)


class StagingFiles:
    """pwrite into the staging files from worker threads. Files of several chunks keep one
    fd open for the whole pull (closed only after every writer thread is done, so an fd
    number is never reused under a writer); single-chunk files are opened per write.

    Their chunks' aligned interiors go with O_DIRECT (transfer/directio.py): a buffered
    write copies every byte into fresh page-cache pages, and on the benchmark VM first
    touches of fresh pages cost ~1.6 ms per MiB (1.68 GB of 4 MiB pwrites: 2.7 s of system
    time against 0.2 s into recycled pages, and 0.18 s direct). A cold pull of the 1.69 GB
    save, alternated: 3.0-3.3 s direct against 3.9-5.4 s buffered. Direct writes wait for
    the device, though, where buffered ones finish in memory (the restore is settled later:
    settle.py): when the device falls behind (SLOW_DIRECT_WRITES writes in a row slower
    than MIN_DIRECT_RATE, e.g. while it discards a deleted checkpoint), the next
    BUFFERED_SPELL writes go buffered, then direct writes are tried again.
    Unlike a push's pack writes they stay direct while the base is read from the same disk:
    a pull of k+1 holding k, alternated, 3.32 s against 3.68 s yielding to the reads
    (median of 3, CPU 2.89 against 3.23 s)."""

    MAX_KEPT_OPEN = 1024
    #: A smaller write goes buffered: a direct write waits for the device, once per write.
    #: A DCP file cut at its items (chunkspans.py) has ~4x the chunks of fixed 4 MiB ones,
    #: most under 1 MiB; all direct, a cold pull of the corpus's 1.69 GB save took 3.7-3.8
    #: s against 2.9-3.1 s for fixed chunks (writers' time 17.7-18.0 against 8.3-9.8 s);
    #: with these buffered, 3.0-3.1 s (11-13 s).
    DIRECT_MIN_BYTES = 1 << 20
    MIN_DIRECT_RATE = 64e6  # bytes per second, one writer
    SLOW_DIRECT_WRITES = 2
    BUFFERED_SPELL = 16  # writes (64 MiB at 4 MiB chunks)

    def __init__(
        self,
        staging: Path,
        files: list[FileEntry],
        writeback: bool,
        direct: bool = True,
        warm: bool = False,
    ) -> None:
        self._paths = [staging / f.path for f in files]
        self._writeback = writeback
        self._direct = direct  # engine/writepath.py chose
        #: ... and whether what goes direct is read back for the load: by one thread of its
        #: own, so that no writer waits while the kernel allocates pages and queues reads
        self._warmer = ThreadPoolExecutor(1, thread_name_prefix="ferry-warm") if warm else None
        self._direct_fds: dict[int, int | None] = {}
        self._slow_writes = 0  # direct writes in a row slower than MIN_DIRECT_RATE
        self._buffered_left = 0  # writes to go buffered before direct is tried again
        self.spells = 0  # how often the device fell behind (tests, diagnostics)
        multi = [i for i, f in enumerate(files) if len(f.chunks) > 1]
        self._keep = set(multi) if len(multi) <= self.MAX_KEPT_OPEN else set()
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._buffered_locks: dict[int, threading.Lock] = {}
        #: wall seconds with at least one write in progress: the disk's rate is the bytes
        #: written over this (a disk that keeps up is idle between writes; one that does
        #: not is always busy), whichever threads wrote (workers, or a source landing
        #: chunks in its receiving thread)
        self.busy_seconds = 0.0
        self.bytes_written = 0
        self._busy = threading.Lock()
        self._writing = 0
        self._busy_since = 0.0

    def __enter__(self) -> StagingFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._warmer is not None:  # (the hints queued are quick to give)
            self._warmer.shutdown(wait=True)
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
            fds += [fd for fd in self._direct_fds.values() if fd is not None]
            self._direct_fds = {}
        for fd in fds:
            os.close(fd)

    def _open(self, index: int) -> int:
        return os.open(self._paths[index], os.O_WRONLY | os.O_NOFOLLOW)

    def clear(self, index: int, offset: int, length: int) -> None:
        """Make ``[offset, offset + length)`` of file ``index`` read as zeros: a hole where
        the file system punches one (what a share leaves outside itself costs no disk),
        else written zeros."""
        fd = self._open(index)
        try:
            if _punch_hole(fd, offset, length):
                return
            at, end = offset, offset + length
            while at < end:
                at += os.pwrite(fd, bytes(min(_ZEROS, end - at)), at)
        finally:
            os.close(fd)

    def pwrite(self, index: int, offset: int, data: Buffer) -> None:
        self._begin_write()
        try:
            self._pwrite(index, offset, data)
        finally:
            self._end_write(len(memoryview(data)))

    def _begin_write(self) -> None:
        with self._busy:
            if not self._writing:
                self._busy_since = time.monotonic()
            self._writing += 1

    def _end_write(self, nbytes: int) -> None:
        with self._busy:
            self._writing -= 1
            self.bytes_written += nbytes
            if not self._writing:
                self.busy_seconds += time.monotonic() - self._busy_since

    def _pwrite(self, index: int, offset: int, data: Buffer) -> None:
        kept = index in self._keep
        direct = None
        if kept:
            with self._lock:
                fd = self._fds.get(index)
                if fd is None:
                    fd = self._fds[index] = self._open(index)
                if self._buffered_left:
                    self._buffered_left -= 1
                elif self._direct:
                    if index not in self._direct_fds:
                        self._direct_fds[index] = open_direct(self._paths[index])
                    direct = self._direct_fds[index]
        else:
            fd = self._open(index)
        try:
            view = memoryview(data)
            if direct is not None and len(view) >= self.DIRECT_MIN_BYTES:
                began = time.monotonic()
                write_at(fd, direct, offset, view, yield_to_reads=False)
                self._judge_device(len(view), time.monotonic() - began)
                if self._warmer is not None:  # (the edges went buffered: already cached)
                    self._warmer.submit(self._warm_range, index, offset, len(view))
            else:
                # one buffered writer per file: the kernel serialises them on the inode's
                # lock anyway, and writers spinning on it burnt ~5 s of system time on a
                # 272 MB one-file restore (O_DIRECT overwrites take it shared)
                with self._file_lock(index) if kept else contextlib.nullcontext():
                    done = 0
                    while done < len(view):
                        done += os.pwrite(fd, view[done:], offset + done)
            if self._writeback:
                start_writeback(fd, offset, len(view))
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                msg = f"no space left writing {self._paths[index]}"
                raise DestinationError(msg) from None
            raise
        finally:
            if not kept:
                os.close(fd)

    def _warm_range(self, index: int, offset: int, length: int) -> None:
        try:
            fd = os.open(self._paths[index], os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return  # (a hint: nothing to fail)
        try:
            warm_range(fd, offset, length)
        finally:
            os.close(fd)

    def _file_lock(self, index: int) -> threading.Lock:
        with self._lock:
            return self._buffered_locks.setdefault(index, threading.Lock())

    def _judge_device(self, nbytes: int, seconds: float) -> None:
        if nbytes < (1 << 20):
            return
        with self._lock:
            if seconds * self.MIN_DIRECT_RATE <= nbytes:
                self._slow_writes = 0
                return
            self._slow_writes += 1
            if self._slow_writes >= self.SLOW_DIRECT_WRITES:  # it falls behind: for a while,
                self._slow_writes = 0  # finish in the page cache
                self._buffered_left = self.BUFFERED_SPELL
                self.spells += 1


def seal(staging: Path, files: list[FileEntry], dest: Path, fsync: bool, whole: bool) -> None:
    """Set modes, make the restore safe against a crash (fsync it all, or a durable
    unsynced marker: transfer/engine/settle.py, naming every chunk of a ``whole`` restore,
    not a share's), then rename the staging dir into place."""
    for f in files:
        os.chmod(staging / f.path, f.mode)
    boot = None if fsync else boot_id()
    if boot is None:
        fsync_tree(staging)
    else:
        mark_unsynced(dest.absolute(), boot, files if whole else None)
    os.chmod(staging, 0o755)
    try:
        os.rename(staging, dest)  # replaces an empty dest directory atomically
    except OSError as exc:
        if boot is not None:
            marker_path(dest.absolute()).unlink(missing_ok=True)
        raise FerryError(f"cannot move the pulled checkpoint into {dest}: {exc.strerror}") from None
    if boot is None:
        fsync_dir(dest.parent)


def _prune(root: Path, keep: set[str]) -> None:
    """Remove from an adopted staging dir whatever the restore will not write: files of
    another version of the checkpoint, and any symlink (the restore is renamed into place
    whole, so nothing else may be in it)."""
    dirs = {str(Path(p).parent) for p in keep}
    dirs |= {str(parent) for p in keep for parent in Path(p).parents}
    for here, subdirs, names in os.walk(root, topdown=False):
        rel_dir = Path(here).relative_to(root)
        for name in names + subdirs:
            path = Path(here) / name
            rel = (rel_dir / name).as_posix()
            if path.is_symlink() or (not path.is_dir() and rel not in keep):
                path.unlink()
            elif path.is_dir() and rel not in dirs:
                shutil.rmtree(path)


def worth_resuming(exc: BaseException) -> bool:
    """Whether a restore that failed with ``exc`` keeps its staging directory for the next
    one: when it was stopped (killed, cancelled, interrupted) or the store failed, the same
    restore will be tried again; a corrupt chunk, a full disk or a bad path will not pass
    by retrying, so their partial restore is removed."""
    if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt):
        return True
    return isinstance(exc, StoreError) and not isinstance(exc, AccessDeniedError)


_ZEROS = 8 << 20
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def _punch_hole(fd: int, offset: int, length: int) -> bool:
    """fallocate(2) PUNCH_HOLE (Linux; the os module has no binding): False where the
    file system or the platform cannot, and the caller writes zeros instead."""
    fallocate = _fallocate64()
    if fallocate is None:
        return False
    mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    return bool(fallocate(fd, mode, offset, length) == 0)


@functools.cache
def _fallocate64() -> Any:
    """glibc's fallocate64 (64-bit offsets on every platform, 32-bit ones included)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate64
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn
