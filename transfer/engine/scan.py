"""Reading a checkpoint directory: which files, their bytes at fixed chunk offsets, and
whether they stayed the same while a push read them."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from transfer.errors import FerryError, SourceChangedError
from transfer.format.paths import check_relative_path


@dataclass(frozen=True, slots=True)
class SourceFile:
    path: str  # relative, POSIX
    abspath: Path
    size: int
    mode: int
    # what the file was when scanned: a writer that replaces it (new inode) or writes into
    # it (mtime) or grows/truncates it (size) shows up in a second stat
    mtime_ns: int = 0
    inode: int = 0


def check_checkpoint_dir(root: Path) -> None:
    """The directory to push must be one (said before anything else is asked of it: a
    typo'd path was told "cannot tell the step", and then, with --step, that it is none)."""
    if not root.is_dir():
        raise FerryError(f"checkpoint directory {root} does not exist or is not a directory")


def scan_checkpoint(root: Path) -> list[SourceFile]:
    """Every regular file under ``root``, sorted by path. Symlinks and devices are refused:
    a checkpoint is plain data, and following links could read outside it."""
    check_checkpoint_dir(root)
    found: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in [*filenames, *dirnames]:
            full = Path(dirpath, name)
            try:
                st = full.lstat()
            except FileNotFoundError:
                raise _vanished(full, "scanned") from None
            rel = full.relative_to(root).as_posix()
            if stat.S_ISLNK(st.st_mode):
                raise FerryError(f"{full}: symbolic links are not supported in a checkpoint")
            if stat.S_ISDIR(st.st_mode):
                continue
            found.append(_source_file(full, rel, st))
    found.sort(key=lambda f: f.path)
    return found


def scan_files(root: Path, paths: frozenset[str]) -> list[SourceFile]:
    """The files ``paths`` names under ``root``, sorted by path, each a regular file (one
    node's own files in a directory that holds others' too); a path not there is left out."""
    check_checkpoint_dir(root)
    found = []
    for rel in sorted(paths):
        full = root / check_relative_path(rel)
        try:
            st = full.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise FerryError(f"{full}: symbolic links are not supported in a checkpoint")
        found.append(_source_file(full, rel, st))
    return found


def _source_file(full: Path, rel: str, st: os.stat_result) -> SourceFile:
    if not stat.S_ISREG(st.st_mode):
        raise FerryError(f"{full}: not a regular file")
    return SourceFile(
        check_relative_path(rel), full, st.st_size, st.st_mode & 0o777, st.st_mtime_ns, st.st_ino
    )


def check_unchanged(root: Path, sources: list[SourceFile], *, only: bool = False) -> None:
    """Raise SourceChangedError unless ``root`` still holds exactly ``sources``, each with
    the size, mtime and inode it had when scanned. Call it after the last read: what was
    read is then what is on disk. ``only``: files beside ``sources`` are not theirs to
    judge (one node's own files, which others' were added beside)."""
    if only:
        now = {f.path: f for f in scan_files(root, frozenset(f.path for f in sources))}
    else:
        now = {f.path: f for f in scan_checkpoint(root)}
    for f in sources:
        cur = now.pop(f.path, None)
        if cur is None:
            raise _vanished(f.abspath, "read")
        if cur.inode != f.inode:
            raise SourceChangedError(f"{f.abspath} was replaced while it was being pushed")
        if cur.size != f.size:
            raise SourceChangedError(
                f"{f.abspath} changed size while it was being pushed ({f.size} -> {cur.size}"
                " bytes): still being written?"
            )
        if cur.mtime_ns != f.mtime_ns:
            raise SourceChangedError(f"{f.abspath} was written to while it was being pushed")
    if now:
        raise SourceChangedError(f"{min(now)} appeared in {root} while it was being pushed")


def read_range(path: Path, offset: int, length: int) -> bytearray:
    """Exactly ``length`` bytes at ``offset`` (a file shrinking under us is an error)."""
    out = bytearray(length)
    fd = open_source(path)
    try:
        with memoryview(out) as view:
            got = 0
            while got < length:
                n = os.preadv(fd, [view[got:]], offset + got)
                if not n:
                    raise shrank(path)
                got += n
        return out
    finally:
        os.close(fd)


def open_source(path: Path) -> int:
    """A file descriptor of a checkpoint file the push reads (its one error if deleted)."""
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise _vanished(path, "read") from None


def shrank(path: Path) -> SourceChangedError:
    return SourceChangedError(f"{path} shrank while it was being read (still being written?)")


def _vanished(path: Path, doing: str) -> SourceChangedError:
    """A file of the checkpoint deleted under the push (it was there when scanned): one
    line naming it, not the bare ``[Errno 2]``; the push commits nothing."""
    return SourceChangedError(
        f"{path} vanished while the push {doing} it: the checkpoint changed under the push "
        "(deleted by training or retention?); nothing was committed"
    )


def check_base_dir(base_dir: Path | None) -> None:
    """A base directory named on purpose must be one: a typo must not pass for "nothing
    in it to reuse" (it did: "0 chunks reused", exit 0)."""
    if base_dir is not None and not base_dir.is_dir():
        raise FerryError(f"base directory {base_dir} does not exist or is not a directory")
