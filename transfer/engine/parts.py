"""The parts of one step, taken together: whether they merge into one checkpoint, and
whether, together, they hold the whole save.

Each node pushes its own part (its ranks' shards; rank 0's node also ``.metadata``), and no
push reads another node's manifest (that made every push of an N-node job read N
manifests). What parts must agree on is checked here, once per step: by the node that
finds the step's last part in (before it writes the completion marker), and by every
pull, which merges the parts it restores.
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from transfer.engine.catalog import Catalog
from transfer.engine.chunkindex import ChunkIndex
from transfer.engine.dcp import MAX_METADATA_BYTES, METADATA, required_lengths
from transfer.engine.dcpshare import every_rank_ranges, overlaps, parse_metadata
from transfer.engine.resolver import ChunkResolver
from transfer.errors import FerryError, FormatError, IncompleteStepError, NotFoundError
from transfer.format import layout
from transfer.format.manifest import FileEntry, Manifest
from transfer.format.stepcommon import COMMON_KEY, Placed, common_doc
from transfer.format.stepfiles import MAX_MARKER_BYTES, file_map
from transfer.store.base import Store

log = logging.getLogger(__name__)


def may_share(a: FileEntry, b: FileEntry) -> bool:
    """The rule the parts of one step keep (a push checks it before it commits, a merge
    whenever parts are put together): two nodes may hold the same file only with the same
    content and mode (e.g. a replicated .metadata)."""
    return (a.mode, [c.id for c in a.chunks]) == (b.mode, [c.id for c in b.chunks])


def merge_parts(manifests: list[Manifest]) -> list[tuple[FileEntry, Manifest]]:
    """One file list from every node's part, each file with the manifest whose pack list its
    chunks index; parts that break ``may_share`` raise FormatError."""
    merged: dict[str, tuple[FileEntry, Manifest]] = {}
    for m in manifests:
        for f in m.files:
            if f.path in merged:
                other, owner = merged[f.path]
                if not may_share(other, f):
                    raise FormatError(
                        f"nodes {owner.node} and {m.node} hold different versions of {f.path} "
                        f"in {m.job} step {m.step} (the same step pushed from two saves?)"
                    )
                continue
            merged[f.path] = (f, m)
    paths = set(merged)
    for path in paths:  # across nodes too: a file must not also be a directory
        parts = path.split("/")
        for depth in range(1, len(parts)):
            if "/".join(parts[:depth]) in paths:
                raise FormatError(f"{'/'.join(parts[:depth])!r} is both a file and a directory")
    return [merged[p] for p in sorted(merged)]


async def read_file(catalog: Catalog, manifest: Manifest, entry: FileEntry) -> bytes:
    """One small file of a part, read from the store and verified chunk by chunk."""
    assert entry.starts is None, "a file known only in part (an index's) has no bytes to read"
    index = ChunkIndex()
    index.add_manifest(manifest)
    with ThreadPoolExecutor(1, thread_name_prefix="ferry-parts") as pool:
        resolver = ChunkResolver(catalog.store, index, pool)
        return b"".join([bytes(await resolver.raw(c.id)) for c in entry.chunks])


@dataclass(frozen=True)
class WholeStep:
    """A step's parts that together are the whole save, and its ``.metadata`` (None: not a
    DCP save, or one too large to read)."""

    manifests: list[Manifest]
    metadata: bytes | None


async def check_step_whole(
    catalog: Catalog, job: str, step: int, manifests: list[Manifest] | None = None
) -> WholeStep:
    """The step's parts, when together they are the whole save: they merge, and every file
    the step's ``.metadata`` names is in some part at the length its ranges need. Raises
    IncompleteStepError naming the first file missing or short (a torn shard on a node
    whose part could not check it: it had no ``.metadata``), FormatError when the parts
    clash. A step without DCP metadata is whole once its parts merge. ``manifests``: the
    step's parts, where the caller holds them already (not read again)."""
    if manifests is None:
        manifests = await catalog.manifests(job, step)
    merged = {f.path: (f, m) for f, m in merge_parts(manifests)}
    if METADATA not in merged or merged[METADATA][0].size > MAX_METADATA_BYTES:
        return WholeStep(manifests, None)
    entry, owner = merged[METADATA]
    metadata = await read_file(catalog, owner, entry)
    sizes = {path: f.size for path, (f, _) in merged.items()}
    check_files_whole(metadata, sizes, f"{job} step {step}", len(manifests))
    return WholeStep(manifests, metadata)


