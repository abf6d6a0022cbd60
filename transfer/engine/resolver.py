"""Raw bytes of any chunk by id: from a verified local copy when one is at hand, else from
the store (fetching and decoding its base chain first).

Local copies are found by position: a delta chunk's base sits at the same file path and
offset in the base checkpoint, so the caller passes that position as a hint; the bytes
there are used only when they hash to the expected id.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from transfer.codec import decode, decode_on_keyframe
from transfer.codec.transforms import Buffer
from transfer.engine.chunkindex import ChunkIndex, StoredChunk
from transfer.engine.stages import StageClock
from transfer.errors import FormatError, IntegrityError, NotFoundError, RangeNotSatisfiableError
from transfer.format.chunkid import chunk_id
from transfer.format.layout import pack_key
from transfer.format.manifest import MAX_CHAIN
from transfer.store.base import Store

Hint = tuple[str, int]  # (relative file path, offset in the file)


def read_local_chunk(
    root: Path, rel: str, offset: int, size: int, expected: str
) -> bytearray | None:
    """The bytes at ``root/rel[offset:offset+size]`` if they hash to ``expected``."""
    return read_file_verified(root / rel, offset, size, expected)  # rel: validated


def read_file_verified(path: Path, offset: int, size: int, expected: str) -> bytearray | None:
    """The ``size`` bytes of ``path`` at ``offset`` (never through a symlink) if they hash
    to ``expected``: the one check of a local copy before it is used or served."""
    got = read_file_hashed(path, offset, size)
    return got[0] if got is not None and got[1] == expected else None


def read_file_hashed(path: Path, offset: int, size: int) -> tuple[bytearray, str] | None:
    """The ``size`` bytes of ``path`` at ``offset`` and their chunk id, or None if they are
    not all there: how a local copy is read and hashed, by its re-check and by the probe
    that rates it (agent/peers/probe.py)."""
    data = bytearray(size)
    if not read_file_into(path, offset, memoryview(data)):
        return None
    return data, chunk_id(data)


def read_local_into(root: Path, rel: str, offset: int, buf: memoryview) -> bool:
    """Fill ``buf`` from ``root/rel`` at ``offset``, unverified: True if every byte was there.
    For a delta chunk's base: the decoded chunk's own hash check covers the base too."""
    return read_file_into(root / rel, offset, buf)  # rel: validated, it cannot leave root


def read_file_into(path: Path, offset: int, buf: memoryview) -> bool:
    """Fill ``buf`` from ``path`` at ``offset`` (never through a symlink), unverified: True
    if every byte was there. The one way the node's local copies are read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        return os.preadv(fd, [buf], offset) == len(buf)
    except OSError:
        return False
    finally:
        os.close(fd)


