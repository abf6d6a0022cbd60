"""The completion marker's file map: which part holds each file of a complete step.

A survivor of a scale-down needs the few storage files its new ranks read, and the parts
that hold them are a handful of the step's N. Without a map it must read all N manifests
to find them (N per survivor, N x survivors per scale-down). The node that completes the
step has just read every part (engine/parts.py ``check_step_whole``), so it writes the
map into the marker at no extra request, and a reader of a share loads only the manifests
of the parts its share touches (engine/share.py ``resolve_share``).

``"files": [[path, size, node], ...]``, sorted by path, one entry per path: a file several
parts hold identically (a replicated ``.metadata``) is named under the first of them in
node order. Optional: markers written before 2026-12-06 have none, nor do markers of
steps with more than MAX_MAPPED_FILES files; their readers read every part.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from transfer.errors import FormatError
from transfer.format.manifest import Manifest
from transfer.format.names import check_name
from transfer.format.paths import check_relative_path

#: beyond this many files a step's marker carries no map (a reader reads every part)
MAX_MAPPED_FILES = 1_000_000
#: a marker larger than this is not read for its map (a million files' map is ~60 MB)
MAX_MARKER_BYTES = 128 << 20


@dataclass(frozen=True)
class StepFiles:
    """A complete step's files: path -> (the node whose part holds it, its size); and the
    marker's common index as a manifest (format/stepcommon.py), when it has a sound one."""

    files: dict[str, tuple[str, int]]
    common: Manifest | None = None

    def nodes_holding(self, paths: Iterable[str]) -> set[str]:
        """The parts to read for ``paths`` (paths the map lacks are ignored: the caller
        checks what it read)."""
        return {self.files[p][0] for p in paths if p in self.files}


def file_map(entries: Iterable[tuple[str, int, str]]) -> list[list[Any]] | None:
    """The marker's ``files`` for (path, size, node) entries, one per path; None over the
    limit (the marker then carries no map)."""
    rows = sorted([path, size, node] for path, size, node in entries)
    return rows if len(rows) <= MAX_MAPPED_FILES else None


def parse_file_map(doc: object) -> StepFiles | None:
    """The map of a parsed marker, None when it has none; FormatError when it is there and
    malformed (a path that escapes the step, a node the marker does not name, a repeat)."""
    if not isinstance(doc, dict) or "files" not in doc:
        return None
    rows, nodes = doc["files"], doc.get("nodes")
    if not isinstance(rows, list) or len(rows) > MAX_MAPPED_FILES:
        raise FormatError("the completion marker's files is not a list of at most "
                          f"{MAX_MAPPED_FILES:,} entries")  # fmt: skip
    if not isinstance(nodes, list):
        raise FormatError("the completion marker names files but no nodes")
    known = {check_name("node", n) for n in nodes}
    files: dict[str, tuple[str, int]] = {}
    for row in rows:
        if not (isinstance(row, list) and len(row) == 3):
            raise FormatError(f"completion marker file entry {row!r}: expected [path, size, node]")
        path, size, node = row
        check_relative_path(path)
        check_name("node", node)
        if type(size) is not int or size < 0:
            raise FormatError(f"completion marker: {path} has size {size!r}")
        if node not in known:
            raise FormatError(f"completion marker: {path} is held by {node}, not one of its nodes")
        if path in files:
            raise FormatError(f"completion marker: {path} is named twice")
        files[path] = (node, size)
    return StepFiles(files)
