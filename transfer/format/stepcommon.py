"""The completion marker's common index: where the bytes every rank reads are stored.

DCP writes each replicated item (optimizer step counters, param_groups, tensors saved
whole) once and spreads them over every rank's file. So after a resize every survivor's
share touches every storage file, and a reader that finds each file's chunks in its
owner's manifest reads all N manifests: N per survivor, N x N per resize. The node that
writes the completion marker has every part's manifest in hand and the step's
``.metadata``, so it writes into the marker the chunks covering those items
(engine/parts.py ``completion_doc``), and a survivor reads one marker instead of N parts
for them (engine/stepparts.py).

``"common": {"parts": {node: digest}, "packs": [...], "bases": [chunk, ...], "files":
[{"path", "mode", "runs": [[start, [chunk, ...]], ...]}, ...]}``: ``parts`` the SHA-256 of
each part's manifest as stored (``Manifest.digest``), chunks as in a manifest (``pack`` an
index into this ``packs``), each run the chunks that follow each other from ``start``,
``bases`` the delta bases they need that no run holds (a manifest's rule). An index, never
the record: a reader takes from it only files whose wanted ranges its runs cover and
whose parts it reads no other way, checks it as it checks a manifest, uses it only when
every part it does read is the one the index was made from (a re-pushed, copied or
repacked part is not), and reads the parts when it is absent, malformed or stale.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from transfer.errors import FormatError
from transfer.format.layout import check_pack_id
from transfer.format.manifest import (
    MANIFEST_VERSION,
    MAX_CHUNK_BYTES,
    MAX_FILE_BYTES,
    ChunkRef,
    FileEntry,
    Manifest,
    chain_depths,
    chunk_doc,
    int_field,
    parse_chunk,
)
from transfer.format.paths import check_relative_path

#: the marker key holding the index
COMMON_KEY = "common"
#: the node name of the manifest a reader makes of the index, and how it is told from the
#: parts (no part can have it: names of nodes cannot hold parentheses)
COMMON_NODE = "(common index)"
#: beyond this many chunks the marker carries no index (its readers read the parts): ~5 MB
#: of JSON, parsed by every reader of the step's map
MAX_COMMON_CHUNKS = 20_000


#: (path, mode, start, chunk, the manifest whose packs the chunk's ``pack`` indexes)
Placed = tuple[str, int, int, ChunkRef, Manifest]


def common_doc(parts: Sequence[Manifest], placed: Iterable[Placed]) -> dict[str, Any] | None:
    """The index of ``placed`` chunks (each file's in offset order) of the step whose parts
    are ``parts``; None when there are none, more than MAX_COMMON_CHUNKS or more than half
    the step's chunks (a save whose tensors are all whole: reading its parts costs about
    what the index would). The same chunk id held by two parts is written once, with the
    first part's location and base chain."""
    placed = list(placed)
    step_chunks = sum(len(f.chunks) for m in parts for f in m.files)
    if not placed or len(placed) > min(MAX_COMMON_CHUNKS, step_chunks // 2):
        return None
    digests = {m.node: m.digest for m in parts}  # (of their stored bytes)
    if None in digests.values():  # (parts not read from the store: nothing to vouch by)
        return None
    packs: dict[str, int] = {}
    records: dict[str, dict[str, Any]] = {}  # chunk id -> its record, in this doc's packs

    def record(c: ChunkRef, owner: Manifest) -> dict[str, Any]:
        if c.id not in records:
            doc = chunk_doc(c)
            doc["pack"] = packs.setdefault(owner.packs[c.pack], len(packs))
            records[c.id] = doc
        return records[c.id]

    files: dict[str, dict[str, Any]] = {}
    ends: dict[str, int] = {}
    owners: dict[str, Manifest] = {}
    for path, mode, start, c, owner in placed:
        entry = files.setdefault(path, {"path": path, "mode": mode, "runs": []})
        if not entry["runs"] or ends[path] != start:
            entry["runs"].append([start, []])
        entry["runs"][-1][1].append(record(c, owner))
        ends[path] = start + c.size
        owners.setdefault(c.id, owner)
    bases: list[dict[str, Any]] = []
    chunks_of: dict[int, dict[str, ChunkRef]] = {}  # id(part) -> its chunks by id
    for cid in list(records):  # each delta's chain, from its own part's bases table
        owner = owners[cid]
        if id(owner) not in chunks_of:
            chunks_of[id(owner)] = {b.id: b for b in owner.all_chunks()}
        base = records[cid].get("base")
        while base is not None and base not in records:
            ref = chunks_of[id(owner)][base]
            bases.append(record(ref, owner))
            base = ref.base
    return {"parts": digests, "packs": list(packs), "bases": bases, "files": list(files.values())}


def parse_common(
    doc: object, job: str, step: int, sizes: Mapping[str, int], created_at: str
) -> Manifest:
    """The index as a manifest a restore reads like any part (node COMMON_NODE, each file
    known only where its runs are: FileEntry.starts). ``sizes``: each file's size by the
    marker's file map, which must name every file the index does. FormatError naming the
    first problem."""
    if not isinstance(doc, dict):
        raise FormatError("the common index is not an object")
    digests = doc.get("parts")
    if not isinstance(digests, dict) or not all(
        isinstance(v, str) and len(v) == 64 for v in digests.values()
    ):
        raise FormatError("the common index names no parts it was made from")
    packs_doc, bases_doc, files_doc = doc.get("packs"), doc.get("bases"), doc.get("files")
    if not (isinstance(packs_doc, list) and isinstance(bases_doc, list)):
        raise FormatError("the common index needs lists 'packs' and 'bases'")
    if not isinstance(files_doc, list):
        raise FormatError("the common index needs a list 'files'")
    packs = tuple(check_pack_id(p) for p in packs_doc)
    count = [0]
    files = tuple(_parse_file(f, len(packs), sizes, count) for f in files_doc)
    if len({f.path for f in files}) != len(files):
        raise FormatError("the common index names a file twice")
    bases = tuple(parse_chunk(c, "common index bases", len(packs), MANIFEST_VERSION)
                  for c in bases_doc)  # fmt: skip
    chunk_size = max((c.size for f in files for c in f.chunks), default=1)
    extra = {COMMON_KEY: {str(node): d for node, d in digests.items()}}
    index = Manifest(job, step, COMMON_NODE, created_at, chunk_size, packs, files, bases, extra)
    chain_depths(index)  # every base resolves, no cycles, bounded chains
    return index


def made_from(index: Manifest, read: Iterable[Manifest]) -> bool:
    """Whether every part in ``read`` is the one ``index`` was made from."""
    digests = index.extra[COMMON_KEY]
    return all(m.digest is not None and digests.get(m.node) == m.digest for m in read)


def _parse_file(
    fdoc: object, n_packs: int, sizes: Mapping[str, int], count: list[int]
) -> FileEntry:
    if not isinstance(fdoc, dict):
        raise FormatError("a common index file is not an object")
    path = check_relative_path(fdoc.get("path"))
    where = f"common index file {path!r}"
    if path not in sizes:
        raise FormatError(f"{where}: the marker's file map does not name it")
    size = sizes[path]
    mode = int_field(fdoc, "mode", where, 0, 0o7777) & 0o777
    runs = fdoc.get("runs")
    if not isinstance(runs, list) or not runs:
        raise FormatError(f"{where}: 'runs' must be a non-empty list")
    starts: list[int] = []
    chunks: list[ChunkRef] = []
    end = 0
    for run in runs:
        if not (isinstance(run, list) and len(run) == 2 and isinstance(run[1], list) and run[1]):
            raise FormatError(f"{where}: a run is not [start, [chunk, ...]] with a chunk")
        start = run[0]
        if type(start) is not int or not 0 <= start <= MAX_FILE_BYTES:
            raise FormatError(f"{where}: a run starts at {start!r}")
        if start < end:
            raise FormatError(f"{where}: a run starts at {start}, before the last one ended")
        for c in run[1]:
            ref = parse_chunk(c, where, n_packs, MANIFEST_VERSION)
            if not 0 < ref.size <= MAX_CHUNK_BYTES:
                raise FormatError(f"{where}: a chunk of {ref.size} bytes")
            starts.append(start)
            chunks.append(ref)
            start += ref.size
        end = start
        count[0] += len(run[1])
    if end > size:
        raise FormatError(f"{where}: its runs end at {end}, past its {size} bytes")
    if count[0] > MAX_COMMON_CHUNKS:
        raise FormatError(f"more than {MAX_COMMON_CHUNKS:,} chunks")
    return FileEntry(path, size, mode, tuple(chunks), starts=tuple(starts))


def covered(entry: FileEntry) -> tuple[tuple[int, int], ...]:
    """The byte ranges of ``entry`` its chunks describe, merged (all of it, for a whole
    file's entry)."""
    spans: list[tuple[int, int]] = []
    for start, c in entry.chunk_offsets():
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], start + c.size)
        else:
            spans.append((start, start + c.size))
    return tuple(spans)


def restricted(index: Manifest, paths: Sequence[str]) -> Manifest:
    """The index with only the files ``paths`` (their bases all kept: harmless)."""
    keep = set(paths)
    files = tuple(f for f in index.files if f.path in keep)
    return dataclasses.replace(index, files=files)
