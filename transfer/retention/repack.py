"""Repacking and chain compaction: the space whole-pack GC cannot give back.

GC frees a pack only when no chunk in it is referenced, and a delta chunk keeps its base
chunk (and that one's pack) alive however old the base's step is. So after expiry a store
can hold several times what its kept steps need (issue 14: 627 MB for a 272 MB step whose
fresh push costs 160 MB). A retention run therefore, after its expiries and before its GC:

1. **compacts chains**: a kept chunk stored as a delta whose base no kept step holds as
   file content (only some manifest's ``bases`` table keeps it) is decoded and stored again
   as a keyframe (as is one whose chain grew past ``max_chain``), so its base can go;
2. **repacks**: the live chunks of every pack with at least ``min_dead`` of its bytes dead
   are copied, byte for byte, into new packs;
3. **re-points** each kept part whose chunks moved: its manifest is *replaced* by one with
   the same content (FORMAT.md rule 6's sense: paths, sizes, modes, chunk ids) and the new
   locations, written only once every pack it names is durable (rule 4).

The packs left behind are ordinary garbage for the GC that follows. A run killed at any
moment leaves every part readable: a manifest is either the old one (whose packs are still
there: nothing is deleted before its GC) or the new one (whose packs were complete before
it was written); the new packs of an unfinished run are unreferenced garbage, and the next
run plans again from what it finds.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from transfer.codec import encode
from transfer.codec.transforms import Buffer
from transfer.engine.catalog import load_manifest
from transfer.engine.chunkindex import ChunkIndex, StoredChunk, build_refs
from transfer.engine.fetch import fetch_chunks, plan_ranges
from transfer.engine.packer import PackWriter
from transfer.engine.parts import drop_common_index, reindex_marker
from transfer.engine.resolver import ChunkResolver
from transfer.format import layout
from transfer.format.manifest import FileEntry, Manifest
from transfer.options import TransferOptions
from transfer.retention.inventory import Inventory, RetentionError
from transfer.store.base import Store

log = logging.getLogger(__name__)

#: repack a pack once this fraction of its bytes is dead (restic prunes at 5% unused by
#: default; copying costs a GET and a PUT of the live bytes, so we wait for more)
DEFAULT_MIN_DEAD = 0.2

Part = tuple[str, int, str]  # (job, step, node)


@dataclass(frozen=True)
class RepackPolicy:
    min_dead: float = DEFAULT_MIN_DEAD
    #: zstd level, pack and part sizes, window, workers and max_chain of what is rewritten
    options: TransferOptions = field(default_factory=TransferOptions)

    def __post_init__(self) -> None:
        if not 0.0 < self.min_dead <= 1.0:
            raise ValueError("repack min_dead must be within (0, 1]")


@dataclass
class RepackResult:
    url: str
    #: kept parts whose manifest was replaced (same content, new locations)
    parts_rewritten: int = 0
    #: chunks copied as they are out of mostly-dead packs
    chunks_moved: int = 0
    bytes_moved: int = 0
    #: delta chunks stored again whole: their base only an expired step held
    chunks_reencoded: int = 0
    bytes_reencoded: int = 0
    #: packs the kept steps no longer reference (GC deletes them) and their bytes
    packs_vacated: list[str] = field(default_factory=list)
    bytes_vacated: int = 0
    new_packs: list[str] = field(default_factory=list)
    dry_run: bool = False

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


async def repack(
    store: Store, inv: Inventory, policy: RepackPolicy, *, dry_run: bool = False
) -> RepackResult:
    """Compact and repack the parts ``inv`` holds (call it under the GC lease, after the
    expiries). ``inv``'s entries are updated to the rewritten manifests."""
    manifests = await _load_parts(store, inv)
    layout_now = _Layout(manifests, inv.pack_sizes, policy)
    result = RepackResult(store.url, dry_run=dry_run)
    result.chunks_reencoded = len(layout_now.reencode)
    moving = layout_now.moving()
    result.chunks_moved = len(moving)
    result.bytes_moved = sum(c.stored for c in moving)
    if dry_run or not (moving or layout_now.reencode):
        result.packs_vacated = sorted(layout_now.vacated())
        result.bytes_vacated = sum(inv.pack_sizes.get(p, 0) for p in result.packs_vacated)
        return result
    new_forms, written = await _write(store, layout_now, moving, policy.options)
    result.new_packs = written
    result.bytes_reencoded = sum(new_forms[cid].stored for cid in layout_now.reencode)
    # every new pack is complete and durable: only now may a manifest name one (rule 4)
    final = dict(manifests)
    seen: set[tuple[str, int]] = set()  # steps whose marker was looked at
    unindexed: dict[tuple[str, int], dict[str, Any]] = {}  # ... the markers, index dropped
    for part, old in sorted(manifests.items()):
        new = layout_now.rewrite(old, new_forms)
        if new is None:
            continue
        if not new.same_content(old):  # a bug, never a store's fault: stop before writing
            raise RetentionError(f"repack would change the content of {part}; nothing written")
        if part[:2] not in seen:  # its marker's index names where the chunks were
            seen.add(part[:2])
            if (marker := await drop_common_index(store, *part[:2])) is not None:
                unindexed[part[:2]] = marker
        data = new.to_json()
        await store.put(layout.manifest_key(*part), data)
        final[part] = replace(new, digest=hashlib.sha256(data).hexdigest())  # (as stored)
        result.parts_rewritten += 1
    for (job, step), marker in sorted(unindexed.items()):  # each step re-pointed: anew
        parts = [m for p, m in sorted(final.items()) if p[:2] == (job, step)]
        await reindex_marker(store, parts, marker)
    _refresh(inv, final)
    still = {p for m in final.values() for p in m.packs}
    result.packs_vacated = sorted(layout_now.packs_before - still)
    result.bytes_vacated = sum(inv.pack_sizes.get(p, 0) for p in result.packs_vacated)
    if result.parts_rewritten:
        log.info(
            "repack %s: %d parts re-pointed, %d chunks moved (%d bytes), %d re-encoded; "
            "%d packs (%d bytes) left to GC",
            store.url, result.parts_rewritten, result.chunks_moved, result.bytes_moved,
            result.chunks_reencoded, len(result.packs_vacated), result.bytes_vacated,
        )  # fmt: skip
    return result


