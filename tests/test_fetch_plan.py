"""How a restore's chunks are grouped into ranged reads (engine/fetch.py)."""

from __future__ import annotations

from transfer.engine.chunkindex import StoredChunk
from transfer.engine.fetch import (
    RANGES_PER_READER,
    READ_RANGE_BYTES,
    STREAM_RANGE_BYTES,
    balanced_cap,
    plan_ranges,
)

MiB = 1 << 20


def _packs(packs: int, per_pack: int, stored: int) -> list[StoredChunk]:
    return [
        StoredChunk(f"c{p}-{i}", 4 * MiB, "zstd", f"p{p}", i * stored, stored)
        for p in range(packs)
        for i in range(per_pack)
    ]


def test_a_few_long_packs_are_split_so_every_reader_gets_several_ranges() -> None:
    # a bf16 delta pull: 573 MB of payloads in 3 packs, 4 readers
    chunks = _packs(3, 136, 1_400_000)
    readers = 4
    cap = balanced_cap(sum(c.stored for c in chunks), readers)
    ranges = plan_ranges(chunks, cap)
    assert len(ranges) >= readers * RANGES_PER_READER
    assert max(r.end - r.start for r in ranges) <= cap
    # every chunk exactly once, each range one pack's contiguous run in offset order
    assert sorted(c.id for r in ranges for c in r.chunks) == sorted(c.id for c in chunks)
    for r in ranges:
        assert {c.pack_id for c in r.chunks} == {r.pack_id}
        assert [c.offset for c in r.chunks] == sorted(c.offset for c in r.chunks)
        assert r.start == r.chunks[0].offset and r.end == r.chunks[-1].offset + 1_400_000


def test_the_cap_stays_between_the_short_and_the_long_read() -> None:
    assert balanced_cap(1, 4) == READ_RANGE_BYTES  # a tiny restore: one short read
    assert balanced_cap(100 << 30, 4) == STREAM_RANGE_BYTES  # 100 GiB: long reads
    share = balanced_cap(600 * MiB, 4)
    assert share == -(-600 * MiB // (4 * RANGES_PER_READER))
    assert READ_RANGE_BYTES < share < STREAM_RANGE_BYTES
