"""Packs encoded chunks into large objects and uploads them as a sliding window of parts.

Why packs: a 100 GB checkpoint in 4 MiB chunks is 25,000 objects; as packs it is a few
hundred parts of one object each (restic does the same with blobs). Fewer requests, fewer
round trips, lower per-request cost; bench/pack_vs_objects.py measures the difference.

Concurrency: every part upload is a task in the caller's TaskGroup, gated by a semaphore of
``window`` slots shared by all packs, so at most ``window`` parts (and their bytes) are in
flight whatever the number of files. ``add`` waits for a slot: that is the backpressure that
keeps memory bounded.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from transfer.format.layout import new_pack_id, pack_key
from transfer.store.base import PartReceipt, Store, Upload


@dataclass(frozen=True, slots=True)
class PackLocation:
    pack_id: str
    offset: int
    stored: int


@dataclass
class _OpenPack:
    pack_id: str
    size: int = 0  # bytes assigned to this pack so far
    flushed: int = 0  # bytes handed to part uploads
    next_part: int = 1
    # payloads not yet handed to a part, by reference: a part is joined from them in one
    # copy (appending to a bytearray, slicing a part off it and shifting the rest were three,
    # all on the event loop's thread)
    pending: collections.deque[memoryview] = field(default_factory=collections.deque)
    pending_bytes: int = 0
    upload: asyncio.Task[Upload] | None = None
    parts: list[asyncio.Task[None]] = field(default_factory=list)
    members: list[tuple[object, PackLocation]] = field(default_factory=list)
    reported: int = 0  # members already told to on_pack_durable

    def take(self, nbytes: int | None = None) -> bytes:
        """The first ``nbytes`` pending bytes (all by default), as one part."""
        need = self.pending_bytes if nbytes is None else nbytes
        pieces = []
        while need:
            head = self.pending[0]
            if len(head) <= need:
                pieces.append(self.pending.popleft())
                need -= len(head)
            else:
                pieces.append(head[:need])
                self.pending[0] = head[need:]
                need = 0
        data = b"".join(pieces)
        self.pending_bytes -= len(data)
        return data


class PackWriter:
    def __init__(
        self,
        store: Store,
        tasks: asyncio.TaskGroup,
        *,
        part_size: int,
        pack_size: int,
        window: int,
        on_bytes_stored: Callable[[int], None],
        on_pack_durable: Callable[[str, list[tuple[object, PackLocation]]], None] | None = None,
        on_part_receipt: Callable[[str, PartReceipt], None] | None = None,
    ) -> None:
        # told (pack id, [(tag, location)]) as each pack becomes durable, and already as the
        # parts of a multipart pack are sent: a journal of these lets a restarted push reuse
        # durable packs, and salvage the landed parts of a pack its kill left unfinished
        # (Store.salvage_upload), instead of uploading everything again
        self._on_pack_durable = on_pack_durable
        # told (pack id, receipt) of each part before it is sent, where the store needs one
        # to complete the upload: journaled beside the packs, it lets a resumed push complete
        # the unfinished pack's upload with every part that landed
        self._on_part_receipt = on_part_receipt
        self._store = store
        self._tasks = tasks
        self._part_size = max(part_size, store.min_part_size)
        self._pack_size = pack_size
        self._slots = asyncio.Semaphore(window)
        self._on_bytes_stored = on_bytes_stored
        self._current: _OpenPack | None = None
        self._closing: list[asyncio.Task[None]] = []
        self._uploads: dict[str, asyncio.Task[Upload]] = {}  # by pack id
        self._reported: set[str] = set()  # packs whose chunks on_pack_durable was told
        # the final write of each pack runs shielded from cancellation, so that after a
        # failure abort() knows for sure which packs exist and can delete them
        self._commits: dict[str, asyncio.Future[None]] = {}
        self._packs: dict[str, _OpenPack] = {}  # the packs of those writes
        self.completed_packs: list[str] = []

    async def add(self, payload: bytes, tag: object = None) -> PackLocation:
        """Append one encoded chunk; returns where it will live once the pack completes."""
        pack = self._current
        if pack is None:
            pack = self._current = _OpenPack(new_pack_id())
        location = PackLocation(pack.pack_id, pack.size, len(payload))
        pack.members.append((tag, location))
        pack.pending.append(memoryview(payload))
        pack.pending_bytes += len(payload)
        pack.size += len(payload)
        if pack.size >= self._pack_size:
            self._current = None  # later chunks go to a new pack while this one drains
            await self._close(pack)
        else:
            while pack.pending_bytes >= self._part_size:  # parts of exactly part_size bytes
                await self._flush_part(pack, self._part_size)
        return location

    async def finish(self) -> list[str]:
        """Complete every pack; returns the ids of the packs now durable in the store."""
        if self._current is not None and self._current.size:
            pack, self._current = self._current, None
            await self._close(pack)
        for task in self._closing:
            await task
        return self.completed_packs

    async def abort(self, *, keep_reported: bool = True, interrupted: bool = False) -> None:
        """Best effort after a failure: drop pending uploads, and packs nobody references.
        Each pack's final write runs shielded, so it is waited for first: a pack that
        became durable (before the failure or after) is kept unless ``keep_reported`` is
        false or there is no journal (``on_pack_durable``, told of it now if it was not yet:
        its resume reuses it); the rest are deleted. ``interrupted`` (Ctrl-C, SIGTERM, a
        drain: the same push is meant to run again): an unfinished upload the journal
        knows is left as a kill leaves it, where the store can salvage what landed
        (``salvages_uploads``), so the next attempt completes it instead of sending its
        parts again (retention aborts it if none does)."""
        keep = keep_reported and self._on_pack_durable is not None
        leave = (
            keep and interrupted and self._store.salvages_uploads and bool(self._on_part_receipt)
        )
        outcomes = await asyncio.gather(*self._commits.values(), return_exceptions=True)
        landed = {
            p
            for p, o in zip(self._commits, outcomes, strict=True)
            if not isinstance(o, BaseException)
        }
        for pack_id, task in self._uploads.items():
            if pack_id in landed or (leave and pack_id in self._reported):
                continue
            if task.done() and not task.cancelled() and task.exception() is None:
                await task.result().abort()
        for pack_id in self._commits:
            if keep and pack_id in landed:
                self._report(self._packs[pack_id])  # (a landed whole PUT was not told yet)
                continue
            with contextlib.suppress(Exception):
                await self._store.delete(pack_key(pack_id))

    async def _flush_part(self, pack: _OpenPack, nbytes: int | None = None) -> None:
        """Send the first ``nbytes`` pending bytes (all of them by default) as the next part."""
        data = pack.take(nbytes)
        number, offset = pack.next_part, pack.flushed
        pack.next_part += 1
        pack.flushed += len(data)
        if pack.upload is None:
            pack.upload = self._tasks.create_task(self._store.begin_upload(pack_key(pack.pack_id)))
            self._uploads[pack.pack_id] = pack.upload
        self._report(pack)  # before the upload can begin: a kill never hides one from us
        await self._slots.acquire()
        pack.parts.append(self._tasks.create_task(self._send_part(pack, number, offset, data)))

    async def _send_part(self, pack: _OpenPack, number: int, offset: int, data: bytes) -> None:
        try:
            assert pack.upload is not None
            upload = await pack.upload
            receipt = None
            if self._on_part_receipt is not None:
                receipt = await upload.prepare_part(number, data)
                if receipt is not None:
                    self._on_part_receipt(pack.pack_id, receipt)  # before the send
            await upload.write_part(number, offset, data, receipt)
            self._on_bytes_stored(len(data))
        finally:
            self._slots.release()

    async def _close(self, pack: _OpenPack) -> None:
        if pack.upload is None:
            # Everything fits in one part: a single PUT beats create + part + complete.
            data = pack.take()
            await self._slots.acquire()
            self._closing.append(self._tasks.create_task(self._put_whole(pack, data)))
            return
        if pack.pending_bytes:
            await self._flush_part(pack)
        self._closing.append(self._tasks.create_task(self._complete(pack)))

    def _commit(self, pack: _OpenPack, write: Awaitable[None]) -> Awaitable[None]:
        self._packs[pack.pack_id] = pack
        self._commits[pack.pack_id] = asyncio.ensure_future(write)
        return asyncio.shield(self._commits[pack.pack_id])

    def _durable(self, pack: _OpenPack) -> None:
        self.completed_packs.append(pack.pack_id)
        self._report(pack)

    def _report(self, pack: _OpenPack) -> None:
        if self._on_pack_durable is not None and pack.reported < len(pack.members):
            self._on_pack_durable(pack.pack_id, pack.members[pack.reported :])
            pack.reported = len(pack.members)
            self._reported.add(pack.pack_id)

    async def _put_whole(self, pack: _OpenPack, data: bytes) -> None:
        try:
            await self._commit(pack, self._store.put(pack_key(pack.pack_id), data))
            self._on_bytes_stored(len(data))
            self._durable(pack)
        finally:
            self._slots.release()

    async def _complete(self, pack: _OpenPack) -> None:
        assert pack.upload is not None
        upload = await pack.upload
        for part in pack.parts:
            await part
        await self._commit(pack, upload.complete())
        self._durable(pack)
