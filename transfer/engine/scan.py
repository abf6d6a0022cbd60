"""Reading a checkpoint directory: which files, and their bytes at fixed chunk offsets."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from transfer.errors import FerryError
from transfer.format.paths import check_relative_path


@dataclass(frozen=True, slots=True)
class SourceFile:
    path: str  # relative, POSIX
    abspath: Path
    size: int
    mode: int


def scan_checkpoint(root: Path) -> list[SourceFile]:
    """Every regular file under ``root``, sorted by path. Symlinks and devices are refused:
    a checkpoint is plain data, and following links could read outside it."""
    if not root.is_dir():
        raise FerryError(f"checkpoint directory {root} does not exist or is not a directory")
    found: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in [*filenames, *dirnames]:
            full = Path(dirpath, name)
            st = full.lstat()
            rel = full.relative_to(root).as_posix()
            if stat.S_ISLNK(st.st_mode):
                raise FerryError(f"{full}: symbolic links are not supported in a checkpoint")
            if stat.S_ISDIR(st.st_mode):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise FerryError(f"{full}: not a regular file")
            found.append(SourceFile(check_relative_path(rel), full, st.st_size, st.st_mode & 0o777))
    found.sort(key=lambda f: f.path)
    return found


def read_range(path: Path, offset: int, length: int) -> bytes:
    """Exactly ``length`` bytes at ``offset`` (a file shrinking under us is an error)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        out = bytearray()
        while len(out) < length:
            piece = os.pread(fd, length - len(out), offset + len(out))
            if not piece:
                raise FerryError(f"{path} shrank while it was being read (still being written?)")
            out += piece
        return bytes(out)
    finally:
        os.close(fd)
