"""Aborting multipart uploads whose writer died (a SIGKILLed push leaves them pending, and on
S3 their parts are billed until someone aborts them)."""

from __future__ import annotations

import time

from transfer.format.layout import PACKS_PREFIX
from transfer.store.base import Store


async def abort_orphaned_uploads(store: Store, older_than_s: float) -> int:
    """Abort pack uploads begun more than ``older_than_s`` ago; returns how many. The age
    guard keeps a live push on another node (same store) safe: packs complete in minutes."""
    cutoff = time.time() - older_than_s
    aborted = 0
    for pending in await store.list_uploads(PACKS_PREFIX):
        if pending.initiated < cutoff:
            await store.abort_upload(pending)
            aborted += 1
    return aborted
