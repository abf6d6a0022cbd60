"""What a push remembers so that, killed half way and run again, it reuses what it sent.

A resume log holds, for one push (job, step, node to one store), the chunks of each pack that
became durable and the receipt of each part of an unfinished pack, written before the part is
sent. The push reads both back when it starts (``chunks()``, ``parts()``), reuses the chunks
whose pack still exists and completes, with what landed, the upload of a pack the kill left
unfinished (``Store.salvage_upload``). The caller owns the log and forgets it once the push
commits (its manifest then references every pack). The one implementation on disk is the
agent's SQLite journal (agent/journal.py), which ``ferry push`` opens too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from transfer.engine.chunkindex import StoredChunk
from transfer.store.base import PartReceipt


class ResumeLog(Protocol):
    def chunks(self) -> Iterable[StoredChunk]:
        """Chunks of the packs an earlier attempt made durable."""
        ...

    def parts(self) -> Mapping[str, Sequence[PartReceipt]]:
        """Receipts of the parts an earlier attempt sent, by pack id."""
        ...

    def pack_durable(self, chunks: list[StoredChunk]) -> None:
        """Record one durable pack's chunks (called as each pack completes, and already as
        the parts of a multipart pack are sent)."""
        ...

    def part_sent(self, pack_id: str, receipt: PartReceipt) -> None:
        """Record the receipt of a part about to be sent."""
        ...