async def _load_parts(store: Store, inv: Inventory) -> dict[Part, Manifest]:
    """Every kept part's manifest: the inventory's copy, fetched only where it has none."""
    out: dict[Part, Manifest] = {}
    for (job, step), entry in sorted(inv.steps.items()):
        for node in sorted(entry.parts):
            held = entry.manifests.get(node)
            out[(job, step, node)] = held or await load_manifest(store, job, step, node)
    return out


@dataclass(frozen=True)
class RepackForecast:
    """What repacking would leave of some kept steps, without writing anything."""

    #: packs the kept steps reference today that repacking empties (GC deletes them)
    packs_vacated: frozenset[str]
    #: the packs left in place, with the bytes of each that the kept steps still use
    live_in_kept_packs: dict[str, int]
    #: stored bytes copied as they are into new packs
    bytes_moved: int
    #: raw bytes of the delta chunks stored again whole (their stored size is only known
    #: once encoded: ``bytes_reencoded_estimate`` scales them by the kept keyframes' ratio)
    raw_reencoded: int
    bytes_reencoded_estimate: int


def forecast(
    inv: Inventory, kept: Iterable[tuple[str, int]], policy: RepackPolicy
) -> RepackForecast:
    """What ``repack`` would do to ``kept`` (steps of ``inv`` whose manifests it read)."""
    keys = set(kept)
    manifests = {
        (job, step, node): m
        for (job, step), entry in inv.steps.items()
        if (job, step) in keys
        for node, m in entry.manifests.items()
    }
    missing = sum(len(inv.steps[k].parts) for k in keys) - len(manifests)
    if missing:  # a bug: every caller forecasts from an inventory that read its manifests
        raise RetentionError(f"cannot forecast repacking: {missing} kept manifests not read")
    plan = _Layout(manifests, inv.pack_sizes, policy)
    vacated = plan.vacated()
    live: Counter[str] = Counter()
    for chunk in plan.live():
        if chunk.id not in plan.reencode and chunk.pack_id not in vacated:
            live[chunk.pack_id] += chunk.stored
    reencoded = [c for cid in plan.reencode if (c := plan.index.get(cid)) is not None]
    raw = sum(c.size for c in reencoded)
    return RepackForecast(
        packs_vacated=frozenset(vacated),
        live_in_kept_packs={p: live[p] for p in plan.packs_before - vacated},
        bytes_moved=sum(c.stored for c in plan.moving()),
        raw_reencoded=raw,
        bytes_reencoded_estimate=round(raw * _keyframe_ratio(inv)),
    )