def read_local_spans(
    root: Path, rel: str, offset: int, spans: list[tuple[int, int]]
) -> list[bytearray] | None:
    """The bytes at ``offset + lo .. offset + hi`` of ``root/rel`` for each span, unverified
    (a writer's samples of a base, which only steer its choice); None if any is not there."""
    try:  # rel comes from a validated manifest: it cannot leave root
        fd = os.open(root / rel, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        pieces = [bytearray(hi - lo) for lo, hi in spans]
        for (lo, _), piece in zip(spans, pieces, strict=True):
            if os.preadv(fd, [piece], offset + lo) != len(piece):
                return None
        return pieces
    except OSError:
        return None
    finally:
        os.close(fd)


def decode_verified(
    chunk: StoredChunk,
    payload: Buffer,
    base: Buffer | None,
    out: memoryview | None = None,
    clock: StageClock | None = None,
    keyframe: tuple[str, Buffer] | None = None,
) -> Buffer:
    """Decode (into ``out`` when given) and check the hash; any mismatch is an
    IntegrityError naming the chunk. ``clock`` gets the decode and hash times.
    ``keyframe``: instead of ``base``, the base's (encoding, stored payload), decoded
    together with the chunk (codec.decode_on_keyframe)."""
    began = time.perf_counter()
    try:
        if keyframe is not None:
            data = decode_on_keyframe(chunk.enc, payload, chunk.size, *keyframe, out)
        else:
            data = decode(chunk.enc, payload, chunk.size, base, out)
    except FormatError as exc:
        msg = f"chunk {chunk.id} in pack {chunk.pack_id} is corrupt: {exc}"
        raise IntegrityError(msg, [chunk.id]) from None
    decoded = time.perf_counter()
    matches = chunk_id(data) == chunk.id
    if clock is not None:
        clock.add("decode", decoded - began)
        clock.add("hash", time.perf_counter() - decoded)
    if not matches:
        raise IntegrityError(
            f"chunk {chunk.id} in pack {chunk.pack_id} is corrupt: its bytes hash to "
            "something else" + (" (or its base is)" if chunk.base else ""),
            [chunk.id],
        )
    return data


def truncated(chunk: StoredChunk) -> IntegrityError:
    """A chunk's payload came back shorter than the index says."""
    return IntegrityError(f"chunk {chunk.id}: pack {chunk.pack_id} is truncated", [chunk.id])


def unreadable(chunk: StoredChunk) -> IntegrityError:
    """A chunk's pack is not in the store, or ends before the chunk."""
    msg = f"chunk {chunk.id}: pack {chunk.pack_id} is missing or truncated"
    return IntegrityError(msg, [chunk.id])


class ChunkResolver:
    def __init__(
        self,
        store: Store,
        index: ChunkIndex,
        pool: ThreadPoolExecutor,
        local_root: Path | None = None,
        on_bytes_read: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.store = store
        self.index = index
        self.pool = pool
        self.local_root = local_root
        self.on_bytes_read = on_bytes_read
        self.local_hits = 0  # chunks (and bases) read from local_root and used
        self._hits_lock = threading.Lock()
        self.clock = StageClock()  # thread time per stage: stages.py

    def decode(
        self,
        chunk: StoredChunk,
        payload: Buffer,
        base: Buffer | None,
        out: memoryview | None = None,
        keyframe: tuple[str, Buffer] | None = None,
    ) -> Buffer:
        """decode_verified, timed (runs in a worker thread)."""
        return decode_verified(chunk, payload, base, out, self.clock, keyframe)

    async def local(self, cid: str, size: int, hint: Hint | None) -> bytearray | None:
        if self.local_root is None or hint is None:
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self.read_local, cid, size, hint)

    def read_local(self, cid: str, size: int, hint: Hint) -> bytearray | None:
        """``cid``'s bytes from the local copy at ``hint``, verified; None if not there (in a
        worker thread)."""
        if self.local_root is None:
            return None
        data = read_local_chunk(self.local_root, hint[0], hint[1], size, cid)
        if data is not None:
            self.count_local_hit()
        return data

    def read_local_samples(
        self, hint: Hint, spans: list[tuple[int, int]]
    ) -> list[bytearray] | None:
        """Unverified bytes of the local copy at ``hint`` for each span (see
        read_local_spans); None without a local copy."""
        if self.local_root is None:
            return None
        return read_local_spans(self.local_root, hint[0], hint[1], spans)

    def count_local_hit(self) -> None:
        with self._hits_lock:  # called from reader threads too
            self.local_hits += 1

    async def raw(self, cid: str, hint: Hint | None = None, _depth: int = 0) -> Buffer:
        if _depth > MAX_CHAIN:  # manifests are validated; this guards hand-built indexes
            raise IntegrityError(f"chunk {cid}: base chain longer than {MAX_CHAIN}", [cid])
        chunk = self.index.get(cid)
        if chunk is None:
            raise IntegrityError(f"chunk {cid} is needed but no manifest says where it is", [cid])
        local = await self.local(cid, chunk.size, hint)
        if local is not None:
            return local
        try:
            payload = await self.store.get(
                pack_key(chunk.pack_id), chunk.offset, chunk.offset + chunk.stored
            )
        except (NotFoundError, RangeNotSatisfiableError):
            raise unreadable(chunk) from None
        self.on_bytes_read(len(payload))
        if len(payload) != chunk.stored:
            raise truncated(chunk)
        base = await self.raw(chunk.base, hint, _depth + 1) if chunk.base else None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self.decode, chunk, payload, base)
