"""A store in an S3-compatible bucket (AWS S3, MinIO, SeaweedFS).

Every request goes through one blocking client (transfer/store/s3client.py: one connection
pool, one retry policy) on the store's own threads, as many as the pool has connections: the
async methods hand their request to those threads, the engine's reader threads call the
client directly (``range_reader``). So ``pool_size`` is what bounds a store's concurrency,
not Python's default executor. We drive multipart uploads ourselves: parts are sent from
those threads and checksummed there (CRC32 or Content-MD5, checked by the server).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from transfer.errors import AccessDeniedError, NotFoundError, StoreError, StoreMissingError
from transfer.options import CHECKSUMS, StoreSettings
from transfer.store.base import (
    ObjectInfo,
    PartReceipt,
    PendingUpload,
    PendingUploads,
    RangeReader,
    RangeStream,
    Store,
    StoreThreads,
    Upload,
    check_key,
)
from transfer.store.retry import RetryPolicy
from transfer.store.s3client import S3Client
from transfer.store.s3config import S3Settings

MIN_PART_SIZE = 5 << 20
_GONE = -1  # an upload's size when it completed or was aborted since it was listed
T = TypeVar("T")
Parts = list[dict[str, Any]]  # (a name: inside S3Store, ``list`` is the method)


def _leading_run(parts: Parts, receipts: Sequence[PartReceipt], need_crc32: bool) -> Parts:
    """Parts 1, 2, ... up to the first one missing, or (``need_crc32``: the upload was begun
    with CRC32 checksums, so completing it names each part's) the first whose checksum
    neither ListParts nor a receipt of the same part (number and size) gives. A pack's part
    number always holds the same bytes (pack ids are never reused), so a wrong receipt can
    only be a corrupt journal: the server then refuses the complete, and it is aborted."""
    journaled = {
        (int(r["PartNumber"]), int(r["Size"])): r
        for r in receipts
        if isinstance(r.get("PartNumber"), int) and isinstance(r.get("Size"), int)
    }
    run: Parts = []
    for p in sorted(parts, key=lambda p: int(p["PartNumber"])):
        number = int(p["PartNumber"])
        if number != len(run) + 1:
            break
        if need_crc32 and "ChecksumCRC32" not in p:
            receipt = journaled.get((number, int(p["Size"])))
            if receipt is None or "ChecksumCRC32" not in receipt:
                break
            p = {**p, "ChecksumCRC32": receipt["ChecksumCRC32"]}
        run.append(p)
    return run


class S3Upload(Upload):
    def __init__(self, store: S3Store, key: str, upload_id: str) -> None:
        self.key = key
        self._store = store
        self._upload_id = upload_id
        self._parts: dict[int, dict[str, Any]] = {}
        self._sizes: dict[int, int] = {}

    async def prepare_part(self, number: int, data: bytes) -> PartReceipt | None:
        if self._store.checksum_kind != "crc32":
            return None  # md5 and none: ListParts alone is enough to complete an upload
        checksum = await self._store.on_thread(lambda: self._store.checksum_args(data))
        return {"PartNumber": number, "Size": len(data), **checksum}

    async def write_part(
        self, number: int, offset: int, data: bytes, receipt: PartReceipt | None = None
    ) -> None:
        store = self._store

        def send() -> dict[str, Any]:
            known = receipt or {}
            checksum = (
                {"ChecksumCRC32": known["ChecksumCRC32"]}
                if "ChecksumCRC32" in known
                else store.checksum_args(data)
            )
            resp = store.client.call(
                "upload_part",
                f"upload part {number} of {self.key}",
                Key=store.full_key(self.key),
                UploadId=self._upload_id,
                PartNumber=number,
                Body=data,
                **checksum,
            )
            part = {"PartNumber": number, "ETag": resp["ETag"]}
            if "ChecksumCRC32" in checksum:
                part["ChecksumCRC32"] = checksum["ChecksumCRC32"]
            return part

        self._parts[number] = await store.on_thread(send)
        self._sizes[number] = len(data)

    def add_landed_part(self, part: dict[str, Any], size: int) -> None:
        """A part an earlier writer uploaded (from ListParts), to complete it with."""
        self._parts[int(part["PartNumber"])] = part
        self._sizes[int(part["PartNumber"])] = size

    async def complete(self, *, create_only: bool = False) -> None:
        parts = [self._parts[n] for n in sorted(self._parts)]
        extra = {"IfNoneMatch": "*"} if create_only else {}
        try:
            await self._store.call(
                "complete_multipart_upload",
                f"complete {self.key}",
                Key=self._store.full_key(self.key),
                UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
                **extra,
            )
        except NotFoundError:
            # A retry after a reply lost on the way back finds the upload gone because it
            # completed: the object is there, at its full size.
            if not await self._landed():
                await self.abort()
                raise
        except StoreError:
            # A rejected complete leaves the upload pending (and billed): abort it.
            await self.abort()
            raise

    async def _landed(self) -> bool:
        try:
            info = await self._store.head(self.key)
        except StoreError:
            return False
        return info.size == sum(self._sizes.values())

    async def abort(self) -> None:
        # best effort: the agent's start-up sweep and a bucket lifecycle rule catch the rest
        with contextlib.suppress(StoreError):
            await self._store.call(
                "abort_multipart_upload",
                f"abort upload of {self.key}",
                Key=self._store.full_key(self.key),
                UploadId=self._upload_id,
            )


class _S3Ranges(RangeReader):
    """The store's client seen as a RangeReader (store keys, not bucket keys)."""

    def __init__(self, store: S3Store) -> None:
        self._store = store

    def read_into(self, key: str, start: int, buf: memoryview) -> int:
        store = self._store
        return store.client.read_into(store.full_key(key), start, buf, f"get {key}")

    def streams(self) -> bool:
        return self._store.client.streams()

    def stream(self, key: str, start: int, end: int) -> RangeStream | None:
        store = self._store
        return store.client.stream(store.full_key(key), start, end, f"get {key}")


class S3Store(Store):
    min_part_size = MIN_PART_SIZE
    salvages_uploads = True

    def __init__(
        self,
        settings: S3Settings,
        prefix: str = "",
        *,
        checksum: str = StoreSettings.checksum,
        retry: RetryPolicy | None = None,
    ) -> None:
        """The store under ``prefix`` of ``settings.bucket``, reached as ``settings`` says
        (endpoint, credentials, pool size, timeouts: what every transport is made from)."""
        if checksum not in CHECKSUMS:
            raise ValueError(f"unknown checksum {checksum!r} ({', '.join(CHECKSUMS)})")
        if settings.pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        bucket = settings.bucket
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.endpoint_url = settings.endpoint_url
        self.retry = retry or RetryPolicy()
        self._checksum = checksum
        self.client = S3Client(settings, self.retry)
        # one thread per pooled connection: more would only queue on the pool
        self._threads = StoreThreads(settings.pool_size, "s3")

    def full_key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    async def on_thread(self, fn: Callable[[], T]) -> T:
        """Run a blocking request on the store's threads."""
        return await self._threads.run(fn)

    async def call(self, method: str, what: str, **kwargs: Any) -> Any:
        """One S3 API call, retried when transient; raises mapped StoreErrors."""
        return await self.on_thread(lambda: self.client.call(method, what, **kwargs))

    @property
    def checksum_kind(self) -> str:
        """The per-part integrity header this store sends: "crc32", "md5" or "none"."""
        return self._checksum

    def checksum_args(self, data: bytes) -> dict[str, Any]:
        if self._checksum == "crc32":
            crc = zlib.crc32(data).to_bytes(4, "big")
            return {"ChecksumCRC32": base64.b64encode(crc).decode()}
        if self._checksum == "md5":
            md5 = hashlib.md5(data, usedforsecurity=False).digest()
            return {"ContentMD5": base64.b64encode(md5).decode()}
        return {}

    async def check(self) -> None:
        what = f"bucket {self.bucket!r}"
        try:  # a list of the store's own prefix: needs only the permission reads need
            await self.on_thread(lambda: self.client.check(self.full_key_prefix(), what))
        except NotFoundError as exc:
            raise StoreMissingError(f"bucket {self.bucket!r} does not exist") from exc

    async def holds_objects(self) -> bool:
        full = self.full_key_prefix()
        what = f"list {self.url}"
        return bool(await self.on_thread(lambda: self.client.holds_objects(full, what)))

    def full_key_prefix(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        full = self.full_key(key)
        if end is not None and end <= (start or 0):
            return b""
        body = await self.on_thread(lambda: self.client.get(full, f"get {key}", start, end))
        return bytes(body)

    async def put(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        full = self.full_key(key)

        def send() -> None:
            extra = self.checksum_args(data)
            if create_only:
                extra["IfNoneMatch"] = "*"
            self.client.call("put_object", f"put {key}", Key=full, Body=data, **extra)

        await self.on_thread(send)

    async def head(self, key: str) -> ObjectInfo:
        full = self.full_key(key)
        return ObjectInfo(key, await self.on_thread(lambda: self.client.head(full, f"head {key}")))

    async def list_dirs(self, prefix: str) -> list[str]:
        check_key(prefix.rstrip("/"))
        full = self.full_key_prefix() + prefix
        listed = await self.on_thread(lambda: self.client.list_dirs(full, f"list {prefix!r}"))
        return sorted(listed)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        if prefix.rstrip("/"):
            check_key(prefix.rstrip("/"))
        full = self.full_key_prefix() + prefix
        strip = len(self.full_key_prefix())
        listed = await self.on_thread(lambda: self.client.list(full, f"list {prefix!r}"))
        return sorted((ObjectInfo(k[strip:], size) for k, size in listed), key=lambda o: o.key)

    async def delete(self, key: str) -> None:
        with contextlib.suppress(NotFoundError):
            await self.call("delete_object", f"delete {key}", Key=self.full_key(key))

    async def list_uploads(self, prefix: str) -> PendingUploads:
        """The unfinished uploads under ``prefix``, each with its size: one listing of its
        parts each (S3's upload listing has none; uploads are few: running pushes', and
        killed ones' until retention's next run), 16 at a time. One that completes or is
        aborted meanwhile is gone, not an error; one whose parts cannot be listed has no
        size."""
        pending = await self._pending_uploads(prefix)
        sizes: list[int | None] = []
        for i in range(0, len(pending), 16):
            batch = pending[i : i + 16]
            sizes += await asyncio.gather(*(self._upload_size(p) for p in batch))
        return [
            dataclasses.replace(p, size=size)
            for p, size in zip(pending, sizes, strict=True)
            if size != _GONE
        ]

    async def _upload_size(self, pending: PendingUpload) -> int | None:
        try:
            parts = await self._list_parts(self.full_key(pending.key), pending.upload_id)
        except NotFoundError:
            return _GONE  # completed or aborted since it was listed
        except AccessDeniedError:  # (s3:ListMultipartUploadParts not granted)
            return None
        return sum(int(p["Size"]) for p in parts)

    async def _pending_uploads(self, prefix: str) -> PendingUploads:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        found: list[PendingUpload] = []
        marker: dict[str, str] = {}
        while True:
            resp = await self.call(
                "list_multipart_uploads", f"list uploads {prefix!r}", Prefix=full, **marker
            )
            for up in resp.get("Uploads", []) or []:
                initiated = up["Initiated"].timestamp()
                found.append(PendingUpload(up["Key"][strip:], up["UploadId"], initiated))
            if not resp.get("IsTruncated"):
                return found
            marker = {
                "KeyMarker": resp["NextKeyMarker"],
                "UploadIdMarker": resp["NextUploadIdMarker"],
            }

    async def abort_upload(self, pending: PendingUpload) -> None:
        await S3Upload(self, pending.key, pending.upload_id).abort()

    async def salvage_upload(self, key: str, receipts: Sequence[PartReceipt] = ()) -> int | None:
        full = self.full_key(key)
        best: tuple[int, PendingUpload, Parts] | None = None
        for pending in await self._pending_uploads(key):  # (its parts: listed below)
            if pending.key != key:
                continue
            listed = await self._list_parts(full, pending.upload_id)
            run = _leading_run(listed, receipts, self._checksum == "crc32")
            size = sum(int(p["Size"]) for p in run)
            if best is None or size > best[0]:
                if best is not None:
                    await self.abort_upload(best[1])
                best = (size, pending, run)
            else:
                await self.abort_upload(pending)
        if best is None:
            return None
        size, pending, run = best
        if not size:
            await self.abort_upload(pending)
            return None
        upload = S3Upload(self, key, pending.upload_id)
        for p in run:
            part: dict[str, Any] = {
                k: p[k] for k in ("PartNumber", "ETag", "ChecksumCRC32") if k in p
            }
            upload.add_landed_part(part, int(p["Size"]))
        try:
            await upload.complete()
        except StoreError:
            return None  # complete() aborted it
        return size

    async def _list_parts(self, full: str, upload_id: str) -> Parts:
        parts: Parts = []
        marker: dict[str, Any] = {}
        while True:
            resp = await self.call(
                "list_parts", f"list parts of {full}", Key=full, UploadId=upload_id, **marker
            )
            parts.extend(resp.get("Parts", []) or [])
            if not resp.get("IsTruncated"):
                return parts
            marker = {"PartNumberMarker": resp["NextPartNumberMarker"]}

    async def begin_upload(self, key: str) -> Upload:
        full = self.full_key(key)
        extra = {"ChecksumAlgorithm": "CRC32"} if self._checksum == "crc32" else {}
        tries = 0

        def counted() -> None:
            nonlocal tries
            tries += 1

        resp = await self.on_thread(
            lambda: self.client.call(
                "create_multipart_upload",
                f"start upload of {key}",
                on_try=counted,
                Key=full,
                **extra,
            )
        )
        upload_id = resp["UploadId"]
        if tries > 1:
            # an earlier try may have started an upload whose reply was lost: nobody will
            # ever complete it, so abort it now rather than leave it billed until the sweep
            with contextlib.suppress(StoreError):
                for pending in await self.list_uploads(key):
                    if pending.key == key and pending.upload_id != upload_id:
                        await self.abort_upload(pending)
        return S3Upload(self, key, upload_id)

    def range_reader(self) -> RangeReader:
        return _S3Ranges(self)

    async def close(self) -> None:
        self._threads.close()
        self.client.close()
