"""The engine's side of a chunk source (transfer/engine/pull.py ``_from_source``): what a
source lands is checked and written, and nothing is written once the restore has moved on,
even by a thread still receiving when the prefetch was cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from transfer.codec.transforms import Buffer
from transfer.engine.chunkindex import ChunkIndex, StoredChunk
from transfer.engine.pull import _from_source
from transfer.engine.sources import Land, LocalBase, Supplied
from transfer.format.chunkid import chunk_id

DATA = [bytes([i]) * 4096 for i in range(4)]


def _index() -> tuple[ChunkIndex, list[str]]:
    index = ChunkIndex()
    for i, data in enumerate(DATA):
        index.add(StoredChunk(chunk_id(data), len(data), "raw", "p", i * 4096, 4096))
    return index, [chunk_id(d) for d in DATA]


class _SlowPeer:
    """Receives each chunk in a thread of its own that takes ``delay`` s, then lands it
    there (as agent/peers/chunks.py does); one chunk's bytes are wrong."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.pool = ThreadPoolExecutor(8)
        self.refused: list[str] = []

    async def __call__(
        self, chunk: StoredChunk, base: LocalBase | None, land: Land | None = None
    ) -> Supplied | None:
        assert land is not None
        data = next(d for d in DATA if chunk_id(d) == chunk.id)
        if data is DATA[3]:
            data = b"x" * 4096  # a hostile peer

        def receive() -> bool:
            time.sleep(self.delay)
            ok = land(chunk, data)
            if not ok:
                self.refused.append(chunk.id)
            return ok

        landed = await asyncio.get_running_loop().run_in_executor(self.pool, receive)
        return (None, len(data), "peer:slow") if landed else None


def _gather(peer: _SlowPeer, cancel_after: float | None) -> tuple[dict[str, int] | None, list[str]]:
    index, ids = _index()
    written: list[str] = []
    lock = threading.Lock()

    def write(c: StoredChunk, data: Buffer) -> None:
        with lock:
            written.append(c.id)

    async def run() -> dict[str, int] | None:
        task = asyncio.ensure_future(
            _from_source(peer, None, index, ids, write, 4, lambda cid: None)  # type: ignore[arg-type]
        )
        if cancel_after is None:
            return await task
        await asyncio.sleep(cancel_after)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None

    supplied = asyncio.run(run())
    peer.pool.shutdown(wait=True)  # every receiving thread has finished now
    return supplied, written


def test_what_a_source_lands_is_checked_and_written() -> None:
    peer = _SlowPeer(delay=0.05)
    supplied, written = _gather(peer, cancel_after=None)
    assert supplied is not None
    good = {chunk_id(d) for d in DATA[:3]}
    assert set(supplied) == good and set(written) == good  # the wrong bytes are not
    assert peer.refused == [chunk_id(DATA[3])]


def test_nothing_is_written_after_the_restore_was_cancelled() -> None:
    peer = _SlowPeer(delay=0.5)
    supplied, written = _gather(peer, cancel_after=0.1)
    assert supplied is None
    assert written == []  # the threads landed after the cancellation: turned away
    assert len(peer.refused) == len(DATA)
