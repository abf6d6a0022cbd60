"""A store in an S3-compatible bucket (AWS S3, MinIO, SeaweedFS) through s3fs's async client.

We drive multipart uploads ourselves (s3fs's own uploads go in waves and do file I/O on the
event loop). Settings that matter, from shared notes checked against botocore >= 1.36:
- the connection pool is sized to the caller's concurrency (aiobotocore defaults to 10);
- botocore's automatic checksums and payload signing are off (they break or slow MinIO and
  SeaweedFS); instead each PUT carries an explicit CRC32 (or Content-MD5) that the server checks;
- one retry layer, ours (botocore's and s3fs's are off: stacked, they multiplied into a
  minute of retries per request against a store that is down): transient failures (5xx,
  SlowDown, resets, timeouts, bodies shorter than announced) are retried with jittered
  exponential backoff, ``attempts`` tries in all; anything else fails at once.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import threading
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import s3fs

from transfer.errors import (
    AccessDeniedError,
    AlreadyExistsError,
    NotFoundError,
    RangeNotSatisfiableError,
    StoreError,
)
from transfer.store.base import (
    ObjectInfo,
    PendingUpload,
    PendingUploads,
    Store,
    Upload,
    check_key,
)
from transfer.store.retry import (
    ATTEMPTS,
    ShortBodyError,
    backoff_seconds,
    http_status,
    is_transient,
    range_length,
)
from transfer.store.s3reader import S3RangeReader

MIN_PART_SIZE = 5 << 20
_SMALL_FOR_THREAD = 1 << 20  # checksum small bodies inline; big ones in a thread
T = TypeVar("T")


def _map_error(exc: BaseException, what: str, attempts: int = 1) -> StoreError:
    status = http_status(exc)
    # botocore's own retries are off; its "(reached max retries: 0)" would only mislead
    text = " ".join(str(exc).replace(" (reached max retries: 0)", "").split())
    if status == 412 or isinstance(exc, FileExistsError):
        return AlreadyExistsError(f"{what}: already exists")
    if status == 416:
        return RangeNotSatisfiableError(f"{what}: range past the end of the object")
    if isinstance(exc, FileNotFoundError) or status == 404:
        return NotFoundError(f"{what}: {text}")
    if isinstance(exc, PermissionError) or status in (401, 403):
        return AccessDeniedError(f"{what}: access denied ({text}); check the AWS credentials")
    detail = f"{type(exc).__name__}: {text}"
    if attempts > 1:
        return StoreError(f"{what}: failed {attempts} times, the store may be down ({detail})")
    return StoreError(f"{what}: {detail}")


Parts = list[dict[str, Any]]  # (a name: inside S3Store, ``list`` is the method)


def _leading_run(parts: Parts) -> Parts:
    """Parts 1, 2, ... up to the first one missing."""
    run: Parts = []
    for p in sorted(parts, key=lambda p: int(p["PartNumber"])):
        if int(p["PartNumber"]) != len(run) + 1:
            break
        run.append(p)
    return run


def _check_length(resp: dict[str, Any], body: bytes) -> None:
    """A ranged reply must hold exactly the range its Content-Range names."""
    expected = range_length(str(resp.get("ContentRange", "")))
    if expected is not None and len(body) != expected:
        raise ShortBodyError(f"got {len(body)} of the {expected} bytes of the range")


class S3Upload(Upload):
    def __init__(self, store: S3Store, key: str, upload_id: str) -> None:
        self.key = key
        self._store = store
        self._upload_id = upload_id
        self._parts: dict[int, dict[str, Any]] = {}
        self._sizes: dict[int, int] = {}

    async def write_part(self, number: int, offset: int, data: bytes) -> None:
        store = self._store
        checksum = await store.checksum_args(data)
        args = {
            "Key": store.full_key(self.key),
            "UploadId": self._upload_id,
            "PartNumber": number,
            "Body": data,
            **checksum,
        }

        async def once() -> Any:
            # Sent from a thread by the blocking client: through aiohttp every part existed
            # twice while in flight (its payload wrapper copies the body), ~130 MB more
            # peak RSS per push at the default window; as fast either way (measured).
            client = await asyncio.to_thread(store.range_reader)
            return await asyncio.to_thread(client.call, "upload_part", **args)

        resp = await store.retrying(f"upload part {number} of {self.key}", once)
        part = {"PartNumber": number, "ETag": resp["ETag"]}
        if "ChecksumCRC32" in checksum:
            part["ChecksumCRC32"] = checksum["ChecksumCRC32"]
        self._parts[number] = part
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


class S3Store(Store):
    min_part_size = MIN_PART_SIZE

    def __init__(
        self,
        bucket: str,
        prefix: str,
        *,
        endpoint_url: str | None = None,
        pool_size: int = 32,
        checksum: str = "crc32",
        key: str | None = None,
        secret: str | None = None,
        connect_timeout: float = 10.0,
        # no byte for this long on a connection: give up on it and retry (with 6 tries a
        # silently hung server fails a request within about 6 minutes)
        read_timeout: float = 60.0,
        attempts: int = ATTEMPTS,
    ) -> None:
        if checksum not in ("crc32", "md5", "none"):
            raise ValueError(f"unknown checksum {checksum!r} (crc32, md5, none)")
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.endpoint_url = endpoint_url
        self.attempts = attempts
        self._checksum = checksum
        self._fs = s3fs.S3FileSystem(
            endpoint_url=endpoint_url,
            key=key,
            secret=secret,
            asynchronous=True,
            skip_instance_cache=True,
            config_kwargs={
                "max_pool_connections": pool_size,
                "request_checksum_calculation": "when_required",
                "response_checksum_validation": "when_required",
                "s3": {"payload_signing_enabled": False},
                "connect_timeout": connect_timeout,
                "read_timeout": read_timeout,
                "retries": {"total_max_attempts": 1},  # ours: see retrying()
            },
        )
        self._session_lock = asyncio.Lock()
        self._ready = False
        self._make_reader = functools.partial(
            S3RangeReader,
            bucket,
            self.full_key,
            _map_error,
            endpoint_url=endpoint_url,
            key=key,
            secret=secret,
            pool_size=pool_size,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
        self._reader: S3RangeReader | None = None
        self._reader_lock = threading.Lock()

    def full_key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    async def _client(self) -> Any:
        if not self._ready:
            async with self._session_lock:
                if not self._ready:
                    try:
                        await self._fs.set_session()
                    except Exception as exc:
                        raise _map_error(exc, f"connect to {self.endpoint_url or 'S3'}") from exc
                    self._ready = True
        return await self._fs.get_s3(self.bucket)

    async def retrying(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """Run ``attempt`` until it succeeds, fails for good, or ``attempts`` are used up;
        failures come out mapped to the store's error classes."""
        for tried in range(1, self.attempts + 1):
            try:
                return await attempt()
            except Exception as exc:
                if not is_transient(exc) or tried == self.attempts:
                    raise _map_error(exc, what, tried) from exc
            await asyncio.sleep(backoff_seconds(tried))
        raise AssertionError("unreachable")

    async def call(self, method: str, what: str, **kwargs: Any) -> Any:
        """One S3 API call, retried when transient; raises mapped StoreErrors."""

        async def once() -> Any:
            client = await self._client()
            return await getattr(client, method)(Bucket=self.bucket, **kwargs)

        return await self.retrying(what, once)

    async def checksum_args(self, data: bytes) -> dict[str, str]:
        if self._checksum == "none":
            return {}

        def digest() -> dict[str, str]:
            if self._checksum == "crc32":
                crc = zlib.crc32(data).to_bytes(4, "big")
                return {"ChecksumCRC32": base64.b64encode(crc).decode()}
            md5 = hashlib.md5(data, usedforsecurity=False).digest()
            return {"ContentMD5": base64.b64encode(md5).decode()}

        if len(data) < _SMALL_FOR_THREAD:
            return digest()
        return await asyncio.to_thread(digest)

    async def check(self) -> None:
        try:
            await self.call("head_bucket", f"bucket {self.bucket!r}")
        except NotFoundError as exc:
            raise NotFoundError(f"bucket {self.bucket!r} does not exist") from exc

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        full = self.full_key(key)
        extra: dict[str, str] = {}
        if start is not None or end is not None:
            lo = start or 0
            if end is not None and end <= lo:
                return b""
            extra["Range"] = f"bytes={lo}-{'' if end is None else end - 1}"

        async def once() -> bytes:
            # the body is read inside the attempt: a torn or short body is retried too
            client = await self._client()
            resp = await client.get_object(Bucket=self.bucket, Key=full, **extra)
            try:
                body: bytes = await resp["Body"].read()
            finally:
                resp["Body"].close()
            _check_length(resp, body)
            return body

        return await self.retrying(f"get {key}", once)

    async def put(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        full = self.full_key(key)
        extra: dict[str, str] = dict(await self.checksum_args(data))
        if create_only:
            extra["IfNoneMatch"] = "*"
        await self.call("put_object", f"put {key}", Key=full, Body=data, **extra)

    async def head(self, key: str) -> ObjectInfo:
        resp = await self.call("head_object", f"head {key}", Key=self.full_key(key))
        return ObjectInfo(key, int(resp["ContentLength"]))

    async def list(self, prefix: str) -> list[ObjectInfo]:
        if prefix.rstrip("/"):
            check_key(prefix.rstrip("/"))
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        found: list[ObjectInfo] = []
        token: dict[str, str] = {}
        while True:
            resp = await self.call("list_objects_v2", f"list {prefix!r}", Prefix=full, **token)
            for obj in resp.get("Contents", []):
                found.append(ObjectInfo(obj["Key"][strip:], int(obj["Size"])))
            if not resp.get("IsTruncated"):
                break
            token = {"ContinuationToken": resp["NextContinuationToken"]}
        found.sort(key=lambda o: o.key)
        return found

    async def delete(self, key: str) -> None:
        with contextlib.suppress(NotFoundError):
            await self.call("delete_object", f"delete {key}", Key=self.full_key(key))

    async def list_uploads(self, prefix: str) -> PendingUploads:
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

    async def salvage_upload(self, key: str) -> int | None:
        full = self.full_key(key)
        best: tuple[int, PendingUpload, Parts] | None = None
        for pending in await self.list_uploads(key):
            if pending.key != key:
                continue
            run = _leading_run(await self._list_parts(full, pending.upload_id))
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

        async def once() -> Any:
            nonlocal tries
            tries += 1
            client = await self._client()
            return await client.create_multipart_upload(Bucket=self.bucket, Key=full, **extra)

        resp = await self.retrying(f"start upload of {key}", once)
        upload_id = resp["UploadId"]
        if tries > 1:
            # an earlier try may have started an upload whose reply was lost: nobody will
            # ever complete it, so abort it now rather than leave it billed until the sweep
            with contextlib.suppress(StoreError):
                for pending in await self.list_uploads(key):
                    if pending.key == key and pending.upload_id != upload_id:
                        await self.abort_upload(pending)
        return S3Upload(self, key, upload_id)

    def range_reader(self) -> S3RangeReader:
        with self._reader_lock:  # one client per store, made on first use
            if self._reader is None:
                # the async client's data loader holds the parsed service models: sharing
                # it makes this second client ~0.3 s cheaper to create
                session = getattr(self._fs, "session", None)
                loader = session.get_component("data_loader") if session is not None else None
                self._reader = self._make_reader(loader=loader)
            return self._reader

    async def close(self) -> None:
        with self._reader_lock:
            reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
        client = getattr(self._fs, "_s3", None)
        if client is not None:
            await client.close()
        self._ready = False
