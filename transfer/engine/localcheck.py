"""Is a local directory an exact copy of a committed checkpoint? (Hash every chunk.)"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

from transfer.engine.parts import merge_parts
from transfer.engine.resolver import read_local_chunk
from transfer.format.manifest import FileEntry, Manifest


def _differences(root: Path, manifests: list[Manifest]) -> list[str]:
    return file_differences(root, [entry for entry, _ in merge_parts(manifests)])


def file_differences(
    root: Path,
    files: list[FileEntry],
    stop: threading.Event | None = None,
    *,
    whole_or_nothing: bool = False,
) -> list[str]:
    """One line per file of ``files`` that ``root`` does not hold with identical bytes.
    Every file's presence and size is looked at before any byte is read, and the first
    chunk that differs ends a file's check (a directory of another checkpoint costs a
    chunk per file, not a read of it all). ``whole_or_nothing``: no byte is read once a
    file is missing or of another size (a directory holding part of the step costs a stat
    per file). ``stop`` set: it returns after the chunk it is on (what it found so far)."""
    problems = []
    sized = []
    for entry in files:
        try:
            size = os.stat(root / entry.path, follow_symlinks=False).st_size  # validated path
        except OSError:
            problems.append(f"{entry.path}: missing")
            continue
        if size != entry.size:
            problems.append(f"{entry.path}: {size} bytes, expected {entry.size}")
        else:
            sized.append(entry)
    if problems and whole_or_nothing:
        return problems
    for entry in sized:
        for offset, chunk in entry.chunk_offsets():
            if stop is not None and stop.is_set():
                return problems
            if read_local_chunk(root, entry.path, offset, chunk.size, chunk.id) is None:
                problems.append(
                    f"{entry.path}: the chunk at offsets {offset}-{offset + chunk.size} differs"
                )
                break
    return problems


async def local_copy_differences(root: Path, manifests: list[Manifest]) -> list[str]:
    """Empty when ``root`` holds every file of the checkpoint with identical bytes (extra
    local files are allowed); otherwise one line per problem."""
    return await asyncio.to_thread(_differences, root, manifests)
