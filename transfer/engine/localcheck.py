"""Is a local directory an exact copy of a committed checkpoint? (Hash every chunk.)"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from transfer.engine.parts import merge_parts
from transfer.engine.resolver import read_local_chunk
from transfer.format.manifest import FileEntry, Manifest


def _differences(root: Path, manifests: list[Manifest]) -> list[str]:
    return file_differences(root, [entry for entry, _ in merge_parts(manifests)])


def file_differences(root: Path, files: list[FileEntry]) -> list[str]:
    """One line per file of ``files`` that ``root`` does not hold with identical bytes
    (the first chunk that differs ends a file's check: one of a different checkpoint
    costs a chunk per file, not a read of it all)."""
    problems = []
    for entry in files:
        path = root / entry.path  # validated relative path
        try:
            size = os.stat(path, follow_symlinks=False).st_size
        except OSError:
            problems.append(f"{entry.path}: missing")
            continue
        if size != entry.size:
            problems.append(f"{entry.path}: {size} bytes, expected {entry.size}")
            continue
        for offset, chunk in entry.chunk_offsets():
            if read_local_chunk(root, entry.path, offset, chunk.size, chunk.id) is None:
                problems.append(f"{entry.path}: bytes at offset {offset} differ")
                break
    return problems


async def local_copy_differences(root: Path, manifests: list[Manifest]) -> list[str]:
    """Empty when ``root`` holds every file of the checkpoint with identical bytes (extra
    local files are allowed); otherwise one line per problem."""
    return await asyncio.to_thread(_differences, root, manifests)
