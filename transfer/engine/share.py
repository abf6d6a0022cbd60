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
import json
import os
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from transfer.engine.catalog import Catalog
from transfer.engine.dcp import MAX_METADATA_BYTES, METADATA, required_lengths
from transfer.engine.dcpshare import (
    Layout,
    Ranges,
    merge_ranges,
    overlaps,
    ranges_from_items,
    share_bytes,
    share_ranges,
)
from transfer.engine.parts import merge_parts, read_file
from transfer.errors import FerryError, FormatError
from transfer.format.manifest import Manifest
from transfer.format.share import SHARE_FORMAT, SHARE_MARKER, SHARE_VERSION

K = TypeVar("K", bound=Hashable | None)


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
    entry, owner = merged[METADATA]
    if entry.size > MAX_METADATA_BYTES:
        raise FormatError(f"{job} step {step}: {METADATA} is {entry.size} bytes, over the limit")
    metadata = await read_file(catalog, owner, entry)

    def plan() -> dict[K, Share]:  # pure Python over the whole .metadata: off the loop
        storage = frozenset(required_lengths(metadata) or ())
        sizes = {path: f.size for path, (f, _) in merged.items() if path in storage}
        return {key: _share(metadata, storage, sizes, *ask) for key, ask in asks.items()}

    return await asyncio.to_thread(plan)


def _share(
    metadata: bytes,
    storage: frozenset[str],
    sizes: dict[str, int],
    layout: Layout | None,
    items: object,
) -> Share:
    if items is not None:
        ranges = ranges_from_items(items)
    elif layout is not None:
        ranges = share_ranges(metadata, layout)
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
    data = json.dumps(share.to_record(job, step)).encode()
    fd = os.open(root / SHARE_MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, data)
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


def _recorded_ranges(record: dict[str, object]) -> Ranges:
    """The ranges a record says its copy holds (none, for a record that does not parse)."""
    raw = record.get("ranges")
    if not isinstance(raw, dict):
        return {}
    try:
        items = [(p, int(a), int(b) - int(a)) for p, spans in raw.items() for a, b in spans]
    except (TypeError, ValueError):
        return {}
    return merge_ranges(i for i in items if isinstance(i[0], str) and i[2] > 0)


def covers(record: dict[str, object], share: Share) -> bool:
    """Whether the copy ``record`` describes holds every byte of ``share``."""
    held = _recorded_ranges(record)
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
) -> ShareFill:
    """What to pull into ``copy`` (a step directory, a partial copy or not there yet) for
    the share of ``layout`` or ``items`` (neither: the whole step). One answer, so a
    caller plans a share, reads the copy's record and widens in one place."""
    share = None
    if layout is not None or items is not None:
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
    held = _recorded_ranges(record)
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
