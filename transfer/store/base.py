"""The store interface: a flat key space of immutable objects plus multipart uploads.

Error semantics (every backend): a missing key raises NotFoundError, a create-only write onto
an existing key raises AlreadyExistsError, rejected credentials raise AccessDeniedError,
anything else raises StoreError. ``delete`` of a missing key is not an error.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from transfer.errors import FormatError, NotFoundError
from transfer.format.paths import check_relative_path


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int


@dataclass(frozen=True, slots=True)
class PendingUpload:
    """A multipart upload begun and never completed or aborted (its writer may be dead)."""

    key: str
    upload_id: str
    initiated: float  # unix time
    #: bytes it holds so far (None: the backend cannot tell)
    size: int | None = None


PendingUploads = list[PendingUpload]  # (a name: inside Store, ``list`` is the method)
T = TypeVar("T")


class StoreThreads:
    """A store's own worker threads for its blocking requests, as many as the transfers it
    serves keep in flight (``StoreOptions.pool_size``: the window plus a few control calls),
    so the window is what limits: Python's default executor has cpu + 4 threads (6 here)
    and is shared with every other ``to_thread`` of the process."""

    def __init__(self, size: int, name: str) -> None:
        if size < 1:
            raise ValueError("a store needs at least one thread")
        self.size = size
        self._pool = ThreadPoolExecutor(size, thread_name_prefix=name)

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def check_key(key: str) -> str:
    """Keys are relative POSIX paths without '..' (they become file paths on local stores)."""
    try:
        return check_relative_path(key)
    except FormatError as exc:
        raise ValueError(f"invalid store key: {exc}") from None


#: what completing a part later needs, known before it is sent (S3 with CRC32 checksums: its
#: number, size and checksum): a writer journals it before the send, so that a resumed push
#: can complete an upload its kill left pending even where ListParts omits part checksums
#: (SeaweedFS does) and even for a part that landed after the kill cut its reply off
PartReceipt = dict[str, Any]


class Upload(ABC):
    """An object written in parts, possibly concurrently and out of order.

    Nothing is visible under ``key`` until ``complete`` returns; ``abort`` discards the parts.
    Parts are numbered from 1; ``offset`` is where the part starts in the final object.
    """

    key: str

    async def prepare_part(self, number: int, data: bytes) -> PartReceipt | None:
        """What completing part ``number`` holding ``data`` will need, if anything (pass it
        to ``write_part``: the work is not done twice)."""
        return None

    @abstractmethod
    async def write_part(
        self, number: int, offset: int, data: bytes, receipt: PartReceipt | None = None
    ) -> None: ...

    @abstractmethod
    async def complete(self, *, create_only: bool = False) -> None: ...

    @abstractmethod
    async def abort(self) -> None: ...


class RangeReader(ABC):
    """Blocking ranged reads straight into a caller's buffer, callable from many threads at
    once. Why beside the async ``get``: on a 2-core node a pull is bound by the one event-loop
    thread that receives every byte into fresh ``bytes`` objects; worker threads that receive
    into reused buffers (the GIL is released while they wait on the socket) move the same
    bytes with less CPU and on every core. Same error semantics as ``Store.get``."""

    @abstractmethod
    def read_into(self, key: str, start: int, buf: memoryview) -> int:
        """Fill ``buf`` with the object's bytes from ``start``; returns how many it had
        there (fewer than ``len(buf)`` only at the object's end)."""

    def streams(self) -> bool:
        """True when ``stream`` answers (a reader may then plan long ranges)."""
        return False

    def stream(self, key: str, start: int, end: int) -> RangeStream | None:
        """Bytes ``start``..``end`` of the object as one request read piece by piece, or
        None where each read is a request of its own (then use ``read_into``). Why: a
        reader can take a long range in one request (cheaper per byte for the server)
        without holding a buffer the size of it."""
        return None

    def close(self) -> None:  # noqa: B027  # optional hook
        """Release connections."""


class RangeStream(ABC):
    """One ranged read's bytes, in order (RangeReader.stream); retried from where it stood
    when the connection fails. A context manager: leave it to release the request."""

    @abstractmethod
    def fill(self, buf: memoryview) -> int:
        """Fill ``buf`` with the next bytes; how many there were (fewer only at the
        object's end)."""

    def __enter__(self) -> RangeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:  # noqa: B027  # optional hook
        """Give up the rest (an unread remainder closes its connection)."""


class Store(ABC):
    """A backend. Every write is durable when the awaited call returns."""

    url: str
    #: smallest allowed part except the last (S3: 5 MiB); the engine sizes parts above it
    min_part_size: int = 1
    #: whether ``salvage_upload`` can keep the parts an unfinished upload landed (S3: it
    #: lists them): an interrupted push then leaves its uploads for the next attempt
    salvages_uploads: bool = False

    @abstractmethod
    async def check(self) -> None:
        """Raise NotFoundError/AccessDeniedError when the store root is unusable."""

    async def create_root(self) -> None:
        """Make the store's root exist (``ferry init`` only: a local directory that is not
        there yet is made; nothing else creates one, so a missing mount stays an error).
        This default creates nothing: a bucket is never created, a prefix needs no
        creating; it checks the root as ``check`` does."""
        await self.check()

    async def holds_objects(self) -> bool:
        """True when the store holds any object at all (whether a new store may be made
        here). This default lists every object; backends override it to stop at the first."""
        return bool(await self.list(""))

    @abstractmethod
    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of the object (the whole object by default)."""

    @abstractmethod
    async def put(self, key: str, data: bytes, *, create_only: bool = False) -> None: ...

    @abstractmethod
    async def head(self, key: str) -> ObjectInfo: ...

    async def list_dirs(self, prefix: str) -> list[str]:
        """The names one level below ``prefix`` (ending in "/") that hold objects, sorted: a
        delimiter listing, whose cost grows with those names, not with what lies under
        them (a job's steps, not its steps x nodes). This default lists everything below;
        backends that can ask for one level override it."""
        names = set()
        for obj in await self.list(prefix):
            rest = obj.key[len(prefix) :]
            if "/" in rest:
                names.add(rest.split("/", 1)[0])
        return sorted(names)

    @abstractmethod
    async def list(self, prefix: str) -> list[ObjectInfo]:
        """Every committed object whose key starts with ``prefix``, sorted by key."""

    @abstractmethod
    async def delete(self, key: str) -> None: ...

    @abstractmethod
    async def begin_upload(self, key: str) -> Upload: ...

    @abstractmethod
    async def list_uploads(self, prefix: str) -> PendingUploads:
        """Uploads under ``prefix`` that were begun and are not finished."""

    @abstractmethod
    async def abort_upload(self, pending: PendingUpload) -> None: ...

    async def salvage_upload(self, key: str, receipts: Sequence[PartReceipt] = ()) -> int | None:
        """Complete an upload of ``key`` that a dead writer left pending with what landed:
        its parts from the first on, up to the first gap. Returns the length of the object
        now at ``key``, or None when nothing was kept (such an upload is aborted). Call it
        only for keys whose writer is known to be dead. ``receipts``: what the dead writer's
        ``prepare_part`` calls returned, as it journaled them. Backends that cannot tell which
        parts landed keep nothing."""
        return None

    async def close(self) -> None:  # noqa: B027  # optional hook
        """Release connections; the store is unusable afterwards."""

    def range_reader(self) -> RangeReader | None:
        """A blocking reader for bulk ranged reads, or None (use ``get``). May block while
        it sets up (call it from a thread); the store owns it and closes it in ``close``."""
        return None

    async def exists(self, key: str) -> bool:
        """True/False only when the store says so; other errors propagate (never 'absent')."""
        try:
            await self.head(key)
        except NotFoundError:
            return False
        return True
