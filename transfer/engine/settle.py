"""Restores renamed into place before they reach the disk, and how they get there safely.

Why: a pull used to fsync every file before renaming its staging directory into place. On
a fresh restore most of the checkpoint is still dirty page cache at that point, so the
caller waited for all of it to reach the disk after the download was done; plain copy
tools (s5cmd, cp) do not wait. A restore is a copy of a checkpoint the store still holds:
a crash may cost a re-fetch, never data. What must never happen is a torn copy that looks
whole after a reboot.

The rule (docs/RELIABILITY.md, "Restores and crashes"):
1. Before the rename, a marker ``.<name>.ferry-unsynced`` holding this boot's id is made
   durable beside the destination (fsync of the marker and of the directory).
2. The rename; the kernel writes the data back on its own (writeback was started as each
   chunk landed: transfer/engine/writeback.py).
3. ``settle(parent)`` later looks at every marker there. Same boot: the pages are either on
   disk or still in memory, so fsync the restore's files (cheap by then) and drop the marker.
   Another boot: the machine went down before step 3, maybe before the kernel wrote the
   restore back, maybe long after (a clean reboot, days later). The marker of a whole
   restore names every chunk (where it lies, its content id), so the restore is read back
   and checked: whole, it is kept; torn (or a share, whose marker names no chunks, or an
   unreadable marker), it is removed (renamed to a staging name first, so an interrupted
   removal is swept like any staging directory), or, for ``ferry pull``, whose destination
   is the user's and may hold the user's own files by then, moved aside to
   ``<name>.torn[-N]`` and said so. Its marker is dropped either way.
The agent settles its hot dir before it serves and after each prefetch; ``ferry pull``
settles the destination's parent before it starts. Without a boot id (not Linux) a pull
fsyncs before the rename, as ``--fsync`` asks.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transfer.durable import fsync_dir
from transfer.engine.resolver import read_file_verified
from transfer.engine.restorenames import UNSYNCED_MARK, marker_path, staging_path
from transfer.errors import FormatError
from transfer.format.chunkid import is_chunk_id
from transfer.format.manifest import MAX_CHUNK_BYTES, FileEntry
from transfer.format.paths import check_relative_path

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str | None:
    try:
        return _BOOT_ID.read_text().strip() or None
    except OSError:
        return None


#: the most chunks a marker names (~90 bytes each); a restore of more is not checked
#: after a reboot but removed, as a share is
MAX_MARKED_CHUNKS = 1_000_000


@dataclass(frozen=True)
class Settled:
    """A restore made before the last reboot, found by ``settle``: ``whole`` (checked and
    kept), else removed, or moved to ``moved_to``; ``why`` says what was found."""

    dest: Path
    whole: bool
    moved_to: Path | None
    why: str


def mark_unsynced(dest: Path, boot: str, files: list[FileEntry] | None = None) -> None:
    """Step 1: the durable marker for a restore about to be renamed into ``dest``;
    ``files``: what a whole restore holds, every chunk named so that a settle after a
    reboot can check it (None: a share, which holds only some of its files' bytes)."""
    marker = marker_path(dest)
    tmp = marker.with_name(f"{marker.name}.tmp-{secrets.token_hex(4)}")
    doc: dict[str, object] = {"boot_id": boot, "dest": dest.name, "created": time.time()}
    if files is not None and sum(len(f.chunks) for f in files) <= MAX_MARKED_CHUNKS:
        doc["chunks"] = {f.path: [[at, c.size, c.id] for at, c in f.chunk_offsets()] for f in files}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, json.dumps(doc).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, marker)
    fsync_dir(dest.parent)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and root itself)."""
    for here, dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(here, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(here))
        del dirs  # walked by os.walk itself


def fsync_files(root: Path, paths: list[str]) -> None:
    """fsync the files ``paths`` (relative, validated) under ``root``, never through a
    link, then their directories up to ``root`` and root's parent: those files durable,
    and nothing else of the directory touched."""
    dirs = {root, root.parent}
    for rel in paths:
        path = root / rel
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        dirs.update(p for p in path.parents if p == root or root in p.parents)
    for directory in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
        fsync_dir(directory)


def settle(
    parent: Path, move_torn: bool = False, before_check: Callable[[Path], None] | None = None
) -> list[Settled]:
    """Step 3 for every restore under ``parent`` that still has a marker. Returns what it
    found of restores made before the last reboot. ``move_torn`` (``ferry pull``: a
    directory that is the user's): each is read back and checked (``before_check`` told
    first: it may take a while), kept when whole, else moved aside. Without it (the
    agent's hot dir, swept before it serves: a check of many GB would keep it from
    answering its health checks) each is removed, as a re-fetch is all it costs."""
    found: list[Settled] = []
    try:
        markers = [p for p in parent.iterdir() if p.name.endswith(UNSYNCED_MARK)]
    except FileNotFoundError:
        return found
    current = boot_id()
    for marker in markers:
        dest = parent / marker.name[1 : -len(UNSYNCED_MARK)]
        try:
            doc = _read_marker(marker)
            made_in = doc.get("boot_id")
        except FileNotFoundError:
            continue  # another settle of this directory (a prefetch beside) dropped it first
        except (OSError, ValueError, AttributeError):
            doc, made_in = {}, None  # unreadable: assume the worst
        if dest.is_dir() and not dest.is_symlink():
            if made_in is not None and made_in == current:
                try:
                    fsync_tree(dest)
                except FileNotFoundError:
                    continue  # being evicted right now: its eviction drops it
            elif not move_torn:
                found.append(_remove(dest, "made before the last reboot (not checked here)"))
            else:
                if before_check is not None:
                    before_check(dest)
                try:
                    found.append(_after_reboot(dest, doc, move_torn))
                except FileNotFoundError:
                    continue  # another settle of this directory (a pull beside) took it
        marker.unlink(missing_ok=True)
        fsync_dir(parent)
    return found


def _after_reboot(dest: Path, doc: dict[str, Any], move_torn: bool) -> Settled:
    """A restore renamed into place before the last reboot: checked against the chunks
    its marker names, kept when whole (or changed by its user since: theirs now); else
    moved aside (``move_torn``) or removed."""
    why = _torn(dest, doc.get("chunks"))
    changed = why is not None and _changed_since(dest, doc)
    if why is None or changed:
        fsync_tree(dest)
        said = "every chunk read back and checked" if why is None else (
            "files in it changed since it was restored: kept as they are")  # fmt: skip
        return Settled(dest, True, None, said)
    if move_torn:
        aside = _free_name(dest.with_name(f"{dest.name}.torn"))
        os.rename(dest, aside)
        fsync_dir(dest.parent)
        return Settled(dest, False, aside, why)
    return _remove(dest, why)


def _remove(dest: Path, why: str) -> Settled:
    doomed = staging_path(dest, "unsynced-")
    os.rename(dest, doomed)
    fsync_dir(dest.parent)
    shutil.rmtree(doomed, ignore_errors=True)
    return Settled(dest, False, None, why)


def _changed_since(dest: Path, doc: dict[str, Any]) -> bool:
    """Whether a file of ``dest`` was written after the marker was (its user's edit)."""
    created = doc.get("created")
    if not isinstance(created, (int, float)):
        return False
    try:
        return any(p.stat().st_mtime > created + 1 for p in dest.rglob("*") if p.is_file())
    except OSError:
        return False


def _torn(dest: Path, chunks: object) -> str | None:
    """What is wrong with ``dest`` against the chunks named (None: every one is there).
    A marker is this node's own, but read as if not: anything malformed is "cannot be
    checked", never a reason to allocate or read without bound."""
    if not isinstance(chunks, dict):
        return "its marker names no chunks to check it by (a share, or a marker unread)"
    for rel, spans in chunks.items():
        if not isinstance(spans, list) or not all(_a_span(s) for s in spans):
            return f"its marker's record of {rel!r} is malformed: cannot be checked"
        try:
            path = dest / check_relative_path(rel)
        except FormatError as exc:
            return f"{rel}: {exc}"
        for at, size, cid in spans:
            if read_file_verified(path, at, size, cid) is None:
                return f"{rel}: the chunk at byte {at} is not what was restored"
    return None


def _a_span(span: object) -> bool:
    """[offset, size, chunk id], as mark_unsynced writes it."""
    if not isinstance(span, list) or len(span) != 3:
        return False
    at, size, cid = span
    return (
        type(at) is int and at >= 0 and type(size) is int and 0 < size <= MAX_CHUNK_BYTES
        and is_chunk_id(cid)
    )  # fmt: skip


#: the most of a marker read (one naming MAX_MARKED_CHUNKS chunks: ~93 MB)
MAX_MARKER_BYTES = 128 << 20


def _read_marker(marker: Path) -> dict[str, Any]:
    with marker.open("rb") as f:
        raw = f.read(MAX_MARKER_BYTES + 1)
    if len(raw) > MAX_MARKER_BYTES:
        return {}  # (over the limit: unreadable, as a torn one)
    doc = json.loads(raw)
    return doc if isinstance(doc, dict) else {}


def _free_name(wanted: Path) -> Path:
    """``wanted``, or ``wanted-2``, ``-3``... whichever does not exist yet."""
    n, path = 1, wanted
    while path.exists() or path.is_symlink():
        n += 1
        path = wanted.with_name(f"{wanted.name}-{n}")
    return path
