"""A store on a local or NFS-mounted directory.

Durability discipline (what NFS close-to-open semantics and power loss both need): write a
hidden temp file in the target directory, fsync it, then publish it with ``link`` (create-only,
atomic even on NFS) or ``rename`` (replace), then fsync the directory. Readers never see a
partial object, and hidden temp files are ignored by ``list``. All file I/O runs in threads.

Retries: every read, list, delete and whole-object write goes through the store's
RetryPolicy (transfer/store/retry.py, the one the S3 client uses): an NFS mount answers
ESTALE, ETIMEDOUT or EIO while its server fails over. A whole-object write is retried from
the start (a new temp file, the data written and fsynced again); a failed fsync is never
retried on the same file: the kernel may have dropped the pages it could not write, and a
second fsync would report success (PostgreSQL's "fsyncgate"), so an upload's commit is
tried once.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shlex
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from transfer.directio import open_direct, write_at
from transfer.durable import fsync_dir
from transfer.errors import (
    AccessDeniedError,
    AlreadyExistsError,
    NotFoundError,
    StoreError,
    StoreMissingError,
)
from transfer.store.base import (
    ObjectInfo,
    PartReceipt,
    PendingUpload,
    PendingUploads,
    RangeReader,
    Store,
    StoreThreads,
    Upload,
    check_key,
)
from transfer.store.retry import ErrorTable, RetryPolicy, run_retried, transient_os_error

_TMP_MARK = ".tmp-"
_CREATE_TRIES = 5  # a file's directory removed under it as many times in a row: give up
T = TypeVar("T")


def _temp_path(final: Path) -> Path:
    return final.with_name(f".{final.name}{_TMP_MARK}{secrets.token_hex(6)}")


def _create(final: Path, create: Callable[[], T]) -> T:
    """``create()`` a new file beside ``final`` in its directory, made first: a delete may
    remove that directory as it empties it (LocalStore.delete) between the two, so the
    directory is made again and the file tried again when it vanished."""
    for attempt in range(_CREATE_TRIES):
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # (pathlib: the directory was there when mkdir tried, and
            # gone when it checked that it is a directory; a delete emptied it: CI saw it)
            if attempt == _CREATE_TRIES - 1:
                raise
            continue
        try:
            return create()
        except FileNotFoundError:
            if attempt == _CREATE_TRIES - 1 or final.parent.exists():
                raise
    raise AssertionError("unreachable")


def _prune_empty_dirs(root: Path, path: Path) -> None:
    """Remove ``path``'s directories that are now empty, deepest first, down to (never
    including) the store's top-level ones: an emptied step's directory, listed as a step,
    would cost every later listing of the job one more step to look at."""
    parent = path.parent
    while parent != root and parent.parent != root:
        try:
            parent.rmdir()
        except OSError:  # not empty (a writer's file, or a concurrent one's), or gone
            return
        parent = parent.parent


def _publish(tmp: Path, final: Path, create_only: bool) -> None:
    """Make the fsynced ``tmp`` visible as ``final`` atomically, then fsync the directory."""
    try:
        if create_only:
            try:
                os.link(tmp, final)
            except FileExistsError:
                raise AlreadyExistsError(f"{final} already exists") from None
            finally:
                tmp.unlink(missing_ok=True)
        else:
            os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(final.parent)


def _map_os_error(
    exc: BaseException, what: str, tries: int = 1, where: str | None = None
) -> StoreError:
    if isinstance(exc, StoreError):
        return exc
    if not isinstance(exc, OSError):
        raise exc  # not an I/O failure but a bug: let it out as it is
    if isinstance(exc, FileNotFoundError):
        return NotFoundError(f"{what}: not found")
    if isinstance(exc, PermissionError):
        return AccessDeniedError(f"{what}: permission denied")
    if exc.errno == errno.ENOSPC:
        return StoreError(f"{what}: no space left on device")
    reason = exc.strerror or str(exc)
    if tries > 1:
        return StoreError(f"{what}: failed {tries} times, the mount may be down ({reason})")
    return StoreError(f"{what}: {reason}")


#: A directory's failures: transient what a flaky NFS mount answers (retry.py's errnos).
LOCAL_ERRORS = ErrorTable(transient=transient_os_error, mapped=_map_os_error)


def _same_bytes(path: Path, data: bytes) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(len(data) + 1) == data
    except OSError:
        return False


class LocalUpload(Upload):
    def __init__(self, store: LocalStore, key: str) -> None:
        self._store = store
        self.key = key
        self._final = store.path_of(key)
        self._tmp = _temp_path(self._final)
        self._fd: int | None = None
        self._direct_fd: int | None = None  # the same file, O_DIRECT (transfer/directio.py)
        # complete() and abort() may race with each other and with part writes whose
        # threads outlive a cancelled task: whoever takes the fd closes it, exactly once,
        # and only after in-flight writes are done (a reused fd number must never be hit)
        self._fd_cond = threading.Condition()
        self._writing = 0

    def _take_fd(self) -> int | None:
        """The upload's descriptor, now the caller's to close (its O_DIRECT twin is closed
        here), or None if another caller took it."""
        with self._fd_cond:
            self._fd_cond.wait_for(lambda: self._writing == 0)
            fd, self._fd = self._fd, None
            direct, self._direct_fd = self._direct_fd, None
        if direct is not None:
            os.close(direct)
        return fd

    def _pwrite(self, offset: int, data: bytes) -> None:
        with self._fd_cond:
            fd, direct = self._fd, self._direct_fd
            if fd is None:
                raise StoreError(f"upload of {self.key} is closed")
            self._writing += 1
        try:
            write_at(fd, direct, offset, data)
        finally:
            with self._fd_cond:
                self._writing -= 1
                self._fd_cond.notify_all()

    def _open(self) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        self._fd = _create(self._final, lambda: os.open(self._tmp, flags, 0o644))
        try:
            self._direct_fd = open_direct(self._tmp)
        except BaseException:
            os.close(self._fd)
            self._tmp.unlink(missing_ok=True)
            raise

    async def write_part(
        self, number: int, offset: int, data: bytes, receipt: PartReceipt | None = None
    ) -> None:
        await self._store.run(f"write {self.key}", lambda: self._pwrite(offset, data))

    async def complete(self, *, create_only: bool = False) -> None:
        def finish() -> None:
            fd = self._take_fd()
            if fd is None:
                raise StoreError(f"upload of {self.key} was aborted")
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            _publish(self._tmp, self._final, create_only)

        try:
            await self._store.threads.run(finish)
        except OSError as exc:
            raise _map_os_error(exc, f"commit {self.key}") from exc

    async def abort(self) -> None:
        def discard() -> None:
            fd = self._take_fd()
            if fd is not None:
                os.close(fd)
            self._tmp.unlink(missing_ok=True)

        await self._store.threads.run(discard)


class LocalRangeReader(RangeReader):
    """preadv straight into the caller's buffer (no intermediate ``bytes``)."""

    def __init__(self, store: LocalStore) -> None:
        self._store = store

    def read_into(self, key: str, start: int, buf: memoryview) -> int:
        path = self._store.path_of(key)

        def read() -> int:
            fd = os.open(path, os.O_RDONLY)
            try:
                got = 0
                while got < len(buf):
                    n = os.preadv(fd, [buf[got:]], start + got)
                    if not n:
                        break
                    got += n
                return got
            finally:
                os.close(fd)

        return self._store.run_retried(f"read {key}", read)