def _keyframe_ratio(inv: Inventory) -> float:
    """Stored over raw bytes of the chunks the store holds whole, in every step it read: what
    a chunk re-encoded as a keyframe is expected to cost (1.0 with nothing to learn from)."""
    raw = stored = 0
    for entry in inv.steps.values():
        for m in entry.manifests.values():
            for c in m.all_chunks():
                if c.base is None:
                    raw += c.size
                    stored += c.stored
    return stored / raw if raw else 1.0


class _Layout:
    """Where every kept chunk is now, which to re-encode, and which packs to empty."""

    def __init__(
        self, manifests: dict[Part, Manifest], pack_sizes: dict[str, int], policy: RepackPolicy
    ) -> None:
        self.pack_sizes = pack_sizes
        self.min_dead = policy.min_dead
        # one stored copy per chunk id, which every part re-pointed will use: one whose pack
        # is there and long enough before any other, parts in one order (the forecast's and
        # the run's), so a copy in a pack lost from the store is never the one kept
        self.index = ChunkIndex()
        ordered = [m for _, m in sorted(manifests.items())]
        for whole in (True, False):
            for m in ordered:
                for c in m.all_chunks():
                    pack = m.packs[c.pack]
                    if (pack_sizes.get(pack, 0) >= c.offset + c.stored) == whole:
                        self.index.add(
                            StoredChunk(c.id, c.size, c.enc, pack, c.offset, c.stored, c.base)
                        )
        self.packs_before = {p for m in manifests.values() for p in m.packs}
        self.content = {c.id for m in manifests.values() for f in m.files for c in f.chunks}
        self.reencode = self._to_reencode(policy.options.max_chain)

    def _to_reencode(self, max_chain: int) -> set[str]:
        """Content chunks whose delta base no kept step holds as content, or whose chain is
        longer than ``max_chain``: they are stored again as keyframes."""
        out = set()
        for cid in self.content:
            c = self.index.get(cid)
            assert c is not None
            too_deep = self.index.depth(cid) > max_chain
            if c.base is not None and (c.base not in self.content or too_deep):
                out.add(cid)
        return out

    def live(self) -> list[StoredChunk]:
        """The stored chunks kept parts still need as they are: content, and the bases its
        deltas decode from (a chunk to re-encode needs no base any more)."""
        out: dict[str, StoredChunk] = {}
        for cid in self.content:
            cur = self.index.get(cid)
            while cur is not None and cur.id not in out:
                out[cur.id] = cur
                follow = cur.base is not None and cur.id not in self.reencode
                cur = self.index.get(cur.base) if follow and cur.base else None
        return list(out.values())

    def vacated(self) -> set[str]:
        """Packs to empty: no live byte left, or at least ``min_dead`` of them dead; none
        when the run would move and re-encode nothing. A pack holding only second copies
        (the same content stored elsewhere too: one save pushed under two jobs) is emptied
        only by a run that re-points its parts anyway; alone, each part keeps the copy it
        names (re-pointing every duplicate at one copy would make that copy, unread, the
        only one), and the forecast, the dry run and ``du`` say so (a newcomer's trial saw
        them promise such a pack, which the run then kept)."""
        out = self._emptied()
        if self.reencode or any(c.pack_id in out for c in self.live()):
            return out
        return set()

    def _emptied(self) -> set[str]:
        """Packs with no live byte left (by the index's copies), or ``min_dead`` dead."""
        live: Counter[str] = Counter()
        for c in self.live():
            if c.id not in self.reencode:  # those are written anew anyway
                live[c.pack_id] += c.stored
        out = set()
        for pack_id in self.packs_before:
            size = self.pack_sizes.get(pack_id, 0)
            if live[pack_id] == 0 or size - live[pack_id] >= self.min_dead * size:
                out.add(pack_id)
        return out

    def moving(self) -> list[StoredChunk]:
        """Live chunks (not re-encoded) in packs to empty: copied as they are."""
        emptied = self.vacated()
        return [c for c in self.live() if c.pack_id in emptied and c.id not in self.reencode]

    def rewrite(self, old: Manifest, forms: dict[str, StoredChunk]) -> Manifest | None:
        """``old`` with every chunk at its new location (None: nothing of it moved)."""

        def now(cid: str) -> StoredChunk:
            c = self.index.get(cid)
            assert c is not None
            return forms.get(cid, c)

        files = [[now(c.id) for c in f.chunks] for f in old.files]
        in_files = {c.id for chunks in files for c in chunks}
        bases: dict[str, StoredChunk] = {}
        for chunks in files:
            for c in chunks:
                cur = c
                while cur.base is not None and cur.base not in in_files:
                    if cur.base in bases:
                        break
                    cur = bases.setdefault(cur.base, now(cur.base))
        pack_ids, refs, base_refs = build_refs(files, sorted(bases.values(), key=_order))
        new = replace(
            old,
            packs=pack_ids,
            files=tuple(
                FileEntry(f.path, f.size, f.mode, r) for f, r in zip(old.files, refs, strict=True)
            ),
            bases=base_refs,
        )
        if _locations(new) == _locations(old):
            return None
        stamp = datetime.now(UTC).isoformat(timespec="seconds")
        # (digest None: not the bytes it was read from; the store's copy gets its own)
        return replace(new, extra={**old.extra, "repacked_at": stamp}, digest=None)


