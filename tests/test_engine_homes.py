"""The engine's shared helpers: grouping chunks into ranged reads (engine/ranges.py) and N
workers over one shared iterator (engine/workers.py)."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Iterator

import pytest

from transfer.engine.chunkindex import StoredChunk
from transfer.engine.fetch import _MAX_GAP, plan_ranges
from transfer.engine.ranges import ChunkRange, coalesce
from transfer.engine.workers import run_workers
from transfer.errors import FerryError

KiB = 1 << 10


def _chunk(name: str, pack: str, offset: int, stored: int) -> StoredChunk:
    return StoredChunk(name, stored, "zstd", pack, offset, stored)


Span = tuple[str, int, int, list[str]]  # (pack, start, end, chunk ids)


def _spans(ranges: list[ChunkRange]) -> list[Span]:
    return [(r.pack_id, r.start, r.end, [c.id for c in r.chunks]) for r in ranges]


def test_a_gap_up_to_the_limit_is_read_through_and_a_wider_one_starts_a_new_range() -> None:
    a = _chunk("a", "p", 0, 100)
    b = _chunk("b", "p", 150, 100)  # 50 bytes after a
    c = _chunk("c", "p", 301, 100)  # 51 bytes after b
    assert _spans(coalesce([a, b, c], max_gap=50)) == [
        ("p", 0, 250, ["a", "b"]),
        ("p", 301, 401, ["c"]),
    ]
    assert _spans(coalesce([a, b, c], max_gap=0)) == [
        ("p", 0, 100, ["a"]),
        ("p", 150, 250, ["b"]),
        ("p", 301, 401, ["c"]),
    ]


def test_a_range_never_grows_past_max_bytes_unless_one_chunk_alone_does() -> None:
    chunks = [_chunk(f"c{i}", "p", i * 100, 100) for i in range(7)]
    ranges = coalesce(chunks, max_gap=0, max_bytes=300)
    assert [len(r.chunks) for r in ranges] == [3, 3, 1]
    assert all(r.end - r.start <= 300 for r in ranges)
    big = _chunk("big", "p", 700, 1000)
    assert _spans(coalesce([big], max_gap=0, max_bytes=300)) == [("p", 700, 1700, ["big"])]


def test_the_order_is_kept_another_pack_or_an_earlier_offset_starts_a_new_range() -> None:
    a, b = _chunk("a", "p", 0, 10), _chunk("b", "p", 10, 10)
    c, d = _chunk("c", "q", 20, 10), _chunk("d", "q", 30, 10)
    assert _spans(coalesce([c, d, a, b], max_gap=KiB)) == [
        ("q", 20, 40, ["c", "d"]),
        ("p", 0, 20, ["a", "b"]),
    ]
    # back to back, but given backwards: two reads, in the caller's order
    assert _spans(coalesce([b, a], max_gap=KiB)) == [("p", 10, 20, ["b"]), ("p", 0, 10, ["a"])]


def _plan_ranges_before(chunks: list[StoredChunk], max_bytes: int) -> list[Span]:
    """fetch.plan_ranges as it was written before it called coalesce."""
    by_pack: dict[str, list[StoredChunk]] = defaultdict(list)
    for c in chunks:
        by_pack[c.pack_id].append(c)
    out: list[Span] = []
    for pack_id, members in by_pack.items():
        members.sort(key=lambda c: c.offset)
        group: list[StoredChunk] = []
        for c in members:
            if group:
                start, end = group[0].offset, max(g.offset + g.stored for g in group)
                if c.offset - end > _MAX_GAP or c.offset + c.stored - start > max_bytes:
                    out.append((pack_id, start, end, [g.id for g in group]))
                    group = []
            group.append(c)
        if group:
            end = max(g.offset + g.stored for g in group)
            out.append((pack_id, group[0].offset, end, [g.id for g in group]))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_plan_ranges_groups_as_it_did_gaps_caps_and_overlaps_included(seed: int) -> None:
    rng = random.Random(seed)
    chunks = []
    for i in range(rng.randrange(1, 60)):
        stored = rng.randrange(1, 300 * KiB)
        pos = rng.randrange(0, 8 << 20)  # some overlap: a corrupt index is grouped too
        chunks.append(_chunk(f"c{i}", f"p{rng.randrange(3)}", pos, stored))
    cap = rng.choice([256 * KiB, 1 << 20, 4 << 20])
    assert _spans(plan_ranges(chunks, cap)) == _plan_ranges_before(chunks, cap)


def test_every_item_goes_to_exactly_one_of_n_workers_running_at_once() -> None:
    seen: list[int] = []
    running = peak = 0
    per_worker: list[int] = []

    async def worker(items: Iterator[int]) -> None:
        nonlocal running, peak
        mine = 0
        for item in items:
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.001)
            running -= 1
            seen.append(item)
            mine += 1
        per_worker.append(mine)

    asyncio.run(run_workers(range(40), worker, 4))
    assert sorted(seen) == list(range(40))
    assert peak == 4 and len(per_worker) == 4 and all(n > 0 for n in per_worker)


def test_the_first_failure_is_raised_alone_and_the_other_workers_are_cancelled() -> None:
    cancelled = 0

    async def main() -> None:
        first_item_taken = asyncio.Event()

        async def worker(items: Iterator[int]) -> None:
            nonlocal cancelled
            for item in items:
                if item == 0:
                    first_item_taken.set()
                    await asyncio.sleep(0)
                    raise FerryError("chunk 0 is bad")
                try:
                    await asyncio.sleep(10)  # would hang the test if not cancelled
                except asyncio.CancelledError:
                    cancelled += 1
                    raise

        with pytest.raises(FerryError, match="chunk 0 is bad"):
            await asyncio.wait_for(run_workers(range(100), worker, 3), 5)
        assert first_item_taken.is_set()

    asyncio.run(main())
    assert cancelled == 2


def test_errors_as_group_keeps_the_task_groups_exception_group() -> None:
    async def worker(items: Iterator[int]) -> None:
        for _ in items:
            raise FerryError("bad")

    with pytest.raises(ExceptionGroup) as caught:
        asyncio.run(run_workers([1], worker, 2, errors_as_group=True))
    assert [type(e) for e in caught.value.exceptions] == [FerryError]
