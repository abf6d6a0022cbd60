"""Pins in a store: "do not delete this step" until an expiry, visible to every node's
retention (an agent's in-memory pins protect only its own hot directory).

A pin is one small object per holder (``pins/<job>/<step>/<holder>.json``), so holders never
overwrite each other; it always expires, so a dead client cannot pin forever. Expiry uses the
writer's clock: keep clocks within minutes of each other, as S3 request signing requires.
"""

from __future__ import annotations

import json
import time

from transfer.errors import FerryError, NotFoundError
from transfer.format import layout
from transfer.store.base import Store

#: the longest a pin may last
MAX_PIN_SECONDS = 7 * 86400.0


async def pin(store: Store, job: str, step: int, holder: str, ttl_s: float) -> float:
    """Pin (job, step) for ``ttl_s`` seconds on behalf of ``holder``; returns the expiry.
    Pinning again moves the expiry (to extend a pin, or to shorten it)."""
    if not 0 < ttl_s <= MAX_PIN_SECONDS:
        raise ValueError(
            f"a pin lasts more than 0 s and at most {MAX_PIN_SECONDS / 86400:.0f} days "
            f"({MAX_PIN_SECONDS:.0f} s); asked {ttl_s:,.0f} s ({ttl_s / 86400:.3g} days)"
        )
    expires = time.time() + ttl_s
    doc = {"job": job, "step": step, "holder": holder, "expires_at": expires}
    await store.put(layout.pin_key(job, step, holder), json.dumps(doc).encode())
    return expires


async def unpin(store: Store, job: str, step: int, holder: str) -> bool:
    """Remove ``holder``'s pin of (job, step); True if it was pinned (an unexpired or
    unreadable pin was there: retention honoured it), False if there was nothing to remove."""
    key = layout.pin_key(job, step, holder)
    try:
        doc = await store.get(key)
    except NotFoundError:
        return False
    await store.delete(key)
    try:
        return float(json.loads(doc)["expires_at"]) > time.time()
    except (ValueError, KeyError, TypeError):
        return True  # unreadable: read_pins treated it as pinned


async def pin_expiry(store: Store, key: str) -> float | None:
    """When the pin object at ``key`` expires; None if it is gone or unreadable (callers
    decide what that means: retention treats it as pinned)."""
    try:
        return float(json.loads(await store.get(key))["expires_at"])
    except (FerryError, ValueError, KeyError, TypeError):
        return None


async def drop_expired_pins(store: Store, now: float) -> int:
    """Delete pin objects whose expiry has passed (housekeeping; they protect nothing)."""
    dropped = 0
    for obj in await store.list(layout.PINS_PREFIX):
        if layout.parse_pin_key(obj.key) is None:
            continue
        expires = await pin_expiry(store, obj.key)
        if expires is None:
            continue  # gone, or unreadable: read_pins treats it as pinned; leave it for a human
        if expires <= now:
            await store.delete(obj.key)
            dropped += 1
    return dropped
