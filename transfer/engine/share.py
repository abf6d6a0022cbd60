"""A share of a step: the bytes some ranks of a new world will read, and the record a
partial copy keeps of itself so that nothing takes it for the whole step.

A node that will host ranks A and B of a W-rank world after a resize needs, of a DCP step,
``.metadata`` and the byte ranges of the storage files those ranks' loads read
(dcpshare.share_ranges, from ``.metadata`` alone), or an explicit item list computed where
the model lives (dcpplan_torch). The pull writes exactly those ranges: every other byte of
a storage file it touches stays a hole, and a storage file it needs nothing of is left out,
so a rank that reads outside the share fails (a missing file, or a blob of zeros that
``torch.load`` refuses), never loads another rank's values.

The record (``.ferry-share.json`` in the copy, written before the copy is renamed into place)
names the job, step, layout and ranges. A directory holding it is never pushed as a part,
served to a peer as the step, or counted as holding the step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from transfer.durable import fsync_dir
from transfer.engine.catalog import (
    Catalog,
    latest_step,
    resolve_manifests,
    whole_parts,
)
from transfer.engine.dcp import MAX_METADATA_BYTES, METADATA, required_lengths
from transfer.engine.dcpshare import (
    Layout,
    Parsed,
    Ranges,
    layout_ranges,
    merge_ranges,
    overlaps,
    parse_metadata,
    ranges_from_items,
    share_bytes,
)
from transfer.engine.parts import merge_parts, read_file
from transfer.engine.restorenames import staging_path
from transfer.engine.stepparts import needs_of, parts_for
from transfer.errors import FerryError, FormatError, NotFoundError
from transfer.format.manifest import FileEntry, Manifest
from transfer.format.names import step_from_dirname
from transfer.format.share import SHARE_FORMAT, SHARE_MARKER, SHARE_VERSION
from transfer.format.stepfiles import StepFiles
from transfer.store.base import Store

K = TypeVar("K", bound=Hashable | None)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Share:
    """What of a step a partial copy holds: ``ranges`` of the storage files (every other
    storage file of ``storage`` is left out); files outside ``storage`` (``.metadata``)
    whole. ``layout`` is None for an explicit item list."""

    ranges: Ranges
    storage: frozenset[str]
    layout: Layout | None

    def spans_of(self, path: str) -> tuple[tuple[int, int], ...] | None:
        """The ranges of ``path`` to write; None: the whole file; (): none of it."""
        if path not in self.storage:
            return None
        return self.ranges.get(path, ())

    @property
    def nbytes(self) -> int:
        return share_bytes(self.ranges)

    def to_record(self, job: str, step: int) -> dict[str, object]:
        layout = None
        if self.layout is not None:
            layout = {"world_size": self.layout.world_size, "ranks": list(self.layout.ranks)}
        return {
            "format": SHARE_FORMAT,
            "version": SHARE_VERSION,
            "job": job,
            "step": step,
            "layout": layout,
            "bytes": self.nbytes,
            "ranges": {p: [list(r) for r in spans] for p, spans in self.ranges.items()},
        }


async def plan_share(
    catalog: Catalog,
    manifests: list[Manifest],
    layout: Layout | None = None,
    items: object = None,
) -> Share:
    """The share of the step ``manifests`` make for ``layout`` (dcpshare's rule) or for an
    explicit item list ``items`` (JSON, as dcpplan_torch writes it): one read of the step's
    ``.metadata`` from the store."""
    return (await plan_shares(catalog, manifests, {None: (layout, items)}))[None]


async def plan_shares(
    catalog: Catalog,
    manifests: list[Manifest],
    asks: Mapping[K, tuple[Layout | None, object]],
) -> dict[K, Share]:
    """plan_share for several (layout, items) asks at once (a fan-out group's members),
    reading ``.metadata`` once."""
    merged = {f.path: (f, m) for f, m in merge_parts(manifests)}
    job, step = manifests[0].job, manifests[0].step
    if METADATA not in merged:
        raise FerryError(
            f"{job} step {step} has no {METADATA} in its {len(manifests)} part(s): rank 0's "
            "node has not pushed its part yet (or it is not a DCP save); a share needs it"
        )
    metadata = await _read_metadata(catalog, *merged[METADATA])
    sizes = {path: f.size for path, (f, _) in merged.items()}
    return await asyncio.to_thread(_plan, metadata, sizes, asks)


async def resolve_share(
    store: Store,
    job: str,
    step: int | None,
    expected_nodes: Sequence[str],
    ask: tuple[Layout | None, object],
) -> tuple[list[Manifest], Share]:
    """The share ``ask`` (layout, items) of the step a prefetch means by ``step``
    (catalog.resolve_checkpoint's rule), and the manifests of the parts that share
    touches: with the step's file map (its completion marker's), only the parts holding
    ``.metadata``, the storage files the share reads and any file outside DCP's storage
    (a survivor of an N-node job reads a few manifests, not N); without one, every part."""
    manifests, shares = await resolve_shares(store, job, step, expected_nodes, {None: ask}, None)
    return manifests, shares[None]


async def resolve_shares(
    store: Store,
    job: str,
    step: int | None,
    expected_nodes: Sequence[str],
    asks: Mapping[K, tuple[Layout | None, object]],
    mine: K,
    use_index: bool = True,
) -> tuple[list[Manifest], dict[K, Share]]:
    """resolve_share for a fan-out group's members (``asks``), ``.metadata`` read once:
    every member's share, and the manifests of the parts the share of ``mine`` touches
    (each member reads its own few, not every part of the step; ``use_index``: the
    marker's common index standing in for the parts it covers, stepparts.parts_for)."""
    catalog = Catalog(store)
    named = step is not None
    if step is None:  # (latest: the newest complete step, as everywhere)
        step = await latest_step(store, job, expected_nodes, catalog)
    if (files := await catalog.step_files(job, step)) is not None:
        if not use_index:
            files = dataclasses.replace(files, common=None)
        try:
            return await _shares_by_map(catalog, job, step, files, asks, mine)
        except (FormatError, NotFoundError) as exc:  # the parts say; they are the record
            log.warning("%s step %s: %s; reading every part instead", job, step, exc)
    manifests = await resolve_manifests(store, job, step)  # (afresh: the map misled)
    if named:  # (latest is complete already: not asked again)
        manifests = await whole_parts(store, manifests, expected_nodes)
    return manifests, await plan_shares(catalog, manifests, asks)


async def _shares_by_map(
    catalog: Catalog,
    job: str,
    step: int,
    files: StepFiles,
    asks: Mapping[K, tuple[Layout | None, object]],
    mine: K,
) -> tuple[list[Manifest], dict[K, Share]]:
    """resolve_shares by the step's file map: ``.metadata``'s part, then the parts the
    share of ``mine`` touches, each checked to hold its files at the sizes the map gave."""
    if METADATA not in files.files:
        raise FormatError(f"the file map names no {METADATA}")
    owner = (await catalog.manifests_of(job, step, [files.files[METADATA][0]]))[0]
    entry = next((f for f in owner.files if f.path == METADATA), None)
    if entry is None:
        raise FormatError(f"the file map places {METADATA} in {owner.node}'s part, which lacks it")
    metadata = await _read_metadata(catalog, entry, owner)
    sizes = {path: size for path, (_, size) in files.files.items()}
    shares = await asyncio.to_thread(_plan, metadata, sizes, asks)
    share = shares[mine]
    touched = [p for p in files.files if p not in share.storage or share.ranges.get(p)]
    needs = {path: share.spans_of(path) for path in touched}
    manifests = await parts_for(catalog, job, step, files, needs)
    held = {f.path: f.size for f, _ in merge_parts(manifests)}
    for path in touched:
        if held.get(path) != files.files[path][1]:
            raise FormatError(f"the file map places {path} where the parts do not hold it")
    return manifests, shares


async def base_parts(
    catalog: Catalog,
    job: str,
    base_step: int,
    entries: Iterable[FileEntry],
    use_index: bool = True,
) -> list[Manifest] | None:
    """The parts of an earlier step ``base_step`` (the base a share's restore starts from)
    describing what a restore of ``entries`` (the new step's, at the same paths) uses of
    it, by that step's marker (stepparts.parts_for); None without a file map (the pull then
    reads every part of it, by the base's directory name)."""
    files = await catalog.step_files(job, base_step)
    if files is None:
        return None
    if not use_index:
        files = dataclasses.replace(files, common=None)
    try:
        return await parts_for(catalog, job, base_step, files, needs_of(entries))
    except NotFoundError:  # the base step is gone from the store: positions unknown, as
        return None  # without a map; the pull then finds none either and reads every position


async def base_dir_parts(
    store: Store,
    job: str,
    manifests: list[Manifest],
    base_dir: Path | None,
    use_index: bool = True,
) -> list[Manifest] | None:
    """For a share resolved from only the parts it touches (``manifests``): the parts of
    the step ``base_dir``'s name gives (``step_000120``) holding the same files
    (base_parts); None without a base dir, a step in its name or that step's file map (the
    pull then reads every part of it by that name)."""
    base_step = None if base_dir is None else step_from_dirname(base_dir.name)
    if base_step is None:
        return None
    entries = [f for m in manifests for f in m.files]
    return await base_parts(Catalog(store), job, base_step, entries, use_index)


async def _read_metadata(catalog: Catalog, entry: FileEntry, owner: Manifest) -> bytes:
    if entry.size > MAX_METADATA_BYTES:
        raise FormatError(
            f"{owner.job} step {owner.step}: {METADATA} is {entry.size} bytes, over the limit"
        )
    return await read_file(catalog, owner, entry)


def _plan(
    metadata: bytes, sizes: dict[str, int], asks: Mapping[K, tuple[Layout | None, object]]
) -> dict[K, Share]:
    """Pure Python over the whole ``.metadata``, parsed once however many asks (a group of
    G members each plans G shares): callers run it off the loop."""
    storage = frozenset(required_lengths(metadata) or ())
    sizes = {path: size for path, size in sizes.items() if path in storage}
    parsed = None
    if any(layout is not None and items is None for layout, items in asks.values()):
        parsed = parse_metadata(metadata)
    return {key: _share(parsed, storage, sizes, *ask) for key, ask in asks.items()}


def _share(
    parsed: Parsed | None,
    storage: frozenset[str],
    sizes: dict[str, int],
    layout: Layout | None,
    items: object,
) -> Share:
    if items is not None:
        ranges = ranges_from_items(items)
    elif layout is not None and parsed is not None:
        ranges = layout_ranges(parsed, layout)
    else:
        raise ValueError("a share needs a layout or an item list")
    for path, spans in ranges.items():
        if path not in sizes or spans[-1][1] > sizes[path]:
            raise FormatError(
                f"the share names {path} up to byte {spans[-1][1]}, which the step's parts do "
                "not hold (the step is not complete yet? ask for a complete step)"
            )
    return Share(ranges, storage, layout)


def write_record(root: Path, job: str, step: int, share: Share) -> None:
    """The copy's record of what it holds (durable with the copy: seal fsyncs or marks it)."""
    _write_record_at(root / SHARE_MARKER, job, step, share, durable=False)


def replace_record(root: Path, job: str, step: int, share: Share) -> None:
    """Write or rewrite the record of a copy in place, durably and atomically: a crash
    leaves the old record or the new one, never half of either, and nothing inside
    ``root`` but them (the new one is written in a swept scratch directory beside it)."""
    scratch = staging_path(root, "fill-")
    scratch.mkdir()
    try:
        _write_record_at(scratch / SHARE_MARKER, job, step, share, durable=True)
        os.replace(scratch / SHARE_MARKER, root / SHARE_MARKER)
        fsync_dir(root)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _write_record_at(path: Path, job: str, step: int, share: Share, *, durable: bool) -> None:
    data = json.dumps(share.to_record(job, step)).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_record(root: Path) -> dict[str, object] | None:
    """The record of a partial copy at ``root``, or None for a whole one. A record that
    does not parse still marks the copy partial (it is never taken for the whole step)."""
    try:
        raw = (root / SHARE_MARKER).read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # (``root`` no directory: not a copy)
        return None
    except OSError as exc:
        return {"error": f"unreadable: {exc.strerror}"}
    try:
        doc = json.loads(raw)
    except ValueError:
        return {"error": "not JSON"}
    return doc if isinstance(doc, dict) else {"error": "not an object"}


def recorded_ranges(record: dict[str, object]) -> Ranges:
    """The ranges a record says its copy holds (none, for a record that does not parse)."""
    raw = record.get("ranges")
    if not isinstance(raw, dict):
        return {}
    try:
        items = [(p, int(a), int(b) - int(a)) for p, spans in raw.items() for a, b in spans]
    except (TypeError, ValueError):
        return {}
    return merge_ranges(i for i in items if isinstance(i[0], str) and i[2] > 0)


def copy_holds(copy: Path, paths: Iterable[str]) -> dict[str, tuple[tuple[int, int], ...] | None]:
    """What the copy at ``copy`` holds of each of ``paths`` it has: the ranges its share
    record names of that file, or None for a file held whole (one the record does not name,
    this node's own part; every file of a copy without a record)."""
    record = read_record(copy)
    ranges = {} if record is None else recorded_ranges(record)
    return {p: ranges.get(p) for p in paths if (copy / p).is_file()}


def held_chunks(copy: Path, files: Iterable[FileEntry]) -> set[str]:
    """The chunks a copy holds whole (``copy_holds``: a chunk inside the ranges held of its
    file): what a prefetch of more of the step keeps in place."""
    files = list(files)
    holds = copy_holds(copy, (f.path for f in files))
    held: set[str] = set()
    for f in files:
        if f.path not in holds:
            continue
        spans = holds[f.path]
        for offset, c in f.chunk_offsets():
            end = offset + c.size
            if spans is None or overlaps(spans, offset, end) == [(offset, end)]:
                held.add(c.id)
    return held


def covers(record: dict[str, object], share: Share) -> bool:
    """Whether the copy ``record`` describes holds every byte of ``share``."""
    held = recorded_ranges(record)
    for path, spans in share.ranges.items():
        have = held.get(path, ())
        if any(overlaps(have, lo, hi) != [(lo, hi)] for lo, hi in spans):
            return False
    return True


@dataclass(frozen=True)
class ShareFill:
    """What a restore into a step directory that may hold a partial copy pulls:
    ``share`` (None: the whole step); ``held``: the copy there already holds all of it;
    ``fill``: it holds part of it, so the restore is pulled beside it (reusing its verified
    chunks) and swapped in."""

    share: Share | None
    held: bool = False
    fill: bool = False


async def plan_fill(
    catalog: Catalog,
    manifests: list[Manifest],
    copy: Path,
    layout: Layout | None = None,
    items: object = None,
    planned: Share | None = None,
) -> ShareFill:
    """What to pull into ``copy`` (a step directory, a partial copy or not there yet) for
    the share of ``layout`` or ``items`` (neither: the whole step; ``planned``: that
    share, planned already by resolve_share). One answer, so a caller plans a share, reads
    the copy's record and widens in one place."""
    share = planned
    if share is None and (layout is not None or items is not None):
        share = await plan_share(catalog, manifests, layout, items)
    had = read_record(copy)
    if had is None:
        return ShareFill(share)
    if share is not None and covers(had, share):
        return ShareFill(share, held=True)
    return ShareFill(None if share is None else widen(share, had), fill=True)


def widen(share: Share, record: dict[str, object]) -> Share:
    """``share`` and what the copy ``record`` describes holds, as one share (an explicit
    item set: the union of two layouts is not a layout)."""
    held = recorded_ranges(record)
    items = [
        (p, a, b - a) for r in (share.ranges, held) for p, spans in r.items() for a, b in spans
    ]
    ranges = {p: spans for p, spans in merge_ranges(items).items() if p in share.storage}
    return Share(ranges, share.storage, None)


def describe(record: dict[str, object]) -> str:
    """One line for an error: what share a partial copy holds."""
    layout = record.get("layout")
    if isinstance(layout, dict):
        return f"ranks {layout.get('ranks')} of a world of {layout.get('world_size')}"
    return "an explicit item list" if "error" not in record else f"a share ({record['error']})"
