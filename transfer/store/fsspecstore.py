"""A store on any fsspec filesystem: ``memory://name`` (an in-process tier, and the fast
store the conformance suite runs beside the real ones), or a scheme whose fsspec
implementation is installed (``gcs://``, ``az://``, ``hdfs://``...). S3 and local paths have
their own backends (store/s3.py, store/local.py), tuned for the data path.

Objects are files under ``root``; multipart uploads collect their parts in memory and write
the object once, at ``complete`` (so nothing is visible before it). Create-only writes are
atomic within one process (a lock around check-and-write); across processes only where the
filesystem's exclusive-create mode is. fsspec calls block, so they run in threads, each
retried while it fails transiently by the one RetryPolicy every backend uses (a remote
filesystem's connection and timeout errors; a create-only write that finds its own bytes
after a failed try has succeeded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from transfer.errors import AlreadyExistsError, NotFoundError, StoreError
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

T = TypeVar("T")


class _PartsUpload(Upload):
    def __init__(self, store: FsspecStore, key: str) -> None:
        self.key = key
        self._store = store
        self._parts: dict[int, bytes] = {}
        self.pending = PendingUpload(key, secrets.token_hex(8), time.time())

    async def write_part(
        self, number: int, offset: int, data: bytes, receipt: PartReceipt | None = None
    ) -> None:
        self._parts[number] = bytes(data)

    def listed(self) -> PendingUpload:
        """As list_uploads names it: with the bytes its parts hold so far."""
        return dataclasses.replace(self.pending, size=sum(map(len, self._parts.values())))

    async def complete(self, *, create_only: bool = False) -> None:
        body = b"".join(self._parts[n] for n in sorted(self._parts))
        self._parts.clear()
        try:
            await self._store.put(self.key, body, create_only=create_only)
        finally:
            self._store.uploads.pop(self.pending.upload_id, None)

    async def abort(self) -> None:
        self._parts.clear()
        self._store.uploads.pop(self.pending.upload_id, None)


class _Ranges(RangeReader):
    def __init__(self, store: FsspecStore) -> None:
        self._store = store

    def read_into(self, key: str, start: int, buf: memoryview) -> int:
        if not len(buf):
            return 0
        path = self._store.path_of(key)
        data: bytes = self._store.run_retried(
            f"get {key}", lambda: self._store.fs.cat_file(path, start=start, end=start + len(buf))
        )
        buf[: len(data)] = data
        return len(data)


class FsspecStore(Store):
    def __init__(
        self, fs: Any, root: str, url: str, retry: RetryPolicy | None = None, threads: int = 16
    ) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.retry = retry or RetryPolicy()
        self.threads = StoreThreads(threads, "fsspec-store")
        self._create_lock = threading.Lock()
        #: uploads begun and not finished (their parts live in the writer's memory)
        self.uploads: dict[str, _PartsUpload] = {}

    def path_of(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def run_retried(self, what: str, work: Callable[[], T]) -> T:
        """``work()`` (blocking), retried while it fails transiently; a failure comes out
        as a StoreError naming ``what``."""
        return run_retried(self.retry, FSSPEC_ERRORS, what, work)

    async def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await self.threads.run(lambda: self.run_retried(what, lambda: fn(*args, **kwargs)))

    async def close(self) -> None:
        self.threads.close()

    async def check(self) -> None:
        pass  # a path on these filesystems needs no creating

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        if start is not None and end is not None and end <= start:
            return b""
        data: bytes = await self._call(
            f"get {key}", self.fs.cat_file, self.path_of(key), start=start, end=end
        )
        return data

    async def put(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        path = self.path_of(key)

        tried = False

        def write() -> None:
            nonlocal tried
            again, tried = tried, True
            if not create_only:
                self.fs.pipe_file(path, bytes(data))
                return
            with self._create_lock:
                if self.fs.exists(path):
                    if again and self.fs.cat_file(path) == bytes(data):
                        return  # our own write, from a try whose reply was lost
                    raise FileExistsError(path)
                self.fs.pipe_file(path, bytes(data))

        await self._call(f"put {key}", write)

    async def head(self, key: str) -> ObjectInfo:
        info = await self._call(f"head {key}", self.fs.info, self.path_of(key))
        if info.get("type") == "directory":
            raise NotFoundError(f"head {key}: not found")
        return ObjectInfo(key, int(info["size"]))

    async def list(self, prefix: str) -> list[ObjectInfo]:
        if prefix.rstrip("/"):
            check_key(prefix.rstrip("/"))
        # the deepest directory the prefix names for sure, then filter by the full prefix
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = f"{self.root}/{base}".rstrip("/")

        def find() -> dict[str, Any]:
            try:
                found: dict[str, Any] = self.fs.find(top, detail=True)
                return found
            except FileNotFoundError:
                return {}

        found = await self._call(f"list {prefix!r}", find)
        head = self.root + "/"
        out = []
        for path, info in found.items():
            norm = self.fs._strip_protocol(path)
            if info.get("type") == "directory" or not norm.startswith(head):
                continue
            key = norm[len(head) :]
            if key.startswith(prefix):
                out.append(ObjectInfo(key, int(info["size"])))
        out.sort(key=lambda o: o.key)
        return out

    async def delete(self, key: str) -> None:
        with contextlib.suppress(NotFoundError):
            await self._call(f"delete {key}", self.fs.rm_file, self.path_of(key))

    async def begin_upload(self, key: str) -> Upload:
        check_key(key)
        upload = _PartsUpload(self, key)
        self.uploads[upload.pending.upload_id] = upload
        return upload

    async def list_uploads(self, prefix: str) -> PendingUploads:
        found = [u.listed() for u in self.uploads.values() if u.key.startswith(prefix)]
        return sorted(found, key=lambda p: (p.key, p.initiated))

    async def abort_upload(self, pending: PendingUpload) -> None:
        upload = self.uploads.get(pending.upload_id)
        if upload is not None:
            await upload.abort()

    def range_reader(self) -> RangeReader:
        return _Ranges(self)


def _map_error(exc: BaseException, what: str, tries: int, where: str | None) -> StoreError:
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, FileNotFoundError):
        return NotFoundError(f"{what}: not found")
    if isinstance(exc, FileExistsError):
        return AlreadyExistsError(f"{what}: already exists")
    if not isinstance(exc, OSError):  # (connection and timeout errors are OSErrors)
        raise exc  # not an I/O failure but a bug: let it out as it is
    reason = f"failed {tries} times ({exc})" if tries > 1 else str(exc)
    return StoreError(f"{what}: {reason}")


#: A remote filesystem's failures: transient its connection and timeout errors (and a
#: mounted one's errnos, retry.py's); fsspec types the rest as the builtin OSErrors.
FSSPEC_ERRORS = ErrorTable(transient=transient_os_error, mapped=_map_error)
