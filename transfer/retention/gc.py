"""Garbage collection of packs: mark, then sweep in a later run, under a lease.

A pack no retained manifest references is garbage, but not at once: a push that started
before its last manifest was removed may still commit a new reference to it (dedupe or a
delta base), and packs of pushes in flight are unreferenced until their manifest lands.
So a run only *marks* unreferenced packs (``gc/state.json``: pack -> when first seen
unreferenced); a later run deletes a marked pack once it has stayed unreferenced for the
grace period. The grace period must exceed the longest push plus one GC run (pushes also
re-check, right before committing, that every pack they reuse still exists). A lease
(``gc/lock.json``, written create-only) keeps two runs from interleaving.

Without a grace period (``grace_s=0``: the operator says no push writes to the store) the
packs this very run released by expiring steps go at once, in one run; packs that were
already unreferenced when the run began (a crashed push's) are still marked first, since
a push may be uploading them now. And nothing at all is deleted without grace while any
push holds its lease (``locks/push/``): the lease is taken before a push reads the
manifests it dedupes against, so a push that could still reference a released pack is
always one we can see.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field

from transfer.engine.pushlease import (
    drop_lapsed_leases,
    holder_alive,
    holder_identity,
    push_lease_census,
)
from transfer.errors import AlreadyExistsError, FerryError, NotFoundError
from transfer.format import layout
from transfer.retention.inventory import Inventory, RetentionError, take_inventory
from transfer.store.base import Store

log = logging.getLogger(__name__)

GC_STATE_VERSION = 1
#: a lease older than this belongs to a dead run and may be broken
LEASE_SECONDS = 3600.0


class GcBusyError(RetentionError):
    """Another retention run holds the store's lease."""


@dataclass
class GcResult:
    url: str
    referenced_packs: int = 0
    #: unreferenced packs still inside their grace period (deleted by a later run)
    marked_packs: int = 0
    marked_bytes: int = 0
    deleted_packs: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    dry_run: bool = False
    #: pushes holding their lease: without a grace period, deleting waits for them
    running_pushes: int = 0
    #: unfinished pack uploads aborted (a killed push's ``.tmp`` file or multipart upload:
    #: no live push holds its lease, or it is older than the grace period), their bytes where
    #: the store tells, and the younger ones left for a push that may still finish them
    aborted_uploads: int = 0
    aborted_upload_bytes: int = 0
    pending_uploads: int = 0
    #: push leases that lapsed (a killed push's, its part never pushed again), removed
    lapsed_leases: int = 0
    #: packs and manifests the store holds once this sweep is done (the inventory's count;
    #: None in a dry run, which changes nothing: the plan's ``bytes_after`` forecasts it)
    bytes_stored: int | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@asynccontextmanager
async def gc_lease(store: Store, holder: str, now: float | None = None) -> AsyncIterator[None]:
    """Hold the store's retention lease for the body; raise GcBusyError if a live run has it."""
    token = f"{holder}-{secrets.token_hex(4)}"
    started = time.time() if now is None else now
    doc = json.dumps(
        {"holder": token, "expires_at": started + LEASE_SECONDS, **holder_identity()}
    ).encode()
    for _ in range(2):
        try:
            await store.put(layout.GC_LOCK_KEY, doc, create_only=True)
            break
        except AlreadyExistsError:
            other = await _read_json(store, layout.GC_LOCK_KEY)
            if other.get("holder") == token:
                break  # the reply to an earlier try was lost, and that try landed: ours
            expires = other.get("expires_at")
            # garbled, expired, or held by a dead process of this host (a killed run): break it
            if isinstance(expires, (int, float)) and expires > started and holder_alive(other):
                raise GcBusyError(
                    f"{store.url}: retention is already running ({other.get('holder')!r} "
                    f"holds {layout.GC_LOCK_KEY}); try again later"
                ) from None
            log.warning("breaking the retention lease of %r (expired, or its process is gone)",
                        other.get("holder"))  # fmt: skip
            await store.delete(layout.GC_LOCK_KEY)
    else:
        raise GcBusyError(f"{store.url}: lost the race for {layout.GC_LOCK_KEY}; try again")
    try:
        yield
    finally:
        try:
            if (await _read_json(store, layout.GC_LOCK_KEY)).get("holder") == token:
                await store.delete(layout.GC_LOCK_KEY)
        except FerryError as exc:  # it expires on its own
            log.warning("could not release %s: %s", layout.GC_LOCK_KEY, exc)


