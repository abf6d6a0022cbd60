"""What one store tier holds, as retention sees it: steps (with their parts, completeness,
age and packs), pack sizes, and pins. One listing per prefix plus one GET per manifest."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from transfer.engine.catalog import (
    Catalog,
    list_checkpoints,
    load_manifest,
    parts_lack_metadata,
    step_is_complete,
    unless_damaged,
    whole_by_files,
)
from transfer.errors import FerryError, FormatError
from transfer.format import layout
from transfer.format.manifest import PART_EXTRA, Manifest
from transfer.format.names import Key
from transfer.retention.pins import pin_expiry
from transfer.store.base import PendingUpload, Store

log = logging.getLogger(__name__)

#: manifests read at once while taking inventory
_CONCURRENT_GETS = 16


class RetentionError(FerryError):
    """Retention refused to run: deleting anything could lose data (the message says why)."""


@dataclass
class StepEntry:
    job: str
    step: int
    #: node -> the packs its manifest references (files and bases)
    parts: dict[str, frozenset[str]] = field(default_factory=dict)
    #: node -> manifest size in bytes
    manifest_bytes: dict[str, int] = field(default_factory=dict)
    #: node -> the manifest, as read by this inventory (absent for parts passed as ``known``):
    #: repacking and the space forecast read it here instead of fetching it again
    manifests: dict[str, Manifest] = field(default_factory=dict, repr=False)
    #: pack -> {offset: stored length} of the chunks the step's parts use in it
    extents: dict[str, dict[int, int]] = field(default_factory=dict)
    #: the checkpoint's own size, all parts (0 for parts read before: see ``known``)
    bytes_raw: int = 0
    has_marker: bool = False
    complete: bool = False
    created: float = 0.0  # unix time of the newest part's manifest

    @property
    def key(self) -> Key:
        return (self.job, self.step)

    @property
    def packs(self) -> frozenset[str]:
        return frozenset().union(*self.parts.values())


@dataclass
class Inventory:
    url: str
    steps: dict[Key, StepEntry]
    #: every committed pack in the store, referenced or not
    pack_sizes: dict[str, int]
    #: (job, step) -> latest pin expiry (unix time), expired pins left out
    pins: dict[Key, float]
    #: pack uploads begun and never finished: a running push's, or a killed one's left-over
    #: (a local store's hidden ``.<pack>.tmp-*`` file, an S3 multipart upload)
    uploads: list[PendingUpload] = field(default_factory=list)

    def jobs(self) -> list[str]:
        return sorted({job for job, _ in self.steps})

    def referenced(self, keys: Iterable[Key] | None = None) -> set[str]:
        chosen = self.steps if keys is None else keys
        out: set[str] = set()
        for key in chosen:
            out |= self.steps[key].packs
        return out

    def bytes_of(self, keys: Iterable[Key]) -> int:
        """Bytes the tier would hold with only ``keys`` retained (each pack counted once)."""
        keys = list(keys)
        packs = sum(self.pack_sizes.get(p, 0) for p in self.referenced(keys))
        return packs + sum(sum(self.steps[k].manifest_bytes.values()) for k in keys)

    def dead_bytes(self, keys: Iterable[Key]) -> int:
        """Bytes inside the packs ``keys`` keep that none of their chunks use: space that
        comes back only when the whole pack goes (there is no repacking)."""
        used: dict[str, dict[int, int]] = {}
        keys = list(keys)
        for key in keys:
            for pack_id, extents in self.steps[key].extents.items():
                used.setdefault(pack_id, {}).update(extents)
        return sum(
            max(self.pack_sizes.get(p, 0) - sum(used.get(p, {}).values()), 0)
            for p in self.referenced(keys)
        )

    def total_bytes(self) -> int:
        manifests = sum(sum(s.manifest_bytes.values()) for s in self.steps.values())
        return sum(self.pack_sizes.values()) + manifests


async def take_inventory(
    store: Store,
    *,
    now: float,
    expected_nodes: Sequence[str] = (),
    known: dict[tuple[str, int, str], frozenset[str]] | None = None,
) -> Inventory:
    """Read the whole store. Raises RetentionError if any manifest cannot be read or parsed:
    nobody can tell which packs it needs, so nothing may be deleted (FORMAT.md's GC rules).

    ``known`` maps (job, step, node) to packs for manifests already read (they are
    immutable), so a second look right before a sweep reads only the new ones.
    """
    entries = await list_checkpoints(store)
    steps: dict[Key, StepEntry] = {}
    for c in entries:
        entry = steps.setdefault((c.job, c.step), StepEntry(c.job, c.step))
        entry.manifest_bytes[c.node] = c.manifest_bytes

    limit = asyncio.Semaphore(_CONCURRENT_GETS)

    async def read(job: str, step: int, node: str) -> None:
        async with limit:
            try:
                manifest = await load_manifest(store, job, step, node)
                created = _unix_time(manifest.created_at)
            except FerryError as exc:
                raise RetentionError(
                    f"cannot read manifest {layout.manifest_key(job, step, node)} in "
                    f"{store.url}: {exc}; retention deletes nothing while a manifest is "
                    "unreadable (it cannot tell which packs that manifest needs)"
                ) from exc
        entry = steps[(job, step)]
        entry.manifests[node] = manifest
        entry.parts[node] = frozenset(manifest.packs)
        entry.bytes_raw += manifest.bytes_raw
        for chunk in manifest.all_chunks():
            entry.extents.setdefault(manifest.packs[chunk.pack], {})[chunk.offset] = chunk.stored
        entry.created = max(entry.created, created)

    todo = []
    for c in entries:
        cached = known.get((c.job, c.step, c.node)) if known else None
        if cached is not None:
            steps[(c.job, c.step)].parts[c.node] = cached
        else:
            todo.append(read(c.job, c.step, c.node))
    await asyncio.gather(*todo)

    await _mark_complete(store, steps, expected_nodes)
    pack_sizes = {
        pack_id: obj.size
        for obj in await store.list(layout.PACKS_PREFIX)
        if (pack_id := layout.parse_pack_key(obj.key)) is not None
    }
    _mark_damaged(store.url, steps, pack_sizes)
    pins = await read_pins(store, now=now)
    uploads = await store.list_uploads(layout.PACKS_PREFIX)
    return Inventory(store.url, steps, pack_sizes, pins, uploads)


def _mark_damaged(url: str, steps: dict[Key, StepEntry], pack_sizes: dict[str, int]) -> None:
    """A whole step whose parts need a pack the store does not hold, or holds shorter than
    their chunks reach, cannot be restored: it is not counted whole (so it is never the
    job's newest whole step, and the steps before it, one of which may be the last that
    restores, are kept as keep_last would keep them), and the run says so. An operator's
    trial lost a pack of the newest step, and a run with --keep-last 1 expired the step
    before it, the last one that restored."""
    for entry in steps.values():
        if not entry.complete:
            continue
        lost = sorted(p for p in entry.packs if p not in pack_sizes)
        short = sorted(
            p
            for p, reach in entry.extents.items()
            if p in pack_sizes and max(o + n for o, n in reach.items()) > pack_sizes[p]
        )
        if lost or short:
            entry.complete = False
            log.warning(
                "%s: %s step %s needs %d pack(s) the store does not hold and %d it holds "
                "short (first: %s): not a whole step for retention, which keeps the steps "
                "before it; see ferry verify", url, entry.job, entry.step, len(lost),
                len(short), (lost + short)[0],
            )  # fmt: skip


async def _mark_complete(
    store: Store, steps: dict[Key, StepEntry], expected_nodes: Sequence[str]
) -> None:
    """Which steps are whole: their completion marker, or every expected node's part; with
    no nodes named, a single-node job's part; a multi-node job's step only by its marker
    (a job is multi-node if it writes markers, a step of it has several parts, or a part
    of it was pushed as one: ``extra.part``; and never parts without ``.metadata``:
    catalog.parts_lack_metadata)."""
    markers = {
        parsed
        for obj in await store.list(layout.COMPLETE_PREFIX)
        if (parsed := layout.parse_completion_key(obj.key)) is not None
    }
    # a job is multi-node if it writes markers, or if a step of it has several parts: then
    # one part, or any set of parts, is not known to be the step (pushed by hand, without
    # markers, and no nodes named: every step is kept, never taken for the newest whole one)
    multi_node = {job for job, _ in markers} | {e.job for e in steps.values() if len(e.parts) > 1}
    # (and a job one of whose parts was pushed as a part: alone it is not the step, whatever
    # it holds; a newcomer's trial pushed one with --part, and retention kept it as the
    # newest step and expired the last whole one)
    multi_node |= {
        e.job for e in steps.values() if any(m.extra.get(PART_EXTRA) for m in e.manifests.values())
    }
    catalog = Catalog(store)
    for entry in steps.values():
        entry.has_marker = entry.key in markers
        read = list(entry.manifests.values())  # (every part's, but on a second look: known)
        lacks = len(read) == len(entry.parts) and parts_lack_metadata(read)
        entry.complete = step_is_complete(
            entry.parts, entry.has_marker, expected_nodes, entry.job in multi_node,
            without_metadata=lacks,
        )  # fmt: skip
        if entry.complete and not entry.has_marker and expected_nodes:
            # every expected node's part, no marker: whole only if its files say so (a torn
            # newest step kept as "whole" would let the last loadable one expire); the
            # manifests this inventory read are not read again
            whole_read = read if len(read) == len(entry.parts) else None
            entry.complete = await unless_damaged(
                whole_by_files(catalog, entry.job, entry.step, entry.parts, whole_read)
            )


async def read_pins(store: Store, *, now: float) -> dict[Key, float]:
    """Unexpired pins by (job, step). An unreadable pin counts as pinned for an hour from
    now: a garbled pin must not make its step deletable."""
    pins: dict[Key, float] = {}
    for obj in await store.list(layout.PINS_PREFIX):
        parsed = layout.parse_pin_key(obj.key)
        if parsed is None:
            continue
        job, step, _holder = parsed
        expires = await pin_expiry(store, obj.key)
        if expires is None:
            expires = now + 3600.0
        if expires > now:
            pins[(job, step)] = max(expires, pins.get((job, step), 0.0))
    return pins


def _unix_time(created_at: str) -> float:
    try:
        when = datetime.fromisoformat(created_at)
    except ValueError:
        raise FormatError(f"manifest created_at {created_at!r} is not an ISO 8601 time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()