def completion_doc(job: str, step: int, whole: WholeStep) -> dict[str, object]:
    """The completion marker of a step ``check_step_whole`` found whole (docs/FORMAT.md):
    its nodes, when, which part holds each file (format/stepfiles.py: a share's reader
    then reads only the parts it touches) and where the items every rank reads are
    stored (format/stepcommon.py: so it need not read every part for them). Pure Python
    over every part's chunks: callers run it off the loop."""
    manifests = whole.manifests
    doc: dict[str, object] = {
        "job": job,
        "step": step,
        "nodes": sorted(m.node for m in manifests),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    merged = merge_parts(manifests)
    if (files := file_map((f.path, f.size, m.node) for f, m in merged)) is None:
        return doc
    doc["files"] = files
    if (common := common_index(whole)) is not None:
        doc[COMMON_KEY] = common
    return doc


def common_index(whole: WholeStep) -> dict[str, Any] | None:
    """The marker's common index of a whole step (format/stepcommon.py); None for a step
    of one part (a reader reads it whole anyway), without a DCP ``.metadata``, one that
    needs none, one too large, or when building it fails (a shortcut's bug never keeps a
    step from completing)."""
    if whole.metadata is None or len(whole.manifests) < 2:
        return None
    try:
        common = common_doc(whole.manifests, _every_rank_chunks(whole))
    except Exception:
        first = whole.manifests[0]
        log.exception("%s step %s: no common index in its marker", first.job, first.step)
        return None
    if common is None or len(json.dumps(common)) > MAX_MARKER_BYTES // 2:
        return None
    return common


async def reindex_marker(store: Store, parts: list[Manifest], marker: dict[str, Any]) -> None:
    """After a repack re-pointed parts of a step (``parts``: every part of it as it is now,
    each with the digest of its stored bytes), its marker (``marker``, as drop_common_index
    wrote it back) with a common index made anew. Best effort: a marker without one only
    costs survivors the parts' manifests."""
    job, step = parts[0].job, parts[0].step
    key = layout.completion_key(job, step)
    try:
        merged = {f.path: (f, m) for f, m in merge_parts(parts)}
        metadata = None
        if METADATA in merged and merged[METADATA][0].size <= MAX_METADATA_BYTES:
            metadata = await read_file(Catalog(store), merged[METADATA][1], merged[METADATA][0])
        common = await asyncio.to_thread(common_index, WholeStep(parts, metadata))
        if "files" in marker and common is not None:
            await store.put(key, json.dumps({**marker, COMMON_KEY: common}).encode())
    except (FerryError, ValueError) as exc:
        log.warning("%s: no common index after the repack (%s); survivors read the parts",
                    key, exc)  # fmt: skip


def _every_rank_chunks(whole: WholeStep) -> list[Placed]:
    """The chunks of the step's storage files that hold items every rank reads (none when
    ``.metadata`` does not parse as DCP's: the marker then carries no index)."""
    assert whole.metadata is not None
    try:
        wanted = every_rank_ranges(parse_metadata(whole.metadata))
    except FormatError as exc:
        log.info("%s step %s: no common index (%s)", whole.manifests[0].job,
                 whole.manifests[0].step, exc)  # fmt: skip
        return []
    placed: list[Placed] = []
    for f, owner in merge_parts(whole.manifests):
        spans = wanted.get(f.path)
        if not spans:
            continue
        for start, c in f.chunk_offsets():
            if overlaps(spans, start, start + c.size):
                placed.append((f.path, f.mode, start, c, owner))
    return placed


async def drop_common_index(store: Store, job: str, step: int) -> dict[str, Any] | None:
    """Write the step's completion marker back without its common index, before a repack
    re-points a part of the step (the index names where the chunks were; once the old
    packs are collected it would send readers to packs that are gone). Its readers then
    read the parts; the rest of the marker is kept as it was. The marker as written back,
    when it had an index (None: none to drop)."""
    key = layout.completion_key(job, step)
    try:
        raw = await store.get(key)
    except NotFoundError:
        return None
    if (stripped := without_common_index(raw)) == raw:
        return None
    await store.put(key, stripped)
    doc: dict[str, Any] = json.loads(stripped)  # (a dict: it had a key to drop)
    return doc


def without_common_index(marker: bytes) -> bytes:
    """A completion marker's bytes without its common index (as they were, when it has
    none or does not parse: nothing a reader would take from it)."""
    try:
        doc = json.loads(marker)
    except ValueError:
        return marker
    if not isinstance(doc, dict) or COMMON_KEY not in doc:
        return marker
    del doc[COMMON_KEY]
    return json.dumps(doc).encode()


def check_files_whole(metadata: bytes, sizes: dict[str, int], what: str, parts: int) -> None:
    """Raise IncompleteStepError unless ``sizes`` (the merged parts' files) hold every file
    ``metadata`` names at the length its ranges need."""
    for path, length in sorted((required_lengths(metadata) or {}).items()):
        have = sizes.get(path)
        if have is None or have < length:
            held = "no part holds it" if have is None else f"its part holds {have} bytes"
            raise IncompleteStepError(
                f"{what} is not whole: {METADATA} names {path} ({length} bytes) and {held} "
                f"({parts} part{'s' if parts != 1 else ''} in; a node's part still to come? "
                "pull --node for one part)"
            )
