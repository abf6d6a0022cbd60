"""A store on a local or NFS-mounted directory.

Durability discipline (what NFS close-to-open semantics and power loss both need): write a
hidden temp file in the target directory, fsync it, then publish it with ``link`` (create-only,
atomic even on NFS) or ``rename`` (replace), then fsync the directory. Readers never see a
partial object, and hidden temp files are ignored by ``list``. All file I/O runs in threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import threading
from pathlib import Path

from transfer.durable import fsync_dir
from transfer.errors import AccessDeniedError, AlreadyExistsError, NotFoundError, StoreError
from transfer.store.base import (
    ObjectInfo,
    PartReceipt,
    PendingUpload,
    PendingUploads,
    RangeReader,
    Store,
    Upload,
    check_key,
)

_TMP_MARK = ".tmp-"


def _temp_path(final: Path) -> Path:
    return final.with_name(f".{final.name}{_TMP_MARK}{secrets.token_hex(6)}")


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


def _map_os_error(exc: OSError, what: str) -> StoreError:
    if isinstance(exc, FileNotFoundError):
        return NotFoundError(f"{what}: not found")
    if isinstance(exc, PermissionError):
        return AccessDeniedError(f"{what}: permission denied")
    if exc.errno == errno.ENOSPC:
        return StoreError(f"{what}: no space left on device")
    return StoreError(f"{what}: {exc.strerror or exc}")


class LocalUpload(Upload):
    def __init__(self, store: LocalStore, key: str) -> None:
        self.key = key
        self._final = store.path_of(key)
        self._tmp = _temp_path(self._final)
        self._fd: int | None = None
        # complete() and abort() may race with each other and with part writes whose
        # threads outlive a cancelled task: whoever takes the fd closes it, exactly once,
        # and only after in-flight writes are done (a reused fd number must never be hit)
        self._fd_cond = threading.Condition()
        self._writing = 0

    def _take_fd(self) -> int | None:
        with self._fd_cond:
            self._fd_cond.wait_for(lambda: self._writing == 0)
            fd, self._fd = self._fd, None
        return fd

    def _pwrite(self, offset: int, data: bytes) -> None:
        with self._fd_cond:
            fd = self._fd
            if fd is None:
                raise StoreError(f"upload of {self.key} is closed")
            self._writing += 1
        try:
            view = memoryview(data)
            pos = 0
            while pos < len(view):
                pos += os.pwrite(fd, view[pos:], offset + pos)
        finally:
            with self._fd_cond:
                self._writing -= 1
                self._fd_cond.notify_all()

    def _open(self) -> None:
        self._final.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    async def write_part(
        self, number: int, offset: int, data: bytes, receipt: PartReceipt | None = None
    ) -> None:
        try:
            await asyncio.to_thread(self._pwrite, offset, data)
        except OSError as exc:
            raise _map_os_error(exc, f"write {self.key}") from exc

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
            await asyncio.to_thread(finish)
        except OSError as exc:
            raise _map_os_error(exc, f"commit {self.key}") from exc

    async def abort(self) -> None:
        def discard() -> None:
            fd = self._take_fd()
            if fd is not None:
                os.close(fd)
            self._tmp.unlink(missing_ok=True)

        await asyncio.to_thread(discard)


class LocalRangeReader(RangeReader):
    """preadv straight into the caller's buffer (no intermediate ``bytes``)."""

    def __init__(self, store: LocalStore) -> None:
        self._store = store

    def read_into(self, key: str, start: int, buf: memoryview) -> int:
        try:
            fd = os.open(self._store.path_of(key), os.O_RDONLY)
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
        except OSError as exc:
            raise _map_os_error(exc, f"read {key}") from exc


class LocalStore(Store):
    """Objects are files under ``root``; a key's '/' separators are directories."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)

    def path_of(self, key: str) -> Path:
        return self.root / check_key(key)

    async def check(self) -> None:
        if not self.root.is_dir():
            raise NotFoundError(
                f"store directory {self.root} does not exist (create it, or check the mount)"
            )
        if not os.access(self.root, os.R_OK | os.X_OK):
            raise AccessDeniedError(f"store directory {self.root}: permission denied")

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

        try:
            return await asyncio.to_thread(read)
        except OSError as exc:
            raise _map_os_error(exc, f"read {key}") from exc

    def range_reader(self) -> RangeReader:
        return LocalRangeReader(self)

    async def put(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        final = self.path_of(key)

        def write() -> None:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = _temp_path(final)
            try:
                with open(tmp, "xb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            _publish(tmp, final, create_only)

        try:
            await asyncio.to_thread(write)
        except OSError as exc:
            raise _map_os_error(exc, f"write {key}") from exc

    async def head(self, key: str) -> ObjectInfo:
        try:
            st = await asyncio.to_thread(os.stat, self.path_of(key))
        except OSError as exc:
            raise _map_os_error(exc, f"stat {key}") from exc
        return ObjectInfo(key, st.st_size)

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

        try:
            return await asyncio.to_thread(walk)
        except OSError as exc:
            raise _map_os_error(exc, f"list {prefix!r}") from exc

    async def delete(self, key: str) -> None:
        path = self.path_of(key)

        def remove() -> None:
            path.unlink(missing_ok=True)
            fsync_dir(path.parent)

        try:
            await asyncio.to_thread(remove)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise _map_os_error(exc, f"delete {key}") from exc

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
                                found.append(PendingUpload(key, name, path.stat().st_mtime))
            return found

        return await asyncio.to_thread(walk) if start.is_dir() else []

    async def abort_upload(self, pending: PendingUpload) -> None:
        tmp = self.path_of(pending.key).with_name(pending.upload_id)
        await asyncio.to_thread(tmp.unlink, True)

    async def begin_upload(self, key: str) -> Upload:
        upload = LocalUpload(self, key)
        try:
            await asyncio.to_thread(upload._open)
        except OSError as exc:
            raise _map_os_error(exc, f"create {key}") from exc
        return upload