class LocalStore(Store):
    """Objects are files under ``root``; a key's '/' separators are directories."""

    def __init__(self, root: Path, retry: RetryPolicy | None = None, threads: int = 16) -> None:
        self.root = root
        self.url = str(root)
        self.retry = retry or RetryPolicy()
        self.threads = StoreThreads(threads, "local-store")

    def run_retried(self, what: str, work: Callable[[], T]) -> T:
        """``work()`` (blocking), retried while it fails transiently; a failure comes out
        as a StoreError naming ``what``."""
        return run_retried(self.retry, LOCAL_ERRORS, what, work)

    async def close(self) -> None:
        self.threads.close()

    async def run(self, what: str, work: Callable[[], T]) -> T:
        """run_retried on one of the store's threads."""
        return await self.threads.run(lambda: self.run_retried(what, work))

    def path_of(self, key: str) -> Path:
        return self.root / check_key(key)

    async def check(self) -> None:
        self._refuse_a_file()
        if not self.root.is_dir():
            raise StoreMissingError(
                f"store directory {self.root} does not exist (make a store there with "
                f"`ferry init {shlex.quote(str(self.root))}`, or check the mount)"
            )
        if not os.access(self.root, os.R_OK | os.X_OK):
            raise AccessDeniedError(f"store directory {self.root}: permission denied")

    def _refuse_a_file(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"store path {self.root} is a file, not a directory")

    async def create_root(self) -> None:
        self._refuse_a_file()
        await self.run(f"create {self.root}", lambda: self.root.mkdir(parents=True, exist_ok=True))
        await self.check()

    async def holds_objects(self) -> bool:
        """Any file under the root, hidden ones included (a directory with only a
        ``.bashrc`` in it is not empty); empty directories (``lost+found``) are not objects."""

        def any_file() -> bool:
            return any(filenames for _, _, filenames in os.walk(self.root))

        return await self.run(f"list {self.root}", any_file)

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        path = self.path_of(key)

        def read() -> bytes:
            with open(path, "rb") as fh:
                lo = start or 0
                hi = os.fstat(fh.fileno()).st_size if end is None else end
                out = bytearray()
                while len(out) < hi - lo:
                    piece = os.pread(fh.fileno(), hi - lo - len(out), lo + len(out))
                    if not piece:
                        break
                    out += piece
                return bytes(out)

        return await self.run(f"read {key}", read)

    def range_reader(self) -> RangeReader:
        return LocalRangeReader(self)

    async def put(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        final = self.path_of(key)
        tries = 0

        def write() -> None:
            nonlocal tries
            tries += 1
            tmp = _temp_path(final)
            try:
                with _create(final, lambda: open(tmp, "xb")) as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            try:
                _publish(tmp, final, create_only)
            except AlreadyExistsError:
                # a retry finding our own earlier try's object (it landed, then the
                # directory's fsync failed) has succeeded
                if tries > 1 and _same_bytes(final, data):
                    fsync_dir(final.parent)
                    return
                raise

        await self.run(f"write {key}", write)

    async def head(self, key: str) -> ObjectInfo:
        path = self.path_of(key)
        st = await self.run(f"stat {key}", lambda: os.stat(path))
        return ObjectInfo(key, st.st_size)

    async def list_dirs(self, prefix: str) -> list[str]:
        start = self.root / check_key(prefix.rstrip("/"))

        def names() -> list[str]:
            try:
                entries = list(os.scandir(start))
            except (FileNotFoundError, NotADirectoryError):
                return []
            return sorted(e.name for e in entries if not e.name.startswith(".") and e.is_dir())

        return await self.run(f"list {prefix!r}", names)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        # Walk only the directory the prefix names (or its parent for a partial name).
        base_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / base_dir if base_dir else self.root

        def walk() -> list[ObjectInfo]:
            found: list[ObjectInfo] = []
            if not start.is_dir():
                return found
            for dirpath, dirnames, filenames in os.walk(start):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                rel_dir = os.path.relpath(dirpath, self.root)
                for name in filenames:
                    if name.startswith("."):  # temp files and other hidden strays
                        continue
                    key = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                    if key.startswith(prefix):
                        with contextlib.suppress(FileNotFoundError):
                            found.append(
                                ObjectInfo(key, os.stat(os.path.join(dirpath, name)).st_size)
                            )
            found.sort(key=lambda o: o.key)
            return found

        return await self.run(f"list {prefix!r}", walk)

    async def delete(self, key: str) -> None:
        path = self.path_of(key)

        def remove() -> None:
            path.unlink(missing_ok=True)
            fsync_dir(path.parent)
            _prune_empty_dirs(self.root, path)

        try:
            await self.run(f"delete {key}", remove)
        except NotFoundError:
            return  # its directory is gone too

    async def list_uploads(self, prefix: str) -> PendingUploads:
        """Temp files of unfinished writes (hidden ``.<name>.tmp-*`` beside their target)."""
        base_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / base_dir if base_dir else self.root

        def walk() -> PendingUploads:
            found = []
            for dirpath, _, filenames in os.walk(start):
                for name in filenames:
                    if name.startswith(".") and _TMP_MARK in name:
                        path = Path(dirpath, name)
                        target = path.with_name(name[1:].split(_TMP_MARK, 1)[0])
                        key = target.relative_to(self.root).as_posix()
                        if key.startswith(prefix):
                            with contextlib.suppress(FileNotFoundError):
                                st = path.stat()
                                found.append(PendingUpload(key, name, st.st_mtime, st.st_size))
            return found

        return await self.run(f"list uploads {prefix!r}", walk) if start.is_dir() else []

    async def salvage_upload(self, key: str, receipts: Sequence[PartReceipt] = ()) -> int | None:
        """Nothing of a dead writer's temp file is kept: its parts land by ``pwrite`` in any
        order with no per-part checksum, so which landed whole cannot be told (the push sends
        that pack again). Its temp files are removed now, not left for retention's sweep."""
        for pending in await self.list_uploads(key):
            if pending.key == key:
                await self.abort_upload(pending)
        return None

    async def abort_upload(self, pending: PendingUpload) -> None:
        tmp = self.path_of(pending.key).with_name(pending.upload_id)
        await self.run(f"abort {pending.key}", lambda: tmp.unlink(missing_ok=True))

    async def begin_upload(self, key: str) -> Upload:
        upload = LocalUpload(self, key)
        try:
            await self.threads.run(upload._open)
        except OSError as exc:
            raise _map_os_error(exc, f"create {key}") from exc
        return upload