def _locations(m: Manifest) -> set[tuple[str, str, int, str]]:
    return {(c.id, m.packs[c.pack], c.offset, c.enc) for c in m.all_chunks()}


def _order(c: StoredChunk) -> tuple[str, int]:
    return (c.pack_id, c.offset)


async def _write(
    store: Store, plan: _Layout, moving: list[StoredChunk], options: TransferOptions
) -> tuple[dict[str, StoredChunk], list[str]]:
    """Write the re-encoded and the moved chunks into new packs; their new forms by id."""
    forms: dict[str, StoredChunk] = {}
    loop = asyncio.get_running_loop()
    async with asyncio.TaskGroup() as tasks:
        writer = PackWriter(
            store,
            tasks,
            part_size=options.part_size,
            pack_size=options.pack_size,
            window=options.window,
            on_bytes_stored=lambda n: None,
        )
        try:
            await _reencode(store, plan, writer, forms, loop, options)
            await _move(store, moving, writer, forms, options)
            written = await writer.finish()
        except BaseException:
            await writer.abort(keep_reported=False)
            raise
    return forms, written


async def _reencode(
    store: Store,
    plan: _Layout,
    writer: PackWriter,
    forms: dict[str, StoredChunk],
    loop: asyncio.AbstractEventLoop,
    options: TransferOptions,
) -> None:
    """Decode each chunk to re-encode (its hash verified on the way) and store it whole."""
    todo = [c for cid in sorted(plan.reencode) if (c := plan.index.get(cid)) is not None]
    if not todo:
        return

    def sink(c: StoredChunk, data: Buffer) -> None:  # a worker thread
        enc, payload = encode(data, options.zstd_level)
        loc = asyncio.run_coroutine_threadsafe(writer.add(payload), loop).result()
        forms[c.id] = StoredChunk(c.id, c.size, enc, loc.pack_id, loc.offset, loc.stored)

    with ThreadPoolExecutor(options.workers, thread_name_prefix="ferry-repack") as pool:
        resolver = ChunkResolver(store, plan.index, pool)
        await fetch_chunks(
            resolver, todo, part_size=options.part_size, window=options.window, sink=sink
        )


async def _move(
    store: Store,
    moving: Iterable[StoredChunk],
    writer: PackWriter,
    forms: dict[str, StoredChunk],
    options: TransferOptions,
) -> None:
    """Copy payloads byte for byte (``ferry verify`` re-hashes them; decoding every moved
    chunk here would cost a restore)."""
    for r in plan_ranges(moving, options.part_size):
        blob = await store.get(layout.pack_key(r.pack_id), r.start, r.end)
        if len(blob) != r.end - r.start:
            raise RetentionError(f"pack {r.pack_id} is shorter than its manifests say")
        for c in r.chunks:
            payload = blob[c.offset - r.start : c.offset - r.start + c.stored]
            loc = await writer.add(payload)
            forms[c.id] = replace(c, pack_id=loc.pack_id, offset=loc.offset)


def _refresh(inv: Inventory, manifests: dict[Part, Manifest]) -> None:
    """The inventory's view of the re-pointed parts (GC's second listing trusts it)."""
    for (job, step), entry in inv.steps.items():
        parts = {node: m for (j, s, node), m in manifests.items() if (j, s) == (job, step)}
        if not parts:
            continue
        entry.extents = {}
        for node, m in parts.items():
            entry.manifests[node] = m
            entry.parts[node] = frozenset(m.packs)
            for c in m.all_chunks():
                entry.extents.setdefault(m.packs[c.pack], {})[c.offset] = c.stored
