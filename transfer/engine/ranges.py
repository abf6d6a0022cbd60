"""Grouping chunks into ranged reads: chunks near each other in one pack come in one request.

The one rule behind a restore's ranges (fetch.plan_ranges), the runs of keyframe bases a
reader thread fetches at once (fetch._BaseWindow) and the runs a tier probe times.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from transfer.engine.chunkindex import StoredChunk


@dataclass(frozen=True, slots=True)
class ChunkRange:
    """One ranged read: bytes ``[start, end)`` of pack ``pack_id``, holding ``chunks``."""

    pack_id: str
    start: int
    end: int
    chunks: tuple[StoredChunk, ...]


def coalesce(
    chunks: Iterable[StoredChunk], *, max_gap: int, max_bytes: int | None = None
) -> list[ChunkRange]:
    """``chunks``, in the order given, cut into ranged reads. A chunk joins the range before
    it when it is in the same pack, starts no earlier than that range, at most ``max_gap``
    bytes past its end (the gap is read through, not skipped), and keeps the range within
    ``max_bytes`` (None: no cap); otherwise it starts a new range.

    ``max_gap=0`` joins only chunks back to back (or overlapping). Give the chunks sorted by
    offset within each pack to group all that can be (the order is kept, not imposed: a
    caller's own order of requests stays as it was)."""
    ranges: list[ChunkRange] = []
    group: list[StoredChunk] = []
    start = end = 0
    for c in chunks:
        if group and (
            c.pack_id != group[0].pack_id
            or c.offset < start
            or c.offset - end > max_gap
            or (max_bytes is not None and c.offset + c.stored - start > max_bytes)
        ):
            ranges.append(ChunkRange(group[0].pack_id, start, end, tuple(group)))
            group = []
        if not group:
            start = end = c.offset
        group.append(c)
        end = max(end, c.offset + c.stored)
    if group:
        ranges.append(ChunkRange(group[0].pack_id, start, end, tuple(group)))
    return ranges