async def collect_garbage(
    store: Store,
    inventory: Inventory,
    *,
    grace_s: float,
    now: float,
    released: frozenset[str] = frozenset(),
    dry_run: bool = False,
    expected_nodes: tuple[str, ...] = (),
) -> GcResult:
    """Mark and sweep the packs of ``store``; call it under ``gc_lease``.

    ``inventory`` is the state after retention removed manifests; the store is listed again
    here, so a manifest committed since then is seen (only new manifests are read).
    ``released``: the packs referenced when this run began (before its expiries).
    """
    # leases first: a push that commits after the listing below held its lease by now
    pushes, lapsed = await push_lease_census(store)
    known = {
        (job, step, node): packs
        for (job, step), entry in inventory.steps.items()
        for node, packs in entry.parts.items()
    }
    fresh = (
        inventory
        if dry_run  # nothing is deleted: the plan's view is what to report
        else await take_inventory(store, now=now, expected_nodes=expected_nodes, known=known)
    )
    referenced = fresh.referenced()
    state = await load_gc_state(store)
    marks: dict[str, float] = {}
    doomed: list[str] = []
    for pack_id in sorted(set(fresh.pack_sizes) - referenced):
        first_seen = state.get(pack_id)
        if _may_delete(pack_id, first_seen, grace_s=grace_s, now=now, released=released,
                       pushes=pushes):  # fmt: skip
            doomed.append(pack_id)
        else:
            marks[pack_id] = first_seen if first_seen is not None else now
    freed = sum(fresh.pack_sizes[p] for p in doomed)
    stale = [u for u in fresh.uploads if _may_abort(u.initiated, grace_s, now, pushes)]
    result = GcResult(
        store.url,
        referenced_packs=len(referenced),
        marked_packs=len(marks),
        marked_bytes=sum(fresh.pack_sizes[p] for p in marks),
        deleted_packs=doomed,
        freed_bytes=freed,
        dry_run=dry_run,
        running_pushes=pushes,
        bytes_stored=None if dry_run else fresh.total_bytes() - freed,
        aborted_uploads=len(stale),
        aborted_upload_bytes=sum(u.size or 0 for u in stale),
        pending_uploads=len(fresh.uploads) - len(stale),
    )
    if dry_run:
        return result
    # The state is written before deleting: a crash mid-sweep leaves doomed packs unmarked,
    # which only restarts their grace period (the safe direction).
    await save_gc_state(store, marks, now)
    for pack_id in doomed:
        await store.delete(layout.pack_key(pack_id))
    for upload in stale:
        await store.abort_upload(upload)
        log.info("gc %s: aborted the unfinished upload of %s", store.url, upload.key)
    # (after the uploads: a lease that lapsed is no push that might still finish one)
    result.lapsed_leases = await drop_lapsed_leases(store, lapsed)
    if doomed:
        log.info("gc %s: deleted %d packs, %d bytes", store.url, len(doomed), result.freed_bytes)
    return result


def _may_delete(
    pack_id: str,
    first_seen: float | None,
    *,
    grace_s: float,
    now: float,
    released: frozenset[str],
    pushes: int,
) -> bool:
    if grace_s > 0:
        return first_seen is not None and now - first_seen >= grace_s
    if pushes:
        return False  # a running push may reference it before it commits
    return first_seen is not None or pack_id in released


def _may_abort(initiated: float, grace_s: float, now: float, pushes: int) -> bool:
    """An unfinished upload is a dead push's once it is older than the grace period, or,
    without one, once no push holds its lease (a live push always does)."""
    if grace_s > 0:
        return now - initiated >= grace_s
    return not pushes


async def load_gc_state(store: Store) -> dict[str, float]:
    """Pack id -> when a run first saw it unreferenced. A missing state means no marks; an
    unreadable one is an error (ignoring it could not delete too early, but hides a bug)."""
    try:
        doc = await _read_json(store, layout.GC_STATE_KEY)
    except NotFoundError:
        return {}
    saved = doc.get("marks")
    if doc.get("version") != GC_STATE_VERSION or not isinstance(saved, dict):
        raise RetentionError(f"{store.url}: {layout.GC_STATE_KEY} has an unknown version")
    marks: dict[str, float] = {}
    for pack_id, first_seen in saved.items():
        if _is_pack_id(pack_id) and _is_number(first_seen):
            marks[pack_id] = float(first_seen)
    return marks


async def save_gc_state(store: Store, marks: dict[str, float], now: float) -> None:
    doc = {"version": GC_STATE_VERSION, "updated_at": now, "marks": marks}
    await store.put(layout.GC_STATE_KEY, json.dumps(doc, sort_keys=True).encode())


async def _read_json(store: Store, key: str) -> dict[str, object]:
    try:
        doc = json.loads(await store.get(key))
    except ValueError:
        raise RetentionError(f"{store.url}: {key} is not JSON") from None
    if not isinstance(doc, dict):
        raise RetentionError(f"{store.url}: {key} is not a JSON object")
    return doc


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_pack_id(value: str) -> bool:
    try:
        layout.check_pack_id(value)
    except FerryError:
        return False
    return True
