"""The manifests a reader of some bytes of a complete step needs, by its completion marker.

The marker's file map names the part holding each file, and its common index
(format/stepcommon.py) where the items every rank reads are stored. A reader that wants
``needs`` (path -> the ranges it wants, None for the whole file) reads the parts holding
the files the index does not cover, and takes the rest from the index: a survivor of an
N-node job reads the few parts its own ranks' rows are in, not N.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from transfer.engine.catalog import Catalog
from transfer.engine.dcpshare import overlaps
from transfer.format.manifest import FileEntry, Manifest
from transfer.format.stepcommon import COMMON_NODE, covered, made_from, restricted
from transfer.format.stepfiles import StepFiles

log = logging.getLogger(__name__)

Spans = tuple[tuple[int, int], ...]
#: path -> the byte ranges wanted of it (sorted, merged); None: the whole file
Needs = Mapping[str, Spans | None]


async def parts_for(
    catalog: Catalog, job: str, step: int, files: StepFiles, needs: Needs
) -> list[Manifest]:
    """The parts holding ``needs``' files, by the map, with the common index (restricted to
    the files it serves, last) standing in for the parts whose files it covers. A file a
    part read anyway holds is taken from that part; and when a part read is not the one
    the index was made from (re-pushed, copied over another save, repacked), the index is
    not used: the parts it stood in for are read too. Paths the map lacks are ignored: the
    caller checks what it read."""
    served = _served_by_index(files.common, needs)
    nodes = files.nodes_holding(p for p in needs if p not in served)
    manifests = await catalog.manifests_of(job, step, sorted(nodes))
    if not served or files.common is None:
        return manifests
    if not manifests or not made_from(files.common, manifests):  # (none: nothing vouches)
        if manifests:
            why = "its marker's common index was made from other parts than the store holds"
            log.warning("%s step %s: %s now; reading the parts instead", job, step, why)
        rest = files.nodes_holding(served) - nodes
        return manifests + await catalog.manifests_of(job, step, sorted(rest))
    held = {f.path for m in manifests for f in m.files}
    served = [p for p in served if p not in held]  # (a file two parts hold: the part's)
    return manifests + ([restricted(files.common, served)] if served else [])


def _served_by_index(index: Manifest | None, needs: Needs) -> list[str]:
    if index is None:
        return []
    entries = {f.path: f for f in index.files}
    return [
        path
        for path, spans in needs.items()
        if spans and path in entries and _within(spans, covered(entries[path]))
    ]


def _within(spans: Spans, have: Spans) -> bool:
    return all(overlaps(have, lo, hi) == [(lo, hi)] for lo, hi in spans)


def needs_of(entries: Iterable[FileEntry]) -> dict[str, Spans | None]:
    """What a reader of ``entries`` (another step's, at the same paths) wants of them: a
    file known whole, whole; one known in part (the index's), the ranges it is known in."""
    return {f.path: None if f.starts is None else covered(f) for f in entries}


def index_chunks(manifests: Iterable[Manifest]) -> frozenset[str]:
    """The ids of the chunks a restore of ``manifests`` would take from a marker's common
    index (parts_for): a missing or bad one among them may mean the index is stale."""
    return frozenset(c.id for m in manifests if m.node == COMMON_NODE for c in m.all_chunks())
