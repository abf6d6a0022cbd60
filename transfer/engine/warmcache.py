"""Leave a restore in the page cache for the load that follows, without writing it there.

Why (issue 32): what comes after a prefetch or a pull is the training process loading the
checkpoint. A restore written with O_DIRECT is on the disk and not in memory, so the load
reads the disk again (289 MB fine-tune: 0.74 s from a cold cache against 0.24 s warm). A
buffered restore leaves it in memory, but the CPU then copies every byte into freshly
allocated pages: on VMs whose free memory goes back to the host (free page reporting:
this class of machine), each first touch of such a page faults into the host: 2.3 ms of
system time per MiB 3 s after the cache was dropped, 0.18 ms into pages just freed, while
the kernel's read-back costs ~0.25 ms either way (``python -m bench.page_cost``).
Asking the kernel to read each chunk back as soon as its O_DIRECT write has returned
(``posix_fadvise(POSIX_FADV_WILLNEED)``) fills the cache by DMA (the CPU only allocates the
pages) while the rest of the restore is still being fetched: the load then reads memory.
The bytes read back are the ones just written and verified (an O_DIRECT write drops any
cached copy of its range before it returns), so nothing unverified reaches the cache.

The kernel reads at most one readahead window per call (``max(read_ahead_kb,
max_sectors_kb)`` of the device: mm/readahead.c ``force_page_cache_ra``), so a range is
hinted a window at a time. Only data is hinted: a share's holes are skipped (read as
zeros, they would cost fresh pages for nothing).
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Iterable
from pathlib import Path

#: the smallest window a device reads per hint (the kernel's default readahead)
MIN_WINDOW = 128 << 10
_SYS_DEV = Path("/sys/dev/block")


def warm_range(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to read ``[offset, offset + length)`` of ``fd``'s file into the page
    cache, without waiting for it (a hint: an error is no reason to fail a restore)."""
    if not hasattr(os, "posix_fadvise"):  # (not Linux: nothing to ask)
        return
    step = _window(os.fstat(fd).st_dev)
    end = offset + length
    try:
        for at in range(offset, end, step):
            os.posix_fadvise(fd, at, min(step, end - at), os.POSIX_FADV_WILLNEED)
    except OSError:
        pass


def warm_files(paths: Iterable[Path]) -> int:
    """Hint every data range of ``paths`` into the page cache; the bytes hinted."""
    hinted = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile (evicted): nothing to warm
        try:
            for offset, length in data_ranges(fd):
                warm_range(fd, offset, length)
                hinted += length
        finally:
            os.close(fd)
    return hinted


def tree_files(root: Path) -> list[Path]:
    """The regular files under ``root`` (a step directory), symlinks left out."""
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]


def allocated_bytes(paths: Iterable[Path]) -> int:
    """What the files take on disk, and so in the page cache once warmed (holes not)."""
    total = 0
    for path in paths:
        try:
            total += os.stat(path, follow_symlinks=False).st_blocks * 512
        except OSError:
            continue
    return total


def data_ranges(fd: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of data in the file, holes left out (the whole file
    where the file system cannot say)."""
    size = os.fstat(fd).st_size
    ranges, at = [], 0
    try:
        while at < size:
            start = os.lseek(fd, at, os.SEEK_DATA)
            end = os.lseek(fd, start, os.SEEK_HOLE)
            ranges.append((start, end - start))
            at = end
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # (ENXIO: no data past ``at``) SEEK_DATA not known
            return [(0, size)]
    return ranges


@functools.cache
def _window(dev: int) -> int:
    """Bytes the kernel reads per hint on device ``dev`` (a partition's from its disk)."""
    node = _SYS_DEV / f"{os.major(dev)}:{os.minor(dev)}"
    for queue in (node / "queue", node / ".." / "queue"):
        try:
            kib = [int((queue / name).read_text()) for name in ("read_ahead_kb", "max_sectors_kb")]
        except (OSError, ValueError):
            continue
        return max(MIN_WINDOW, max(kib) << 10)
    return MIN_WINDOW
